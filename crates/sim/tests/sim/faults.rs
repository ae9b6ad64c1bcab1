//! Each injected fault produces the failure a controller must survive, and clearing it recovers.

use std::time::Duration;

use crate::common::*;
use talos_api::proto::machine;
use talos_sim::{Fault, MachineStage, SimConfig, Simulator, Timings};
use tokio_stream::StreamExt;
use tonic::Code;

async fn start(talos: &str) -> Simulator {
    init();
    let config = SimConfig::uniform("faults", 3, 1, talos, "1.34.1").with_timings(Timings::fast());
    Simulator::start(config).await.expect("simulator starts")
}

fn upgrade(image: &str) -> machine::UpgradeRequest {
    machine::UpgradeRequest {
        image: image.into(),
        ..Default::default()
    }
}

#[tokio::test]
async fn installer_pull_failure_fails_the_legacy_upgrade_rpc() {
    let sim = start("1.11.6").await;
    sim.inject_fault("worker-1", Fault::InstallerPullFails)
        .unwrap();
    let mut client = admin(&sim, "worker-1").await;
    let image = "ghcr.io/siderolabs/installer:v1.12.0";
    let status = client.upgrade(upgrade(image)).await.unwrap_err();
    assert!(
        status
            .message()
            .starts_with(&format!("error validating installer image \"{image}\": ")),
        "{status:?}"
    );
    let snapshot = sim.node_snapshot("worker-1").unwrap();
    assert_eq!(snapshot.talos_version, "1.11.6");
    assert!(snapshot.ready && !snapshot.down);
    let calls = sim.record();
    assert_eq!(calls.len(), 1);
    assert!(
        calls[0].result.contains("error validating installer image"),
        "{calls:#?}"
    );

    sim.clear_faults("worker-1").unwrap();
    client
        .upgrade(upgrade(image))
        .await
        .expect("works once cleared");
    wait_snapshot(&sim, "worker-1", "upgraded", |s| {
        s.talos_version == "1.12.0" && s.ready
    })
    .await;
}

