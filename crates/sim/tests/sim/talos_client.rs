//! The project's Talos client library against the Talos simulator, over real mutual TLS on loopback:
//! every call the controller will make, both upgrade API generations observed through events, COSI and
//! boot ids, the reboot gap seen as `Unreachable`, and refusals (roles, foreign CA, expired certificate,
//! malformed talosconfig).

use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt;
use talos_api::proto::machine;
use talos_api::proto::talos::resource::definitions::runtime::MachineStatusSpec;
use talos_api::{
    ApplyMode, ConnectOptions, CosiEventType, EventPayload, EventsOptions, LegacyUpgradeOptions,
    RebootMode, TalosClient, TalosCredentials, TalosError, Talosconfig, Target, resources,
};
use talos_sim::{ClientRole, Fault, NodeConfig, SimConfig, Simulator, Timings, Validity};

/// Upper bound for things that should happen soon; nothing asserts on how long they took.
const PATIENCE: Duration = Duration::from_secs(30);

fn init() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn five_nodes(talos: &str) -> SimConfig {
    SimConfig::uniform("client-test", 3, 2, talos, "1.34.1").with_timings(Timings::fast())
}

fn credentials(talosconfig: &str) -> TalosCredentials {
    Talosconfig::from_yaml(talosconfig)
        .and_then(|config| config.current_context()?.credentials())
        .expect("the simulator's talosconfig parses")
}

fn address(sim: &Simulator, name: &str) -> IpAddr {
    let node = sim
        .nodes()
        .into_iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"));
    IpAddr::V4(node.address)
}

fn options(sim: &Simulator) -> ConnectOptions {
    ConnectOptions {
        port: sim.config().port,
        ..ConnectOptions::default()
    }
}

async fn client_for(sim: &Simulator, role: ClientRole, node: &str) -> TalosClient {
    TalosClient::connect(
        &credentials(&sim.talosconfig(role)),
        Target::Node(address(sim, node)),
        &options(sim),
    )
    .await
    .unwrap_or_else(|e| panic!("connecting to {node}: {e}"))
}

/// Retries `call` while the node is unreachable (rebooting), as the controller will.
async fn when_reachable<T, F, Fut>(mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, TalosError>>,
{
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        match call().await {
            Ok(value) => return value,
            Err(e) if e.is_unreachable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("call failed: {e}"),
        }
    }
}

/// Waits until the node answers with a boot id other than `before`.
async fn rebooted(client: &TalosClient, before: &str) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while when_reachable(|| client.boot_id()).await == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the node never rebooted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn read_calls_answer_on_every_node_directly_and_through_an_endpoint() {
    init();
    let sim = Simulator::start(five_nodes("1.11.6"))
        .await
        .expect("simulator");
    let creds = credentials(&sim.talosconfig(ClientRole::Admin));
    let endpoint = address(&sim, "cp-1").to_string();

    for node in sim.nodes() {
        let direct = client_for(&sim, ClientRole::Admin, &node.name).await;
        assert_eq!(direct.version().await.expect("version").tag, "v1.11.6");
        assert_eq!(direct.nodename().await.expect("nodename"), node.name);
        let services = direct.service_list().await.expect("services");
        assert!(
            services
                .iter()
                .any(|s| s.id == "kubelet" && s.is_running_and_healthy())
        );
        assert_eq!(
            services.iter().any(|s| s.id == "etcd"),
            node.role.is_control_plane(),
            "etcd runs on control planes only ({})",
            node.name
        );

        // The same machine through cp-1's apid, with the `node` header.
        let proxied = TalosClient::connect(
            &creds,
            Target::ViaEndpoint {
                endpoint: endpoint.clone(),
                node: node.address.to_string(),
            },
            &options(&sim),
        )
        .await
        .expect("connect via endpoint");
        assert_eq!(proxied.nodename().await.expect("nodename"), node.name);
        let status = proxied.machine_status().await.expect("machine status");
        assert!(
            status.status.as_ref().is_some_and(|s| s.ready),
            "{status:?}"
        );
    }

    let cp = client_for(&sim, ClientRole::Admin, "cp-2").await;
    let members = cp.etcd_member_list().await.expect("members");
    assert_eq!(members.len(), 3);
    let status = cp.etcd_status().await.expect("etcd status");
    assert!(members.iter().any(|m| m.id == status.member_id));
    let config = cp.machine_config().await.expect("machine config");
    let text = String::from_utf8_lossy(config.as_bytes()).into_owned();
    assert!(
        text.contains("registry.k8s.io/kube-apiserver:v1.34.1"),
        "{text}"
    );
    assert_eq!(
        cp.talos_version_resource().await.expect("version resource"),
        Some("v1.11.6".to_string())
    );

    // Leadership moves away from whoever holds it.
    let leader_id = status.leader;
    let leader = members
        .iter()
        .find(|m| m.id == leader_id)
        .map(|m| m.hostname.clone())
        .expect("leader among members");
    let on_leader = client_for(&sim, ClientRole::Admin, &leader).await;
    let new_leader = on_leader.etcd_forfeit_leadership().await.expect("forfeit");
    assert!(
        !new_leader.is_empty() && new_leader != leader,
        "{new_leader}"
    );

    let worker = client_for(&sim, ClientRole::Admin, "worker-1").await;
    assert!(matches!(
        worker.etcd_status().await,
        Err(TalosError::Unimplemented { .. })
    ));
}

