//! One kind's part of a reconcile, written once for both kinds: the core's lifecycle asks, this loop
//! does the IO. Look → decide (core) → save the run → publish → call → report.
//!
//! The loop carries out every [`Step`] of [`Lifecycle`] with the kind's IO ([`KindIo`]) and the
//! progress record. An [`Act`] goes out as the protocol promises: the run is saved first (the
//! write-ahead: [`Records::write_ahead`] hands the calls back only as
//! [`Saved`](crate::progress_store::Saved)), its Events go out
//! with the save, and the report it asks for is written beside the calls, so `kubectl wait` shows a
//! node being upgraded during a long install rather than after it.

use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::lifecycle::{Conclusion, Lifecycle, Look, Step};
use talos_upgrade_core::report;

use super::Error;
use super::report::Reporter;
use crate::followers::FollowedNode;
use crate::kind_io::KindIo;
use crate::progress_store::{Records, Stored};

/// How one kind's part of a reconcile ended.
pub struct KindOutcome<K: Stored> {
    pub conclusion: Conclusion<K>,
    /// The cluster as written by a report made before the calls, if one was.
    pub reported: Option<KubernetesCluster>,
    /// The nodes in flight, followed.
    pub follow: Vec<FollowedNode>,
}

/// Runs `lifecycle` to its end: every look, call and save it asks for.
pub async fn drive<K, I>(
    mut lifecycle: Lifecycle<'_, K>,
    io: &mut I,
    records: &mut Records<'_>,
    reporter: &Reporter<'_>,
    cluster: &KubernetesCluster,
) -> Result<KindOutcome<K>, Error>
where
    K: Stored,
    I: KindIo<K>,
{
    let mut reported = None;
    let mut step = lifecycle.start();
    let conclusion = loop {
        step = match step {
            // Each look on the heap while it runs, as the calls below: a drive holds one of them
            // at a time, and 200 reconciles at once would each keep room for the largest.
            Step::Look(Look::Versions) => {
                lifecycle.looked_at_versions(Box::pin(io.look_at_versions()).await)
            }
            Step::Look(Look::Cluster(request)) => {
                lifecycle.looked_at_cluster(Box::pin(io.look_at_cluster(&request)).await)
            }
            Step::Further(work) => lifecycle.further(Box::pin(io.further(&work)).await),
            Step::Act(act) => {
                let notes = act.notes.clone();
                let report = act.report.clone();
                // The report goes out beside the save and the calls; the calls wait for the save and
                // the Events only (a node's return costs no round trip before the next call but the
                // write-ahead). Should the save fail, no call is made and the next reconcile decides,
                // reports and announces again.
                let baseline = reported.as_ref().unwrap_or(cluster);
                // The phase this kind's report shows, unless a phase must be kept before it is
                // replaced: the record is saved beside this write, not before it, so that is left to
                // the reconcile's own report.
                let kept = records
                    .progress()
                    .phase_before_upgrade()
                    .map(str::to_string);
                let early = report.as_ref().map(|report| async move {
                    let phase = report::phase_change(&[report], baseline.phase(), kept.as_deref())
                        .without_keeping(kept.as_deref());
                    reporter
                        .write(baseline, &[report], phase.as_deref())
                        .await
                        // Not fatal: the report after the calls says it all again.
                        .inspect_err(|error| tracing::warn!(%error, "reporting before the calls"))
                        .ok()
                        .flatten()
                });
                let save_and_call = async {
                    let (saved, ()) = tokio::join!(
                        records.write_ahead(act),
                        reporter.publish(cluster, K::KIND, &notes)
                    );
                    Ok::<_, Error>(io.act(&saved?).await)
                };
                // On the heap while they run (the writes' and the calls' futures are several KB).
                let (written, called) = tokio::join!(
                    Box::pin(futures::future::OptionFuture::from(early)),
                    Box::pin(save_and_call)
                );
                if let Some(Some(object)) = written {
                    reported = Some(object);
                }
                lifecycle.called(called?)
            }
            Step::Done(conclusion) => {
                records.keep::<K>(conclusion.record.clone()).await?;
                break conclusion;
            }
        };
    };
    let follow = io.follow(&conclusion.report.in_flight);
    Ok(KindOutcome {
        conclusion,
        reported,
        follow,
    })
}
