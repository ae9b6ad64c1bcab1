//! mTLS round trips against a tiny in-process apid stand-in (tonic server with the generated
//! `MachineService` and COSI `State` servers, Ed25519 certificates from rcgen).

use super::*;
use crate::config::tests::talos_ed25519_label;
use crate::events::{EventPayload, event_any};
use crate::proto::cosi::resource::state_server::{State, StateServer};
use crate::proto::machine::machine_service_server::{MachineService, MachineServiceServer};
use crate::proto::talos::resource::definitions::enums::RuntimeMachineStage;
use crate::{CosiEventType, TalosEvent, Talosconfig};

use std::pin::Pin;
use std::sync::Mutex;

use futures::Stream;
use prost::Message as _;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

// ----- PKI -----

struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

fn new_ca() -> TestCa {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("ca key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "talos");
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    let cert = params.self_signed(&key).expect("ca cert");
    TestCa {
        issuer: rcgen::Issuer::new(params, key),
        pem: cert.pem(),
    }
}

/// (certificate PEM, PKCS#8 key PEM) signed by `ca`.
fn issue(ca: &TestCa, org: &str, sans: &[&str], server: bool) -> (String, String) {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("key");
    let sans: Vec<String> = sans.iter().map(|s| s.to_string()).collect();
    let mut params = rcgen::CertificateParams::new(sans).expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, org);
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![if server {
        rcgen::ExtendedKeyUsagePurpose::ServerAuth
    } else {
        rcgen::ExtendedKeyUsagePurpose::ClientAuth
    }];
    let cert = params.signed_by(&key, &ca.issuer).expect("cert");
    (cert.pem(), key.serialize_pem())
}

/// Client credentials the way a talosconfig delivers them: through YAML, base64 and the Talos
/// `ED25519 PRIVATE KEY` label.
fn talosconfig_credentials(ca_pem: &str, crt: &str, key: &str) -> TalosCredentials {
    let yaml = crate::config::tests::talosconfig_yaml(ca_pem, crt, &talos_ed25519_label(key));
    Talosconfig::from_yaml(&yaml)
        .unwrap()
        .current_context()
        .unwrap()
        .credentials()
        .unwrap()
}

// ----- fake apid -----

const BOOT_ID: &str = "5f0f1d7e-3c3c-4b0e-9e0a-6f6a4c1e2b11";

#[derive(Clone, Copy)]
struct FakeNode;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn unimplemented<T>() -> Result<T, Status> {
    Err(Status::unimplemented("not implemented by the fake node"))
}

fn machine_status_resource(version: &str, stage: RuntimeMachineStage) -> cosi_pb::Resource {
    let spec = runtime_pb::MachineStatusSpec {
        stage: stage as i32,
        status: Some(runtime_pb::MachineStatusStatus {
            ready: true,
            unmet_conditions: vec![],
        }),
    };
    cosi_pb::Resource {
        metadata: Some(cosi_pb::Metadata {
            namespace: resources::machine_status::NAMESPACE.into(),
            r#type: resources::machine_status::TYPE.into(),
            id: resources::machine_status::ID.into(),
            version: version.into(),
            phase: "running".into(),
            ..Default::default()
        }),
        spec: Some(cosi_pb::Spec {
            proto_spec: spec.encode_to_vec(),
            yaml_spec: String::new(),
        }),
    }
}

