//! The Talos OS rolling upgrade as a pure decision: given the persisted run, what the nodes look like
//! now and the time, which node to take next (if any), what to call, and what to tell the user.
//!
//! No IO and no clock here: the reconciler observes, calls [`advance`], persists the returned run
//! *before* executing the returned actions (write-ahead), then executes them. Everything that makes an
//! upgrade safe is decided in this file and covered by its table-driven tests:
//! - nodes go in the order fixed at the start of the run: workers first (or control planes first), workers
//!   in batches of at most `max_parallel_workers`, control planes strictly one at a time;
//! - before a node starts, every other node is up and Ready, the node's Talos API answers, and for a
//!   control plane etcd is healthy and leadership has moved off it;
//! - an upgrade call is issued at most once per node and run; the node is done only when it rebooted (new
//!   boot id), runs the target, reports ready and its Kubernetes Node is Ready;
//! - a node that comes back on its old version (A/B fallback) or misses its deadline fails the run, which
//!   then touches no further node;
//! - on Talos ≥ 1.13 the controller sequences install, cordon and drain (bounded by a timeout), reboot and
//!   uncordon itself; a node it cordoned stays in flight until it is uncordoned again.

pub mod installer;
mod kind;
mod record;
pub mod rollback;

use std::collections::BTreeSet;
use std::time::Duration;

use jiff::Timestamp;
use semver::Version;

pub use self::installer::{InstallSource, InstallerOverride};
pub use self::kind::{
    Further, FurtherLooked, StartingNodes, Talos, TalosVersions, check_new_run,
    with_installer_image,
};
pub use self::record::{
    FailedAttempt, LifecycleStage, NodeProgress, NodeStep, PendingInstall, Run,
};
use crate::holds::{self, Gate, GateObservation, GateSettings, Hold, RunProgress};
use crate::prepull;
pub use crate::run::UpgradeOrder;
use crate::run::{
    NodeRole, Note, Outcome, PreflightCheck, Reason, Report, RunState, human_duration,
};
use crate::versions::KubernetesVersion;

/// Knobs of one run, from the user's annotations and the controller's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub order: UpgradeOrder,
    /// Workers upgraded at once (at least 1); control planes always go one at a time.
    pub max_parallel_workers: usize,
    /// Finish the node(s) in flight, start no new one.
    pub paused: bool,
    /// How long a node may take from its upgrade call (or, on Talos ≥ 1.13, its reboot) to being done.
    pub node_deadline: Duration,
    /// How long draining a node (Talos ≥ 1.13) may take before the run fails.
    pub drain_timeout: Duration,
    /// How long a node whose upgrade call got no answer must be seen on its old boot, running and ready,
    /// before the call is taken as never received and made again.
    pub unanswered_grace: Duration,
    /// How long after a pull or install refused for a reason that may pass it is made again.
    pub retry_after: Duration,
    /// The installer named by the cluster's annotations for every node, if any (see [`installer`]).
    pub installer: Option<InstallerOverride>,
    /// The operator's gates before each node (see [`crate::holds`]).
    pub gates: GateSettings,
    /// Take an etcd snapshot before the first control plane ([`crate::etcd_snapshot`]).
    pub etcd_snapshot: bool,
}

/// What the controller sees of one node right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeObservation {
    pub name: String,
    pub role: NodeRole,
    pub talos: TalosState,
    /// The Kubernetes Node's `Ready` condition is `True`.
    pub kubernetes_ready: bool,
    /// The Kubernetes Node is unschedulable (`spec.unschedulable`).
    pub cordoned: bool,
    /// For a node the run is draining: what this pass's evictions left on it.
    pub drain: Option<DrainStatus>,
    /// The Kubernetes Node's `status.nodeInfo.kubeletVersion`, when it reports one.
    pub kubelet_version: Option<KubernetesVersion>,
}

/// The pods left on a node being drained, after this pass's evictions.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DrainStatus {
    /// Pods that still have to go (evicted ones still terminating included); DaemonSet and mirror pods
    /// never count.
    pub remaining: usize,
    /// Why an eviction was refused, naming the pod (a PodDisruptionBudget, usually).
    pub blocked: Option<String>,
}

/// The node's Talos API as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TalosState {
    Up {
        version: Version,
        boot_id: String,
        /// Machine stage `running` and every readiness check met.
        ready: bool,
        /// How the node was installed (its config's install image, its platform). Read only for the
        /// nodes the run may start now ([`may_start`]); `None` for the others.
        install: Option<InstallSource>,
    },
    /// Connection refused, reset, timed out: the node is down or rebooting.
    Unreachable { reason: String },
}

/// etcd as seen from the control planes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EtcdObservation {
    /// `None` when healthy: every member healthy, the member lists agree, and quorum holds with one member
    /// down. Otherwise why not, in one sentence.
    pub problem: Option<String>,
    /// Node name of the current leader, if known.
    pub leader: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observation {
    pub nodes: Vec<NodeObservation>,
    pub etcd: EtcdObservation,
    /// What the shell found for the gates that need IO, and the nodes held out of the run.
    pub gates: GateObservation,
    /// Which nodes' Talos state was asked for this look.
    pub scope: Scope,
}

/// Which nodes' Talos state a look asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Every node's, and etcd's: what any decision may be made on.
    #[default]
    Everything,
    /// Every node's, not etcd's: asked when no control plane may start (its `etcd` says so).
    /// A pass that turns out to need it (a control plane may start after all, one is in flight,
    /// a rollback) looks at etcd before it decides ([`Further::Etcd`]).
    WithoutEtcd,
    /// Only the nodes in flight (and etcd when a control plane is in flight); the other nodes and
    /// etcd as the last look saw them. Asked for by a pass that can start no node
    /// ([`only_in_flight_may_change`]); a node in flight seen back (done or failed) makes the pass
    /// look at everything again before it decides ([`Further::Refresh`]).
    InFlight,
}

impl Observation {
    fn node(&self, name: &str) -> Option<&NodeObservation> {
        self.nodes.iter().find(|n| n.name == name)
    }
}

/// Which Talos API generation upgrades a node, by the version it runs now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpgradeApi {
    /// `MachineService.Upgrade` (all Talos 1.x; the only one before 1.13).
    Legacy,
    /// `ImageService.Pull` + `LifecycleService.Upgrade`, cordon and drain, then `Reboot` (Talos ≥ 1.13).
    /// The upgrade action installs only; the reboot is its own action once the node is drained.
    Lifecycle,
}

impl UpgradeApi {
    pub fn for_running(version: &Version) -> Self {
        if *version >= Version::new(1, 13, 0) {
            UpgradeApi::Lifecycle
        } else {
            UpgradeApi::Legacy
        }
    }
}

/// A call the reconciler makes after persisting the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Move etcd leadership off a control plane before it is upgraded.
    ForfeitEtcdLeadership { node: String },
    /// Pull the installer image on a node before the run disrupts any node ([`crate::prepull`]): with
    /// [`UpgradeApi::Lifecycle`] into the containerd the install reads it from, with
    /// [`UpgradeApi::Legacy`] as a check that the node can pull it (see docs/upgrades.md, Pre-pull).
    /// Changes nothing the node boots; recorded before it is made.
    PrePull {
        node: String,
        installer_image: String,
        api: UpgradeApi,
    },
    /// Pull the installer image on a node (Talos ≥ 1.13), before its install.
    Pull {
        node: String,
        installer_image: String,
    },
    /// Upgrade a node; the run already records it as issued. With [`UpgradeApi::Lifecycle`] this
    /// installs the new system only (pulled first by [`Action::Pull`]): draining and
    /// [`Action::Reboot`] follow.
    Upgrade {
        node: String,
        installer_image: String,
        api: UpgradeApi,
    },
    /// Reboot a drained node into its newly installed system (Talos ≥ 1.13); recorded before it is sent.
    Reboot { node: String },
    /// Make a node the run cordoned schedulable again.
    Uncordon { node: String },
    /// Roll a node back to its previous system (`MachineService.Rollback`: the other A/B slot becomes
    /// the boot default and the node reboots); the rollback run already records it as issued.
    Rollback { node: String },
    /// Take an etcd snapshot from a control plane and store it ([`crate::etcd_snapshot`]), before the
    /// first control plane is upgraded; the run records it as being taken first. Changes nothing on
    /// the node.
    EtcdSnapshot { node: String },
}

