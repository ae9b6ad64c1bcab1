//! The vocabulary both kinds of upgrade share: a node's role and the order of roles, a run as it is
//! recorded ([`Record`]), how a run ends, where it stands, what it tells the user (the decision's
//! [`Report`] and its Events as [`Note`]s), and the checks that hold it.

use std::fmt;
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// A node's role in the rollout order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeRole {
    ControlPlane,
    Worker,
}

impl NodeRole {
    pub const ALL: [NodeRole; 2] = [NodeRole::ControlPlane, NodeRole::Worker];

    /// `control-plane` / `worker`, as in the persisted run and the metrics `role` label.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::ControlPlane => "control-plane",
            NodeRole::Worker => "worker",
        }
    }
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "result"
)]
pub enum Outcome {
    Completed {
        at: Timestamp,
    },
    /// `node` is absent when the run was refused before touching any node (an invalid target).
    Failed {
        at: Timestamp,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        node: Option<String>,
        reason: String,
    },
}

/// A persisted run of either kind, as the lifecycle and the gates read it.
pub trait Record: Clone + PartialEq + fmt::Debug {
    /// The target as the user wrote it (trimmed): a different annotation value is a different run.
    fn requested(&self) -> &str;
    /// The normalised target version.
    fn target(&self) -> &str;
    fn started_at(&self) -> Timestamp;
    fn outcome(&self) -> Option<&Outcome>;
    /// Whether the run has nodes or steps: a run, rather than a target refused before any was touched.
    fn touched(&self) -> bool;
    /// Nodes done and in all, as `*-progress` shows them.
    fn counts(&self) -> (usize, usize);
    /// The nodes being worked on right now, in run order.
    fn in_flight(&self) -> Vec<String>;
    /// The record of a target refused before any node was touched, so it is not decided again.
    fn refused(requested: &str, reason: &str, now: Timestamp) -> Self;

    fn is_finished(&self) -> bool {
        self.outcome().is_some()
    }

    fn failure(&self) -> Option<&str> {
        match self.outcome() {
            Some(Outcome::Failed { reason, .. }) => Some(reason),
            Some(Outcome::Completed { .. }) | None => None,
        }
    }

    /// Whether the run rolled nodes back (Talos `talos-rollback`) rather than upgrading them: its
    /// completion takes the nodes off its target, so a plan never moves past a hop on it.
    fn is_rollback(&self) -> bool {
        false
    }
}

/// Node order of the Talos OS upgrade (`upgrade-order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum UpgradeOrder {
    /// Workers first, then control planes one at a time: a bad release shows up on a worker before it
    /// can cost etcd quorum.
    #[default]
    WorkersFirst,
    ControlPlanesFirst,
}

impl UpgradeOrder {
    pub fn as_str(self) -> &'static str {
        match self {
            UpgradeOrder::WorkersFirst => "workers-first",
            UpgradeOrder::ControlPlanesFirst => "control-planes-first",
        }
    }

    /// ASCII case-insensitive, no trimming (the caller trims).
    pub fn parse(value: &str) -> Option<UpgradeOrder> {
        [UpgradeOrder::WorkersFirst, UpgradeOrder::ControlPlanesFirst]
            .into_iter()
            .find(|order| order.as_str().eq_ignore_ascii_case(value))
    }
}

impl fmt::Display for UpgradeOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether an event is routine or needs attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoteType {
    Normal,
    Warning,
}

