//! `talos-status: in-progress` as soon as a new Talos target is seen, judged on the annotations and the
//! versions the controller last saw, before the reconcile reads the cluster's credentials and asks its
//! nodes. The controller's shell writes it (reconcile/acknowledge.rs, which says why); the rules are
//! here.
//!
//! The run itself is still decided on the fresh look: should it refuse the target (a node upgraded by
//! hand since the last look), the run is reported `failed` a moment later and no node is touched.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

use crate::annotations::{self, UpgradeKind, UpgradeStatus};
use crate::gates;
use crate::intent::{Target, UpgradeIntent};
use crate::kubernetes::KubeRun;
use crate::report::KindReport;
use crate::talos::{Run, TalosVersions};
use crate::versions::TalosStep;

/// What a reconcile last saw of a cluster's versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastLook {
    pub versions: TalosVersions,
    pub at: Timestamp,
}

/// An acknowledgement to write before the reconcile looks at the cluster, once the progress record
/// confirms that no run was decided for the target yet ([`Acknowledgement::still_undecided`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Acknowledgement {
    pub report: KindReport,
    /// The target as the user wrote it (trimmed), as a run records it.
    requested: String,
    /// `talos-status` shows no run (`idle`, or not written yet): the controller's last report found no
    /// run recorded (no target, the target removed, or a reset), and any run decided since would have
    /// shown itself, so the progress record need not be read first.
    shows_no_run: bool,
}

impl Acknowledgement {
    /// Whether the progress record must be read, and [`Acknowledgement::still_undecided`] asked,
    /// before the acknowledgement is written: only when the annotations show a run (`completed` or
    /// `failed`: the last value decided, which may be this one).
    pub fn needs_progress(&self) -> bool {
        !self.shows_no_run
    }

    /// Whether the records leave the target to be decided: no run for this value (started, finished
    /// or refused) and no other run still going, Talos or Kubernetes.
    pub fn still_undecided(&self, talos: Option<&Run>, kubernetes: Option<&KubeRun>) -> bool {
        let talos_decided =
            talos.is_some_and(|run| run.requested == self.requested || !run.is_finished());
        !talos_decided && gates::running(kubernetes).is_none()
    }
}

/// The acknowledgement a reconcile may write for its cluster's Talos target, judged on the annotations
/// and the last look alone (at most `max_age` old): only for a target that would start a new run,
/// that nothing in the annotations holds back (a pause, a reset, a bad option, a Kubernetes upgrade
/// shown in progress) and that the last look accepts by the rules a run's start applies. Anything else
/// is left to the reconcile's own report.
pub fn acknowledgement(
    annotations: &BTreeMap<String, String>,
    intent: &UpgradeIntent,
    last: Option<&LastLook>,
    now: Timestamp,
    max_age: Duration,
) -> Option<Acknowledgement> {
    let Target::Version(target) = &intent.talos_target else {
        return None;
    };
    let raw = annotations
        .get(annotations::TALOS_TARGET)
        .map(|value| value.trim())
        .filter(|value| !value.is_empty())?;
    let held_back = intent.talos_reset
        || intent.paused
        || intent.order.is_err()
        || intent.max_parallel_workers.is_err()
        || intent.credentials_secret.is_err()
        || intent.alert_gate.is_err()
        || intent.health_checks.is_err()
        || intent.alert_silences.is_err()
        || intent.maintenance_window.is_err()
        || intent.soak_after_node.is_err()
        || intent.soak_after_control_planes.is_err()
        || intent.pause_after_nodes.is_err()
        // An etcd-snapshot mode other than the default or off depends on the controller having a
        // snapshot destination, which only the reconcile knows: it reports those itself.
        || !matches!(
            intent.etcd_snapshot,
            Ok(None | Some(crate::etcd_snapshot::SnapshotMode::Off))
        );
    let in_progress = |key: &str| {
        annotations.get(key).map(String::as_str) == Some(UpgradeStatus::InProgress.as_str())
    };
    // Already shown (nothing to write), or Kubernetes being upgraded (the Talos run waits for it).
    if held_back
        || in_progress(annotations::TALOS_STATUS)
        || in_progress(annotations::KUBERNETES_STATUS)
    {
        return None;
    }
    let last = last?;
    let age = now.duration_since(last.at);
    if age.is_negative() || age.unsigned_abs() > max_age {
        return None;
    }
    // A refusal is the report's to tell, and so is a target every node already runs (it completes at
    // once).
    let step = crate::talos::check_new_run(&last.versions, target)?;
    if !matches!(step, Ok(TalosStep::Upgrade)) {
        return None;
    }
    let (lowest, _) = last.versions.range.as_ref()?;
    Some(Acknowledgement {
        report: KindReport::new(
            UpgradeKind::Talos,
            UpgradeStatus::InProgress,
            format!("Starting the Talos upgrade from {lowest} to {target}: checking the nodes"),
        ),
        requested: raw.to_string(),
        shows_no_run: annotations
            .get(annotations::TALOS_STATUS)
            .is_none_or(|status| status == UpgradeStatus::Idle.as_str()),
    })
}

#[cfg(test)]
mod tests;
