//! Observing a simulated Talos cluster over its real API: node versions, boot ids, readiness, installer
//! images, and etcd health, including the failures the rollout must hold on.

use std::net::IpAddr;
use std::time::Duration;

use talos_api::{ConnectOptions, RebootMode, Talosconfig};
use talos_sim::{ClientRole, Fault, SimConfig, Simulator, Timings};
use talos_upgrade_controller::inventory::InventoryNode;
use talos_upgrade_controller::talos_fleet::{TalosFleet, control_planes};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::talos::TalosState;

const PATIENCE: Duration = Duration::from_secs(30);

async fn fleet_for(sim: &Simulator) -> (TalosFleet, Vec<InventoryNode>) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let credentials = Talosconfig::from_yaml(&sim.talosconfig(ClientRole::Admin))
        .and_then(|c| c.current_context()?.credentials())
        .expect("talosconfig");
    let options = ConnectOptions {
        port: sim.config().port,
        ..ConnectOptions::default()
    };
    let inventory = sim
        .nodes()
        .into_iter()
        .map(|n| InventoryNode {
            name: n.name.clone(),
            role: if n.role.is_control_plane() {
                NodeRole::ControlPlane
            } else {
                NodeRole::Worker
            },
            address: IpAddr::V4(n.address),
            held: false,
        })
        .collect();
    (TalosFleet::new(credentials, options), inventory)
}

#[tokio::test]
async fn a_healthy_cluster_is_observed_as_it_is() {
    let sim = Simulator::start(
        SimConfig::uniform("observe", 3, 2, "1.11.6", "1.34.1").with_timings(Timings::fast()),
    )
    .await
    .expect("simulator");
    let (fleet, inventory) = fleet_for(&sim).await;

    for node in &inventory {
        match fleet.observe_node(node).await {
            TalosState::Up {
                version,
                boot_id,
                ready,
                install,
            } => {
                assert_eq!(version.to_string(), "1.11.6", "{}", node.name);
                assert_eq!(
                    boot_id,
                    sim.node_snapshot(&node.name).expect("snapshot").boot_id
                );
                assert!(ready, "{}", node.name);
                // The machine config is read apart, for the nodes a run may start next only.
                assert_eq!(install, None);
                // Its install image, and the platform it reports (the simulator's default, metal).
                assert_eq!(
                    fleet.read_installer_image(node).await.expect("config"),
                    talos_upgrade_core::talos::InstallSource::new(
                        "ghcr.io/siderolabs/installer:v1.11.6",
                        Some("metal")
                    )
                );
            }
            other => panic!("{} should be up: {other:?}", node.name),
        }
    }

    let etcd = fleet.observe_etcd(&control_planes(&inventory)).await;
    assert_eq!(etcd.problem, None);
    let leader = etcd.leader.expect("a leader");
    let snapshot = sim.node_snapshot(&leader).expect("leader snapshot");
    assert!(snapshot.etcd.expect("member").leader, "{leader} leads");
}

#[tokio::test]
async fn unhealthy_members_and_rebooting_nodes_are_observed_with_their_reason() {
    let sim = Simulator::start(
        SimConfig::uniform("observe-faults", 3, 2, "1.11.6", "1.34.1")
            .with_timings(Timings::fast()),
    )
    .await
    .expect("simulator");
    let (fleet, inventory) = fleet_for(&sim).await;
    let cps = control_planes(&inventory);

    sim.inject_fault("cp-2", Fault::EtcdUnhealthy)
        .expect("fault");
    let etcd = fleet.observe_etcd(&cps).await;
    let problem = etcd.problem.expect("etcd problem");
    assert!(problem.contains("member cp-2 reports"), "{problem}");
    assert!(problem.contains("would lose quorum"), "{problem}");
    sim.clear_faults("cp-2").expect("clear");
    assert_eq!(fleet.observe_etcd(&cps).await.problem, None);

    // A control plane that is down: etcd cannot be vouched for, and the node is unreachable.
    sim.inject_fault("cp-3", Fault::NeverReturns)
        .expect("fault");
    let cp3 = inventory.iter().find(|n| n.name == "cp-3").expect("cp-3");
    fleet
        .client(cp3.address)
        .expect("client")
        .reboot(RebootMode::Default)
        .await
        .expect("reboot");
    sim.wait_for("cp-3", PATIENCE, |s| s.down)
        .await
        .expect("down");
    match fleet.observe_node(cp3).await {
        TalosState::Unreachable { reason } => assert!(!reason.is_empty()),
        other => panic!("cp-3 should be unreachable: {other:?}"),
    }
    let problem = fleet.observe_etcd(&cps).await.problem.expect("problem");
    assert!(
        problem.contains("control plane cp-3 does not answer"),
        "{problem}"
    );
}

