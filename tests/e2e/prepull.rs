//! The pre-pull (issue 23 item 6), against the real API server and the simulator: before a Talos run
//! disrupts its first node, the installer is pulled on every node it upgrades; a node that cannot pull
//! (the simulator's registry answers that the image is not found) fails the run before any node is
//! cordoned, installed or rebooted, naming the node and the registry's answer; `resume` pulls again;
//! a controller restarted mid pre-pull neither disrupts a node early nor loses track.

use std::collections::BTreeMap;
use std::time::Duration;

use talos_sim::{CallRecord, Fault, Timings};

use crate::talos_drain::{IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT, unschedulable_nodes};
use crate::world::{World, WorldSpec};

const LEGACY_IMAGE_PULL: &str = "/machine.MachineService/ImagePull";
const LEGACY_UPGRADE: &str = "/machine.MachineService/Upgrade";

/// The calls that disrupt a node (an install, a reboot, a legacy upgrade).
fn disruptive(call: &CallRecord) -> bool {
    [LIFECYCLE_UPGRADE, REBOOT, LEGACY_UPGRADE].contains(&call.method.as_str())
}

/// Per node, the results of the `pull` calls the simulator recorded before the first disruptive call;
/// and whether there was a disruptive call at all.
fn pulls_before_disruption(record: &[CallRecord], pull: &str) -> BTreeMap<String, Vec<String>> {
    let first = record.iter().position(disruptive).unwrap_or(record.len());
    let mut pulls: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for call in record[..first].iter().filter(|c| c.method == pull) {
        pulls
            .entry(call.node.clone())
            .or_default()
            .push(call.result.clone());
    }
    pulls
}

fn node_names(world: &World) -> Vec<String> {
    world.sim.nodes().into_iter().map(|n| n.name).collect()
}