#[tokio::test]
async fn legacy_upgrade_reboots_into_the_new_version() {
    init();
    let sim = Simulator::start(five_nodes("1.11.6"))
        .await
        .expect("simulator");
    let client = client_for(&sim, ClientRole::Admin, "worker-1").await;
    let boot_before = client.boot_id().await.expect("boot id");
    let mut events = client
        .events(EventsOptions::default())
        .await
        .expect("events");

    // Keep the node down after its reboot so the outage is observable without racing the clock.
    sim.inject_fault("worker-1", Fault::NeverReturns)
        .expect("fault");
    let actor = client
        .upgrade_legacy(
            "ghcr.io/siderolabs/installer:v1.12.0",
            &LegacyUpgradeOptions {
                preserve: true,
                ..LegacyUpgradeOptions::default()
            },
        )
        .await
        .expect("upgrade accepted");
    assert!(!actor.is_empty());

    let mut saw_upgrade_sequence = false;
    let mut saw_upgrading_stage = false;
    while let Some(event) = tokio::time::timeout(PATIENCE, events.next())
        .await
        .expect("events keep coming until the reboot")
    {
        let event = match event {
            Ok(event) => event,
            // The stream ends with the connection when the machine powers off.
            Err(e) => {
                assert!(e.is_unreachable(), "stream ended with {e}");
                break;
            }
        };
        match &event.payload {
            EventPayload::Sequence(seq) if seq.sequence == "upgrade" => {
                assert_eq!(event.actor_id, actor);
                saw_upgrade_sequence = true;
            }
            EventPayload::MachineStatus(ms)
                if ms.stage() == machine::machine_status_event::MachineStage::Upgrading =>
            {
                saw_upgrading_stage = true;
            }
            _ => {}
        }
    }
    assert!(saw_upgrade_sequence && saw_upgrading_stage);

    sim.wait_for("worker-1", PATIENCE, |s| s.down)
        .await
        .expect("node powers off");
    let while_down = client.version().await;
    assert!(
        matches!(&while_down, Err(e) if e.is_unreachable()),
        "a rebooting node is Unreachable, got {while_down:?}"
    );

    sim.clear_faults("worker-1").expect("clear");
    let version = when_reachable(|| client.version()).await;
    assert_eq!(version.tag, "v1.12.0");
    let boot_after = when_reachable(|| client.boot_id()).await;
    assert_ne!(boot_after, boot_before, "a reboot changes the boot id");

    let upgrades: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method == "/machine.MachineService/Upgrade")
        .collect();
    assert_eq!(upgrades.len(), 1);
    assert_eq!(upgrades[0].node, "worker-1");
    assert_eq!(
        upgrades[0].params["image"],
        "ghcr.io/siderolabs/installer:v1.12.0"
    );
}

