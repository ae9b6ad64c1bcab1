//! The simulated nodes in the workload cluster: the simulator's kubelet mirror, started per node.
//!
//! A real Talos node registers itself as a `Node`, runs the control-plane components as static pods,
//! goes `NotReady` while it reboots and is cordoned by Talos while it upgrades; the controller waits on
//! exactly these objects. [`talos_sim::workload::WorkloadMirror`] writes them from the simulator's node
//! snapshots; here it is started for every node of a simulator, each task ending with `stop`.

use std::collections::BTreeSet;

use anyhow::Context;
use talos_sim::Simulator;
use talos_sim::workload::{WorkloadMirror, WorkloadNode};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Keeps every simulated node's `Node` and static pods in the workload cluster in step with the
/// simulator, and plays kubelet for ordinary pods bound to the nodes (runs them; finishes their deletion
/// when a drain evicts them), until `stop` is cancelled. What a cluster that is upgraded needs.
pub fn mirror_workload(
    sim: &Simulator,
    mirror: &WorkloadMirror,
    stop: &CancellationToken,
) -> anyhow::Result<Vec<JoinHandle<()>>> {
    let mut tasks = mirror_nodes(sim, mirror, stop, |_: &WorkloadNode| {})?;
    let names: BTreeSet<String> = sim.nodes().into_iter().map(|node| node.name).collect();
    let mirror = mirror.clone();
    let stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        tokio::select! {
            _ = mirror.run_kubelet(names) => {}
            () = stop.cancelled() => {}
        }
    }));
    Ok(tasks)
}

/// Only the `Node`s and static pods of [`mirror_workload`] (no kubelet for ordinary pods: no pod watch),
/// calling `on_written` with each node state once the workload cluster has it.
pub fn mirror_nodes<F>(
    sim: &Simulator,
    mirror: &WorkloadMirror,
    stop: &CancellationToken,
    on_written: F,
) -> anyhow::Result<Vec<JoinHandle<()>>>
where
    F: FnMut(&WorkloadNode) + Clone + Send + 'static,
{
    let mut tasks = Vec::new();
    for node in sim.nodes() {
        let snapshots = sim
            .subscribe(&node.name)
            .with_context(|| format!("following simulated node {}", node.name))?;
        let mirror = mirror.clone();
        let stop = stop.clone();
        let on_written = on_written.clone();
        tasks.push(tokio::spawn(async move {
            tokio::select! {
                () = mirror.follow_reporting(snapshots, on_written) => {}
                () = stop.cancelled() => {}
            }
        }));
    }
    Ok(tasks)
}
