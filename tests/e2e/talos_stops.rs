//! A Talos run stopped or held by the user while a node is in flight: the target removed mid-drain on
//! Talos ≥ 1.13, an invalid option set mid-run, and a reset, after a finished run and mid-drain (issue
//! 21, items 1, 4 and 5). What must hold each time: the node in flight is finished (or, for a reset, left
//! as the message says), no other node is touched, and the cluster says what happened.
//!
//! No timing assertions: the moment a user acts is pinned by something the test holds (a
//! PodDisruptionBudget refusing a drain, a node kept not Ready by a fault), and every wait is on what a
//! user sees.

use std::time::Duration;

use crate::talos_drain::{
    IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT, changing_calls, pod_exists, unschedulable_nodes,
    web_budget, web_pod,
};
use crate::world::{ClusterEvent, World, WorldSpec};
use talos_sim::{Fault, PowerKind};

const PATIENCE: Duration = Duration::from_secs(120);
const LEGACY_UPGRADE: &str = "/machine.MachineService/Upgrade";

async fn condition_reason(world: &World) -> String {
    world
        .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
        .await
}

/// The calls after the run's pre-pull, which comes first: one installer pull on each of the five
/// nodes (docs/upgrades.md, Pre-pull).
fn after_the_pre_pull(calls: Vec<(String, String)>) -> Vec<(String, String)> {
    let (pulls, rest) = calls.split_at(calls.len().min(5));
    let mut pulled: Vec<&str> = pulls
        .iter()
        .filter(|(m, _)| m == IMAGE_PULL)
        .map(|(_, n)| n.as_str())
        .collect();
    pulled.sort();
    pulled.dedup();
    assert_eq!(pulled.len(), 5, "the pre-pull first: {calls:?}");
    rest.to_vec()
}

/// Every call that changes a node (pull, install, reboot, legacy upgrade), as `(method, node)`.
fn every_changing_call(world: &World) -> Vec<(String, String)> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|c| {
            [IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT, LEGACY_UPGRADE].contains(&c.method.as_str())
        })
        .map(|c| (c.method, c.node))
        .collect()
}

