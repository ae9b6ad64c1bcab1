//! The gates between the two kinds of upgrade: never both at once, Talos first.
//!
//! * A Kubernetes upgrade waits (`blocked`) while a Talos upgrade is pending or running, and starts by
//!   itself when it is done (design/protocol.md).
//! * A Talos upgrade waits while a Kubernetes upgrade is under way (static pods being patched, kubelets
//!   restarting): it starts when that is done, and no node reboots meanwhile.
//!
//! A reconcile looks at Talos first, then Kubernetes; [`Gates`] carries what one kind's state means
//! for the other within it.

use crate::annotations::{UpgradeKind, UpgradeStatus};
use crate::run::Record;

/// What each kind's state means for the other, in one reconcile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gates {
    /// A Talos upgrade is pending or running: it reported `in-progress` in this reconcile, or a Talos
    /// run that has touched nodes is not finished (even when its status says otherwise for the
    /// moment: a bad option reported as failed mid-run, a lost Secret).
    pub talos_upgrading: bool,
    /// The target of a Kubernetes run under way (it has steps and is not finished).
    pub kubernetes_running: Option<String>,
}

impl Gates {
    /// The gates for the Talos part of a reconcile, which comes first. `kubernetes_target` is the
    /// `kubernetes-target` annotation as written (trimmed).
    ///
    /// A Kubernetes run holds Talos back while it is wanted (its target is still the annotation) or
    /// has a step in flight (being finished after the target changed or was removed). A run left
    /// behind by a changed target with nothing in flight never moves again, and waiting for it would
    /// deadlock: the new Kubernetes target waits for Talos, which would wait for the old run.
    pub fn for_talos(kubernetes: Option<&impl Record>, kubernetes_target: Option<&str>) -> Gates {
        let under_way = running(kubernetes).filter(|run| {
            Some(run.requested()) == kubernetes_target || !run.in_flight().is_empty()
        });
        Gates {
            talos_upgrading: false,
            kubernetes_running: under_way.map(|run| run.target().to_string()),
        }
    }

    /// The gates for the Kubernetes part, after the Talos part reported `talos_status`.
    pub fn for_kubernetes(talos: Option<&impl Record>, talos_status: UpgradeStatus) -> Gates {
        Gates {
            talos_upgrading: talos_status == UpgradeStatus::InProgress || running(talos).is_some(),
            kubernetes_running: None,
        }
    }

    /// Whether `kind`'s idle refresh waits: the Kubernetes versions cannot change while Talos rolls
    /// across the nodes (only a Kubernetes run changes them, and none runs), and the reconcile that
    /// ends the Talos run refreshes them, since the Kubernetes part comes after the Talos part.
    pub fn holds_idle_refresh(&self, kind: UpgradeKind) -> bool {
        match kind {
            UpgradeKind::Kubernetes => self.talos_upgrading,
            UpgradeKind::Talos => false,
        }
    }
}

/// A run that has touched nodes and is not finished.
pub fn running<R: Record>(run: Option<&R>) -> Option<&R> {
    run.filter(|run| !run.is_finished() && run.touched())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kubernetes::{KubeRun, Step, StepProgress, StepState};
    use crate::run::Outcome;
    use crate::talos::Run;

    fn at() -> jiff::Timestamp {
        "2026-11-25T10:00:00Z".parse().expect("timestamp")
    }

    fn kube_run(outcome: Option<Outcome>, steps: bool) -> KubeRun {
        KubeRun {
            requested: "1.35.0".into(),
            target: "1.35.0".into(),
            from: "1.34.1".into(),
            started_at: at(),
            outcome,
            steps: if steps {
                vec![StepProgress {
                    step: Step::Manifests,
                    state: StepState::Pending,
                }]
            } else {
                Vec::new()
            },
            etcd_snapshot: None,
        }
    }

    #[test]
    fn talos_waits_only_for_a_kubernetes_run_under_way() {
        let completed = Some(Outcome::Completed { at: at() });
        let cases = [
            (None, Some("1.35.0"), None),
            (Some(kube_run(None, true)), Some("1.35.0"), Some("1.35.0")),
            (Some(kube_run(completed, true)), Some("1.35.0"), None),
            // A refused target touched nothing and holds nothing back.
            (Some(kube_run(None, false)), Some("1.35.0"), None),
            // A run whose target changed, with nothing in flight, never moves again: waiting for it
            // would deadlock (explorer seed 1032).
            (Some(kube_run(None, true)), Some("1.36.0"), None),
            (Some(kube_run(None, true)), None, None),
        ];
        for (run, target, expected) in cases {
            assert_eq!(
                Gates::for_talos(run.as_ref(), target)
                    .kubernetes_running
                    .as_deref(),
                expected,
                "{run:?} {target:?}"
            );
        }
    }

    #[test]
    fn kubernetes_waits_while_talos_shows_or_has_a_run_in_flight() {
        let run = |outcome| Run {
            requested: "1.12.0".into(),
            target: "1.12.0".into(),
            started_at: at(),
            outcome,
            gates: Default::default(),
            previous: Default::default(),
            rollback: None,
            nodes: vec![crate::talos::NodeProgress {
                name: "w-1".into(),
                role: crate::run::NodeRole::Worker,
                step: crate::talos::NodeStep::Pending,
            }],
        };
        let cases = [
            (None, UpgradeStatus::Idle, false),
            (None, UpgradeStatus::InProgress, true),
            (Some(run(None)), UpgradeStatus::Failed, true),
            (
                Some(run(Some(Outcome::Completed { at: at() }))),
                UpgradeStatus::Completed,
                false,
            ),
        ];
        for (talos, status, upgrading) in cases {
            let gates = Gates::for_kubernetes(talos.as_ref(), status);
            assert_eq!(gates.talos_upgrading, upgrading, "{talos:?} {status:?}");
            assert_eq!(gates.holds_idle_refresh(UpgradeKind::Kubernetes), upgrading);
            assert!(!gates.holds_idle_refresh(UpgradeKind::Talos));
        }
    }
}
