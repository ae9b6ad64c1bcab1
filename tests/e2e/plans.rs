//! Multi-hop upgrade plans and their preview (issue #24 items 1 and 2), against the real API server,
//! `kubectl`, the controller and the simulator: a target one step cannot reach becomes hops, each an
//! ordinary run; the plan shows in `plan-message` and Events; `*-status` says completed only after the
//! last hop of its kind; a failure stops the plan at its hop and `resume` continues it; the preview
//! touches no node, and the `plan` subcommand prints the same plan.

use std::collections::BTreeMap;

use talos_sim::Fault;
use talos_upgrade_controller::catalog_sources::CatalogHandle;
use talos_upgrade_core::catalog::Catalog;

use crate::world::{AnnotationLog, PHASE_KEY, World, WorldSpec};

/// A small cluster on the built-in release catalog (Talos 1.13.9 and 1.14.1, Kubernetes 1.30.5, 1.31.4
/// …), which is what the plan's intermediate hops are taken from.
fn spec(talos: &'static str, kubernetes: &'static str) -> WorldSpec {
    WorldSpec {
        control_planes: 1,
        workers: 2,
        talos,
        kubernetes,
        catalog: Some(CatalogHandle::fixed(Catalog::builtin())),
        ..WorldSpec::default()
    }
}

/// The installer tags each node's upgrade calls asked for, in order.
fn upgrades_per_node(world: &World) -> BTreeMap<String, Vec<String>> {
    let mut per_node: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for call in world.sim.record() {
        if matches!(
            call.method.as_str(),
            "/machine.MachineService/Upgrade" | "/machine.LifecycleService/Upgrade"
        ) {
            let image = call.params["image"].as_str().unwrap_or_default();
            let tag = image.rsplit_once(':').map(|(_, tag)| tag).unwrap_or(image);
            per_node.entry(call.node).or_default().push(tag.to_string());
        }
    }
    per_node
}

/// Calls that change a node (or its etcd): none may be made by a preview.
const CHANGING: [&str; 9] = [
    "/machine.MachineService/Upgrade",
    "/machine.LifecycleService/Upgrade",
    "/machine.MachineService/ImagePull",
    "/machine.ImageService/Pull",
    "/machine.MachineService/Reboot",
    "/machine.MachineService/Rollback",
    "/machine.MachineService/ApplyConfiguration",
    "/machine.MachineService/EtcdForfeitLeadership",
    "/machine.MachineService/EtcdSnapshot",
];

fn changing_calls(world: &World) -> Vec<String> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|call| CHANGING.contains(&call.method.as_str()))
        .map(|call| format!("{} {}", call.method, call.node))
        .collect()
}

/// Opts in to plans and sets Talos 1.14.1 and Kubernetes 1.32.0 in one change on a world running
/// Kubernetes `kubernetes_from`; waits for the plan's last hop, a Talos one in both plans that use
/// this, so Kubernetes has completed by then, and both kinds are at their targets. The annotations
/// as they moved.
async fn plan_to_talos_1_14_and_kubernetes_1_32(
    world: &World,
    kubernetes_from: &str,
) -> AnnotationLog {
    world
        .wait_for_annotation("kubernetes-current", kubernetes_from, "60s")
        .await;
    let log = world.record_annotations().await;
    world.annotate("upgrade-plan", "multi-hop").await;
    world
        .annotate_raw_pair(
            "upgrade.vitistack.io/talos-target=1.14.1",
            "upgrade.vitistack.io/kubernetes-target=1.32.0",
        )
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "400s")
        .await;
    assert_eq!(world.annotation("kubernetes-status").await, "completed");
    assert_eq!(world.annotation("talos-current").await, "1.14.1");
    assert_eq!(world.annotation("kubernetes-current").await, "1.32.0");
    log
}