impl Action {
    pub fn node(&self) -> &str {
        match self {
            Action::ForfeitEtcdLeadership { node }
            | Action::PrePull { node, .. }
            | Action::Pull { node, .. }
            | Action::Upgrade { node, .. }
            | Action::Reboot { node }
            | Action::Uncordon { node }
            | Action::Rollback { node }
            | Action::EtcdSnapshot { node } => node,
        }
    }
}

/// The decision of one pass (see [`crate::lifecycle::Decision`]).
pub type Decision = crate::lifecycle::Decision<Talos>;

/// Starts a run: fixes the node order and counts nodes already on the target as done.
pub fn start_run(
    requested: &str,
    target: &Version,
    order: UpgradeOrder,
    observation: &Observation,
    now: Timestamp,
) -> Run {
    let mut nodes: Vec<&NodeObservation> = observation.nodes.iter().collect();
    // Role first (in the chosen order), then name: a stable order the user can predict.
    nodes.sort_by_key(|n| (role_rank(n.role, order), n.name.clone()));
    let nodes = nodes
        .into_iter()
        .map(|n| NodeProgress {
            name: n.name.clone(),
            role: n.role,
            step: match &n.talos {
                TalosState::Up { version, .. } if version == target => NodeStep::Done {
                    at: now,
                    started_at: None,
                },
                _ => NodeStep::Pending,
            },
        })
        .collect();
    Run {
        requested: requested.to_string(),
        target: target.to_string(),
        started_at: now,
        outcome: None,
        gates: Default::default(),
        previous: Default::default(),
        rollback: None,
        nodes,
    }
}

/// Where a role comes in the order: 0 first, 1 second.
pub fn role_rank(role: NodeRole, order: UpgradeOrder) -> u8 {
    match (order, role) {
        (UpgradeOrder::WorkersFirst, NodeRole::Worker)
        | (UpgradeOrder::ControlPlanesFirst, NodeRole::ControlPlane) => 0,
        (UpgradeOrder::WorkersFirst, NodeRole::ControlPlane)
        | (UpgradeOrder::ControlPlanesFirst, NodeRole::Worker) => 1,
    }
}

/// Records that a call on `node` failed for good (the node refused the upgrade, the installer image is
/// bad): the run fails, naming the node. Returns the clean-up to do: uncordoning the node if the run had
/// cordoned it.
pub fn fail_node(run: &mut Run, node: &str, reason: &str, now: Timestamp) -> Option<Action> {
    let mut cleanup = None;
    let mut reason = reason.to_string();
    for progress in &mut run.nodes {
        if progress.name != node {
            continue;
        }
        let mut installed = None;
        if let NodeStep::Issued {
            lifecycle: Some(stage),
            ..
        } = &progress.step
        {
            installed = pending_install(&progress.step);
            if installed.is_none() && stage.must_uncordon() {
                cleanup = Some(Action::Uncordon {
                    node: node.to_string(),
                });
            }
        }
        if let Some(pending) = &installed {
            reason = format!("{reason}; {}", left_with_install(pending, &run.target));
        }
        progress.step = NodeStep::Failed {
            at: now,
            reason: reason.clone(),
            installed,
        };
    }
    // Other nodes in flight are finished first (see `advance`), which then fails the run.
    if run.in_flight().is_empty() {
        run.outcome = Some(Outcome::Failed {
            at: now,
            node: Some(node.to_string()),
            reason: failure_reason(run),
        });
    }
    cleanup
}

