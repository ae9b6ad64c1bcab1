//! The Kubernetes version upgrade as a pure decision: given the persisted run, what the nodes look like
//! now and the time, which step to take next (if any), what to call, and what to tell the user.
//!
//! The run follows `talosctl upgrade-k8s` (reference: talos-api.md §4), one step at a time, each verified
//! before the next:
//! 1. pre-pull the new images on every node (control planes, then workers);
//! 2. kube-apiserver, then kube-controller-manager, then kube-scheduler, each on one control plane after
//!    the other: patch the image in the node's machine config (no reboot) and wait for the re-rendered
//!    static pod to run the new image and be Ready;
//! 3. `cluster.proxy.image` on every control plane (they render the kube-proxy DaemonSet from it);
//! 4. the kubelet on every node (control planes, then workers), verified by the Node's kubeletVersion;
//! 5. the bootstrap manifests, synced from a control plane.
//!
//! With `etcd-snapshot: talos-and-kubernetes` an etcd snapshot is taken (from a healthy control
//! plane, through the Talos API) and verified before the first step that restarts something on a
//! control plane; one that fails stops the run there ([`crate::etcd_snapshot`]).
//!
//! No IO and no clock here, as in [`crate::talos`]: the reconciler observes, calls [`advance`], persists
//! the returned run *before* executing the returned actions (write-ahead), then executes them and records
//! the result of calls that have nothing to observe with [`complete_step`] / [`fail_step`]. Unlike a Talos
//! OS upgrade every call here is idempotent (the same image patched twice, images pulled twice, manifests
//! applied twice), so a step whose effect is not seen may be called again; what must never happen is a
//! step starting before the one before it is verified, or a restart while the cluster is unhealthy.
//!
//! Version rules (no minor skipped, Talos supports the target, …) are checked by the reconciler before a
//! run starts and are not checked again here.
//!
//! Wiring, per reconcile:
//! 1. no run for this `requested` value yet: [`start_run`] (with `from` = [`kubernetes_current`]);
//! 2. `decision = advance(run, settings, observation, now)`; persist `decision.run`;
//! 3. execute `decision.actions` (at most one) in order. A pull or a manifest sync that succeeded:
//!    [`complete_step`]`(run, decision.step, now)`; any call that failed for good (image not found, config
//!    refused): [`fail_step`], which ends the run, and announce `UpgradeFailed` yourself (as for
//!    [`crate::talos::fail_node`]). A transient error may simply be left: the next decision makes the call
//!    again until the step deadline. Persist again;
//! 4. publish `decision.report` (annotations, conditions, metrics, `notes` as Events).

mod image;
mod kind;
mod record;

use std::time::Duration;

use jiff::Timestamp;

pub use self::image::{ImageError, ImageField, desired_image, image_tag};
pub use self::kind::{Kubernetes, KubernetesVersions, WAITING_FOR_TALOS};
pub use self::record::{Component, KubeRun, Step, StepProgress, StepState};
use crate::run::{NodeRole, Note, NoteType, Outcome, Reason, Report, RunState, human_duration};

use crate::versions::{KubernetesVersion, TalosVersion};

/// Knobs of one run, from the user's annotations and the controller's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Finish the step in flight, start no new one.
    pub paused: bool,
    /// How long one step may take from its start to being verified.
    pub step_deadline: Duration,
    /// Take an etcd snapshot before the first step that restarts something on a control plane
    /// ([`crate::etcd_snapshot`]).
    pub etcd_snapshot: bool,
}

/// What a pass looks at besides the nodes ([`crate::lifecycle::Kind::request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Request {
    /// etcd's health and leader: only while the run's etcd snapshot is still to be taken, so a run
    /// that takes none makes no etcd calls.
    pub etcd: bool,
}

/// What the controller sees of the cluster right now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observation {
    pub nodes: Vec<NodeObservation>,
    /// etcd as the control planes report it; looked at only when [`Request::etcd`] asks (otherwise
    /// the default, which no decision reads).
    pub etcd: crate::talos::EtcdObservation,
}

impl Observation {
    pub fn node(&self, name: &str) -> Option<&NodeObservation> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The Talos version of every node whose Talos API answered.
    pub fn talos_versions(&self) -> impl Iterator<Item = &TalosVersion> {
        self.nodes.iter().filter_map(|node| match &node.talos {
            TalosApi::Up { version, .. } => Some(version),
            TalosApi::Unreachable { .. } => None,
        })
    }
}

/// What the controller sees of one node right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeObservation {
    /// The Kubernetes node name.
    pub name: String,
    pub role: NodeRole,
    pub talos: TalosApi,
    /// The images the node's machine config sets (read through its Talos API).
    pub images: ConfiguredImages,
    /// Per control-plane component, the `metadata.version` of the node's Talos config resource
    /// (`APIServerConfigs` / `ControllerManagerConfigs` / `SchedulerConfigs`): the value Talos writes in
    /// the static pod's `talos.dev/config-version` annotation when it renders the pod.
    pub config_versions: ConfigVersions,
    /// The node's mirror pods of the control-plane components in `kube-system` (none on workers).
    pub static_pods: Vec<StaticPod>,
    /// The Node's `status.nodeInfo.kubeletVersion`, if it reports one.
    pub kubelet_version: Option<KubernetesVersion>,
    /// The Kubernetes Node's `Ready` condition is `True`.
    pub kubernetes_ready: bool,
}

