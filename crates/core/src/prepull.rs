//! The pre-pull (issue 23 item 6): before a Talos run disrupts its first node, the installer image each
//! node will be upgraded with is pulled on that node. A node that cannot pull stops the run before any
//! node is cordoned, drained or rebooted, naming the node and the registry's answer.
//!
//! What this module decides, with no IO: which of the run's nodes still need their pull, which pulls to
//! make now (all at once: the shell makes them in parallel), how long a pull that failed for a reason
//! that may pass waits before it is made again, and what the status says meanwhile. The record
//! ([`PrePull`]) lives in the run's [`crate::holds::RunGates`] and is written before each pull is made
//! (write-ahead, as every other call of the run): a controller that restarts mid pre-pull makes the
//! pulls it finds unanswered again (a pull changes nothing the node boots, and one already done is a
//! local no-op on the node), never redoes those recorded as pulled, and starts no node before every
//! pull is recorded as done.

use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// Attempts a pull that fails for a reason that may pass (the node or the registry did not answer) gets
/// before the run fails on it: the pre-pull is there to find a node that cannot pull early, not to wait
/// for it.
pub const ATTEMPTS: u32 = 3;

/// How long after its pre-pull a node's install reads the installer without pulling it again. Talos
/// ≥ 1.13 collects images no container uses once they have been unreferenced for an hour (its image
/// garbage collection runs every 15 minutes with a grace of four runs, talos v1.13.0
/// `internal/app/machined/pkg/controllers/cri/image_gc.go`, for the system containerd and the CRI
/// one), and `LifecycleService.Upgrade` only looks the installer up (`internal/app/lifecycle/
/// container.go`): a node whose turn comes later (a large cluster, a soak, a canary pause) pulls
/// again right before its install, which is quick when the image is still there (`ImageService.Pull`
/// skips an image already pulled, `internal/app/images/images.go`).
pub const FRESH: Duration = Duration::from_secs(30 * 60);

/// What a run keeps of its pre-pull.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrePull {
    /// The nodes whose pull was made (or is about to be), with their installer image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<PrePullNode>,
    /// When every node that needed it had pulled: from then on nodes may be disrupted. Never unset in
    /// a run (a node that joins later, or is unheld, pulls just before its own upgrade, as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_at: Option<Timestamp>,
}

/// One node's pull.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrePullNode {
    pub name: String,
    pub installer_image: String,
    #[serde(flatten)]
    pub state: PullState,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "pull"
)]
pub enum PullState {
    /// The pull was sent (or is about to be) and not answered yet, or failed for a reason that may
    /// pass (`failed`): found in a later pass, it is made again.
    Pulling {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        failed: Option<PullFailure>,
    },
    /// The node answered that the image is pulled.
    Pulled { at: Timestamp },
}

/// The last failed attempt of a pull that may succeed later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PullFailure {
    pub at: Timestamp,
    /// The node's (or its registry's) answer.
    pub reason: String,
    pub failures: u32,
}

impl PrePull {
    pub fn is_empty(&self) -> bool {
        *self == PrePull::default()
    }

    pub fn is_done(&self) -> bool {
        self.done_at.is_some()
    }

    pub fn node(&self, name: &str) -> Option<&PrePullNode> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Records that `name` pulled its image.
    pub fn pulled(&mut self, name: &str, now: Timestamp) {
        for node in self.nodes.iter_mut().filter(|n| n.name == name) {
            node.state = PullState::Pulled { at: now };
        }
    }

    /// Whether `name` pulled `image` less than [`FRESH`] ago: its install needs no pull of its own.
    pub fn fresh(&self, name: &str, image: &str, now: Timestamp) -> bool {
        self.node(name).is_some_and(|n| {
            n.installer_image == image
                && matches!(n.state, PullState::Pulled { at }
                    if now.duration_since(at).unsigned_abs() < FRESH)
        })
    }

    /// Whether every recorded pull was answered.
    pub fn all_pulled(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| matches!(n.state, PullState::Pulled { .. }))
    }

    /// Records a failed attempt on `name` that may pass; returns whether the pull gets another
    /// attempt (false: it failed [`ATTEMPTS`] times, and the run fails on it).
    pub fn failed(&mut self, name: &str, reason: &str, now: Timestamp) -> bool {
        let Some(node) = self.nodes.iter_mut().find(|n| n.name == name) else {
            return false;
        };
        let failures = match &node.state {
            PullState::Pulling { failed } => failed.as_ref().map_or(0, |f| f.failures) + 1,
            PullState::Pulled { .. } => 1,
        };
        node.state = PullState::Pulling {
            failed: Some(PullFailure {
                at: now,
                reason: reason.to_string(),
                failures,
            }),
        };
        failures < ATTEMPTS
    }

    /// `resume` after a failed pull: every pull not done gets its attempts afresh.
    pub fn resume(&mut self) {
        for node in &mut self.nodes {
            if let PullState::Pulling { failed } = &mut node.state {
                *failed = None;
            }
        }
    }
}