#[tonic::async_trait]
impl MachineService for FakeNode {
    async fn version(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::VersionResponse>, Status> {
        // Echo the `node` header as the platform name so tests can see proxying metadata arrive.
        let node = request
            .metadata()
            .get("node")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        Ok(Response::new(machine::VersionResponse {
            messages: vec![machine::Version {
                metadata: None,
                version: Some(machine::VersionInfo {
                    tag: "v1.10.3".into(),
                    sha: "abcdef0".into(),
                    arch: "amd64".into(),
                    os: "linux".into(),
                    ..Default::default()
                }),
                platform: Some(machine::PlatformInfo {
                    name: node.into(),
                    mode: "metal".into(),
                }),
                features: Some(machine::FeaturesInfo { rbac: true }),
            }],
        }))
    }

    async fn service_list(
        &self,
        _request: Request<()>,
    ) -> Result<Response<machine::ServiceListResponse>, Status> {
        // Never answers in time: exercises the request timeout.
        tokio::time::sleep(Duration::from_secs(30)).await;
        unimplemented()
    }

    async fn etcd_status(
        &self,
        _request: Request<()>,
    ) -> Result<Response<machine::EtcdStatusResponse>, Status> {
        Err(Status::unimplemented(
            "etcd is only available on control plane nodes",
        ))
    }

    async fn apply_configuration(
        &self,
        _request: Request<machine::ApplyConfigurationRequest>,
    ) -> Result<Response<machine::ApplyConfigurationResponse>, Status> {
        // An error reported inside the envelope, as apid does for a failing backend.
        Ok(Response::new(machine::ApplyConfigurationResponse {
            messages: vec![machine::ApplyConfiguration {
                metadata: Some(common::Metadata {
                    hostname: "10.0.0.5".into(),
                    error: "config validation failed".into(),
                    status: Some(crate::proto::google::rpc::Status {
                        code: tonic::Code::InvalidArgument as i32,
                        message: "config validation failed".into(),
                        details: vec![],
                    }),
                }),
                ..Default::default()
            }],
        }))
    }

    type EventsStream = BoxStream<machine::Event>;

    async fn events(
        &self,
        request: Request<machine::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        let actor = request.into_inner().with_actor_id;
        let event = |id: &str, data: Option<prost_types::Any>, actor: &str| machine::Event {
            metadata: None,
            data,
            id: id.into(),
            actor_id: actor.into(),
        };
        let seq = machine::SequenceEvent {
            sequence: "upgrade".into(),
            action: machine::sequence_event::Action::Start as i32,
            error: None,
        };
        let status = machine::MachineStatusEvent {
            stage: machine::machine_status_event::MachineStage::Running as i32,
            status: Some(machine::machine_status_event::MachineStatus {
                ready: true,
                unmet_conditions: vec![],
            }),
        };
        let unknown = prost_types::Any {
            type_url: "talos/runtime/machine.SomethingNew".into(),
            value: vec![],
        };
        let items = vec![
            Ok(event("hello", None, &actor)),
            Ok(event("e1", Some(event_any(&seq)), "actor-1")),
            Ok(event("e2", Some(unknown), "")),
            Ok(event("e3", Some(event_any(&status)), "")),
        ];
        let stream = futures::stream::iter(items);
        if actor == "keep-open" {
            // Like a real node: the stream stays open until the connection goes away.
            Ok(Response::new(Box::pin(
                stream.chain(futures::stream::pending()),
            )))
        } else {
            Ok(Response::new(Box::pin(stream)))
        }
    }

    async fn etcd_member_list(
        &self,
        _request: Request<machine::EtcdMemberListRequest>,
    ) -> Result<Response<machine::EtcdMemberListResponse>, Status> {
        unimplemented()
    }

    async fn etcd_forfeit_leadership(
        &self,
        _request: Request<machine::EtcdForfeitLeadershipRequest>,
    ) -> Result<Response<machine::EtcdForfeitLeadershipResponse>, Status> {
        unimplemented()
    }

    async fn image_pull(
        &self,
        _request: Request<machine::ImagePullRequest>,
    ) -> Result<Response<machine::ImagePullResponse>, Status> {
        unimplemented()
    }

    type ReadStream = BoxStream<common::Data>;

    async fn read(
        &self,
        request: Request<machine::ReadRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        if request.get_ref().path != BOOT_ID_PATH {
            return Err(Status::not_found("no such file"));
        }
        // Split across chunks, with the trailing newline the kernel file has.
        let (a, b) = BOOT_ID.split_at(10);
        let chunks = [a.to_string(), format!("{b}\n")].map(|c| {
            Ok(common::Data {
                metadata: None,
                bytes: c.into_bytes(),
            })
        });
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn reboot(
        &self,
        _request: Request<machine::RebootRequest>,
    ) -> Result<Response<machine::RebootResponse>, Status> {
        Ok(Response::new(machine::RebootResponse {
            messages: vec![machine::Reboot {
                metadata: None,
                actor_id: "reboot-actor".into(),
            }],
        }))
    }

    async fn rollback(
        &self,
        _request: Request<machine::RollbackRequest>,
    ) -> Result<Response<machine::RollbackResponse>, Status> {
        unimplemented()
    }

    async fn upgrade(
        &self,
        _request: Request<machine::UpgradeRequest>,
    ) -> Result<Response<machine::UpgradeResponse>, Status> {
        unimplemented()
    }

    // The reads `talosctl health`, `dmesg`, `logs` and `kubeconfig` make; the client does not call them.

    type DmesgStream = BoxStream<common::Data>;

    async fn dmesg(
        &self,
        _request: Request<machine::DmesgRequest>,
    ) -> Result<Response<Self::DmesgStream>, Status> {
        unimplemented()
    }

    type EtcdSnapshotStream = BoxStream<common::Data>;

    async fn etcd_snapshot(
        &self,
        _request: Request<machine::EtcdSnapshotRequest>,
    ) -> Result<Response<Self::EtcdSnapshotStream>, Status> {
        unimplemented()
    }

    type KubeconfigStream = BoxStream<common::Data>;

    async fn kubeconfig(
        &self,
        _request: Request<()>,
    ) -> Result<Response<Self::KubeconfigStream>, Status> {
        unimplemented()
    }

    type LogsStream = BoxStream<common::Data>;

    async fn logs(
        &self,
        _request: Request<machine::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        unimplemented()
    }

    async fn logs_containers(
        &self,
        _request: Request<()>,
    ) -> Result<Response<machine::LogsContainersResponse>, Status> {
        unimplemented()
    }

    async fn memory(
        &self,
        _request: Request<()>,
    ) -> Result<Response<machine::MemoryResponse>, Status> {
        unimplemented()
    }
}

#[tonic::async_trait]
impl State for FakeNode {
    async fn get(
        &self,
        request: Request<cosi_pb::GetRequest>,
    ) -> Result<Response<cosi_pb::GetResponse>, Status> {
        let req = request.into_inner();
        if req.r#type == resources::machine_status::TYPE && req.id == resources::machine_status::ID
        {
            let resource = machine_status_resource("4", RuntimeMachineStage::MachineStageRunning);
            return Ok(Response::new(cosi_pb::GetResponse {
                resource: Some(resource),
            }));
        }
        if req.r#type == resources::version::TYPE {
            return Err(Status::permission_denied(format!(
                "resource type {:?} is not supported",
                req.r#type
            )));
        }
        Err(Status::not_found(format!(
            "resource {} doesn't exist",
            req.id
        )))
    }

    type ListStream = BoxStream<cosi_pb::ListResponse>;

    async fn list(
        &self,
        _request: Request<cosi_pb::ListRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let items = ["1", "2"].map(|v| {
            Ok(cosi_pb::ListResponse {
                resource: Some(machine_status_resource(
                    v,
                    RuntimeMachineStage::MachineStageBooting,
                )),
            })
        });
        Ok(Response::new(Box::pin(futures::stream::iter(items))))
    }

    type WatchStream = BoxStream<cosi_pb::WatchResponse>;

    async fn watch(
        &self,
        _request: Request<cosi_pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let ev = |t: cosi_pb::EventType, v: &str, stage| cosi_pb::Event {
            resource: Some(machine_status_resource(v, stage)),
            event_type: t as i32,
            ..Default::default()
        };
        let items = vec![
            // "Watch established": no events.
            Ok(cosi_pb::WatchResponse { event: vec![] }),
            Ok(cosi_pb::WatchResponse {
                event: vec![ev(
                    cosi_pb::EventType::Created,
                    "5",
                    RuntimeMachineStage::MachineStageRebooting,
                )],
            }),
            // Two events in one response.
            Ok(cosi_pb::WatchResponse {
                event: vec![
                    ev(
                        cosi_pb::EventType::Updated,
                        "6",
                        RuntimeMachineStage::MachineStageBooting,
                    ),
                    ev(
                        cosi_pb::EventType::Updated,
                        "7",
                        RuntimeMachineStage::MachineStageRunning,
                    ),
                ],
            }),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(items))))
    }
}

