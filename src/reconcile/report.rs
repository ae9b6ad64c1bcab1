//! Telling the user: the report the core computed ([`talos_upgrade_core::report`]) written to the
//! cluster (a metadata-only merge patch of the controller's annotation keys, then a minimal status
//! merge patch of the phase and the upgrade conditions) and the Events, through kube's recorder.

use crate::event_recorder::EventRecorder;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use talos_upgrade_core::annotations::UpgradeKind;
use talos_upgrade_core::coexistence;
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::report::{self, KindReport};
use talos_upgrade_core::run::{Note, NoteType};

/// A written cluster as the reconcile keeps it (the baseline of its next write): without
/// managedFields, which only the coexistence check reads, from the watch's copy. An API server's
/// answer carries every entry in full, and with a fleet reconciled at once these copies were 6 MB
/// of the controller's peak heap at 200 clusters (docs/performance.md, Memory).
fn kept(mut cluster: KubernetesCluster) -> KubernetesCluster {
    cluster.metadata.managed_fields = None;
    cluster
}

/// Every write to a KubernetesCluster names the controller's field manager, so its fields in
/// `metadata.managedFields` tell it from another controller writing the same keys (see
/// [`talos_upgrade_core::coexistence`]).
pub fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(coexistence::FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    }
}

/// Where a reconcile's reports and Events go.
pub struct Reporter<'a> {
    pub api: &'a Api<KubernetesCluster>,
    pub recorder: &'a EventRecorder,
    pub now: jiff::Timestamp,
}

impl Reporter<'_> {
    /// Writes `reports` to `cluster` (as last seen): annotations, then status (with `phase`, if one is
    /// given: see [`report::phase_change`]), each touching only its own part of the object and only
    /// when something changes. Returns the object as the API server returned it (`None`: nothing
    /// changed), so a later write in the same reconcile compares against what is really there.
    pub async fn write(
        &self,
        cluster: &KubernetesCluster,
        reports: &[&KindReport],
        phase: Option<&str>,
    ) -> Result<Option<KubernetesCluster>, kube::Error> {
        let name = cluster.name_any();
        let annotations_patch = report::annotations_patch(cluster, reports);
        let status_patch = report::status_patch(cluster, reports, phase, self.now);
        // The annotations first, then the status: `kubectl wait` and the user's tools read the
        // annotations, so they go out at once. Sent together, the two patches of one object collide
        // in the API server (its optimistic concurrency makes one of them read the object again and
        // redo its work), which under load delayed the annotations by seconds.
        let (name, params) = (&name, &patch_params());
        let with_annotations = match annotations_patch {
            Some(patch) => Some(self.api.patch(name, params, &Patch::Merge(patch)).await),
            None => None,
        };
        let with_status = match status_patch {
            Some(patch) => Some(
                self.api
                    .patch_status(name, params, &Patch::Merge(patch))
                    .await,
            ),
            None => None,
        };
        // Each answer is sure of its own part only (the other patch may have landed before or after).
        Ok(
            match (with_annotations.transpose()?, with_status.transpose()?) {
                (Some(mut object), Some(with_status)) => {
                    object.status = with_status.status;
                    Some(object)
                }
                (object, None) | (None, object) => object,
            }
            .map(kept),
        )
    }

    /// Writes only the annotations of `report` (no status, no Events): the acknowledgement of a new
    /// target, which the reconcile's full report follows.
    pub async fn write_annotations(
        &self,
        cluster: &KubernetesCluster,
        report: &KindReport,
    ) -> Result<Option<KubernetesCluster>, kube::Error> {
        let Some(patch) = report::annotations_patch(cluster, &[report]) else {
            return Ok(None);
        };
        self.api
            .patch(&cluster.name_any(), &patch_params(), &Patch::Merge(patch))
            .await
            .map(|object| Some(kept(object)))
    }

    /// Writes the controller's `plan-message` annotation (`None` removes it) when it differs from what
    /// `cluster` shows; the multi-hop plan's own key, beside the kinds' reports.
    pub async fn write_plan_message(
        &self,
        cluster: &KubernetesCluster,
        message: Option<&str>,
    ) -> Result<(), kube::Error> {
        let key = talos_upgrade_core::annotations::PLAN_MESSAGE;
        if cluster.annotations().get(key).map(String::as_str) == message {
            return Ok(());
        }
        let patch = serde_json::json!({ "metadata": { "annotations": { key: message } } });
        self.api
            .patch(&cluster.name_any(), &patch_params(), &Patch::Merge(patch))
            .await
            .map(drop)
    }

    /// Publishes Events on the cluster. An Event that cannot be published is logged, not fatal: the
    /// annotations already say it all.
    pub async fn publish(&self, cluster: &KubernetesCluster, kind: UpgradeKind, notes: &[Note]) {
        let reference = cluster.object_ref(&());
        // Sent together, each one round trip: the events are independent objects, and each takes its
        // time when it is first polled, in order, so they still read in order.
        futures::future::join_all(notes.iter().map(|note| {
            let event = Event {
                type_: match note.type_ {
                    NoteType::Normal => EventType::Normal,
                    NoteType::Warning => EventType::Warning,
                },
                reason: note.reason.as_str().to_string(),
                note: Some(note.message.clone()),
                action: report::event_action(kind, &note.message),
                secondary: None,
            };
            let reference = &reference;
            async move {
                if let Err(error) = self.recorder.publish(&event, reference).await {
                    tracing::warn!(%error, reason = %note.reason, "publishing event");
                }
            }
        }))
        .await;
    }
}