/// Every failed node of `run`, with why, in run order: what the run's failure says.
fn failure_reason(run: &Run) -> String {
    run.nodes
        .iter()
        .filter_map(|n| match &n.step {
            NodeStep::Failed { reason, .. } => Some(format!("node {} {reason}", n.name)),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether the cluster has a single node: nothing to drain onto.
fn only_node(observation: &Observation) -> bool {
    observation.nodes.len() == 1
}

/// The new system installed on a node in flight that has not rebooted into it: drained or being
/// drained, or its reboot recorded but refused (Talos ≥ 1.13).
fn pending_install(step: &NodeStep) -> Option<PendingInstall> {
    let NodeStep::Issued {
        boot_id,
        from_version,
        installer_image,
        lifecycle: Some(stage),
        ..
    } = step
    else {
        return None;
    };
    let uncordon = match stage {
        LifecycleStage::Draining { uncordon, .. } | LifecycleStage::Rebooting { uncordon, .. } => {
            *uncordon
        }
        LifecycleStage::Pulling { .. }
        | LifecycleStage::Pulled
        | LifecycleStage::Installing { .. }
        | LifecycleStage::Uncordoning { .. }
        | LifecycleStage::Failing { .. } => return None,
    };
    Some(PendingInstall {
        boot_id: boot_id.clone(),
        from_version: from_version.clone(),
        installer_image: installer_image.clone(),
        uncordon,
    })
}

/// What a node with a pending install is left as when its run stops, in words that stay true: the
/// new system boots at its next reboot, whatever causes it, so it is left cordoned (it takes no pods
/// that an unplanned reboot would drop), and the user chooses.
fn left_with_install(pending: &PendingInstall, target: &str) -> String {
    let from = &pending.from_version;
    format!(
        "it was not rebooted: it runs Talos {from}, and Talos {target} is installed and boots at its \
         next reboot. It is left cordoned: set resume to drain and reboot it, or uncordon it to keep it \
         on {from} until it reboots"
    )
}

/// Records that the installer is pulled on `node` (Talos ≥ 1.13): the install is next.
pub fn pulled(run: &mut Run, node: &str) {
    for progress in run.nodes.iter_mut().filter(|n| n.name == node) {
        if let NodeStep::Issued {
            lifecycle: lifecycle @ Some(LifecycleStage::Pulling { .. }),
            ..
        } = &mut progress.step
        {
            *lifecycle = Some(LifecycleStage::Pulled);
        }
    }
}

/// Records that the new system is installed on `node` (Talos ≥ 1.13): draining starts now.
/// `already_cordoned` says the node was unschedulable before the controller touched it, in which case it
/// is left cordoned afterwards, as it was found.
pub fn installed(run: &mut Run, node: &str, already_cordoned: bool, now: Timestamp) {
    for progress in &mut run.nodes {
        if progress.name == node
            && let NodeStep::Issued { lifecycle, .. } = &mut progress.step
            && matches!(lifecycle, Some(LifecycleStage::Installing { .. }))
        {
            *lifecycle = Some(LifecycleStage::Draining {
                since: now,
                uncordon: !already_cordoned,
            });
        }
    }
}

/// Records that the call just made to `node` was answered, so it is never made again: the legacy
/// upgrade call, or (Talos ≥ 1.13) the reboot.
pub fn answered(run: &mut Run, node: &str) {
    for progress in &mut run.nodes {
        if progress.name != node {
            continue;
        }
        if let NodeStep::Issued {
            unanswered,
            lifecycle,
            ..
        } = &mut progress.step
        {
            *unanswered = false;
            if let Some(LifecycleStage::Rebooting { unanswered, .. }) = lifecycle {
                *unanswered = false;
            }
        }
    }
}

/// Nodes the run is draining right now: the reconciler cordons them and evicts their pods, and reports
/// what is left in [`NodeObservation::drain`].
pub fn draining(run: &Run) -> Vec<&str> {
    run.nodes
        .iter()
        .filter(|n| {
            matches!(
                n.step,
                NodeStep::Issued {
                    lifecycle: Some(LifecycleStage::Draining { .. }),
                    ..
                }
            )
        })
        .map(|n| n.name.as_str())
        .collect()
}

/// Decides the next step of an unfinished or finished run.
pub fn advance(
    run: &Run,
    settings: &Settings,
    observation: &Observation,
    installer_image_for: &dyn Fn(&InstallSource, &Version) -> Result<String, String>,
    now: Timestamp,
) -> Decision {
    let mut decision = advance_run(run, settings, observation, installer_image_for, now);
    // `force-start` is one-shot: once the run keeps it, the annotation goes, whatever else the pass
    // decided.
    if settings.gates.force_start && decision.run.gates.force_started_at.is_some() {
        decision
            .report
            .consumed
            .push(crate::annotations::FORCE_START);
    }
    decision
}

fn advance_run(
    run: &Run,
    settings: &Settings,
    observation: &Observation,
    installer_image_for: &dyn Fn(&InstallSource, &Version) -> Result<String, String>,
    now: Timestamp,
) -> Decision {
    if let Some(rollback) = &run.rollback {
        return rollback::advance(run, rollback, settings, observation, now);
    }
    let mut run = run.clone();
    let mut notes = Vec::new();
    let Ok(target) = Version::parse(&run.target) else {
        // The run was created from a parsed version, so this is a corrupted record: fail rather than guess.
        let reason = format!("the recorded target {:?} is not a version", run.target);
        run.outcome.get_or_insert(Outcome::Failed {
            at: now,
            node: None,
            reason: reason.clone(),
        });
        return finish(run, Vec::new(), notes, None, true);
    };
    if run.outcome.is_some() {
        // Decided before: report it again, but announce nothing twice.
        return finish(run, Vec::new(), notes, None, false);
    }
    // The snapshot stored by the call just answered: announced once, with where it went.
    if let Some(crate::etcd_snapshot::Snapshot::Taken {
        node,
        stored,
        announced: announced @ false,
        ..
    }) = &mut run.gates.etcd_snapshot
    {
        notes.push(Note::normal(
            Reason::EtcdSnapshotTaken,
            crate::etcd_snapshot::taken_message(node, stored),
        ));
        *announced = true;
    }

    // 0. Nodes not started that left the cluster (gone from its node list): the run goes on without
    // them, rather than waiting for ever for a node that will not come back. A node that returns
    // later is taken in like one that joined (see `Kind::join`).
    if !observation.nodes.is_empty() {
        run.nodes.retain(|progress| {
            let gone = matches!(progress.step, NodeStep::Pending)
                && observation.node(&progress.name).is_none();
            if gone {
                notes.push(Note::normal(
                    Reason::NodeLeft,
                    format!(
                        "Node {} is no longer in the cluster's node list; the run goes on without it",
                        progress.name
                    ),
                ));
            }
            !gone
        });
    }

    // Held nodes (their Machine or Node annotated): skipped, announced once per node and run.
    let held = &observation.gates.held_nodes;
    for progress in &run.nodes {
        if matches!(progress.step, NodeStep::Pending)
            && held.contains(&progress.name)
            && !run.gates.held.contains(&progress.name)
        {
            notes.push(Note::normal(
                Reason::NodeHeld,
                format!(
                    "Node {} is held ({} is \"true\" on its Machine or Node): the run skips it",
                    progress.name,
                    crate::annotations::NODE_HOLD
                ),
            ));
        }
    }
    run.gates.held.extend(
        run.nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Pending) && held.contains(&n.name))
            .map(|n| n.name.clone()),
    );
    // `force-start`: kept by the run, which the windows then hold no more.
    if settings.gates.force_start && run.gates.force_started_at.is_none() {
        run.gates.force_started_at = Some(now);
        let windows = settings
            .gates
            .maintenance_window
            .as_ref()
            .map(|windows| format!(" ({windows})"))
            .unwrap_or_default();
        notes.push(Note::normal(
            Reason::MaintenanceWindowOverridden,
            format!(
                "force-start: the Talos upgrade to {} starts now and goes on outside the \
                 maintenance window{windows}",
                run.target
            ),
        ));
    }

    // 1. Nodes in flight: done, still going, or failed.
    let mut actions = Vec::new();
    let mut details = Vec::new();
    for progress in &mut run.nodes {
        let name = progress.name.clone();
        let NodeStep::Issued {
            at,
            boot_id,
            from_version,
            installer_image,
            lifecycle,
            unanswered,
            install_unconfirmed,
        } = &mut progress.step
        else {
            continue;
        };
        let observed = observation.node(&name);
        // A call without an answer, and the node still on the same boot, running and ready well after
        // it: the call never reached it (the controller stopped mid-call). A node that did get it would
        // be upgrading (not ready) or rebooted by now. It goes back to pending and is called again. Not
        // while paused (or following the nodes in flight after the target was removed): no new call
        // would be made then, so the node stays in flight until it is seen done or its deadline passes.
        if *unanswered
            && !settings.paused
            && now.duration_since(*at).unsigned_abs() > settings.unanswered_grace
            && untouched_since(observed, boot_id)
        {
            progress.step = NodeStep::Pending;
            continue;
        }
        // Where the deadline counts from, and whether the node must be uncordoned once back.
        let (since, uncordon) = match lifecycle {
            None => (*at, false),
            // Nothing installed yet, surely: the pull changes nothing the node boots, and an
            // install that reached nothing left it untouched. The pull is made again (found in a
            // later pass), the install follows a pull or is made again, each recorded before it is
            // sent; past the node deadline the node fails, untouched.
            Some(
                stage @ (LifecycleStage::Pulling { .. }
                | LifecycleStage::Pulled
                | LifecycleStage::Installing { retry: true, .. }),
            ) => {
                let failed = match stage {
                    LifecycleStage::Pulling { failed }
                    | LifecycleStage::Installing { failed, .. } => failed.clone(),
                    _ => None,
                };
                let deadline = *at + settings.node_deadline;
                if now > deadline {
                    let last = failed
                        .as_ref()
                        .map(|failed| format!(" (the last attempt: {})", failed.reason))
                        .unwrap_or_default();
                    progress.step = NodeStep::Failed {
                        at: now,
                        reason: format!(
                            "could not install Talos {target} within {}{last}; it was not \
                             rebooted and runs its old version",
                            human_duration(settings.node_deadline)
                        ),
                        installed: None,
                    };
                    continue;
                }
                if let Some(failed) = &failed {
                    details.push(format!(
                        "{name}'s {} failed ({}), tried {} time{}; trying again until {}",
                        if matches!(stage, LifecycleStage::Pulling { .. }) {
                            "installer pull"
                        } else {
                            "install"
                        },
                        failed.reason,
                        failed.failures,
                        if failed.failures == 1 { "" } else { "s" },
                        deadline.strftime("%H:%M:%S UTC"),
                    ));
                    // Not at once: what failed (a registry, the network) is given time to recover.
                    if now < failed.at + settings.retry_after {
                        continue;
                    }
                    notes.push(Note::warning(
                        Reason::NodeInstallRetried,
                        format!(
                            "Node {name}: {}; trying again (attempt {} of as many as fit in its \
                             deadline, {})",
                            failed.reason,
                            failed.failures + 1,
                            deadline.strftime("%H:%M:%S UTC"),
                        ),
                    ));
                }
                if matches!(stage, LifecycleStage::Pulling { .. }) {
                    actions.push(Action::Pull {
                        node: name,
                        installer_image: installer_image.clone(),
                    });
                } else {
                    *lifecycle = Some(LifecycleStage::Installing {
                        retry: false,
                        failed,
                    });
                    actions.push(Action::Upgrade {
                        node: name,
                        installer_image: installer_image.clone(),
                        api: UpgradeApi::Lifecycle,
                    });
                }
                continue;
            }
            Some(LifecycleStage::Installing { retry: false, .. }) => {
                // The install's answer was never recorded (the controller stopped during it, or it
                // got no answer): it may have happened. Installing again could flip the bootloader
                // back onto the running slot, so the node goes on as if installed: drained, then
                // rebooted. Back on its old version it fails rather than being upgraded twice.
                let cordoned = observed.is_some_and(|n| n.cordoned);
                *install_unconfirmed = true;
                *lifecycle = Some(LifecycleStage::Draining {
                    since: now,
                    uncordon: !cordoned,
                });
                details.push(format!(
                    "{name}'s install got no answer, so it is drained and rebooted rather than \
                     installed again"
                ));
                continue;
            }
            Some(LifecycleStage::Draining { since, uncordon }) => {
                let status = observed.and_then(|n| n.drain.as_ref());
                // The cluster's only node: no other node can take its pods, so evicting them would
                // only leave them Pending until it is back, and a PodDisruptionBudget would hold the
                // reboot until the drain timeout fails the run (tuppr#310). It is rebooted without
                // being cordoned or drained, and its pods restart with it, as they would under
                // `talosctl upgrade` on a single node. Its etcd (one member) has nothing to hold.
                if only_node(observation) {
                    notes.push(Note::normal(
                        Reason::NodeDrained,
                        format!(
                            "Node {name} is the cluster's only node: no other node can take its \
                             pods, so it is not drained; rebooting it into Talos {target}, and \
                             its pods restart with it"
                        ),
                    ));
                    *lifecycle = Some(LifecycleStage::Rebooting {
                        at: now,
                        uncordon: false,
                        unanswered: true,
                    });
                    actions.push(Action::Reboot { node: name });
                    continue;
                }
                match status {
                    // Drained, and a control plane: its reboot is what takes it down, so etcd
                    // must be healthy and leadership off it now, not only when its install began
                    // (another control plane may have gone down since). It holds, drained, until
                    // then; a drain that is done is not timed out.
                    Some(status)
                        if status.remaining == 0
                            && let Some((detail, action)) =
                                reboot_held(progress.role, &name, observation) =>
                    {
                        details.push(detail);
                        actions.extend(action);
                    }
                    Some(status) if status.remaining == 0 => {
                        notes.push(Note::normal(
                            Reason::NodeDrained,
                            format!("Node {name} is drained; rebooting it into Talos {target}"),
                        ));
                        *lifecycle = Some(LifecycleStage::Rebooting {
                            at: now,
                            uncordon: *uncordon,
                            unanswered: true,
                        });
                        actions.push(Action::Reboot { node: name });
                    }
                    _ if now.duration_since(*since).unsigned_abs() > settings.drain_timeout => {
                        let why = status
                            .and_then(|s| s.blocked.as_deref())
                            .map(|blocked| format!(": {blocked}"))
                            .unwrap_or_default();
                        // The new system is installed and boots at the next reboot, planned or not:
                        // the node stays cordoned, and the message says so.
                        let pending = PendingInstall {
                            boot_id: boot_id.clone(),
                            from_version: from_version.clone(),
                            installer_image: installer_image.clone(),
                            uncordon: *uncordon,
                        };
                        progress.step = NodeStep::Failed {
                            at: now,
                            reason: format!(
                                "could not be drained within {}{why}; {}",
                                human_duration(settings.drain_timeout),
                                left_with_install(&pending, &target.to_string())
                            ),
                            installed: Some(pending),
                        };
                    }
                    _ => {
                        let left = status.map_or(String::from("pods"), |s| {
                            format!("{} pod{} left", s.remaining, plural(s.remaining))
                        });
                        let why = status
                            .and_then(|s| s.blocked.as_deref())
                            .map(|blocked| format!("; {blocked}"))
                            .unwrap_or_default();
                        details.push(format!("draining {name}, {left}{why}"));
                    }
                }
                continue;
            }
            Some(LifecycleStage::Rebooting {
                at,
                uncordon,
                unanswered,
            }) => {
                // A reboot without an answer, and the node still on the same boot, running and ready
                // well after it: the reboot never reached it (the controller stopped between recording
                // and sending it, or the call failed on the way). A node that got it would be going down
                // or back on a new boot by now. The node is drained and waits for nothing else, so the
                // reboot is sent again, paused or not, and the deadline counts from then.
                if *unanswered
                    && now.duration_since(*at).unsigned_abs() > settings.unanswered_grace
                    && untouched_since(observed, boot_id)
                {
                    // The same gate as the first reboot: etcd may have changed since.
                    if let Some((detail, action)) = reboot_held(progress.role, &name, observation) {
                        details.push(detail);
                        actions.extend(action);
                        continue;
                    }
                    notes.push(Note::normal(
                        Reason::NodeRebootResent,
                        format!(
                            "Node {name} is still running its old system, ready, after its reboot \
                             got no answer; sending the reboot again"
                        ),
                    ));
                    *at = now;
                    actions.push(Action::Reboot { node: name });
                    continue;
                }
                (*at, *uncordon)
            }
            Some(LifecycleStage::Uncordoning { since }) => (*since, true),
            Some(LifecycleStage::Failing { reason, since }) => {
                // Failed, and cordoned by the run: uncordoned before the failure is recorded, so a
                // controller that stops in between uncordons it again rather than forgetting it.
                let cordoned = observed.is_some_and(|n| n.cordoned);
                if cordoned
                    && now.duration_since(*since).unsigned_abs() <= settings.unanswered_grace
                {
                    actions.push(Action::Uncordon { node: name.clone() });
                    details.push(format!("uncordoning {name} after its failure"));
                } else {
                    let mut reason = reason.clone();
                    if cordoned {
                        reason.push_str(
                            "; it is left cordoned: uncordoning it did not take, uncordon it",
                        );
                    }
                    progress.step = NodeStep::Failed {
                        at: now,
                        reason,
                        installed: None,
                    };
                }
                continue;
            }
        };
        // A node that fails, cordoned by the run, is uncordoned first (see `Failing`).
        let cordoned = observed.is_some_and(|n| n.cordoned);
        let fail = |lifecycle: &mut Option<LifecycleStage>, reason: String| {
            if uncordon && cordoned {
                *lifecycle = Some(LifecycleStage::Failing { reason, since: now });
                None
            } else {
                Some(NodeStep::Failed {
                    at: now,
                    reason,
                    installed: None,
                })
            }
        };
        match check_in_flight(observed, &target, boot_id, from_version) {
            InFlight::Done if uncordon && observed.is_some_and(|n| n.cordoned) => {
                // Back on the target and Ready: it only has to take pods again. An uncordon that
                // does not take (someone cordons it again, the API refuses) ends at the deadline,
                // counted from when the node was first seen back (not from its reboot: a controller
                // that was away meanwhile has not tried yet).
                actions.push(Action::Uncordon { node: name.clone() });
                let since = match lifecycle {
                    Some(LifecycleStage::Uncordoning { since }) => *since,
                    _ => {
                        *lifecycle = Some(LifecycleStage::Uncordoning { since: now });
                        now
                    }
                };
                if now.duration_since(since).unsigned_abs() > settings.node_deadline {
                    progress.step = NodeStep::Failed {
                        at: now,
                        reason: format!(
                            "runs Talos {target} but is still cordoned {} after it came back: \
                             uncordoning it did not take (is something else cordoning it?); \
                             uncordon it once it may take pods",
                            human_duration(settings.node_deadline)
                        ),
                        installed: None,
                    };
                } else {
                    details.push(format!("uncordoning {name}"));
                }
            }
            InFlight::Done => {
                let started = *at;
                notes.push(Note::normal(
                    Reason::NodeUpgraded,
                    format!("Node {name} is running Talos {target}"),
                ));
                progress.step = NodeStep::Done {
                    at: now,
                    started_at: Some(started),
                };
            }
            InFlight::Failed(_) if *install_unconfirmed => {
                // Back on its old version after an install whose answer was never recorded: either
                // the install did not take or the new system did not boot. Either way nothing is
                // pending now, and the node is not upgraded again unasked.
                let running = match observed.map(|n| &n.talos) {
                    Some(TalosState::Up { version, .. }) => version.to_string(),
                    _ => from_version.clone(),
                };
                let reason = format!(
                    "came back on Talos {running} instead of {target} after a reboot whose install \
                     got no answer: either the install did not take or the new system did not boot \
                     (A/B fallback); it was not upgraded again: set resume to install it again"
                );
                if let Some(step) = fail(lifecycle, reason) {
                    progress.step = step;
                } else {
                    actions.push(Action::Uncordon { node: name.clone() });
                }
            }
            InFlight::Failed(reason) => {
                if let Some(step) = fail(lifecycle, reason) {
                    progress.step = step;
                } else {
                    actions.push(Action::Uncordon { node: name.clone() });
                }
            }
            InFlight::Waiting(waiting_for) => {
                let elapsed = now.duration_since(since).unsigned_abs();
                if elapsed > settings.node_deadline {
                    let reason = match waiting_for {
                        Waiting::Down => format!(
                            "did not come back online within {}",
                            human_duration(settings.node_deadline)
                        ),
                        Waiting::NotRebooted => format!(
                            "did not reboot into the new version within {}",
                            human_duration(settings.node_deadline)
                        ),
                        Waiting::NotReady => format!(
                            "did not become Ready within {}",
                            human_duration(settings.node_deadline)
                        ),
                    };
                    if let Some(step) = fail(lifecycle, reason) {
                        progress.step = step;
                    } else {
                        actions.push(Action::Uncordon { node: name.clone() });
                    }
                }
            }
        }
    }
    // Every node not started whose install source was read (every node when the run starts) must have
    // an installer for the target: one that has none (an unserved platform, an empty install image)
    // fails the run before any call to any node, all such nodes named at once, rather than after the
    // nodes before it in the order were upgraded.
    if !settings.paused {
        let underivable: Vec<(String, String)> = run
            .nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Pending) && !held.contains(&n.name))
            .filter_map(|n| match observation.node(&n.name).map(|o| &o.talos) {
                Some(TalosState::Up {
                    version,
                    install: Some(install),
                    ..
                }) if *version != target => installer_image_for(install, &target)
                    .err()
                    .map(|reason| (n.name.clone(), reason)),
                _ => None,
            })
            .collect();
        for (name, reason) in underivable {
            fail_node(
                &mut run,
                &name,
                &format!("has an installer image the upgrade cannot be derived from: {reason}"),
                now,
            );
        }
    }
    // Failed nodes, and failed ones being uncordoned before they are recorded as failed.
    let failed: Vec<(String, String)> = run
        .nodes
        .iter()
        .filter_map(|n| match &n.step {
            NodeStep::Failed { reason, .. }
            | NodeStep::Issued {
                lifecycle: Some(LifecycleStage::Failing { reason, .. }),
                ..
            } => Some((n.name.clone(), reason.clone())),
            _ => None,
        })
        .collect();
    // A failure stops the run: no node starts after it. The nodes still in flight (their calls made)
    // are finished first, as after a removed target, so none is left half-upgraded, cordoned or
    // unfollowed; then the run fails, naming every node that failed.
    if let Some(first) = failed.first().cloned() {
        let in_flight = run.in_flight();
        if !in_flight.is_empty() {
            let mut decision = finish(run, actions, notes, None, false);
            decision.report.message = format!(
                "Stopping after a failure: node {} {}; finishing {} first ({}/{} done)",
                first.0,
                first.1,
                in_flight.join(", "),
                decision.report.done,
                decision.report.total
            );
            return decision;
        }
        let reason = failed
            .iter()
            .map(|(node, why)| format!("node {node} {why}"))
            .collect::<Vec<_>>()
            .join("; ");
        actions.retain(|action| matches!(action, Action::Uncordon { .. }));
        run.outcome = Some(Outcome::Failed {
            at: now,
            node: Some(first.0.clone()),
            reason,
        });
        return finish(run, actions, notes, None, true);
    }
    // Done, but for held nodes not started: they are left out of the run, which completes naming
    // them (a node later unheld is taken in like one that joined, see `Kind::join`).
    if run.nodes.iter().all(|n| match n.step {
        NodeStep::Done { .. } => true,
        NodeStep::Pending => held.contains(&n.name),
        NodeStep::Issued { .. } | NodeStep::Failed { .. } => false,
    }) {
        let skipped: Vec<String> = run
            .nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Pending))
            .map(|n| n.name.clone())
            .collect();
        run.nodes.retain(|n| !matches!(n.step, NodeStep::Pending));
        run.gates.skipped.extend(skipped);
        run.outcome = Some(Outcome::Completed { at: now });
        return finish(run, Vec::new(), notes, None, true);
    }

    // The canary: where a node would start, it begins once enough nodes were upgraded, and a pause
    // and unpause (or resume) releases it, also while paused.
    if run
        .nodes
        .iter()
        .any(|n| matches!(n.step, NodeStep::Pending) && !held.contains(&n.name))
    {
        run.gates.canary = holds::canary_step(
            &settings.gates,
            run.gates.canary,
            upgraded_by(&run),
            settings.paused,
            now,
        );
    }

    // 2. Start the next node(s), unless paused. The pre-pull comes first: no node starts (nothing is
    // cordoned, drained or rebooted) before the installer is pulled on every node the run upgrades.
    let mut waiting = None;
    if !settings.paused
        && let Some(message) = pre_pull(
            &mut run,
            settings,
            observation,
            installer_image_for,
            &target,
            now,
            &mut actions,
            &mut notes,
        )
    {
        waiting = Some(Held::PrePull(message));
    } else if !settings.paused {
        let pass = Pass {
            target: &target,
            settings,
            observation,
            installer_image_for,
            now,
        };
        waiting = pass.start_next(&mut run, &mut actions, &mut notes);
    }
    // A node whose installer image cannot be derived fails the run on the spot.
    let newly_finished = run.outcome.is_some();
    let mut decision = finish(run, actions, notes, waiting, newly_finished);
    if decision.report.state == RunState::InProgress && !details.is_empty() {
        decision.report.message = format!("{}: {}", decision.report.message, details.join("; "));
    }
    if settings.paused && !newly_finished {
        decision.report.state = RunState::Paused;
        decision.report.message = if decision.report.in_flight.is_empty() {
            format!(
                "Paused after {}/{} nodes; remove the paused annotation to continue",
                decision.report.done, decision.report.total
            )
        } else {
            format!(
                "Pausing: finishing {} before holding ({}/{} done)",
                decision.report.in_flight.join(", "),
                decision.report.done,
                decision.report.total
            )
        };
    }
    decision
}

