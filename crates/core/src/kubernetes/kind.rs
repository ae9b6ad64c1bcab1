//! The Kubernetes upgrade as a kind of the shared lifecycle ([`crate::lifecycle`]).

use jiff::Timestamp;

use super::{Action, Decision, KubeRun, Observation, Request, Settings, TalosApi};
use crate::annotations::{UpgradeKind, UpgradeStatus};
use crate::catalog::{self, Catalog};
use crate::crd::condition::Reason as ConditionReason;
use crate::gates::Gates;
use crate::intent::{InvalidOption, Target, UpgradeIntent};
use crate::lifecycle::{Answered, Hold, Kind, Limits, NoFurther, Revisit, StartCheck};
use crate::run::{NodeRole, Note, Outcome, Reason, Record};
use crate::versions::{self, KubernetesVersion, TalosVersion};

/// The Kubernetes upgrade (the steps of `talosctl upgrade-k8s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kubernetes {}

/// The protocol's sentence while a Talos upgrade is pending or running.
pub const WAITING_FOR_TALOS: &str = "Waiting for Talos upgrade to complete";

/// What the versions of a cluster say, for `kubernetes-current`, `kubernetes-available` and the rules
/// of a run's start.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KubernetesVersions {
    /// Lowest and highest Kubernetes version running: every kubelet and control-plane component.
    pub range: Option<(KubernetesVersion, KubernetesVersion)>,
    /// Every node's Talos version; `None` when a node's Talos cannot be read (it could be one that
    /// does not support the next release).
    pub talos: Option<Vec<TalosVersion>>,
}

impl KubernetesVersions {
    pub fn of(observation: &Observation) -> KubernetesVersions {
        let talos: Vec<TalosVersion> = observation.talos_versions().cloned().collect();
        KubernetesVersions {
            range: super::kubernetes_range(observation),
            talos: (talos.len() == observation.nodes.len()).then_some(talos),
        }
    }
}

/// Why the upgrade cannot start yet although the target is valid: a Talos upgrade to finish first, or
/// a node whose Talos does not support the target (the protocol's sentence, naming the lowest such
/// Talos).
fn blocked(observation: &Observation, target: &KubernetesVersion, gates: &Gates) -> Option<String> {
    if gates.talos_upgrading {
        return Some(WAITING_FOR_TALOS.to_string());
    }
    let mut talos: Vec<&TalosVersion> = Vec::new();
    for node in &observation.nodes {
        match &node.talos {
            TalosApi::Up { version, .. } => talos.push(version),
            TalosApi::Unreachable { reason } => {
                return Some(format!(
                    "Waiting: node {}'s Talos API is unreachable ({reason}), so its support for K8s \
                     {target} cannot be checked",
                    node.name
                ));
            }
        }
    }
    talos.sort();
    talos
        .into_iter()
        .find_map(|version| versions::check_kubernetes_target_supported(version, target).err())
        .map(|refusal| refusal.to_string())
}

impl Record for KubeRun {
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
        !self.steps.is_empty()
    }

    fn counts(&self) -> (usize, usize) {
        KubeRun::counts(self)
    }

    fn in_flight(&self) -> Vec<String> {
        self.step_in_flight()
            .and_then(|index| self.steps[index].step.node())
            .map(String::from)
            .into_iter()
            .collect()
    }

    fn refused(requested: &str, reason: &str, now: Timestamp) -> Self {
        KubeRun {
            requested: requested.to_string(),
            target: String::new(),
            from: String::new(),
            started_at: now,
            outcome: Some(Outcome::Failed {
                at: now,
                node: None,
                reason: reason.to_string(),
            }),
            steps: Vec::new(),
            etcd_snapshot: None,
        }
    }
}

impl Kind for Kubernetes {
    const KIND: UpgradeKind = UpgradeKind::Kubernetes;
    type Version = KubernetesVersion;
    type Run = KubeRun;
    type Settings = Settings;
    type Observation = Observation;
    type Versions = KubernetesVersions;
    type Action = Action;
    type Request = Request;
    type Further = NoFurther;
    type FurtherLooked = NoFurther;

    fn target(intent: &UpgradeIntent) -> &Target<KubernetesVersion> {
        &intent.kubernetes_target
    }

