//! The `upgrade.vitistack.io/*` annotation keys and the formats of the values the controller writes
//! (design/protocol.md, "Annotations").
//!
//! Every key is a constant here, and per-kind keys are reached through [`UpgradeKind`], so no other code
//! formats a key by hand: a typo in a key would silently turn into an annotation nobody reads.
//!
//! The user-written values are interpreted in [`crate::intent`]; this module only names keys and
//! parses/prints the controller-written value formats ([`UpgradeStatus`], [`Progress`], node lists).

use std::fmt;
use std::str::FromStr;

/// The prefix shared by every key.
pub const PREFIX: &str = "upgrade.vitistack.io/";

// ----- written by the user -----

/// Talos version to upgrade every node to (`1.12.0` or `v1.12.0`).
pub const TALOS_TARGET: &str = "upgrade.vitistack.io/talos-target";
/// Kubernetes version to upgrade to (`1.35.0` or `v1.35.0`).
pub const KUBERNETES_TARGET: &str = "upgrade.vitistack.io/kubernetes-target";
/// `"true"`: retry a failed upgrade from the node that failed; the controller removes it.
pub const RESUME: &str = "upgrade.vitistack.io/resume";
/// `"true"`: forget all Talos upgrade state (status back to `idle`); the controller removes it.
pub const TALOS_RESET_UPGRADE_STATE: &str = "upgrade.vitistack.io/talos-reset-upgrade-state";
/// `"true"`: forget all Kubernetes upgrade state (status back to `idle`); the controller removes it.
pub const KUBERNETES_RESET_UPGRADE_STATE: &str =
    "upgrade.vitistack.io/kubernetes-reset-upgrade-state";
/// `"true"`: finish the node(s) in flight, then hold.
pub const PAUSED: &str = "upgrade.vitistack.io/paused";
/// `workers-first` (default) or `control-planes-first`.
pub const UPGRADE_ORDER: &str = "upgrade.vitistack.io/upgrade-order";
/// Workers upgraded at once, an integer ≥ 1 (default 1).
pub const MAX_PARALLEL_WORKERS: &str = "upgrade.vitistack.io/max-parallel-workers";
/// Name of the credentials Secret, overriding the configured name template.
pub const CREDENTIALS_SECRET: &str = "upgrade.vitistack.io/credentials-secret";
/// Any non-empty value: the controller touches nothing on this cluster (no look at its nodes, no
/// call, no progress record written, no run advanced) and only says once that it is excluded.
/// vitistack's talos-operator reads the same key the same way (it skips the whole reconcile), so one
/// annotation excludes a cluster from both (see [`crate::coexistence`]).
pub const DO_NOT_RECONCILE: &str = "upgrade.vitistack.io/do-not-reconcile";
/// An installer image repository (no tag) for every node's Talos upgrade; the target's tag is added.
/// Overrides the image derived from each node's own (see [`crate::talos::installer`]).
pub const TALOS_INSTALLER_IMAGE: &str = "upgrade.vitistack.io/talos-installer-image";
/// An Image Factory schematic id for every node's Talos upgrade, with each node's platform:
/// `factory.talos.dev/<platform>-installer/<schematic>:<target>`.
pub const TALOS_SCHEMATIC: &str = "upgrade.vitistack.io/talos-schematic";
/// Which firing alerts hold this cluster's upgrade before each node: `off`, `alerts: A, B` (the
/// operator's selector narrowed to these names), a label selector `{...}` (replacing the operator's),
/// or `promql: <expression>` that must return nothing (see [`crate::alert_gate`]).
pub const ALERT_GATE: &str = "upgrade.vitistack.io/alert-gate";
/// Which Alertmanager silences the controller keeps during this cluster's Talos runs: `off`, `node`
/// (one per node in flight; the default with `--alertmanager-url`) or `run` (one for all the run's
/// nodes while it goes on); see [`crate::silences`].
pub const ALERT_SILENCES: &str = "upgrade.vitistack.io/alert-silences";
/// Objects of the workload cluster that must be healthy before each node: a YAML or JSON list of
/// checks, each an object reference and a condition (`Ready`, `Available` or `cel: <expression>`);
/// see [`crate::health_checks`].
pub const HEALTH_CHECKS: &str = "upgrade.vitistack.io/health-checks";