/// Why a drained control plane's reboot waits, and the call that lets it go on: its reboot is what
/// takes it down, so etcd must be healthy and its leadership off it at that moment, not only when its
/// install began (another control plane may have gone down while it drained). `None` for workers.
fn reboot_held(
    role: NodeRole,
    name: &str,
    observation: &Observation,
) -> Option<(String, Option<Action>)> {
    if role != NodeRole::ControlPlane {
        return None;
    }
    if let Some(problem) = &observation.etcd.problem {
        return Some((
            format!("{name} is drained; holding its reboot: etcd is not healthy ({problem})"),
            None,
        ));
    }
    (observation.etcd.leader.as_deref() == Some(name)).then(|| {
        (
            format!("{name} is drained; moving etcd leadership off it before its reboot"),
            Some(Action::ForfeitEtcdLeadership {
                node: name.to_string(),
            }),
        )
    })
}

/// The node is up on the boot recorded before its call, running and ready: nothing the call would have
/// set off (an upgrade, a reboot) has happened to it.
fn untouched_since(observed: Option<&NodeObservation>, boot_id_before: &str) -> bool {
    observed.is_some_and(|n| {
        matches!(&n.talos, TalosState::Up { boot_id, ready: true, .. } if boot_id == boot_id_before)
    })
}