/// Routes by gRPC service to the two generated servers (tonic's own router needs a feature we do
/// not enable).
#[derive(Clone)]
struct BothServices {
    machine: MachineServiceServer<FakeNode>,
    state: StateServer<FakeNode>,
}

impl BothServices {
    fn new() -> Self {
        BothServices {
            machine: MachineServiceServer::new(FakeNode),
            state: StateServer::new(FakeNode),
        }
    }
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for BothServices {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        if req.uri().path().starts_with("/cosi.resource.State/") {
            self.state.call(req)
        } else {
            self.machine.call(req)
        }
    }
}

struct Apid {
    addr: SocketAddr,
    ca: TestCa,
    client_crt: String,
    client_key: String,
}

/// Start the fake apid on 127.0.0.1 with an Ed25519 server certificate (SANs `127.0.0.1`, `node1`)
/// that requires a client certificate from the same CA.
async fn start_apid() -> Apid {
    let ca = new_ca();
    let (server_crt, server_key) = issue(&ca, "talos", &["127.0.0.1", "node1"], true);
    let (client_crt, client_key) = issue(&ca, "os:admin", &[], false);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(&server_crt, &server_key))
        .client_ca_root(Certificate::from_pem(&ca.pem));
    let server = Server::builder()
        .tls_config(tls)
        .unwrap()
        .serve_with_incoming(BothServices::new(), TcpListenerStream::new(listener));
    tokio::spawn(server);
    Apid {
        addr,
        ca,
        client_crt,
        client_key,
    }
}

