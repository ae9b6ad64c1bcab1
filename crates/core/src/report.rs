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

/// The status merge patch for `reports`: the phase both kinds put the cluster in and their conditions;
/// `None` when the status already says it all.
pub fn status_patch(
    cluster: &KubernetesCluster,
    reports: &[&KindReport],
    now: jiff::Timestamp,
) -> Option<Value> {
    let current = cluster.status.as_ref();
    let mut desired = KubernetesClusterStatus {
        phase: current.and_then(|s| s.phase.clone()),
        conditions: current.map(|s| s.conditions.clone()).unwrap_or_default(),
        ..KubernetesClusterStatus::default()
    };
    if let Some(phase) = combined_phase(reports, current.and_then(|s| s.phase.as_deref())) {
        desired.phase = Some(phase.as_str().to_string());
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
            awaiting_reboots: false,
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