enum Waiting {
    Down,
    NotRebooted,
    NotReady,
}

enum InFlight {
    Done,
    Failed(String),
    Waiting(Waiting),
}

fn check_in_flight(
    observed: Option<&NodeObservation>,
    target: &Version,
    boot_id_before: &str,
    from_version: &str,
) -> InFlight {
    let Some(node) = observed else {
        return InFlight::Waiting(Waiting::Down);
    };
    match &node.talos {
        TalosState::Unreachable { .. } => InFlight::Waiting(Waiting::Down),
        TalosState::Up { boot_id, .. } if boot_id == boot_id_before => {
            InFlight::Waiting(Waiting::NotRebooted)
        }
        TalosState::Up { version, .. } if version != target => InFlight::Failed(format!(
            "came back on Talos {version} instead of {target} (the new system did not boot; A/B \
             fallback from {from_version}); it was not upgraded again"
        )),
        TalosState::Up { ready, .. } => {
            if *ready && node.kubernetes_ready {
                InFlight::Done
            } else {
                InFlight::Waiting(Waiting::NotReady)
            }
        }
    }
}

/// The nodes [`advance`] may start in this pass, whose installer image the observation must carry
/// (every other node's machine config is left unread, a Talos call saved per node and pass): the next
/// nodes in the run's order, as many as a batch of their role holds (`start_next` takes them in that
/// order), whether or not the batch has room now (a node in flight may finish in this very pass and
/// free it), with the nodes held as the run recorded them and as if none were (a node may be held or
/// unheld since the record was written); until the pre-pull is done, every pending node it has no
/// image recorded for; and a legacy call without an answer (it may be taken back and made again).
/// None while paused or once the run has an outcome.
pub fn may_start<'r>(run: &'r Run, settings: &Settings) -> Vec<&'r str> {
    let not_held = BTreeSet::new();
    let mut names = next_to_start(run, settings, &not_held, |_| false);
    for name in next_to_start(run, settings, &run.gates.held, |_| false) {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    // In the run's order, as the observation is asked.
    names.sort_by_key(|name| run.nodes.iter().position(|n| n.name == *name));
    names
}