/// The node's Talos API as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TalosApi {
    Up {
        version: TalosVersion,
        /// Machine stage `running` and every readiness check met.
        ready: bool,
    },
    /// Connection refused, reset, timed out.
    Unreachable { reason: String },
}

/// Image fields of the node's machine config. Control-plane fields are `None` on workers.
///
/// `None` means the config leaves the field unset, so Talos runs its default image
/// ([`ImageField::default_repository`]); the upgrade then sets it explicitly, as talosctl does. It must
/// never mean "could not read": an observer that cannot read a node's config reports its Talos API as
/// unreachable instead, or the default repository would be patched in over a mirror. Read the config
/// Talos actually runs (the `v1alpha1` machine config, or the `APIServerConfig`/… and `KubeletSpec`
/// resources, which carry the effective image) so a patch shows up here as soon as Talos accepted it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfiguredImages {
    pub api_server: Option<String>,
    pub controller_manager: Option<String>,
    pub scheduler: Option<String>,
    pub proxy: Option<String>,
    pub kubelet: Option<String>,
}

impl ConfiguredImages {
    pub fn get(&self, field: ImageField) -> Option<&str> {
        match field {
            ImageField::ApiServer => self.api_server.as_deref(),
            ImageField::ControllerManager => self.controller_manager.as_deref(),
            ImageField::Scheduler => self.scheduler.as_deref(),
            ImageField::Proxy => self.proxy.as_deref(),
            ImageField::Kubelet => self.kubelet.as_deref(),
        }
    }
}

/// Config-resource versions per control-plane component (`None` when not seen).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigVersions {
    pub api_server: Option<String>,
    pub controller_manager: Option<String>,
    pub scheduler: Option<String>,
}

impl ConfigVersions {
    pub fn get(&self, component: Component) -> Option<&str> {
        match component {
            Component::KubeApiserver => self.api_server.as_deref(),
            Component::KubeControllerManager => self.controller_manager.as_deref(),
            Component::KubeScheduler => self.scheduler.as_deref(),
        }
    }
}

/// A control-plane mirror pod as the Kubernetes API shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticPod {
    pub component: Component,
    /// The image of the pod *spec* (exactly what Talos rendered), not the container status, which the
    /// runtime may normalise (`docker.io/library/…`) and would then never equal the desired image.
    pub image: String,
    /// The `talos.dev/config-version` annotation.
    pub config_version: Option<String>,
    /// The pod's `Ready` condition is `True`.
    pub ready: bool,
}

impl Component {
    /// The machine-config field that sets the component's image.
    pub fn image_field(self) -> ImageField {
        match self {
            Component::KubeApiserver => ImageField::ApiServer,
            Component::KubeControllerManager => ImageField::ControllerManager,
            Component::KubeScheduler => ImageField::Scheduler,
        }
    }
}

/// An image to pull on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImagePull {
    /// What the image is for; [`ImageField::pulls_into_system_namespace`] tells the containerd namespace.
    pub field: ImageField,
    pub image: String,
}

/// A call the reconciler makes after persisting the run. All are idempotent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Pull images on the node (Talos `ImagePull`; an `Unimplemented` answer counts as success, as in
    /// talosctl). Report the result with [`complete_step`] / [`fail_step`].
    PullImages {
        node: String,
        images: Vec<ImagePull>,
    },
    /// Set one image in the node's machine config, applied with mode `NO_REBOOT`. The result is observed
    /// (the configured image, the pods); call [`fail_step`] only when the node refuses the config.
    PatchImage {
        node: String,
        field: ImageField,
        image: String,
    },
    /// Apply the bootstrap manifests the node's Talos renders. Report the result with
    /// [`complete_step`] / [`fail_step`].
    SyncManifests { node: String },
    /// Take an etcd snapshot from the control plane and store it ([`crate::etcd_snapshot`]), before
    /// the first step that restarts something on a control plane. Report where it went with
    /// [`snapshot_stored`], a failure with [`snapshot_failed`].
    EtcdSnapshot { node: String },
}

impl Action {
    /// The node the call goes to.
    pub fn node(&self) -> &str {
        match self {
            Action::PullImages { node, .. }
            | Action::PatchImage { node, .. }
            | Action::SyncManifests { node }
            | Action::EtcdSnapshot { node } => node,
        }
    }
}

/// The decision of one pass (see [`crate::lifecycle::Decision`]); the step in flight, whose
/// [`complete_step`] / [`fail_step`] the calls' results go to, is [`KubeRun::step_in_flight`].
pub type Decision = crate::lifecycle::Decision<Kubernetes>;

/// The lowest and highest Kubernetes version running: every kubelet (the Node's kubeletVersion) and every
/// control-plane component (the tag of its static pod's image). Versions that do not parse are left out.
pub fn kubernetes_range(
    observation: &Observation,
) -> Option<(KubernetesVersion, KubernetesVersion)> {
    let versions: Vec<KubernetesVersion> = observation
        .nodes
        .iter()
        .flat_map(|node| {
            let pods = node
                .static_pods
                .iter()
                .filter_map(|pod| image_tag(&pod.image))
                .filter_map(|tag| KubernetesVersion::parse(tag).ok());
            node.kubelet_version.clone().into_iter().chain(pods)
        })
        .collect();
    let lowest = versions.iter().min()?.clone();
    let highest = versions.iter().max()?.clone();
    Some((lowest, highest))
}