/// A five-node cluster on Talos 1.13.0 whose worker-1 holds the only `web` pod, kept by a budget that
/// wants it running; the target 1.13.1 is set and the test returns once the controller says it is
/// draining worker-1 and the budget refuses. worker-1 then has its new system installed (not booted)
/// and is cordoned.
async fn draining_worker_1(prefix: &str) -> World {
    let world = World::start(
        prefix,
        WorldSpec {
            talos: "1.13.0",
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_1 = world.node("worker-1");
    web_pod(&world, "web-1", &worker_1).await;
    web_budget(&world, 1).await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    world.annotate("talos-target", "1.13.1").await;
    world
        .wait_for_annotation_matching(
            "talos-message",
            PATIENCE,
            "worker-1's drain held by the budget",
            |m| m.contains(&format!("draining {worker_1}")) && m.contains("disruption budget"),
        )
        .await;
    assert_eq!(
        after_the_pre_pull(changing_calls(&world)),
        vec![(LIFECYCLE_UPGRADE.to_string(), worker_1.clone())]
    );
    assert_eq!(unschedulable_nodes(&world).await, vec![worker_1]);
    world
}

/// Issue 21 item 1: the target removed while worker-1 drains on Talos ≥ 1.13. The stop finishes the
/// node in flight (drain, reboot, uncordon) and then stops; no other node is touched.
#[tokio::test]
async fn removing_the_target_mid_drain_finishes_the_node_then_stops() {
    let world = draining_worker_1("stop-drain").await;
    let worker_1 = world.node("worker-1");

    let log = world.record_annotations().await;
    world.remove_annotation("talos-target").await;
    world
        .wait_for_annotation_matching(
            "talos-message",
            PATIENCE,
            "finishing worker-1 before stopping",
            |m| m == format!("Talos target removed: finishing {worker_1} before stopping"),
        )
        .await;
    // Still held by the budget: not rebooted yet.
    assert!(
        !every_changing_call(&world).contains(&(REBOOT.to_string(), worker_1.clone())),
        "{:?}",
        every_changing_call(&world)
    );

    // A replacement pod comes up elsewhere (as a ReplicaSet would): the budget allows the eviction.
    web_pod(&world, "web-2", &world.node("worker-2")).await;
    world
        .wait_for_annotation("talos-status", "idle", "180s")
        .await;
    // What the stop said, as the user saw it when the status turned idle (a later look may report the
    // running version instead).
    let stopped = first_idle_state(&world, &log).await;
    assert_eq!(
        stopped.get("talos-message").map(String::as_str),
        Some("Talos upgrade stopped: the target was removed"),
        "{stopped:?}"
    );
    assert_eq!(condition_reason(&world).await, "Reset");
    assert_eq!(world.annotation("talos-current").await, "1.13.0");
    assert_eq!(world.annotation("failed-nodes").await, "");

    // worker-1 was drained, rebooted once into 1.13.1 and uncordoned.
    assert!(!pod_exists(&world, "web-1").await, "web-1 was evicted");
    assert_eq!(
        world
            .sim
            .node_snapshot(&worker_1)
            .expect("worker-1")
            .talos_version,
        "1.13.1"
    );
    let downs: Vec<_> = world
        .sim
        .power_events()
        .into_iter()
        .filter(|e| e.kind == PowerKind::Down)
        .map(|e| e.node)
        .collect();
    assert_eq!(
        downs,
        vec![worker_1.clone()],
        "only worker-1 went down, once"
    );
    world
        .poll(PATIENCE, "worker-1 to be uncordoned", || async {
            unschedulable_nodes(&world).await.is_empty()
        })
        .await;
    // Exactly the pre-pull, then install and reboot, both to worker-1; looking again calls nothing
    // more.
    world.poke_and_wait(1).await;
    assert_eq!(
        after_the_pre_pull(every_changing_call(&world)),
        vec![
            (LIFECYCLE_UPGRADE.to_string(), worker_1.clone()),
            (REBOOT.to_string(), worker_1.clone()),
        ]
    );
    assert_eq!(world.annotation("talos-status").await, "idle");
}

/// Issue 21 item 4: an invalid `upgrade-order` set while worker-1 is in flight (legacy path). The run
/// is held, not failed: worker-1 is finished and followed to the end, no new node starts while the
/// value is invalid, and fixing it lets the run complete.
#[tokio::test]
async fn an_invalid_upgrade_order_set_mid_run_holds_after_the_node_in_flight() {
    let world = World::start("stop-option", WorldSpec::default()).await;
    let worker_1 = world.node("worker-1");
    let log = world.record_annotations().await;
    // worker-1 comes back on the target but stays not Ready until the test clears the fault: in flight
    // for as long as the test needs.
    world
        .sim
        .inject_fault(&worker_1, Fault::ReadyDelay(Duration::from_secs(600)))
        .expect("fault");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world.annotate("talos-target", "1.12.0").await;
    world
        .poll(PATIENCE, "worker-1's upgrade call", || async {
            world.upgrade_calls() == vec![worker_1.clone()]
        })
        .await;
    world.annotate("upgrade-order", "sideways").await;

    let invalid = "Annotation upgrade.vitistack.io/upgrade-order has the invalid value \"sideways\": \
                   use workers-first (the default) or control-planes-first";
    let finishing =
        format!("Talos upgrade held: {invalid}; finishing {worker_1} before holding (0/5 done)");
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "held, finishing worker-1", |m| {
            m == finishing
        })
        .await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    let event = world
        .wait_for_event("InvalidOption", Some(&finishing))
        .await;
    assert_eq!(event.type_, "Warning");
    assert_eq!(world.upgrade_calls(), vec![worker_1.clone()]);

    // worker-1 becomes Ready: it is done, and the run holds before the next node.
    world.sim.clear_faults(&worker_1).expect("clear");
    let held =
        format!("Talos upgrade held: {invalid}; no new node starts until it is fixed (1/5 done)");
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "held after worker-1", |m| {
            m == held
        })
        .await;
    assert_eq!(world.annotation("talos-progress").await, "1/5");
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    world.poke_and_wait(3).await;
    assert_eq!(world.upgrade_calls(), vec![worker_1.clone()]);
    assert_eq!(world.annotation("talos-message").await, held);
    // Announced once per message, not on every pass (the recorder may fold the second into the first's
    // series, keeping the first message).
    let invalid_events: Vec<ClusterEvent> = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "InvalidOption")
        .collect();
    let count: u64 = invalid_events.iter().map(|e| e.count).sum();
    assert!(
        (1..=2).contains(&count),
        "InvalidOption once per held message: {invalid_events:#?}"
    );
    for event in &invalid_events {
        assert_eq!(event.type_, "Warning");
        assert!(
            event.message == finishing || event.message == held,
            "{invalid_events:#?}"
        );
    }

    // Removing the bad value lets the run go on from where it held.
    world.remove_annotation("upgrade-order").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(5);
    world.assert_talos_run_kept_its_promises("1.12.0").await;
    let statuses = log.values("talos-status");
    assert!(
        !statuses.iter().any(|s| s == "failed"),
        "never failed: {statuses:?}"
    );
}