/// When a Talos run may start nodes: `always`, or windows such as `Mon-Fri 22:00 4h Europe/Oslo;
/// Sat,Sun 02:00 8h UTC` (see [`crate::holds::MaintenanceWindows`]); absent: the operator's default.
pub const MAINTENANCE_WINDOW: &str = "upgrade.vitistack.io/maintenance-window";
/// `"true"`: the Talos run starts now and goes on outside the maintenance windows; the controller
/// records it in the run and removes it.
pub const FORCE_START: &str = "upgrade.vitistack.io/force-start";
/// Roll nodes back to the Talos they ran before the last run: `failed` (its failed nodes), `run` (its
/// failed and upgraded nodes) or a comma-separated list of node names; the controller removes it when
/// it accepts the rollback (see [`crate::talos::rollback`]).
pub const TALOS_ROLLBACK: &str = "upgrade.vitistack.io/talos-rollback";
/// A duration (`10m`): after each node is done, the next one waits this long.
pub const SOAK_AFTER_NODE: &str = "upgrade.vitistack.io/soak-after-node";
/// A duration (`30m`): after the last control plane is done, the next phase's first node waits this
/// long.
pub const SOAK_AFTER_CONTROL_PLANES: &str = "upgrade.vitistack.io/soak-after-control-planes";
/// A whole number ≥ 1: the canary; after this many nodes upgraded, the run pauses once.
pub const PAUSE_AFTER_NODES: &str = "upgrade.vitistack.io/pause-after-nodes";
/// `multi-hop`: a target that needs several steps becomes a plan of hops (`core::plan`); absent or
/// `single-step`: one step, as the protocol's version rules say.
pub const UPGRADE_PLAN: &str = "upgrade.vitistack.io/upgrade-plan";
/// `"true"`: a dry run: the controller shows the plan it would run (Event and `plan-message`) and
/// touches no node.
pub const PLAN_PREVIEW: &str = "upgrade.vitistack.io/plan-preview";
/// Whether Talos runs take an etcd snapshot before their first control plane: `off` or `talos` (the
/// default when the controller has a snapshot destination); see [`crate::etcd_snapshot`].
pub const ETCD_SNAPSHOT: &str = "upgrade.vitistack.io/etcd-snapshot";

/// `"true"` on a node's vitistack Machine (management cluster) or its workload Node: Talos runs skip
/// the node (a node in flight finishes) and complete without it, naming it. Not a key of the
/// `KubernetesCluster`, so in neither list below.
pub const NODE_HOLD: &str = "upgrade.vitistack.io/hold";

// ----- written by the controller -----

/// Lowest Talos version running across the nodes, without a leading `v`.
pub const TALOS_CURRENT: &str = "upgrade.vitistack.io/talos-current";
/// Lowest Kubernetes version running across the nodes, without a leading `v`.
pub const KUBERNETES_CURRENT: &str = "upgrade.vitistack.io/kubernetes-current";
/// Newest Talos version that is a valid next target; absent when there is none.
pub const TALOS_AVAILABLE: &str = "upgrade.vitistack.io/talos-available";
/// Newest Kubernetes version that is a valid next target and supported by every node's Talos.
pub const KUBERNETES_AVAILABLE: &str = "upgrade.vitistack.io/kubernetes-available";
/// [`UpgradeStatus`] of the Talos upgrade.
pub const TALOS_STATUS: &str = "upgrade.vitistack.io/talos-status";
/// [`UpgradeStatus`] of the Kubernetes upgrade.
pub const KUBERNETES_STATUS: &str = "upgrade.vitistack.io/kubernetes-status";
/// One human sentence about the Talos upgrade.
pub const TALOS_MESSAGE: &str = "upgrade.vitistack.io/talos-message";
/// One human sentence about the Kubernetes upgrade.
pub const KUBERNETES_MESSAGE: &str = "upgrade.vitistack.io/kubernetes-message";
/// [`Progress`] of the Talos upgrade, `done/total`.
pub const TALOS_PROGRESS: &str = "upgrade.vitistack.io/talos-progress";
/// [`Progress`] of the Kubernetes upgrade, `done/total`.
pub const KUBERNETES_PROGRESS: &str = "upgrade.vitistack.io/kubernetes-progress";
/// Comma-separated nodes that failed in the last run; removed on success or reset.
pub const FAILED_NODES: &str = "upgrade.vitistack.io/failed-nodes";
/// The multi-hop plan: the hop in progress, what is done and what is left (or the preview).
pub const PLAN_MESSAGE: &str = "upgrade.vitistack.io/plan-message";