/// The version `kubernetes-current` shows: the lowest running (see [`kubernetes_range`]).
pub fn kubernetes_current(observation: &Observation) -> Option<KubernetesVersion> {
    kubernetes_range(observation).map(|(lowest, _)| lowest)
}

/// Starts a run: fixes the steps in the order of `talosctl upgrade-k8s` (nodes by role, then name) and
/// counts steps already satisfied as done, so a cluster already on the target completes at once.
pub fn start_run(
    requested: &str,
    target: &KubernetesVersion,
    from: &KubernetesVersion,
    observation: &Observation,
    now: Timestamp,
) -> KubeRun {
    let mut nodes: Vec<&NodeObservation> = observation.nodes.iter().collect();
    nodes.sort_by_key(|n| (role_rank(n.role), n.name.clone()));
    let control_planes: Vec<&str> = nodes
        .iter()
        .filter(|n| n.role == NodeRole::ControlPlane)
        .map(|n| n.name.as_str())
        .collect();

    let mut steps: Vec<Step> = Vec::new();
    steps.extend(nodes.iter().map(|n| Step::PrePull {
        node: n.name.clone(),
    }));
    for component in Component::ALL {
        steps.extend(control_planes.iter().map(|n| Step::ControlPlane {
            component,
            node: n.to_string(),
        }));
    }
    steps.extend(control_planes.iter().map(|n| Step::KubeProxy {
        node: n.to_string(),
    }));
    steps.extend(nodes.iter().map(|n| Step::Kubelet {
        node: n.name.clone(),
    }));

    let mut steps: Vec<StepProgress> = steps
        .into_iter()
        .map(|step| {
            let satisfied = observation
                .node(step.node().unwrap_or_default())
                .is_some_and(|node| satisfied(&step, node, target));
            StepProgress {
                step,
                state: if satisfied {
                    StepState::Done {
                        at: now,
                        started_at: None,
                    }
                } else {
                    StepState::Pending
                },
            }
        })
        .collect();
    // The manifests follow from what the nodes run: nothing to sync when every node is already there.
    let all_there = steps.iter().all(|s| s.state.is_done());
    steps.push(StepProgress {
        step: Step::Manifests,
        state: if all_there {
            StepState::Done {
                at: now,
                started_at: None,
            }
        } else {
            StepState::Pending
        },
    });
    KubeRun {
        requested: requested.to_string(),
        target: target.to_string(),
        from: from.to_string(),
        started_at: now,
        outcome: None,
        steps,
        etcd_snapshot: None,
    }
}

fn role_rank(role: NodeRole) -> u8 {
    match role {
        NodeRole::ControlPlane => 0,
        NodeRole::Worker => 1,
    }
}

/// Records that the issued step at `index` succeeded: only for a pull or the manifest sync, the calls
/// with nothing to observe. Returns false, changing nothing, for any other step or one that is not
/// issued (already decided). The next [`advance`] starts the following step.
pub fn complete_step(run: &mut KubeRun, index: usize, now: Timestamp) -> bool {
    let Some(progress) = run.steps.get_mut(index) else {
        return false;
    };
    // A patch is done only when its effect is seen: a successful call proves nothing about the pods.
    match progress.step {
        Step::PrePull { .. } | Step::Manifests => {}
        Step::ControlPlane { .. } | Step::KubeProxy { .. } | Step::Kubelet { .. } => return false,
    }
    let StepState::Issued { at, .. } = progress.state else {
        return false;
    };
    progress.state = StepState::Done {
        at: now,
        started_at: Some(at),
    };
    true
}

/// Records that the step at `index` failed for good (a missing image, a refused config, a manifest that
/// does not apply): the run fails, naming the step. `reason` completes `… failed: <reason>`. Returns
/// false, changing nothing, when the run is finished or there is no such step.
pub fn fail_step(run: &mut KubeRun, index: usize, reason: &str, now: Timestamp) -> bool {
    if run.outcome.is_some() {
        return false;
    }
    let Some(progress) = run.steps.get_mut(index) else {
        return false;
    };
    progress.state = StepState::Failed {
        at: now,
        reason: reason.to_string(),
    };
    run.outcome = Some(Outcome::Failed {
        at: now,
        node: progress.step.node().map(String::from),
        reason: format!("{} failed: {reason}", progress.step.activity()),
    });
    true
}

/// Makes a failed run continue (the user set `resume`): failed steps go back to pending, everything done
/// stays done. Safe because every step is idempotent and re-verified. A snapshot that failed is taken
/// again; one taken stays (it is the state before the first control plane, which is what it is for).
/// Returns false for a run that did not fail.
pub fn resume(run: &mut KubeRun) -> bool {
    if !matches!(run.outcome, Some(Outcome::Failed { .. })) {
        return false;
    }
    for progress in &mut run.steps {
        if matches!(progress.state, StepState::Failed { .. }) {
            progress.state = StepState::Pending;
        }
    }
    if matches!(
        run.etcd_snapshot,
        Some(crate::etcd_snapshot::Snapshot::Failed { .. })
    ) {
        run.etcd_snapshot = None;
    }
    run.outcome = None;
    true
}

/// Records the run's etcd snapshot stored and verified: the step it held may start.
pub fn snapshot_stored(
    run: &mut KubeRun,
    node: &str,
    stored: &crate::etcd_snapshot::Stored,
    now: Timestamp,
) {
    run.etcd_snapshot = Some(crate::etcd_snapshot::Snapshot::Taken {
        node: node.to_string(),
        at: now,
        stored: stored.clone(),
        announced: false,
    });
}

