//! How runs start and go on, end to end, on paths the other suites do not take: the installer image
//! that keeps the node's Image Factory schematic, a run held before a node's turn because another
//! node is not Ready and going on by itself, a Kubernetes target blocked because Talos does not
//! support it starting by itself once Talos is upgraded, and `*-available` fed by live release
//! sources (a real HTTP server on 127.0.0.1). A real API server, the real kubectl, the controller
//! in-process and the Talos simulator; every wait is on a condition, bounded, and "nothing happened
//! meanwhile" is asserted over a counted number of reconciles.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};

use crate::world::{World, WorldSpec};
use talos_sim::{Fault, PowerKind};

const TARGET: &str = "1.12.0";
const PATIENCE: Duration = Duration::from_secs(60);

const TALOS_UPGRADE: &str = "/machine.MachineService/Upgrade";
const APPLY: &str = "/machine.MachineService/ApplyConfiguration";
const IMAGE_PULL: &str = "/machine.MachineService/ImagePull";

/// An Image Factory installer repository with a schematic: the factory's id of a vanilla Talos (no
/// extensions, no kernel arguments), a real 64-hex schematic id.
const FACTORY_INSTALLER: &str =
    "factory.talos.dev/installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";

async fn condition(world: &World, kind: &str, field: &str) -> String {
    world
        .jsonpath(&format!(
            "{{.status.conditions[?(@.type==\"{kind}\")].{field}}}"
        ))
        .await
}

/// Sets the Ready condition of a workload Node, as kubelet (`True`) or the node lifecycle controller
/// once kubelet went silent (`Unknown`) would.
async fn set_node_ready(world: &World, node: &str, ready: bool) {
    let (status, reason, message) = if ready {
        ("True", "KubeletReady", "kubelet is posting ready status")
    } else {
        (
            "Unknown",
            "NodeStatusUnknown",
            "Kubelet stopped posting node status.",
        )
    };
    let now = jiff::Timestamp::now().to_string();
    let patch = serde_json::json!({"status": {"conditions": [{
        "type": "Ready",
        "status": status,
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }]}});
    Api::<Node>::all(world.ns.client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(patch))
        .await
        .unwrap_or_else(|e| panic!("setting Node {node} Ready={status}: {e}"));
}

