//! What the controller shows and does after a finished Talos run while `talos-target` stays set (issue
//! 21, item 2): the cluster is still looked at, so a change made outside the controller is seen. Here a
//! node joins the cluster after the run completed, on the old Talos version (vitistack creates its
//! Machine when a node pool grows): the run reopens for it, upgrades it once, and touches no other node.
//!
//! No timing assertions: the controller's idle refresh is short in this world, and every wait is on what
//! a user sees.

use std::time::Duration;

use crate::world::{World, WorldSpec};
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};

fn machines(world: &World) -> Api<DynamicObject> {
    Api::namespaced_with(
        world.ns.client.clone(),
        &world.ns.name,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
            "machines",
        ),
    )
}

/// Removes the node's Machine (as if vitistack had not provisioned it yet); returns it to create again.
async fn take_machine(world: &World, node: &str) -> DynamicObject {
    let api = machines(world);
    let machine = api.get(node).await.expect("the node's Machine");
    api.delete(node, &Default::default())
        .await
        .expect("delete the Machine");
    world
        .poll(
            Duration::from_secs(60),
            "the Machine to be gone",
            || async { api.get_opt(node).await.expect("get Machine").is_none() },
        )
        .await;
    machine
}

/// Creates the Machine again, labels, spec and status as they were: the node joins the inventory.
async fn give_machine(world: &World, machine: &DynamicObject) {
    let api = machines(world);
    let name = machine.metadata.name.clone().expect("a name");
    let fresh: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "vitistack.io/v1alpha1",
        "kind": "Machine",
        "metadata": {"name": name, "labels": machine.metadata.labels},
        "spec": machine.data["spec"],
    }))
    .expect("a Machine");
    api.create(&PostParams::default(), &fresh)
        .await
        .expect("create the Machine");
    api.patch_status(
        &name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"status": machine.data["status"]})),
    )
    .await
    .expect("the Machine's status");
}

/// Issue 21 item 2: a sixth worker joins on Talos 1.11.6 after a run to 1.12.0 completed (target still
/// set). It is shown and upgraded: the run reopens, the new node gets one upgrade call, no other node a
/// second one, a `NodeJoined` Event says so once, and the run completes at 6/6.
#[tokio::test]
async fn a_node_that_joins_after_a_completed_run_is_upgraded_and_counted() {
    let world = World::start(
        "refresh-join",
        WorldSpec {
            workers: 3,
            start_controller: false,
            // The controller looks again at a finished cluster every second (10 minutes by default).
            idle_interval: Duration::from_secs(1),
            ..WorldSpec::default()
        },
    )
    .await;
    let joining = world.node("worker-3");
    // Its Machine does not exist yet when the controller starts: the cluster has five nodes.
    let machine = take_machine(&world, &joining).await;
    world.start_controller();
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    let first_run = world.upgrade_calls();
    assert_eq!(first_run.len(), 5, "{first_run:?}");
    assert!(!first_run.contains(&joining), "{first_run:?}");

    let log = world.record_annotations().await;
    give_machine(&world, &machine).await;
    world
        .wait_for_annotation("talos-progress", "6/6", "180s")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    // The story a user watching saw: completed, reopened for the new node, completed again.
    let statuses = log.values("talos-status");
    assert_eq!(
        statuses,
        vec!["completed", "in-progress", "completed"],
        "{:#?}",
        log.states()
    );

    // One upgrade call to the new node, after the five others; none again to an old one.
    let calls = world.assert_each_node_upgraded_once(6);
    assert_eq!(calls.last(), Some(&joining), "{calls:?}");
    world.assert_talos_run_kept_its_promises("1.12.0").await;

    world.poke_and_wait(1).await;
    let joined: Vec<(String, String, u64)> = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "NodeJoined")
        .map(|e| (e.type_, e.message, e.count))
        .collect();
    assert_eq!(
        joined,
        vec![(
            "Normal".to_string(),
            format!("Node {joining} joined on Talos 1.11.6; upgrading it to 1.12.0"),
            1
        )]
    );
    assert_eq!(world.upgrade_calls().len(), 6);
}