/// Talos 1.13 -> 1.14: every node pulls its installer once, all before the first install, and no node
/// pulls a second time before its install (the pull is fresh); the status said so meanwhile and the
/// `InstallerPulled` Event says it is done.
#[tokio::test]
async fn every_node_pulls_the_installer_once_before_the_first_node_is_disrupted() {
    let world = World::start(
        "pp-all",
        WorldSpec {
            talos: "1.13.0",
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    let log = world.record_annotations().await;
    world.annotate("talos-target", "1.14.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;

    let record = world.sim.record();
    let before = pulls_before_disruption(&record, IMAGE_PULL);
    for node in node_names(&world) {
        assert_eq!(
            before.get(&node).map(Vec::as_slice),
            Some(&["ok".to_string()][..]),
            "{node} pulled once, before any node was disrupted: {}",
            world.sim.record_json()
        );
        let pulls = record
            .iter()
            .filter(|c| c.method == IMAGE_PULL && c.node == node)
            .count();
        assert_eq!(pulls, 1, "{node}: no second pull before its install");
    }
    world.assert_each_node_upgraded_once(5);

    let messages = log.values("talos-message");
    let pulling = messages
        .iter()
        .find(|m| m.starts_with("Pulling "))
        .unwrap_or_else(|| panic!("no pre-pull message among {messages:?}"));
    assert!(
        pulling.ends_with("on 5 nodes before upgrading any (0/5 pulled)"),
        "{pulling}"
    );
    let pulled = world.event_messages("InstallerPulled").await;
    assert_eq!(pulled.len(), 1, "{pulled:?}");
    assert!(
        pulled[0].ends_with("pulled on 5 nodes; upgrading them to Talos 1.14.0"),
        "{pulled:?}"
    );
}

/// Talos < 1.13: the legacy upgrade pulls into a containerd `MachineService.ImagePull` cannot reach,
/// so the pre-pull there is a check through the node's registry configuration: one `ImagePull` of the
/// installer per node, in the system namespace, all before the first upgrade call.
#[tokio::test]
async fn legacy_nodes_check_their_pull_before_the_first_upgrade() {
    let world = World::start("pp-legacy", WorldSpec::default()).await;
    world.upgrade_talos("1.11.6", "1.12.0").await;

    let record = world.sim.record();
    let before = pulls_before_disruption(&record, LEGACY_IMAGE_PULL);
    for node in node_names(&world) {
        assert_eq!(
            before.get(&node).map(Vec::as_slice),
            Some(&["ok".to_string()][..]),
            "{node}: {}",
            world.sim.record_json()
        );
    }
    let checks: Vec<&CallRecord> = record
        .iter()
        .filter(|c| c.method == LEGACY_IMAGE_PULL)
        .collect();
    assert_eq!(checks.len(), 5);
    for check in checks {
        assert_eq!(
            check.params["reference"], "ghcr.io/siderolabs/installer:v1.12.0",
            "{check:?}"
        );
        // ContainerdNamespace.NS_SYSTEM.
        assert_eq!(check.params["namespace"], 1, "{check:?}");
    }
    world.assert_each_node_upgraded_once(5);
}

/// One node's registry does not have the installer: the run fails naming the node and the registry's
/// answer, with an Event, and no node is cordoned, installed or rebooted. Once the registry has it,
/// `resume` pulls again (only where it failed) and the run completes.
#[tokio::test]
async fn a_node_that_cannot_pull_stops_the_run_before_any_disruption_and_resume_finishes_it() {
    let world = World::start(
        "pp-fails",
        WorldSpec {
            talos: "1.13.0",
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_2 = world.node("worker-2");
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    world
        .sim
        .inject_fault(&worker_2, Fault::InstallerPullFails)
        .expect("fault");
    world.annotate("talos-target", "1.14.0").await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;

    let message = world.annotation("talos-message").await;
    let prefix = format!("Talos upgrade failed: node {worker_2} could not pull its installer ");
    assert!(message.starts_with(&prefix), "{message}");
    // The registry's answer, as Talos hands it on: containerd's resolver found no such image.
    assert!(
        message.contains(": not found: error pulling image: failed to pull image \"")
            && message.contains("failed to resolve reference")
            && message.contains(":v1.14.0: not found"),
        "{message}"
    );
    assert!(
        message.ends_with(
            "the run stopped before upgrading any node (none was cordoned or rebooted): fix the \
             image or the registry, then set resume to pull again"
        ),
        "{message}"
    );
    assert_eq!(world.annotation("failed-nodes").await, worker_2);
    assert_eq!(world.annotation("talos-progress").await, "0/5");
    let failed = world.wait_for_event("UpgradeFailed", None).await;
    assert_eq!(failed.type_, "Warning");
    assert_eq!(failed.message, message);

    // Nothing disrupted: no install, no reboot, no Node cordoned, every node on its old version.
    world.poke_and_wait(1).await;
    let record = world.sim.record();
    assert!(
        !record.iter().any(disruptive),
        "{}",
        world.sim.record_json()
    );
    assert_eq!(unschedulable_nodes(&world).await, Vec::<String>::new());
    assert!(world.sim.power_events().is_empty());
    for snapshot in world.sim.snapshots() {
        assert_eq!(snapshot.talos_version, "1.13.0", "{}", snapshot.name);
    }
    let failed_pulls: Vec<&CallRecord> = record
        .iter()
        .filter(|c| c.method == IMAGE_PULL && c.result != "ok")
        .collect();
    assert!(
        !failed_pulls.is_empty() && failed_pulls.iter().all(|c| c.node == worker_2),
        "{failed_pulls:?}"
    );
    assert!(
        failed_pulls[0]
            .result
            .starts_with("NotFound: error pulling image: "),
        "{failed_pulls:?}"
    );

    // The registry has it now: resume pulls on worker-2 again, then the run completes.
    let pulls_before_resume = record.len();
    world.sim.clear_faults(&worker_2).expect("clear");
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    let record = world.sim.record();
    let after = &record[pulls_before_resume..];
    let first = after
        .iter()
        .position(disruptive)
        .expect("the resumed run upgrades");
    let pulled_again: Vec<&str> = after[..first]
        .iter()
        .filter(|c| c.method == IMAGE_PULL)
        .map(|c| c.node.as_str())
        .collect();
    assert_eq!(
        pulled_again,
        [worker_2.as_str()],
        "{}",
        world.sim.record_json()
    );
    world.assert_each_node_upgraded_once(5);
}

/// A controller killed while the pulls are under way (slow pulls) and started again: the pulls the
/// record holds unanswered are made again, no node is disrupted before every node pulled, and the run
/// completes with each node upgraded once.
#[tokio::test]
async fn a_restart_mid_pre_pull_disrupts_no_node_early_and_keeps_track() {
    let world = World::start(
        "pp-restart",
        WorldSpec {
            talos: "1.13.0",
            timings: Timings {
                pull_ms: 3000,
                ..Timings::fast()
            },
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    world.annotate("talos-target", "1.14.0").await;
    let pulling = world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(60),
            "the pre-pull to start",
            |m| m.starts_with("Pulling "),
        )
        .await;
    assert!(pulling.contains("(0/5 pulled)"), "{pulling}");
    world.kill_controller().await;
    assert!(
        !world.sim.record().iter().any(disruptive),
        "{}",
        world.sim.record_json()
    );
    world.start_controller();
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;

    let record = world.sim.record();
    let before = pulls_before_disruption(&record, IMAGE_PULL);
    for node in node_names(&world) {
        let results = before.get(&node).cloned().unwrap_or_default();
        assert!(
            results.iter().any(|r| r == "ok"),
            "{node} pulled before any node was disrupted: {}",
            world.sim.record_json()
        );
        // The pull cut short by the restart, and the one made again: never more.
        assert!(results.len() <= 2, "{node}: {results:?}");
    }
    world.assert_each_node_upgraded_once(5);
    assert_eq!(world.event_count("InstallerPulled").await, 1);
}