/// The reason of an Event on the KubernetesCluster: what `kubectl describe` shows in its Reason column.
/// The names are part of the contract (users filter on them, the alerts count them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// A run started: the versions and how many nodes.
    UpgradeStarted,
    /// A failed run continues (`resume`).
    UpgradeResumed,
    /// The user reset the state of an upgrade kind.
    UpgradeReset,
    UpgradeCompleted,
    UpgradeFailed,
    /// A run (or its start) holds, and says on what.
    UpgradeWaiting,
    /// A run cannot go on or start: the cluster cannot be looked at, or (Kubernetes) Talos blocks it.
    UpgradeBlocked,
    /// A target that is refused before any node is touched.
    InvalidTarget,
    /// An option annotation with a value the controller cannot use.
    InvalidOption,
    /// A flag annotation (`paused`, `resume`, the resets) that is neither "true" nor "false".
    InvalidFlag,
    /// A node's upgrade started.
    NodeUpgradeStarted,
    /// A node is on the target, verified.
    NodeUpgraded,
    /// A node was drained before its reboot (Talos ≥ 1.13).
    NodeDrained,
    /// A reboot that got no answer was sent again (Talos ≥ 1.13).
    NodeRebootResent,
    /// A pull or install that failed for a reason that may pass is made again (Talos ≥ 1.13).
    NodeInstallRetried,
    /// A node joined the cluster below the target of a completed run, which takes it in.
    NodeJoined,
    /// A node not started yet left the cluster's node list; the run goes on without it.
    NodeLeft,
    /// One step of a Kubernetes upgrade started.
    StepStarted,
    /// A node held by its Machine's or Node's `upgrade.vitistack.io/hold` is skipped by the run.
    NodeHeld,
    /// `force-start`: the run starts and goes on outside the maintenance windows.
    MaintenanceWindowOverridden,
    /// The installer is pulled on every node the run upgrades, before the first is disrupted.
    InstallerPulled,
    /// An Alertmanager silence was created for the run or a node in flight (its id and matchers).
    SilenceCreated,
    /// One of the controller's Alertmanager silences was expired (its id, matchers and why).
    SilenceExpired,
    /// Alertmanager could not be asked or refused a silence; the run goes on without it.
    SilenceFailed,
    /// A multi-hop upgrade plan was computed for the targets (its hops).
    PlanComputed,
    /// A hop of the plan starts (its run follows).
    PlanHopStarted,
    /// A hop of the plan finished (its run completed).
    PlanHopFinished,
    /// The plan's last hop finished.
    PlanFinished,
    /// No plan reaches the targets; no node was touched.
    PlanRefused,
    /// `plan-preview`: the plan the controller would run, nothing touched.
    PlanPreview,
    /// The etcd snapshot before the first control plane was stored and verified (where, size, sha256).
    EtcdSnapshotTaken,
    /// `talos-rollback` was accepted: which nodes go back to which version.
    RollbackStarted,
    /// A node's `MachineService.Rollback` is about to be made.
    NodeRollbackStarted,
    /// A node rebooted into its previous version, ready and Ready.
    NodeRolledBack,
    RollbackCompleted,
    RollbackFailed,
    /// `talos-rollback` was refused (a bad value, an unknown node, a node with no previous system):
    /// no node was touched.
    RollbackRefused,
}

