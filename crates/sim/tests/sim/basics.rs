//! The simulator answers stock tonic clients over mutual TLS, and refuses what apid refuses.

use std::collections::HashSet;

use crate::common::*;
use talos_api::proto::cosi::resource as cosi;
use talos_api::proto::machine;
use talos_api::proto::machine::machine_service_client::MachineServiceClient;
use talos_sim::{ClientRole, Role, SimConfig, Simulator, Timings, Validity};
use tonic::Code;
use tonic::transport::Endpoint;

async fn five_nodes() -> Simulator {
    init();
    let config =
        SimConfig::uniform("basics", 3, 2, "1.11.6", "1.34.1").with_timings(Timings::fast());
    Simulator::start(config).await.expect("simulator starts")
}

/// Expect the node to refuse this client: either the connection or the first call fails.
async fn expect_refused(endpoint: &str, tls: tonic::transport::ClientTlsConfig) {
    match connect(endpoint, tls).await {
        Err(_) => {}
        Ok(channel) => {
            let result = MachineServiceClient::new(channel).version(()).await;
            assert!(
                result.is_err(),
                "a refused client got an answer: {result:?}"
            );
        }
    }
}

#[tokio::test]
async fn version_on_every_node_of_a_five_node_cluster() {
    let sim = five_nodes().await;
    let nodes = sim.nodes();
    assert_eq!(nodes.len(), 5);
    assert_eq!(
        nodes
            .iter()
            .filter(|n| n.role == Role::ControlPlane)
            .count(),
        3
    );
    let addresses: HashSet<_> = nodes.iter().map(|n| n.address).collect();
    assert_eq!(addresses.len(), 5, "each node has its own address");
    for node in &nodes {
        assert_eq!(node.address.octets()[0], 127);
        assert_ne!(node.address, std::net::Ipv4Addr::LOCALHOST);
        assert_eq!(node.port, 50000);

        let mut client = admin(&sim, &node.name).await;
        let reply = client.version(()).await.expect("Version").into_inner();
        let version = &reply.messages[0];
        assert!(version.metadata.is_none(), "machined never fills metadata");
        let info = version.version.as_ref().unwrap();
        assert_eq!(info.tag, "v1.11.6");
        assert_eq!(info.os, "linux");
        assert!(!info.sha.is_empty());
        let platform = version.platform.as_ref().unwrap();
        assert_eq!(
            (platform.name.as_str(), platform.mode.as_str()),
            ("metal", "metal")
        );
        assert!(version.features.as_ref().unwrap().rbac);

        let snapshot = sim.node_snapshot(&node.name).unwrap();
        assert!(snapshot.ready && !snapshot.down);
        assert_eq!(snapshot.talos_version, "1.11.6");
        assert_eq!(snapshot.kubelet.version, "1.34.1");
        assert_eq!(
            snapshot.control_plane.is_some(),
            node.role == Role::ControlPlane
        );
    }
}