/// Issue 21 item 5a: a reset after a completed run forgets it, consumes its key and the target, and
/// touches no node.
#[tokio::test]
async fn a_reset_after_a_completed_run_forgets_it_and_touches_no_node() {
    let world = World::start("stop-reset-done", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    let calls = world.sim.record().len();
    let power = world.sim.power_events().len();
    let log = world.record_annotations().await;

    world.annotate("talos-reset-upgrade-state", "true").await;
    world
        .wait_for_annotation("talos-status", "idle", "60s")
        .await;
    reset_keys_removed(&world).await;
    // What the reset said, as the user saw it when the status turned idle.
    let reset_state = first_idle_state(&world, &log).await;
    assert_eq!(
        reset_state.get("talos-message").map(String::as_str),
        Some("Talos upgrade state was reset; no node was touched"),
        "{reset_state:?}"
    );
    assert_eq!(condition_reason(&world).await, "Reset");
    assert_eq!(world.annotation("failed-nodes").await, "");

    world.poke_and_wait(1).await;
    assert_eq!(world.annotation("talos-status").await, "idle");
    assert_eq!(world.sim.record().len(), calls, "no call to any node");
    assert_eq!(world.sim.power_events().len(), power);
}

/// Issue 21 item 5b: a reset while worker-1 drains on Talos ≥ 1.13. The run is forgotten and no node is
/// touched any more: worker-1 stays cordoned with its new system staged, and the message says so and
/// what to do. Even once the budget would let the drain finish, nothing reboots it.
#[tokio::test]
async fn a_reset_mid_drain_forgets_the_run_and_says_the_node_is_left_cordoned() {
    let world = draining_worker_1("stop-reset-drain").await;
    let worker_1 = world.node("worker-1");
    let log = world.record_annotations().await;

    world.annotate("talos-reset-upgrade-state", "true").await;
    world
        .wait_for_annotation("talos-status", "idle", "60s")
        .await;
    // What the reset said, as the user saw it when the status turned idle, and in its Event.
    let message = format!(
        "Talos upgrade state was reset; no node was touched. Node {worker_1} is left cordoned, with \
         Talos 1.13.1 installed for its next reboot: reboot it to finish its upgrade, or uncordon it"
    );
    let reset_state = first_idle_state(&world, &log).await;
    assert_eq!(
        reset_state.get("talos-message"),
        Some(&message),
        "{reset_state:?}"
    );
    let event = world.wait_for_event("UpgradeReset", Some(&message)).await;
    assert_eq!(event.type_, "Normal");
    assert_eq!(condition_reason(&world).await, "Reset");
    reset_keys_removed(&world).await;

    // The budget would now allow the eviction: the forgotten run must not go on.
    web_pod(&world, "web-2", &world.node("worker-2")).await;
    for round in 1..=3 {
        world.poke_and_wait(round).await;
    }
    assert_eq!(world.annotation("talos-status").await, "idle");
    assert_eq!(
        unschedulable_nodes(&world).await,
        vec![worker_1.clone()],
        "worker-1 is left cordoned"
    );
    assert_eq!(
        after_the_pre_pull(every_changing_call(&world)),
        vec![(LIFECYCLE_UPGRADE.to_string(), worker_1.clone())],
        "no reboot, no other node"
    );
    assert!(world.sim.power_events().is_empty());
}

/// The first state of the log with `talos-status: idle`, once the log's watch has seen it (`kubectl
/// wait` on the object may see it first).
async fn first_idle_state(
    world: &World,
    log: &crate::world::AnnotationLog,
) -> std::collections::BTreeMap<String, String> {
    let idle = || {
        log.states()
            .into_iter()
            .find(|s| s.get("talos-status").map(String::as_str) == Some("idle"))
    };
    world
        .poll(
            PATIENCE,
            "the annotation log to see the idle state",
            || async { idle().is_some() },
        )
        .await;
    idle().expect("an idle state, just seen")
}

/// Waits until the controller has removed the reset key and `talos-target`, as a reset does.
async fn reset_keys_removed(world: &World) {
    world
        .poll(
            PATIENCE,
            "the reset key and the target to be removed",
            || async {
                world
                    .annotation("talos-reset-upgrade-state")
                    .await
                    .is_empty()
                    && world.annotation("talos-target").await.is_empty()
            },
        )
        .await;
}
