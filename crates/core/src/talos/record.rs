//! What the controller remembers about an upgrade run between reconciles and across restarts.
//!
//! The record is written *before* every call that changes a node (write-ahead), so a controller that
//! restarts at any moment knows which nodes are finished, which one may have received an upgrade call
//! (and must not get another), and which are still to do. It lives in an object the controller owns (a
//! ConfigMap next to the cluster), never in `KubernetesCluster` fields that vitistack's schema would prune.

use std::collections::BTreeMap;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::holds::RunGates;
use crate::run::{NodeRole, Outcome};

/// One run: every node of a cluster taken to `target`, in a fixed order decided when the run started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Run {
    /// The target as the user wrote it (`v1.12.0` or `1.12.0`); a different annotation value is a new run.
    pub requested: String,
    /// The normalised target version, without a leading `v`.
    pub target: String,
    pub started_at: Timestamp,
    /// Set once the run ends; a finished run is never decided again for the same `requested` value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Nodes in the order they are taken; the order never changes within a run.
    pub nodes: Vec<NodeProgress>,
    /// What the operator's gates keep of this run (force-start, the canary, held nodes).
    #[serde(default, skip_serializing_if = "RunGates::is_empty")]
    pub gates: RunGates,
    /// The Talos version each node ran when this run made its first call to it: what a rollback
    /// (`talos-rollback`) takes it back to.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub previous: BTreeMap<String, String>,
    /// Set when this run rolls nodes back to their previous version rather than upgrading them
    /// ([`crate::talos::rollback`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<crate::talos::rollback::Rollback>,
}

/// One node's place in a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeProgress {
    pub name: String,
    pub role: NodeRole,
    #[serde(flatten)]
    pub step: NodeStep,
}

/// Where a node is in its upgrade.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "step"
)]
pub enum NodeStep {
    /// Not started.
    Pending,
    /// The upgrade call was (or is about to be) sent: it must never be sent again in this run. The boot id
    /// from before the call tells a reboot apart from a node that never went down.
    Issued {
        at: Timestamp,
        boot_id: String,
        from_version: String,
        installer_image: String,
        /// Talos ≥ 1.13 only, where the controller drives install, drain and reboot itself: how far it
        /// got. Absent for the legacy single `MachineService.Upgrade` call.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lifecycle: Option<LifecycleStage>,
        /// The legacy upgrade call was recorded but its answer never came (the controller stopped
        /// mid-call, or the node did not answer). If the node is then seen still running its old system,
        /// ready, on the same boot, for a while, the call never took and is made again.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unanswered: bool,
        /// Talos ≥ 1.13: the install may have happened without its answer being recorded (the
        /// controller stopped during it, or it got no answer). It is never made again over a
        /// possible pending one: the node is drained and rebooted, and if it comes back on its old
        /// version the install had not taken, and is made again.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        install_unconfirmed: bool,
    },
    /// On the target, rebooted, ready and Ready in Kubernetes.
    Done {
        at: Timestamp,
        /// When work on the node began (absent for nodes that were already on the target).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<Timestamp>,
    },
    Failed {
        at: Timestamp,
        reason: String,
        /// The new system was installed but the node was not rebooted into it (Talos ≥ 1.13: its drain
        /// did not finish). It boots at the node's next reboot, so `resume` drains and reboots the node
        /// again and never installs a second time (a second install before the reboot would flip the
        /// bootloader back onto the running slot; talos-1.14.md §4.5).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        installed: Option<PendingInstall>,
    },
}

/// A new system installed on a node that has not booted it yet: what resuming its upgrade needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingInstall {
    pub boot_id: String,
    pub from_version: String,
    pub installer_image: String,
    /// The controller cordoned the node (it was schedulable before), so it uncordons it at the end.
    pub uncordon: bool,
}

/// The stages of a Talos ≥ 1.13 node upgrade, which the controller sequences itself: `ImageService.Pull`
/// and `LifecycleService.Upgrade` install into the other boot slot without disturbing the node; then the
/// node is cordoned and drained through the eviction API; then `Reboot`; then, once it is back on the
/// target and Ready, it is uncordoned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "stage"
)]
pub enum LifecycleStage {
    /// `ImageService.Pull` of the installer sent (or about to be). Pulling changes nothing the node
    /// boots, so found in a later pass it is simply made again.
    Pulling {
        /// The last pull failed for a reason that may pass (Talos 1.14 pulls once and leaves retries
        /// to the caller): it is made again once [`crate::talos::Settings::retry_after`] has passed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<FailedAttempt>,
    },
    /// The installer is pulled; the install is next (within the same pass).
    Pulled,
    /// `LifecycleService.Upgrade` sent (or about to be). Found in a later pass, the install's answer
    /// was never recorded: unless `retry` says the call reached nothing, it may have happened (Talos
    /// finishes an install whose client went away), and installing again before a reboot would flip
    /// the bootloader back onto the running slot (talos-1.14.md §4.5).
    Installing {
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        retry: bool,
        /// The last install failed in a way its installer says is worth retrying (`retry` is then
        /// set): it is made again once [`crate::talos::Settings::retry_after`] has passed.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<FailedAttempt>,
    },
    /// Installed; the node is cordoned and its pods are being evicted since `since`. `uncordon` is false
    /// when the node was already cordoned before (by someone else), so it is left as it was found.
    Draining { since: Timestamp, uncordon: bool },
    /// Drained; `Reboot` sent (or about to be) at `at`. The node's deadline counts from here. The node
    /// stays in flight until it is back, Ready and (if `uncordon`) uncordoned.
    Rebooting {
        at: Timestamp,
        uncordon: bool,
        /// The reboot was recorded but its answer never came (the controller stopped mid-call, or the
        /// node did not answer). Only then, and only if the node is seen still on its old boot, running
        /// and ready, for a while, is the reboot sent again: an answered reboot is never repeated.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unanswered: bool,
    },
    /// Back on the target and Ready, and cordoned by the run: uncordoned since `since`, when it was
    /// first seen back. Done once schedulable; past the node deadline from `since`, it fails.
    Uncordoning { since: Timestamp },
    /// Failed for `reason`, and cordoned by the run: it is uncordoned before the failure is
    /// recorded (a controller stopped in between uncordons it again), then it is `Failed`.
    Failing { reason: String, since: Timestamp },
}

