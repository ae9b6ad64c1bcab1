//! The Talos OS upgrade as a kind of the shared lifecycle ([`crate::lifecycle`]): how its runs start,
//! what its observation holds, and what its answered calls mean.

use std::collections::BTreeSet;

use jiff::Timestamp;
use semver::Version;

use super::{
    Action, Decision, DrainStatus, EtcdObservation, FailedAttempt, InstallSource, LifecycleStage,
    NodeObservation, NodeStep, Observation, Run, Settings, TalosState, UpgradeApi, UpgradeOrder,
};
use crate::annotations::UpgradeKind;
use crate::catalog::{self, Catalog};
use crate::crd::condition::Reason as ConditionReason;
use crate::gates::Gates;
use crate::holds::GateSettings;
use crate::intent::{InvalidOption, Target, UpgradeIntent};
use crate::lifecycle::{Answered, Hold, Kind, Limits, Revisit, StartCheck};
use crate::run::{NodeRole, Note, Outcome, Reason, Record};
use crate::versions::{self, KubernetesVersion, TalosStep, TalosVersion};

/// The Talos OS upgrade.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Talos {}

/// What the versions of a cluster's nodes say, for `talos-current`, `talos-available` and the rules of
/// a run's start.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TalosVersions {
    /// Lowest and highest Talos version among the nodes that answered.
    pub range: Option<(TalosVersion, TalosVersion)>,
    /// The lowest kubelet among the cluster's Talos nodes: the Kubernetes a target must support.
    pub kubernetes: Option<KubernetesVersion>,
}

impl TalosVersions {
    /// From each node's Talos version (those that answered) and kubelet version (where known).
    pub fn of<'a>(
        talos: impl IntoIterator<Item = &'a Version>,
        kubelets: impl IntoIterator<Item = &'a KubernetesVersion>,
    ) -> TalosVersions {
        let talos: Vec<&Version> = talos.into_iter().collect();
        let range = talos
            .iter()
            .min()
            .zip(talos.iter().max())
            .map(|(low, high)| {
                (
                    TalosVersion::from_semver((*low).clone()),
                    TalosVersion::from_semver((*high).clone()),
                )
            });
        TalosVersions {
            range,
            kubernetes: kubelets.into_iter().min().cloned(),
        }
    }
}

/// The nodes whose installer image a look at the cluster reads (their machine config), in the same
/// round trip as their state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartingNodes {
    /// The nodes a run under way may start in this pass ([`super::may_start`]).
    Named(Vec<String>),
    /// A run about to start: every node, so that a node no installer can be chosen for fails the run
    /// before the first call to any node (see `advance`).
    Every,
    /// A pass that can start no node ([`super::only_in_flight_may_change`]): no installer image is
    /// read, and only these nodes (the run's in flight) are asked for their state, etcd not (a node
    /// waiting to come back from its reboot needs nothing of it); the look is of
    /// [`super::Scope::InFlight`].
    InFlight { nodes: Vec<String> },
}

impl StartingNodes {
    /// The names among `nodes` (name and role, as the inventory lists them).
    pub fn names(&self, nodes: &[(&str, NodeRole)]) -> Vec<String> {
        match self {
            StartingNodes::Named(names) => names.clone(),
            StartingNodes::Every => nodes.iter().map(|(name, _)| name.to_string()).collect(),
            StartingNodes::InFlight { .. } => Vec::new(),
        }
    }
}

/// Work within a pass, before the decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Further {
    /// The drain pass on the nodes the saved run is draining: cordon, evict what must leave, and
    /// report what is left. Only nodes whose record says they are draining are touched, so this
    /// happens strictly after the install was recorded.
    Drain(Vec<String>),
    /// Read the installer image (machine config) of these nodes, which the pass may start.
    InstallerImages(Vec<String>),
    /// Look at etcd again (leadership just moved).
    Etcd,
    /// Look at every node and etcd again, reading the installer images of these nodes (which the
    /// pass may start): a look at the nodes in flight only saw one of them back.
    Refresh(StartingNodes),
}

/// What a [`Further`] brought back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FurtherLooked {
    /// Per node, what the drain pass left (`None`: the pass failed, and is made again next time).
    Drained(Vec<(String, Option<DrainStatus>)>),
    /// Per node, how it was installed or why its config could not be read.
    InstallerImages(Vec<(String, Result<InstallSource, String>)>),
    Etcd(EtcdObservation),
    /// The look at everything ([`Further::Refresh`]), or why the cluster could not be looked at.
    Refreshed(Result<Observation, String>),
}

/// The rules a new run's start applies to what the nodes run: the one-step path from the lowest node,
/// no downgrade of the highest, and a target that supports the running Kubernetes (when it is known).
/// `Err` is the refusal's sentence. The acknowledgement of a new target judges the last look by the
/// same rules ([`crate::acknowledgement`]).
pub fn check_new_run(
    versions: &TalosVersions,
    target: &TalosVersion,
) -> Option<Result<TalosStep, String>> {
    let (lowest, highest) = versions.range.as_ref()?;
    Some(check_path(
        lowest,
        highest,
        versions.kubernetes.as_ref(),
        target,
    ))
}