#[tokio::test]
async fn a_two_hop_talos_plan_upgrades_each_node_twice_and_completes_only_at_the_end() {
    let world = World::start("plan-talos", spec("1.11.6", "1.34.1")).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let log = world.record_annotations().await;
    world
        .annotate_raw_pair(
            "upgrade.vitistack.io/upgrade-plan=multi-hop",
            "upgrade.vitistack.io/talos-target=1.14.1",
        )
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "300s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.14.1");
    assert_eq!(
        world.annotation("talos-message").await,
        "Talos upgrade completed: now running 1.14.1"
    );
    assert_eq!(
        world.annotation("plan-message").await,
        "finished: 1. Talos 1.11.6 → 1.13.9, 2. Talos 1.13.9 → 1.14.1"
    );

    // Each node: exactly two upgrades, in order, to the hops' versions.
    let per_node = upgrades_per_node(&world);
    assert_eq!(per_node.len(), 3, "{per_node:?}");
    for (node, tags) in &per_node {
        assert_eq!(tags, &["v1.13.9", "v1.14.1"], "{node}");
    }
    // Every node finished the first hop before any started the second.
    let tags: Vec<String> = world
        .sim
        .record()
        .into_iter()
        .filter(|call| call.method.ends_with("/Upgrade"))
        .map(|call| {
            call.params["image"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    let last_first = tags.iter().rposition(|t| t.ends_with(":v1.13.9"));
    let first_second = tags.iter().position(|t| t.ends_with(":v1.14.1"));
    assert!(last_first < first_second, "{tags:?}");

    // What the user saw: the hops in plan-message, talos-current moving hop by hop, and completed
    // only once, at the end.
    let plan = log.values("plan-message");
    for line in [
        "hop 1/2: Talos 1.11.6 → 1.13.9; left: Talos 1.13.9 → 1.14.1",
        "hop 2/2: Talos 1.13.9 → 1.14.1; done: Talos 1.11.6 → 1.13.9; nothing left after it",
    ] {
        assert!(plan.iter().any(|value| value == line), "{plan:?}");
    }
    let current = log.values("talos-current");
    let at = |v: &str| current.iter().position(|c| c == v);
    assert!(
        at("1.11.6") < at("1.13.9") && at("1.13.9") < at("1.14.1"),
        "{current:?}"
    );
    let statuses = log.values("talos-status");
    assert_eq!(
        statuses.iter().filter(|s| *s == "completed").count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(statuses.last().map(String::as_str), Some("completed"));

    assert_eq!(world.event_count("PlanComputed").await, 1);
    assert_eq!(world.event_count("PlanHopStarted").await, 2);
    assert_eq!(world.event_count("PlanHopFinished").await, 2);
    assert_eq!(world.event_count("PlanFinished").await, 1);
    world
        .wait_for_event(
            "PlanHopStarted",
            Some("Starting hop 2/2: Talos 1.13.9 → 1.14.1 of the upgrade plan"),
        )
        .await;
}

#[tokio::test]
async fn without_the_opt_in_the_one_step_refusal_stays() {
    let world = World::start("plan-refuse", spec("1.11.6", "1.34.1")).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("talos-target", "1.14.1").await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Talos upgrade refused: Talos 1.11.6 cannot upgrade to 1.14.1 in one step: upgrade to 1.13 first. No node was touched."
    );
    assert_eq!(world.annotation("plan-message").await, "");
    assert!(world.upgrade_calls().is_empty());
}

#[tokio::test]
async fn an_interleaved_plan_raises_kubernetes_before_the_talos_hop_that_needs_it() {
    // Talos 1.14 runs Kubernetes 1.32 to 1.37: from 1.30 Kubernetes goes up twice first.
    let world = World::start("plan-mixed", spec("1.12.0", "1.30.0")).await;
    let log = plan_to_talos_1_14_and_kubernetes_1_32(&world, "1.30.0").await;
    assert_eq!(
        world.annotation("plan-message").await,
        "finished: 1. Kubernetes 1.30.0 → 1.31.4, 2. Kubernetes 1.31.4 → 1.32.0, 3. Talos 1.12.0 → 1.14.1"
    );
    // Kubernetes went up to what Talos 1.14 supports before any Talos upgrade call.
    let record = world.sim.record();
    let first_talos = record
        .iter()
        .position(|c| c.method.ends_with("/Upgrade"))
        .expect("talos upgrades");
    let last_kubernetes = record
        .iter()
        .rposition(|c| c.method == "/machine.MachineService/ApplyConfiguration")
        .expect("kubernetes changes");
    assert!(last_kubernetes < first_talos);
    let kubernetes = log.values("kubernetes-current");
    assert!(
        kubernetes.iter().any(|v| v == "1.31.4"),
        "Kubernetes moved hop by hop: {kubernetes:?}"
    );
    // Talos was in-progress (waiting for its hop), never completed, while Kubernetes went first.
    let talos = log.values("talos-status");
    assert_eq!(
        talos.iter().filter(|s| *s == "completed").count(),
        1,
        "{talos:?}"
    );
    let messages = log.values("talos-message");
    assert!(
        messages.iter().any(|m| m.starts_with("Upgrade plan hop 1/3: Kubernetes 1.30.0 → 1.31.4 in progress; next for Talos: hop 3/3: Talos 1.12.0 → 1.14.1")),
        "{messages:?}"
    );
}

#[tokio::test]
async fn a_plan_that_fails_at_its_second_hop_stops_there_and_resume_continues_it() {
    let world = World::start("plan-resume", spec("1.11.6", "1.34.1")).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    // The control plane, last in the second hop (workers first), falls back to its old system when
    // it boots 1.14.1; 1.13.9 boots. Injected before the target is set, so the test never races the
    // run to the node.
    let cp = world.node("cp-1");
    world
        .sim
        .inject_fault(&cp, Fault::BootsOldVersionOf("1.14.1".into()))
        .expect("fault");
    world
        .annotate_raw_pair(
            "upgrade.vitistack.io/upgrade-plan=multi-hop",
            "upgrade.vitistack.io/talos-target=1.14.1",
        )
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "180s")
        .await;
    assert_eq!(
        world.annotation("plan-message").await,
        "hop 2/2: Talos 1.13.9 → 1.14.1 failed; the plan stops here until resume; done: Talos 1.11.6 → 1.13.9; nothing left after it"
    );
    assert_eq!(world.annotation("talos-current").await, "1.13.9");
    assert_eq!(world.annotation("failed-nodes").await, cp);
    // Looking again changes nothing: the plan stays at its hop.
    world.poke_and_wait(1).await;
    assert_eq!(upgrades_per_node(&world)[&cp], ["v1.13.9", "v1.14.1"]);
    assert_eq!(world.event_count("PlanFinished").await, 0);

    world.sim.clear_faults(&cp).expect("clear");
    world.annotate_raw("upgrade.vitistack.io/resume=true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.14.1");
    assert_eq!(world.annotation("resume").await, "");
    assert_eq!(
        world.annotation("plan-message").await,
        "finished: 1. Talos 1.11.6 → 1.13.9, 2. Talos 1.13.9 → 1.14.1"
    );
    let per_node = upgrades_per_node(&world);
    for (node, tags) in &per_node {
        let expected: &[&str] = if *node == cp {
            &["v1.13.9", "v1.14.1", "v1.14.1"]
        } else {
            &["v1.13.9", "v1.14.1"]
        };
        assert_eq!(tags, expected, "{node}");
    }
    world.wait_for_event("UpgradeResumed", None).await;
    assert_eq!(
        world.event_count("PlanComputed").await,
        1,
        "the plan was not computed again"
    );
    assert_eq!(world.event_count("PlanFinished").await, 1);
}

#[tokio::test]
async fn the_preview_touches_no_node_and_the_subcommand_prints_the_same_plan() {
    let world = World::start("plan-preview", spec("1.11.6", "1.34.1")).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/plan-preview=true",
            "upgrade.vitistack.io/upgrade-plan=multi-hop",
            "upgrade.vitistack.io/talos-target=1.14.1",
            "upgrade.vitistack.io/soak-after-node=5m",
        ])
        .await;
    let event = world.wait_for_event("PlanPreview", None).await;
    let (cp, w1, w2) = (
        world.node("cp-1"),
        world.node("worker-1"),
        world.node("worker-2"),
    );
    let nodes = format!("nodes: {w1}, {w2}, then {cp}");
    assert_eq!(
        event.message,
        format!(
            "Plan preview: 2 hops; hop 1/2: Talos 1.11.6 → 1.13.9; {nodes}; hop 2/2: Talos 1.13.9 → 1.14.1; {nodes}; gates: Talos: workers-first, 1 worker at a time, every other node up and Ready before each node, etcd healthy and leadership moved off each control plane first, each node done within the node deadline, soak 5m after each node; nothing would hold it now"
        )
    );
    assert_eq!(world.annotation("plan-message").await, event.message);
    // Looking again: nothing is called, nothing announced again, no run started.
    world.poke_and_wait(2).await;
    assert_eq!(changing_calls(&world), Vec::<String>::new());
    assert_eq!(world.event_count("PlanPreview").await, 1);
    assert_eq!(world.event_count("PlanComputed").await, 0);
    assert_eq!(world.annotation("talos-status").await, "idle");

    // The subcommand, from the namespace's kubeconfig, prints the same lines.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_talos-upgrade-controller"))
        .args([
            "plan",
            "--kubeconfig",
            &world.ns.kubeconfig().display().to_string(),
            "--namespace",
            &world.ns.name,
            &world.cluster,
        ])
        .env_remove("TUC_RELEASE_CATALOG")
        .output()
        .await
        .expect("running talos-upgrade-controller plan");
    let stdout = String::from_utf8(output.stdout).expect("UTF-8");
    assert!(
        output.status.success(),
        "plan failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(
        format!(
            "Plan preview: {}",
            stdout.lines().collect::<Vec<_>>().join("; ")
        ),
        event.message,
        "{stdout}"
    );
    assert!(
        stdout.starts_with("2 hops\nhop 1/2: Talos 1.11.6 → 1.13.9; nodes: "),
        "{stdout}"
    );
    assert_eq!(changing_calls(&world), Vec::<String>::new());

    // The preview off (and the soak with it, to keep the test short): the plan runs as previewed.
    world.remove_annotation("soak-after-node").await;
    world.remove_annotation("plan-preview").await;
    world
        .wait_for_annotation("talos-status", "completed", "300s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.14.1");
}