/// The nodes `start_next` takes next with the nodes in `held` skipped: the first pending nodes of
/// the role that comes next, as many as a batch of that role holds, passing over those `on_target`
/// (`start_next` counts a node found on the target done and takes the one after it); the pre-pull's
/// nodes and a call without an answer as [`may_start`] has them.
pub fn next_to_start<'r>(
    run: &'r Run,
    settings: &Settings,
    held: &BTreeSet<String>,
    on_target: impl Fn(&str) -> bool,
) -> Vec<&'r str> {
    // A rollback installs nothing: no machine config to read.
    if settings.paused || run.outcome.is_some() || run.rollback.is_some() {
        return Vec::new();
    }
    let next = next_in_order(run, settings, held, on_target);
    // Until the pre-pull is done, every pending node it has no image recorded for (it pulls on all).
    let prepulling = |name: &str| {
        !run.gates.prepull.is_done()
            && !run.gates.held.contains(name)
            && run.gates.prepull.node(name).is_none()
    };
    run.nodes
        .iter()
        .filter(|n| match &n.step {
            NodeStep::Pending => next.contains(&n.name.as_str()) || prepulling(&n.name),
            NodeStep::Issued { unanswered, .. } => *unanswered,
            NodeStep::Done { .. } | NodeStep::Failed { .. } => false,
        })
        .map(|n| n.name.as_str())
        .collect()
}

/// The pending nodes `start_next` takes next with the nodes in `held` skipped and those `on_target`
/// passed over: the first of the role that comes next, as many as a batch of that role holds.
pub fn next_in_order<'r>(
    run: &'r Run,
    settings: &Settings,
    held: &BTreeSet<String>,
    on_target: impl Fn(&str) -> bool,
) -> Vec<&'r str> {
    let waiting = |n: &NodeProgress| matches!(n.step, NodeStep::Pending) && !held.contains(&n.name);
    let next_role = run.nodes.iter().find(|n| waiting(n)).map(|n| n.role);
    let capacity = match next_role {
        Some(NodeRole::Worker) => settings.max_parallel_workers.max(1),
        Some(NodeRole::ControlPlane) | None => 1,
    };
    run.nodes
        .iter()
        .filter(|n| waiting(n) && Some(n.role) == next_role && !on_target(&n.name))
        .take(capacity)
        .map(|n| n.name.as_str())
        .collect()
}

/// Whether nothing but the nodes in flight can change what a pass decides on `run`, until one of them
/// is back: every node in flight only waits to come back from its reboot (the state
/// [`Report::awaiting_reboots`] reports), the batch has no room for another node (or the run is
/// paused), and no node waiting to start is held (an unheld node could change the phase). Such a
/// pass looks only at the nodes in flight ([`Scope::InFlight`]); the nodes that are not in flight
/// are looked at again before any node starts or the run finishes.
pub fn only_in_flight_may_change(run: &Run, settings: &Settings) -> bool {
    if run.outcome.is_some() || run.rollback.is_some() {
        return false;
    }
    let in_flight: Vec<&NodeProgress> = run
        .nodes
        .iter()
        .filter(|n| matches!(n.step, NodeStep::Issued { .. }))
        .collect();
    let only_rebooting = in_flight.iter().all(|n| {
        matches!(
            &n.step,
            NodeStep::Issued {
                unanswered: false,
                lifecycle: None
                    | Some(LifecycleStage::Rebooting {
                        unanswered: false,
                        ..
                    }),
                ..
            }
        )
    });
    let held_waiting = run
        .nodes
        .iter()
        .any(|n| matches!(n.step, NodeStep::Pending) && run.gates.held.contains(&n.name));
    // The phase is the role of the first node not done, as `start_next` has it (no node waiting
    // is held, so none is skipped).
    let phase = run
        .nodes
        .iter()
        .find(|n| !matches!(n.step, NodeStep::Done { .. }))
        .map(|n| n.role);
    let capacity = match phase {
        Some(NodeRole::ControlPlane) | None => 1,
        Some(NodeRole::Worker) => settings.max_parallel_workers.max(1),
    };
    !in_flight.is_empty()
        && only_rebooting
        && !held_waiting
        && (settings.paused || in_flight.len() >= capacity)
}

/// Whether a node in flight, as `observation` sees it, is back (done, or failed on its old
/// version): what a look at the nodes in flight only must be followed by a look at everything for.
pub fn in_flight_back(run: &Run, observation: &Observation) -> bool {
    let Ok(target) = Version::parse(&run.target) else {
        return true;
    };
    run.nodes.iter().any(|progress| match &progress.step {
        NodeStep::Issued {
            boot_id,
            from_version,
            ..
        } => matches!(
            check_in_flight(
                observation.node(&progress.name),
                &target,
                boot_id,
                from_version
            ),
            InFlight::Done | InFlight::Failed(_)
        ),
        NodeStep::Pending | NodeStep::Done { .. } | NodeStep::Failed { .. } => false,
    })
}

/// Why the next node is not starting: a preflight check, one of the operator's gates, or the
/// pre-pull still going.
enum Held {
    /// The check and its sentence.
    Preflight(PreflightCheck, String),
    Gate(Hold),
    /// The status message of the pre-pull.
    PrePull(String),
    /// The etcd snapshot before the first control plane is being taken (the status message).
    Snapshot(String),
}

impl Held {
    fn message(&self) -> &str {
        match self {
            Held::Preflight(_, why) => why,
            Held::Gate(hold) => &hold.message,
            Held::PrePull(message) | Held::Snapshot(message) => message,
        }
    }
}

/// The pre-pull of this pass ([`crate::prepull`]) over the nodes the run will upgrade: pending, not
/// held, not on the target. Adds the pulls to make (recorded in the run first) and returns the status
/// message while it is not done.
#[allow(clippy::too_many_arguments)]
fn pre_pull(
    run: &mut Run,
    settings: &Settings,
    observation: &Observation,
    installer_image_for: &dyn Fn(&InstallSource, &Version) -> Result<String, String>,
    target: &Version,
    now: Timestamp,
    actions: &mut Vec<Action>,
    notes: &mut Vec<Note>,
) -> Option<String> {
    if run.gates.prepull.is_done() {
        return None;
    }
    let held = &observation.gates.held_nodes;
    let candidates: Vec<prepull::Candidate> = run
        .nodes
        .iter()
        .filter(|n| matches!(n.step, NodeStep::Pending) && !held.contains(&n.name))
        .filter_map(|n| {
            // (A node that left the node list is dropped from the run before this; one missing from
            // an empty look holds the pre-pull rather than count as pulled.)
            let Some(observed) = observation.node(&n.name) else {
                return Some(prepull::Candidate {
                    name: n.name.clone(),
                    seen: prepull::Seen::Missing,
                });
            };
            let seen = match &observed.talos {
                TalosState::Up { version, .. } if version == target => return None,
                TalosState::Up { install, .. } => prepull::Seen::Up {
                    image: install
                        .as_ref()
                        .and_then(|install| installer_image_for(install, target).ok()),
                },
                TalosState::Unreachable { reason } => prepull::Seen::Unreachable {
                    reason: reason.clone(),
                },
            };
            Some(prepull::Candidate {
                name: n.name.clone(),
                seen,
            })
        })
        .collect();
    let plan = prepull::decide(
        &mut run.gates.prepull,
        &candidates,
        settings.retry_after,
        now,
    );
    for pull in plan.pulls {
        let Some(TalosState::Up { version, .. }) = observation.node(&pull.node).map(|n| &n.talos)
        else {
            continue;
        };
        if let Some(failed) = &pull.after {
            notes.push(Note::warning(
                Reason::NodeInstallRetried,
                format!(
                    "Node {}: pulling {} failed ({}); trying again (attempt {} of {})",
                    pull.node,
                    pull.installer_image,
                    failed.reason,
                    failed.failures + 1,
                    prepull::ATTEMPTS
                ),
            ));
        }
        actions.push(Action::PrePull {
            node: pull.node,
            installer_image: pull.installer_image,
            api: UpgradeApi::for_running(version),
        });
    }
    if let Some(finished) = &plan.finished {
        notes.push(Note::normal(
            Reason::InstallerPulled,
            prepull::finished_message(finished, &run.target),
        ));
    }
    plan.message
}