/// Every key the user writes.
pub const USER_KEYS: [&str; 24] = [
    TALOS_TARGET,
    KUBERNETES_TARGET,
    RESUME,
    TALOS_RESET_UPGRADE_STATE,
    KUBERNETES_RESET_UPGRADE_STATE,
    PAUSED,
    UPGRADE_ORDER,
    MAX_PARALLEL_WORKERS,
    CREDENTIALS_SECRET,
    DO_NOT_RECONCILE,
    TALOS_INSTALLER_IMAGE,
    TALOS_SCHEMATIC,
    ALERT_GATE,
    ALERT_SILENCES,
    HEALTH_CHECKS,
    MAINTENANCE_WINDOW,
    FORCE_START,
    TALOS_ROLLBACK,
    SOAK_AFTER_NODE,
    SOAK_AFTER_CONTROL_PLANES,
    PAUSE_AFTER_NODES,
    UPGRADE_PLAN,
    PLAN_PREVIEW,
    ETCD_SNAPSHOT,
];

/// Every key the controller writes. The controller must never rewrite a key outside this list
/// (protocol: "the user's own keys are never rewritten"); it only removes the one-shot user keys.
pub const CONTROLLER_KEYS: [&str; 12] = [
    TALOS_CURRENT,
    KUBERNETES_CURRENT,
    TALOS_AVAILABLE,
    KUBERNETES_AVAILABLE,
    TALOS_STATUS,
    KUBERNETES_STATUS,
    TALOS_MESSAGE,
    KUBERNETES_MESSAGE,
    TALOS_PROGRESS,
    KUBERNETES_PROGRESS,
    FAILED_NODES,
    PLAN_MESSAGE,
];

/// The two upgrades the controller runs. Each has its own target, status, message, progress, current,
/// available and reset keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UpgradeKind {
    Talos,
    Kubernetes,
}

impl UpgradeKind {
    /// Both kinds, Talos first (the order in which a cluster is upgraded).
    pub const ALL: [UpgradeKind; 2] = [UpgradeKind::Talos, UpgradeKind::Kubernetes];

    /// `talos` / `kubernetes`: the metrics `kind` label and the key infix.
    pub fn as_str(self) -> &'static str {
        match self {
            UpgradeKind::Talos => "talos",
            UpgradeKind::Kubernetes => "kubernetes",
        }
    }

    /// `Talos` / `Kubernetes`, for sentences.
    pub fn name(self) -> &'static str {
        match self {
            UpgradeKind::Talos => "Talos",
            UpgradeKind::Kubernetes => "Kubernetes",
        }
    }

    /// `*-target` (user-written).
    pub fn target_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_TARGET,
            UpgradeKind::Kubernetes => KUBERNETES_TARGET,
        }
    }

    /// `*-reset-upgrade-state` (user-written, one-shot).
    pub fn reset_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_RESET_UPGRADE_STATE,
            UpgradeKind::Kubernetes => KUBERNETES_RESET_UPGRADE_STATE,
        }
    }

    /// `*-status`.
    pub fn status_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_STATUS,
            UpgradeKind::Kubernetes => KUBERNETES_STATUS,
        }
    }

    /// `*-message`.
    pub fn message_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_MESSAGE,
            UpgradeKind::Kubernetes => KUBERNETES_MESSAGE,
        }
    }

    /// `*-progress`.
    pub fn progress_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_PROGRESS,
            UpgradeKind::Kubernetes => KUBERNETES_PROGRESS,
        }
    }

    /// `*-current`.
    pub fn current_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_CURRENT,
            UpgradeKind::Kubernetes => KUBERNETES_CURRENT,
        }
    }

    /// `*-available`.
    pub fn available_key(self) -> &'static str {
        match self {
            UpgradeKind::Talos => TALOS_AVAILABLE,
            UpgradeKind::Kubernetes => KUBERNETES_AVAILABLE,
        }
    }
}