fn check_path(
    lowest: &TalosVersion,
    highest: &TalosVersion,
    kubernetes: Option<&KubernetesVersion>,
    target: &TalosVersion,
) -> Result<TalosStep, String> {
    let step =
        versions::check_talos_upgrade_across(lowest, highest, target).map_err(|e| e.to_string())?;
    if let Some(running) = kubernetes {
        versions::check_talos_target_supports(target, running).map_err(|e| e.to_string())?;
    }
    Ok(step)
}

/// The nodes whose installer image a pass on `run` needs, as `observation` has them: those
/// [`super::may_start`] names, and the next ones with the nodes held now skipped (held since the
/// record was written) and those seen on the target already passed over (`start_next` counts them
/// done and starts the next).
fn starting<'r>(run: &'r Run, settings: &Settings, observation: &Observation) -> Vec<&'r str> {
    let on_target = on_target(run, observation);
    let mut starting = super::may_start(run, settings);
    let extra: Vec<&str> =
        super::next_to_start(run, settings, &observation.gates.held_nodes, on_target)
            .into_iter()
            .filter(|name| !starting.contains(name))
            .collect();
    starting.extend(extra);
    starting
}

/// Whether `observation` sees the node on the run's target already.
fn on_target<'a>(run: &Run, observation: &'a Observation) -> impl Fn(&str) -> bool + 'a {
    let target = Version::parse(&run.target).ok();
    move |name: &str| {
        observation.node(name).is_some_and(|n| match &n.talos {
            TalosState::Up { version, .. } => Some(version) == target.as_ref(),
            TalosState::Unreachable { .. } => false,
        })
    }
}

/// Whether `name` may start in this pass: next in the run's order, with the nodes held as the run
/// recorded them, as the gates see them now, or as if none were (not only pre-pulled: the pre-pull
/// reads every node's machine config but starts none).
fn next_in_line(run: &Run, settings: &Settings, observation: &Observation, name: &str) -> bool {
    let none = BTreeSet::new();
    [&none, &run.gates.held, &observation.gates.held_nodes]
        .into_iter()
        .any(|held| {
            super::next_in_order(run, settings, held, on_target(run, observation)).contains(&name)
        })
}

/// A node's state with how it was installed, as read: a node up whose config cannot be read cannot be
/// upgraded, so it counts as unreachable, with the reason.
pub fn with_installer_image(state: TalosState, read: Result<InstallSource, String>) -> TalosState {
    match (state, read) {
        (
            TalosState::Up {
                version,
                boot_id,
                ready,
                ..
            },
            Ok(install),
        ) => TalosState::Up {
            version,
            boot_id,
            ready,
            install: Some(install),
        },
        (TalosState::Up { .. }, Err(reason)) => TalosState::Unreachable { reason },
        (unreachable @ TalosState::Unreachable { .. }, _) => unreachable,
    }
}

impl Record for Run {
    fn requested(&self) -> &str {
        &self.requested
    }

    fn target(&self) -> &str {
        &self.target
    }

    fn started_at(&self) -> Timestamp {
        self.started_at
    }

    fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    fn touched(&self) -> bool {
        !self.nodes.is_empty()
    }

    fn counts(&self) -> (usize, usize) {
        Run::counts(self)
    }

    fn in_flight(&self) -> Vec<String> {
        Run::in_flight(self)
    }

    fn is_rollback(&self) -> bool {
        self.rollback.is_some()
    }

    fn refused(requested: &str, reason: &str, now: Timestamp) -> Self {
        Run {
            requested: requested.to_string(),
            target: String::new(),
            started_at: now,
            outcome: Some(Outcome::Failed {
                at: now,
                node: None,
                reason: reason.to_string(),
            }),
            gates: Default::default(),
            previous: Default::default(),
            rollback: None,
            nodes: Vec::new(),
        }
    }
}

impl Kind for Talos {
    const KIND: UpgradeKind = UpgradeKind::Talos;
    type Version = TalosVersion;
    type Run = Run;
    type Settings = Settings;
    type Observation = Observation;
    type Versions = TalosVersions;
    type Action = Action;
    type Request = StartingNodes;
    type Further = Further;
    type FurtherLooked = FurtherLooked;

    fn target(intent: &UpgradeIntent) -> &Target<TalosVersion> {
        &intent.talos_target
    }