impl Apid {
    fn credentials(&self) -> TalosCredentials {
        talosconfig_credentials(&self.ca.pem, &self.client_crt, &self.client_key)
    }

    fn options(&self) -> ConnectOptions {
        ConnectOptions {
            port: self.addr.port(),
            ..ConnectOptions::default()
        }
    }

    async fn client(&self) -> TalosClient {
        TalosClient::connect(
            &self.credentials(),
            Target::Node(self.addr.ip()),
            &self.options(),
        )
        .await
        .unwrap()
    }
}

// ----- tests -----

#[tokio::test]
async fn version_over_mtls_with_ip_san() {
    let apid = start_apid().await;
    let client = apid.client().await;
    let v = client.version().await.unwrap();
    assert_eq!(v.tag, "v1.10.3");
    assert_eq!(v.arch, "amd64");
    assert!(v.rbac);
    assert_eq!(
        v.platform, "",
        "no node header when dialling the node directly"
    );
    assert_eq!(client.endpoint(), apid.addr.to_string());
}

/// The client's connection to apid has the kernel watch for a vanished node (TCP keepalive, as
/// apid's own connections to its backends), not HTTP/2 pings: its socket, found in the kernel's
/// list by the apid address it is connected to, has the keepalive timer running while it is idle,
/// due within the 30 s idle time; apid's end of the same connection (this fake's, which sets no
/// keepalive) has none.
#[tokio::test]
async fn an_idle_connection_is_watched_by_tcp_keepalive() {
    let apid = start_apid().await;
    let client = apid.client().await;
    client.version().await.unwrap();
    let std::net::SocketAddr::V4(apid_addr) = apid.addr else {
        panic!("the fake apid listens on IPv4 loopback");
    };
    // /proc/net/tcp prints an IPv4 address as its four bytes read as a little-endian number.
    let apid_hex = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(apid_addr.ip().octets()),
        apid_addr.port()
    );
    // Field 2 is the local address, 3 the remote one, 4 the state (01: established), 6 the timer
    // ("02:<ticks>" while the keepalive timer is pending; 00 for none).
    let timers = |side: usize| -> Vec<String> {
        std::fs::read_to_string("/proc/self/net/tcp")
            .expect("the kernel's TCP socket list")
            .lines()
            .skip(1)
            .map(|line| {
                line.split_whitespace()
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .filter(|fields| {
                fields.get(side) == Some(&apid_hex)
                    && fields.get(3).map(String::as_str) == Some("01")
            })
            .map(|fields| fields[5].clone())
            .collect()
    };
    // Right after the call, the last bytes may still wait for their (delayed) acknowledgement,
    // and the retransmission timer (01) shows instead; once acknowledged, the connection is idle.
    let mut client_side = timers(2);
    for _ in 0..50 {
        if client_side.len() == 1 && client_side[0].starts_with("02:") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        client_side = timers(2);
    }
    assert_eq!(
        client_side.len(),
        1,
        "one connection to apid: {client_side:?}"
    );
    let (kind, ticks) = client_side[0].split_once(':').unwrap();
    assert_eq!(
        kind, "02",
        "the keepalive timer runs on the idle connection"
    );
    let due_in = u64::from_str_radix(ticks, 16).unwrap();
    // In USER_HZ ticks (100 a second): within the 30 s of idle time before the first probe.
    assert!(due_in <= 30 * 100, "first probe due in {due_in} ticks");
    let apid_side = timers(1);
    assert!(
        apid_side.iter().all(|timer| timer.starts_with("00:")),
        "apid's end, which sets no keepalive, has no timer: {apid_side:?}"
    );
}

#[tokio::test]
async fn dead_peer_detection_is_set_on_the_socket_as_apid_sets_it() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    DeadPeerDetection::APID.apply(&tcp).unwrap();
    let socket = socket2::SockRef::from(&tcp);
    assert!(socket.keepalive().unwrap());
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(30)
    );
    assert_eq!(
        socket.tcp_keepalive_interval().unwrap(),
        Duration::from_secs(10)
    );
    assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
    assert_eq!(
        socket.tcp_user_timeout().unwrap(),
        Some(Duration::from_secs(60))
    );
}

