//! What one reconcile shows the user, computed: the controller's annotation keys, `status.phase` and the
//! upgrade conditions, as patches against the object as it is. The controller's shell sends them; only
//! what changes is written, so the controller's own writes settle after one round.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use crate::annotations::{self, UpgradeKind, UpgradeStatus};
use crate::crd::condition::Reason as ConditionReason;
use crate::crd::{KubernetesCluster, KubernetesClusterStatus, Phase, set_condition};
use crate::run::{Report, RunState};

/// What one upgrade kind shows after a reconcile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindReport {
    pub kind: UpgradeKind,
    pub status: UpgradeStatus,
    pub message: String,
    /// `done/total`, absent when there is no run.
    pub progress: Option<(usize, usize)>,
    pub current: Option<String>,
    /// `*-available`: `None` leaves the annotation as it is (nothing was learnt this time), `Some(None)`
    /// removes it, `Some(Some(v))` sets it.
    pub available: Option<Option<String>>,
    pub failed_nodes: Vec<String>,
    /// Nodes upgrading right now (for metrics).
    pub in_flight: Vec<String>,
    /// The condition's reason; `None` leaves the condition as it is.
    pub condition_reason: Option<ConditionReason>,
    /// One-shot user annotations to remove (`resume`, the reset key).
    pub consumed: Vec<&'static str>,
}

impl KindReport {
    /// A report of `status` and `message` alone: no progress, versions, nodes or condition change.
    pub fn new(kind: UpgradeKind, status: UpgradeStatus, message: String) -> KindReport {
        KindReport {
            kind,
            status,
            message,
            progress: None,
            current: None,
            available: None,
            failed_nodes: Vec::new(),
            in_flight: Vec::new(),
            condition_reason: None,
            consumed: Vec::new(),
        }
    }

    /// The report of a decision: its state as status and condition reason, its message, progress and
    /// nodes. Versions and consumed keys are the caller's to add.
    pub fn of_decision(kind: UpgradeKind, report: &Report) -> KindReport {
        let (status, reason) = match report.state {
            RunState::InProgress => (UpgradeStatus::InProgress, ConditionReason::InProgress),
            RunState::Paused => (UpgradeStatus::InProgress, ConditionReason::Paused),
            RunState::Completed => (UpgradeStatus::Completed, ConditionReason::Completed),
            RunState::Failed => (UpgradeStatus::Failed, ConditionReason::Failed),
        };
        KindReport {
            progress: (report.total > 0).then_some((report.done, report.total)),
            failed_nodes: report.failed_nodes.clone(),
            in_flight: report.in_flight.clone(),
            condition_reason: Some(reason),
            ..KindReport::new(kind, status, report.message.clone())
        }
    }
}

/// The annotation changes `report` asks for, against the object's current annotations: `Some(value)`
/// sets, `None` removes. Empty when nothing changes.
pub fn annotation_changes(
    current: &BTreeMap<String, String>,
    report: &KindReport,
) -> BTreeMap<&'static str, Option<String>> {
    let kind = report.kind;
    let mut wanted: Vec<(&'static str, Option<String>)> = vec![
        (kind.status_key(), Some(report.status.as_str().to_string())),
        (kind.message_key(), Some(report.message.clone())),
        (
            kind.progress_key(),
            report
                .progress
                .map(|(done, total)| format!("{done}/{total}")),
        ),
    ];
    if let Some(current_version) = &report.current {
        wanted.push((kind.current_key(), Some(current_version.clone())));
    }
    if let Some(available) = &report.available {
        wanted.push((kind.available_key(), available.clone()));
    }
    if kind == UpgradeKind::Talos {
        wanted.push((
            annotations::FAILED_NODES,
            (!report.failed_nodes.is_empty()).then(|| report.failed_nodes.join(",")),
        ));
    }
    for key in &report.consumed {
        wanted.push((key, None));
    }
    wanted
        .into_iter()
        .filter(|(key, value)| current.get(*key) != value.as_ref())
        .collect()
}

/// The metadata-only merge patch that sets the annotations `reports` ask for; `None` when they are all
/// as asked already. Metadata only: the user's keys and everything else on the object stay as they are.
pub fn annotations_patch(cluster: &KubernetesCluster, reports: &[&KindReport]) -> Option<Value> {
    let current = cluster.metadata.annotations.clone().unwrap_or_default();
    let mut changes = BTreeMap::new();
    for report in reports {
        changes.extend(annotation_changes(&current, report));
    }
    (!changes.is_empty()).then(|| {
        let mut patch = Map::new();
        for (key, value) in changes {
            patch.insert(key.to_string(), value.map_or(Value::Null, Value::String));
        }
        json!({"metadata": {"annotations": patch}})
    })
}