impl Reason {
    pub const ALL: [Reason; 37] = [
        Reason::UpgradeStarted,
        Reason::UpgradeResumed,
        Reason::UpgradeReset,
        Reason::UpgradeCompleted,
        Reason::UpgradeFailed,
        Reason::UpgradeWaiting,
        Reason::UpgradeBlocked,
        Reason::InvalidTarget,
        Reason::InvalidOption,
        Reason::InvalidFlag,
        Reason::NodeUpgradeStarted,
        Reason::NodeUpgraded,
        Reason::NodeDrained,
        Reason::NodeRebootResent,
        Reason::NodeInstallRetried,
        Reason::NodeJoined,
        Reason::NodeLeft,
        Reason::StepStarted,
        Reason::NodeHeld,
        Reason::MaintenanceWindowOverridden,
        Reason::InstallerPulled,
        Reason::SilenceCreated,
        Reason::SilenceExpired,
        Reason::SilenceFailed,
        Reason::PlanComputed,
        Reason::PlanHopStarted,
        Reason::PlanHopFinished,
        Reason::PlanFinished,
        Reason::PlanRefused,
        Reason::PlanPreview,
        Reason::EtcdSnapshotTaken,
        Reason::RollbackStarted,
        Reason::NodeRollbackStarted,
        Reason::NodeRolledBack,
        Reason::RollbackCompleted,
        Reason::RollbackFailed,
        Reason::RollbackRefused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::UpgradeStarted => "UpgradeStarted",
            Reason::UpgradeResumed => "UpgradeResumed",
            Reason::UpgradeReset => "UpgradeReset",
            Reason::UpgradeCompleted => "UpgradeCompleted",
            Reason::UpgradeFailed => "UpgradeFailed",
            Reason::UpgradeWaiting => "UpgradeWaiting",
            Reason::UpgradeBlocked => "UpgradeBlocked",
            Reason::InvalidTarget => "InvalidTarget",
            Reason::InvalidOption => "InvalidOption",
            Reason::InvalidFlag => "InvalidFlag",
            Reason::NodeUpgradeStarted => "NodeUpgradeStarted",
            Reason::NodeUpgraded => "NodeUpgraded",
            Reason::NodeDrained => "NodeDrained",
            Reason::NodeRebootResent => "NodeRebootResent",
            Reason::NodeInstallRetried => "NodeInstallRetried",
            Reason::NodeJoined => "NodeJoined",
            Reason::NodeLeft => "NodeLeft",
            Reason::StepStarted => "StepStarted",
            Reason::NodeHeld => "NodeHeld",
            Reason::MaintenanceWindowOverridden => "MaintenanceWindowOverridden",
            Reason::InstallerPulled => "InstallerPulled",
            Reason::SilenceCreated => "SilenceCreated",
            Reason::SilenceExpired => "SilenceExpired",
            Reason::SilenceFailed => "SilenceFailed",
            Reason::PlanComputed => "PlanComputed",
            Reason::PlanHopStarted => "PlanHopStarted",
            Reason::PlanHopFinished => "PlanHopFinished",
            Reason::PlanFinished => "PlanFinished",
            Reason::PlanRefused => "PlanRefused",
            Reason::PlanPreview => "PlanPreview",
            Reason::EtcdSnapshotTaken => "EtcdSnapshotTaken",
            Reason::RollbackStarted => "RollbackStarted",
            Reason::NodeRollbackStarted => "NodeRollbackStarted",
            Reason::NodeRolledBack => "NodeRolledBack",
            Reason::RollbackCompleted => "RollbackCompleted",
            Reason::RollbackFailed => "RollbackFailed",
            Reason::RollbackRefused => "RollbackRefused",
        }
    }

    /// How a run ended, for the runs-by-result metric: an Event with this reason is published exactly
    /// once per run end.
    pub fn run_result(self) -> Option<RunResult> {
        match self {
            Reason::UpgradeCompleted => Some(RunResult::Completed),
            Reason::UpgradeFailed | Reason::InvalidTarget => Some(RunResult::Failed),
            Reason::UpgradeStarted
            | Reason::UpgradeResumed
            | Reason::UpgradeReset
            | Reason::UpgradeWaiting
            | Reason::UpgradeBlocked
            | Reason::InvalidOption
            | Reason::InvalidFlag
            | Reason::NodeUpgradeStarted
            | Reason::NodeUpgraded
            | Reason::NodeDrained
            | Reason::NodeRebootResent
            | Reason::NodeInstallRetried
            | Reason::NodeJoined
            | Reason::NodeLeft
            | Reason::StepStarted
            | Reason::NodeHeld
            | Reason::MaintenanceWindowOverridden
            | Reason::InstallerPulled
            | Reason::SilenceCreated
            | Reason::SilenceExpired
            | Reason::SilenceFailed
            | Reason::PlanComputed
            | Reason::PlanHopStarted
            | Reason::PlanHopFinished
            | Reason::PlanFinished
            | Reason::PlanRefused
            | Reason::PlanPreview
            | Reason::EtcdSnapshotTaken
            | Reason::RollbackStarted
            | Reason::NodeRollbackStarted
            | Reason::NodeRolledBack
            | Reason::RollbackCompleted
            | Reason::RollbackFailed
            | Reason::RollbackRefused => None,
        }
    }

    /// How a rollback ended or was refused, for the rollbacks-by-result metric: an Event with this
    /// reason is published once per rollback end (a refusal once per refused value).
    pub fn rollback_result(self) -> Option<RollbackResult> {
        match self {
            Reason::RollbackCompleted => Some(RollbackResult::Completed),
            Reason::RollbackFailed => Some(RollbackResult::Failed),
            Reason::RollbackRefused => Some(RollbackResult::Refused),
            _ => None,
        }
    }
}

