//! The etcd snapshot before the control planes (issue 24 item 3): before a Talos run takes down its
//! first control plane (and, with `talos-and-kubernetes`, before a Kubernetes run restarts anything
//! on its first control plane), the controller takes a snapshot of etcd through the Talos API
//! (`MachineService.EtcdSnapshot`) from a healthy control plane and stores it where the operator said.
//! A snapshot that fails, or that cannot be verified, stops the run before any control plane is
//! touched.
//!
//! What this module decides, with no IO: whether a cluster wants a snapshot (its
//! `upgrade.vitistack.io/etcd-snapshot` mode and whether the controller has a destination), which
//! control plane it is taken from, what the run keeps of it ([`Snapshot`], in the Talos run's
//! [`crate::holds::RunGates`] or in the Kubernetes run's record, written before the call like every
//! other call), and the sentences that tell it. Taking a snapshot changes nothing on any node, so a call found unanswered (the controller
//! stopped during it) is simply made again.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// `upgrade.vitistack.io/etcd-snapshot`: which runs of a cluster take a snapshot first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotMode {
    /// No snapshot.
    Off,
    /// Before the first control plane of a Talos run (the default when the controller has a
    /// destination). Kubernetes runs take none.
    Talos,
    /// Before the first control plane of a Talos run, and before the first step of a Kubernetes run
    /// that restarts something on a control plane (its kube-apiserver, usually).
    TalosAndKubernetes,
}

/// What [`SnapshotMode::parse`] accepts, for the invalid-option message.
pub const MODE_REASON: &str = "use off, talos (a snapshot before the first control plane of a \
     Talos run; the default when the controller has a snapshot destination) or talos-and-kubernetes \
     (also one before the first control plane of a Kubernetes run)";

/// Why a snapshot asked for by name cannot be taken: the controller has nowhere to put it.
const NO_DESTINATION: &str = "the controller has no etcd snapshot destination (--etcd-snapshot-dir \
     or --etcd-snapshot-s3-bucket); ask its operator for one, or use off";

impl SnapshotMode {
    pub fn parse(text: &str) -> Result<SnapshotMode, String> {
        match text.trim() {
            "off" => Ok(SnapshotMode::Off),
            "talos" => Ok(SnapshotMode::Talos),
            "talos-and-kubernetes" => Ok(SnapshotMode::TalosAndKubernetes),
            _ => Err(MODE_REASON.to_string()),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotMode::Off => "off",
            SnapshotMode::Talos => "talos",
            SnapshotMode::TalosAndKubernetes => "talos-and-kubernetes",
        }
    }

    /// Whether a Talos run takes a snapshot.
    pub fn for_talos(self) -> bool {
        match self {
            SnapshotMode::Off => false,
            SnapshotMode::Talos | SnapshotMode::TalosAndKubernetes => true,
        }
    }

    /// Whether a Kubernetes run takes a snapshot.
    pub fn for_kubernetes(self) -> bool {
        match self {
            SnapshotMode::Off | SnapshotMode::Talos => false,
            SnapshotMode::TalosAndKubernetes => true,
        }
    }
}

/// Whether a Talos run of a cluster takes a snapshot: its mode (absent: `talos` when the controller
/// has a destination, else off), or why the mode cannot be honoured (a snapshot asked for by name
/// from a controller that has nowhere to put it must not silently become none).
pub fn wanted_for_talos(
    mode: Option<SnapshotMode>,
    destination_configured: bool,
) -> Result<bool, String> {
    match (mode, destination_configured) {
        (None, configured) => Ok(configured),
        (Some(mode), true) => Ok(mode.for_talos()),
        (Some(SnapshotMode::Off), false) => Ok(false),
        (Some(_), false) => Err(NO_DESTINATION.to_string()),
    }
}

/// Whether a Kubernetes run of a cluster takes a snapshot: only when its mode says
/// `talos-and-kubernetes` (absent: none, the snapshot of a Kubernetes run is asked for by name), or
/// why the mode cannot be honoured (as for [`wanted_for_talos`]).
pub fn wanted_for_kubernetes(
    mode: Option<SnapshotMode>,
    destination_configured: bool,
) -> Result<bool, String> {
    match mode {
        None => Ok(false),
        Some(mode) if !mode.for_kubernetes() => Ok(false),
        Some(_) if destination_configured => Ok(true),
        Some(_) => Err(NO_DESTINATION.to_string()),
    }
}

/// Where a snapshot went, as the shell verified it: it wrote the bytes while hashing them, then read
/// the stored object back (or asked the store for its size and checksum) and found the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stored {
    /// `file:///…` or `s3://bucket/key`.
    pub location: String,
    /// Bytes stored.
    pub size: u64,
    /// SHA-256 of the stored bytes, lower-case hex (what `sha256sum` prints).
    pub sha256: String,
}