/// What one decision starts nodes with.
struct Pass<'a> {
    target: &'a Version,
    settings: &'a Settings,
    observation: &'a Observation,
    installer_image_for: &'a dyn Fn(&InstallSource, &Version) -> Result<String, String>,
    now: Timestamp,
}

impl Pass<'_> {
    /// Starts as many next nodes as the order and batch size allow and their preflight checks pass. Returns
    /// why it is holding, if it is.
    fn start_next(
        &self,
        run: &mut Run,
        actions: &mut Vec<Action>,
        notes: &mut Vec<Note>,
    ) -> Option<Held> {
        let Pass {
            target,
            settings,
            observation,
            installer_image_for,
            now,
        } = *self;
        let held = &observation.gates.held_nodes;
        let skipped =
            |n: &NodeProgress| matches!(n.step, NodeStep::Pending) && held.contains(&n.name);
        // The current phase is the role of the first node that is not done (nor held, which the run
        // skips); later phases wait for it.
        let phase = run
            .nodes
            .iter()
            .find(|n| !matches!(n.step, NodeStep::Done { .. }) && !skipped(n))
            .map(|n| n.role)?;
        let in_flight = run.in_flight();
        let capacity = match phase {
            NodeRole::ControlPlane => 1,
            NodeRole::Worker => settings.max_parallel_workers.max(1),
        };
        let mut free = capacity.saturating_sub(in_flight.len());
        let candidates: Vec<usize> = run
            .nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.role == phase && matches!(n.step, NodeStep::Pending) && !skipped(n))
            .map(|(i, _)| i)
            .collect();
        // The operator's gates come before any node starts (the first one too), after the nodes in
        // flight were settled: a hold keeps the next node from starting, never stops one going.
        if free > 0 && !candidates.is_empty() {
            let progress = run_progress(run, phase);
            if let Some(hold) =
                holds::hold_before_next_node(&settings.gates, &observation.gates, &progress, now)
            {
                return Some(Held::Gate(hold));
            }
        }

        for index in candidates {
            if free == 0 {
                return None;
            }
            let name = run.nodes[index].name.clone();
            let Some(node) = observation.node(&name) else {
                return Some(Held::Preflight(
                    PreflightCheck::NodeInventory,
                    format!("node {name} is not in the cluster's node list"),
                ));
            };
            let (version, boot_id, install) = match &node.talos {
                TalosState::Up {
                    version,
                    boot_id,
                    install,
                    ..
                } => (version, boot_id, install.as_ref()),
                TalosState::Unreachable { reason } => {
                    return Some(Held::Preflight(
                        PreflightCheck::TalosApi,
                        format!("node {name}'s Talos API is unreachable: {reason}"),
                    ));
                }
            };
            // Upgraded by someone else meanwhile (or by a call whose answer was lost): it counts as done.
            if version == target {
                run.nodes[index].step = NodeStep::Done {
                    at: now,
                    started_at: None,
                };
                continue;
            }
            // A node that is not ready may be in the middle of an upgrade already (a call whose answer was
            // lost), or broken: it is not called until it is running and ready.
            if !matches!(node.talos, TalosState::Up { ready: true, .. }) {
                return Some(Held::Preflight(
                    PreflightCheck::NodesReady,
                    format!("node {name} is not ready; holding before upgrading it"),
                ));
            }
            if let Some(blocker) = observation.nodes.iter().find(|other| {
                other.name != name && !in_flight.contains(&other.name) && !is_healthy(other)
            }) {
                return Some(Held::Preflight(
                    PreflightCheck::NodesReady,
                    format!(
                        "node {} is not ready; holding before upgrading {name}",
                        blocker.name
                    ),
                ));
            }
            if node.role == NodeRole::ControlPlane {
                if let Some(problem) = &observation.etcd.problem {
                    return Some(Held::Preflight(
                        PreflightCheck::EtcdHealth,
                        format!(
                            "etcd is not healthy ({problem}); holding before control plane {name}"
                        ),
                    ));
                }
                if observation.etcd.leader.as_deref() == Some(name.as_str()) {
                    actions.push(Action::ForfeitEtcdLeadership { node: name.clone() });
                    return Some(Held::Preflight(
                        PreflightCheck::EtcdLeader,
                        format!("moving etcd leadership off {name} before upgrading it"),
                    ));
                }
            }
            // Read for every node `may_start` names; a node without it is held, not failed.
            let Some(install) = install else {
                return Some(Held::Preflight(
                    PreflightCheck::TalosApi,
                    format!(
                        "node {name}'s machine config was not read; holding before upgrading it"
                    ),
                ));
            };
            let image = match installer_image_for(install, target) {
                Ok(image) => image,
                Err(reason) => {
                    fail_node(
                        run,
                        &name,
                        &format!(
                            "has an installer image the upgrade cannot be derived from: {reason}"
                        ),
                        now,
                    );
                    return None;
                }
            };
            if node.role == NodeRole::ControlPlane
                && settings.etcd_snapshot
                && let Some(held) = snapshot_first(run, observation, &name, now, actions)
            {
                return Some(held);
            }
            let api = UpgradeApi::for_running(version);
            // Pulled by the pre-pull a moment ago: the install follows at once (see
            // `prepull::FRESH` for why a node whose pull is older pulls again).
            let pulled = run.gates.prepull.fresh(&name, &image, now);
            // What a rollback of this run takes the node back to.
            run.previous.insert(name.clone(), version.to_string());
            run.nodes[index].step = NodeStep::Issued {
                at: now,
                boot_id: boot_id.clone(),
                from_version: version.to_string(),
                installer_image: image.clone(),
                lifecycle: match api {
                    UpgradeApi::Legacy => None,
                    UpgradeApi::Lifecycle if pulled => Some(LifecycleStage::Installing {
                        retry: false,
                        failed: None,
                    }),
                    UpgradeApi::Lifecycle => Some(LifecycleStage::Pulling { failed: None }),
                },
                // Until its answer is recorded (see [`answered`]).
                unanswered: api == UpgradeApi::Legacy,
                install_unconfirmed: false,
            };
            notes.push(Note::normal(
                Reason::NodeUpgradeStarted,
                format!("Upgrading node {name} from Talos {version} to {target} with {image}"),
            ));
            actions.push(match api {
                UpgradeApi::Legacy => Action::Upgrade {
                    node: name.clone(),
                    installer_image: image,
                    api,
                },
                UpgradeApi::Lifecycle if pulled => Action::Upgrade {
                    node: name.clone(),
                    installer_image: image,
                    api,
                },
                UpgradeApi::Lifecycle => Action::Pull {
                    node: name.clone(),
                    installer_image: image,
                },
            });
            free -= 1;
        }
        None
    }
}

/// The etcd snapshot before the first control plane `first` starts ([`crate::etcd_snapshot`]):
/// nothing once it is taken; otherwise the call to make (recorded in the run first) and the hold
/// while it is made. Asked only when etcd is healthy. A call found recorded but unanswered is made
/// again: a snapshot changes nothing.
fn snapshot_first(
    run: &mut Run,
    observation: &Observation,
    first: &str,
    now: Timestamp,
    actions: &mut Vec<Action>,
) -> Option<Held> {
    use crate::etcd_snapshot::{self as snapshot, Next, Snapshot};
    let sources: Vec<snapshot::Source> = observation
        .nodes
        .iter()
        .filter(|n| n.role == NodeRole::ControlPlane && is_healthy(n))
        .map(|n| snapshot::Source {
            name: n.name.clone(),
            leader: observation.etcd.leader.as_deref() == Some(n.name.as_str()),
        })
        .collect();
    match snapshot::next(run.gates.etcd_snapshot.as_ref(), &sources, first) {
        Next::Done => None,
        Next::NoSource(message) => Some(Held::Preflight(PreflightCheck::EtcdHealth, message)),
        Next::Take { node, message } => {
            run.gates.etcd_snapshot = Some(Snapshot::Taking {
                node: node.clone(),
                at: now,
            });
            actions.push(Action::EtcdSnapshot { node });
            Some(Held::Snapshot(message))
        }
    }
}