/// An apid that does not fan a call out (this one ignores `nodes` and answers for itself, as a
/// Talos without one-to-many proxying might) is not taken for one that did: the call fails as a
/// whole, so the caller asks node by node, rather than taking one node's answer for another's.
#[tokio::test]
async fn a_reply_that_does_not_answer_each_node_named_is_refused_as_a_whole() {
    let apid = start_apid().await;
    let client = apid.client().await;
    let nodes: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "10.0.0.6".parse().unwrap()];
    let error = client.versions_of(&nodes).await.unwrap_err();
    assert!(matches!(error, TalosError::Decode { .. }), "{error}");
    assert!(
        error
            .to_string()
            .contains("does not answer each of them once"),
        "{error}"
    );
    // A relayed client cannot fan out: apid fans out only what it was sent directly.
    let relayed = client.relayed_to(nodes[0]).unwrap();
    assert!(matches!(
        relayed.versions_of(&nodes).await,
        Err(TalosError::InvalidArgument { .. })
    ));
}

#[tokio::test]
async fn lazy_client_connects_on_first_call() {
    let apid = start_apid().await;
    let client = TalosClient::lazy(
        &apid.credentials(),
        Target::Node(apid.addr.ip()),
        &apid.options(),
    )
    .unwrap();
    assert_eq!(client.version().await.unwrap().tag, "v1.10.3");
}

#[tokio::test]
async fn via_endpoint_sends_node_header() {
    let apid = start_apid().await;
    let target = Target::ViaEndpoint {
        endpoint: apid.addr.to_string(),
        node: "10.0.0.9".into(),
    };
    let client = TalosClient::connect(&apid.credentials(), target, &apid.options())
        .await
        .unwrap();
    assert_eq!(client.version().await.unwrap().platform, "10.0.0.9");
    assert!(
        client
            .endpoint()
            .starts_with("node 10.0.0.9 via 127.0.0.1:"),
        "{}",
        client.endpoint()
    );

    // The endpoint written as a talosconfig URL works too.
    let target = Target::Endpoint(format!("https://{}/", apid.addr));
    let client = TalosClient::connect(&apid.credentials(), target, &apid.options())
        .await
        .unwrap();
    assert_eq!(client.version().await.unwrap().platform, "");
}