/// The status merge patch for `reports`: `phase` (decided by [`phase_change`]; `None` leaves the phase
/// as it is) and the kinds' conditions; `None` when the status already says it all.
pub fn status_patch(
    cluster: &KubernetesCluster,
    reports: &[&KindReport],
    phase: Option<&str>,
    now: jiff::Timestamp,
) -> Option<Value> {
    let current = cluster.status.as_ref();
    let mut desired = KubernetesClusterStatus {
        phase: current.and_then(|s| s.phase.clone()),
        conditions: current.map(|s| s.conditions.clone()).unwrap_or_default(),
        ..KubernetesClusterStatus::default()
    };
    if let Some(phase) = phase {
        desired.phase = Some(phase.to_string());
    }
    for report in reports {
        if let Some(reason) = report.condition_reason {
            let active = matches!(report.status, UpgradeStatus::InProgress);
            set_condition(
                &mut desired.conditions,
                condition_type(report.kind),
                active,
                reason.as_str(),
                &report.message,
                now,
            );
        }
    }
    KubernetesClusterStatus::merge_patch(current, &desired, now)
}

/// The condition type of an upgrade kind.
pub fn condition_type(kind: UpgradeKind) -> &'static str {
    match kind {
        UpgradeKind::Talos => crate::crd::condition::TALOS_UPGRADE,
        UpgradeKind::Kubernetes => crate::crd::condition::KUBERNETES_UPGRADE,
    }
}

/// The phase an upgrade status puts the cluster in; `None` leaves the phase alone.
pub fn phase_for(kind: UpgradeKind, status: UpgradeStatus, current: Option<&str>) -> Option<Phase> {
    let ours = current.is_none_or(|p| p.is_empty() || Phase::parse(p).is_some());
    match status {
        UpgradeStatus::InProgress => Some(match kind {
            UpgradeKind::Talos => Phase::UpgradingTalos,
            UpgradeKind::Kubernetes => Phase::UpgradingKubernetes,
        }),
        UpgradeStatus::Failed => Some(Phase::UpgradeFailed),
        // Back to Ready only from a phase this controller set: a provisioning operator's phase stays.
        UpgradeStatus::Completed | UpgradeStatus::Idle if ours => {
            let upgrading = current
                .and_then(Phase::parse)
                .is_some_and(|p| p != Phase::Ready);
            upgrading.then_some(Phase::Ready)
        }
        UpgradeStatus::Completed | UpgradeStatus::Idle | UpgradeStatus::Blocked => None,
    }
}

/// The phase both upgrade kinds put the cluster in together; `None` leaves the phase alone. A kind in
/// progress shows first (Kubernetes, which starts only after Talos, before Talos), then a failure, then
/// `Ready` when the controller's own phase is no longer true.
pub fn combined_phase(reports: &[&KindReport], current: Option<&str>) -> Option<Phase> {
    let phases: Vec<Phase> = reports
        .iter()
        .filter_map(|r| phase_for(r.kind, r.status, current))
        .collect();
    [
        Phase::UpgradingKubernetes,
        Phase::UpgradingTalos,
        Phase::UpgradeFailed,
    ]
    .into_iter()
    .find(|p| phases.contains(p))
    .or_else(|| {
        // `Ready` only when no kind still holds the phase where it is (a failure stays until cleared).
        let held = reports
            .iter()
            .any(|r| matches!(r.status, UpgradeStatus::Failed | UpgradeStatus::InProgress));
        (!held && phases.contains(&Phase::Ready)).then_some(Phase::Ready)
    })
}

/// What a reconcile does with `status.phase`, and the phase it keeps to give back.
///
/// The controller changes the phase only to show its own runs and failures (`UpgradingTalos`,
/// `UpgradingKubernetes`, `UpgradeFailed`). When one of them replaces a phase it did not write (a
/// provisioning operator's, such as `Provisioning`), that phase is kept (the shell keeps it in the
/// progress record, since vitistack's schema prunes unknown status fields) and written back when the
/// controller's own phase goes: the run completed or stopped, the failure was cleared or reset. A
/// cluster whose phase was the controller's own, or empty, goes back to `Ready`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseChange {
    /// The phase to write; `None` leaves it as it is.
    pub phase: Option<String>,
    /// The phase to give back once the controller's own phase goes, as the record must hold it from now
    /// on (`None`: nothing to give back).
    pub give_back: Option<String>,
}