/// A pull or install that failed for a reason that may pass, and is to be made again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FailedAttempt {
    pub at: Timestamp,
    /// What failed, in the node's (or the installer's) words.
    pub reason: String,
    /// Attempts that failed so far.
    pub failures: u32,
}

impl LifecycleStage {
    /// Whether the controller cordoned the node and so must make it schedulable again.
    pub fn must_uncordon(&self) -> bool {
        match self {
            LifecycleStage::Pulling { .. }
            | LifecycleStage::Pulled
            | LifecycleStage::Installing { .. } => false,
            LifecycleStage::Draining { uncordon, .. }
            | LifecycleStage::Rebooting { uncordon, .. } => *uncordon,
            LifecycleStage::Uncordoning { .. } | LifecycleStage::Failing { .. } => true,
        }
    }
}

impl Run {
    /// Nodes finished (done) and the total, as `talos-progress` shows them.
    pub fn counts(&self) -> (usize, usize) {
        let done = self
            .nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Done { .. }))
            .count();
        (done, self.nodes.len())
    }

    pub fn node(&self, name: &str) -> Option<&NodeProgress> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The nodes whose call was made (or is about to be) and that are not done yet, in run order.
    pub fn in_flight(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Issued { .. }))
            .map(|n| n.name.clone())
            .collect()
    }

    pub fn failed_nodes(&self) -> Vec<&str> {
        self.nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Failed { .. }))
            .map(|n| n.name.as_str())
            .collect()
    }

    pub fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_round_trips_through_json_with_stable_field_names() {
        let at: Timestamp = "2026-11-25T10:00:00Z".parse().expect("timestamp");
        let run = Run {
            requested: "v1.12.0".into(),
            target: "1.12.0".into(),
            started_at: at,
            outcome: None,
            gates: Default::default(),
            previous: Default::default(),
            rollback: None,
            nodes: vec![
                NodeProgress {
                    name: "worker-1".into(),
                    role: NodeRole::Worker,
                    step: NodeStep::Done {
                        at,
                        started_at: Some(at),
                    },
                },
                NodeProgress {
                    name: "cp-1".into(),
                    role: NodeRole::ControlPlane,
                    step: NodeStep::Issued {
                        at,
                        boot_id: "b1".into(),
                        from_version: "1.11.6".into(),
                        installer_image: "ghcr.io/siderolabs/installer:v1.12.0".into(),
                        lifecycle: None,
                        unanswered: false,
                        install_unconfirmed: false,
                    },
                },
                NodeProgress {
                    name: "cp-2".into(),
                    role: NodeRole::ControlPlane,
                    step: NodeStep::Issued {
                        at,
                        boot_id: "b2".into(),
                        from_version: "1.13.0".into(),
                        installer_image: "ghcr.io/siderolabs/installer:v1.13.1".into(),
                        lifecycle: Some(LifecycleStage::Draining {
                            since: at,
                            uncordon: true,
                        }),
                        unanswered: false,
                        install_unconfirmed: false,
                    },
                },
            ],
        };
        let json = serde_json::to_value(&run).expect("serialize");
        // The legacy path records no stage at all, so runs written before stages existed read the same.
        assert!(json["nodes"][1].get("lifecycle").is_none());
        assert_eq!(json["nodes"][2]["lifecycle"]["stage"], "draining");
        assert_eq!(
            json["nodes"][2]["lifecycle"]["since"],
            "2026-11-25T10:00:00Z"
        );
        assert_eq!(json["nodes"][1]["step"], "issued");
        assert_eq!(json["nodes"][1]["bootId"], "b1");
        assert_eq!(json["nodes"][1]["role"], "control-plane");
        let back: Run = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, run);
        assert_eq!(run.counts(), (1, 3));
    }

    /// Records written before failed attempts were kept (`{"stage":"pulling"}`, `retry` alone) read
    /// as stages with no failed attempt; one with a failed attempt survives a round trip.
    #[test]
    fn stages_written_before_failed_attempts_still_read() {
        let old: LifecycleStage = serde_json::from_str(r#"{"stage":"pulling"}"#).expect("pulling");
        assert_eq!(old, LifecycleStage::Pulling { failed: None });
        let old: LifecycleStage =
            serde_json::from_str(r#"{"stage":"installing","retry":true}"#).expect("installing");
        assert_eq!(
            old,
            LifecycleStage::Installing {
                retry: true,
                failed: None
            }
        );
        let stage = LifecycleStage::Installing {
            retry: true,
            failed: Some(FailedAttempt {
                at: "2026-11-28T10:00:00Z".parse().expect("time"),
                reason: "installer exited with code 5".into(),
                failures: 2,
            }),
        };
        let json = serde_json::to_value(&stage).expect("serialize");
        assert_eq!(json["failed"]["failures"], 2);
        assert_eq!(
            serde_json::from_value::<LifecycleStage>(json).expect("back"),
            stage
        );
        assert_eq!(
            serde_json::to_value(LifecycleStage::Pulling { failed: None }).expect("serialize"),
            serde_json::json!({"stage": "pulling"})
        );
    }
}