/// What a run keeps of its snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "state"
)]
pub enum Snapshot {
    /// The call was made (or is about to be) to `node`; found in a later pass, its answer was never
    /// recorded, and it is made again (a snapshot changes nothing).
    Taking { node: String, at: Timestamp },
    /// Stored and verified.
    Taken {
        node: String,
        at: Timestamp,
        #[serde(flatten)]
        stored: Stored,
        /// The `EtcdSnapshotTaken` Event was published (it is decided with the pass after the call).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        announced: bool,
    },
    /// Failed or could not be verified: the run failed with `reason`, before any control plane.
    /// `resume` takes it again.
    Failed {
        node: String,
        at: Timestamp,
        reason: String,
    },
}

impl Snapshot {
    pub fn is_taken(&self) -> bool {
        matches!(self, Snapshot::Taken { .. })
    }
}

/// A control plane the snapshot may be taken from, as this pass sees it: up, ready, its etcd member
/// among a healthy cluster (the caller only asks when etcd is healthy).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub name: String,
    pub leader: bool,
}

/// The control plane to take the snapshot from: a follower if there is one (the leader has the most
/// to do), the first by name among equals, so the choice is predictable.
pub fn choose(sources: &[Source]) -> Option<String> {
    let mut sorted: Vec<&Source> = sources.iter().collect();
    sorted.sort_by_key(|s| (s.leader, s.name.clone()));
    sorted.first().map(|s| s.name.clone())
}

/// What a run's snapshot gate asks for this pass, before its first control-plane change (`first`,
/// the control plane about to be touched). Shared by the Talos run and the Kubernetes run: each
/// keeps its own record and hold, the decision is the same.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Taken and verified: the control plane may be touched.
    Done,
    /// No control plane can give a snapshot: hold before `first` (the message).
    NoSource(String),
    /// Take it from `node` (record [`Snapshot::Taking`] first), holding with `message` meanwhile.
    Take { node: String, message: String },
}

/// The gate's decision: nothing once taken; otherwise the source to take it from (see [`choose`]).
/// A gate found `Taking` (the controller stopped during the call) or `Failed` (then `resume`) is
/// taken again: a snapshot changes nothing.
pub fn next(gate: Option<&Snapshot>, sources: &[Source], first: &str) -> Next {
    if gate.is_some_and(Snapshot::is_taken) {
        return Next::Done;
    }
    match choose(sources) {
        None => Next::NoSource(no_source_message(first)),
        Some(node) => Next::Take {
            message: taking_message(&node, first),
            node,
        },
    }
}

/// The status message while the snapshot is taken.
pub fn taking_message(node: &str, first_control_plane: &str) -> String {
    format!(
        "Taking an etcd snapshot from {node} before upgrading control plane {first_control_plane}"
    )
}

/// The hold when no control plane can give a snapshot.
pub fn no_source_message(first_control_plane: &str) -> String {
    format!(
        "no control plane is up and ready to take the etcd snapshot from; holding before control \
         plane {first_control_plane}"
    )
}

/// The Event once the snapshot is stored and verified.
pub fn taken_message(node: &str, stored: &Stored) -> String {
    format!(
        "etcd snapshot from {node} stored at {} ({} bytes, sha256 {}); upgrading the control planes",
        stored.location, stored.size, stored.sha256
    )
}

/// The run's failure when the snapshot failed or could not be verified (`reason`: what failed, in
/// the node's or the store's words).
pub fn failure(node: &str, reason: &str) -> String {
    format!(
        "the etcd snapshot from control plane {node} failed: {reason}; the run stopped before \
         upgrading any control plane (none was touched): fix the node or the snapshot destination, \
         then set resume to take it again"
    )
}