/// Records the run's etcd snapshot failed or unverifiable: the run fails before any step that
/// restarts something on a control plane, naming the node it was taken from. No step is marked
/// failed (none was started by it). Returns false, changing nothing, for a finished run.
pub fn snapshot_failed(run: &mut KubeRun, node: &str, reason: &str, now: Timestamp) -> bool {
    if run.outcome.is_some() {
        return false;
    }
    let (snapshot, outcome) = crate::etcd_snapshot::failed_records(node, reason, now);
    run.etcd_snapshot = Some(snapshot);
    run.outcome = Some(outcome);
    true
}

/// Decides the next step of an unfinished or finished run.
pub fn advance(
    run: &KubeRun,
    settings: &Settings,
    observation: &Observation,
    now: Timestamp,
) -> Decision {
    let mut run = run.clone();
    if run.outcome.is_some() {
        // Decided before: report it again, but announce nothing twice.
        return finish(run, Vec::new(), Vec::new(), None, false, false);
    }
    let Ok(target) = KubernetesVersion::parse(&run.target) else {
        // The run was created from a parsed version, so this is a corrupted record: fail rather than guess.
        let reason = format!("the recorded target {:?} is not a version", run.target);
        run.outcome = Some(Outcome::Failed {
            at: now,
            node: None,
            reason,
        });
        return finish(run, Vec::new(), Vec::new(), None, true, false);
    };

    let mut notes = Vec::new();
    // The snapshot stored by the call just answered: announced once, with where it went.
    if let Some(crate::etcd_snapshot::Snapshot::Taken {
        node,
        stored,
        announced: announced @ false,
        ..
    }) = &mut run.etcd_snapshot
    {
        notes.push(Note::normal(
            Reason::EtcdSnapshotTaken,
            crate::etcd_snapshot::taken_message(node, stored),
        ));
        *announced = true;
    }
    // Steps not started on a node that left the cluster (gone from its node list): the run goes on
    // without them, rather than waiting for ever for a node that will not come back.
    if !observation.nodes.is_empty() {
        let mut gone = Vec::new();
        run.steps.retain(|progress| {
            let left = matches!(progress.state, StepState::Pending)
                && progress
                    .step
                    .node()
                    .is_some_and(|node| observation.node(node).is_none());
            if left
                && let Some(node) = progress.step.node()
                && !gone.contains(&node.to_string())
            {
                gone.push(node.to_string());
            }
            !left
        });
        for node in gone {
            notes.push(Note {
                type_: NoteType::Normal,
                reason: Reason::NodeLeft,
                message: format!(
                    "Node {node} is no longer in the cluster's node list; the run goes on without it"
                ),
            });
        }
    }
    let mut actions = Vec::new();
    let mut waiting = None;
    // Each pass settles the first step not done; a step that becomes done lets the next one go in the
    // same decision (no reconcile lost), anything else ends the decision.
    while let Some(index) = run.steps.iter().position(|s| !s.state.is_done()) {
        let step = run.steps[index].step.clone();
        match run.steps[index].state.clone() {
            // `position` above only yields steps that are not done.
            StepState::Done { .. } => break,
            StepState::Failed { reason, .. } => {
                // Only `fail_step` marks a step failed, and it ends the run; repair a record that lost
                // the outcome rather than retry behind the user's back.
                run.outcome = Some(Outcome::Failed {
                    at: now,
                    node: step.node().map(String::from),
                    reason: format!("{} failed: {reason}", step.activity()),
                });
                break;
            }
            StepState::Issued { at, image } => {
                match check_issued(&run, &step, image.as_deref(), observation, &target) {
                    Check::Verified => {
                        run.steps[index].state = StepState::Done {
                            at: now,
                            started_at: Some(at),
                        };
                        announce_node_done(&run, &step, &target, &mut notes);
                    }
                    Check::Waiting { missing, retry } => {
                        let elapsed = now.duration_since(at).unsigned_abs();
                        if elapsed > settings.step_deadline {
                            let reason = format!(
                                "{missing} within {}",
                                human_duration(settings.step_deadline)
                            );
                            run.steps[index].state = StepState::Failed {
                                at: now,
                                reason: reason.clone(),
                            };
                            run.outcome = Some(Outcome::Failed {
                                at: now,
                                node: step.node().map(String::from),
                                reason,
                            });
                        } else {
                            // The call may never have been made (the controller stopped between the
                            // write-ahead and the call) or failed on the way: make it again.
                            actions.extend(retry);
                        }
                        break;
                    }
                }
            }
            StepState::Pending => {
                if settings.paused {
                    break;
                }
                match start(&run, &step, observation, &target) {
                    Start::Satisfied => {
                        // Done by someone else (or an earlier run) meanwhile: nothing to do.
                        run.steps[index].state = StepState::Done {
                            at: now,
                            started_at: None,
                        };
                        announce_node_done(&run, &step, &target, &mut notes);
                    }
                    Start::Hold(why) => {
                        waiting = Some(Waiting::Nodes(why));
                        break;
                    }
                    Start::Refuse(reason) => {
                        run.steps[index].state = StepState::Failed {
                            at: now,
                            reason: reason.clone(),
                        };
                        run.outcome = Some(Outcome::Failed {
                            at: now,
                            node: step.node().map(String::from),
                            reason,
                        });
                        break;
                    }
                    Start::Go {
                        image,
                        actions: calls,
                    } => {
                        if settings.etcd_snapshot
                            && let Some(held) = snapshot_first(&mut run, &step, observation, now)
                        {
                            if let Waiting::Snapshot { call, .. } = &held {
                                actions.push(call.clone());
                            }
                            waiting = Some(held);
                            break;
                        }
                        if let Some(node) = step.node()
                            && !run
                                .steps
                                .iter()
                                .any(|s| s.step.node() == Some(node) && s.state.was_started())
                        {
                            notes.push(Note {
                                type_: NoteType::Normal,
                                reason: Reason::NodeUpgradeStarted,
                                message: format!(
                                    "Upgrading Kubernetes on node {node} from {} to {target}",
                                    run.from
                                ),
                            });
                        }
                        notes.push(Note {
                            type_: NoteType::Normal,
                            reason: Reason::StepStarted,
                            message: step_started(&step, image.as_deref(), &calls, &target),
                        });
                        run.steps[index].state = StepState::Issued { at: now, image };
                        actions = calls;
                        break;
                    }
                }
            }
        }
    }
    if run.outcome.is_none() && run.steps.iter().all(|s| s.state.is_done()) {
        run.outcome = Some(Outcome::Completed { at: now });
    }
    let newly_finished = run.outcome.is_some();
    if newly_finished {
        // Nothing more is called in a run that ends here.
        actions.clear();
    }
    finish(
        run,
        actions,
        notes,
        waiting,
        newly_finished,
        settings.paused,
    )
}