impl PhaseChange {
    /// Whether the record must be made to hold [`PhaseChange::give_back`] before the phase is written:
    /// a phase is kept before it is replaced, so that a controller stopped in between still gives it
    /// back. (Forgetting one goes the other way: after the write that gave it back.)
    pub fn keeps_first(&self, kept: Option<&str>) -> bool {
        self.give_back.is_some() && self.give_back.as_deref() != kept
    }

    /// The phase a write may set when the record is not saved before it (one kind's report written
    /// beside its calls): the change's phase, unless a phase must be kept first, which the reconcile's
    /// own report does.
    pub fn without_keeping(self, kept: Option<&str>) -> Option<String> {
        if self.keeps_first(kept) {
            None
        } else {
            self.phase
        }
    }
}

/// The phase `reports` put the cluster in, from the phase it has (`current`) and the one the record
/// keeps to give back (`kept`); see [`PhaseChange`].
pub fn phase_change(
    reports: &[&KindReport],
    current: Option<&str>,
    kept: Option<&str>,
) -> PhaseChange {
    let current = current.filter(|phase| !phase.is_empty());
    // The controller's own phase, showing one of its runs or failures.
    let showing = current
        .and_then(Phase::parse)
        .is_some_and(|phase| phase != Phase::Ready);
    let kept_while_showing = || kept.filter(|_| showing).map(str::to_string);
    match combined_phase(reports, current) {
        // The controller's phase is no longer true (only ever from a phase it shows).
        Some(Phase::Ready) => PhaseChange {
            phase: Some(kept.unwrap_or(Phase::Ready.as_str()).to_string()),
            give_back: None,
        },
        Some(shown) => PhaseChange {
            phase: Some(shown.as_str().to_string()),
            give_back: match current {
                // Someone else's phase, replaced now: the one to give back.
                Some(foreign) if Phase::parse(foreign).is_none() => Some(foreign.to_string()),
                _ => kept_while_showing(),
            },
        },
        None => PhaseChange {
            phase: None,
            give_back: kept_while_showing(),
        },
    }
}