/// What a run records when the snapshot from `node` failed or could not be verified: the snapshot
/// as failed and the run's outcome, failed naming that node. Talos and Kubernetes runs record the
/// same pair, each in its own place.
pub(crate) fn failed_records(
    node: &str,
    reason: &str,
    now: Timestamp,
) -> (Snapshot, crate::run::Outcome) {
    let snapshot = Snapshot::Failed {
        node: node.to_string(),
        at: now,
        reason: reason.to_string(),
    };
    let outcome = crate::run::Outcome::Failed {
        at: now,
        node: Some(node.to_string()),
        reason: failure(node, reason),
    };
    (snapshot, outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_decide_whether_a_talos_run_wants_a_snapshot() {
        let cases: &[Case] = &[
            (None, true, Ok(true)),
            (None, false, Ok(false)),
            (Some("off"), true, Ok(false)),
            (Some("off"), false, Ok(false)),
            (Some("talos"), true, Ok(true)),
            (Some(" talos "), true, Ok(true)),
            (Some("talos"), false, Err("no etcd snapshot destination")),
            (Some("talos-and-kubernetes"), true, Ok(true)),
            (
                Some("talos-and-kubernetes"),
                false,
                Err("no etcd snapshot destination"),
            ),
        ];
        check(wanted_for_talos, cases);
        for bad in ["on", "true", "kubernetes", "talos,kubernetes", "all", ""] {
            assert_eq!(
                SnapshotMode::parse(bad),
                Err(MODE_REASON.to_string()),
                "{bad}"
            );
        }
    }

    /// Each case: the mode as written (absent: `None`), whether the controller has a destination,
    /// and whether the run wants a snapshot (or a word of why the mode cannot be honoured).
    type Case = (Option<&'static str>, bool, Result<bool, &'static str>);

    fn check(wanted: fn(Option<SnapshotMode>, bool) -> Result<bool, String>, cases: &[Case]) {
        for (text, configured, want) in cases {
            let mode = text.map(|t| SnapshotMode::parse(t).expect("mode"));
            match (wanted(mode, *configured), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, *want, "{text:?} {configured}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{got}"),
                (got, want) => panic!("{text:?} {configured}: {got:?}, wanted {want:?}"),
            }
        }
    }

    /// A Kubernetes run takes one only when asked for by name: never by default, never with
    /// `talos`; asked for without a destination it cannot start.
    #[test]
    fn only_talos_and_kubernetes_makes_a_kubernetes_run_want_a_snapshot() {
        check(
            wanted_for_kubernetes,
            &[
                (None, true, Ok(false)),
                (None, false, Ok(false)),
                (Some("off"), true, Ok(false)),
                (Some("off"), false, Ok(false)),
                (Some("talos"), true, Ok(false)),
                (Some("talos"), false, Ok(false)),
                (Some("talos-and-kubernetes"), true, Ok(true)),
                (Some(" talos-and-kubernetes "), true, Ok(true)),
                (
                    Some("talos-and-kubernetes"),
                    false,
                    Err("no etcd snapshot destination"),
                ),
            ],
        );
        for mode in [
            SnapshotMode::Off,
            SnapshotMode::Talos,
            SnapshotMode::TalosAndKubernetes,
        ] {
            assert_eq!(SnapshotMode::parse(mode.as_str()), Ok(mode));
        }
    }

    #[test]
    fn a_follower_is_chosen_over_the_leader_and_names_break_ties() {
        let source = |name: &str, leader| Source {
            name: name.into(),
            leader,
        };
        let cases: &[(Vec<Source>, Option<&str>)] = &[
            (vec![], None),
            (vec![source("cp-1", true)], Some("cp-1")),
            (
                vec![
                    source("cp-1", true),
                    source("cp-3", false),
                    source("cp-2", false),
                ],
                Some("cp-2"),
            ),
            (
                vec![source("cp-2", false), source("cp-1", false)],
                Some("cp-1"),
            ),
        ];
        for (sources, want) in cases {
            assert_eq!(choose(sources).as_deref(), *want, "{sources:?}");
        }
    }

    #[test]
    fn the_gate_takes_until_taken_and_holds_without_a_source() {
        let at: Timestamp = "2026-11-29T02:00:00Z".parse().expect("time");
        let taken = Snapshot::Taken {
            node: "cp-2".into(),
            at,
            stored: Stored {
                location: "file:///s".into(),
                size: 1,
                sha256: "ab".into(),
            },
            announced: false,
        };
        let taking = Snapshot::Taking {
            node: "cp-2".into(),
            at,
        };
        let failed = Snapshot::Failed {
            node: "cp-2".into(),
            at,
            reason: "r".into(),
        };
        let two = vec![
            Source {
                name: "cp-1".into(),
                leader: true,
            },
            Source {
                name: "cp-2".into(),
                leader: false,
            },
        ];
        let take = Next::Take {
            node: "cp-2".into(),
            message: taking_message("cp-2", "cp-1"),
        };
        let cases: &[(Option<&Snapshot>, &[Source], Next)] = &[
            (None, &two, take.clone()),
            (Some(&taking), &two, take.clone()),
            (Some(&failed), &two, take.clone()),
            (Some(&taken), &two, Next::Done),
            (Some(&taken), &[], Next::Done),
            (None, &[], Next::NoSource(no_source_message("cp-1"))),
        ];
        for (gate, sources, want) in cases {
            assert_eq!(next(*gate, sources, "cp-1"), *want, "{gate:?} {sources:?}");
        }
    }

    #[test]
    fn the_record_round_trips_with_stable_field_names() {
        let at: Timestamp = "2026-11-29T02:00:00Z".parse().expect("time");
        let taken = Snapshot::Taken {
            node: "cp-2".into(),
            at,
            stored: Stored {
                location: "file:///snapshots/ns/c/x.snapshot".into(),
                size: 42,
                sha256: "ab".into(),
            },
            announced: false,
        };
        let json = serde_json::to_value(&taken).expect("json");
        assert_eq!(
            json,
            serde_json::json!({"state": "taken", "node": "cp-2", "at": "2026-11-29T02:00:00Z",
                "location": "file:///snapshots/ns/c/x.snapshot", "size": 42, "sha256": "ab"})
        );
        assert_eq!(
            serde_json::from_value::<Snapshot>(json).expect("back"),
            taken
        );
        let failed = Snapshot::Failed {
            node: "cp-1".into(),
            at,
            reason: "r".into(),
        };
        let json = serde_json::to_value(&failed).expect("json");
        assert_eq!(json["state"], "failed");
        assert_eq!(
            serde_json::from_value::<Snapshot>(json).expect("back"),
            failed
        );
    }
}