#[tokio::test]
async fn talos_1_13_installs_without_reboot_then_reboots_and_can_roll_back() {
    init();
    let config = SimConfig::new("client-113")
        .with_node(NodeConfig::control_plane("cp-1", "1.13.0", "1.35.0"))
        .with_node(NodeConfig::worker("worker-1", "1.13.0", "1.35.0"))
        .with_timings(Timings::fast());
    let sim = Simulator::start(config).await.expect("simulator");
    let client = client_for(&sim, ClientRole::Admin, "worker-1").await;
    // The generic installer has no 1.14 release; the Image Factory's installer is the default one.
    let image = "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.14.0";

    let pulled = client.image_pull(image).await.expect("pull");
    assert!(pulled.contains("installer"), "{pulled}");
    let outcome = client.lifecycle_upgrade(image).await.expect("install");
    assert_eq!(outcome.exit_code, 0);
    assert!(!outcome.messages.is_empty());
    // Installed into the other slot; still running the old one until a reboot.
    assert_eq!(client.version().await.expect("version").tag, "v1.13.0");

    let mut watch = client
        .cosi_watch::<MachineStatusSpec>(
            resources::machine_status::NAMESPACE,
            resources::machine_status::TYPE,
            Some(resources::machine_status::ID),
            false,
        )
        .await
        .expect("watch machine status");
    let first = tokio::time::timeout(PATIENCE, watch.next())
        .await
        .expect("initial event")
        .expect("stream open")
        .expect("event");
    assert_eq!(first.event_type, CosiEventType::Created);

    let boot_before = client.boot_id().await.expect("boot id");
    let actor = client.reboot(RebootMode::Default).await.expect("reboot");
    assert!(!actor.is_empty());
    // Reboot answers before the machine goes down; a new boot id is the proof it came back.
    rebooted(&client, &boot_before).await;
    assert_eq!(when_reachable(|| client.version()).await.tag, "v1.14.0");

    // Rollback boots the previous slot again.
    client.rollback().await.expect("rollback");
    sim.wait_for("worker-1", PATIENCE, |s| {
        s.talos_version == "1.13.0" && !s.down && s.ready
    })
    .await
    .expect("rolled back");
    assert_eq!(when_reachable(|| client.version()).await.tag, "v1.13.0");

    let methods: Vec<_> = sim.record().into_iter().map(|c| c.method).collect();
    for expected in [
        "/machine.ImageService/Pull",
        "/machine.LifecycleService/Upgrade",
        "/machine.MachineService/Reboot",
        "/machine.MachineService/Rollback",
    ] {
        assert_eq!(
            methods.iter().filter(|m| *m == expected).count(),
            1,
            "{expected} in {methods:?}"
        );
    }
}