/// How a rollback ended, as the rollbacks-by-result metric counts it (label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RollbackResult {
    Completed,
    Failed,
    Refused,
}

impl RollbackResult {
    pub const ALL: [RollbackResult; 3] = [
        RollbackResult::Completed,
        RollbackResult::Failed,
        RollbackResult::Refused,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RollbackResult::Completed => "completed",
            RollbackResult::Failed => "failed",
            RollbackResult::Refused => "refused",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a run ended, as the runs-by-result metric counts it (label `result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunResult {
    Completed,
    Failed,
}

impl RunResult {
    pub const ALL: [RunResult; 2] = [RunResult::Completed, RunResult::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            RunResult::Completed => "completed",
            RunResult::Failed => "failed",
        }
    }
}

/// A Kubernetes Event to publish on the KubernetesCluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub type_: NoteType,
    pub reason: Reason,
    pub message: String,
}

impl Note {
    pub fn normal(reason: Reason, message: String) -> Self {
        Note {
            type_: NoteType::Normal,
            reason,
            message,
        }
    }

    pub fn warning(reason: Reason, message: String) -> Self {
        Note {
            type_: NoteType::Warning,
            reason,
            message,
        }
    }
}

/// A check made before a node starts, by the name the preflight-failures metric counts it under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreflightCheck {
    /// The node is in the cluster's inventory.
    NodeInventory,
    /// The node's Talos API answers.
    TalosApi,
    /// Every other node is up, ready and Ready.
    NodesReady,
    /// etcd is healthy and keeps quorum with the node down.
    EtcdHealth,
    /// etcd leadership is off the node (not a failure: the controller moves it).
    EtcdLeader,
}

impl PreflightCheck {
    pub fn as_str(self) -> &'static str {
        match self {
            PreflightCheck::NodeInventory => "node-inventory",
            PreflightCheck::TalosApi => "talos-api",
            PreflightCheck::NodesReady => "nodes-ready",
            PreflightCheck::EtcdHealth => "etcd-health",
            PreflightCheck::EtcdLeader => "etcd-leader",
        }
    }

    /// Whether a hold on this check is a failed check (counted), rather than work in progress.
    pub fn is_failure(self) -> bool {
        !matches!(self, PreflightCheck::EtcdLeader)
    }
}

/// Where the run stands, for annotations, conditions and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunState {
    InProgress,
    /// In progress, but starting no new node because the user paused it.
    Paused,
    Completed,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub state: RunState,
    /// One sentence for `talos-message`.
    pub message: String,
    /// Nodes done and total, for `talos-progress`.
    pub done: usize,
    pub total: usize,
    /// Nodes upgrading right now.
    pub in_flight: Vec<String>,
    pub failed_nodes: Vec<String>,
    pub notes: Vec<Note>,
    /// The preflight check holding the next node, if one is.
    pub hold: Option<PreflightCheck>,
    /// The operator's gate holding the next node, if one is (see [`crate::holds`]).
    pub gate: Option<crate::holds::Hold>,
    /// One-shot annotations the decision took in, to remove (`force-start`).
    pub consumed: Vec<&'static str>,
    /// Every node in flight is only waiting to come back from its reboot (the legacy upgrade call was
    /// answered, or the Talos ≥ 1.13 reboot was sent), and no other node waits to start. Until one of
    /// those nodes changes, only a deadline can change the decision: the reconciler follows the nodes
    /// and need not poll often.
    pub awaiting_reboots: bool,
    /// What [`Report::awaiting_reboots`] becomes once every call of the decision is answered: the
    /// decision that sends a node its upgrade (or reboot) records it before the call, unanswered, and
    /// the pass that made the call concludes with this decision. Without it, that pass would look
    /// again a poll later, only to find the node still going down, which its followers tell anyway.
    pub awaiting_reboots_once_answered: bool,
}

/// `15m`, `90s`, `1h`: how a deadline reads in a message (both kinds of upgrade).
pub fn human_duration(duration: Duration) -> String {
    let secs = duration.as_secs();
    if secs >= 3600 && secs.is_multiple_of(3600) {
        format!("{}h", secs / 3600)
    } else if secs >= 60 && secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}