    fn settings(intent: &UpgradeIntent, limits: &Limits) -> Result<Settings, InvalidOption> {
        let order = intent.order.clone()?;
        let parallel = intent.max_parallel_workers.clone()?;
        // The alert gate is the shell's to ask, but a value it cannot read must keep the run from
        // starting here, as every other invalid option does: the user meant some gate, not none.
        intent.alert_gate.clone()?;
        // So are the health checks: a check the user wrote must never pass for being unreadable.
        intent.health_checks.as_ref().map_err(Clone::clone)?;
        // So is a silence mode it cannot read: the user meant some silences, or none.
        intent.alert_silences.clone()?;
        // A snapshot asked for by name needs somewhere to go: without one the run does not start.
        let snapshot_mode = intent.etcd_snapshot.clone()?;
        let etcd_snapshot =
            crate::etcd_snapshot::wanted_for_talos(snapshot_mode, limits.etcd_snapshot).map_err(
                |reason| InvalidOption {
                    key: crate::annotations::ETCD_SNAPSHOT,
                    value: snapshot_mode.map_or("", |m| m.as_str()).to_string(),
                    reason,
                },
            )?;
        Ok(Settings {
            order,
            max_parallel_workers: parallel.get() as usize,
            paused: intent.paused,
            installer: intent.installer.clone()?,
            gates: GateSettings {
                maintenance_window: intent.maintenance_window.clone()?,
                force_start: intent.force_start,
                soak_after_node: intent.soak_after_node.clone()?,
                soak_after_control_planes: intent.soak_after_control_planes.clone()?,
                pause_after_nodes: intent.pause_after_nodes.clone()?,
                resume: intent.resume,
            },
            etcd_snapshot,
            ..Talos::stopping(limits)
        })
    }

    fn stopping(limits: &Limits) -> Settings {
        Settings {
            // Paused: only the node(s) in flight are followed, so the order plays no part.
            order: UpgradeOrder::default(),
            max_parallel_workers: 1,
            paused: true,
            node_deadline: limits.node_deadline,
            drain_timeout: limits.drain_timeout,
            unanswered_grace: limits.unanswered_grace,
            retry_after: limits.retry_after,
            installer: None,
            // Stopping starts no node: no gate is asked.
            gates: GateSettings::default(),
            etcd_snapshot: false,
        }
    }

    fn request(run: Option<&Run>, settings: &Settings) -> StartingNodes {
        // The machine configs (installer images) of the nodes this pass may start are read together
        // with every node's state, not one round trip after it: the run under way names them; a run
        // about to start reads every node's, so that one no installer can be chosen for fails the
        // run before any call (once per run: a run under way reads only those it may start).
        match run {
            // Nothing but the nodes in flight can change the decision until one is back: only they
            // are asked.
            Some(run) if super::only_in_flight_may_change(run, settings) => {
                StartingNodes::InFlight {
                    nodes: run.in_flight(),
                }
            }
            Some(run) => StartingNodes::Named(
                super::may_start(run, settings)
                    .into_iter()
                    .map(str::to_string)
                    .collect(),
            ),
            None => StartingNodes::Every,
        }
    }

    fn versions_of(observation: &Observation) -> TalosVersions {
        TalosVersions::of(
            observation.nodes.iter().filter_map(|n| match &n.talos {
                TalosState::Up { version, .. } => Some(version),
                TalosState::Unreachable { .. } => None,
            }),
            observation
                .nodes
                .iter()
                .filter_map(|n| n.kubelet_version.as_ref()),
        )
    }

    fn current(versions: &TalosVersions) -> Option<TalosVersion> {
        versions.range.as_ref().map(|(lowest, _)| lowest.clone())
    }

    fn available(versions: &TalosVersions, catalog: &Catalog) -> Option<Option<TalosVersion>> {
        let (lowest, highest) = versions.range.as_ref()?;
        let running: Vec<KubernetesVersion> = versions.kubernetes.iter().cloned().collect();
        Some(catalog::talos_available(catalog, lowest, highest, &running))
    }

    fn unknown(catalog: &Catalog, target: &TalosVersion) -> Option<String> {
        catalog.unknown("Talos", target, catalog.talos().cloned())
    }

    fn check_start(versions: &TalosVersions, target: &TalosVersion) -> StartCheck {
        match check_new_run(versions, target) {
            None => StartCheck::NoVersions,
            Some(Ok(_)) => StartCheck::Go,
            Some(Err(reason)) => StartCheck::Refused(reason),
        }
    }

    fn hold_start(_: &Observation, _: &TalosVersion, gates: &Gates) -> Option<Hold> {
        // Never both at once: a Kubernetes upgrade under way (static pods being patched, kubelets
        // restarting) finishes before any node reboots for Talos.
        let kubernetes = gates.kubernetes_running.as_ref()?;
        Some(Hold {
            status: crate::annotations::UpgradeStatus::InProgress,
            condition: ConditionReason::InProgress,
            message: format!(
                "Waiting: the Kubernetes upgrade to {kubernetes} is running; the Talos upgrade starts when it is done"
            ),
            reason: Reason::UpgradeWaiting,
            revisit: Revisit::Poll,
        })
    }

    fn start(
        requested: &str,
        target: &TalosVersion,
        settings: &Settings,
        observation: &Observation,
        now: Timestamp,
    ) -> Run {
        super::start_run(requested, target.semver(), settings.order, observation, now)
    }