/// The record's calls of `method` on `node`, as `(node, endpoint that received it)`.
fn received(sim: &Simulator, node: &str, method: &str) -> Vec<(String, String)> {
    sim.record()
        .into_iter()
        .filter(|call| call.node == node && call.method == method)
        .map(|call| (call.node, call.endpoint))
        .collect()
}

/// Reboots `node` with the fleet's client for it; returns every Reboot the node received so far, as
/// `(node, endpoint that received it)`.
async fn reboot(
    fleet: &TalosFleet,
    sim: &Simulator,
    node: &InventoryNode,
) -> Vec<(String, String)> {
    fleet
        .client(node.address)
        .expect("client")
        .reboot(RebootMode::Default)
        .await
        .unwrap_or_else(|error| panic!("rebooting {}: {error}", node.name));
    received(sim, &node.name, "/machine.MachineService/Reboot")
}

#[tokio::test]
async fn calls_go_through_one_control_plane_and_around_it_when_it_is_down() {
    let sim = Simulator::start(
        SimConfig::uniform("observe-relay", 3, 2, "1.11.6", "1.34.1").with_timings(Timings::fast()),
    )
    .await
    .expect("simulator");
    let (fleet, inventory) = fleet_for(&sim).await;
    let node = |name: &str| {
        inventory
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("{name} in the inventory"))
            .clone()
    };
    let (cp1, cp2, worker1, worker2) = (
        node("cp-1"),
        node("cp-2"),
        node("worker-1"),
        node("worker-2"),
    );

    // Until told the control planes, every node is dialled directly.
    assert_eq!(
        reboot(&fleet, &sim, &worker1).await,
        [("worker-1".to_string(), "worker-1".to_string())]
    );
    sim.wait_for("worker-1", PATIENCE, |s| !s.down && s.ready)
        .await
        .expect("worker-1 back");

    fleet.relay_through(control_planes(&inventory).iter().map(|n| n.address));
    for node in &inventory {
        assert!(
            matches!(fleet.observe_node(node).await, TalosState::Up { .. }),
            "{} is up",
            node.name
        );
    }
    assert_eq!(
        fleet.relay(),
        Some(cp1.address),
        "the first control plane relays"
    );
    assert_eq!(
        fleet
            .observe_etcd(&control_planes(&inventory))
            .await
            .problem,
        None
    );

    // A call to a worker arrives at cp-1, which acts on worker-2.
    assert_eq!(
        reboot(&fleet, &sim, &worker2).await,
        [("worker-2".to_string(), "cp-1".to_string())]
    );
    sim.wait_for("worker-2", PATIENCE, |s| s.down)
        .await
        .expect("worker-2 down");
    // A node that is down is unreachable whichever way it is asked, and that does not move the relay.
    match fleet.observe_node(&worker2).await {
        TalosState::Unreachable { reason } => assert!(!reason.is_empty()),
        other => panic!("worker-2 should be unreachable while it reboots: {other:?}"),
    }
    assert_eq!(fleet.relay(), Some(cp1.address));
    sim.wait_for("worker-2", PATIENCE, |s| !s.down && s.ready)
        .await
        .expect("worker-2 back");

    // The relay itself goes down and stays down: its own calls went to it directly, and the other
    // nodes are still observed as up (asked directly), while the relay moves on to cp-2.
    sim.inject_fault("cp-1", Fault::NeverReturns)
        .expect("fault");
    assert_eq!(
        reboot(&fleet, &sim, &cp1).await,
        [("cp-1".to_string(), "cp-1".to_string())]
    );
    sim.wait_for("cp-1", PATIENCE, |s| s.down)
        .await
        .expect("cp-1 down");
    match fleet.observe_node(&worker1).await {
        TalosState::Up { ready, .. } => assert!(ready, "worker-1 ready"),
        other => panic!("worker-1 is up, whatever its relay: {other:?}"),
    }
    assert_eq!(
        fleet.relay(),
        Some(cp2.address),
        "the next control plane relays"
    );
    let problem = fleet
        .observe_etcd(&control_planes(&inventory))
        .await
        .problem
        .expect("cp-1's etcd member is down");
    assert!(
        problem.contains("control plane cp-1 does not answer"),
        "{problem}"
    );
    assert_eq!(
        reboot(&fleet, &sim, &worker1).await,
        [
            ("worker-1".to_string(), "worker-1".to_string()),
            ("worker-1".to_string(), "cp-2".to_string())
        ]
    );
}
