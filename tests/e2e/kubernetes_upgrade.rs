//! The user guide's Kubernetes upgrade, verbatim, against a real API server, the real kubectl, the
//! controller and a simulated five-node cluster: the full workflow (Talos, then Kubernetes), the version
//! rules and blocked cases with the guide's messages, both targets at once, and `*-available`.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::world::{PHASE_KEY, World, WorldSpec};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::api::Api;

const APPLY: &str = "/machine.MachineService/ApplyConfiguration";
const IMAGE_PULL: &str = "/machine.MachineService/ImagePull";
const TALOS_UPGRADE: &str = "/machine.MachineService/Upgrade";
const FIELDS: [&str; 5] = [
    "apiserver",
    "controller_manager",
    "scheduler",
    "proxy",
    "kubelet",
];

/// For every ApplyConfiguration the simulator received, in order: the node and the image fields that
/// changed from the node's previous configuration (`field`, new image).
fn config_changes(world: &World) -> Vec<(String, Vec<(String, String)>)> {
    config_changes_from(world, "registry.k8s.io", "ghcr.io/siderolabs")
}

/// [`config_changes`] for nodes whose initial images come from `upstream` (the Kubernetes components)
/// and `talos_images` (the kubelet).
fn config_changes_from(
    world: &World,
    upstream: &str,
    talos_images: &str,
) -> Vec<(String, Vec<(String, String)>)> {
    let mut last: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    let mut changes = Vec::new();
    for call in world.sim.record() {
        // Only changes the node accepted (a refused apply changes nothing).
        if call.method != APPLY || call.result != "ok" {
            continue;
        }
        assert_eq!(call.params["mode"], "NO_REBOOT", "{call:?}");
        let images = call.params["images"].clone();
        let before = last.get(&call.node).cloned().unwrap_or_else(|| {
            // The simulator's initial configuration: the images of Kubernetes 1.34.1.
            serde_json::json!({
                "kubelet": format!("{talos_images}/kubelet:v1.34.1"),
                "apiserver": format!("{upstream}/kube-apiserver:v1.34.1"),
                "controller_manager": format!("{upstream}/kube-controller-manager:v1.34.1"),
                "scheduler": format!("{upstream}/kube-scheduler:v1.34.1"),
                "proxy": format!("{upstream}/kube-proxy:v1.34.1"),
            })
        });
        // Worker configs carry no control-plane images (the simulator shows Talos's defaults there).
        let worker = call.node.contains("-worker-");
        let changed: Vec<(String, String)> = FIELDS
            .iter()
            .filter(|field| !worker || **field == "kubelet")
            .filter(|field| images[**field] != before[**field])
            .map(|field| {
                (
                    field.to_string(),
                    images[*field].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        last.insert(call.node.clone(), images);
        changes.push((call.node, changed));
    }
    changes
}

fn calls_of(world: &World, method: &str) -> Vec<String> {
    world
        .sim
        .record()
        .into_iter()
        .filter(|c| c.method == method)
        .map(|c| c.node)
        .collect()
}

#[tokio::test]
async fn the_user_guides_full_upgrade_workflow_talos_then_kubernetes() {
    let world = World::start("k8s-e2e", WorldSpec::default()).await;
    let cps: Vec<String> = (1..=3).map(|i| world.node(&format!("cp-{i}"))).collect();
    let workers: Vec<String> = (1..=2)
        .map(|i| world.node(&format!("worker-{i}")))
        .collect();

    // "Check Available Upgrades": Talos 1.12.0 is offered; Kubernetes 1.35.0 is not, since Talos 1.11
    // does not support it.
    world
        .wait_for_annotation("talos-available", "1.12.0", "60s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.11.6");
    assert_eq!(world.annotation("talos-status").await, "idle");
    assert_eq!(
        world.annotation("talos-message").await,
        "Upgrade available: 1.11.6 → 1.12.0"
    );
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;
    assert_eq!(world.annotation("kubernetes-available").await, "");
    assert_eq!(world.annotation("kubernetes-status").await, "idle");

    // Step 1 of the workflow: Talos.
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/talos-target=1.12.0",
        ])
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    // Nothing newer than 1.12.0 among the guide's releases: no Talos upgrade is offered any more.
    world
        .wait_for_annotation_matching(
            "talos-available",
            Duration::from_secs(60),
            "absent",
            str::is_empty,
        )
        .await;

    // Now Kubernetes 1.35.0 is available.
    world
        .wait_for_annotation("kubernetes-available", "1.35.0", "60s")
        .await;
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Upgrade available: 1.34.1 → 1.35.0"
    );

    // Step 2: Kubernetes.
    let log = world.record_annotations().await;
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/kubernetes-target=1.35.0",
        ])
        .await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    assert_eq!(world.annotation("kubernetes-progress").await, "5/5");
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Kubernetes upgrade completed: now running 1.35.0"
    );
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"KubernetesUpgrade\")].reason}")
            .await,
        "Completed"
    );
    let phases = log.values(PHASE_KEY);
    assert!(
        phases.contains(&"UpgradingKubernetes".to_string()),
        "{phases:?}"
    );
    let statuses = log.values("kubernetes-status");
    assert_eq!(
        statuses
            .iter()
            .skip_while(|s| s.as_str() != "in-progress")
            .map(String::as_str)
            .collect::<Vec<_>>(),
        vec!["in-progress", "completed"],
        "{statuses:?}"
    );
    // Talos 1.12 nodes do not offer a newer Kubernetes from the guide's releases.
    assert_eq!(world.annotation("kubernetes-available").await, "");

    // What the nodes received, in the order of `talosctl upgrade-k8s`: images pulled first; then each
    // control-plane component on one control plane after the other, then kube-proxy, then the kubelets
    // (control planes, then workers), every change exactly once and one field per call.
    let pulls = calls_of(&world, IMAGE_PULL);
    let applies = calls_of(&world, APPLY);
    let first_apply = world
        .sim
        .record()
        .iter()
        .position(|c| c.method == APPLY)
        .expect("an apply");
    let last_pull = world
        .sim
        .record()
        .iter()
        .rposition(|c| c.method == IMAGE_PULL)
        .expect("a pull");
    assert!(last_pull < first_apply, "images pulled before any change");
    for node in cps.iter().chain(&workers) {
        assert!(pulls.contains(node), "{node} pulled its images: {pulls:?}");
    }
    let mut expected = Vec::new();
    for (field, repo) in [
        ("apiserver", "registry.k8s.io/kube-apiserver"),
        (
            "controller_manager",
            "registry.k8s.io/kube-controller-manager",
        ),
        ("scheduler", "registry.k8s.io/kube-scheduler"),
        ("proxy", "registry.k8s.io/kube-proxy"),
    ] {
        for cp in &cps {
            expected.push((
                cp.clone(),
                vec![(field.to_string(), format!("{repo}:v1.35.0"))],
            ));
        }
    }
    for node in cps.iter().chain(&workers) {
        expected.push((
            node.clone(),
            vec![(
                "kubelet".to_string(),
                "ghcr.io/siderolabs/kubelet:v1.35.0".to_string(),
            )],
        ));
    }
    assert_eq!(config_changes(&world), expected, "applies: {applies:?}");
    // The Talos upgrade came first and was not repeated.
    assert_eq!(calls_of(&world, TALOS_UPGRADE).len(), 5);

    // The nodes and the workload cluster show it.
    for node in world.sim.snapshots() {
        assert_eq!(node.kubelet.version, "1.35.0", "{}", node.name);
    }
    let daemonsets: Api<DaemonSet> = Api::namespaced(world.ns.client.clone(), "kube-system");
    let proxy = daemonsets.get("kube-proxy").await.expect("kube-proxy");
    let image = proxy
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.first().and_then(|c| c.image.clone()));
    assert_eq!(image.as_deref(), Some("registry.k8s.io/kube-proxy:v1.35.0"));

    // Events tell the story: the run, each node, the end; each told once.
    let all_events = world.cluster_events().await;
    for event in &all_events {
        assert_eq!(event.count, 1, "announced more than once: {event:?}");
    }
    let events: Vec<(String, String)> = all_events
        .into_iter()
        .map(|e| (e.reason, e.message))
        .collect();
    let mut expected = vec![
        (
            "UpgradeStarted".to_string(),
            "Upgrading Kubernetes from 1.34.1 to 1.35.0 on 5 nodes".to_string(),
        ),
        (
            "UpgradeCompleted".to_string(),
            "Kubernetes upgrade completed: all 5 nodes run 1.35.0".to_string(),
        ),
    ];
    for node in cps.iter().chain(&workers) {
        expected.push((
            "NodeUpgraded".to_string(),
            format!("Node {node} runs Kubernetes 1.35.0"),
        ));
    }
    for event in expected {
        assert!(events.contains(&event), "no {event:?} in {events:#?}");
    }
}