#[tokio::test]
async fn server_name_override() {
    let apid = start_apid().await;
    let target = Target::Node(apid.addr.ip());
    let options = ConnectOptions {
        server_name: Some("node1".into()),
        ..apid.options()
    };
    let client = TalosClient::connect(&apid.credentials(), target.clone(), &options)
        .await
        .unwrap();
    assert_eq!(client.version().await.unwrap().tag, "v1.10.3");

    let options = ConnectOptions {
        server_name: Some("wrong.example".into()),
        ..apid.options()
    };
    let err = TalosClient::connect(&apid.credentials(), target, &options)
        .await
        .unwrap_err();
    assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
    assert!(err.to_string().contains("not valid for name"), "{err}");
}

#[tokio::test]
async fn server_certificate_from_another_ca_fails_at_connect_with_tls() {
    let apid = start_apid().await;
    let other = new_ca();
    let (crt, key) = issue(&other, "os:admin", &[], false);
    // We trust only the other CA, so the node's certificate does not verify.
    let creds = talosconfig_credentials(&other.pem, &crt, &key);
    let err = TalosClient::connect(&creds, Target::Node(apid.addr.ip()), &apid.options())
        .await
        .unwrap_err();
    assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
    assert!(!err.is_unreachable());
    // Both CAs are named O=talos (as every Talos OS CA is), so rustls finds the "issuer" by name and
    // then reports a bad signature rather than an unknown issuer.
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "{err}"
    );
}

#[tokio::test]
async fn client_certificate_from_another_ca_is_rejected_with_tls() {
    let apid = start_apid().await;
    let other = new_ca();
    let (crt, key) = issue(&other, "os:admin", &[], false);
    // We trust the node's CA, but present a client certificate the node does not trust. With TLS 1.3
    // the rejection arrives after our side of the handshake is done, so it may surface at connect or
    // at the first call; either way it must be a TLS error, not "unreachable".
    let creds = talosconfig_credentials(&apid.ca.pem, &crt, &key);
    let result =
        match TalosClient::connect(&creds, Target::Node(apid.addr.ip()), &apid.options()).await {
            Ok(client) => client.version().await.map(|_| ()),
            Err(e) => Err(e),
        };
    let err = result.unwrap_err();
    assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        !text.contains(&key[40..80]),
        "error leaks key material: {text}"
    );
}

#[tokio::test]
async fn closed_port_is_unreachable() {
    let apid = start_apid().await;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let options = ConnectOptions {
        port,
        ..apid.options()
    };
    let err = TalosClient::connect(&apid.credentials(), Target::Node(apid.addr.ip()), &options)
        .await
        .unwrap_err();
    assert!(err.is_unreachable(), "{err:?}");
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );

    // A lazy client reports the same on its first call.
    let client =
        TalosClient::lazy(&apid.credentials(), Target::Node(apid.addr.ip()), &options).unwrap();
    let err = client.version().await.unwrap_err();
    assert!(err.is_unreachable(), "{err:?}");
}

#[tokio::test]
async fn request_timeout_and_status_mapping() {
    let apid = start_apid().await;
    let options = ConnectOptions {
        request_timeout: Duration::from_millis(300),
        ..apid.options()
    };
    let client = TalosClient::connect(&apid.credentials(), Target::Node(apid.addr.ip()), &options)
        .await
        .unwrap();

    let err = client.service_list().await.unwrap_err();
    assert!(matches!(err, TalosError::Timeout { .. }), "{err:?}");

    let err = client.etcd_status().await.unwrap_err();
    assert!(
        matches!(err, TalosError::Unimplemented { ref message, .. } if message.contains("control plane"))
    );

    // metadata.error inside the envelope becomes an error with the status code it carries.
    let err = client
        .apply_configuration(b"version: v1alpha1".to_vec(), ApplyMode::NoReboot, false)
        .await;
    assert!(
        matches!(err, Err(TalosError::InvalidArgument { .. })),
        "{err:?}"
    );

    assert_eq!(
        client.reboot(RebootMode::Default).await.unwrap(),
        "reboot-actor"
    );
    assert_eq!(client.boot_id().await.unwrap(), BOOT_ID);
}

