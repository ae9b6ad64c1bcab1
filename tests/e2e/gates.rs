//! The operator's gates before each node (issue #23), against a real API server and the simulator:
//! each gate holds, says so (annotations, Events, metrics), keeps holding across a controller
//! restart, and lets the run go once released. Time is the test's (`World::set_clock`), never waited
//! for.

use std::time::Duration;

use crate::world::{World, WorldSpec};

const PATIENCE: Duration = Duration::from_secs(120);

/// A two-worker, one-control-plane cluster: enough for every gate, quick to upgrade.
fn small() -> WorldSpec {
    WorldSpec {
        control_planes: 1,
        workers: 2,
        ..WorldSpec::default()
    }
}

/// 2026-12-01 (a Tuesday) at `time` UTC.
fn tuesday(time: &str) -> jiff::Timestamp {
    format!("2026-12-01T{time}Z").parse().expect("timestamp")
}

fn metric(world: &World, name: &str, gate: &str) -> Option<String> {
    world
        .metrics
        .encode()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains(&format!("gate=\"{gate}\"")))
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
}

/// Waits until the metric `name` of `gate` reads `value`: metrics are exported after the annotations
/// are written and the Events published, so a test that has just seen an annotation polls for them.
async fn wait_for_metric(world: &World, name: &str, gate: &str, value: &str) {
    world
        .poll(
            PATIENCE,
            &format!("{name} of {gate} to be {value}"),
            || async { metric(world, name, gate).as_deref() == Some(value) },
        )
        .await;
}

#[tokio::test]
async fn a_run_waits_for_its_maintenance_window_across_a_restart_and_starts_inside_it() {
    let world = World::start("gates-window", small()).await;
    world.set_clock(tuesday("12:00:00"));
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .annotate("maintenance-window", "Mon-Fri 22:00 4h Europe/Oslo")
        .await;
    world.annotate("talos-target", "1.12.0").await;

    let expected = "Waiting: outside the maintenance window (Mon-Fri 22:00 4h Europe/Oslo); the \
                    next opens at Tue 2026-12-01 22:00 Europe/Oslo (2026-12-01 21:00:00 UTC) (0/3 done)";
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, expected, |m| m == expected)
        .await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    world.wait_for_event("UpgradeWaiting", Some(expected)).await;
    wait_for_metric(&world, "talos_upgrade_hold", "maintenance-window", "1").await;
    wait_for_metric(
        &world,
        "talos_upgrade_holds_total",
        "maintenance-window",
        "1",
    )
    .await;

    // Held across a restart, and looked at again without a new Event or a node started.
    world.restart_controller().await;
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    assert_eq!(world.annotation("talos-message").await, expected);
    assert!(
        world.upgrade_calls().is_empty(),
        "{:?}",
        world.upgrade_calls()
    );
    assert_eq!(world.event_count("UpgradeWaiting").await, 1);

    // Inside the window: the run goes.
    world.set_clock(tuesday("21:00:00"));
    world.poke_and_wait(3).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
}

#[tokio::test]
async fn force_start_starts_outside_the_window_once_and_is_removed() {
    let world = World::start("gates-force", small()).await;
    world.set_clock(tuesday("12:00:00"));
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .annotate("maintenance-window", "Sat,Sun 02:00 8h UTC")
        .await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "a window hold", |m| {
            m.starts_with("Waiting: outside the maintenance window")
        })
        .await;

    world.annotate("force-start", "true").await;
    let overridden = world
        .wait_for_event("MaintenanceWindowOverridden", None)
        .await;
    assert!(
        overridden
            .message
            .contains("starts now and goes on outside the maintenance window"),
        "{}",
        overridden.message
    );
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("force-start").await, "");
    world.assert_each_node_upgraded_once(3);
}

#[tokio::test]
async fn a_soak_holds_each_next_node_and_says_until_when() {
    let world = World::start("gates-soak", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("soak-after-node", "2s").await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "a soak", |m| {
            m.starts_with("Waiting: soaking after node ") && m.contains(" until ")
        })
        .await;
    let soaking = world.event_messages("UpgradeWaiting").await;
    assert!(
        soaking
            .iter()
            .any(|m| m.starts_with("Waiting: soaking after node ")),
        "{soaking:?}"
    );
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
    // One hold per node but the last: after each of the two workers.
    wait_for_metric(&world, "talos_upgrade_holds_total", "soak", "2").await;
}

#[tokio::test]
async fn the_canary_pauses_after_one_node_until_unpaused_or_resumed() {
    let world = World::start("gates-canary", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("pause-after-nodes", "1").await;
    world.annotate("talos-target", "1.12.0").await;
    let canary = |m: &str| m.starts_with("Paused by the canary pause after 1 upgraded node");
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the canary pause", canary)
        .await;
    assert_eq!(world.upgrade_calls().len(), 1);
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Paused"
    );
    world.restart_controller().await;
    world.poke_and_wait(1).await;
    assert!(canary(&world.annotation("talos-message").await));
    assert_eq!(world.upgrade_calls().len(), 1);

    // The usual pause and unpause lets it go on.
    world.annotate("paused", "true").await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "paused by the user", |m| {
            m.starts_with("Paused after 1/3 nodes")
        })
        .await;
    world.remove_annotation("paused").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);

    // A new run pauses again; resume releases it.
    world.annotate("talos-target", "1.13.0").await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the canary pause", canary)
        .await;
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("resume").await, "");
}