/// A node installed from an Image Factory installer (`factory.talos.dev/installer/<schematic>:v1.11.6`)
/// is upgraded with the same repository and schematic, only the tag changed: that is the image of every
/// upgrade call, of every `NodeUpgradeStarted` Event, and of each node's machine config afterwards.
#[tokio::test]
async fn the_installer_image_keeps_the_nodes_image_factory_schematic() {
    let world = World::start(
        "starts-factory",
        WorldSpec {
            installer_repository: Some(FACTORY_INSTALLER),
            ..WorldSpec::default()
        },
    )
    .await;
    let from = format!("{FACTORY_INSTALLER}:v1.11.6");
    let to = format!("{FACTORY_INSTALLER}:v{TARGET}");
    for node in world.sim.snapshots() {
        assert_eq!(
            node.installer_image, from,
            "{} was installed from",
            node.name
        );
    }
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;

    // Every upgrade call carried the factory image with the schematic, only the tag changed.
    let calls: Vec<(String, String)> = world
        .sim
        .record()
        .into_iter()
        .filter(|c| c.method == TALOS_UPGRADE)
        .map(|c| {
            (
                c.node,
                c.params["image"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(calls.len(), 5, "{calls:?}");
    for (node, image) in &calls {
        assert_eq!(image, &to, "the upgrade call to {node}");
    }
    // The Events say which image each node got.
    let mut started = world.event_messages("NodeUpgradeStarted").await;
    started.sort();
    let mut expected: Vec<String> = world
        .sim
        .nodes()
        .into_iter()
        .map(|n| {
            format!(
                "Upgrading node {} from Talos 1.11.6 to {TARGET} with {to}",
                n.name
            )
        })
        .collect();
    expected.sort();
    assert_eq!(started, expected);
    // And the nodes now run from it: their machine config names the new factory image.
    for node in world.sim.snapshots() {
        assert_eq!(node.installer_image, to, "{}'s installer image", node.name);
    }
}

/// "All nodes Ready" before each node's turn: worker-1 is upgraded; by the time it is back, cp-3's
/// Kubernetes Node is no longer Ready (kubelet went silent). The run holds before worker-2, says which
/// node it waits for, announces it once and calls no node; when cp-3 is Ready again the run goes on
/// by itself and completes.
#[tokio::test]
async fn a_node_that_is_not_ready_holds_the_next_node_until_it_is_ready_again() {
    let world = World::start("starts-ready", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let (worker1, worker2, cp3) = (
        world.node("worker-1"),
        world.node("worker-2"),
        world.node("cp-3"),
    );
    // worker-1 stays not ready after its reboot until the fault is cleared, so cp-3 can be made
    // NotReady while worker-1 is still in flight, before worker-2's turn is decided.
    world
        .sim
        .inject_fault(&worker1, Fault::ReadyDelay(Duration::from_secs(3600)))
        .expect("fault");
    world.annotate("talos-target", TARGET).await;
    world
        .poll(PATIENCE, "worker-1's upgrade call", || {
            let called = world.upgrade_calls().contains(&worker1);
            async move { called }
        })
        .await;
    set_node_ready(&world, &cp3, false).await;
    world.sim.clear_faults(&worker1).expect("clear");

    let expected =
        format!("Waiting: node {cp3} is not ready; holding before upgrading {worker2} (1/5 done)");
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the hold", |m| m == expected)
        .await;

    // Held: the controller keeps looking (counted reconciles) and calls no other node.
    world.wait_for_reconciles(5, PATIENCE).await;
    assert_eq!(
        world.upgrade_calls(),
        vec![worker1.clone()],
        "held after worker-1"
    );
    assert_eq!(world.annotation("talos-message").await, expected);
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    assert_eq!(world.annotation("talos-progress").await, "1/5");
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradingTalos");
    assert_eq!(
        condition(&world, "TalosUpgrade", "reason").await,
        "InProgress"
    );
    let waiting: Vec<_> = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "UpgradeWaiting" && e.message == expected)
        .collect();
    assert_eq!(waiting.len(), 1, "announced once: {waiting:?}");
    assert_eq!(waiting[0].count, 1, "announced once: {waiting:?}");
    assert_eq!(waiting[0].type_, "Normal");

    // cp-3 is Ready again: the run goes on by itself.
    set_node_ready(&world, &cp3, true).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    let calls = world.assert_each_node_upgraded_once(5);
    assert_eq!(calls[..2], [worker1, worker2], "workers first: {calls:?}");
    // The hold was announced once, however long it lasted.
    assert_eq!(
        world
            .cluster_events()
            .await
            .iter()
            .filter(|e| e.reason == "UpgradeWaiting" && e.message == expected)
            .map(|e| e.count)
            .sum::<u64>(),
        1
    );
}

/// A Kubernetes target the nodes' Talos does not support (1.35.0 on Talos 1.11.6) is `blocked` with the
/// guide's sentence. Once the Talos target is set and Talos is upgraded, the Kubernetes upgrade starts
/// by itself (nobody touches `kubernetes-target` again) and completes; no Kubernetes call reached a node
/// before the last Talos node was back.
#[tokio::test]
async fn a_kubernetes_target_blocked_by_talos_starts_by_itself_once_talos_is_upgraded() {
    let world = World::start("starts-unblock", WorldSpec::default()).await;
    world
        .wait_for_annotation("kubernetes-current", "1.34.1", "60s")
        .await;
    let log = world.record_annotations().await;
    let unsupported = "Talos 1.11.6 does not support K8s 1.35.0. Upgrade Talos first.";

    world.annotate("kubernetes-target", "1.35.0").await;
    world
        .wait_for_annotation("kubernetes-status", "blocked", "60s")
        .await;
    assert_eq!(world.annotation("kubernetes-message").await, unsupported);
    assert_eq!(
        condition(&world, "KubernetesUpgrade", "reason").await,
        "Blocked"
    );
    assert!(
        world
            .event_messages("UpgradeBlocked")
            .await
            .iter()
            .any(|m| m == unsupported),
        "the block is announced"
    );
    world.wait_for_reconciles(3, PATIENCE).await;
    assert!(world.sim.record().is_empty(), "{}", world.sim.record_json());

    // Only the Talos target is set.
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "300s")
        .await;
    assert_eq!(world.annotation("talos-status").await, "completed");
    assert_eq!(world.annotation("talos-current").await, TARGET);
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    assert_eq!(world.annotation("kubernetes-target").await, "1.35.0");
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Kubernetes upgrade completed: now running 1.35.0"
    );
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, TARGET, "{}", node.name);
        assert_eq!(node.kubelet.version, "1.35.0", "{}", node.name);
    }

    // The story a user watching the object saw: blocked with the guide's sentence, Talos completed,
    // and only then the Kubernetes run.
    let states = log.states();
    let first_blocked = states
        .iter()
        .position(|s| s.get("kubernetes-message").map(String::as_str) == Some(unsupported))
        .expect("the unsupported block was shown");
    let k8s_start = states
        .iter()
        .position(|s| s.get("kubernetes-status").map(String::as_str) == Some("in-progress"))
        .expect("the Kubernetes run was shown in progress");
    assert!(first_blocked < k8s_start, "{states:#?}");
    for state in &states[..k8s_start] {
        let status = state.get("kubernetes-status").map(String::as_str);
        assert!(
            matches!(status, None | Some("idle" | "blocked")),
            "Kubernetes neither started nor failed before Talos was done: {state:?}"
        );
    }
    let at_start = &states[k8s_start];
    assert_eq!(
        at_start.get("talos-status").map(String::as_str),
        Some("completed"),
        "{at_start:?}"
    );
    assert_eq!(
        at_start.get("talos-current").map(String::as_str),
        Some(TARGET)
    );
    assert_eq!(
        log.values("talos-status")
            .into_iter()
            .skip_while(|s| s != "in-progress")
            .collect::<Vec<_>>(),
        ["in-progress", "completed"]
    );

    // What the nodes received: every Talos node back up before the first Kubernetes call.
    let record = world.sim.record();
    assert_eq!(
        record.iter().filter(|c| c.method == TALOS_UPGRADE).count(),
        5
    );
    // (The Talos run's pre-pull checks the installer with the same ImagePull: not a Kubernetes call.)
    let kubernetes_call = |c: &&talos_sim::CallRecord| {
        c.method == APPLY
            || (c.method == IMAGE_PULL
                && !c.params["reference"]
                    .as_str()
                    .is_some_and(|r| r.contains("/installer")))
    };
    let first_kubernetes = record
        .iter()
        .filter(kubernetes_call)
        .map(|c| c.elapsed)
        .min()
        .expect("Kubernetes calls");
    let last_back = world
        .sim
        .power_events()
        .iter()
        .filter(|e| e.kind == PowerKind::Up)
        .map(|e| e.elapsed)
        .max()
        .expect("nodes came back");
    assert!(
        last_back < first_kubernetes,
        "the last Talos node was back ({last_back:?}) before the first Kubernetes call \
         ({first_kubernetes:?}): {}",
        world.sim.record_json()
    );
    let last_talos_call = record
        .iter()
        .rposition(|c| c.method == TALOS_UPGRADE)
        .expect("talos upgrades");
    let first_kubernetes_call = record
        .iter()
        .position(|c| kubernetes_call(&c))
        .expect("Kubernetes calls");
    assert!(last_talos_call < first_kubernetes_call);
}