#[tokio::test]
async fn blocked_and_refused_targets_touch_no_node() {
    let world = World::start("k8s-rules", WorldSpec::default()).await;
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;

    // Talos 1.11 does not support 1.35: blocked, with the guide's sentence, until Talos is upgraded.
    world.annotate("kubernetes-target", "1.35.0").await;
    world
        .wait_for_annotation("kubernetes-status", "blocked", "60s")
        .await;
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Talos 1.11.6 does not support K8s 1.35.0. Upgrade Talos first."
    );
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"KubernetesUpgrade\")].reason}")
            .await,
        "Blocked"
    );
    world.poke_and_wait(1).await;
    assert!(calls_of(&world, APPLY).is_empty());
    assert!(calls_of(&world, IMAGE_PULL).is_empty());

    // A skipped minor is refused for good, whatever Talos runs.
    world.annotate("kubernetes-target", "1.36.0").await;
    world
        .wait_for_annotation("kubernetes-status", "failed", "60s")
        .await;
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Kubernetes upgrade refused: Kubernetes upgrades go one minor version at a time: upgrade \
         1.34.1 to 1.35 first. No node was touched."
    );
    // An unparsable one too.
    world.annotate("kubernetes-target", "1.35").await;
    world
        .wait_for_annotation_matching(
            "kubernetes-message",
            Duration::from_secs(60),
            "an invalid-target message",
            |m| m.starts_with("Invalid kubernetes-target:"),
        )
        .await;
    assert_eq!(world.annotation("kubernetes-status").await, "failed");
    // The same version completes at once.
    world.annotate("kubernetes-target", "1.34.1").await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "60s")
        .await;
    world.poke_and_wait(2).await;
    assert!(calls_of(&world, APPLY).is_empty());
    assert!(calls_of(&world, IMAGE_PULL).is_empty());
    let invalid = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "InvalidTarget")
        .count();
    assert_eq!(invalid, 2, "each refusal announced once");
}