/// Announces a node whose steps are now all done, if work on it happened in this run.
fn announce_node_done(
    run: &KubeRun,
    step: &Step,
    target: &KubernetesVersion,
    notes: &mut Vec<Note>,
) {
    let Some(node) = step.node() else {
        return;
    };
    let mine = || run.steps.iter().filter(|s| s.step.node() == Some(node));
    if mine().all(|s| s.state.is_done()) && mine().any(|s| s.state.was_started()) {
        notes.push(Note {
            type_: NoteType::Normal,
            reason: Reason::NodeUpgraded,
            message: format!("Node {node} runs Kubernetes {target}"),
        });
    }
}

/// How an issued step stands.
enum Check {
    Verified,
    /// Not yet: `missing` says what was not seen (`kube-apiserver on node cp-1 did not become Ready on
    /// v1.35.0`); `retry` is the call to make again, if making it again can help.
    Waiting {
        missing: String,
        retry: Option<Action>,
    },
}

fn check_issued(
    run: &KubeRun,
    step: &Step,
    image: Option<&str>,
    observation: &Observation,
    target: &KubernetesVersion,
) -> Check {
    match step {
        // Nothing to observe: an issued call whose result was not recorded (the reconciler records it
        // right after the call) was lost, so it is made again.
        Step::PrePull { node } => Check::Waiting {
            missing: format!("pre-pulling images on node {node} did not finish"),
            retry: observation.node(node).and_then(|n| {
                let is_control_plane = run.control_planes().contains(&node.as_str());
                pulls(n, is_control_plane, target)
                    .ok()
                    .filter(|_| reachable(n))
                    .map(|images| Action::PullImages {
                        node: node.clone(),
                        images,
                    })
            }),
        },
        Step::Manifests => Check::Waiting {
            missing: "syncing the bootstrap manifests did not finish".to_string(),
            retry: manifest_node(run, observation).map(|node| Action::SyncManifests {
                node: node.to_string(),
            }),
        },
        Step::ControlPlane { node: name, .. }
        | Step::KubeProxy { node: name }
        | Step::Kubelet { node: name } => {
            let Some(node) = observation.node(name) else {
                return Check::Waiting {
                    missing: format!("node {name} was not seen in the cluster"),
                    retry: None,
                };
            };
            let desired = match (image, field_of(step)) {
                (Some(image), _) => image.to_string(),
                // A record without the image (written by an older controller): derive it again.
                (None, Some(field)) => match desired_image(field, node.images.get(field), target) {
                    Ok(image) => image,
                    Err(error) => {
                        return Check::Waiting {
                            missing: format!("node {name}: {error}"),
                            retry: None,
                        };
                    }
                },
                // Every patch step has a field; `check_patched` reports the impossible case.
                (None, None) => String::new(),
            };
            check_patched(step, node, &desired, target)
        }
    }
}

