//! Talos ≥ 1.13, where the controller drives the upgrade itself: install, cordon and drain through the
//! eviction API (PodDisruptionBudgets computed by the real disruption controller), reboot, uncordon.
//! Against the real API server, the simulator and the real kubectl.

use std::time::Duration;

use crate::world::{World, WorldSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, PostParams};
use talos_sim::{CallRecord, Role, max_concurrently_down};

const LIFECYCLE_UPGRADE: &str = "/machine.LifecycleService/Upgrade";
const IMAGE_PULL: &str = "/machine.ImageService/Pull";
const REBOOT: &str = "/machine.MachineService/Reboot";

/// Creates a pod bound to `node` (the simulator plays its kubelet and reports it Ready).
async fn web_pod(world: &World, name: &str, node: &str) {
    let pods: Api<Pod> = Api::namespaced(world.ns.client.clone(), &world.ns.name);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {"app": "web"}},
        "spec": {"nodeName": node, "containers": [{"name": "web", "image": "web:1"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
}

/// A budget that keeps at least one `app=web` pod running; waits until the disruption controller has
/// computed it with `healthy` pods.
async fn web_budget(world: &World, healthy: i32) {
    let budgets: Api<PodDisruptionBudget> =
        Api::namespaced(world.ns.client.clone(), &world.ns.name);
    let budget: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    }))
    .expect("budget");
    budgets
        .create(&PostParams::default(), &budget)
        .await
        .expect("create budget");
    world
        .poll(
            Duration::from_secs(60),
            "the disruption controller to count the web pods",
            || {
                let budgets = budgets.clone();
                async move {
                    budgets
                        .get("web")
                        .await
                        .ok()
                        .and_then(|b| b.status)
                        .is_some_and(|s| s.current_healthy == healthy)
                }
            },
        )
        .await;
}

async fn pod_exists(world: &World, name: &str) -> bool {
    let pods: Api<Pod> = Api::namespaced(world.ns.client.clone(), &world.ns.name);
    pods.get_opt(name).await.expect("get pod").is_some()
}

async fn unschedulable_nodes(world: &World) -> Vec<String> {
    let nodes: Api<Node> = Api::all(world.ns.client.clone());
    let mut cordoned = Vec::new();
    for node in world.sim.nodes() {
        let object = nodes.get(&node.name).await.expect("node");
        if object.spec.and_then(|s| s.unschedulable).unwrap_or(false) {
            cordoned.push(node.name.clone());
        }
    }
    cordoned
}

/// The calls that change a node, in the order the simulator received them.
fn changing_records(world: &World) -> Vec<CallRecord> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|c| [IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT].contains(&c.method.as_str()))
        .collect()
}

/// `(method, node)` of the calls that change a node, in the order the simulator received them.
fn changing_calls(world: &World) -> Vec<(String, String)> {
    changing_records(world)
        .into_iter()
        .map(|c| (c.method, c.node))
        .collect()
}

/// Asserts that every node received exactly pull, install and reboot, in that order, each through a
/// control plane's Talos API (the controller relays a cluster's calls through one, as talosctl does);
/// returns the calls.
fn each_node_pulled_installed_and_rebooted_once(world: &World) -> Vec<(String, String)> {
    let control_planes: Vec<String> = world
        .sim
        .nodes()
        .into_iter()
        .filter(|n| n.role.is_control_plane())
        .map(|n| n.name)
        .collect();
    let records = changing_records(world);
    for call in &records {
        assert!(
            control_planes.contains(&call.endpoint),
            "{} for {} arrived at {}, not at a control plane",
            call.method,
            call.node,
            call.endpoint
        );
    }
    let calls: Vec<(String, String)> = records.into_iter().map(|c| (c.method, c.node)).collect();
    for node in world.sim.nodes() {
        let of_node: Vec<&str> = calls
            .iter()
            .filter(|(_, n)| *n == node.name)
            .map(|(m, _)| m.as_str())
            .collect();
        assert_eq!(
            of_node,
            vec![IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT],
            "{}: {calls:?}",
            node.name
        );
    }
    calls
}