#[tokio::test]
async fn both_targets_at_once_upgrade_talos_then_kubernetes_by_themselves() {
    let world = World::start("k8s-both", WorldSpec::default()).await;
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;
    let log = world.record_annotations().await;
    world
        .annotate_raw_pair(
            "upgrade.vitistack.io/talos-target=1.12.0",
            "upgrade.vitistack.io/kubernetes-target=1.35.0",
        )
        .await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "300s")
        .await;
    assert_eq!(world.annotation("talos-status").await, "completed");
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    let messages = log.values("kubernetes-message");
    assert!(
        messages
            .iter()
            .any(|m| m == "Waiting for Talos upgrade to complete"),
        "{messages:?}"
    );
    // Every Talos upgrade call came before the first Kubernetes change.
    let record = world.sim.record();
    let last_talos = record
        .iter()
        .rposition(|c| c.method == TALOS_UPGRADE)
        .expect("talos upgrades");
    // (The Talos run's pre-pull checks the installer with the same ImagePull: not a Kubernetes change.)
    let first_change = record
        .iter()
        .position(|c| {
            c.method == APPLY
                || (c.method == IMAGE_PULL
                    && !c.params["reference"]
                        .as_str()
                        .is_some_and(|r| r.contains("/installer")))
        })
        .expect("kubernetes changes");
    assert!(last_talos < first_change);
    assert_eq!(calls_of(&world, TALOS_UPGRADE).len(), 5);
    assert_eq!(config_changes(&world).len(), 3 * 4 + 5);
}

