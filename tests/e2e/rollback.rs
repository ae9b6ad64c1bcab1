//! Talos rollbacks end to end (`talos-rollback`, docs/upgrades.md "Rolling back"): a real API server,
//! the real kubectl, the controller in-process and a simulated five-node cluster whose nodes keep the
//! system they ran before in their other A/B slot. Each test checks what a user sees (annotations,
//! Events, metrics) and what the nodes received (the simulator's call record: one
//! `MachineService/Rollback` per node at most, never two nodes down at once).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::world::{World, WorldSpec};
use talos_sim::{Fault, Role, Timings, max_concurrently_down};

const ROLLBACK: &str = "/machine.MachineService/Rollback";

/// The nodes that received a Rollback call, in order.
fn rollback_calls(world: &World) -> Vec<String> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|c| c.method == ROLLBACK)
        .map(|c| c.node)
        .collect()
}

fn per_node(calls: &[String]) -> BTreeMap<&str, usize> {
    let mut counts = BTreeMap::new();
    for node in calls {
        *counts.entry(node.as_str()).or_default() += 1;
    }
    counts
}

/// Waits for the rollback's end: its message (the status alone says `completed` before it, too).
async fn wait_for_message(world: &World, prefix: &str) -> String {
    world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(180),
            &format!("a message starting {prefix:?}"),
            |message| message.starts_with(prefix),
        )
        .await
}

/// The rollbacks counter of this world's cluster for `result`, as /metrics shows it (0 when absent).
fn rollbacks_counted(world: &World, result: &str) -> u64 {
    let line = format!(
        "talos_upgrade_rollbacks_total{{namespace=\"{}\",cluster=\"{}\",result=\"{result}\"}} ",
        world.ns.name, world.cluster
    );
    world
        .metrics
        .encode()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&line)
                .map(|n| n.trim().parse().expect("a count"))
        })
        .unwrap_or(0)
}

/// (a) A run fails because a worker came back on its old slot (A/B fallback): rolling back a node the
/// run did not touch, or one the cluster does not have, is refused with the reason and touches
/// nothing; rolling back the run takes the worker it did upgrade back to 1.11.6 with one Rollback
/// call, and reports the failed worker as already on its previous version, with no call.
#[tokio::test]
async fn after_an_a_b_fallback_the_run_rolls_back_and_what_cannot_be_rolled_back_is_refused() {
    let world = World::start("rb-fallback", WorldSpec::default()).await;
    let upgraded = world.node("worker-1");
    let fell_back = world.node("worker-2");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .sim
        .inject_fault(&fell_back, Fault::BootsOldVersion)
        .expect("fault");
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    assert_eq!(world.annotation("failed-nodes").await, fell_back);
    assert_eq!(
        world.upgrade_calls(),
        vec![upgraded.clone(), fell_back.clone()]
    );
    world.sim.clear_faults(&fell_back).expect("clear");

    // (d) A control plane the failed run never reached has no previous system: refused, no call.
    let cp = world.node("cp-1");
    world.annotate("talos-rollback", &cp).await;
    let refused = format!(
        "Talos rollback refused: node {cp} was not upgraded by the last Talos run (to 1.12.0), so \
         it has no previous system to go back to. No node was touched."
    );
    world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(60),
            "the refusal",
            |m| m == refused,
        )
        .await;
    assert_eq!(world.annotation("talos-status").await, "failed");
    let event = world
        .wait_for_event("RollbackRefused", Some(&refused))
        .await;
    assert_eq!(event.type_, "Warning");
    assert_eq!(
        world.annotation("talos-rollback").await,
        cp,
        "a refused rollback is left for the user to change"
    );
    // An unknown node, the same way.
    world.annotate("talos-rollback", "no-such-node").await;
    let unknown = "Talos rollback refused: unknown node no-such-node: not in the cluster's node \
                   list. No node was touched.";
    world.wait_for_event("RollbackRefused", Some(unknown)).await;
    assert_eq!(world.annotation("talos-message").await, unknown);
    world.poke_and_wait(1).await;
    assert!(rollback_calls(&world).is_empty());
    assert!(world.sim.record().iter().all(|c| c.method != ROLLBACK));
    assert_eq!(rollbacks_counted(&world, "refused"), 2);

    // The run: the upgraded worker goes back, the one that fell back already runs 1.11.6.
    world.annotate("talos-rollback", "run").await;
    let message = wait_for_message(&world, "Talos rollback completed").await;
    assert_eq!(
        message,
        "Talos rollback completed: 2 nodes back on Talos 1.11.6 (rolled back from 1.12.0: run); \
         talos-target 1.12.0 stays decided: change it to upgrade again"
    );
    assert_eq!(world.annotation("talos-status").await, "completed");
    assert_eq!(world.annotation("talos-rollback").await, "", "consumed");
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.annotation("talos-current").await, "1.11.6");
    assert_eq!(rollback_calls(&world), vec![upgraded.clone()]);
    let started = world.wait_for_event("RollbackStarted", None).await;
    assert_eq!(
        started.message,
        format!(
            "Rolling back 2 nodes from Talos 1.12.0 to Talos 1.11.6 (run): {upgraded}, {fell_back}; \
             {fell_back} already runs its previous version"
        )
    );
    world
        .wait_for_event(
            "NodeRolledBack",
            Some(&format!(
                "Node {upgraded} is running Talos 1.11.6 again (rolled back from 1.12.0)"
            )),
        )
        .await;
    world
        .wait_for_event("RollbackCompleted", Some(&message))
        .await;
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.11.6", "{}", node.name);
    }
    assert_eq!(rollbacks_counted(&world, "completed"), 1);
    // The target stays decided: no node is upgraded again on its own.
    world.poke_and_wait(2).await;
    assert_eq!(world.upgrade_calls().len(), 2);
    assert_eq!(world.annotation("talos-message").await, message);
}

