//! Helpers shared by the simulator tests: stock tonic clients configured from a talosconfig, the way
//! any gRPC client would reach a Talos node, plus condition waits with generous upper bounds.

use std::time::Duration;

use base64::Engine as _;
use talos_api::proto::cosi::resource::state_client::StateClient;
use talos_api::proto::machine;
use talos_api::proto::machine::image_service_client::ImageServiceClient;
use talos_api::proto::machine::lifecycle_service_client::LifecycleServiceClient;
use talos_api::proto::machine::machine_service_client::MachineServiceClient;
use talos_sim::{ClientRole, NodeSnapshot, Simulator};
use tokio_stream::StreamExt;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// Upper bound for anything that should happen "soon"; tests wait on conditions, never on durations.
pub const PATIENCE: Duration = Duration::from_secs(30);

pub fn init() {
    // tonic uses the process-wide rustls provider when one is installed; ring is the one we ship.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Talos writes Ed25519 keys under `ED25519 PRIVATE KEY`; rustls wants `PRIVATE KEY` (same PKCS#8 body).
pub fn relabel_key(pem: &str) -> String {
    pem.replace("ED25519 PRIVATE KEY", "PRIVATE KEY")
}

/// (ca, crt, key) PEMs from a talosconfig's current context.
pub fn talosconfig_pems(talosconfig: &str) -> (String, String, String) {
    let value: serde_yaml::Value = serde_yaml::from_str(talosconfig).expect("talosconfig is YAML");
    let context = value["context"].as_str().expect("context");
    let ctx = &value["contexts"][context];
    let field = |name: &str| {
        let b64 = ctx[name]
            .as_str()
            .unwrap_or_else(|| panic!("{name} missing"));
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("base64");
        String::from_utf8(bytes).expect("PEM is text")
    };
    (field("ca"), field("crt"), field("key"))
}

pub fn tls_from_talosconfig(talosconfig: &str) -> ClientTlsConfig {
    let (ca, crt, key) = talosconfig_pems(talosconfig);
    tls_from_pems(&ca, &crt, &key)
}

pub fn tls_from_pems(ca: &str, crt: &str, key: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(crt, relabel_key(key)))
}

pub async fn connect(
    endpoint: &str,
    tls: ClientTlsConfig,
) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(endpoint.to_string())
        .expect("valid endpoint")
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(20))
        .connect()
        .await
}

pub fn endpoint(sim: &Simulator, node: &str) -> String {
    sim.nodes()
        .into_iter()
        .find(|n| n.name == node)
        .unwrap_or_else(|| panic!("no node {node}"))
        .endpoint()
}

pub async fn channel_as(sim: &Simulator, node: &str, role: ClientRole) -> Channel {
    let talosconfig = sim.talosconfig(role);
    connect(&endpoint(sim, node), tls_from_talosconfig(&talosconfig))
        .await
        .expect("connect")
}

pub async fn admin(sim: &Simulator, node: &str) -> MachineServiceClient<Channel> {
    MachineServiceClient::new(channel_as(sim, node, ClientRole::Admin).await)
}

pub async fn state(sim: &Simulator, node: &str) -> StateClient<Channel> {
    StateClient::new(channel_as(sim, node, ClientRole::Admin).await)
}

pub async fn images(sim: &Simulator, node: &str) -> ImageServiceClient<Channel> {
    ImageServiceClient::new(channel_as(sim, node, ClientRole::Admin).await)
}

pub async fn lifecycle(sim: &Simulator, node: &str) -> LifecycleServiceClient<Channel> {
    LifecycleServiceClient::new(channel_as(sim, node, ClientRole::Admin).await)
}

/// Retry connecting until the node answers Version (it may be rebooting).
pub async fn admin_when_up(sim: &Simulator, node: &str) -> MachineServiceClient<Channel> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let talosconfig = sim.talosconfig(ClientRole::Admin);
        if let Ok(channel) = connect(&endpoint(sim, node), tls_from_talosconfig(&talosconfig)).await
        {
            let mut client = MachineServiceClient::new(channel);
            if client.version(()).await.is_ok() {
                return client;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{node} did not come back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn wait_snapshot(
    sim: &Simulator,
    node: &str,
    what: &str,
    condition: impl FnMut(&NodeSnapshot) -> bool,
) -> NodeSnapshot {
    match sim.wait_for(node, PATIENCE, condition).await {
        Ok(snapshot) => snapshot,
        Err(e) => panic!("waiting for {what}: {e}"),
    }
}

/// A decoded event payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Ev {
    Hello {
        actor: String,
    },
    Sequence {
        name: String,
        action: i32,
        actor: String,
        error: Option<i32>,
    },
    Phase {
        name: String,
        action: i32,
        actor: String,
    },
    Task {
        name: String,
        action: i32,
        actor: String,
    },
    Service {
        name: String,
        action: i32,
    },
    Status {
        stage: i32,
        ready: bool,
        unmet: usize,
    },
    Other(String),
}

pub fn decode(event: &machine::Event) -> Ev {
    use prost::Message;
    let Some(data) = &event.data else {
        return Ev::Hello {
            actor: event.actor_id.clone(),
        };
    };
    let actor = event.actor_id.clone();
    match data.type_url.as_str() {
        "talos/runtime/machine.SequenceEvent" => {
            let e = machine::SequenceEvent::decode(data.value.as_slice()).expect("decode");
            Ev::Sequence {
                name: e.sequence,
                action: e.action,
                actor,
                error: e.error.map(|e| e.code),
            }
        }
        "talos/runtime/machine.PhaseEvent" => {
            let e = machine::PhaseEvent::decode(data.value.as_slice()).expect("decode");
            Ev::Phase {
                name: e.phase,
                action: e.action,
                actor,
            }
        }
        "talos/runtime/machine.TaskEvent" => {
            let e = machine::TaskEvent::decode(data.value.as_slice()).expect("decode");
            Ev::Task {
                name: e.task,
                action: e.action,
                actor,
            }
        }
        "talos/runtime/machine.ServiceStateEvent" => {
            let e = machine::ServiceStateEvent::decode(data.value.as_slice()).expect("decode");
            Ev::Service {
                name: e.service,
                action: e.action,
            }
        }
        "talos/runtime/machine.MachineStatusEvent" => {
            let e = machine::MachineStatusEvent::decode(data.value.as_slice()).expect("decode");
            let status = e.status.unwrap_or_default();
            Ev::Status {
                stage: e.stage,
                ready: status.ready,
                unmet: status.unmet_conditions.len(),
            }
        }
        other => Ev::Other(other.to_string()),
    }
}

/// Collect events from a stream until `stop` matches one (inclusive) or the stream ends/errors.
/// Returns the events and whether the stream ended (EOF or error) rather than `stop` matching.
pub async fn collect_until(
    stream: &mut tonic::Streaming<machine::Event>,
    mut stop: impl FnMut(&Ev) -> bool,
) -> (Vec<Ev>, bool) {
    let mut out = Vec::new();
    let result = tokio::time::timeout(PATIENCE, async {
        loop {
            match stream.next().await {
                Some(Ok(event)) => {
                    let ev = decode(&event);
                    let done = stop(&ev);
                    out.push(ev);
                    if done {
                        return false;
                    }
                }
                Some(Err(_)) | None => return true,
            }
        }
    })
    .await;
    match result {
        Ok(ended) => (out, ended),
        Err(_) => panic!("event stream stalled; got so far: {out:#?}"),
    }
}