/// The `action` of an Event. kube's recorder folds events with the same type, reason and action into
/// one series that keeps the first message, so "Upgrading node worker-1" and "Upgrading node worker-2"
/// would show as one event for worker-1. A digest of the message in the action keeps different
/// messages apart while an identical repeat still counts up one series. (`kubectl describe` does not
/// show the action.)
pub fn event_action(kind: UpgradeKind, message: &str) -> String {
    // FNV-1a: stable across processes and releases, unlike the standard library's hasher.
    let digest = message
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{}Upgrade-{:016x}", kind.name(), digest)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(status: UpgradeStatus) -> KindReport {
        KindReport {
            kind: UpgradeKind::Talos,
            status,
            message: "Upgrading node cp-1 (3/5)".into(),
            progress: Some((2, 5)),
            current: Some("1.11.6".into()),
            available: None,
            failed_nodes: Vec::new(),
            in_flight: Vec::new(),
            condition_reason: Some(ConditionReason::InProgress),
            consumed: vec![annotations::RESUME],
        }
    }

    #[test]
    fn only_changed_controller_keys_are_written_and_user_keys_kept() {
        let current = BTreeMap::from([
            (annotations::TALOS_TARGET.to_string(), "1.12.0".to_string()),
            ("team".to_string(), "blue".to_string()),
            (
                annotations::TALOS_STATUS.to_string(),
                "in-progress".to_string(),
            ),
            (annotations::RESUME.to_string(), "true".to_string()),
            (annotations::FAILED_NODES.to_string(), "cp-2".to_string()),
        ]);
        let changes = annotation_changes(&current, &report(UpgradeStatus::InProgress));
        assert_eq!(
            changes,
            BTreeMap::from([
                (
                    annotations::TALOS_MESSAGE,
                    Some("Upgrading node cp-1 (3/5)".to_string())
                ),
                (annotations::TALOS_PROGRESS, Some("2/5".to_string())),
                (annotations::TALOS_CURRENT, Some("1.11.6".to_string())),
                (annotations::FAILED_NODES, None),
                (annotations::RESUME, None),
            ])
        );
    }

    #[test]
    fn event_actions_differ_by_message_and_repeat_for_the_same_one() {
        let a = event_action(UpgradeKind::Talos, "Upgrading node worker-1");
        let b = event_action(UpgradeKind::Talos, "Upgrading node worker-2");
        assert_ne!(a, b);
        assert_eq!(
            a,
            event_action(UpgradeKind::Talos, "Upgrading node worker-1")
        );
        assert!(a.starts_with("TalosUpgrade-") && a.len() <= 128, "{a}");
    }

    #[test]
    fn phases_follow_the_status_and_leave_foreign_phases_alone() {
        use UpgradeStatus::*;
        let cases = [
            (InProgress, Some("Ready"), Some(Phase::UpgradingTalos)),
            (Failed, Some("UpgradingTalos"), Some(Phase::UpgradeFailed)),
            (Completed, Some("UpgradingTalos"), Some(Phase::Ready)),
            (Idle, Some("UpgradeFailed"), Some(Phase::Ready)),
            (Completed, Some("Ready"), None),
            (Completed, Some("Provisioning"), None),
            (Idle, None, None),
        ];
        for (status, current, expected) in cases {
            assert_eq!(
                phase_for(UpgradeKind::Talos, status, current),
                expected,
                "{status:?} from {current:?}"
            );
        }
    }

    #[test]
    fn a_phase_the_controller_did_not_write_is_kept_during_its_run_and_given_back_after() {
        use UpgradeStatus::*;
        let reports = |talos, kubernetes| {
            [
                KindReport::new(UpgradeKind::Talos, talos, String::new()),
                KindReport::new(UpgradeKind::Kubernetes, kubernetes, String::new()),
            ]
        };
        // ((Talos, Kubernetes), phase now, phase kept) -> (phase written, phase kept from now on)
        let cases = [
            // A run starts over the operator's phase: shown, and kept.
            (
                (InProgress, Idle),
                Some("Provisioning"),
                None,
                (Some("UpgradingTalos"), Some("Provisioning")),
            ),
            (
                (InProgress, Idle),
                Some("UpgradingTalos"),
                Some("Provisioning"),
                (Some("UpgradingTalos"), Some("Provisioning")),
            ),
            // Talos hands over to Kubernetes: still the controller's phase, still kept.
            (
                (Completed, InProgress),
                Some("UpgradingTalos"),
                Some("Provisioning"),
                (Some("UpgradingKubernetes"), Some("Provisioning")),
            ),
            // The run completes: the kept phase is given back, not Ready.
            (
                (Completed, Idle),
                Some("UpgradingTalos"),
                Some("Provisioning"),
                (Some("Provisioning"), None),
            ),
            (
                (Completed, Completed),
                Some("UpgradingKubernetes"),
                Some("Provisioning"),
                (Some("Provisioning"), None),
            ),
            // Given back: left alone, and no longer kept.
            ((Completed, Idle), Some("Provisioning"), None, (None, None)),
            (
                (Completed, Idle),
                Some("Provisioning"),
                Some("Provisioning"),
                (None, None),
            ),
            // A failure over the operator's phase: shown and kept until it is cleared (target removed or
            // reset: idle), then given back.
            (
                (Failed, Idle),
                Some("Provisioning"),
                None,
                (Some("UpgradeFailed"), Some("Provisioning")),
            ),
            (
                (Failed, Idle),
                Some("UpgradeFailed"),
                Some("Provisioning"),
                (Some("UpgradeFailed"), Some("Provisioning")),
            ),
            (
                (Idle, Idle),
                Some("UpgradeFailed"),
                Some("Provisioning"),
                (Some("Provisioning"), None),
            ),
            // A run stopped (target removed): given back too.
            (
                (Idle, Idle),
                Some("UpgradingTalos"),
                Some("Provisioning"),
                (Some("Provisioning"), None),
            ),
            // The operator wrote another phase during the run: that one is given back.
            (
                (InProgress, Idle),
                Some("ConfigApplied"),
                Some("Provisioning"),
                (Some("UpgradingTalos"), Some("ConfigApplied")),
            ),
            // Blocked and idle leave a foreign phase alone, and keep nothing.
            ((Idle, Blocked), Some("Provisioning"), None, (None, None)),
            ((Idle, Idle), Some("Provisioning"), None, (None, None)),
            // A phase of the controller's own, or none, goes back to Ready, whatever was kept before.
            (
                (InProgress, Idle),
                Some("Ready"),
                None,
                (Some("UpgradingTalos"), None),
            ),
            (
                (InProgress, Idle),
                Some("Ready"),
                Some("Provisioning"),
                (Some("UpgradingTalos"), None),
            ),
            (
                (InProgress, Idle),
                None,
                None,
                (Some("UpgradingTalos"), None),
            ),
            (
                (InProgress, Idle),
                Some(""),
                None,
                (Some("UpgradingTalos"), None),
            ),
            (
                (Completed, Idle),
                Some("UpgradingTalos"),
                None,
                (Some("Ready"), None),
            ),
            (
                (Idle, Idle),
                Some("UpgradeFailed"),
                None,
                (Some("Ready"), None),
            ),
            ((Completed, Idle), Some("Ready"), None, (None, None)),
            ((Idle, Idle), None, None, (None, None)),
        ];
        for ((talos, kubernetes), current, kept, (phase, give_back)) in cases {
            let [talos_report, kubernetes_report] = reports(talos, kubernetes);
            let change = phase_change(&[&talos_report, &kubernetes_report], current, kept);
            assert_eq!(
                (change.phase.as_deref(), change.give_back.as_deref()),
                (phase, give_back),
                "{talos:?}/{kubernetes:?} from {current:?}, keeping {kept:?}"
            );
        }
    }

    #[test]
    fn a_phase_is_kept_before_it_is_replaced_and_forgotten_after_it_is_given_back() {
        let change = |phase: Option<&str>, give_back: Option<&str>| PhaseChange {
            phase: phase.map(str::to_string),
            give_back: give_back.map(str::to_string),
        };
        // (change, kept) -> (keep first?, what a write without keeping first may set)
        let cases = [
            (
                change(Some("UpgradingTalos"), Some("Provisioning")),
                None,
                (true, None),
            ),
            (
                change(Some("UpgradingTalos"), Some("Provisioning")),
                Some("Provisioning"),
                (false, Some("UpgradingTalos")),
            ),
            (
                change(Some("UpgradingTalos"), Some("ConfigApplied")),
                Some("Provisioning"),
                (true, None),
            ),
            (
                change(Some("Provisioning"), None),
                Some("Provisioning"),
                (false, Some("Provisioning")),
            ),
            (
                change(Some("UpgradingTalos"), None),
                None,
                (false, Some("UpgradingTalos")),
            ),
            (change(None, None), Some("Provisioning"), (false, None)),
        ];
        for (change, kept, (first, early)) in cases {
            assert_eq!(
                change.keeps_first(kept),
                first,
                "{change:?} keeping {kept:?}"
            );
            assert_eq!(
                change.clone().without_keeping(kept).as_deref(),
                early,
                "{change:?} keeping {kept:?}"
            );
        }
    }

    #[test]
    fn a_decision_reads_as_its_status_and_condition_reason() {
        let report = |state| Report {
            state,
            message: "m".into(),
            done: 1,
            total: 3,
            in_flight: vec!["w-1".into()],
            failed_nodes: Vec::new(),
            notes: Vec::new(),
            hold: None,
            gate: None,
            consumed: Vec::new(),
            awaiting_reboots: false,
            awaiting_reboots_once_answered: false,
        };
        let cases = [
            (
                RunState::InProgress,
                UpgradeStatus::InProgress,
                ConditionReason::InProgress,
            ),
            (
                RunState::Paused,
                UpgradeStatus::InProgress,
                ConditionReason::Paused,
            ),
            (
                RunState::Completed,
                UpgradeStatus::Completed,
                ConditionReason::Completed,
            ),
            (
                RunState::Failed,
                UpgradeStatus::Failed,
                ConditionReason::Failed,
            ),
        ];
        for (state, status, reason) in cases {
            let shown = KindReport::of_decision(UpgradeKind::Kubernetes, &report(state));
            assert_eq!(
                (shown.status, shown.condition_reason),
                (status, Some(reason))
            );
            assert_eq!(shown.progress, Some((1, 3)));
            assert_eq!(shown.in_flight, ["w-1"]);
        }
    }
}