    fn settings(intent: &UpgradeIntent, limits: &Limits) -> Result<Settings, InvalidOption> {
        // A mode it cannot read keeps the run from starting, as for a Talos run: the user may have
        // meant a snapshot before this run too. One asked for by name needs somewhere to go.
        let snapshot_mode = intent.etcd_snapshot.clone()?;
        let etcd_snapshot =
            crate::etcd_snapshot::wanted_for_kubernetes(snapshot_mode, limits.etcd_snapshot)
                .map_err(|reason| InvalidOption {
                    key: crate::annotations::ETCD_SNAPSHOT,
                    value: snapshot_mode.map_or("", |m| m.as_str()).to_string(),
                    reason,
                })?;
        Ok(Settings {
            paused: intent.paused,
            step_deadline: limits.step_deadline,
            etcd_snapshot,
        })
    }

    fn stopping(limits: &Limits) -> Settings {
        Settings {
            paused: true,
            step_deadline: limits.step_deadline,
            // Stopping starts no step: no snapshot is taken.
            etcd_snapshot: false,
        }
    }

    fn request(run: Option<&KubeRun>, settings: &Settings) -> Request {
        // etcd is looked at only while a snapshot is still due: a run about to start may need one
        // in this very pass; a run under way until its snapshot is taken or no control plane is
        // left to restart.
        Request {
            etcd: settings.etcd_snapshot
                && !settings.paused
                && run.is_none_or(KubeRun::snapshot_due),
        }
    }

    fn versions_of(observation: &Observation) -> KubernetesVersions {
        KubernetesVersions::of(observation)
    }

    fn current(versions: &KubernetesVersions) -> Option<KubernetesVersion> {
        versions.range.as_ref().map(|(lowest, _)| lowest.clone())
    }

    fn available(
        versions: &KubernetesVersions,
        catalog: &Catalog,
    ) -> Option<Option<KubernetesVersion>> {
        let (current, _) = versions.range.as_ref()?;
        let talos = versions.talos.as_ref()?;
        Some(catalog::kubernetes_available(catalog, current, talos))
    }

    fn unknown(catalog: &Catalog, target: &KubernetesVersion) -> Option<String> {
        catalog.unknown("Kubernetes", target, catalog.kubernetes().cloned())
    }

    fn check_start(versions: &KubernetesVersions, target: &KubernetesVersion) -> StartCheck {
        let Some((lowest, highest)) = &versions.range else {
            return StartCheck::NoVersions;
        };
        // Invalid targets first: they are refused whatever Talos does.
        match versions::check_kubernetes_upgrade_across(lowest, highest, target) {
            Ok(_) => StartCheck::Go,
            Err(refusal) => StartCheck::Refused(refusal.to_string()),
        }
    }

    fn hold_start(
        observation: &Observation,
        target: &KubernetesVersion,
        gates: &Gates,
    ) -> Option<Hold> {
        Some(Hold {
            status: UpgradeStatus::Blocked,
            condition: ConditionReason::Blocked,
            message: blocked(observation, target, gates)?,
            reason: Reason::UpgradeBlocked,
            revisit: Revisit::Blocked,
        })
    }

    fn start(
        requested: &str,
        target: &KubernetesVersion,
        _: &Settings,
        observation: &Observation,
        now: Timestamp,
    ) -> KubeRun {
        let from = super::kubernetes_current(observation)
            .expect("a run starts only once the nodes tell their Kubernetes version");
        super::start_run(requested, target, &from, observation, now)
    }

    fn started(run: &KubeRun, versions: &KubernetesVersions, target: &KubernetesVersion) -> String {
        let lowest = versions
            .range
            .as_ref()
            .map(|(lowest, _)| lowest.to_string())
            .unwrap_or_default();
        format!(
            "Upgrading Kubernetes from {lowest} to {target} on {} nodes",
            run.nodes().len()
        )
    }