#[tokio::test]
async fn apply_configuration_changes_components_within_the_support_matrix() {
    init();
    let sim = Simulator::start(five_nodes("1.12.0"))
        .await
        .expect("simulator");
    let client = client_for(&sim, ClientRole::Admin, "cp-1").await;
    let config = client.machine_config().await.expect("config");
    let text = String::from_utf8_lossy(config.as_bytes()).into_owned();

    let newer = text.replace(
        "registry.k8s.io/kube-apiserver:v1.34.1",
        "registry.k8s.io/kube-apiserver:v1.35.0",
    );
    let outcome = client
        .apply_configuration(newer.into_bytes(), ApplyMode::NoReboot, false)
        .await
        .expect("apply");
    assert_eq!(outcome.mode, ApplyMode::NoReboot);
    sim.wait_for("cp-1", PATIENCE, |s| {
        s.control_plane
            .as_ref()
            .is_some_and(|cp| cp.apiserver.version == "1.35.0" && cp.apiserver.running)
    })
    .await
    .expect("kube-apiserver restarted on 1.35.0");

    // Talos 1.12 supports Kubernetes up to 1.35: 1.36 is refused and nothing changes.
    let too_new = text.replace(
        "registry.k8s.io/kube-apiserver:v1.34.1",
        "registry.k8s.io/kube-apiserver:v1.36.0",
    );
    let refused = client
        .apply_configuration(too_new.into_bytes(), ApplyMode::NoReboot, false)
        .await;
    match refused {
        Err(TalosError::InvalidArgument { message, .. }) => {
            assert!(message.contains("1.36.0"), "{message}")
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[tokio::test]
async fn refusals_are_typed_and_never_touch_a_node() {
    init();
    let sim = Simulator::start(five_nodes("1.11.6"))
        .await
        .expect("simulator");
    let worker = address(&sim, "worker-2");

    // A reader may look but not upgrade.
    let reader = client_for(&sim, ClientRole::Reader, "worker-2").await;
    assert!(reader.version().await.is_ok());
    let denied = reader
        .upgrade_legacy(
            "ghcr.io/siderolabs/installer:v1.12.0",
            &LegacyUpgradeOptions::default(),
        )
        .await;
    assert!(
        matches!(denied, Err(TalosError::PermissionDenied { .. })),
        "{denied:?}"
    );

    // A client certificate from another CA, and an expired one, are refused by the node.
    let foreign = credentials(&sim.talosconfig_from_other_ca());
    let (crt, key) = sim.client_identity_pem(ClientRole::Admin, Validity::expired());
    let expired = TalosCredentials::from_pem(sim.ca_pem(), crt, key).expect("credentials");
    for (what, creds) in [("foreign CA", foreign), ("expired", expired)] {
        let attempt = async {
            let client = TalosClient::connect(&creds, Target::Node(worker), &options(&sim)).await?;
            client.version().await
        };
        let result = attempt.await;
        assert!(
            matches!(&result, Err(TalosError::Tls { .. })),
            "{what}: {result:?}"
        );
    }

    // A broken talosconfig is a configuration error that names the problem, not the key.
    let talosconfig = sim.talosconfig(ClientRole::Admin);
    let broken = talosconfig.replace("key: ", "key: !!!");
    let error = Talosconfig::from_yaml(&broken)
        .and_then(|c| c.current_context()?.credentials())
        .expect_err("broken key");
    assert!(matches!(error, TalosError::Config(_)), "{error:?}");
    assert!(error.to_string().contains("key"), "{error}");

    assert!(
        sim.record().is_empty(),
        "refused calls must not reach a node: {:?}",
        sim.record()
    );
}

/// Reads a whole etcd snapshot through the client.
async fn read_snapshot(client: &TalosClient) -> Result<Vec<u8>, TalosError> {
    let mut stream = client.etcd_snapshot().await?;
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next_chunk().await? {
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

#[tokio::test]
async fn etcd_snapshot_streams_from_control_planes_to_the_roles_talos_allows() {
    init();
    let sim = Simulator::start(five_nodes("1.11.6"))
        .await
        .expect("simulator");
    let cp = client_for(&sim, ClientRole::Admin, "cp-1").await;
    let snapshot = read_snapshot(&cp).await.expect("snapshot");
    // Whole bbolt pages, then the SHA-256 of them that etcd appends (etcdutl's hasChecksum).
    assert_eq!(snapshot.len() % 512, 32, "{}", snapshot.len());
    assert!(snapshot.len() > 256 * 1024, "{}", snapshot.len());
    let (db, hash) = snapshot.split_at(snapshot.len() - 32);
    assert_eq!(
        ring::digest::digest(&ring::digest::SHA256, db).as_ref(),
        hash
    );
    // Every member serves the same database.
    let cp2 = client_for(&sim, ClientRole::Admin, "cp-2").await;
    assert_eq!(read_snapshot(&cp2).await.expect("cp-2"), snapshot);
    // os:etcd:backup and os:operator may take one; os:reader may not (talos v1.14.1 machined.go).
    let backup = client_for(&sim, ClientRole::Custom("os:etcd:backup".into()), "cp-1").await;
    assert_eq!(read_snapshot(&backup).await.expect("backup role"), snapshot);
    let reader = client_for(&sim, ClientRole::Reader, "cp-1").await;
    assert!(matches!(
        read_snapshot(&reader).await,
        Err(TalosError::PermissionDenied { .. })
    ));
    // A worker has no etcd: Talos's CheckControlplane answer.
    let worker = client_for(&sim, ClientRole::Admin, "worker-1").await;
    match read_snapshot(&worker).await {
        Err(TalosError::Unimplemented { message, .. }) => assert_eq!(
            message,
            "etcd snapshot is only available on control plane nodes"
        ),
        other => panic!("worker answered {other:?}"),
    }
    // Recorded with the bytes sent.
    let calls: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method == "/machine.MachineService/EtcdSnapshot")
        .collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert_eq!(calls[0].node, "cp-1");
    assert_eq!(calls[0].params["size"], snapshot.len());
    assert_eq!(calls[0].result, "ok");

    // The faults: an error from the node, or a stream that ends early without one.
    sim.inject_fault("cp-1", Fault::EtcdSnapshotFails)
        .expect("fault");
    match read_snapshot(&cp).await {
        Err(TalosError::Status { message, .. }) => {
            assert!(
                message.starts_with("failed reading etcd snapshot"),
                "{message}"
            )
        }
        other => panic!("faulted snapshot answered {other:?}"),
    }
    sim.clear_faults("cp-1").expect("clear");
    sim.inject_fault("cp-1", Fault::EtcdSnapshotTruncated)
        .expect("fault");
    let short = read_snapshot(&cp)
        .await
        .expect("a truncated stream ends cleanly");
    assert_eq!(short.len(), snapshot.len() / 2);
}
