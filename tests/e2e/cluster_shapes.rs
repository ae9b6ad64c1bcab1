//! Cluster shapes beyond three control planes and two workers (issue 22, item 7): a single node, one
//! control plane with workers, five control planes, control planes only; on both Talos API
//! generations. Each run keeps the promises every run keeps (each node down once, never two control
//! planes down, nothing left cordoned, `completed` with every node counted).

use crate::world::{World, WorldSpec};

/// Upgrades a cluster of `control_planes` + `workers` nodes on `from` to `to`, and checks the run.
async fn upgrades(
    prefix: &str,
    control_planes: usize,
    workers: usize,
    from: &'static str,
    to: &str,
) {
    let kubernetes = if from.starts_with("1.13") {
        "1.35.0"
    } else {
        "1.34.1"
    };
    let world = World::start(
        prefix,
        WorldSpec {
            control_planes,
            workers,
            talos: from,
            kubernetes,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", from, "60s")
        .await;
    world.annotate("talos-target", to).await;
    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    world.assert_talos_run_kept_its_promises(to).await;
}

/// A single node: its etcd has one member (no leadership to move, no quorum to keep through its own
/// reboot, as Talos allows).
#[tokio::test]
async fn a_single_node_cluster_is_upgraded_on_both_api_generations() {
    upgrades("shape-one-legacy", 1, 0, "1.11.6", "1.12.0").await;
}

/// The only node of a cluster on Talos ≥ 1.13, running a pod that a PodDisruptionBudget protects
/// (tuppr#310): there is nowhere to move it, so the node is neither cordoned nor drained (a drain
/// would be held by the budget until the drain timeout failed the run); it is rebooted into the
/// target, an Event says why, and the pod is still there afterwards.
#[tokio::test]
async fn the_only_node_is_rebooted_without_a_drain_and_keeps_its_pods() {
    use crate::talos_drain::{pod_exists, web_budget, web_pod};
    let world = World::start(
        "shape-one-lifecycle",
        WorldSpec {
            control_planes: 1,
            workers: 0,
            talos: "1.13.0",
            kubernetes: "1.35.0",
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    let node = world.node("cp-1");
    web_pod(&world, "web-1", &node).await;
    web_budget(&world, 1).await;
    world.annotate("talos-target", "1.13.1").await;
    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    world.assert_talos_run_kept_its_promises("1.13.1").await;
    world
        .wait_for_event(
            "NodeDrained",
            Some(&format!(
                "Node {node} is the cluster's only node: no other node can take its pods, so it is \
                 not drained; rebooting it into Talos 1.13.1, and its pods restart with it"
            )),
        )
        .await;
    assert!(pod_exists(&world, "web-1").await, "the pod was not evicted");
}

#[tokio::test]
async fn one_control_plane_with_workers_is_upgraded() {
    upgrades("shape-1-2", 1, 2, "1.13.0", "1.13.1").await;
}

#[tokio::test]
async fn five_control_planes_go_one_at_a_time() {
    upgrades("shape-5-0", 5, 0, "1.11.6", "1.12.0").await;
}

#[tokio::test]
async fn control_planes_only_are_upgraded() {
    upgrades("shape-3-0", 3, 0, "1.13.0", "1.13.1").await;
}