/// Whether a patch step's effect is fully there on `node` (see the module documentation).
fn check_patched(
    step: &Step,
    node: &NodeObservation,
    desired: &str,
    target: &KubernetesVersion,
) -> Check {
    let Some(field) = field_of(step) else {
        return Check::Waiting {
            missing: step.activity(),
            retry: None,
        };
    };
    let name = &node.name;
    if let TalosApi::Unreachable { .. } = node.talos {
        return Check::Waiting {
            missing: format!("node {name}'s Talos API did not answer"),
            retry: None,
        };
    }
    if node.images.get(field) != Some(desired) {
        return Check::Waiting {
            missing: format!("node {name}'s machine config did not take {field} image {desired}"),
            retry: Some(Action::PatchImage {
                node: name.clone(),
                field,
                image: desired.to_string(),
            }),
        };
    }
    let waiting = |missing: String| Check::Waiting {
        missing,
        retry: None,
    };
    match step {
        Step::ControlPlane { component, .. } => {
            let Some(pod) = node.static_pods.iter().find(|p| p.component == *component) else {
                return waiting(format!(
                    "{component} on node {name} did not show up as a static pod"
                ));
            };
            if pod.image != desired {
                return waiting(format!(
                    "{component} on node {name} was not restarted on {}",
                    target.tag()
                ));
            }
            // The pod must come from the latest config, not merely carry the image: a pod rendered
            // before a later config change would be replaced once more. Rendered from that version
            // or a later one counts, as talosctl 1.14.1 compares (`>=`, talos
            // `pkg/cluster/kubernetes/talos_managed.go`).
            let current = node.config_versions.get(*component);
            let rendered_from_latest = match (pod.config_version.as_deref(), current) {
                (Some(pod), Some(current)) => match (pod.parse::<u64>(), current.parse::<u64>()) {
                    (Ok(pod), Ok(current)) => pod >= current,
                    _ => pod == current,
                },
                _ => false,
            };
            if !rendered_from_latest {
                return waiting(format!(
                    "{component} on node {name} was not re-rendered from the latest machine config"
                ));
            }
            if !pod.ready {
                return waiting(format!(
                    "{component} on node {name} did not become Ready on {}",
                    target.tag()
                ));
            }
            Check::Verified
        }
        Step::Kubelet { .. } => {
            if node.kubelet_version.as_ref() != Some(target) {
                return waiting(format!(
                    "the kubelet on node {name} did not report {}",
                    target.tag()
                ));
            }
            if !node.kubernetes_ready {
                return waiting(format!(
                    "node {name} did not become Ready with kubelet {}",
                    target.tag()
                ));
            }
            Check::Verified
        }
        // talosctl does not wait for kube-proxy: the DaemonSet follows with the manifest sync.
        Step::KubeProxy { .. } => Check::Verified,
        // Not patch steps (`field_of` already turned them away): never verified here.
        Step::PrePull { .. } | Step::Manifests => waiting(step.activity()),
    }
}

/// The machine-config field a step patches.
fn field_of(step: &Step) -> Option<ImageField> {
    match step {
        Step::ControlPlane { component, .. } => Some(component.image_field()),
        Step::KubeProxy { .. } => Some(ImageField::Proxy),
        Step::Kubelet { .. } => Some(ImageField::Kubelet),
        Step::PrePull { .. } | Step::Manifests => None,
    }
}

/// The images a node pulls: a control plane the three component images and the kubelet, a worker the
/// kubelet (kube-proxy comes with its DaemonSet).
fn pulls(
    node: &NodeObservation,
    is_control_plane: bool,
    target: &KubernetesVersion,
) -> Result<Vec<ImagePull>, ImageError> {
    let fields: &[ImageField] = if is_control_plane {
        &[
            ImageField::ApiServer,
            ImageField::ControllerManager,
            ImageField::Scheduler,
            ImageField::Kubelet,
        ]
    } else {
        &[ImageField::Kubelet]
    };
    fields
        .iter()
        .map(|&field| {
            desired_image(field, node.images.get(field), target)
                .map(|image| ImagePull { field, image })
        })
        .collect()
}

fn reachable(node: &NodeObservation) -> bool {
    matches!(node.talos, TalosApi::Up { .. })
}

/// The control plane the manifests are synced from: the first one in run order whose Talos API answers
/// (talosctl uses the first control plane; any renders the same manifests).
fn manifest_node<'a>(run: &'a KubeRun, observation: &Observation) -> Option<&'a str> {
    run.control_planes()
        .into_iter()
        .find(|name| observation.node(name).is_some_and(reachable))
}

/// Nothing to pull when the node's config already names every new image: the node runs them.
fn already_configured(node: &NodeObservation, images: &[ImagePull]) -> bool {
    images
        .iter()
        .all(|pull| node.images.get(pull.field) == Some(pull.image.as_str()))
}

/// Whether a step's effect is already there on `node` when the run starts, so it needs no work.
fn satisfied(step: &Step, node: &NodeObservation, target: &KubernetesVersion) -> bool {
    match step {
        Step::PrePull { .. } => pulls(node, node.role == NodeRole::ControlPlane, target)
            .is_ok_and(|images| already_configured(node, &images)),
        Step::ControlPlane { .. } | Step::KubeProxy { .. } | Step::Kubelet { .. } => {
            let Some(field) = field_of(step) else {
                return false;
            };
            match desired_image(field, node.images.get(field), target) {
                Ok(desired) => {
                    matches!(check_patched(step, node, &desired, target), Check::Verified)
                }
                Err(_) => false,
            }
        }
        Step::Manifests => false,
    }
}

/// What starting a pending step comes to.
enum Start {
    Satisfied,
    /// Not now, for this reason (one sentence fragment naming the node).
    Hold(String),
    /// Cannot ever: the run fails for this reason.
    Refuse(String),
    /// Start it: record `image` and make these calls.
    Go {
        image: Option<String>,
        actions: Vec<Action>,
    },
}