    fn started(run: &Run, versions: &TalosVersions, target: &TalosVersion) -> String {
        let lowest = versions
            .range
            .as_ref()
            .map(|(lowest, _)| lowest.to_string())
            .unwrap_or_default();
        format!(
            "Upgrading Talos from {lowest} to {target} on {} nodes ({} already on {target})",
            run.nodes.len(),
            run.counts().0
        )
    }

    fn no_versions() -> &'static str {
        "Waiting: no node's Talos API answers yet"
    }

    fn resume(run: &mut Run, now: Timestamp) {
        // The failed node goes back to pending; everything done stays done. A node whose new system
        // is installed but not booted is drained and rebooted again, never installed a second time;
        // a drain cut short by the failure starts its timeout afresh.
        for node in &mut run.nodes {
            match &mut node.step {
                NodeStep::Failed {
                    installed: Some(pending),
                    ..
                } => {
                    let pending = pending.clone();
                    node.step = NodeStep::Issued {
                        at: now,
                        boot_id: pending.boot_id,
                        from_version: pending.from_version,
                        installer_image: pending.installer_image,
                        lifecycle: Some(LifecycleStage::Draining {
                            since: now,
                            uncordon: pending.uncordon,
                        }),
                        unanswered: false,
                        install_unconfirmed: false,
                    };
                }
                NodeStep::Failed { .. } => node.step = NodeStep::Pending,
                NodeStep::Issued {
                    lifecycle: Some(LifecycleStage::Draining { since, .. }),
                    ..
                } => *since = now,
                NodeStep::Pending | NodeStep::Issued { .. } | NodeStep::Done { .. } => {}
            }
        }
        // A pull that failed gets its attempts afresh; pulls done stay done.
        run.gates.prepull.resume();
        // A snapshot that failed is taken again; one taken stays (it is the state before the first
        // control plane, which is what it is for).
        if matches!(
            run.gates.etcd_snapshot,
            Some(crate::etcd_snapshot::Snapshot::Failed { .. })
        ) {
            run.gates.etcd_snapshot = None;
        }
        run.outcome = None;
    }

    fn remember(run: &Run, now: Timestamp) -> Option<Run> {
        // Nodes that may have a new system installed for their next reboot: left failed with one,
        // being drained or rebooted (the reboot may not have reached them), or mid-install.
        let nodes: Vec<super::NodeProgress> = run
            .nodes
            .iter()
            .filter_map(|node| {
                let installed = match &node.step {
                    NodeStep::Failed {
                        installed: Some(pending),
                        ..
                    } => pending.clone(),
                    NodeStep::Issued {
                        boot_id,
                        from_version,
                        installer_image,
                        lifecycle:
                            Some(
                                LifecycleStage::Installing { .. }
                                | LifecycleStage::Draining { .. }
                                | LifecycleStage::Rebooting { .. },
                            ),
                        ..
                    } => super::PendingInstall {
                        boot_id: boot_id.clone(),
                        from_version: from_version.clone(),
                        installer_image: installer_image.clone(),
                        uncordon: false,
                    },
                    _ => return None,
                };
                Some(super::NodeProgress {
                    name: node.name.clone(),
                    role: node.role,
                    step: NodeStep::Failed {
                        at: now,
                        reason: "was left with an install pending for its next reboot".into(),
                        installed: Some(installed),
                    },
                })
            })
            .collect();
        (!nodes.is_empty()).then(|| Run {
            // Matches no target: it only keeps new runs from installing over these nodes.
            requested: String::new(),
            target: run.target.clone(),
            started_at: run.started_at,
            outcome: Some(Outcome::Failed {
                at: now,
                node: None,
                reason: "kept after the run was dropped: nodes with an install pending".into(),
            }),
            gates: Default::default(),
            previous: Default::default(),
            rollback: None,
            nodes,
        })
    }

    fn left_pending(previous: &Run, observation: &Observation) -> Option<String> {
        previous.nodes.iter().find_map(|node| {
            let NodeStep::Failed {
                installed: Some(pending),
                ..
            } = &node.step
            else {
                return None;
            };
            // Rebooted since (a new boot): the pending system was booted, nothing is pending now.
            let observed = observation.node(&node.name)?;
            let TalosState::Up { boot_id, .. } = &observed.talos else {
                return None;
            };
            (*boot_id == pending.boot_id).then(|| {
                if previous.requested.is_empty() {
                    return format!(
                        "node {} may have Talos {} installed for its next reboot, left by a run \
                         that was reset or stopped; a new run would install over it: reboot the \
                         node first (it boots what is installed)",
                        node.name, previous.target
                    );
                }
                format!(
                    "node {} has Talos {} installed for its next reboot, left by the run to {}; a \
                     new run would install over it: reboot the node (it boots Talos {}), or set \
                     talos-target back to {} and resume",
                    node.name,
                    previous.target,
                    previous.requested,
                    previous.target,
                    previous.requested
                )
            })
        })
    }

    fn left_behind(run: &Run) -> Vec<String> {
        let target = &run.target;
        run.nodes
            .iter()
            .filter_map(|node| {
                let name = &node.name;
                let lifecycle = match &node.step {
                    NodeStep::Issued { lifecycle, .. } => lifecycle,
                    // Failed with its new system installed (a drain past its timeout, a refused
                    // reboot): left cordoned by the run, with the install pending.
                    NodeStep::Failed {
                        installed: Some(pending),
                        ..
                    } => {
                        let cordoned = if pending.uncordon {
                            "is left cordoned, with"
                        } else {
                            "has"
                        };
                        return Some(format!(
                            "Node {name} {cordoned} Talos {target} installed for its next reboot: \
                             reboot it to finish its upgrade, or uncordon it"
                        ));
                    }
                    NodeStep::Pending | NodeStep::Done { .. } | NodeStep::Failed { .. } => {
                        return None;
                    }
                };
                Some(match lifecycle {
                    Some(LifecycleStage::Pulling { .. } | LifecycleStage::Pulled) => return None,
                    None => format!(
                        "Node {name} had its upgrade call to Talos {target} and finishes it by itself"
                    ),
                    Some(LifecycleStage::Installing { .. }) => format!(
                        "Node {name} may have Talos {target} installed for its next reboot (its \
                         install was under way)"
                    ),
                    Some(LifecycleStage::Draining { uncordon: true, .. }) => format!(
                        "Node {name} is left cordoned, with Talos {target} installed for its next \
                         reboot: reboot it to finish its upgrade, or uncordon it"
                    ),
                    Some(LifecycleStage::Draining {
                        uncordon: false, ..
                    }) => format!(
                        "Node {name} has Talos {target} installed for its next reboot (it was \
                         cordoned before the run, and stays so)"
                    ),
                    Some(LifecycleStage::Rebooting { uncordon: true, .. }) => format!(
                        "Node {name} is left cordoned (it was rebooting into Talos {target}): \
                         uncordon it once it is back"
                    ),
                    Some(LifecycleStage::Rebooting {
                        uncordon: false, ..
                    }) => format!("Node {name} was rebooting into Talos {target}"),
                    Some(LifecycleStage::Failing { reason, .. }) => format!(
                        "Node {name} is left cordoned (its upgrade failed: it {reason}): uncordon it"
                    ),
                    Some(LifecycleStage::Uncordoning { .. }) => format!(
                        "Node {name} is left cordoned (it runs Talos {target}, and the run was \
                         uncordoning it): uncordon it"
                    ),
                })
            })
            .collect()
    }

    fn behind(run: &Run, versions: &TalosVersions) -> bool {
        // A rollback's nodes run below its target on purpose, and it takes in no node.
        if run.rollback.is_some() {
            return false;
        }
        let Ok(target) = Version::parse(&run.target) else {
            return false;
        };
        versions
            .range
            .as_ref()
            .is_some_and(|(lowest, _)| *lowest.semver() < target)
    }

    fn behind_hint() -> &'static str {
        "set resume to upgrade it again"
    }

    fn left_out(run: &Run) -> bool {
        !run.gates.skipped.is_empty()
    }

    const JOINS: bool = true;

    fn join(run: &mut Run, observation: &Observation, again: bool, _: Timestamp) -> Vec<Note> {
        let Ok(target) = Version::parse(&run.target) else {
            return Vec::new();
        };
        let mut notes = Vec::new();
        for node in &observation.nodes {
            let TalosState::Up { version, .. } = &node.talos else {
                continue;
            };
            // A held node is not taken in while it is held.
            if *version >= target || observation.gates.held_nodes.contains(&node.name) {
                continue;
            }
            match run.nodes.iter_mut().find(|n| n.name == node.name) {
                None if run.gates.skipped.remove(&node.name) => {
                    notes.push(Note::normal(
                        Reason::NodeJoined,
                        format!(
                            "Node {} is no longer held; upgrading it from Talos {version} to \
                             {target}",
                            node.name
                        ),
                    ));
                    run.nodes.push(super::NodeProgress {
                        name: node.name.clone(),
                        role: node.role,
                        step: NodeStep::Pending,
                    });
                }
                None => {
                    notes.push(Note::normal(
                        Reason::NodeJoined,
                        format!(
                            "Node {} joined on Talos {version}; upgrading it to {target}",
                            node.name
                        ),
                    ));
                    run.nodes.push(super::NodeProgress {
                        name: node.name.clone(),
                        role: node.role,
                        step: NodeStep::Pending,
                    });
                }
                Some(progress) if again && matches!(progress.step, NodeStep::Done { .. }) => {
                    notes.push(Note::normal(
                        Reason::UpgradeResumed,
                        format!(
                            "Node {} runs Talos {version} since the run completed; upgrading it \
                             to {target} again, as asked",
                            node.name
                        ),
                    ));
                    progress.step = NodeStep::Pending;
                }
                Some(_) => {}
            }
        }
        // Every node before those taken in is done, so they go next, whatever their role.
        if !notes.is_empty() {
            run.outcome = None;
        }
        notes
    }

    fn before_deciding(run: &Run, settings: &Settings, observation: &Observation) -> Vec<Further> {
        // A look at the nodes in flight only decides nothing but their waiting: once one of them is
        // back (the pass may then finish it, start the next node or finish the run), everything is
        // looked at again first, the machine configs of the nodes that may start included.
        if observation.scope == super::Scope::InFlight {
            return if super::in_flight_back(run, observation) {
                vec![Further::Refresh(StartingNodes::Named(
                    starting(run, settings, observation)
                        .into_iter()
                        .map(str::to_string)
                        .collect(),
                ))]
            } else {
                Vec::new()
            };
        }
        let mut further = Vec::new();
        let draining: Vec<String> = super::draining(run)
            .into_iter()
            .map(str::to_string)
            .collect();
        // The cluster's only node has nowhere to move its pods: it is not drained (see `advance`).
        if !draining.is_empty() && !super::only_node(observation) {
            further.push(Further::Drain(draining));
        }
        let starting = starting(run, settings, observation);
        // etcd is asked only where it may be needed: a look without it is followed by one at it
        // when a control plane may start (not merely pre-pull), one is in flight, or the run is a
        // rollback.
        let needs_etcd = run.outcome.is_none()
            && (run.rollback.is_some()
                || run.nodes.iter().any(|n| {
                    n.role == NodeRole::ControlPlane
                        && (matches!(n.step, NodeStep::Issued { .. })
                            || (!settings.paused
                                && next_in_line(run, settings, observation, &n.name)))
                }));
        // Those the look already read are not read again.
        let unread: Vec<String> = starting
            .into_iter()
            .filter(|name| {
                observation
                    .node(name)
                    .is_some_and(|n| matches!(n.talos, TalosState::Up { install: None, .. }))
            })
            .map(str::to_string)
            .collect();
        if !unread.is_empty() {
            further.push(Further::InstallerImages(unread));
        }
        if observation.scope == super::Scope::WithoutEtcd && needs_etcd {
            further.push(Further::Etcd);
        }
        further
    }

    fn merge(observation: &mut Observation, looked: FurtherLooked) {
        match looked {
            FurtherLooked::Drained(nodes) => {
                for (name, status) in nodes {
                    if let Some(node) = observation.node_mut(&name) {
                        node.drain = status;
                    }
                }
            }
            FurtherLooked::InstallerImages(nodes) => {
                for (name, read) in nodes {
                    if let Some(node) = observation.node_mut(&name) {
                        node.talos = with_installer_image(node.talos.clone(), read);
                    }
                }
            }
            FurtherLooked::Etcd(etcd) => {
                observation.etcd = etcd;
                if observation.scope == super::Scope::WithoutEtcd {
                    observation.scope = super::Scope::Everything;
                }
            }
            FurtherLooked::Refreshed(Ok(refreshed)) => *observation = refreshed,
            // Nothing is decided on what was not seen again: every node counts as unreachable, so
            // no node starts and none finishes in this pass.
            FurtherLooked::Refreshed(Err(reason)) => {
                for node in &mut observation.nodes {
                    node.talos = TalosState::Unreachable {
                        reason: reason.clone(),
                    };
                }
                observation.scope = super::Scope::Everything;
            }
        }
    }

    fn advance(
        run: &Run,
        settings: &Settings,
        observation: &Observation,
        now: Timestamp,
    ) -> Decision {
        let installer_image = |install: &InstallSource, target: &Version| {
            super::installer::installer_image(install, target, settings.installer.as_ref())
        };
        super::advance(run, settings, observation, &installer_image, now)
    }

    fn answered(
        run: &mut Run,
        action: &Action,
        observation: &Observation,
        now: Timestamp,
    ) -> Answered<Further> {
        match action {
            // etcd is looked at once more, and when that fresh look shows it healthy with another
            // leader, the control plane is upgraded in the same pass. (The fresh look is what the
            // upgrade needs: Talos's legacy upgrade checks every etcd member when it gets the call,
            // and an election still in progress would fail it.)
            Action::ForfeitEtcdLeadership { .. } => Answered::LookFurther(Further::Etcd),
            // The last pre-pull answered: the first node may start in the same pass.
            Action::PrePull { node, .. } => {
                run.gates.prepull.pulled(node, now);
                if run.gates.prepull.all_pulled() {
                    Answered::DecideAgain
                } else {
                    Answered::Nothing
                }
            }
            // Pulled: the install follows in the same pass, recorded (as sent) before it is made.
            Action::Pull { node, .. } => {
                super::pulled(run, node);
                Answered::DecideAgain
            }
            Action::Upgrade {
                node,
                api: UpgradeApi::Legacy,
                ..
            }
            | Action::Reboot { node }
            | Action::Rollback { node } => {
                super::answered(run, node);
                Answered::Nothing
            }
            Action::Upgrade {
                node,
                api: UpgradeApi::Lifecycle,
                ..
            } => {
                // Draining starts with the next pass; the saved run says so before anything else.
                let cordoned = observation.node(node).is_some_and(|n| n.cordoned);
                super::installed(run, node, cordoned, now);
                Answered::Nothing
            }
            Action::Uncordon { .. } => Answered::Nothing,
            // The shell answers a snapshot with where it is stored (`stored`); an answer without it
            // stored nothing, and the next pass takes it again.
            Action::EtcdSnapshot { .. } => Answered::Nothing,
        }
    }

    fn stored(
        run: &mut Run,
        action: &Action,
        stored: &crate::etcd_snapshot::Stored,
        observation: &Observation,
        now: Timestamp,
    ) -> Answered<Further> {
        match action {
            // Stored and verified: the first control plane may start in the same pass.
            Action::EtcdSnapshot { node } => {
                super::snapshot_stored(run, node, stored, now);
                Answered::DecideAgain
            }
            _ => Talos::answered(run, action, observation, now),
        }
    }

    fn not_reached(run: &mut Run, action: &Action) {
        // An install that never got to the node may be made again as it is; nothing else needs a
        // record (an unanswered upgrade call or reboot has its own rule).
        if let Action::Upgrade {
            node,
            api: UpgradeApi::Lifecycle,
            ..
        } = action
            && let Some(progress) = run.nodes.iter_mut().find(|n| n.name == *node)
            && let NodeStep::Issued {
                lifecycle: Some(LifecycleStage::Installing { retry, .. }),
                ..
            } = &mut progress.step
        {
            *retry = true;
        }
    }

    fn retry(run: &mut Run, action: &Action, reason: &str, now: Timestamp) -> bool {
        // A pre-pull gets a few attempts, then fails the run: it is there to find early a node that
        // cannot pull, not to wait for it.
        if let Action::PrePull { node, .. } = action {
            return run.gates.prepull.failed(node, reason, now);
        }
        // Only the Talos >= 1.13 pull and install are made again: neither changed what the node boots
        // (an install that failed never made its system the boot default). The legacy upgrade call
        // runs the whole upgrade on the node, which reports no exit code to classify.
        let Some(progress) = run.nodes.iter_mut().find(|n| n.name == action.node()) else {
            return false;
        };
        let NodeStep::Issued {
            lifecycle: Some(stage),
            ..
        } = &mut progress.step
        else {
            return false;
        };
        let attempt = |failed: &Option<FailedAttempt>| {
            Some(FailedAttempt {
                at: now,
                reason: reason.to_string(),
                failures: failed.as_ref().map_or(0, |f| f.failures) + 1,
            })
        };
        match (action, &*stage) {
            (Action::Pull { .. }, LifecycleStage::Pulling { failed }) => {
                *stage = LifecycleStage::Pulling {
                    failed: attempt(failed),
                };
                true
            }
            (
                Action::Upgrade {
                    api: UpgradeApi::Lifecycle,
                    ..
                },
                LifecycleStage::Installing { failed, .. },
            ) => {
                *stage = LifecycleStage::Installing {
                    retry: true,
                    failed: attempt(failed),
                };
                true
            }
            _ => false,
        }
    }

    fn refused(run: &mut Run, action: &Action, reason: &str, now: Timestamp) -> Vec<Action> {
        // No node of the run was touched by a snapshot: the run fails before the control planes.
        if let Action::EtcdSnapshot { node } = action {
            super::snapshot_failed(run, node, reason, now);
            return Vec::new();
        }
        if let Action::PrePull {
            node,
            installer_image,
            ..
        } = action
        {
            let failures = match run.gates.prepull.node(node).map(|n| &n.state) {
                Some(crate::prepull::PullState::Pulling {
                    failed: Some(failed),
                }) => failed.failures,
                _ => 1,
            };
            let reason = crate::prepull::failure(installer_image, reason, failures);
            return super::fail_node(run, node, &reason, now)
                .into_iter()
                .collect();
        }
        super::fail_node(run, action.node(), reason, now)
            .into_iter()
            .collect()
    }

    fn reports_before(actions: &[Action]) -> bool {
        // (A pull, too, can take minutes.)
        // An install (Talos ≥ 1.13 pulls and writes the new image first) can take minutes; moving etcd
        // leadership changes no node and takes a moment.
        actions.iter().any(|action| !Talos::looks_further(action))
    }

    fn looks_further(action: &Action) -> bool {
        matches!(action, Action::ForfeitEtcdLeadership { .. })
    }

    fn rollback_key() -> Option<&'static str> {
        Some(crate::annotations::TALOS_ROLLBACK)
    }

    fn rollback_asked(intent: &UpgradeIntent) -> Option<Result<(), String>> {
        intent
            .talos_rollback
            .as_ref()
            .map(|asked| asked.as_ref().map(|_| ()).map_err(ToString::to_string))
    }

    fn start_rollback(
        last: &Run,
        intent: &UpgradeIntent,
        settings: &Settings,
        observation: &Observation,
        now: Timestamp,
    ) -> Result<(Run, String), String> {
        let request = match &intent.talos_rollback {
            Some(Ok(request)) => request,
            Some(Err(invalid)) => return Err(invalid.to_string()),
            None => return Err("no rollback was asked for".to_string()),
        };
        let asked = match request {
            super::rollback::RollbackRequest::Failed => "failed".to_string(),
            super::rollback::RollbackRequest::Run => "run".to_string(),
            super::rollback::RollbackRequest::Nodes(names) => names.join(","),
        };
        super::rollback::start(last, request, &asked, settings.order, observation, now)
    }

    fn failed_reason(run: &Run) -> Reason {
        if run.rollback.is_some() {
            Reason::RollbackFailed
        } else {
            Reason::UpgradeFailed
        }
    }

    fn resume_starts_afresh(run: &Run) -> bool {
        run.rollback.is_some() && matches!(run.outcome, Some(Outcome::Completed { .. }))
    }

    fn finished_nodes(before: &Run, after: &Run) -> Vec<(NodeRole, f64)> {
        // Nodes rolled back are counted by their own metric, not as upgrades.
        if after.rollback.is_some() {
            return Vec::new();
        }
        after
            .nodes
            .iter()
            .filter_map(|node| match &node.step {
                NodeStep::Done {
                    at,
                    started_at: Some(started),
                } if matches!(
                    before.node(&node.name).map(|n| &n.step),
                    Some(NodeStep::Issued { .. })
                ) =>
                {
                    Some((node.role, at.duration_since(*started).as_secs_f64()))
                }
                _ => None,
            })
            .collect()
    }
}