/// The controller is killed after every Kubernetes change it makes and started afresh: the persisted
/// steps carry the run across, and every component and kubelet is still changed exactly once.
#[tokio::test]
async fn a_controller_killed_after_every_change_changes_each_component_once() {
    let world = World::start(
        "k8s-kill",
        WorldSpec {
            talos: "1.12.0",
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("kubernetes-available", "1.35.0", "60s")
        .await;
    world.annotate("kubernetes-target", "1.35.0").await;
    let total = 3 * 4 + 5;
    for n in 1..=total {
        world
            .poll(
                Duration::from_secs(120),
                &format!("configuration change {n} answered"),
                || {
                    let answered = world
                        .sim
                        .record()
                        .iter()
                        .filter(|c| c.method == APPLY)
                        .nth(n - 1)
                        .is_some_and(|c| c.result != "pending");
                    async move { answered }
                },
            )
            .await;
        world.kill_controller().await;
        world.start_controller();
    }
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    let changes = config_changes(&world);
    assert_eq!(changes.len(), total, "{changes:?}");
    assert!(
        changes.iter().all(|(_, fields)| fields.len() == 1),
        "one field per change, none repeated: {changes:?}"
    );
}

/// A node that refuses its new configuration fails the run, naming the node and what Talos said; no
/// further change is made; after the cause is fixed, `resume` continues from that step, and nothing is
/// changed twice.
#[tokio::test]
async fn a_refused_change_fails_the_run_naming_the_node_and_resume_finishes_it() {
    let world = World::start(
        "k8s-refused",
        WorldSpec {
            talos: "1.12.0",
            ..WorldSpec::default()
        },
    )
    .await;
    let cp2 = world.node("cp-2");
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;
    world
        .sim
        .inject_fault(&cp2, talos_sim::Fault::ApplyConfigRejected)
        .expect("fault");
    world.annotate("kubernetes-target", "1.35.0").await;
    world
        .wait_for_annotation("kubernetes-status", "failed", "120s")
        .await;
    let message = world.annotation("kubernetes-message").await;
    assert!(
        message.starts_with(&format!(
            "Kubernetes upgrade failed: updating kube-apiserver on node {cp2} failed:"
        )),
        "{message}"
    );
    assert!(message.contains("rejected by injected fault"), "{message}");
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradeFailed");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"KubernetesUpgrade\")].reason}")
            .await,
        "Failed"
    );
    let failed = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "UpgradeFailed")
        .collect::<Vec<_>>();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].type_, "Warning");
    assert_eq!(failed[0].message, message);
    // Only cp-1's kube-apiserver changed; the run stopped at cp-2, which was asked once.
    world.poke_and_wait(1).await;
    let before = config_changes(&world);
    assert_eq!(before.len(), 1, "{before:?}");
    assert_eq!(
        calls_of(&world, APPLY)
            .iter()
            .filter(|n| **n == cp2)
            .count(),
        1
    );

    world.sim.clear_faults(&cp2).expect("clear");
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("resume").await, "", "resume is consumed");
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    let changes = config_changes(&world);
    assert_eq!(changes.len(), 3 * 4 + 5, "{changes:?}");
    assert!(changes.iter().all(|(_, fields)| fields.len() == 1));
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
}

