//! Saying `talos-status: in-progress` as soon as a new Talos target is seen, before the reconcile reads
//! the cluster's credentials and asks its nodes.
//!
//! A reconcile that starts a run first reads the credentials Secret and the workload Nodes, then asks
//! every node and etcd, and only then reports. Alone that is a few tens of milliseconds; with a fleet
//! annotated at once it is every cluster's reads and Talos looks queued in the same API server and
//! the same two CPUs, and the user's `kubectl wait` for `in-progress` waited seconds for work that
//! almost never changes the answer. So the reconcile acknowledges the target first, with one
//! metadata-only patch sent before those reads (not beside them, where it queued behind the reads of
//! every other cluster), when the versions the controller last saw on the cluster's nodes (its last
//! look, kept in memory) accept it by the same rules the run's start applies. The same reconcile then
//! looks at the nodes afresh and decides for good, as before: should the fresh look refuse the target
//! (a node upgraded by hand since the last look), the run is reported `failed` a moment later and no
//! node is touched.
//!
//! Whether a run was decided for the target already is read from the annotations when they show no
//! run at all (`talos-status: idle`, or none yet: the first upgrade of a cluster, whose progress record
//! does not exist, is acknowledged without waiting for that read); otherwise from the progress record,
//! which is then nearly always kept in memory.
//!
//! Only the annotations are written here: `status.phase` and the `TalosUpgrade` condition follow with
//! the reconcile's first full report.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use jiff::Timestamp;
use semver::Version;

use super::report::KindReport;
use crate::progress_store::Progress;
use talos_upgrade_core::annotations::{self, UpgradeKind, UpgradeStatus};
use talos_upgrade_core::intent::{Target, UpgradeIntent};
use talos_upgrade_core::versions::{TalosStep, TalosVersion};

/// What a reconcile last saw of a cluster's versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastLook {
    /// Lowest and highest Talos version among the nodes that answered.
    pub talos: (Version, Version),
    /// Lowest kubelet version among the cluster's Talos nodes, when known.
    pub kubernetes: Option<String>,
    pub at: Timestamp,
}

/// The last look of every cluster this controller has looked at since it started, by (namespace,
/// name). A restarted controller knows none, and its first reconciles report as before.
#[derive(Default)]
pub struct LastLooks(Mutex<HashMap<(String, String), LastLook>>);

impl LastLooks {
    pub fn get(&self, key: &(String, String)) -> Option<LastLook> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(key)
            .cloned()
    }

    /// Keeps what a reconcile saw; `None` (it looked and learnt nothing: no node answered, no
    /// credentials) forgets the cluster's last look, so no acknowledgement rests on an older one.
    pub fn note(&self, key: (String, String), look: Option<LastLook>) {
        let mut looks = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match look {
            Some(look) => {
                looks.insert(key, look);
            }
            None => {
                looks.remove(&key);
            }
        }
    }
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

    /// Whether the progress record leaves the target to be decided: no run for this value (started,
    /// finished or refused) and no other run still going, Talos or Kubernetes.
    pub fn still_undecided(&self, progress: &Progress) -> bool {
        let talos_decided = progress
            .talos
            .as_ref()
            .is_some_and(|run| run.requested == self.requested || !run.is_finished());
        let kubernetes_running = progress
            .kubernetes
            .as_ref()
            .is_some_and(|run| !run.is_finished() && !run.steps.is_empty());
        !talos_decided && !kubernetes_running
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
        || intent.credentials_secret.is_err();
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
    let lowest = TalosVersion::from_semver(last.talos.0.clone());
    let highest = TalosVersion::from_semver(last.talos.1.clone());
    // A refusal is the report's to tell, and so is a target every node already runs (it completes at
    // once).
    let step =
        super::talos_flow::check_new_run(&lowest, &highest, last.kubernetes.as_deref(), target);
    if !matches!(step, Ok(TalosStep::Upgrade)) {
        return None;
    }
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
