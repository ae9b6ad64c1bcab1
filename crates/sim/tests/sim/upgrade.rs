//! Upgrades look like upgrades on the wire: the legacy MachineService.Upgrade flow and the Talos 1.13+
//! flow (ImageService.Pull, LifecycleService.Upgrade, Reboot), with a real outage in between.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use talos_api::proto::machine;
use talos_api::proto::machine::machine_service_client::MachineServiceClient;
use talos_sim::{MachineStage, Role, SimConfig, Simulator, Timings, max_concurrently_down};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use machine::machine_status_event::MachineStage as Stage;
use machine::sequence_event::Action as SeqAction;

/// Long enough reboots that "refused while down" is observable without racing the comeback.
fn timings() -> Timings {
    Timings {
        reboot_ms: 800,
        ..Timings::fast()
    }
}

async fn start(config: SimConfig) -> Simulator {
    init();
    Simulator::start(config.with_timings(timings()))
        .await
        .expect("simulator starts")
}

async fn boot_id(client: &mut MachineServiceClient<Channel>) -> String {
    let mut stream = client
        .read(machine::ReadRequest {
            path: "/proc/sys/kernel/random/boot_id".into(),
        })
        .await
        .expect("Read")
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        bytes.extend(chunk.expect("chunk").bytes);
    }
    String::from_utf8(bytes).unwrap().trim().to_string()
}

async fn version_tag(client: &mut MachineServiceClient<Channel>) -> String {
    let reply = client.version(()).await.expect("Version").into_inner();
    reply.messages[0].version.as_ref().unwrap().tag.clone()
}

/// While the snapshot says the node is down, a TCP connection to its port is refused.
async fn assert_refused_while_down(sim: &Simulator, node: &str) {
    let before = wait_snapshot(sim, node, "node down", |s| s.down).await;
    let info = sim.nodes().into_iter().find(|n| n.name == node).unwrap();
    let addr = SocketAddr::from((info.address, info.port));
    let result = tokio::net::TcpStream::connect(addr).await;
    let after = sim.node_snapshot(node).unwrap();
    assert!(
        after.down && after.boot_id == before.boot_id,
        "{node} came back before the check ran; the machine is badly overloaded"
    );
    let err = result.expect_err("connection must be refused while the node is down");
    assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused, "{err}");
}

fn events_request(tail: i32, actor: &str) -> machine::EventsRequest {
    machine::EventsRequest {
        tail_events: tail,
        with_actor_id: actor.to_string(),
        ..Default::default()
    }
}

/// The boot after a reboot, replayed from the node's buffer: Sequence boot START (no actor),
/// BOOTING not ready with unmet conditions, Sequence boot STOP, then RUNNING and ready.
async fn assert_boot_events(client: &mut MachineServiceClient<Channel>) {
    let mut stream = client
        .events(events_request(-1, ""))
        .await
        .expect("Events")
        .into_inner();
    let (events, ended) = collect_until(
        &mut stream,
        |e| matches!(e, Ev::Status { stage, ready: true, .. } if *stage == Stage::Running as i32),
    )
    .await;
    assert!(!ended, "stream ended early: {events:#?}");
    assert_eq!(
        events[0],
        Ev::Hello {
            actor: String::new()
        }
    );
    let pos = |pred: &dyn Fn(&Ev) -> bool| {
        events
            .iter()
            .position(pred)
            .unwrap_or_else(|| panic!("missing event in {events:#?}"))
    };
    let boot_start = pos(&|e| {
        matches!(e, Ev::Sequence { name, action, actor, .. }
            if name == "boot" && *action == SeqAction::Start as i32 && actor.is_empty())
    });
    let booting = pos(&|e| {
        matches!(e, Ev::Status { stage, ready: false, unmet }
            if *stage == Stage::Booting as i32 && *unmet > 0)
    });
    let boot_stop = pos(&|e| {
        matches!(e, Ev::Sequence { name, action, .. }
            if name == "boot" && *action == SeqAction::Stop as i32)
    });
    let ready = events.len() - 1;
    assert!(
        boot_start < booting && booting < boot_stop && boot_stop < ready,
        "{events:#?}"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, Ev::Service { name, .. } if name == "kubelet")),
        "services start during boot: {events:#?}"
    );
}