#[tokio::test]
async fn installer_pull_failure_on_the_1_13_path() {
    let sim = start("1.13.0").await;
    sim.inject_fault("worker-1", Fault::InstallerPullFails)
        .unwrap();
    let image = "ghcr.io/siderolabs/installer:v1.13.4";
    let mut images = images(&sim, "worker-1").await;
    let status = images
        .pull(machine::ImageServicePullRequest {
            containerd: None,
            image_ref: image.into(),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);

    // The installer itself reports the failure as an exit code, not a gRPC error.
    let mut lifecycle = lifecycle(&sim, "worker-1").await;
    let mut stream = lifecycle
        .upgrade(machine::LifecycleServiceUpgradeRequest {
            containerd: None,
            source: Some(machine::InstallArtifactsSource {
                image_name: image.into(),
            }),
        })
        .await
        .expect("the stream starts")
        .into_inner();
    let mut exit = None;
    while let Some(msg) = stream.next().await {
        if let Some(machine::lifecycle_service_install_progress::Response::ExitCode(code)) =
            msg.unwrap().progress.unwrap().response
        {
            exit = Some(code);
        }
    }
    assert_eq!(exit, Some(1));
    assert_eq!(
        sim.node_snapshot("worker-1").unwrap().installed_version,
        None
    );
}

#[tokio::test]
async fn never_returns_keeps_the_node_down_until_cleared() {
    let sim = start("1.11.6").await;
    sim.inject_fault("worker-1", Fault::NeverReturns).unwrap();
    let before = sim.node_snapshot("worker-1").unwrap();
    let mut client = admin(&sim, "worker-1").await;
    client
        .reboot(machine::RebootRequest::default())
        .await
        .unwrap();
    wait_snapshot(&sim, "worker-1", "down", |s| s.down).await;
    // Well past reboot_ms, still down and refusing connections.
    tokio::time::sleep(Duration::from_millis(sim.config().timings.reboot_ms * 4)).await;
    let snapshot = sim.node_snapshot("worker-1").unwrap();
    assert!(snapshot.down);
    assert_eq!(snapshot.boot_id, before.boot_id);
    let talosconfig = sim.talosconfig(talos_sim::ClientRole::Admin);
    assert!(
        connect(
            &endpoint(&sim, "worker-1"),
            tls_from_talosconfig(&talosconfig)
        )
        .await
        .is_err()
    );

    sim.clear_faults("worker-1").unwrap();
    let snapshot = wait_snapshot(&sim, "worker-1", "back", |s| s.ready && !s.down).await;
    assert_ne!(snapshot.boot_id, before.boot_id);
}

#[tokio::test]
async fn boots_old_version_falls_back_to_the_old_slot() {
    let sim = start("1.11.6").await;
    sim.inject_fault("worker-1", Fault::BootsOldVersion)
        .unwrap();
    let before = sim.node_snapshot("worker-1").unwrap();
    let mut client = admin(&sim, "worker-1").await;
    client
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.12.0"))
        .await
        .expect("upgrade accepted");
    let after = wait_snapshot(&sim, "worker-1", "rebooted", |s| {
        s.boot_id != before.boot_id && s.ready
    })
    .await;
    assert_eq!(after.talos_version, "1.11.6", "the bootloader fell back");
    let mut client = admin_when_up(&sim, "worker-1").await;
    let tag = client.version(()).await.unwrap().into_inner().messages[0]
        .version
        .clone()
        .unwrap()
        .tag;
    assert_eq!(tag, "v1.11.6");
}

#[tokio::test]
async fn etcd_unhealthy_member_refuses_control_plane_upgrades() {
    let sim = start("1.11.6").await;
    sim.inject_fault("cp-2", Fault::EtcdUnhealthy).unwrap();
    assert!(!sim.node_snapshot("cp-2").unwrap().etcd.unwrap().healthy);

    let mut client = admin(&sim, "cp-1").await;
    let status = client
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.12.0"))
        .await
        .unwrap_err();
    assert!(status.message().contains("not healthy"), "{status:?}");

    // EtcdStatus on the faulted member reports it.
    let mut cp2 = admin(&sim, "cp-2").await;
    let status = cp2.etcd_status(()).await.unwrap().into_inner();
    assert!(
        !status.messages[0]
            .member_status
            .as_ref()
            .unwrap()
            .errors
            .is_empty()
    );

    // Workers have no etcd pre-checks.
    let mut worker = admin(&sim, "worker-1").await;
    worker
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.12.0"))
        .await
        .expect("workers upgrade regardless of etcd");

    sim.clear_faults("cp-2").unwrap();
    client
        .upgrade(upgrade("ghcr.io/siderolabs/installer:v1.12.0"))
        .await
        .expect("allowed once healthy");
}

#[tokio::test]
async fn fail_next_calls_answers_unavailable_n_times() {
    let sim = start("1.11.6").await;
    let mut client = admin(&sim, "cp-3").await;
    sim.inject_fault("cp-3", Fault::FailNextCalls(2)).unwrap();
    for _ in 0..2 {
        assert_eq!(
            client.version(()).await.unwrap_err().code(),
            Code::Unavailable
        );
    }
    client.version(()).await.expect("third call succeeds");

    // Through a proxy the target's counter applies.
    sim.inject_fault("cp-3", Fault::FailNextCalls(1)).unwrap();
    let mut cp1 = admin(&sim, "cp-1").await;
    let mut req = tonic::Request::new(());
    req.metadata_mut().insert("node", "cp-3".parse().unwrap());
    assert_eq!(
        cp1.version(req).await.unwrap_err().code(),
        Code::Unavailable
    );
    cp1.version(()).await.expect("cp-1 itself is fine");
}

#[tokio::test]
async fn ready_delay_holds_readiness_until_cleared() {
    let sim = start("1.11.6").await;
    sim.inject_fault("worker-1", Fault::ReadyDelay(Duration::from_secs(3600)))
        .unwrap();
    let before = sim.node_snapshot("worker-1").unwrap();
    let mut client = admin(&sim, "worker-1").await;
    client
        .reboot(machine::RebootRequest::default())
        .await
        .unwrap();
    let running = wait_snapshot(&sim, "worker-1", "running, not ready", |s| {
        s.boot_id != before.boot_id && s.stage == MachineStage::Running && !s.down
    })
    .await;
    assert!(!running.ready);
    assert!(
        running
            .unmet_conditions
            .iter()
            .any(|c| c.name == "nodeReady"),
        "{running:?}"
    );
    // Still not ready well after ready_ms.
    tokio::time::sleep(Duration::from_millis(sim.config().timings.ready_ms * 4)).await;
    assert!(!sim.node_snapshot("worker-1").unwrap().ready);

    sim.clear_faults("worker-1").unwrap();
    let ready = wait_snapshot(&sim, "worker-1", "ready", |s| s.ready).await;
    assert!(ready.unmet_conditions.is_empty());
}

#[tokio::test]
async fn apply_config_rejected() {
    let sim = start("1.11.6").await;
    sim.inject_fault("cp-1", Fault::ApplyConfigRejected)
        .unwrap();
    let mut state = state(&sim, "cp-1").await;
    let config = machine_config_bytes(&mut state).await;
    let mut client = admin(&sim, "cp-1").await;
    let status = client
        .apply_configuration(machine::ApplyConfigurationRequest {
            data: config.clone(),
            mode: machine::apply_configuration_request::Mode::NoReboot as i32,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    sim.clear_faults("cp-1").unwrap();
    client
        .apply_configuration(machine::ApplyConfigurationRequest {
            data: config,
            mode: machine::apply_configuration_request::Mode::NoReboot as i32,
            ..Default::default()
        })
        .await
        .expect("accepted once cleared");
}

async fn machine_config_bytes(
    state: &mut talos_api::proto::cosi::resource::state_client::StateClient<
        tonic::transport::Channel,
    >,
) -> Vec<u8> {
    use prost::Message;
    use talos_api::proto::cosi::resource as cosi;
    let resource = state
        .get(cosi::GetRequest {
            namespace: "config".into(),
            r#type: "MachineConfigs.config.talos.dev".into(),
            id: "v1alpha1".into(),
            options: None,
        })
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let spec = talos_api::proto::resource::config::MachineConfigSpec::decode(
        resource.spec.unwrap().proto_spec.as_slice(),
    )
    .unwrap();
    spec.yaml_marshalled
}