#[tokio::test]
async fn nodes_are_drained_within_their_budgets_then_rebooted_and_uncordoned() {
    let world = World::start(
        "drain",
        WorldSpec {
            talos: "1.13.0",
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_1 = world.node("worker-1");
    let worker_2 = world.node("worker-2");
    web_pod(&world, "web-1", &worker_1).await;
    web_pod(&world, "web-2", &worker_2).await;
    web_budget(&world, 2).await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;

    world.annotate("talos-target", "1.14.0").await;

    // worker-1 goes first: one disruption is allowed, so web-1 is evicted. Then worker-2's only pod is the
    // last healthy one: the budget refuses, and the controller says so, naming the pod and the budget.
    let ns = world.ns.name.clone();
    let held = world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(120),
            "a drain held by the budget",
            |m| m.contains(&format!("draining {worker_2}")) && m.contains("disruption budget"),
        )
        .await;
    assert_eq!(
        held,
        format!(
            "Upgrading node {worker_2} (2/5): draining {worker_2}, 1 pod left; eviction of pod {ns}/web-2 \
             refused: Cannot evict pod as it would violate the pod's disruption budget (The disruption \
             budget web needs 1 healthy pods and has 1 currently)"
        )
    );
    assert!(!pod_exists(&world, "web-1").await, "web-1 was evicted");
    assert!(pod_exists(&world, "web-2").await, "web-2 is protected");
    // Held means held: worker-2 got its new system but no reboot; worker-1 is back and schedulable.
    let calls = changing_calls(&world);
    assert!(
        calls.contains(&(LIFECYCLE_UPGRADE.to_string(), worker_2.clone())),
        "{calls:?}"
    );
    assert!(
        !calls.contains(&(REBOOT.to_string(), worker_2.clone())),
        "{calls:?}"
    );
    assert_eq!(unschedulable_nodes(&world).await, vec![worker_2.clone()]);

    // A replacement pod comes up on the upgraded worker-1 (as a ReplicaSet would): the budget allows a
    // disruption again and the drain goes on by itself.
    web_pod(&world, "web-3", &worker_1).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.14.0");
    assert!(!pod_exists(&world, "web-2").await, "web-2 was evicted");
    assert!(pod_exists(&world, "web-3").await);
    assert_eq!(
        unschedulable_nodes(&world).await,
        Vec::<String>::new(),
        "every node uncordoned"
    );

    // Per node, exactly: pull, install, reboot, in that order; workers first; one control plane at a time.
    let calls = each_node_pulled_installed_and_rebooted_once(&world);
    let mut order = Vec::new();
    for node in world.sim.nodes() {
        let rebooted_at = calls
            .iter()
            .position(|(m, n)| m == REBOOT && *n == node.name)
            .expect("reboot");
        order.push((rebooted_at, node.name.clone()));
    }
    order.sort();
    let first_cp = order.iter().position(|(_, n)| n.contains("-cp-"));
    let last_worker = order.iter().rposition(|(_, n)| n.contains("-worker-"));
    assert!(last_worker < first_cp, "workers first: {order:?}");
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
    let drained = world.event_messages("NodeDrained").await;
    assert!(
        drained.contains(&format!(
            "Node {worker_2} is drained; rebooting it into Talos 1.14.0"
        )),
        "{drained:?}"
    );
}

#[tokio::test]
async fn a_drain_held_past_its_timeout_fails_naming_the_pod_and_uncordons_the_node() {
    let world = World::start(
        "drain-timeout",
        WorldSpec {
            talos: "1.13.0",
            drain_timeout: Duration::from_secs(3),
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_1 = world.node("worker-1");
    // The only web pod, and a budget that wants it running: it can never be evicted.
    web_pod(&world, "web-1", &worker_1).await;
    web_budget(&world, 1).await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;

    world.annotate("talos-target", "1.14.0").await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let ns = world.ns.name.clone();
    let message = format!(
        "Talos upgrade failed: node {worker_1} could not be drained within 3s: eviction of pod {ns}/web-1 \
         refused: Cannot evict pod as it would violate the pod's disruption budget (The disruption budget \
         web needs 1 healthy pods and has 1 currently); it was not rebooted and runs its old version"
    );
    assert_eq!(world.annotation("talos-message").await, message);
    assert_eq!(world.annotation("failed-nodes").await, worker_1);
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradeFailed");
    let failed = world
        .cluster_events()
        .await
        .into_iter()
        .find(|e| e.reason == "UpgradeFailed")
        .expect("an UpgradeFailed event");
    assert_eq!(failed.type_, "Warning");
    assert_eq!(failed.message, message);

    // The pod stayed, the node takes pods again, and nothing rebooted: only worker-1 got the new system.
    assert!(pod_exists(&world, "web-1").await);
    world
        .poll(
            Duration::from_secs(30),
            "worker-1 to be uncordoned",
            || async { unschedulable_nodes(&world).await.is_empty() },
        )
        .await;
    let calls = changing_calls(&world);
    assert_eq!(
        calls,
        vec![
            (IMAGE_PULL.to_string(), worker_1.clone()),
            (LIFECYCLE_UPGRADE.to_string(), worker_1.clone()),
        ]
    );
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.13.0", "{}", node.name);
    }
}

#[tokio::test]
async fn a_lost_reboot_is_sent_again_and_the_node_still_reboots_once() {
    let world = World::start(
        "lost-reboot",
        WorldSpec {
            talos: "1.13.0",
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_1 = world.node("worker-1");
    // worker-1's first reboot never reaches machined: the controller gets `Unavailable` and the node
    // keeps running its old system, drained and cordoned.
    world
        .sim
        .inject_fault(&worker_1, talos_sim::Fault::RebootLost)
        .expect("fault");
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;

    world.annotate("talos-target", "1.14.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    // Every node, worker-1 included, rebooted exactly once into 1.14.0, is uncordoned, and the run says
    // it completed; never two control planes down.
    world.assert_talos_run_kept_its_promises("1.14.0").await;

    // worker-1 was installed once; the reboot it received is the one sent again.
    each_node_pulled_installed_and_rebooted_once(&world);
    let resent: Vec<(String, String)> = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "NodeRebootResent")
        .map(|e| (e.type_, e.message))
        .collect();
    assert_eq!(
        resent,
        vec![(
            "Normal".to_string(),
            format!(
                "Node {worker_1} is still running its old system, ready, after its reboot got no \
                 answer; sending the reboot again"
            )
        )]
    );
}
