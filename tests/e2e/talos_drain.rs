//! Talos ≥ 1.13, where the controller drives the upgrade itself: install, cordon and drain through the
//! eviction API (PodDisruptionBudgets computed by the real disruption controller), reboot, uncordon.
//! Against the real API server, the simulator and the real kubectl.

use std::time::Duration;

use crate::world::{World, WorldSpec};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, PostParams};
use talos_sim::{CallRecord, Role, max_concurrently_down};

pub(crate) const LIFECYCLE_UPGRADE: &str = "/machine.LifecycleService/Upgrade";
pub(crate) const IMAGE_PULL: &str = "/machine.ImageService/Pull";
pub(crate) const REBOOT: &str = "/machine.MachineService/Reboot";

/// Creates a pod bound to `node` (the simulator plays its kubelet and reports it Ready).
pub(crate) async fn web_pod(world: &World, name: &str, node: &str) {
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
pub(crate) async fn web_budget(world: &World, healthy: i32) {
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

pub(crate) async fn pod_exists(world: &World, name: &str) -> bool {
    let pods: Api<Pod> = Api::namespaced(world.ns.client.clone(), &world.ns.name);
    pods.get_opt(name).await.expect("get pod").is_some()
}

pub(crate) async fn unschedulable_nodes(world: &World) -> Vec<String> {
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
pub(crate) fn changing_records(world: &World) -> Vec<CallRecord> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|c| [IMAGE_PULL, LIFECYCLE_UPGRADE, REBOOT].contains(&c.method.as_str()))
        .collect()
}

/// `(method, node)` of the calls that change a node, in the order the simulator received them.
pub(crate) fn changing_calls(world: &World) -> Vec<(String, String)> {
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

/// The drain of a node on Talos ≥ 1.13 comes after its new system is installed: a drain that times out
/// leaves a node that boots the new system at its next reboot, whoever reboots it. The run fails saying
/// exactly that, and keeps the node cordoned (its pods gone or going, nothing new scheduled on a node
/// about to change); `resume` drains and reboots it without installing again (a second install before
/// the reboot would switch the bootloader back, talos-1.14.md §4.5).
#[tokio::test]
async fn a_drain_held_past_its_timeout_fails_leaving_the_node_cordoned_and_resume_reboots_it() {
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

    world.annotate("talos-target", "1.13.1").await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let ns = world.ns.name.clone();
    let message = format!(
        "Talos upgrade failed: node {worker_1} could not be drained within 3s: eviction of pod {ns}/web-1 \
         refused: Cannot evict pod as it would violate the pod's disruption budget (The disruption budget \
         web needs 1 healthy pods and has 1 currently); it was not rebooted: it runs Talos 1.13.0, and \
         Talos 1.13.1 is installed and boots at its next reboot. It is left cordoned: set resume to drain \
         and reboot it, or uncordon it to keep it on 1.13.0 until it reboots"
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

    // The pod stayed, the node stays cordoned, and nothing rebooted: only worker-1 got the new system,
    // staged. Looking again changes none of it.
    assert!(pod_exists(&world, "web-1").await);
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    assert_eq!(
        unschedulable_nodes(&world).await,
        vec![worker_1.clone()],
        "worker-1 is left cordoned"
    );
    // (Every node pulled its installer first, before any node was touched: the pre-pull.)
    let calls = changing_calls(&world);
    let (pulls, rest) = calls.split_at(calls.len().min(5));
    assert!(
        pulls.iter().all(|(m, _)| m == IMAGE_PULL),
        "the pre-pull first: {calls:?}"
    );
    assert_eq!(rest, [(LIFECYCLE_UPGRADE.to_string(), worker_1.clone())]);
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.13.0", "{}", node.name);
    }

    // The user lets the pod go (the budget is removed) and resumes: worker-1 is drained and rebooted
    // into the system installed before, then the run goes on and completes.
    let budgets: Api<PodDisruptionBudget> =
        Api::namespaced(world.ns.client.clone(), &world.ns.name);
    budgets
        .delete("web", &Default::default())
        .await
        .expect("delete the budget");
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("resume").await, "", "resume is consumed");
    assert!(!pod_exists(&world, "web-1").await, "web-1 was evicted");
    let installs_of_worker_1 = changing_calls(&world)
        .into_iter()
        .filter(|(m, n)| m == LIFECYCLE_UPGRADE && *n == worker_1)
        .count();
    assert_eq!(
        installs_of_worker_1,
        1,
        "worker-1 installed once in the whole test: {:?}",
        changing_calls(&world)
    );
    // Every node rebooted once into 1.13.1, none left cordoned, the run says completed.
    world.assert_talos_run_kept_its_promises("1.13.1").await;
    let calls = changing_calls(&world);
    for node in world.sim.nodes() {
        let reboots = calls
            .iter()
            .filter(|(m, n)| m == REBOOT && *n == node.name)
            .count();
        assert_eq!(reboots, 1, "{}: {calls:?}", node.name);
    }
}

/// Talos ≥ 1.13: a node whose pull never completes (its Talos API answers `Unavailable` to it every
/// time) fails the run in the pre-pull, after its three attempts, naming the node and the answer; it
/// was never cordoned nor rebooted, and no node got anything but its pull. (The install stage's own
/// deadline, for an install that never gets through after a pull, is a unit test:
/// `an_install_that_never_gets_through_fails_at_the_node_deadline`.)
#[tokio::test]
async fn a_pull_that_never_completes_fails_in_the_pre_pull_without_a_reboot() {
    let world = World::start(
        "install-deadline",
        WorldSpec {
            talos: "1.13.0",
            node_deadline: Duration::from_secs(3),
            ..WorldSpec::default()
        },
    )
    .await;
    let worker_1 = world.node("worker-1");
    world
        .sim
        .inject_fault(&worker_1, talos_sim::Fault::InstallUnavailable)
        .expect("fault");
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;

    world.annotate("talos-target", "1.13.1").await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let message = world.annotation("talos-message").await;
    let prefix = format!(
        "Talos upgrade failed: node {worker_1} could not pull its installer \
         ghcr.io/siderolabs/installer:v1.13.1 (tried 3 times): "
    );
    assert!(
        message.starts_with(&prefix) && message.contains("unavailable"),
        "{message}"
    );
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

    // Looking again does not try again. worker-1 was asked to pull three times (each time answered
    // `Unavailable`), the other nodes pulled once; nothing was installed, nothing rebooted.
    world.poke_and_wait(1).await;
    let calls = changing_records(&world);
    for call in &calls {
        assert_eq!(call.method, IMAGE_PULL, "only pulls: {calls:?}");
        if call.node == worker_1 {
            assert!(
                call.result.starts_with("Unavailable"),
                "every pull of worker-1 answered Unavailable: {calls:?}"
            );
        }
    }
    assert_eq!(
        calls.iter().filter(|c| c.node == worker_1).count(),
        3,
        "{calls:?}"
    );
    let legacy: Vec<_> = world
        .sim
        .record()
        .into_iter()
        .filter(|c| c.method == "/machine.MachineService/Upgrade")
        .collect();
    assert!(legacy.is_empty(), "{legacy:?}");
    assert!(world.sim.power_events().is_empty());
    assert_eq!(
        unschedulable_nodes(&world).await,
        Vec::<String>::new(),
        "worker-1 was never cordoned"
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

/// A poll that never comes (1 h, past every wait below): what moves a run on is then only what wakes
/// its reconcile at once.
const NO_POLL: Duration = Duration::from_secs(60 * 60);

/// Talos ≥ 1.13: the end of a node's install wakes the reconcile that drains and reboots it, as a node
/// coming back wakes the one that starts the next node. With no poll to fall back on, the run still
/// completes: every node's reboot follows its install without waiting for a poll. (The legacy
/// generation needs no such wake-up: talos_upgrade.rs
/// `a_node_coming_back_wakes_the_controller_without_waiting_for_the_poll`.)
#[tokio::test]
async fn the_end_of_an_install_wakes_the_drain_and_reboot_without_a_poll() {
    let world = World::start(
        "install-wakes",
        WorldSpec {
            talos: "1.13.0",
            poll_interval: NO_POLL,
            ..WorldSpec::default()
        },
    )
    .await;
    world.upgrade_talos("1.13.0", "1.14.0").await;
    world.assert_talos_run_kept_its_promises("1.14.0").await;
    each_node_pulled_installed_and_rebooted_once(&world);
}