#[tokio::test]
async fn legacy_upgrade_of_a_control_plane() {
    let sim = start(SimConfig::uniform("legacy", 3, 1, "1.11.6", "1.34.1")).await;
    let mut client = admin(&sim, "cp-1").await;

    // As talosctl: events first (hello), boot id, then the upgrade.
    let mut events = client
        .events(events_request(0, ""))
        .await
        .expect("Events")
        .into_inner();
    let hello = events.next().await.unwrap().unwrap();
    assert!(hello.data.is_none());
    assert_eq!(hello.id.len(), 20);
    let old_boot_id = boot_id(&mut client).await;
    assert_eq!(old_boot_id, sim.node_snapshot("cp-1").unwrap().boot_id);

    let image = "ghcr.io/siderolabs/installer:v1.12.0";
    let reply = client
        .upgrade(machine::UpgradeRequest {
            image: image.into(),
            preserve: true,
            ..Default::default()
        })
        .await
        .expect("Upgrade accepted")
        .into_inner();
    let upgrade = &reply.messages[0];
    assert_eq!(upgrade.ack, "Upgrade request received");
    let actor = upgrade.actor_id.clone();
    uuid::Uuid::parse_str(&actor).expect("actor id is a uuid");

    // The live stream shows the sequence until the machine goes away.
    let (seen, ended) = collect_until(&mut events, |_| false).await;
    assert!(ended);
    let first = seen.first().expect("events before the reboot");
    assert_eq!(
        *first,
        Ev::Sequence {
            name: "upgrade".into(),
            action: SeqAction::Start as i32,
            actor: actor.clone(),
            error: None
        }
    );
    for e in &seen {
        if let Ev::Phase { actor: a, .. }
        | Ev::Task { actor: a, .. }
        | Ev::Sequence { actor: a, .. } = e
        {
            assert_eq!(a, &actor, "sequence events carry the actor id");
        }
    }
    let phases: Vec<&str> = seen
        .iter()
        .filter_map(|e| match e {
            Ev::Phase {
                name, action: 0, ..
            } => Some(name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        phases,
        [
            "drain",
            "cleanup",
            "dbus",
            "stopServices",
            "unmount",
            "unmountBind",
            "unmountSystem",
            "volumeFinalize",
            "upgrade",
            "meta",
            "kexec",
            "stopEverything",
            "reboot"
        ]
    );
    assert!(
        seen.iter()
            .any(|e| matches!(e, Ev::Task { name, .. } if name == "cordonAndDrainNode"))
    );
    let stages: Vec<i32> = seen
        .iter()
        .filter_map(|e| match e {
            Ev::Status { stage, .. } => Some(*stage),
            _ => None,
        })
        .collect();
    assert_eq!(stages, [Stage::Upgrading as i32, Stage::Rebooting as i32]);

    assert_refused_while_down(&sim, "cp-1").await;

    let mut client = admin_when_up(&sim, "cp-1").await;
    assert_boot_events(&mut client).await;
    assert_eq!(version_tag(&mut client).await, "v1.12.0");
    let new_boot_id = boot_id(&mut client).await;
    assert_ne!(new_boot_id, old_boot_id);

    let snapshot = wait_snapshot(&sim, "cp-1", "ready on 1.12.0", |s| {
        s.ready && s.stage == MachineStage::Running
    })
    .await;
    assert_eq!(snapshot.talos_version, "1.12.0");
    assert_eq!(snapshot.previous_version.as_deref(), Some("1.11.6"));
    assert_eq!(snapshot.installer_image, image);
    assert!(!snapshot.cordoned);
    assert!(snapshot.etcd.as_ref().unwrap().healthy);

    let calls = sim.record();
    assert_eq!(calls.len(), 1, "{calls:#?}");
    assert_eq!(calls[0].method, "/machine.MachineService/Upgrade");
    assert_eq!(calls[0].node, "cp-1");
    assert_eq!(calls[0].params["image"], image);
    assert_eq!(calls[0].params["preserve"], true);
    assert_eq!(calls[0].result, "ok");
    let power = sim.power_events();
    assert_eq!(power.len(), 2, "{power:#?}");
    assert_eq!(power[1].talos_version, "1.12.0");
}

#[tokio::test]
async fn upgrade_of_every_control_plane_one_at_a_time() {
    let sim = start(SimConfig::uniform("serial", 3, 0, "1.11.6", "1.34.1")).await;
    for cp in ["cp-1", "cp-2", "cp-3"] {
        let mut client = admin_when_up(&sim, cp).await;
        client
            .upgrade(machine::UpgradeRequest {
                image: "ghcr.io/siderolabs/installer:v1.11.7".into(),
                ..Default::default()
            })
            .await
            .expect("upgrade accepted while every member is healthy");
        wait_snapshot(&sim, cp, "upgraded and ready", |s| {
            s.talos_version == "1.11.7" && s.ready && s.etcd.as_ref().is_some_and(|e| e.healthy)
        })
        .await;
    }
    let power = sim.power_events();
    assert_eq!(max_concurrently_down(&power, Some(Role::ControlPlane)), 1);
    assert_eq!(
        sim.record()
            .iter()
            .filter(|c| c.method.ends_with("/Upgrade"))
            .count(),
        3
    );
    let json = serde_json::to_string(&sim.record_json()).unwrap();
    assert!(json.contains("installer:v1.11.7"));
}

#[tokio::test]
async fn talos_1_13_pull_install_reboot_and_rollback() {
    let sim = start(SimConfig::uniform("new-flow", 1, 1, "1.13.0", "1.34.1")).await;
    // The generic installer has no 1.14 release; the Image Factory's installer is the default one.
    let image = "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.14.0";
    let containerd = talos_api::proto::common::ContainerdInstance {
        driver: 1,
        namespace: 1,
    };

    // 1. ImageService.Pull: layer progress, then the resolved name.
    let mut images = images(&sim, "worker-1").await;
    let mut pull = images
        .pull(machine::ImageServicePullRequest {
            containerd: Some(containerd),
            image_ref: image.into(),
        })
        .await
        .expect("Pull")
        .into_inner();
    let mut progress = 0;
    let mut name = None;
    while let Some(msg) = pull.next().await {
        match msg.expect("pull message").response.expect("response") {
            machine::image_service_pull_response::Response::PullProgress(_) => progress += 1,
            machine::image_service_pull_response::Response::Name(n) => name = Some(n),
        }
    }
    assert!(progress > 0);
    assert_eq!(name.as_deref(), Some(image));

    // 2. LifecycleService.Upgrade: installer output, exit code 0, still running the old version.
    let mut lifecycle = lifecycle(&sim, "worker-1").await;
    let mut install = lifecycle
        .upgrade(machine::LifecycleServiceUpgradeRequest {
            containerd: Some(containerd),
            source: Some(machine::InstallArtifactsSource {
                image_name: image.into(),
            }),
        })
        .await
        .expect("LifecycleService.Upgrade")
        .into_inner();
    let mut lines = Vec::new();
    let mut exit = None;
    while let Some(msg) = install.next().await {
        use machine::lifecycle_service_install_progress::Response;
        match msg
            .expect("install message")
            .progress
            .unwrap()
            .response
            .unwrap()
        {
            Response::Message(line) => lines.push(line),
            Response::ExitCode(code) => exit = Some(code),
        }
    }
    assert_eq!(exit, Some(0), "{lines:#?}");
    assert!(lines.len() >= 2);
    let mut client = admin(&sim, "worker-1").await;
    assert_eq!(version_tag(&mut client).await, "v1.13.0", "no reboot yet");
    let snapshot = sim.node_snapshot("worker-1").unwrap();
    assert_eq!(snapshot.installed_version.as_deref(), Some("1.14.0"));
    assert!(snapshot.ready && !snapshot.down);

    // 3. Reboot: the installed slot boots.
    let old_boot_id = boot_id(&mut client).await;
    let mut events = client
        .events(events_request(0, ""))
        .await
        .unwrap()
        .into_inner();
    let _hello = events.next().await;
    let reboot = client
        .reboot(machine::RebootRequest { mode: 0 })
        .await
        .expect("Reboot")
        .into_inner();
    let actor = reboot.messages[0].actor_id.clone();
    assert!(!actor.is_empty());
    let (seen, ended) = collect_until(&mut events, |_| false).await;
    assert!(ended);
    assert_eq!(
        seen[0],
        Ev::Sequence {
            name: "reboot".into(),
            action: SeqAction::Start as i32,
            actor: actor.clone(),
            error: None
        }
    );
    assert!(seen.contains(&Ev::Status {
        stage: Stage::Rebooting as i32,
        ready: false,
        unmet: 0
    }));
    assert_refused_while_down(&sim, "worker-1").await;
    let mut client = admin_when_up(&sim, "worker-1").await;
    assert_eq!(version_tag(&mut client).await, "v1.14.0");
    assert_ne!(boot_id(&mut client).await, old_boot_id);
    let snapshot = wait_snapshot(&sim, "worker-1", "ready on 1.14.0", |s| s.ready).await;
    assert_eq!(snapshot.previous_version.as_deref(), Some("1.13.0"));
    assert_eq!(snapshot.installed_version, None);

    // 4. Rollback flips back to the previous slot and reboots.
    client
        .rollback(machine::RollbackRequest {})
        .await
        .expect("Rollback");
    wait_snapshot(&sim, "worker-1", "rolled back", |s| {
        s.talos_version == "1.13.0" && s.ready
    })
    .await;

    let methods: Vec<String> = sim.record().into_iter().map(|c| c.method).collect();
    assert_eq!(
        methods,
        [
            "/machine.ImageService/Pull",
            "/machine.LifecycleService/Upgrade",
            "/machine.MachineService/Reboot",
            "/machine.MachineService/Rollback",
        ]
    );
    assert!(
        sim.record().iter().all(|c| c.result == "ok"),
        "{:#?}",
        sim.record()
    );
}

#[tokio::test]
async fn events_filters_and_tails() {
    let sim = start(SimConfig::uniform("events", 1, 0, "1.11.6", "1.34.1")).await;
    let mut client = admin(&sim, "cp-1").await;

    // tail -1: the initial boot is in the buffer.
    let mut all = client
        .events(events_request(-1, ""))
        .await
        .unwrap()
        .into_inner();
    let (events, _) =
        collect_until(&mut all, |e| matches!(e, Ev::Status { ready: true, .. })).await;
    assert!(events.len() > 3);

    // tail 2: exactly the last two buffered events after the hello.
    let mut last2 = client
        .events(events_request(2, ""))
        .await
        .unwrap()
        .into_inner();
    let hello = last2.next().await.unwrap().unwrap();
    assert!(hello.data.is_none());
    let a = decode(&last2.next().await.unwrap().unwrap());
    let b = decode(&last2.next().await.unwrap().unwrap());
    assert_eq!(&b, events.last().unwrap());
    assert_eq!(&a, &events[events.len() - 2]);

    // Actor filter: the hello echoes it; only that actor's events follow.
    let mut filtered = client
        .events(events_request(0, "someone-else"))
        .await
        .unwrap()
        .into_inner();
    let hello = filtered.next().await.unwrap().unwrap();
    assert_eq!(hello.actor_id, "someone-else");

    // Mutually exclusive tail options.
    let status = client
        .events(machine::EventsRequest {
            tail_events: 1,
            tail_seconds: 5,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    // The live, filtered stream stays quiet for another actor even while the node reboots...
    client
        .reboot(machine::RebootRequest { mode: 0 })
        .await
        .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(30), filtered.next()).await;
    match next {
        Ok(Some(Err(_))) | Ok(None) => {} // ...and ends with the connection.
        other => panic!("unexpected: {other:?}"),
    }
    wait_snapshot(&sim, "cp-1", "back", |s| s.ready && !s.down).await;
}

#[tokio::test]
async fn a_second_sequence_is_locked_and_the_cordon_outlives_the_reboot() {
    let sim = start(SimConfig::uniform("locked", 1, 1, "1.11.6", "1.34.1")).await;
    // Keep the worker down after its reboot so the cordon can be checked while it is off.
    sim.inject_fault("worker-1", talos_sim::Fault::NeverReturns)
        .unwrap();
    let mut client = admin(&sim, "worker-1").await;
    let mut events = client
        .events(events_request(0, ""))
        .await
        .unwrap()
        .into_inner();
    let _hello = events.next().await;
    let image = "ghcr.io/siderolabs/installer:v1.12.0";
    let request = machine::UpgradeRequest {
        image: image.into(),
        ..Default::default()
    };
    client
        .upgrade(request.clone())
        .await
        .expect("first upgrade");
    let second = client
        .upgrade(request)
        .await
        .expect("a locked upgrade is still acknowledged")
        .into_inner();
    let second_actor = second.messages[0].actor_id.clone();
    let reboot = client
        .reboot(machine::RebootRequest::default())
        .await
        .expect("a locked reboot is still acknowledged")
        .into_inner();
    let reboot_actor = reboot.messages[0].actor_id.clone();

    let (seen, _) = collect_until(&mut events, |_| false).await;
    let locked = |actor: &str, sequence: &str| {
        seen.iter().any(|e| {
            matches!(e, Ev::Sequence { name, action, actor: a, error: Some(code) }
                if name == sequence && a == actor && *action == SeqAction::Noop as i32
                    && *code == talos_api::proto::common::Code::Locked as i32)
        })
    };
    assert!(locked(&second_actor, "upgrade"), "{seen:#?}");
    assert!(locked(&reboot_actor, "reboot"), "{seen:#?}");

    let down = wait_snapshot(&sim, "worker-1", "down", |s| s.down).await;
    assert!(down.cordoned, "machined's cordon holds through the reboot");
    sim.clear_faults("worker-1").unwrap();
    let back = wait_snapshot(&sim, "worker-1", "back", |s| s.ready && !s.down).await;
    assert!(!back.cordoned, "lifted after boot");
    assert_eq!(back.talos_version, "1.12.0");
    // The locked requests changed nothing: one reboot only.
    assert_eq!(sim.power_events().len(), 2);
}
