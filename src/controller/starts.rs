//! Runs that start together are all acknowledged before any of them acts.
//!
//! When many clusters get a target in the same moment (`kubectl annotate` over a fleet, a GitOps sync),
//! each first reconcile reads the cluster, looks at its nodes, writes `in-progress`, then announces the
//! run, saves its write-ahead, cordons and drains the first node and calls it. Side by side, the first
//! clusters' announcements, saves and drains queue at the API server with the last clusters' reads and
//! `in-progress` patches, so the last clusters are told last, after the work of everyone before them.
//! Holding a starting run's first calls until every run starting with it has written `in-progress`
//! (for at most [`ACKNOWLEDGE_WAIT`]) tells every cluster first; the nodes start a moment later, which
//! against a node's minutes-long upgrade costs nothing.
//!
//! Only a starting run waits, and only for reconciles that may start one: a run under way never waits
//! here, so the time between its nodes is not touched.

use std::time::Duration;

use tokio::sync::watch;

use crate::annotations::{UpgradeKind, UpgradeStatus};
use crate::crd::KubernetesCluster;
use crate::intent::{ObservedAnnotations, Target, UpgradeIntent};

/// The longest a starting run waits for the others: a reconcile slow to reach its report (nodes that
/// take their time to answer) delays the others' first calls by no more than this. One second, the
/// time within which `in-progress` is meant to follow the annotation: a fleet that takes longer than
/// that to acknowledge is past what holding back can help (measured at 200 clusters annotated at once:
/// with a 2 s limit, `in-progress` came no sooner and the first calls 2–3 s later).
pub const ACKNOWLEDGE_WAIT: Duration = Duration::from_secs(1);

/// How many reconciles that may start a Talos run have not yet written their report.
pub struct StartingRuns {
    unacknowledged: watch::Sender<usize>,
}

impl Default for StartingRuns {
    fn default() -> Self {
        StartingRuns {
            unacknowledged: watch::Sender::new(0),
        }
    }
}

/// A reconcile that may start a run, counted until it [`acknowledged`](Self::acknowledged) (or is
/// dropped: it ended without starting one).
pub struct MayStart<'a> {
    runs: &'a StartingRuns,
    counted: std::sync::atomic::AtomicBool,
}

impl MayStart<'_> {
    /// Its report is written (or it will write none before acting): the others need not wait for it.
    pub fn acknowledged(&self) {
        if self
            .counted
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            self.runs.unacknowledged.send_modify(|n| *n -= 1);
        }
    }
}

impl Drop for MayStart<'_> {
    fn drop(&mut self) {
        self.acknowledged();
    }
}

impl StartingRuns {
    /// Counts a reconcile of `cluster` if it may start a Talos run: a target is set and the cluster
    /// does not show one in progress. (A cluster whose run is finished is counted too; its reconcile
    /// is short, and that it holds others for a moment does no harm.)
    pub fn may_start(
        &self,
        cluster: &KubernetesCluster,
        intent: &UpgradeIntent,
    ) -> Option<MayStart<'_>> {
        let reported =
            ObservedAnnotations::from_annotations(kube::ResourceExt::annotations(cluster))
                .status(UpgradeKind::Talos);
        let may_start = matches!(intent.talos_target, Target::Version(_))
            && reported != Some(UpgradeStatus::InProgress);
        may_start.then(|| self.count())
    }

    fn count(&self) -> MayStart<'_> {
        self.unacknowledged.send_modify(|n| *n += 1);
        MayStart {
            runs: self,
            counted: std::sync::atomic::AtomicBool::new(true),
        }
    }

    /// Waits until no counted reconcile is left unacknowledged, or `at_most`.
    pub async fn all_acknowledged(&self, at_most: Duration) {
        let mut unacknowledged = self.unacknowledged.subscribe();
        let _ = tokio::time::timeout(at_most, unacknowledged.wait_for(|n| *n == 0)).await;
    }

    #[cfg(test)]
    fn unacknowledged(&self) -> usize {
        *self.unacknowledged.borrow()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn cluster(annotations: &[(&str, &str)]) -> (KubernetesCluster, UpgradeIntent) {
        let annotations: BTreeMap<String, String> = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut cluster = KubernetesCluster::new("c1", Default::default());
        cluster.metadata.annotations = Some(annotations.clone());
        (cluster, UpgradeIntent::from_annotations(&annotations))
    }

    #[test]
    fn only_a_cluster_with_a_target_and_no_run_shown_in_progress_is_counted() {
        use crate::annotations::{TALOS_STATUS, TALOS_TARGET};
        let cases: &[(&[(&str, &str)], bool)] = &[
            (&[], false),
            (&[(TALOS_TARGET, "1.12.0")], true),
            (&[(TALOS_TARGET, "1.12.0"), (TALOS_STATUS, "idle")], true),
            (
                &[(TALOS_TARGET, "1.12.0"), (TALOS_STATUS, "completed")],
                true,
            ),
            (
                &[(TALOS_TARGET, "1.12.0"), (TALOS_STATUS, "in-progress")],
                false,
            ),
            // Refused at once, without a look at the nodes: nothing to wait for.
            (&[(TALOS_TARGET, "1.12")], false),
        ];
        for (annotations, counted) in cases {
            let runs = StartingRuns::default();
            let (cluster, intent) = cluster(annotations);
            let ticket = runs.may_start(&cluster, &intent);
            assert_eq!(ticket.is_some(), *counted, "{annotations:?}");
            assert_eq!(
                runs.unacknowledged(),
                usize::from(*counted),
                "{annotations:?}"
            );
        }
    }

    #[test]
    fn a_reconcile_is_uncounted_once_whether_acknowledged_dropped_or_both() {
        let runs = StartingRuns::default();
        let first = runs.count();
        let second = runs.count();
        assert_eq!(runs.unacknowledged(), 2);
        first.acknowledged();
        first.acknowledged();
        assert_eq!(runs.unacknowledged(), 1);
        drop(first);
        assert_eq!(runs.unacknowledged(), 1);
        drop(second);
        assert_eq!(runs.unacknowledged(), 0);
    }

    #[tokio::test]
    async fn a_starting_run_waits_for_the_others_to_acknowledge() {
        let runs = std::sync::Arc::new(StartingRuns::default());
        let other = runs.count();
        let waiter = tokio::spawn({
            let runs = runs.clone();
            async move { runs.all_acknowledged(Duration::from_secs(3600)).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !waiter.is_finished(),
            "released before the other acknowledged"
        );
        other.acknowledged();
        tokio::time::timeout(Duration::from_secs(60), waiter)
            .await
            .expect("released once the other acknowledged")
            .unwrap();
    }

    #[tokio::test]
    async fn a_reconcile_that_never_acknowledges_holds_the_others_only_until_the_limit() {
        let runs = StartingRuns::default();
        let _stuck = runs.count();
        tokio::time::timeout(
            Duration::from_secs(60),
            runs.all_acknowledged(Duration::from_millis(10)),
        )
        .await
        .expect("the limit ends the wait");
        assert_eq!(runs.unacknowledged(), 1);
    }
}