/// (b) A whole completed run rolled back: every node gets exactly one Rollback call, workers first,
/// then the control planes one at a time, each ending on its previous version; reported as a run of
/// its own, and the target stays decided until the user changes it.
#[tokio::test]
async fn a_whole_run_rolls_back_one_node_at_a_time_workers_first() {
    let world = World::start("rb-run", WorldSpec::default()).await;
    world.upgrade_talos("1.11.6", "1.12.0").await;
    let upgrades = world.assert_each_node_upgraded_once(5);
    let log = world.record_annotations().await;

    world.annotate("talos-rollback", "run").await;
    let message = wait_for_message(&world, "Talos rollback completed").await;
    assert_eq!(
        message,
        "Talos rollback completed: 5 nodes back on Talos 1.11.6 (rolled back from 1.12.0: run); \
         talos-target 1.12.0 stays decided: change it to upgrade again"
    );
    let calls = rollback_calls(&world);
    assert!(per_node(&calls).values().all(|&n| n == 1), "{calls:?}");
    let order: Vec<String> = ["worker-1", "worker-2", "cp-1", "cp-2", "cp-3"]
        .into_iter()
        .map(|short| world.node(short))
        .collect();
    assert_eq!(calls, order, "workers first, then the control planes");
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), None),
        1,
        "one node at a time"
    );
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.11.6", "{}", node.name);
        assert_eq!(
            node.previous_version.as_deref(),
            Some("1.12.0"),
            "{}",
            node.name
        );
    }
    assert_eq!(world.annotation("talos-current").await, "1.11.6");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    // What a user watching saw: in progress with a rollback message, then completed.
    let messages = log.values("talos-message");
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("Rolling back 5 nodes to Talos 1.11.6: ")
                && m.ends_with("rebooting (0/5 done)")),
        "{messages:?}"
    );
    assert!(
        log.values("talos-status")
            .iter()
            .any(|s| s == "in-progress")
    );
    assert_eq!(world.event_count("RollbackStarted").await, 1);
    assert_eq!(world.event_count("NodeRollbackStarted").await, 5);
    assert_eq!(world.event_count("NodeRolledBack").await, 5);
    assert_eq!(world.event_count("RollbackCompleted").await, 1);
    assert_eq!(rollbacks_counted(&world, "completed"), 1);

    // Decided: looking again upgrades nothing.
    world.poke_and_wait(1).await;
    assert_eq!(world.upgrade_calls(), upgrades);
    assert_eq!(world.annotation("talos-message").await, message);
    // Changing the target (the same version, written with a `v`) upgrades again.
    world.annotate("talos-target", "v1.12.0").await;
    world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(180),
            "the upgrade completed again",
            |m| m == "Talos upgrade completed: now running 1.12.0",
        )
        .await;
    assert_eq!(world.upgrade_calls().len(), 10);
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
}

