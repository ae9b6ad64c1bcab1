//! The operator's gates before each node (issue #23): what may hold a run before it starts its next
//! node, beyond the preflight checks every node gets (nodes Ready, etcd healthy; see
//! [`crate::run::PreflightCheck`]).
//!
//! Two kinds of gate, one vocabulary:
//!
//! * gates decided here from the settings, the run record and the time alone (maintenance windows,
//!   soak, the canary's pause after N nodes): pure, table-tested;
//! * gates whose answer needs IO the shell makes before the decision (the alert gate asks Prometheus,
//!   the health checks read the workload cluster): the shell hands in an [`ExternalCheck`] per gate in
//!   a [`GateObservation`], and the decision here only reads it.
//!
//! A hold never stops a node in flight: it only keeps the next one from starting. Every hold names its
//! [`Gate`] and says, in one sentence, what the run waits for (and until when, where that is known).

use std::collections::BTreeSet;

use jiff::Timestamp;

/// One gate a run may wait at before its next node. Closed: every gate is matched exhaustively where
/// holds are reported and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Gate {
    /// Alerts that should stop an upgrade are firing (or Prometheus cannot tell).
    Alerts,
    /// Outside every maintenance window of the cluster.
    MaintenanceWindow,
    /// The pause after a node, or after the control-plane phase, has not ended.
    Soak,
    /// A health check on the workload cluster fails (or cannot be evaluated).
    HealthChecks,
    /// The canary's `pause after N nodes` was reached: a person looks, then unpauses.
    Canary,
}

impl Gate {
    pub const ALL: [Gate; 5] = [
        Gate::Alerts,
        Gate::MaintenanceWindow,
        Gate::Soak,
        Gate::HealthChecks,
        Gate::Canary,
    ];

    /// The gate's name in metrics labels and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Gate::Alerts => "alerts",
            Gate::MaintenanceWindow => "maintenance-window",
            Gate::Soak => "soak",
            Gate::HealthChecks => "health-checks",
            Gate::Canary => "canary",
        }
    }
}

/// What the shell found for a gate that needs IO, this pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExternalCheck {
    /// The gate is not configured for this cluster: it never holds.
    #[default]
    NotConfigured,
    /// Asked, and nothing holds.
    Clear,
    /// Asked, and the answer holds the run: `message` names what (the alerts and since when, the
    /// failing check).
    Holding { message: String },
    /// Could not be asked or answered (Prometheus unreachable, a check that cannot be evaluated):
    /// holds, never counts as clear.
    Unknown { reason: String },
}

impl ExternalCheck {
    /// Why it holds, if it does.
    pub fn holding(&self) -> Option<&str> {
        match self {
            ExternalCheck::NotConfigured | ExternalCheck::Clear => None,
            ExternalCheck::Holding { message } => Some(message),
            ExternalCheck::Unknown { reason } => Some(reason),
        }
    }
}

/// What the shell observed for the gates, handed to the decision with the rest of the observation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GateObservation {
    pub alerts: ExternalCheck,
    pub health_checks: ExternalCheck,
    /// Nodes whose Machine or Node is annotated to be held: the run skips them and says so.
    pub held_nodes: BTreeSet<String>,
}

/// Why a run is not starting its next node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub gate: Gate,
    /// One sentence: what the run waits for.
    pub message: String,
    /// When the hold ends by itself, where that is known (a window's opening, a soak's end): the
    /// shell looks again then.
    pub until: Option<Timestamp>,
}

/// The operator's and the user's gate settings of one run (annotations over flags). Nothing set: no
/// gate holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GateSettings {}

/// What the gates read of the run under way, as the decision hands it over: the gates know nothing
/// of a run's record beyond this.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunProgress {
    /// Nodes done and in all (`d/t`).
    pub done: usize,
    pub total: usize,
}

/// Why the next node may not start now, if a gate says so: canary, maintenance window, soak, alerts,
/// health checks, in that order (the first that holds is the one shown). A user's decision (the
/// canary) comes before the clock, the clock before what must be asked of the cluster. Called only
/// when a node would start: a node in flight is never held.
pub fn hold_before_next_node(
    _settings: &GateSettings,
    observation: &GateObservation,
    _progress: &RunProgress,
    _now: Timestamp,
) -> Option<Hold> {
    let external = |gate: Gate, check: &ExternalCheck| {
        check.holding().map(|message| Hold {
            gate,
            message: message.to_string(),
            until: None,
        })
    };
    external(Gate::Alerts, &observation.alerts)
        .or_else(|| external(Gate::HealthChecks, &observation.health_checks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clear_or_unconfigured_check_lets_the_run_go_on() {
        assert_eq!(ExternalCheck::NotConfigured.holding(), None);
        assert_eq!(ExternalCheck::Clear.holding(), None);
        let firing = ExternalCheck::Holding {
            message: "alert NodeDown is firing".to_string(),
        };
        assert_eq!(firing.holding(), Some("alert NodeDown is firing"));
        let unknown = ExternalCheck::Unknown {
            reason: "Prometheus at http://127.0.0.1:9090 did not answer".to_string(),
        };
        assert_eq!(
            unknown.holding(),
            Some("Prometheus at http://127.0.0.1:9090 did not answer")
        );
    }

    #[test]
    fn every_gate_has_its_own_name() {
        let names: BTreeSet<&str> = Gate::ALL.iter().map(|gate| gate.as_str()).collect();
        assert_eq!(names.len(), Gate::ALL.len());
    }
}