/// A node the run will upgrade (pending, not held, not on the target), as this pass sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    pub seen: Seen,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// Its Talos API answers; its installer image for the target, if its machine config was read in
    /// this pass (`None`: not read, so it cannot be pulled yet unless the record has its image).
    Up { image: Option<String> },
    /// Its Talos API does not answer: nothing can be pulled on it, and the run holds until it does.
    Unreachable { reason: String },
    /// Not in this look's node list: the pre-pull holds rather than count it done without a pull.
    Missing,
}

/// A pull to make now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pull {
    pub node: String,
    pub installer_image: String,
    /// The attempt before failed (this is a retry), and why.
    pub after: Option<PullFailure>,
}

/// The pre-pull's decision in one pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    pub pulls: Vec<Pull>,
    /// While the pre-pull is not done: the status message (no node starts).
    pub message: Option<String>,
    /// Every pull is done as of this decision (announced once).
    pub finished: Option<Finished>,
}

/// The pre-pull just finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub nodes: usize,
    pub images: Vec<String>,
}

/// Decides the pre-pull of this pass over the nodes the run will upgrade. Records the pulls it makes
/// (write-ahead) and, once every candidate pulled, that the pre-pull is done.
pub fn decide(
    prepull: &mut PrePull,
    candidates: &[Candidate],
    retry_after: Duration,
    now: Timestamp,
) -> Plan {
    if prepull.is_done() {
        return Plan::default();
    }
    let mut plan = Plan::default();
    let mut pulled = 0;
    let mut details = Vec::new();
    for candidate in candidates {
        let name = &candidate.name;
        let recorded = prepull.node(name).cloned();
        match (&recorded, &candidate.seen) {
            (
                Some(PrePullNode {
                    state: PullState::Pulled { .. },
                    ..
                }),
                _,
            ) => pulled += 1,
            (_, Seen::Unreachable { reason }) => details.push(format!(
                "node {name}'s Talos API is unreachable ({reason}); holding before pulling on it"
            )),
            (_, Seen::Missing) => details.push(format!(
                "node {name} is not in the cluster's node list; holding before pulling on it"
            )),
            (
                Some(PrePullNode {
                    installer_image,
                    state: PullState::Pulling { failed },
                    ..
                }),
                Seen::Up { .. },
            ) => {
                if let Some(failed) = failed {
                    let again = failed.at + retry_after;
                    details.push(format!(
                        "{name}'s pull failed ({}), tried {} of {ATTEMPTS} times; trying again at {}",
                        failed.reason,
                        failed.failures,
                        again.strftime("%H:%M:%S UTC")
                    ));
                    // Not at once: what failed (the registry, the network) is given time.
                    if now < again {
                        continue;
                    }
                }
                plan.pulls.push(Pull {
                    node: name.clone(),
                    installer_image: installer_image.clone(),
                    after: failed.clone(),
                });
            }
            (None, Seen::Up { image: Some(image) }) => {
                prepull.nodes.push(PrePullNode {
                    name: name.clone(),
                    installer_image: image.clone(),
                    state: PullState::Pulling { failed: None },
                });
                plan.pulls.push(Pull {
                    node: name.clone(),
                    installer_image: image.clone(),
                    after: None,
                });
            }
            (None, Seen::Up { image: None }) => details.push(format!(
                "reading node {name}'s machine config for its installer image"
            )),
        }
    }
    let mut images: Vec<String> = candidates
        .iter()
        .filter_map(|c| prepull.node(&c.name).map(|n| n.installer_image.clone()))
        .collect();
    images.sort();
    images.dedup();
    let total = candidates.len();
    if pulled == total {
        prepull.done_at = Some(now);
        plan.finished = (total > 0).then_some(Finished {
            nodes: total,
            images,
        });
        return plan;
    }
    let what = match images.as_slice() {
        [one] => one.clone(),
        _ => "the installer images".to_string(),
    };
    let mut message = format!(
        "Pulling {what} on {total} node{} before upgrading any ({pulled}/{total} pulled)",
        if total == 1 { "" } else { "s" }
    );
    if !details.is_empty() {
        message = format!("{message}: {}", details.join("; "));
    }
    plan.message = Some(message);
    plan
}

/// The sentence a pull that failed for good leaves in the run's failure (after "node <name>").
pub fn failure(installer_image: &str, answer: &str, failures: u32) -> String {
    let tried = if failures > 1 {
        format!(" (tried {failures} times)")
    } else {
        String::new()
    };
    format!(
        "could not pull its installer {installer_image}{tried}: {answer}; the run stopped before \
         upgrading any node (none was cordoned or rebooted): fix the image or the registry, then set \
         resume to pull again"
    )
}

/// The Event when every pull is done.
pub fn finished_message(finished: &Finished, target: &str) -> String {
    let images = finished.images.join(", ");
    format!(
        "Installer {images} pulled on {} node{}; upgrading them to Talos {target}",
        finished.nodes,
        if finished.nodes == 1 { "" } else { "s" }
    )
}

#[cfg(test)]
mod tests;
