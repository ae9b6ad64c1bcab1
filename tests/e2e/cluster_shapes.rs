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
/// reboot, as Talos allows), and on Talos ≥ 1.13 it is drained although no other node can take its
/// pods: they go Pending until it is back and uncordoned.
#[tokio::test]
async fn a_single_node_cluster_is_upgraded_on_both_api_generations() {
    upgrades("shape-one-legacy", 1, 0, "1.11.6", "1.12.0").await;
    upgrades("shape-one-lifecycle", 1, 0, "1.13.0", "1.13.1").await;
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