/// Records the snapshot stored and verified.
pub(crate) fn snapshot_stored(
    run: &mut Run,
    node: &str,
    stored: &crate::etcd_snapshot::Stored,
    now: Timestamp,
) {
    run.gates.etcd_snapshot = Some(crate::etcd_snapshot::Snapshot::Taken {
        node: node.to_string(),
        at: now,
        stored: stored.clone(),
        announced: false,
    });
}

/// Records the snapshot failed: the run fails before any control plane, naming the node it was taken
/// from. No node of the run is marked failed (none was touched by it).
pub(crate) fn snapshot_failed(run: &mut Run, node: &str, reason: &str, now: Timestamp) {
    let (snapshot, outcome) = crate::etcd_snapshot::failed_records(node, reason, now);
    run.gates.etcd_snapshot = Some(snapshot);
    run.outcome = Some(outcome);
}

/// Nodes this run upgraded (not those found on the target).
fn upgraded_by(run: &Run) -> usize {
    run.nodes
        .iter()
        .filter(|n| {
            matches!(
                n.step,
                NodeStep::Done {
                    started_at: Some(_),
                    ..
                }
            )
        })
        .count()
}

/// What the gates read of `run`, whose next node is of role `phase`.
fn run_progress(run: &Run, phase: NodeRole) -> RunProgress {
    let (done, total) = run.counts();
    let upgraded_done = |n: &&NodeProgress| match n.step {
        NodeStep::Done {
            at,
            started_at: Some(_),
        } => Some(at),
        _ => None,
    };
    let last_done = run
        .nodes
        .iter()
        .filter_map(|n| upgraded_done(&n).map(|at| (n.name.clone(), at)))
        .max_by_key(|(_, at)| *at);
    // The control-plane phase is over, and this is the phase after it (control planes first): its
    // first node soaks after the last control plane.
    let control_planes_first = run
        .nodes
        .first()
        .is_some_and(|n| n.role == NodeRole::ControlPlane);
    let control_planes_done = (phase == NodeRole::Worker && control_planes_first)
        .then(|| {
            run.nodes
                .iter()
                .filter(|n| n.role == NodeRole::ControlPlane)
                .filter_map(|n| upgraded_done(&n))
                .max()
        })
        .flatten();
    RunProgress {
        done,
        total,
        upgraded: upgraded_by(run),
        last_done,
        control_planes_done,
        gates: run.gates.clone(),
    }
}

fn is_healthy(node: &NodeObservation) -> bool {
    matches!(node.talos, TalosState::Up { ready: true, .. }) && node.kubernetes_ready
}

/// Builds the report for `run` after a decision; `announce` adds the completion or failure event (only
/// when this decision ended the run, so a finished run is announced once).
fn finish(
    run: Run,
    actions: Vec<Action>,
    mut notes: Vec<Note>,
    waiting: Option<Held>,
    announce: bool,
) -> Decision {
    let (done, total) = run.counts();
    let in_flight = run.in_flight();
    let failed_nodes: Vec<String> = run.failed_nodes().into_iter().map(String::from).collect();
    let (state, message) = match &run.outcome {
        Some(Outcome::Completed { .. }) if !run.gates.skipped.is_empty() => {
            let skipped: Vec<&str> = run.gates.skipped.iter().map(String::as_str).collect();
            let skipped = skipped.join(", ");
            let held = format!(
                "held and not upgraded: {skipped} (remove {} to upgrade {})",
                crate::annotations::NODE_HOLD,
                if run.gates.skipped.len() == 1 {
                    "it"
                } else {
                    "them"
                }
            );
            if announce {
                notes.push(Note::normal(
                    Reason::UpgradeCompleted,
                    format!(
                        "Talos upgrade completed: {total} nodes run {}; {held}",
                        run.target
                    ),
                ));
            }
            (
                RunState::Completed,
                format!(
                    "Talos upgrade completed: now running {}; {held}",
                    run.target
                ),
            )
        }
        Some(Outcome::Completed { .. }) => {
            if announce {
                notes.push(Note::normal(
                    Reason::UpgradeCompleted,
                    format!(
                        "Talos upgrade completed: all {total} nodes run {}",
                        run.target
                    ),
                ));
            }
            (
                RunState::Completed,
                format!("Talos upgrade completed: now running {}", run.target),
            )
        }
        Some(Outcome::Failed { reason, .. }) => {
            let message = format!("Talos upgrade failed: {reason}");
            if announce {
                notes.push(Note::warning(Reason::UpgradeFailed, message.clone()));
            }
            (RunState::Failed, message)
        }
        None => {
            let message = match (in_flight.as_slice(), &waiting) {
                ([one], _) => format!("Upgrading node {one} ({}/{total})", done + 1),
                // The reconciler publishes an event when this message changes, not on every pass.
                ([], Some(Held::Gate(hold))) if hold.gate == Gate::Canary => {
                    format!("Paused by {} ({done}/{total} done)", hold.message)
                }
                ([], Some(Held::PrePull(message) | Held::Snapshot(message))) => message.clone(),
                ([], Some(held)) => format!("Waiting: {} ({done}/{total} done)", held.message()),
                ([], None) => format!("Upgrading ({done}/{total} done)"),
                (many, _) => format!("Upgrading nodes {} ({done}/{total} done)", many.join(", ")),
            };
            // The canary holds as a pause: a person looks, then lets it go on.
            let canary = in_flight.is_empty()
                && matches!(&waiting, Some(Held::Gate(hold)) if hold.gate == Gate::Canary);
            let state = if canary {
                RunState::Paused
            } else {
                RunState::InProgress
            };
            (state, message)
        }
    };
    let nothing_held = waiting.is_none();
    let (hold, gate) = match (&state, in_flight.is_empty(), waiting) {
        (RunState::InProgress, true, Some(Held::Preflight(check, _))) => (Some(check), None),
        (RunState::InProgress | RunState::Paused, true, Some(Held::Gate(hold))) => {
            (None, Some(hold))
        }
        _ => (None, None),
    };
    // Every node in flight only waits to come back from its reboot, counting the nodes in
    // `answering` as answered (their upgrade or reboot is what this decision sends).
    let only_rebooting = |answering: &[&str]| {
        state == RunState::InProgress
            && !in_flight.is_empty()
            && nothing_held
            && run.nodes.iter().all(|n| match &n.step {
                NodeStep::Issued {
                    lifecycle,
                    unanswered,
                    ..
                } => {
                    let answered = |unanswered: bool| !unanswered || answering.contains(&&*n.name);
                    answered(*unanswered)
                        && match lifecycle {
                            None => true,
                            Some(LifecycleStage::Rebooting { unanswered, .. }) => {
                                answered(*unanswered)
                            }
                            Some(_) => false,
                        }
                }
                NodeStep::Pending | NodeStep::Done { .. } | NodeStep::Failed { .. } => true,
            })
    };
    let rebooting_once_answered: Vec<&str> = actions
        .iter()
        .filter_map(|action| match action {
            Action::Upgrade {
                node,
                api: UpgradeApi::Legacy,
                ..
            }
            | Action::Reboot { node } => Some(node.as_str()),
            _ => None,
        })
        .collect();
    let awaiting_reboots = only_rebooting(&[]);
    let awaiting_reboots_once_answered = only_rebooting(&rebooting_once_answered);
    Decision {
        run,
        actions,
        report: Report {
            state,
            message,
            done,
            total,
            in_flight,
            failed_nodes,
            notes,
            hold,
            gate,
            consumed: Vec::new(),
            awaiting_reboots,
            awaiting_reboots_once_answered,
        },
    }
}

fn plural(count: usize) -> &'static str {
    if count == 1 { "" } else { "s" }
}

#[cfg(test)]
mod tests;