#[tokio::test]
async fn a_held_node_is_skipped_named_and_taken_in_once_unheld() {
    let world = World::start("gates-held", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let worker = world.node("worker-1");
    let hold = "upgrade.vitistack.io/hold";
    world
        .ns
        .kubectl_ok(&["annotate", "machine", &worker, &format!("{hold}=true")])
        .await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    let message = world.annotation("talos-message").await;
    assert_eq!(
        message,
        format!(
            "Talos upgrade completed: now running 1.12.0; held and not upgraded: {worker} (remove \
             {hold} to upgrade it)"
        )
    );
    world
        .wait_for_event(
            "NodeHeld",
            Some(&format!(
                "Node {worker} is held ({hold} is \"true\" on its Machine or Node): the run skips it"
            )),
        )
        .await;
    assert_eq!(world.event_count("NodeHeld").await, 1);
    let calls = world.upgrade_calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(!calls.contains(&worker), "{calls:?}");

    // Unheld: taken in at the next look.
    world
        .ns
        .kubectl_ok(&["annotate", "machine", &worker, &format!("{hold}-")])
        .await;
    world.poke_and_wait(1).await;
    world
        .wait_for_event(
            "NodeJoined",
            Some(&format!(
                "Node {worker} is no longer held; upgrading it from Talos 1.11.6 to 1.12.0"
            )),
        )
        .await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "completed", |m| {
            m == "Talos upgrade completed: now running 1.12.0"
        })
        .await;
    world.assert_each_node_upgraded_once(3);
}

#[tokio::test]
async fn a_soak_holds_across_a_restart_until_the_clock_passes_its_end() {
    let world = World::start("gates-soak-restart", small()).await;
    world.set_clock(tuesday("10:00:00"));
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("soak-after-node", "1h").await;
    world.annotate("talos-target", "1.12.0").await;
    let soaking = |m: &str| {
        m.starts_with("Waiting: soaking after node ") && m.contains(" until 2026-12-01 11:00:")
    };
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "an hour's soak", soaking)
        .await;
    // The Event is published after the annotation: the restart below must not come in between.
    world.wait_for_event("UpgradeWaiting", None).await;
    assert_eq!(world.upgrade_calls().len(), 1);
    wait_for_metric(&world, "talos_upgrade_hold", "soak", "1").await;
    assert!(
        world
            .metrics
            .encode()
            .contains("gate=\"soak\",reason=\"after-node\"} 1"),
        "{}",
        world.metrics.encode()
    );

    // A restarted controller still soaks (the node's end is in the run record), starts nothing.
    world.restart_controller().await;
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    assert!(soaking(&world.annotation("talos-message").await));
    assert_eq!(world.upgrade_calls().len(), 1);
    assert_eq!(world.event_count("UpgradeWaiting").await, 1);

    // Past the soak's end, the next node starts and soaks in its turn; then the last.
    world.set_clock(tuesday("11:30:00"));
    world.poke_and_wait(3).await;
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the second soak", |m| {
            m.starts_with("Waiting: soaking after node ") && m.contains(" until 2026-12-01 12:30:")
        })
        .await;
    assert_eq!(world.upgrade_calls().len(), 2);
    world.set_clock(tuesday("13:00:00"));
    world.poke_and_wait(4).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
    wait_for_metric(&world, "talos_upgrade_hold", "soak", "0").await;
}

#[tokio::test]
async fn a_node_held_on_its_workload_node_is_skipped_and_named() {
    let world = World::start("gates-held-node", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let worker = world.node("worker-2");
    let hold = "upgrade.vitistack.io/hold";
    // The Node of the workload cluster (here the test API server), not the Machine.
    world
        .ns
        .kubectl_ok(&["annotate", "node", &worker, &format!("{hold}=true")])
        .await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        format!(
            "Talos upgrade completed: now running 1.12.0; held and not upgraded: {worker} (remove \
             {hold} to upgrade it)"
        )
    );
    assert_eq!(world.event_count("NodeHeld").await, 1);
    let calls = world.upgrade_calls();
    assert_eq!(calls.len(), 2, "{calls:?}");
    assert!(!calls.contains(&worker), "{calls:?}");

    // A restarted controller keeps it held: no call, no second Event, the completion still names it.
    let completed = world.annotation("talos-message").await;
    world.restart_controller().await;
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    assert_eq!(world.annotation("talos-message").await, completed);
    assert_eq!(world.upgrade_calls().len(), 2);
    assert_eq!(world.event_count("NodeHeld").await, 1);
    world
        .ns
        .kubectl_ok(&["annotate", "node", &worker, &format!("{hold}-")])
        .await;
}

#[tokio::test]
async fn an_invalid_window_is_refused_and_touches_no_node() {
    let world = World::start("gates-bad-window", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .annotate("maintenance-window", "Someday 25:00 4h Mars/Olympus")
        .await;
    world.annotate("talos-target", "1.12.0").await;
    let refused = |m: &str| {
        m.starts_with(
            "Talos upgrade not started: Annotation upgrade.vitistack.io/maintenance-window has the \
             invalid value \"Someday 25:00 4h Mars/Olympus\": ",
        ) && m.contains("use always, or one or more windows")
    };
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the refusal", refused)
        .await;
    let event = world.wait_for_event("InvalidOption", None).await;
    assert!(refused(&event.message), "{}", event.message);
    world.poke_and_wait(1).await;
    assert!(
        world.upgrade_calls().is_empty(),
        "{:?}",
        world.upgrade_calls()
    );
    assert_eq!(world.event_count("InvalidOption").await, 1);

    // Fixed: the run goes.
    world.annotate("maintenance-window", "always").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
}