/// Nodes that take their images from a mirror keep taking them from it: only the tag changes.
#[tokio::test]
async fn image_repositories_come_from_each_nodes_configuration() {
    const MIRROR: &str = "registry.example.internal:5000/k8s";
    let world = World::start(
        "k8s-mirror",
        WorldSpec {
            talos: "1.12.0",
            image_registry: Some(MIRROR),
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;
    world.annotate("kubernetes-target", "1.35.0").await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    let changes = config_changes_from(&world, MIRROR, MIRROR);
    assert_eq!(changes.len(), 3 * 4 + 5, "{changes:?}");
    for (node, fields) in &changes {
        for (field, image) in fields {
            let name = match field.as_str() {
                "apiserver" => "kube-apiserver",
                "controller_manager" => "kube-controller-manager",
                "scheduler" => "kube-scheduler",
                "proxy" => "kube-proxy",
                _ => "kubelet",
            };
            assert_eq!(image, &format!("{MIRROR}/{name}:v1.35.0"), "{node}");
        }
    }
    // The pulls asked for the mirror's images too.
    let pulled: Vec<String> = world
        .sim
        .record()
        .into_iter()
        .filter(|c| c.method == IMAGE_PULL)
        .map(|c| c.params.to_string())
        .collect();
    assert!(!pulled.is_empty());
    assert!(pulled.iter().all(|p| p.contains(MIRROR)), "{pulled:?}");
}

/// A Talos target set while a Kubernetes upgrade is under way waits for it: never a node reboot while
/// static pods are being patched.
#[tokio::test]
async fn a_talos_target_set_during_a_kubernetes_upgrade_waits_for_it() {
    let world = World::start(
        "k8s-then-talos",
        WorldSpec {
            talos: "1.12.0",
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("kubernetes-available", "1.35.0", "60s")
        .await;
    let log = world.record_annotations().await;
    world.annotate("kubernetes-target", "1.35.0").await;
    world
        .poll(
            Duration::from_secs(120),
            "the first configuration change",
            || {
                let applied = !calls_of(&world, APPLY).is_empty();
                async move { applied }
            },
        )
        .await;
    world.annotate("talos-target", "1.13.0").await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.13.0");
    let messages = log.values("talos-message");
    assert!(
        messages.iter().any(|m| m
            == "Waiting: the Kubernetes upgrade to 1.35.0 is running; the Talos upgrade starts when it is done"),
        "{messages:?}"
    );
    let record = world.sim.record();
    let last_change = record
        .iter()
        .rposition(|c| c.method == APPLY)
        .expect("changes");
    let first_talos = record
        .iter()
        .position(|c| c.method == TALOS_UPGRADE)
        .expect("talos upgrades");
    assert!(
        last_change < first_talos,
        "Kubernetes finished before Talos began"
    );
    assert_eq!(config_changes(&world).len(), 3 * 4 + 5);
    assert_eq!(calls_of(&world, TALOS_UPGRADE).len(), 5);
}

/// Live release sources are asked in the background: one that accepts and never answers does not keep
/// the controller from reconciling and reporting what it knows.
#[tokio::test]
async fn a_release_source_that_hangs_does_not_hold_up_reconciles() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use talos_upgrade_controller::catalog_sources::{CatalogHandle, LiveConfig, SourceState};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let asked = Arc::new(AtomicUsize::new(0));
    {
        let asked = asked.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                asked.fetch_add(1, Ordering::SeqCst);
                // Never read, never answer, never close.
                held.push(socket);
            }
        });
    }
    let live = LiveConfig {
        enabled: true,
        talos_factory_url: Some(format!("http://{address}")),
        kubernetes_tags_url: Some(format!("http://{address}/v2/kube-apiserver/tags/list")),
        timeout: Duration::from_secs(3600),
        ..LiveConfig::default()
    };
    let catalog =
        CatalogHandle::start(crate::world::guide_releases(), &live).expect("live catalog");
    let world = World::start(
        "k8s-hang",
        WorldSpec {
            catalog: Some(catalog.clone()),
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .poll(
            Duration::from_secs(60),
            "the release source to be asked",
            || {
                let asked = asked.clone();
                async move { asked.load(Ordering::SeqCst) > 0 }
            },
        )
        .await;
    world
        .wait_for_annotation("talos-available", "1.12.0", "60s")
        .await;
    world.poke_and_wait(1).await;
    assert_eq!(world.annotation("talos-status").await, "idle");
    // All of that while the source still has not answered.
    assert_eq!(catalog.state().talos, SourceState::Pending);
}
