//! A cluster's life around its upgrades, end to end: what the controller keeps of a cluster after the
//! `KubernetesCluster` is deleted (nothing: its metric series go, and one re-created under the same
//! name starts clean), and the `status.phase` of a cluster a provisioning operator owns (the
//! controller shows its own runs and failures, then gives the operator's phase back).
//!
//! No timing assertions: every wait is `kubectl wait` or polling with generous bounds.

use std::time::{Duration, Instant};

use crate::world::{PHASE_KEY, World, WorldSpec};
use talos_sim::Fault;
use talos_upgrade_core::crd::KubernetesClusterStatus;

const PATIENCE: Duration = Duration::from_secs(120);

/// The lines of the controller's `/metrics` text that belong to the world's cluster.
fn cluster_series(world: &World) -> Vec<String> {
    let namespace = format!("namespace=\"{}\"", world.ns.name);
    let cluster = format!("cluster=\"{}\"", world.cluster);
    world
        .metrics
        .encode()
        .lines()
        .filter(|line| line.contains(&namespace) && line.contains(&cluster))
        .map(str::to_string)
        .collect()
}

/// One sample line of a per-cluster metric of the world's cluster: `name{namespace,cluster,rest} value`.
fn sample(world: &World, name: &str, rest: &str, value: &str) -> String {
    let rest = if rest.is_empty() {
        String::new()
    } else {
        format!(",{rest}")
    };
    format!(
        "{name}{{namespace=\"{}\",cluster=\"{}\"{rest}}} {value}",
        world.ns.name, world.cluster
    )
}

/// Waits until the world's cluster exports every one of `lines` (exactly as written).
async fn wait_for_series(world: &World, lines: &[String]) {
    world
        .poll(PATIENCE, &format!("the metrics {lines:#?}"), || async {
            let series = cluster_series(world);
            lines.iter().all(|line| series.contains(line))
        })
        .await;
}

/// Waits until no series of the world's cluster is left on `/metrics`; panics naming what is left.
/// (The world's own `poll` cannot be used: its report reads the cluster, which is gone.)
async fn wait_until_forgotten(world: &World) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let left = cluster_series(world);
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{PATIENCE:?} after the cluster was deleted, /metrics still has {} series of it:\n{}",
            left.len(),
            left.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Writes `status.phase` as a provisioning operator would (through the status subresource, with the
/// fields vitistack's schema requires once a status exists).
async fn set_phase(world: &World, phase: &str) {
    let current = world.jsonpath("{.status}").await;
    let current: Option<KubernetesClusterStatus> =
        (!current.trim().is_empty()).then(|| serde_json::from_str(&current).expect("status JSON"));
    let desired = KubernetesClusterStatus {
        phase: Some(phase.to_string()),
        conditions: current
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default(),
        ..KubernetesClusterStatus::default()
    };
    let patch =
        KubernetesClusterStatus::merge_patch(current.as_ref(), &desired, jiff::Timestamp::now())
            .expect("a phase to write");
    world
        .ns
        .kubectl_ok(&[
            "patch",
            "kubernetescluster",
            &world.cluster,
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch.to_string(),
        ])
        .await;
    assert_eq!(world.jsonpath("{.status.phase}").await, phase);
}

/// The cluster as its owner wrote it, for creating it again: its spec, labels and every annotation but
/// the controller's and the ones the API server and kubectl keep.
async fn as_written(world: &World) -> serde_json::Value {
    let text = world
        .ns
        .kubectl_ok(&["get", "kubernetescluster", &world.cluster, "-o", "json"])
        .await;
    let object: serde_json::Value = serde_json::from_str(&text).expect("cluster JSON");
    let annotations: serde_json::Map<String, serde_json::Value> = object["metadata"]["annotations"]
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, _)| {
            !key.starts_with("upgrade.vitistack.io/") && !key.starts_with("kubectl.kubernetes.io/")
        })
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    serde_json::json!({
        "apiVersion": object["apiVersion"],
        "kind": object["kind"],
        "metadata": {
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "labels": object["metadata"]["labels"].as_object().cloned().unwrap_or_default(),
            "annotations": annotations,
        },
        "spec": object["spec"],
    })
}