#[tokio::test]
async fn talosconfig_looks_like_talosctls() {
    let sim = five_nodes().await;
    let talosconfig = sim.talosconfig(ClientRole::Admin);
    let value: serde_yaml::Value = serde_yaml::from_str(&talosconfig).unwrap();
    assert_eq!(value["context"].as_str(), Some("basics"));
    let ctx = &value["contexts"]["basics"];
    let endpoints: Vec<_> = ctx["endpoints"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    let cps: Vec<_> = sim
        .nodes()
        .into_iter()
        .filter(|n| n.role == Role::ControlPlane)
        .map(|n| n.address.to_string())
        .collect();
    assert_eq!(endpoints, cps);
    let (ca, _crt, key) = talosconfig_pems(&talosconfig);
    assert_eq!(ca, sim.ca_pem());
    assert!(key.starts_with("-----BEGIN ED25519 PRIVATE KEY-----"));
}

/// A talosconfig written to a file holds the role's client and is readable by its owner only, also
/// when it replaces a file others could read.
#[tokio::test]
async fn a_written_talosconfig_is_the_owners_alone() {
    use std::os::unix::fs::PermissionsExt;
    let sim = five_nodes().await;
    let path =
        std::env::temp_dir().join(format!("tuc-sim-basics-{}.talosconfig", std::process::id()));
    std::fs::write(&path, "an older file, readable by all\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();

    sim.write_talosconfig(&path, ClientRole::Reader).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    let written = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();

    assert_eq!(mode, 0o600, "{mode:o}");
    let (ca, _crt, _key) = talosconfig_pems(&written);
    assert_eq!(ca, sim.ca_pem());
    // The reader's client, as the role asked: the node lets it read and refuses a mutation.
    let channel = connect(&endpoint(&sim, "cp-1"), tls_from_talosconfig(&written))
        .await
        .expect("the written talosconfig connects");
    let mut client = MachineServiceClient::new(channel);
    client.version(()).await.expect("readers may call Version");
    let refused = client
        .reboot(machine::RebootRequest::default())
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn reader_is_refused_mutations_but_may_read() {
    let sim = five_nodes().await;
    let mut reader = MachineServiceClient::new(channel_as(&sim, "cp-1", ClientRole::Reader).await);
    reader.version(()).await.expect("readers may call Version");
    reader
        .service_list(())
        .await
        .expect("readers may call ServiceList");

    let status = reader
        .upgrade(machine::UpgradeRequest {
            image: "ghcr.io/siderolabs/installer:v1.12.0".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    for status in [
        reader
            .reboot(machine::RebootRequest::default())
            .await
            .unwrap_err(),
        reader
            .apply_configuration(machine::ApplyConfigurationRequest::default())
            .await
            .unwrap_err(),
        reader
            .rollback(machine::RollbackRequest {})
            .await
            .unwrap_err(),
        reader
            .etcd_forfeit_leadership(machine::EtcdForfeitLeadershipRequest {})
            .await
            .unwrap_err(),
    ] {
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    }
    let read = reader
        .read(machine::ReadRequest {
            path: "/proc/sys/kernel/random/boot_id".into(),
        })
        .await;
    assert_eq!(read.unwrap_err().code(), Code::PermissionDenied);

    // Sensitive COSI resources need admin; others are readable.
    let channel = channel_as(&sim, "cp-1", ClientRole::Reader).await;
    let mut state = cosi::state_client::StateClient::new(channel);
    let denied = state
        .get(cosi::GetRequest {
            namespace: "config".into(),
            r#type: "MachineConfigs.config.talos.dev".into(),
            id: "v1alpha1".into(),
            options: None,
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    state
        .get(cosi::GetRequest {
            namespace: "runtime".into(),
            r#type: "MachineStatuses.runtime.talos.dev".into(),
            id: "machine".into(),
            options: None,
        })
        .await
        .expect("readers may read MachineStatus");

    // No mutation went through, so nothing was recorded.
    assert!(sim.record().is_empty(), "{:#?}", sim.record());
}

#[tokio::test]
async fn client_certificates_from_another_ca_are_refused() {
    let sim = five_nodes().await;
    let talosconfig = sim.talosconfig_from_other_ca();
    expect_refused(&endpoint(&sim, "cp-1"), tls_from_talosconfig(&talosconfig)).await;
}

#[tokio::test]
async fn expired_client_certificates_are_refused() {
    let sim = five_nodes().await;
    let (crt, key) = sim.client_identity_pem(ClientRole::Admin, Validity::expired());
    expect_refused(
        &endpoint(&sim, "cp-2"),
        tls_from_pems(&sim.ca_pem(), &crt, &key),
    )
    .await;

    // Same CA and role with a valid window works: it is the validity that was refused.
    let (crt, key) = sim.client_identity_pem(ClientRole::Admin, Validity::one_year());
    let channel = connect(
        &endpoint(&sim, "cp-2"),
        tls_from_pems(&sim.ca_pem(), &crt, &key),
    )
    .await
    .unwrap();
    MachineServiceClient::new(channel)
        .version(())
        .await
        .unwrap();
}

#[tokio::test]
async fn client_certificates_need_exactly_client_auth() {
    use rcgen::ExtendedKeyUsagePurpose as Eku;
    let sim = five_nodes().await;
    let identity = sim
        .ca()
        .client_identity_with_eku(&ClientRole::Admin, vec![Eku::ClientAuth, Eku::ServerAuth])
        .unwrap();
    expect_refused(
        &endpoint(&sim, "cp-1"),
        tls_from_pems(&sim.ca_pem(), &identity.cert_pem, &identity.key_pem),
    )
    .await;
}

#[tokio::test]
async fn plain_text_connections_fail() {
    let sim = five_nodes().await;
    let plain = endpoint(&sim, "cp-1").replace("https://", "http://");
    let result = async {
        let channel = Endpoint::from_shared(plain)?
            .connect_timeout(std::time::Duration::from_secs(5))
            .timeout(std::time::Duration::from_secs(10))
            .connect()
            .await?;
        MachineServiceClient::new(channel)
            .version(())
            .await
            .map_err(|e| -> Box<dyn std::error::Error> { Box::new(e) })?;
        Ok::<_, Box<dyn std::error::Error>>(())
    }
    .await;
    assert!(result.is_err(), "h2c without TLS must not get an answer");
}

#[tokio::test]
async fn node_header_proxies_through_control_planes_only() {
    let sim = five_nodes().await;
    let worker = sim
        .nodes()
        .into_iter()
        .find(|n| n.name == "worker-1")
        .unwrap();

    // cp-1 forwards to worker-1: the worker answers (etcd is CP-only there).
    let mut cp = admin(&sim, "cp-1").await;
    let mut req = tonic::Request::new(());
    req.metadata_mut()
        .insert("node", worker.address.to_string().parse().unwrap());
    let status = cp.etcd_status(req).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert!(
        status
            .message()
            .contains("only available on control plane nodes")
    );

    // Workers cannot forward.
    let mut w = admin(&sim, "worker-1").await;
    let mut req = tonic::Request::new(());
    req.metadata_mut().insert("node", "cp-2".parse().unwrap());
    assert_eq!(
        w.version(req).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    // Nor fan out (talos v1.14.1 director.go `aggregateDirector`: the whole call is refused), unless
    // the one node named is the worker itself.
    let mut req = tonic::Request::new(());
    req.metadata_mut()
        .insert("nodes", "worker-1,worker-2".parse().unwrap());
    let refused = w.version(req).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message()),
        (Code::PermissionDenied, "no request forwarding")
    );
    let mut req = tonic::Request::new(());
    req.metadata_mut()
        .insert("nodes", "worker-1".parse().unwrap());
    let own = w.version(req).await.unwrap().into_inner();
    assert_eq!(own.messages.len(), 1);

    // One-to-many: aggregated replies stamped with the target, errors inline.
    let mut req = tonic::Request::new(());
    req.metadata_mut()
        .insert("nodes", "cp-2,worker-2".parse().unwrap());
    let reply = cp.etcd_status(req).await.unwrap().into_inner();
    assert_eq!(reply.messages.len(), 2);
    let first = reply.messages[0].metadata.as_ref().unwrap();
    assert_eq!(first.hostname, "cp-2");
    assert!(first.error.is_empty());
    let second = reply.messages[1].metadata.as_ref().unwrap();
    assert_eq!(second.hostname, "worker-2");
    assert_eq!(
        second.status.as_ref().unwrap().code,
        Code::Unimplemented as i32
    );

    // COSI refuses one-to-many.
    let mut state = state(&sim, "cp-1").await;
    let mut req = tonic::Request::new(cosi::GetRequest {
        namespace: "runtime".into(),
        r#type: "MachineStatuses.runtime.talos.dev".into(),
        id: "machine".into(),
        options: None,
    });
    req.metadata_mut().insert("nodes", "cp-2".parse().unwrap());
    assert_eq!(
        state.get(req).await.unwrap_err().code(),
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn unknown_services_answer_unimplemented_on_old_nodes() {
    let sim = five_nodes().await;
    let mut images = images(&sim, "cp-1").await;
    let status = images
        .pull(machine::ImageServicePullRequest {
            containerd: None,
            image_ref: "ghcr.io/siderolabs/installer:v1.12.0".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
}