impl fmt::Display for UpgradeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The value of `*-status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UpgradeStatus {
    /// Nothing to do, or the state was reset.
    #[default]
    Idle,
    /// A run is going on.
    InProgress,
    /// Every node is verified on the target.
    Completed,
    /// Terminal for this target until it changes, `resume` or a reset.
    Failed,
    /// Kubernetes only: waiting for Talos (upgrade running, or a node's Talos too old for the target).
    Blocked,
}

impl UpgradeStatus {
    /// Every status, in lifecycle order.
    pub const ALL: [UpgradeStatus; 5] = [
        UpgradeStatus::Idle,
        UpgradeStatus::InProgress,
        UpgradeStatus::Completed,
        UpgradeStatus::Failed,
        UpgradeStatus::Blocked,
    ];

    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            UpgradeStatus::Idle => "idle",
            UpgradeStatus::InProgress => "in-progress",
            UpgradeStatus::Completed => "completed",
            UpgradeStatus::Failed => "failed",
            UpgradeStatus::Blocked => "blocked",
        }
    }

    /// Parse an annotation value. Exact match only: the controller writes these itself, so anything
    /// else is a hand edit or another writer, and the caller should see it rather than have it guessed.
    pub fn parse(value: &str) -> Result<UpgradeStatus, UnknownStatus> {
        UpgradeStatus::ALL
            .into_iter()
            .find(|status| status.as_str() == value)
            .ok_or_else(|| UnknownStatus {
                value: value.to_string(),
            })
    }
}

impl fmt::Display for UpgradeStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for UpgradeStatus {
    type Err = UnknownStatus;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        UpgradeStatus::parse(value)
    }
}

/// A `*-status` value that is not one of the five statuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "\"{value}\" is not an upgrade status: expected idle, in-progress, completed, failed or blocked"
)]
pub struct UnknownStatus {
    pub value: String,
}

/// The value of `*-progress`: `done/total`, nodes already on the target counting as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Progress {
    pub done: u32,
    pub total: u32,
}

impl Progress {
    /// Parse `done/total`. `done > total` is refused: no writer of ours produces it, so it can only be
    /// a hand edit, and trusting it would report an upgrade as further along than it is.
    pub fn parse(value: &str) -> Result<Progress, InvalidProgress> {
        let invalid = || InvalidProgress {
            value: value.to_string(),
        };
        let (done, total) = value.split_once('/').ok_or_else(invalid)?;
        let done = parse_count(done).ok_or_else(invalid)?;
        let total = parse_count(total).ok_or_else(invalid)?;
        if done > total {
            return Err(invalid());
        }
        Ok(Progress { done, total })
    }
}

/// Decimal digits only: `u32::from_str` also takes a leading `+`, which we never write.
fn parse_count(text: &str) -> Option<u32> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

impl fmt::Display for Progress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.done, self.total)
    }
}

impl FromStr for Progress {
    type Err = InvalidProgress;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        Progress::parse(value)
    }
}

/// A `*-progress` value that is not `done/total`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("\"{value}\" is not an upgrade progress: expected done/total, e.g. 2/5")]
pub struct InvalidProgress {
    pub value: String,
}

/// Split a `failed-nodes` value into node names: comma-separated, surrounding spaces and empty items
/// dropped (a hand-edited `a, b,` still names `a` and `b`).
pub fn parse_node_list(value: &str) -> Vec<String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_string)
        .collect()
}

/// Join node names into a `failed-nodes` value.
pub fn format_node_list<S: AsRef<str>>(nodes: &[S]) -> String {
    nodes
        .iter()
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn every_key_has_the_prefix_and_is_unique() {
        let mut seen = BTreeSet::new();
        for key in USER_KEYS.iter().chain(CONTROLLER_KEYS.iter()) {
            assert!(key.starts_with(PREFIX), "{key}");
            let name = &key[PREFIX.len()..];
            assert!(!name.is_empty() && !name.contains('/'), "{key}");
            assert!(seen.insert(*key), "duplicate key {key}");
        }
        assert_eq!(seen.len(), 36);
    }

    #[test]
    fn keys_match_the_protocol_table() {
        let cases = [
            (TALOS_TARGET, "talos-target"),
            (KUBERNETES_TARGET, "kubernetes-target"),
            (RESUME, "resume"),
            (TALOS_RESET_UPGRADE_STATE, "talos-reset-upgrade-state"),
            (
                KUBERNETES_RESET_UPGRADE_STATE,
                "kubernetes-reset-upgrade-state",
            ),
            (PAUSED, "paused"),
            (UPGRADE_ORDER, "upgrade-order"),
            (MAX_PARALLEL_WORKERS, "max-parallel-workers"),
            (CREDENTIALS_SECRET, "credentials-secret"),
            (DO_NOT_RECONCILE, "do-not-reconcile"),
            (TALOS_INSTALLER_IMAGE, "talos-installer-image"),
            (TALOS_SCHEMATIC, "talos-schematic"),
            (TALOS_CURRENT, "talos-current"),
            (KUBERNETES_CURRENT, "kubernetes-current"),
            (TALOS_AVAILABLE, "talos-available"),
            (KUBERNETES_AVAILABLE, "kubernetes-available"),
            (TALOS_STATUS, "talos-status"),
            (KUBERNETES_STATUS, "kubernetes-status"),
            (TALOS_MESSAGE, "talos-message"),
            (KUBERNETES_MESSAGE, "kubernetes-message"),
            (TALOS_PROGRESS, "talos-progress"),
            (KUBERNETES_PROGRESS, "kubernetes-progress"),
            (FAILED_NODES, "failed-nodes"),
        ];
        for (key, name) in cases {
            assert_eq!(key, format!("{PREFIX}{name}"));
        }
    }

    #[test]
    fn per_kind_keys_follow_the_kind_prefix() {
        for kind in UpgradeKind::ALL {
            let stem = format!("{PREFIX}{}-", kind.as_str());
            let keys = [
                (kind.target_key(), "target"),
                (kind.reset_key(), "reset-upgrade-state"),
                (kind.status_key(), "status"),
                (kind.message_key(), "message"),
                (kind.progress_key(), "progress"),
                (kind.current_key(), "current"),
                (kind.available_key(), "available"),
            ];
            for (key, suffix) in keys {
                assert_eq!(key, format!("{stem}{suffix}"), "{kind}");
            }
        }
        assert_eq!(UpgradeKind::Talos.name(), "Talos");
        assert_eq!(UpgradeKind::Kubernetes.name(), "Kubernetes");
        assert_eq!(UpgradeKind::Kubernetes.to_string(), "kubernetes");
    }

    #[test]
    fn status_round_trips_and_is_exact() {
        let cases = [
            ("idle", Some(UpgradeStatus::Idle)),
            ("in-progress", Some(UpgradeStatus::InProgress)),
            ("completed", Some(UpgradeStatus::Completed)),
            ("failed", Some(UpgradeStatus::Failed)),
            ("blocked", Some(UpgradeStatus::Blocked)),
            ("Idle", None),
            ("in_progress", None),
            ("inprogress", None),
            (" failed", None),
            ("pending", None),
            ("rolling-back", None),
            ("", None),
        ];
        for (text, expected) in cases {
            assert_eq!(UpgradeStatus::parse(text).ok(), expected, "{text:?}");
            assert_eq!(text.parse::<UpgradeStatus>().ok(), expected, "{text:?}");
            if let Some(status) = expected {
                assert_eq!(status.as_str(), text);
                assert_eq!(status.to_string(), text);
            }
        }
        assert_eq!(
            UpgradeStatus::parse("pending").unwrap_err().to_string(),
            "\"pending\" is not an upgrade status: expected idle, in-progress, completed, failed or blocked"
        );
    }

    #[test]
    fn progress_parses_and_prints() {
        let cases = [
            ("0/5", Some((0, 5))),
            ("2/5", Some((2, 5))),
            ("5/5", Some((5, 5))),
            ("0/0", Some((0, 0))),
            ("6/5", None),
            ("2", None),
            ("2/", None),
            ("/5", None),
            ("+2/5", None),
            ("2 / 5", None),
            ("a/b", None),
            ("2/5/7", None),
            ("99999999999/99999999999", None),
        ];
        for (text, expected) in cases {
            let parsed = Progress::parse(text).ok().map(|p| (p.done, p.total));
            assert_eq!(parsed, expected, "{text:?}");
            if expected.is_some() {
                assert_eq!(Progress::parse(text).unwrap().to_string(), text);
            }
        }
        assert_eq!(
            "x".parse::<Progress>().unwrap_err().to_string(),
            "\"x\" is not an upgrade progress: expected done/total, e.g. 2/5"
        );
    }

    #[test]
    fn node_lists() {
        let cases: [(&str, &[&str]); 5] = [
            ("", &[]),
            ("cp-1", &["cp-1"]),
            ("cp-1,worker-2", &["cp-1", "worker-2"]),
            (" cp-1 , worker-2 ,", &["cp-1", "worker-2"]),
            (",,", &[]),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_node_list(text), expected, "{text:?}");
        }
        assert_eq!(format_node_list(&["cp-1", "worker-2"]), "cp-1,worker-2");
        assert_eq!(format_node_list::<String>(&[]), "");
    }
}