fn start(
    run: &KubeRun,
    step: &Step,
    observation: &Observation,
    target: &KubernetesVersion,
) -> Start {
    let Some(name) = step.node() else {
        // The manifests: synced from a control plane whose API answers.
        return match manifest_node(run, observation) {
            Some(node) => Start::Go {
                image: None,
                actions: vec![Action::SyncManifests {
                    node: node.to_string(),
                }],
            },
            None => Start::Hold(
                "no control plane's Talos API answers to sync the bootstrap manifests from"
                    .to_string(),
            ),
        };
    };
    let Some(node) = observation.node(name) else {
        return Start::Hold(format!("node {name} is not in the cluster's node list"));
    };
    if let TalosApi::Unreachable { reason } = &node.talos {
        return Start::Hold(format!("node {name}'s Talos API is unreachable: {reason}"));
    }
    let is_control_plane = run.control_planes().contains(&name);
    let refuse =
        |error: ImageError| Start::Refuse(format!("node {name} cannot be upgraded: {error}"));
    if let Step::PrePull { .. } = step {
        let images = match pulls(node, is_control_plane, target) {
            Ok(images) => images,
            Err(error) => return refuse(error),
        };
        if already_configured(node, &images) {
            return Start::Satisfied;
        }
        return Start::Go {
            image: None,
            actions: vec![Action::PullImages {
                node: name.to_string(),
                images,
            }],
        };
    }
    let Some(field) = field_of(step) else {
        return Start::Hold(format!("{} has nothing to patch", step.activity()));
    };
    let desired = match desired_image(field, node.images.get(field), target) {
        Ok(desired) => desired,
        Err(error) => return refuse(error),
    };
    if matches!(check_patched(step, node, &desired, target), Check::Verified) {
        return Start::Satisfied;
    }
    if step.restarts_something()
        && let Some(why) = unhealthy(observation, field, name)
    {
        return Start::Hold(why);
    }
    // Never patch what is already configured: the config may have been applied while the pod is still
    // on its way; the step then only waits.
    let actions = if node.images.get(field) == Some(desired.as_str()) {
        Vec::new()
    } else {
        vec![Action::PatchImage {
            node: name.to_string(),
            field,
            image: desired.clone(),
        }]
    };
    Start::Go {
        image: Some(desired),
        actions,
    }
}

/// Why no step starts this pass although the run is not paused.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Waiting {
    /// A node not Ready, not reachable or missing (one sentence fragment naming it).
    Nodes(String),
    /// etcd not healthy, or no control plane to take the etcd snapshot from.
    Etcd(String),
    /// The etcd snapshot is being taken with `call` before the step (the status message).
    Snapshot { call: Action, message: String },
}

/// The etcd snapshot before `step`, when it is the first to restart something on a control plane
/// ([`crate::etcd_snapshot`]): nothing once it is taken (or for any other step); otherwise the call
/// to make (recorded in the run first, as every call) or why not yet. A call found recorded but
/// unanswered is made again: a snapshot changes nothing.
fn snapshot_first(
    run: &mut KubeRun,
    step: &Step,
    observation: &Observation,
    now: Timestamp,
) -> Option<Waiting> {
    use crate::etcd_snapshot::{self as snapshot, Next, Snapshot};
    let first = step.node()?;
    if !step.restarts_something()
        || !run.control_planes().contains(&first)
        || run.etcd_snapshot.as_ref().is_some_and(Snapshot::is_taken)
    {
        return None;
    }
    if let Some(problem) = &observation.etcd.problem {
        return Some(Waiting::Etcd(format!(
            "etcd is not healthy ({problem}); holding the etcd snapshot before control plane {first}"
        )));
    }
    let sources: Vec<snapshot::Source> = observation
        .nodes
        .iter()
        .filter(|n| {
            n.role == NodeRole::ControlPlane
                && matches!(n.talos, TalosApi::Up { ready: true, .. })
                && n.kubernetes_ready
        })
        .map(|n| snapshot::Source {
            name: n.name.clone(),
            leader: observation.etcd.leader.as_deref() == Some(n.name.as_str()),
        })
        .collect();
    let first = first.to_string();
    match snapshot::next(run.etcd_snapshot.as_ref(), &sources, &first) {
        Next::Done => None,
        Next::NoSource(message) => Some(Waiting::Etcd(message)),
        Next::Take { node, message } => {
            run.etcd_snapshot = Some(Snapshot::Taking {
                node: node.clone(),
                at: now,
            });
            Some(Waiting::Snapshot {
                call: Action::EtcdSnapshot { node },
                message,
            })
        }
    }
}

/// Why the cluster is not healthy enough to restart `field` on `node`: every node's Talos API answers
/// and is ready, and every Node is Ready.
fn unhealthy(observation: &Observation, field: ImageField, node: &str) -> Option<String> {
    observation.nodes.iter().find_map(|other| {
        let who = &other.name;
        match &other.talos {
            TalosApi::Unreachable { reason } => Some(format!(
                "node {who}'s Talos API is unreachable ({reason}); holding before upgrading {field} on {node}"
            )),
            TalosApi::Up { ready: false, .. } => Some(format!(
                "node {who}'s Talos is not ready; holding before upgrading {field} on {node}"
            )),
            TalosApi::Up { ready: true, .. } if !other.kubernetes_ready => Some(format!(
                "node {who} is not Ready; holding before upgrading {field} on {node}"
            )),
            TalosApi::Up { ready: true, .. } => None,
        }
    })
}

