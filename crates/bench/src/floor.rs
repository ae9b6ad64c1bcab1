//! `--floor`: the least time the API server alone needs, on this machine, between N clusters' annotations
//! and their `in-progress`, with no controller running.
//!
//! A controller, however quick, learns of a cluster's new target from its watch and then patches
//! `talos-status: in-progress` into the cluster's annotations. Here that patch goes out for each cluster
//! the moment the API server answers the cluster's annotation, before any watch could have delivered it,
//! with no read, no Talos call and no status patch: all clusters at once, as the benchmark annotates them.
//! No controller can report sooner on the same API server and machine, so a floor above the 1 s target
//! means that no controller can meet it here; a floor below it is the part of the measured latency that
//! is the API server's and not the controller's.

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use talos_upgrade_core::annotations::{TALOS_MESSAGE, TALOS_PROGRESS, TALOS_STATUS};
use talos_upgrade_core::crd::KubernetesCluster;

use crate::report::Stats;
use crate::world::{NAMESPACE, World, WorldCpu};

/// The same number of annotations in flight as the measured run (`World::annotate_all`).
const IN_FLIGHT: usize = 64;

#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    pub clusters: usize,
    /// Annotation patch sent → answered (what `kubectl annotate` waits for), seconds.
    pub annotation_answered: Stats,
    /// Annotation patch sent → the `in-progress` patch sent right after it answered, seconds.
    pub in_progress_written: Stats,
}

/// Annotates every cluster of `world` and writes each one `in-progress` as soon as its annotation is
/// answered; nothing else talks to the API server meanwhile but the benchmark's own watch.
pub async fn measure(world: &World) -> anyhow::Result<Floor> {
    let api: Api<KubernetesCluster> = Api::namespaced(world.admin.clone(), NAMESPACE);
    let annotate = crate::world::target_patch();
    let times: Vec<(f64, f64)> = futures::stream::iter(world.clusters.iter())
        .map(|cluster| {
            let api = api.clone();
            let annotate = &annotate;
            async move {
                // What the controller writes when a run starts, less what it learns by looking.
                let in_progress = Patch::Merge(serde_json::json!({
                    "metadata": {"annotations": {
                        TALOS_STATUS: "in-progress",
                        TALOS_MESSAGE: format!("Upgrading node {}-worker-1 (0/5)", cluster.name),
                        TALOS_PROGRESS: "0/5",
                    }}
                }));
                let sent = Instant::now();
                api.patch(&cluster.name, &PatchParams::default(), annotate)
                    .await?;
                let answered = sent.elapsed().as_secs_f64();
                api.patch(&cluster.name, &PatchParams::default(), &in_progress)
                    .await?;
                anyhow::Ok((answered, sent.elapsed().as_secs_f64()))
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect()
        .await?;
    let (answered, written): (Vec<f64>, Vec<f64>) = times.into_iter().unzip();
    Ok(Floor {
        clusters: world.clusters.len(),
        annotation_answered: Stats::of(&answered),
        in_progress_written: Stats::of(&written),
    })
}

/// The floor as `--with-floor` takes it for the controller's share: the API server's (and etcd's) CPU
/// over a window as long as the measured run's upgrade, on a fresh world of the same size whose
/// clusters are annotated and written `in-progress` at the window's start ([`measure`]) and then left
/// alone: what the API server spends with no controller (its own loops, the benchmark's watch, the
/// simulated kubelets' writes of nodes that do not change, the annotations). The measured run's API
/// server CPU ÷ this is how many times that work the upgrade made it do.
#[derive(Debug, Clone, Serialize)]
pub struct Share {
    pub floor: Floor,
    pub window_seconds: f64,
    pub cpu: WorldCpu,
}

pub async fn measure_share(world: &World, window: Duration) -> anyhow::Result<Share> {
    let before = world.cpu()?;
    let started = Instant::now();
    let floor = measure(world).await?;
    tokio::time::sleep(window.saturating_sub(started.elapsed())).await;
    let cpu = world.cpu()?.minus(before);
    Ok(Share {
        floor,
        window_seconds: started.elapsed().as_secs_f64(),
        cpu,
    })
}

/// The floor of one size as a table, with the target it bounds.
pub fn table(floor: &Floor) -> String {
    let verdict = if floor.in_progress_written.p99 <= 1.0 {
        "below the target: the rest of a miss is the controller's"
    } else {
        "above the target: no controller meets it on this machine"
    };
    format!(
        "| floor, {n} cluster(s), no controller running | s (p50 / p99 / max) |\n\
         |---|---|\n\
         | annotation patch answered | {answered} |\n\
         | … then `in-progress` patched at once, answered (target ≤ 1 s, p99) | {written} ({verdict}) |\n",
        n = floor.clusters,
        answered = floor.annotation_answered.three(),
        written = floor.in_progress_written.three(),
    )
}