/// (c) The controller killed in the middle of a rollback and started again: the rollback finishes,
/// and no node ever gets a second Rollback call.
#[tokio::test]
async fn a_controller_killed_mid_rollback_never_rolls_a_node_back_twice() {
    // Each node stays powered off 1.5 s, so the rollback is seen past its first node and before its
    // last (with the fast timings all five can be back between two looks of the test).
    let world = World::start(
        "rb-restart",
        WorldSpec {
            timings: Timings {
                reboot_ms: 1500,
                ..Timings::fast()
            },
            ..WorldSpec::default()
        },
    )
    .await;
    world.upgrade_talos("1.11.6", "1.12.0").await;

    world.annotate("talos-rollback", "run").await;
    // Once the first node is back and the next is under way, the controller dies.
    world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(120),
            "the rollback past its first node",
            |m| m.starts_with("Rolling back 5 nodes") && !m.contains("(0/5 done)"),
        )
        .await;
    world.kill_controller().await;
    let before = rollback_calls(&world);
    assert!(!before.is_empty());
    world.start_controller();
    let message = wait_for_message(&world, "Talos rollback completed").await;
    assert!(message.starts_with("Talos rollback completed: 5 nodes back on Talos 1.11.6"));
    let calls = rollback_calls(&world);
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert!(
        per_node(&calls).values().all(|&n| n == 1),
        "a node rolled back twice: {calls:?}\n{}",
        world.sim.record_json()
    );
    assert!(calls.starts_with(&before));
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.11.6", "{}", node.name);
    }
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
}

/// (e) On Talos ≥ 1.13, where the upgrade pulls, installs, drains and reboots each node itself, the
/// versions before are recorded the same way: a whole run rolls back with one Rollback per node, and
/// no node is left cordoned.
#[tokio::test]
async fn a_run_on_the_lifecycle_api_rolls_back_too() {
    let world = World::start(
        "rb-lifecycle",
        WorldSpec {
            talos: "1.13.5",
            kubernetes: "1.36.2",
            ..Default::default()
        },
    )
    .await;
    world.upgrade_talos("1.13.5", "1.13.6").await;
    world.annotate("talos-rollback", "run").await;
    let message = wait_for_message(&world, "Talos rollback completed").await;
    assert_eq!(
        message,
        "Talos rollback completed: 5 nodes back on Talos 1.13.5 (rolled back from 1.13.6: run); \
         talos-target 1.13.6 stays decided: change it to upgrade again"
    );
    let calls = rollback_calls(&world);
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert!(per_node(&calls).values().all(|&n| n == 1), "{calls:?}");
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.13.5", "{}", node.name);
    }
    // This world's Nodes (the API server is shared with other tests' worlds).
    let nodes = world
        .ns
        .kubectl_ok(&[
            "get",
            "nodes",
            "-o",
            r#"jsonpath={range .items[*]}{.metadata.name}={.spec.unschedulable}{"\n"}{end}"#,
        ])
        .await;
    let ours: Vec<&str> = nodes
        .lines()
        .filter(|l| l.starts_with(&format!("{}-", world.ns.name)))
        .collect();
    assert_eq!(ours.len(), 5, "{nodes}");
    assert!(ours.iter().all(|l| !l.ends_with("=true")), "{ours:?}");
}