    fn no_versions() -> &'static str {
        "Waiting: no node reports its Kubernetes version yet"
    }

    fn resume(run: &mut KubeRun, _: Timestamp) {
        super::resume(run);
    }

    fn remember(_: &KubeRun, _: Timestamp) -> Option<KubeRun> {
        // Nothing a Kubernetes run does outlives it on the nodes.
        None
    }

    fn left_pending(_: &KubeRun, _: &Observation) -> Option<String> {
        None
    }

    fn left_behind(_: &KubeRun) -> Vec<String> {
        // Every step is idempotent and leaves no node cordoned: a step cut short by the reset is
        // made again by the next run.
        Vec::new()
    }

    fn behind(run: &KubeRun, versions: &KubernetesVersions) -> bool {
        let Ok(target) = KubernetesVersion::parse(&run.target) else {
            return false;
        };
        versions
            .range
            .as_ref()
            .is_some_and(|(lowest, _)| *lowest < target)
    }

    fn behind_hint() -> &'static str {
        // A run's steps are fixed at its start; a new run takes the node (every step is idempotent).
        "remove kubernetes-target and set it again to upgrade it"
    }

    // A run's steps are fixed at its start: a node behind is told by the completed run's message
    // (see `behind_hint`), not taken in.
    const JOINS: bool = false;

    fn join(_: &mut KubeRun, _: &Observation, _: bool, _: Timestamp) -> Vec<Note> {
        Vec::new()
    }

    fn before_deciding(_: &KubeRun, _: &Settings, _: &Observation) -> Vec<NoFurther> {
        Vec::new()
    }

    fn merge(_: &mut Observation, looked: NoFurther) {
        match looked {}
    }

    fn advance(
        run: &KubeRun,
        settings: &Settings,
        observation: &Observation,
        now: Timestamp,
    ) -> Decision {
        super::advance(run, settings, observation, now)
    }

    fn answered(
        run: &mut KubeRun,
        action: &Action,
        _: &Observation,
        now: Timestamp,
    ) -> Answered<NoFurther> {
        match action {
            // Nothing to observe for these: the call's success is the step's end, and the next step
            // is decided in the same pass, so no time is lost between steps.
            Action::PullImages { .. } | Action::SyncManifests { .. } => {
                let completed = run
                    .step_in_flight()
                    .is_some_and(|index| super::complete_step(run, index, now));
                if completed {
                    Answered::DecideAgain
                } else {
                    Answered::Nothing
                }
            }
            // A patch is done only when its effect is observed, in a later pass.
            Action::PatchImage { .. } => Answered::Nothing,
            // The shell answers a snapshot with where it is stored (`stored`); an answer without it
            // stored nothing, and the next pass takes it again.
            Action::EtcdSnapshot { .. } => Answered::Nothing,
        }
    }

    fn stored(
        run: &mut KubeRun,
        action: &Action,
        stored: &crate::etcd_snapshot::Stored,
        observation: &Observation,
        now: Timestamp,
    ) -> Answered<NoFurther> {
        match action {
            // Stored and verified: the step it held may start in the same pass.
            Action::EtcdSnapshot { node } => {
                super::snapshot_stored(run, node, stored, now);
                Answered::DecideAgain
            }
            _ => Kubernetes::answered(run, action, observation, now),
        }
    }

    fn not_reached(_: &mut KubeRun, _: &Action) {
        // Every call is idempotent: the step's rule makes it again until its deadline.
    }

    fn retry(_: &mut KubeRun, _: &Action, _: &str, _: Timestamp) -> bool {
        // The shell never asks: a Kubernetes step's calls are retried until the step's deadline as
        // unanswered ones, or refused.
        false
    }

    fn refused(run: &mut KubeRun, action: &Action, reason: &str, now: Timestamp) -> Vec<Action> {
        // No step was started by a snapshot: the run fails before the control planes.
        if let Action::EtcdSnapshot { node } = action {
            super::snapshot_failed(run, node, reason, now);
            return Vec::new();
        }
        if let Some(index) = run.step_in_flight() {
            super::fail_step(run, index, reason, now);
        }
        Vec::new()
    }

    fn reports_before(actions: &[Action]) -> bool {
        // Streaming a large etcd snapshot can take a while: the status says so meanwhile. The
        // other calls are short.
        actions
            .iter()
            .any(|action| matches!(action, Action::EtcdSnapshot { .. }))
    }

    fn looks_further(_: &Action) -> bool {
        false
    }

    fn finished_nodes(_: &KubeRun, _: &KubeRun) -> Vec<(NodeRole, f64)> {
        // The node-upgrade-duration histogram is the Talos upgrade's.
        Vec::new()
    }
}