/// What a local release source publishes: the Image Factory's `/versions` and an OCI tag list.
#[derive(Clone)]
struct Releases {
    talos: Arc<Mutex<Vec<String>>>,
    kubernetes: Arc<Mutex<Vec<String>>>,
}

impl Releases {
    fn publish(list: &Mutex<Vec<String>>, tag: &str) {
        list.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(tag.to_string());
    }
}

/// A real HTTP server on 127.0.0.1 answering as the Image Factory (`GET /versions`) and a registry's
/// tag list (`GET /v2/kube-apiserver/tags/list`) do; returns its base URL.
async fn serve_releases(releases: Releases) -> String {
    use axum::routing::get;
    let talos = releases.talos.clone();
    let kubernetes = releases.kubernetes.clone();
    let router =
        axum::Router::new()
            .route(
                "/versions",
                get(move || {
                    let tags = talos.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    async move { axum::Json(tags) }
                }),
            )
            .route(
                "/v2/kube-apiserver/tags/list",
                get(move || {
                    let tags = kubernetes.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    async move {
                        axum::Json(serde_json::json!({"name": "kube-apiserver", "tags": tags}))
                    }
                }),
            );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let address = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    format!("http://{address}")
}

/// The catalog from live sources: releases only the sources know (Talos 1.12.1, Kubernetes 1.34.2,
/// beside the guide's 1.12.0 and 1.35.0) are offered in `talos-available` and `kubernetes-available`,
/// pre-releases are not; when the sources publish newer releases, the controller offers them after
/// the next refresh, by itself.
#[tokio::test]
async fn releases_published_by_live_sources_are_offered_and_newer_ones_picked_up() {
    use talos_upgrade_controller::catalog_sources::{CatalogHandle, LiveConfig, SourceState};

    let releases = Releases {
        talos: Arc::new(Mutex::new(
            ["v1.11.6", "v1.12.0", "v1.12.1", "v1.13.0-beta.0"]
                .map(String::from)
                .to_vec(),
        )),
        kubernetes: Arc::new(Mutex::new(
            ["v1.34.1", "v1.34.2", "v1.35.0", "v1.34.3-rc.0", "latest"]
                .map(String::from)
                .to_vec(),
        )),
    };
    let base = serve_releases(releases.clone()).await;
    let live = LiveConfig {
        enabled: true,
        talos_factory_url: Some(base.clone()),
        kubernetes_tags_url: Some(format!("{base}/v2/kube-apiserver/tags/list")),
        interval: Duration::from_millis(500),
        retry_interval: Duration::from_millis(500),
        timeout: Duration::from_secs(30),
        ..LiveConfig::default()
    };
    // The guide's catalog (Talos 1.11.6 → 1.12.0, Kubernetes 1.34.1 → 1.35.0) as the base.
    let catalog =
        CatalogHandle::start(crate::world::guide_releases(), &live).expect("live catalog");
    let world = World::start(
        "starts-live",
        WorldSpec {
            catalog: Some(catalog.clone()),
            // The controller's own idle refresh (10 minutes): a new catalog reaches the idle cluster
            // because the catalog's change starts a reconcile of every cluster, not by a short poll.
            ..WorldSpec::default()
        },
    )
    .await;

    world
        .wait_for_annotation("talos-available", "1.12.1", "60s")
        .await;
    world
        .wait_for_annotation("kubernetes-available", "1.34.2", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Upgrade available: 1.11.6 → 1.12.1"
    );
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Upgrade available: 1.34.1 → 1.34.2"
    );
    assert_eq!(world.annotation("talos-status").await, "idle");
    let state = catalog.state();
    assert_eq!(state.talos, SourceState::Ok { releases: 3 });
    assert_eq!(state.kubernetes, SourceState::Ok { releases: 3 });

    // New releases are published: the next refresh brings them, and the controller offers them.
    Releases::publish(&releases.talos, "v1.12.2");
    Releases::publish(&releases.kubernetes, "v1.34.3");
    world
        .wait_for_annotation("talos-available", "1.12.2", "60s")
        .await;
    world
        .wait_for_annotation("kubernetes-available", "1.34.3", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Upgrade available: 1.11.6 → 1.12.2"
    );
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Upgrade available: 1.34.1 → 1.34.3"
    );
    // No node was touched by any of it.
    assert!(world.sim.record().is_empty(), "{}", world.sim.record_json());
}
