//! The shell's side of the operator's gates before each node (issue #23): what the gates need that
//! only IO can tell, gathered once per full look at a cluster into a [`GateObservation`] that the
//! pure decision reads ([`talos_upgrade_core::holds`]).
//!
//! The gates decided from settings, the run and the time alone (maintenance windows, soak, canary)
//! need nothing here. What is gathered: the nodes held out of runs (their Machine or Node annotated
//! `upgrade.vitistack.io/hold: "true"`, read with the inventory, so no extra request), and the
//! external checks: alerts ([`alerts`], with `--prometheus-url`) and health checks ([`health`], with
//! the cluster's `health-checks` annotation), each `NotConfigured` when not set up.

use std::collections::BTreeSet;

use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::holds::{ExternalCheck, GateObservation};
use talos_upgrade_core::intent::UpgradeIntent;
use talos_upgrade_core::talos::{Run, StartingNodes};

use crate::cluster_access::Access;

pub mod alerts;
pub mod health;

/// The operator's configuration of the gates that need IO (flags of the `run` command).
#[derive(Debug, Clone, Default)]
pub struct GateConfig {
    /// The alert gate's Prometheus (`--prometheus-url`); `None`: no alert gate.
    pub alerts: Option<alerts::Prometheus>,
    /// Reads the objects of every cluster's health checks (no flag: the checks are per cluster).
    pub health: health::HealthReader,
}

/// What the gates of one cluster are observed with, in one reconcile.
#[derive(Clone, Copy)]
pub struct GateContext<'a> {
    pub cluster: &'a KubernetesCluster,
    pub intent: &'a UpgradeIntent,
    pub config: &'a GateConfig,
    /// The reconcile's time (the controller's clock: tests set it).
    pub now: jiff::Timestamp,
    /// The cluster's Talos run record as this reconcile found it, if any: which nodes it has in
    /// flight or just finished (their alerts are the upgrade's own, see [`alerts`]).
    pub talos_run: Option<&'a Run>,
}

/// What the gates see of the cluster now. `starting` says which nodes the pass may start
/// ([`StartingNodes::Every`]: a run about to start).
pub async fn observe(
    context: &GateContext<'_>,
    access: &Access,
    starting: &StartingNodes,
) -> GateObservation {
    let alerts = async {
        match &context.config.alerts {
            Some(prometheus) => {
                prometheus
                    .check(
                        context.cluster,
                        &context.intent.alert_gate,
                        context.talos_run,
                        context.now,
                    )
                    .await
            }
            None => ExternalCheck::NotConfigured,
        }
    };
    // The checks matter only where a node may start (`may_start` names every pending node of the
    // next role, even while the batch is full): with none, nothing is read. A look at the nodes in
    // flight only starts none (the look at everything that may follow asks the gates again).
    let may_start = match starting {
        StartingNodes::Named(names) => !names.is_empty(),
        StartingNodes::Every => true,
        StartingNodes::InFlight { .. } => false,
    };
    let health_checks = async {
        match &context.intent.health_checks {
            Ok(Some(checks)) if may_start => {
                context
                    .config
                    .health
                    .check(context.cluster, checks, &access.workload)
                    .await
            }
            // An invalid annotation keeps the run from starting before any gate is asked.
            Ok(_) | Err(_) => ExternalCheck::NotConfigured,
        }
    };
    let (alerts, health_checks) = tokio::join!(alerts, health_checks);
    GateObservation {
        alerts,
        health_checks,
        held_nodes: held_nodes(access),
    }
}

/// The nodes whose Machine or workload Node is annotated to be held.
fn held_nodes(access: &Access) -> BTreeSet<String> {
    access
        .inventory
        .iter()
        .filter(|node| node.held)
        .map(|node| node.name.clone())
        .chain(
            access
                .workload_nodes
                .iter()
                .filter(|node| node.node.held)
                .map(|node| node.node.name.clone()),
        )
        .collect()
}
