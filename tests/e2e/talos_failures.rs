//! Talos OS upgrades that go wrong on a node, end to end: a real API server, the real kubectl, the
//! controller in-process and a simulated five-node cluster with faults injected. Each test checks what a
//! user sees (annotations, `status.phase`, the `TalosUpgrade` condition, Events) and what the nodes
//! received (the simulator's call record), then the documented way out (retry or `resume`).
//!
//! No timing assertions: every wait is `kubectl wait` or polling with generous bounds.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::world::{World, WorldSpec};
use talos_sim::{Fault, Role, max_concurrently_down};

const PATIENCE: Duration = Duration::from_secs(120);

/// Upgrade calls per node.
fn calls_per_node(world: &World) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for node in world.upgrade_calls() {
        *counts.entry(node).or_default() += 1;
    }
    counts
}

async fn condition_reason(world: &World) -> String {
    world
        .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
        .await
}

async fn assert_failed_naming(world: &World, node: &str, message: &str) {
    assert_eq!(world.annotation("talos-status").await, "failed");
    assert_eq!(world.annotation("talos-message").await, message);
    assert_eq!(world.annotation("failed-nodes").await, node);
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradeFailed");
    assert_eq!(condition_reason(world).await, "Failed");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].message}")
            .await,
        message
    );
    let failed = world.wait_for_event("UpgradeFailed", None).await;
    assert_eq!(failed.type_, "Warning");
    assert_eq!(failed.message, message);
}

#[tokio::test]
async fn a_node_that_never_comes_back_fails_the_run_and_a_retry_does_not_upgrade_it_twice() {
    let world = World::start(
        "tf-never",
        WorldSpec {
            node_deadline: Duration::from_secs(3),
            ..Default::default()
        },
    )
    .await;
    let lost = world.node("worker-1");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .sim
        .inject_fault(&lost, Fault::NeverReturns)
        .expect("fault");

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    assert_failed_naming(
        &world,
        &lost,
        &format!("Talos upgrade failed: node {lost} did not come back online within 3s"),
    )
    .await;
    assert_eq!(world.annotation("talos-progress").await, "0/5");
    // The run stopped at the lost node: it got the one upgrade call, nobody else got any, and looking
    // again does not change that.
    assert_eq!(world.upgrade_calls(), vec![lost.clone()]);
    world.poke_and_wait(1).await;
    assert_eq!(world.upgrade_calls(), vec![lost.clone()]);
    assert_eq!(world.annotation("talos-status").await, "failed");
    let failures = world.event_count("UpgradeFailed").await;
    assert_eq!(failures, 1, "the failure is announced once");

    // The documented retry: remove the target, then set it again. Removing a failed target clears the
    // failure (status idle, phase Ready, condition Reset) and touches no node.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target-")
        .await;
    world
        .wait_for_annotation("talos-status", "idle", "60s")
        .await;
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(condition_reason(&world).await, "Reset");

    // The node comes back, on the target (its install had finished before the power-off). Setting the
    // target again at once, while it may still be down, is what a user would do.
    world.sim.clear_faults(&lost).expect("clear");
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(condition_reason(&world).await, "Completed");

    // Exactly once per node over both runs: the node that booted into the target by itself counts as
    // done in the new run and gets no second Upgrade call.
    let calls = world.upgrade_calls();
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert_eq!(calls[0], lost, "{calls:?}");
    assert!(
        calls_per_node(&world).values().all(|&n| n == 1),
        "{calls:?}"
    );
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.12.0", "{}", node.name);
    }
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
}

#[tokio::test]
async fn a_node_that_falls_back_to_its_old_version_fails_the_run_and_resume_retries_it() {
    let world = World::start("tf-fallback", WorldSpec::default()).await;
    let node = world.node("worker-1");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .sim
        .inject_fault(&node, Fault::BootsOldVersion)
        .expect("fault");

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let message = world.annotation("talos-message").await;
    assert_eq!(
        message,
        format!(
            "Talos upgrade failed: node {node} came back on Talos 1.11.6 instead of 1.12.0 (the new \
             system did not boot; A/B fallback from 1.11.6); it was not upgraded again"
        )
    );
    assert_failed_naming(&world, &node, &message).await;
    // The node really did reboot (and fall back), and was never asked again.
    assert_eq!(world.upgrade_calls(), vec![node.clone()]);
    world.poke_and_wait(1).await;
    assert_eq!(world.upgrade_calls(), vec![node.clone()]);
    assert_eq!(
        world.sim.node_snapshot(&node).expect("node").talos_version,
        "1.11.6"
    );

    // The user fixes the cause and asks to resume: the controller removes the key and retries from the
    // failed node. Upgrading that node a second time is exactly what `resume` asks for; the
    // never-twice rule holds within one attempt, and `resume` is the user's explicit new attempt.
    world.sim.clear_faults(&node).expect("clear");
    world.annotate_raw("upgrade.vitistack.io/resume=true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("resume").await, "", "resume is consumed");
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(condition_reason(&world).await, "Completed");
    world.wait_for_event("UpgradeResumed", None).await;

    let expected: BTreeMap<String, usize> = ["cp-1", "cp-2", "cp-3", "worker-1", "worker-2"]
        .into_iter()
        .map(|short| {
            let name = world.node(short);
            let n = if name == node { 2 } else { 1 };
            (name, n)
        })
        .collect();
    assert_eq!(calls_per_node(&world), expected);
    // The second call to the resumed node came before any other node's.
    let calls = world.upgrade_calls();
    assert_eq!(&calls[..2], &[node.clone(), node.clone()], "{calls:?}");
    for snapshot in world.sim.snapshots() {
        assert_eq!(snapshot.talos_version, "1.12.0", "{}", snapshot.name);
    }
}

#[tokio::test]
async fn a_bad_installer_image_fails_the_run_before_any_node_is_touched() {
    let world = World::start("tf-installer", WorldSpec::default()).await;
    let node = world.node("worker-1");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .sim
        .inject_fault(&node, Fault::InstallerPullFails)
        .expect("fault");

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    // The pre-pull finds it before any node is upgraded (docs/upgrades.md, Pre-pull).
    let message = world.annotation("talos-message").await;
    let prefix = format!(
        "Talos upgrade failed: node {node} could not pull its installer \
         ghcr.io/siderolabs/installer:v1.12.0: "
    );
    assert!(message.starts_with(&prefix), "{message}");
    assert!(
        message.contains("failed to pull image") && message.contains("installer:v1.12.0"),
        "the reason names the image that could not be pulled: {message}"
    );
    assert_failed_naming(&world, &node, &message).await;
    assert_eq!(world.annotation("talos-progress").await, "0/5");

    // Each node was asked to pull (the check of Talos < 1.13), that node's refused; no upgrade call
    // to any node, nothing rebooted.
    world.poke_and_wait(1).await;
    let record = world.sim.record();
    assert_eq!(record.len(), 5, "{record:#?}");
    for call in &record {
        assert_eq!(
            call.method, "/machine.MachineService/ImagePull",
            "{record:#?}"
        );
        assert_eq!(call.result == "ok", call.node != node, "{record:#?}");
    }
    assert!(world.sim.power_events().is_empty());
    for snapshot in world.sim.snapshots() {
        assert_eq!(snapshot.talos_version, "1.11.6", "{}", snapshot.name);
    }
}