#[tokio::test]
async fn events_skip_hello_and_decode_payloads() {
    let apid = start_apid().await;
    let client = apid.client().await;
    let stream = client
        .events(EventsOptions {
            tail_events: -1,
            ..Default::default()
        })
        .await
        .unwrap();
    let events: Vec<_> = stream.collect().await;
    let events: Vec<TalosEvent> = events.into_iter().map(|e| e.unwrap()).collect();
    assert_eq!(events.len(), 3, "{events:?}");
    assert!(matches!(&events[0].payload, EventPayload::Sequence(s) if s.sequence == "upgrade"));
    assert_eq!(events[0].actor_id, "actor-1");
    assert_eq!(
        events[1].payload,
        EventPayload::Unknown {
            type_url: "talos/runtime/machine.SomethingNew".into()
        }
    );
    assert!(events[2].payload.is_running_and_ready());
}

#[tokio::test]
async fn cosi_get_list_watch() {
    let apid = start_apid().await;
    let client = apid.client().await;
    use resources::machine_status as ms;

    let found = client
        .cosi_get::<runtime_pb::MachineStatusSpec>(ms::NAMESPACE, ms::TYPE, ms::ID)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.metadata.version, 4);
    assert_eq!(found.spec.stage(), RuntimeMachineStage::MachineStageRunning);

    let missing = client.cosi_get::<runtime_pb::MachineStatusSpec>(ms::NAMESPACE, ms::TYPE, "nope");
    assert!(missing.await.unwrap().is_none());

    let status = client.machine_status().await.unwrap();
    assert!(status.status.unwrap().ready);
    // Older Talos without the Versions resource.
    assert_eq!(client.talos_version_resource().await.unwrap(), None);
    assert!(matches!(
        client.nodename().await,
        Err(TalosError::NotFound { .. })
    ));

    let list = client
        .cosi_list::<runtime_pb::MachineStatusSpec>(ms::NAMESPACE, ms::TYPE)
        .await
        .unwrap();
    assert_eq!(
        list.iter().map(|r| r.metadata.version).collect::<Vec<_>>(),
        [1, 2]
    );

    let watch = client
        .cosi_watch::<runtime_pb::MachineStatusSpec>(ms::NAMESPACE, ms::TYPE, Some(ms::ID), false)
        .await
        .unwrap();
    let events: Vec<_> = watch.map(|e| e.unwrap()).collect().await;
    let seen: Vec<(CosiEventType, u64)> = events
        .iter()
        .map(|e| (e.event_type, e.resource.as_ref().unwrap().metadata.version))
        .collect();
    assert_eq!(
        seen,
        [
            (CosiEventType::Created, 5),
            (CosiEventType::Updated, 6),
            (CosiEventType::Updated, 7)
        ]
    );

    let err = client
        .cosi_watch::<runtime_pb::MachineStatusSpec>(ms::NAMESPACE, ms::TYPE, Some(ms::ID), true)
        .await
        .unwrap_err();
    assert!(matches!(err, TalosError::InvalidArgument { .. }));
}

// ----- a node that "reboots": a TCP proxy whose connections we can cut -----

struct Proxy {
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

async fn start_proxy(listen: SocketAddr, upstream: SocketAddr) -> Proxy {
    let listener = TcpListener::bind(listen).await.unwrap();
    let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
    let tracked = conns.clone();
    let accept = tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            let conn = tokio::spawn(async move {
                if let Ok(mut up) = TcpStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                }
            });
            tracked.lock().unwrap().push(conn);
        }
    });
    Proxy { accept, conns }
}

impl Proxy {
    /// Drop the listener and every connection, like a node going down.
    fn kill(&self) {
        self.accept.abort();
        for conn in self.conns.lock().unwrap().drain(..) {
            conn.abort();
        }
    }
}