/// The `StepStarted` event: one sentence naming what, where and which version.
fn step_started(
    step: &Step,
    image: Option<&str>,
    actions: &[Action],
    target: &KubernetesVersion,
) -> String {
    let image = image.map(|i| format!(" ({i})")).unwrap_or_default();
    // A step whose image is already configured only waits for it to take effect.
    let already = if actions.is_empty() {
        ", already configured"
    } else {
        ""
    };
    match step {
        Step::PrePull { node } => {
            format!("Pre-pulling the Kubernetes {target} images on node {node}")
        }
        Step::ControlPlane { component, node } => {
            format!("Upgrading {component} on node {node} to {target}{image}{already}")
        }
        Step::KubeProxy { node } => {
            format!("Upgrading kube-proxy on node {node} to {target}{image}{already}")
        }
        Step::Kubelet { node } => {
            format!("Upgrading kubelet on node {node} to {target}{image}{already}")
        }
        Step::Manifests => {
            let from = actions
                .iter()
                .find_map(|a| match a {
                    Action::SyncManifests { node } => Some(format!(" from node {node}")),
                    Action::PullImages { .. }
                    | Action::PatchImage { .. }
                    | Action::EtcdSnapshot { .. } => None,
                })
                .unwrap_or_default();
            format!("Syncing the bootstrap manifests for Kubernetes {target}{from}")
        }
    }
}

/// What the run is doing while `step` is in flight, for the message.
fn doing(step: &Step, target: &str) -> String {
    match step {
        Step::PrePull { node } => {
            format!("Pre-pulling the Kubernetes {target} images on node {node}")
        }
        Step::ControlPlane { component, node } => format!("Upgrading {component} on node {node}"),
        Step::KubeProxy { node } => format!("Upgrading kube-proxy on node {node}"),
        Step::Kubelet { node } => format!("Upgrading kubelet on node {node}"),
        Step::Manifests => "Syncing the bootstrap manifests".to_string(),
    }
}

/// The step as a noun phrase: `the kube-apiserver upgrade on node cp-1`.
fn work(step: &Step) -> String {
    match step {
        Step::PrePull { node } => format!("the image pre-pull on node {node}"),
        Step::ControlPlane { component, node } => format!("the {component} upgrade on node {node}"),
        Step::KubeProxy { node } => format!("the kube-proxy upgrade on node {node}"),
        Step::Kubelet { node } => format!("the kubelet upgrade on node {node}"),
        Step::Manifests => "the bootstrap manifest sync".to_string(),
    }
}

/// Builds the report for `run` after a decision; `announce` adds the completion or failure event (only
/// when this decision ended the run, so a finished run is announced once).
fn finish(
    run: KubeRun,
    actions: Vec<Action>,
    mut notes: Vec<Note>,
    waiting: Option<Waiting>,
    announce: bool,
    paused: bool,
) -> Decision {
    let (done, total) = run.counts();
    let steps = run.steps.len();
    let in_flight_step = if run.outcome.is_none() {
        run.step_in_flight()
    } else {
        None
    };
    let in_flight: Vec<String> = in_flight_step
        .and_then(|i| run.steps[i].step.node())
        .map(String::from)
        .into_iter()
        .collect();
    let failed_nodes: Vec<String> = run.failed_nodes().into_iter().map(String::from).collect();
    let (state, message) = match &run.outcome {
        Some(Outcome::Completed { .. }) => {
            if announce {
                notes.push(Note {
                    type_: NoteType::Normal,
                    reason: Reason::UpgradeCompleted,
                    message: format!(
                        "Kubernetes upgrade completed: all {total} nodes run {}",
                        run.target
                    ),
                });
            }
            (
                RunState::Completed,
                format!("Kubernetes upgrade completed: now running {}", run.target),
            )
        }
        Some(Outcome::Failed { reason, .. }) => {
            let message = format!("Kubernetes upgrade failed: {reason}");
            if announce {
                notes.push(Note {
                    type_: NoteType::Warning,
                    reason: Reason::UpgradeFailed,
                    message: message.clone(),
                });
            }
            (RunState::Failed, message)
        }
        None => {
            let next = run
                .steps
                .iter()
                .position(|s| !s.state.is_done())
                .unwrap_or(steps);
            let position = format!("step {}/{steps}", next + 1);
            match (in_flight_step, paused, &waiting) {
                (Some(i), false, _) => (
                    RunState::InProgress,
                    format!("{} ({position})", doing(&run.steps[i].step, &run.target)),
                ),
                (Some(i), true, _) => (
                    RunState::Paused,
                    format!(
                        "Pausing: finishing {} before holding ({position})",
                        work(&run.steps[i].step)
                    ),
                ),
                (None, true, _) => (
                    RunState::Paused,
                    format!(
                        "Paused after {next}/{steps} steps; remove the paused annotation to continue"
                    ),
                ),
                // The reconciler publishes an event when this message changes, not on every pass.
                (None, false, Some(Waiting::Nodes(why) | Waiting::Etcd(why))) => {
                    (RunState::InProgress, format!("Waiting: {why} ({position})"))
                }
                (None, false, Some(Waiting::Snapshot { message, .. })) => {
                    (RunState::InProgress, format!("{message} ({position})"))
                }
                (None, false, None) => (RunState::InProgress, format!("Upgrading ({position})")),
            }
        }
    };
    // A hold before a step is a node not Ready, not reachable or missing, or etcd not healthy
    // enough for the snapshot; taking the snapshot is work, not a failed check.
    let hold = match &waiting {
        _ if state != RunState::InProgress || in_flight_step.is_some() => None,
        Some(Waiting::Nodes(_)) => Some(crate::run::PreflightCheck::NodesReady),
        Some(Waiting::Etcd(_)) => Some(crate::run::PreflightCheck::EtcdHealth),
        Some(Waiting::Snapshot { .. }) | None => None,
    };
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
            gate: None,
            consumed: Vec::new(),
            // The Kubernetes upgrade is not followed: it polls.
            awaiting_reboots: false,
            awaiting_reboots_once_answered: false,
        },
    }
}

#[cfg(test)]
mod tests;