impl Observation {
    pub(crate) fn node_mut(&mut self, name: &str) -> Option<&mut NodeObservation> {
        self.nodes.iter_mut().find(|n| n.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_about_to_start_reads_every_nodes_installer_a_run_under_way_those_it_may_start() {
        use NodeRole::{ControlPlane, Worker};
        let mixed = [
            ("cp-1", ControlPlane),
            ("w-1", Worker),
            ("cp-2", ControlPlane),
            ("w-2", Worker),
        ];
        type Nodes<'a> = &'a [(&'a str, NodeRole)];
        let cases: [(Nodes, StartingNodes, &[&str]); 3] = [
            (
                &mixed,
                StartingNodes::Every,
                &["cp-1", "w-1", "cp-2", "w-2"],
            ),
            (&[], StartingNodes::Every, &[]),
            (&mixed, StartingNodes::Named(vec!["cp-2".into()]), &["cp-2"]),
        ];
        for (nodes, starting, expected) in cases {
            assert_eq!(starting.names(nodes), expected, "{nodes:?}");
        }
    }

    #[test]
    fn a_node_up_whose_config_cannot_be_read_counts_as_unreachable() {
        let up = || TalosState::Up {
            version: Version::new(1, 11, 6),
            boot_id: "boot-1".into(),
            ready: true,
            install: None,
        };
        assert_eq!(
            with_installer_image(
                up(),
                Ok(InstallSource::new(
                    "ghcr.io/siderolabs/installer:v1.11.6",
                    Some("metal")
                ))
            ),
            TalosState::Up {
                version: Version::new(1, 11, 6),
                boot_id: "boot-1".into(),
                ready: true,
                install: Some(InstallSource::new(
                    "ghcr.io/siderolabs/installer:v1.11.6",
                    Some("metal")
                )),
            }
        );
        assert!(matches!(
            with_installer_image(up(), Err("connection refused".into())),
            TalosState::Unreachable { reason } if reason.contains("connection refused")
        ));
        let down = TalosState::Unreachable {
            reason: "node cp-1 is rebooting".into(),
        };
        assert_eq!(
            with_installer_image(down.clone(), Err("connection refused".into())),
            down
        );
    }

    #[test]
    fn the_versions_are_the_lowest_and_highest_talos_and_the_lowest_kubelet() {
        let talos = [Version::new(1, 11, 6), Version::new(1, 12, 0)];
        let kubelets = [
            KubernetesVersion::new(1, 34, 2),
            KubernetesVersion::new(1, 34, 1),
        ];
        let versions = TalosVersions::of(&talos, &kubelets);
        assert_eq!(
            versions.range,
            Some((TalosVersion::new(1, 11, 6), TalosVersion::new(1, 12, 0)))
        );
        assert_eq!(versions.kubernetes, Some(KubernetesVersion::new(1, 34, 1)));
        assert_eq!(TalosVersions::of(&[], &[]), TalosVersions::default());
    }
}