#[tokio::test]
async fn node_going_down_and_coming_back() {
    let apid = start_apid().await;
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let front: SocketAddr = ([127, 0, 0, 1], port).into();
    let proxy = start_proxy(front, apid.addr).await;
    let options = ConnectOptions {
        port,
        request_timeout: Duration::from_secs(5),
        ..apid.options()
    };
    let client = TalosClient::connect(&apid.credentials(), Target::Node(front.ip()), &options)
        .await
        .unwrap();

    let opts = EventsOptions {
        actor_id: Some("keep-open".into()),
        ..Default::default()
    };
    let mut events = client.events(opts).await.unwrap();
    for _ in 0..3 {
        events.next().await.unwrap().unwrap();
    }

    proxy.kill();
    // The open stream ends with "unreachable" (the connection dropped: EOF/reset), then ends.
    let err = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("stream noticed the drop")
        .expect("an error item")
        .unwrap_err();
    assert!(err.is_unreachable(), "{err:?}");
    assert!(events.next().await.is_none());

    // While the node is down, calls fail with "unreachable".
    let err = client.version().await.unwrap_err();
    assert!(err.is_unreachable(), "{err:?}");

    // The node is back: the same client reconnects.
    let _proxy = start_proxy(front, apid.addr).await;
    let mut last = None;
    for _ in 0..20 {
        match client.version().await {
            Ok(v) => {
                last = Some(Ok(v));
                break;
            }
            Err(e) => {
                assert!(e.is_unreachable(), "{e:?}");
                last = Some(Err(e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert_eq!(last.unwrap().unwrap().tag, "v1.10.3");
}

// ----- argument parsing -----

#[test]
fn endpoint_forms() {
    let ok = |s: &str| endpoint_authority(s, 50000).unwrap();
    assert_eq!(ok("10.0.0.2"), "10.0.0.2:50000");
    assert_eq!(ok("10.0.0.2:50001"), "10.0.0.2:50001");
    assert_eq!(ok("fd00::1"), "[fd00::1]:50000");
    assert_eq!(ok("[fd00::1]"), "[fd00::1]:50000");
    assert_eq!(ok("[fd00::1]:6443"), "[fd00::1]:6443");
    assert_eq!(ok("cp1.example.com"), "cp1.example.com:50000");
    assert_eq!(ok("cp1.example.com:443"), "cp1.example.com:443");
    assert_eq!(
        ok("https://cp1.example.com:50000/"),
        "cp1.example.com:50000"
    );
    assert_eq!(ok(" https://10.0.0.2 "), "10.0.0.2:50000");
    for bad in [
        "",
        "http://10.0.0.2",
        "host:port",
        "a/b",
        "[zz]",
        "bad host",
    ] {
        assert!(
            matches!(endpoint_authority(bad, 50000), Err(TalosError::Config(_))),
            "{bad:?}"
        );
    }
}

#[tokio::test]
async fn node_target_brackets_ipv6() {
    let ca = new_ca();
    let (crt, key) = issue(&ca, "os:admin", &[], false);
    let creds = TalosCredentials::from_pem(&ca.pem, &crt, &key).unwrap();
    let target = Target::Node("fd00::5".parse().unwrap());
    let client = TalosClient::lazy(&creds, target, &ConnectOptions::default()).unwrap();
    assert_eq!(client.endpoint(), "[fd00::5]:50000");

    let bad = Target::ViaEndpoint {
        endpoint: "10.0.0.2".into(),
        node: "bad\nnode".into(),
    };
    let err = TalosClient::lazy(&creds, bad, &ConnectOptions::default()).unwrap_err();
    assert!(matches!(err, TalosError::InvalidArgument { .. }), "{err:?}");
}

#[test]
fn client_debug_shows_no_secrets() {
    let ca = new_ca();
    let (crt, key) = issue(&ca, "os:admin", &[], false);
    let creds = TalosCredentials::from_pem(&ca.pem, &crt, &key).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let client = TalosClient::lazy(
        &creds,
        Target::Node("10.0.0.5".parse().unwrap()),
        &ConnectOptions::default(),
    )
    .unwrap();
    let debug = format!("{client:?} {creds:?}");
    assert!(debug.contains("10.0.0.5:50000"), "{debug}");
    let body: String = key.lines().filter(|l| !l.starts_with("-----")).collect();
    assert!(!debug.contains(&body[..20]), "{debug}");
}