#[tokio::test]
async fn a_deleted_cluster_is_forgotten_and_one_recreated_under_its_name_starts_clean() {
    let world = World::start("lc-forget", WorldSpec::default()).await;
    let node = world.node("worker-1");
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    // A run that fails: the first node cannot pull its installer.
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
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradeFailed");
    // /metrics shows the failure: what the shipped KubernetesClusterUpgradeFailed alert fires on.
    wait_for_series(
        &world,
        &[
            sample(
                &world,
                "talos_upgrade_cluster_phase",
                "phase=\"UpgradeFailed\"",
                "1",
            ),
            sample(
                &world,
                "talos_upgrade_cluster_status",
                "kind=\"talos\",status=\"failed\"",
                "1",
            ),
            sample(
                &world,
                "talos_upgrade_runs_total",
                "kind=\"talos\",result=\"failed\"",
                "1",
            ),
        ],
    )
    .await;
    let written = as_written(&world).await;

    // The cluster is deleted (nothing of this controller's holds the deletion up): every series of it
    // goes from /metrics, so the alert stops.
    world
        .ns
        .kubectl_ok(&[
            "delete",
            "kubernetescluster",
            &world.cluster,
            "--timeout=60s",
        ])
        .await;
    wait_until_forgotten(&world).await;
    // Other metrics stay.
    assert!(world.reconciles() > 0);

    // Created again under the same name, as its owner wrote it, with the same target and the cause
    // fixed: it is a new cluster, and nothing of the old one's failure comes back. The run starts
    // afresh and completes.
    world.sim.clear_faults(&node).expect("clear");
    let mut again = written;
    again["metadata"]["annotations"]["upgrade.vitistack.io/talos-target"] = "1.12.0".into();
    world.ns.kubectl_apply(&again.to_string()).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.annotation("failed-nodes").await, "");
    world
        .poll(PATIENCE, "the phase Ready", || async {
            world.jsonpath("{.status.phase}").await == "Ready"
        })
        .await;
    wait_for_series(
        &world,
        &[
            sample(
                &world,
                "talos_upgrade_cluster_phase",
                "phase=\"Ready\"",
                "1",
            ),
            sample(
                &world,
                "talos_upgrade_cluster_status",
                "kind=\"talos\",status=\"completed\"",
                "1",
            ),
            sample(
                &world,
                "talos_upgrade_runs_total",
                "kind=\"talos\",result=\"completed\"",
                "1",
            ),
        ],
    )
    .await;
    let series = cluster_series(&world);
    assert!(
        !series
            .iter()
            .any(|line| line.contains("failed\"") || line.contains("UpgradeFailed")),
        "the old cluster's failure is gone: {series:#?}"
    );
    // Each node got one upgrade call in the new run; the old run failed in its pre-pull, before any.
    let calls = world.upgrade_calls();
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert_eq!(calls[0], node, "{calls:?}");
}

#[tokio::test]
async fn a_provisioning_phase_is_given_back_when_the_run_ends_and_when_a_failure_is_cleared() {
    let world = World::start("lc-phase", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    // The provisioning operator owns the phase.
    set_phase(&world, "Provisioning").await;
    let log = world.record_annotations().await;
    world.poke_and_wait(1).await;
    assert_eq!(world.jsonpath("{.status.phase}").await, "Provisioning");

    // A run shows as UpgradingTalos while it goes on, and the operator's phase is back once it is done.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world
        .poll(PATIENCE, "the phase Provisioning again", || async {
            world.jsonpath("{.status.phase}").await == "Provisioning"
        })
        .await;
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Completed"
    );
    wait_for_series(
        &world,
        &[sample(
            &world,
            "talos_upgrade_cluster_phase",
            "phase=\"Provisioning\"",
            "1",
        )],
    )
    .await;
    world.poke_and_wait(2).await;
    assert_eq!(world.jsonpath("{.status.phase}").await, "Provisioning");

    // A failure shows as UpgradeFailed until it is cleared; then the operator's phase is back.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.11.6")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    world
        .poll(PATIENCE, "the phase UpgradeFailed", || async {
            world.jsonpath("{.status.phase}").await == "UpgradeFailed"
        })
        .await;
    world
        .annotate_raw("upgrade.vitistack.io/talos-target-")
        .await;
    world
        .wait_for_annotation("talos-status", "idle", "60s")
        .await;
    world
        .poll(
            PATIENCE,
            "the phase Provisioning after the failure",
            || async { world.jsonpath("{.status.phase}").await == "Provisioning" },
        )
        .await;

    assert_eq!(
        log.values(PHASE_KEY),
        [
            "Provisioning",
            "UpgradingTalos",
            "Provisioning",
            "UpgradeFailed",
            "Provisioning"
        ],
        "the phase never went Ready: {:#?}",
        log.states()
    );
}
