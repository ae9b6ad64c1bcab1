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

/// The controller's `talos_upgrade_talos_api_calls_total{method="Version",code="OK"}` so far.
fn version_calls(world: &World) -> u64 {
    world
        .metrics
        .encode()
        .lines()
        .find(|line| {
            line.starts_with("talos_upgrade_talos_api_calls_total{")
                && line.contains(r#"method="Version""#)
                && line.contains(r#"code="OK""#)
        })
        .and_then(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .map_or(0, |value| value as u64)
}

/// Issue 27 item 3 and the exploration's bug 2: an idle cluster's refresh reads each node's Talos
/// version from its Ready workload Node (`osImage`, which the kubelet takes from the os-release Talos
/// writes) and asks one node's Talos API per look, in turn, not every node; and `talos-current`
/// still follows nodes upgraded by hand (talosctl, behind the controller's back) within the refresh.
#[tokio::test]
async fn an_idle_refresh_asks_one_node_and_still_sees_nodes_upgraded_by_hand() {
    use talos_api::{ConnectOptions, LegacyUpgradeOptions, TalosClient, Talosconfig, Target};
    use talos_sim::ClientRole;

    let world = World::start(
        "refresh-hand",
        WorldSpec {
            // The controller looks again at an idle cluster every second (10 minutes by default).
            idle_interval: Duration::from_secs(1),
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    // A few idle looks: at most one Version call each (one more for a look under way at either
    // end), where every node was asked before.
    let (calls, looks) = (version_calls(&world), world.reconciles());
    world
        .poll(Duration::from_secs(60), "three idle refreshes", || async {
            world.reconciles() >= looks + 3
        })
        .await;
    let (calls_after, looks_after) = (version_calls(&world), world.reconciles());
    assert!(
        calls_after - calls <= looks_after - looks + 1,
        "{} Version calls in {} looks",
        calls_after - calls,
        looks_after - looks
    );
    assert!(calls_after > calls, "each look still asks a node");

    // An operator upgrades every node with talosctl.
    let credentials = Talosconfig::from_yaml(&world.sim.talosconfig(ClientRole::Admin))
        .and_then(|config| config.current_context()?.credentials())
        .expect("the simulator's talosconfig");
    for node in world.sim.nodes() {
        let client = TalosClient::connect(
            &credentials,
            Target::Node(std::net::IpAddr::V4(node.address)),
            &ConnectOptions {
                port: world.sim.config().port,
                ..ConnectOptions::default()
            },
        )
        .await
        .expect("connecting to the node");
        client
            .upgrade_legacy(
                "ghcr.io/siderolabs/installer:v1.12.0",
                &LegacyUpgradeOptions {
                    preserve: true,
                    ..LegacyUpgradeOptions::default()
                },
            )
            .await
            .expect("the upgrade by hand is accepted");
        // One at a time, as talosctl's user would (Talos refuses while an etcd member is down).
        world
            .poll(
                Duration::from_secs(120),
                "the node back on 1.12.0",
                || async {
                    world
                        .sim
                        .node_snapshot(&node.name)
                        .is_ok_and(|node| node.talos_version == "1.12.0" && node.ready)
                },
            )
            .await;
    }
    world
        .wait_for_annotation("talos-current", "1.12.0", "120s")
        .await;
    // The controller made no call of its own to any node.
    let record = world.sim.record();
    assert_eq!(record.len(), 5, "{record:#?}");
    assert!(
        record
            .iter()
            .all(|call| call.method == "/machine.MachineService/Upgrade"),
        "{record:#?}"
    );
}