#[tokio::test]
async fn talos_and_kubernetes_hops_alternate_where_the_matrix_demands_it() {
    // Talos 1.13 needs Kubernetes 1.31, Talos 1.14 needs 1.32, and Talos 1.11 runs up to 1.34: Kubernetes
    // goes up to 1.31 on Talos 1.11, Talos to 1.13, Kubernetes to 1.32, then Talos to 1.14.
    let world = World::start("plan-alternate", spec("1.11.0", "1.29.0")).await;
    let log = plan_to_talos_1_14_and_kubernetes_1_32(&world, "1.29.0").await;
    assert_eq!(
        world.annotation("plan-message").await,
        "finished: 1. Kubernetes 1.29.0 → 1.30.5, 2. Kubernetes 1.30.5 → 1.31.4, 3. Talos 1.11.0 → 1.13.9, 4. Kubernetes 1.31.4 → 1.32.0, 5. Talos 1.13.9 → 1.14.1"
    );
    // The calls in the plan's order: each node's Talos upgrades come after Kubernetes 1.31 and the last
    // after Kubernetes 1.32's changes; Kubernetes 1.32's changes come between the two Talos hops.
    let record = world.sim.record();
    let upgrade_to = |tag: &str| {
        record
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                c.method.ends_with("/Upgrade")
                    && c.params["image"]
                        .as_str()
                        .is_some_and(|image| image.ends_with(tag))
            })
            .map(|(at, _)| at)
            .collect::<Vec<_>>()
    };
    let (first_hop, second_hop) = (upgrade_to(":v1.13.9"), upgrade_to(":v1.14.1"));
    assert_eq!((first_hop.len(), second_hop.len()), (3, 3), "{record:?}");
    let applies: Vec<usize> = record
        .iter()
        .enumerate()
        .filter(|(_, c)| c.method == "/machine.MachineService/ApplyConfiguration")
        .map(|(at, _)| at)
        .collect();
    let between = applies
        .iter()
        .filter(|at| **at > *first_hop.last().unwrap() && **at < second_hop[0])
        .count();
    assert!(
        between > 0,
        "Kubernetes 1.32 changes between the Talos hops"
    );
    assert!(applies[0] < first_hop[0], "Kubernetes went first");
    assert!(*applies.last().unwrap() < second_hop[0]);
    let kubernetes = log.values("kubernetes-current");
    for version in ["1.30.5", "1.31.4", "1.32.0"] {
        assert!(kubernetes.iter().any(|v| v == version), "{kubernetes:?}");
    }
    for kind in ["talos-status", "kubernetes-status"] {
        let statuses = log.values(kind);
        assert_eq!(
            statuses.iter().filter(|s| *s == "completed").count(),
            1,
            "{kind}: {statuses:?}"
        );
    }
    assert_eq!(world.event_count("PlanHopFinished").await, 5);
    // The phase shows the kind of the hop in progress: Kubernetes waiting for its next hop during a
    // Talos hop does not make the cluster `UpgradingKubernetes`.
    let phases = log.values(PHASE_KEY);
    let talos_phases = phases.iter().filter(|p| *p == "UpgradingTalos").count();
    let kubernetes_phases = phases
        .iter()
        .filter(|p| *p == "UpgradingKubernetes")
        .count();
    assert_eq!((talos_phases, kubernetes_phases), (2, 2), "{phases:?}");
    assert_eq!(phases.last().map(String::as_str), Some("Ready"));
}
