//! Upgrade plans across several hops (issue #24): a target the cluster cannot reach in one step becomes
//! a list of hops, each an ordinary run of one kind, when the cluster opts in
//! (`upgrade.vitistack.io/upgrade-plan: multi-hop`). Without the opt-in nothing here is used and the
//! one-step rules of [`crate::versions`] speak as before.
//!
//! # The rules a plan is built by
//!
//! * **Talos**: the fewest hops the installer accepts ([`versions::check_talos_upgrade`], talos-api.md
//!   §3.5): from the running version, the newest release line the host can reach in one step
//!   (`talos_stepping_stone`'s rule), at the newest patch the release catalog knows of that line, until
//!   the target is one step away; the last hop is the target as written. Every hop is a full rolling
//!   reboot of every node, so a hop the installer does not need is not made.
//! * **Kubernetes**: one minor at a time (`talosctl upgrade-k8s`'s rule, §4): each intermediate minor at
//!   the newest patch the catalog knows, the last hop the target as written.
//! * **Interleaving**: Talos first, as the one-step rules already order a cluster with both targets
//!   (Kubernetes is `blocked` while Talos upgrades). A Kubernetes hop comes before a Talos hop only where
//!   the support matrix (§5) demands it: the Talos release of the next hop no longer supports the
//!   running Kubernetes, so Kubernetes goes up one minor at a time (on the Talos that runs, which must
//!   support each) until it does. A Kubernetes hop the running Talos does not support waits for the
//!   Talos hops.
//! * The versions come from the same [`Catalog`] that decides `*-available` (built in, file, live); a
//!   line with no known release cannot be passed through and the plan is refused naming it.
//!
//! The plan is computed once for the targets as written and kept in the progress record
//! ([`Plan`]); it is computed again only when a target changes (not when the catalog does), or with
//! `resume` after it was refused.

pub mod preview;

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::annotations::{UpgradeKind, UpgradeStatus};
use crate::catalog::Catalog;
use crate::crd::condition::Reason as ConditionReason;
use crate::intent::{Target, UpgradeIntent};
use crate::report::KindReport;
use crate::run::{Note, Outcome, Reason};
use crate::versions::{
    self, KubernetesPathError, KubernetesVersion, MinorVersion, TalosPathError, TalosSupportError,
    TalosVersion,
};

/// `upgrade.vitistack.io/upgrade-plan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlanMode {
    /// One step per target, refused when one is not enough (the default).
    #[default]
    SingleStep,
    /// A target that needs several steps becomes a plan of hops.
    MultiHop,
}

impl PlanMode {
    /// The accepted values, for the invalid-option sentence.
    pub const REASON: &'static str = "use multi-hop or single-step (the default)";

    /// ASCII case-insensitive, as every keyword annotation.
    pub fn parse(text: &str) -> Option<PlanMode> {
        [PlanMode::SingleStep, PlanMode::MultiHop]
            .into_iter()
            .find(|mode| mode.as_str().eq_ignore_ascii_case(text))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PlanMode::SingleStep => "single-step",
            PlanMode::MultiHop => "multi-hop",
        }
    }
}

/// The kind of one hop, as the progress record spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HopKind {
    Talos,
    Kubernetes,
}

impl HopKind {
    pub fn upgrade_kind(self) -> UpgradeKind {
        match self {
            HopKind::Talos => UpgradeKind::Talos,
            HopKind::Kubernetes => UpgradeKind::Kubernetes,
        }
    }

    fn of(kind: UpgradeKind) -> HopKind {
        match kind {
            UpgradeKind::Talos => HopKind::Talos,
            UpgradeKind::Kubernetes => HopKind::Kubernetes,
        }
    }
}

/// One hop: an ordinary run of `kind` from `from` to `to` (versions as `*-current` spells them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hop {
    pub kind: HopKind,
    pub from: String,
    pub to: String,
}

impl Hop {
    fn talos(from: &TalosVersion, to: &TalosVersion) -> Hop {
        Hop {
            kind: HopKind::Talos,
            from: from.to_string(),
            to: to.to_string(),
        }
    }

    fn kubernetes(from: &KubernetesVersion, to: &KubernetesVersion) -> Hop {
        Hop {
            kind: HopKind::Kubernetes,
            from: from.to_string(),
            to: to.to_string(),
        }
    }
}

impl fmt::Display for Hop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} → {}",
            self.kind.upgrade_kind().name(),
            self.from,
            self.to
        )
    }
}

/// Where the cluster starts from: the lowest version of each kind running, when known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Start {
    pub talos: Option<TalosVersion>,
    pub kubernetes: Option<KubernetesVersion>,
}

/// What the user asked for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Targets {
    pub talos: Option<TalosVersion>,
    pub kubernetes: Option<KubernetesVersion>,
}

/// Why no plan can be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// A version the plan starts from is not known yet: look at the cluster first.
    #[error("the {} version the cluster runs is not known yet", .0.name())]
    NoVersions(UpgradeKind),

    /// The one-step rules refuse the target whatever the path (a downgrade, another major, a release
    /// too old or unknown): they say it, as without a plan.
    #[error("{0}")]
    OneStep(String),

    /// No release of a line the plan must pass through is known.
    #[error(
        "No upgrade plan reaches {} {target}: the release catalog knows no {} {line} release to upgrade through. Add one to the catalog (--release-catalog or live sources). No node was touched.",
        .kind.name(), .kind.name()
    )]
    NoRelease {
        kind: UpgradeKind,
        target: String,
        line: MinorVersion,
    },

    /// A Talos hop needs a newer Kubernetes than the user asked for.
    #[error(
        "No upgrade plan reaches Talos {target}: Talos {hop} does not support the running Kubernetes {kubernetes}, and the Kubernetes target does not go up to {min}. Set kubernetes-target to {min}.0 or newer. No node was touched."
    )]
    NeedsKubernetes {
        target: String,
        hop: String,
        kubernetes: String,
        min: MinorVersion,
    },

    /// A Kubernetes hop needs a newer Talos than the user asked for.
    #[error(
        "No upgrade plan reaches Kubernetes {target}: Talos {talos} does not support Kubernetes {hop}. Set talos-target to a release that supports it. No node was touched."
    )]
    NeedsTalos {
        target: String,
        talos: String,
        hop: String,
    },
}

/// The most hops a plan may have: far more than any real path (Talos 1.7 to 1.14 with Kubernetes
/// 1.25 to 1.37 is under twenty), a bound so a wrong table can never loop.
const MAX_HOPS: usize = 64;

/// The hops from `start` to `targets`, in order (empty: nothing to do). See the module documentation
/// for the rules.
pub fn compute(start: &Start, targets: &Targets, catalog: &Catalog) -> Result<Vec<Hop>, PlanError> {
    let mut talos = match (&targets.talos, &start.talos) {
        (Some(_), None) => return Err(PlanError::NoVersions(UpgradeKind::Talos)),
        (_, talos) => talos.clone(),
    };
    let mut kubernetes = match (&targets.kubernetes, &start.kubernetes) {
        (Some(_), None) => return Err(PlanError::NoVersions(UpgradeKind::Kubernetes)),
        (_, kubernetes) => kubernetes.clone(),
    };
    // A Kubernetes target's support is checked against Talos, so its version must be known.
    if targets.kubernetes.is_some() && talos.is_none() {
        return Err(PlanError::NoVersions(UpgradeKind::Talos));
    }
    // What no path fixes is said by the one-step rules, in their words.
    if let (Some(target), Some(from)) = (&targets.talos, &talos) {
        if let Some(why) = catalog.unknown("Talos", target, catalog.talos().cloned()) {
            return Err(PlanError::OneStep(format!(
                "Talos upgrade refused: {why}. No node was touched."
            )));
        }
        match versions::check_talos_upgrade(from, target) {
            Ok(_) | Err(TalosPathError::TooFarForOneStep { .. }) => {}
            Err(error) => return Err(PlanError::OneStep(error.to_string())),
        }
    }
    if let (Some(target), Some(from)) = (&targets.kubernetes, &kubernetes) {
        if let Some(why) = catalog.unknown("Kubernetes", target, catalog.kubernetes().cloned()) {
            return Err(PlanError::OneStep(format!(
                "Kubernetes upgrade refused: {why}. No node was touched."
            )));
        }
        match versions::check_kubernetes_upgrade(from, target) {
            Ok(_) | Err(KubernetesPathError::SkipsMinor { .. }) => {}
            Err(error) => return Err(PlanError::OneStep(error.to_string())),
        }
    }

    let mut hops = Vec::new();
    while hops.len() < MAX_HOPS {
        if let (Some(target), Some(from)) = (&targets.talos, &talos)
            && from < target
        {
            let next = next_talos(from, target, catalog)?;
            let Some(running) = &kubernetes else {
                // Kubernetes not observed: the run's own start skips the support check as well.
                hops.push(Hop::talos(from, &next));
                talos = Some(next);
                continue;
            };
            match versions::check_talos_target_supports(&next, running) {
                Ok(()) => {
                    hops.push(Hop::talos(from, &next));
                    talos = Some(next);
                }
                Err(TalosSupportError::KubernetesTooOld { min, .. }) => {
                    let too_old = || PlanError::NeedsKubernetes {
                        target: target.to_string(),
                        hop: next.to_string(),
                        kubernetes: running.to_string(),
                        min,
                    };
                    let Some(kubernetes_target) = &targets.kubernetes else {
                        return Err(too_old());
                    };
                    if kubernetes_target.minor_version() < min {
                        return Err(too_old());
                    }
                    let up = next_kubernetes(running, kubernetes_target, catalog)?;
                    // The Talos that runs must support the step up, or no order of hops works.
                    if versions::check_kubernetes_target_supported(from, &up).is_err() {
                        return Err(too_old());
                    }
                    hops.push(Hop::kubernetes(running, &up));
                    kubernetes = Some(up);
                }
                Err(error) => return Err(PlanError::OneStep(error.to_string())),
            }
            continue;
        }
        if let (Some(target), Some(from)) = (&targets.kubernetes, &kubernetes)
            && from < target
        {
            let next = next_kubernetes(from, target, catalog)?;
            let talos_now = talos
                .as_ref()
                .expect("Talos is known with a Kubernetes target");
            if versions::check_kubernetes_target_supported(talos_now, &next).is_err() {
                return Err(PlanError::NeedsTalos {
                    target: target.to_string(),
                    talos: talos_now.to_string(),
                    hop: next.to_string(),
                });
            }
            hops.push(Hop::kubernetes(from, &next));
            kubernetes = Some(next);
            continue;
        }
        break;
    }
    Ok(hops)
}

/// The next Talos hop from `from` toward `target`: the target when one step reaches it, otherwise the
/// newest known release of the newest line `from` reaches in one step.
fn next_talos(
    from: &TalosVersion,
    target: &TalosVersion,
    catalog: &Catalog,
) -> Result<TalosVersion, PlanError> {
    match versions::check_talos_upgrade(from, target) {
        Ok(_) => Ok(target.clone()),
        Err(TalosPathError::TooFarForOneStep { via, .. }) => catalog
            .talos()
            .rev()
            .find(|release| {
                release.minor_version() == via
                    && release > &from
                    && matches!(
                        versions::check_talos_upgrade(from, release),
                        Ok(versions::TalosStep::Upgrade)
                    )
            })
            .cloned()
            .ok_or_else(|| PlanError::NoRelease {
                kind: UpgradeKind::Talos,
                target: target.to_string(),
                line: via,
            }),
        Err(error) => Err(PlanError::OneStep(error.to_string())),
    }
}

/// The next Kubernetes hop: the target when it is on this or the next minor, otherwise the newest
/// known release of the next minor.
fn next_kubernetes(
    from: &KubernetesVersion,
    target: &KubernetesVersion,
    catalog: &Catalog,
) -> Result<KubernetesVersion, PlanError> {
    if target.minor() <= from.minor() + 1 {
        return Ok(target.clone());
    }
    let line = MinorVersion::new(from.major(), from.minor() + 1);
    catalog
        .kubernetes()
        .rev()
        .find(|release| release.minor_version() == line)
        .cloned()
        .ok_or_else(|| PlanError::NoRelease {
            kind: UpgradeKind::Kubernetes,
            target: target.to_string(),
            line,
        })
}

/// Whether `hops` need a plan at all: more than one hop of a kind, or a Kubernetes hop before a Talos
/// hop. Otherwise the one-step rules run them exactly as they always did (Talos first).
pub fn needs_plan(hops: &[Hop]) -> bool {
    let count = |kind| hops.iter().filter(|hop| hop.kind == kind).count();
    let kubernetes_first = hops
        .iter()
        .position(|hop| hop.kind == HopKind::Kubernetes)
        .zip(hops.iter().rposition(|hop| hop.kind == HopKind::Talos))
        .is_some_and(|(kubernetes, talos)| kubernetes < talos);
    count(HopKind::Talos) > 1 || count(HopKind::Kubernetes) > 1 || kubernetes_first
}

/// A plan as the progress record keeps it (`plan.json`), with the targets it was computed for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// The `talos-target` value (trimmed) the plan was computed for.
    #[serde(default)]
    pub talos_target: Option<String>,
    #[serde(default)]
    pub kubernetes_target: Option<String>,
    #[serde(default)]
    pub hops: Vec<Hop>,
    /// How many hops are finished; `hops[done]` is the hop in progress.
    #[serde(default)]
    pub done: usize,
    /// Why no plan reaches the targets (then `hops` is empty): decided once, like a refused target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

impl Plan {
    /// Whether this plan was computed for these target values.
    pub fn is_for(&self, talos: Option<&str>, kubernetes: Option<&str>) -> bool {
        self.talos_target.as_deref() == talos && self.kubernetes_target.as_deref() == kubernetes
    }

    pub fn current(&self) -> Option<&Hop> {
        self.hops.get(self.done)
    }

    pub fn is_finished(&self) -> bool {
        self.refused.is_none() && self.done >= self.hops.len()
    }

    /// `hop 2/4: Talos 1.13.6 → 1.14.1`.
    pub fn hop_line(&self, index: usize) -> String {
        format!(
            "hop {}/{}: {}",
            index + 1,
            self.hops.len(),
            self.hops[index]
        )
    }

    /// The target value `kind`'s run is given this reconcile, `user` being the annotation as written:
    /// the hop in progress when it is of this kind, else this kind's last finished hop (its run stands,
    /// completed), else nothing (its first hop has not come yet); the user's value when the plan has
    /// no hop of this kind.
    pub fn effective_target<'a>(
        &'a self,
        kind: UpgradeKind,
        user: Option<&'a str>,
    ) -> Option<&'a str> {
        let kind = HopKind::of(kind);
        if !self.hops.iter().any(|hop| hop.kind == kind) {
            return user;
        }
        if let Some(hop) = self.current()
            && hop.kind == kind
        {
            return Some(&hop.to);
        }
        self.hops[..self.done.min(self.hops.len())]
            .iter()
            .rev()
            .find(|hop| hop.kind == kind)
            .map(|hop| hop.to.as_str())
    }

    /// Whether hops of `kind` are still to finish.
    pub fn has_left(&self, kind: UpgradeKind) -> bool {
        let kind = HopKind::of(kind);
        self.hops.iter().skip(self.done).any(|hop| hop.kind == kind)
    }

    /// Moves past the hop in progress when `kind`'s run finished it: `requested` is the target value
    /// the run was for, `completed` whether it completed. Returns the Events of the move.
    pub fn advance(&mut self, kind: UpgradeKind, requested: &str, completed: bool) -> Vec<Note> {
        let Some(hop) = self.current() else {
            return Vec::new();
        };
        if hop.kind != HopKind::of(kind) || !same_version(kind, &hop.to, requested) || !completed {
            return Vec::new();
        }
        let mut notes = vec![Note::normal(
            Reason::PlanHopFinished,
            format!("Finished {} of the upgrade plan", self.hop_line(self.done)),
        )];
        self.done += 1;
        notes.push(match self.current() {
            Some(_) => self.hop_started(),
            None => Note::normal(
                Reason::PlanFinished,
                format!(
                    "The upgrade plan is finished: {} in {} hops",
                    self.targets_line(),
                    self.hops.len()
                ),
            ),
        });
        notes
    }

    /// The Event of the hop in progress starting.
    pub fn hop_started(&self) -> Note {
        Note::normal(
            Reason::PlanHopStarted,
            format!("Starting {} of the upgrade plan", self.hop_line(self.done)),
        )
    }

    /// `Talos 1.14.1 and Kubernetes 1.37.0`.
    pub fn targets_line(&self) -> String {
        let mut parts = Vec::new();
        if let Some(talos) = &self.talos_target
            && self.hops.iter().any(|hop| hop.kind == HopKind::Talos)
        {
            parts.push(format!("Talos {talos}"));
        }
        if let Some(kubernetes) = &self.kubernetes_target
            && self.hops.iter().any(|hop| hop.kind == HopKind::Kubernetes)
        {
            parts.push(format!("Kubernetes {kubernetes}"));
        }
        parts.join(" and ")
    }

    /// The hops as one list: `1. Talos 1.11.6 → 1.13.9, 2. …`.
    pub fn hops_line(&self) -> String {
        self.hops
            .iter()
            .enumerate()
            .map(|(index, hop)| format!("{}. {hop}", index + 1))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The Event of a new plan.
    pub fn computed(&self) -> Note {
        Note::normal(
            Reason::PlanComputed,
            format!(
                "Upgrade plan to {} in {} hops: {}",
                self.targets_line(),
                self.hops.len(),
                self.hops_line()
            ),
        )
    }

    /// The controller's `upgrade-plan-progress` annotation: the hop in progress, what is done and what is
    /// left; `failed` when the hop in progress failed.
    pub fn progress_line(&self, failed: bool) -> String {
        if let Some(refused) = &self.refused {
            return format!("refused: {refused}");
        }
        let Some(_) = self.current() else {
            return format!("finished: {}", self.hops_line());
        };
        let left: Vec<String> = self.hops[self.done + 1..]
            .iter()
            .map(ToString::to_string)
            .collect();
        let done: Vec<String> = self.hops[..self.done]
            .iter()
            .map(ToString::to_string)
            .collect();
        let mut line = self.hop_line(self.done);
        if failed {
            line.push_str(" failed; the plan stops here until resume");
        }
        if !done.is_empty() {
            line.push_str(&format!("; done: {}", done.join(", ")));
        }
        line.push_str(&match left.is_empty() {
            true => "; nothing left after it".to_string(),
            false => format!("; left: {}", left.join(", ")),
        });
        line
    }

    /// `report` as the plan shows it: a kind with hops still to finish is `in-progress` (a hop that
    /// completed is not the plan completed: `kubectl wait` waits for the last), and a kind waiting for
    /// its next hop says which.
    pub fn shape(&self, report: &mut KindReport) {
        let kind = report.kind;
        if self.refused.is_some() || !self.has_left(kind) {
            return;
        }
        match report.status {
            UpgradeStatus::Completed | UpgradeStatus::Idle => {
                report.status = UpgradeStatus::InProgress;
                report.condition_reason = Some(ConditionReason::InProgress);
                let next = self
                    .hops
                    .iter()
                    .enumerate()
                    .skip(self.done)
                    .find(|(_, hop)| hop.kind == HopKind::of(kind))
                    .map(|(index, _)| index)
                    .expect("a hop of this kind is left");
                report.message = match self.current() {
                    Some(_) if next == self.done => {
                        format!("Upgrade plan {}: starting", self.hop_line(next))
                    }
                    _ => format!(
                        "Upgrade plan {} in progress; next for {}: {}",
                        self.hop_line(self.done),
                        kind.name(),
                        self.hop_line(next)
                    ),
                };
            }
            UpgradeStatus::InProgress | UpgradeStatus::Failed | UpgradeStatus::Blocked => {}
        }
    }
}

/// What the plan layer does this reconcile (see [`course`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Course {
    /// No plan: the one-step rules, with the user's targets as written. `forget` drops a stored plan.
    OneStep { forget: bool },
    /// A plan needs the versions the cluster runs: the runs are given no target this time (they look and
    /// report `*-current`), and the next reconcile computes it.
    Waiting(UpgradeKind),
    /// Follow `plan` (new when `notes` announce it).
    Follow { plan: Plan, notes: Vec<Note> },
}

/// What the plan layer needs of a reconcile.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    pub mode: PlanMode,
    /// The target annotations, trimmed, `None` when absent or blank.
    pub talos_target: Option<&'a str>,
    pub kubernetes_target: Option<&'a str>,
    /// `*-current` as the controller last showed it.
    pub talos_current: Option<&'a str>,
    pub kubernetes_current: Option<&'a str>,
    pub stored: Option<Plan>,
    pub resume: bool,
    /// A reset of either kind: the plan is dropped, the reset is the lifecycle's.
    pub reset: bool,
    pub catalog: &'a Catalog,
}

/// Decides the plan of a reconcile: the stored one while the targets are those it was made for,
/// otherwise a new one from the versions last shown.
pub fn course(inputs: &Inputs<'_>) -> Course {
    let forget = inputs.stored.is_some();
    if inputs.mode == PlanMode::SingleStep || inputs.reset {
        return Course::OneStep { forget };
    }
    if let Some(plan) = &inputs.stored
        && plan.is_for(inputs.talos_target, inputs.kubernetes_target)
        && !(plan.refused.is_some() && inputs.resume)
    {
        return Course::Follow {
            plan: plan.clone(),
            notes: Vec::new(),
        };
    }
    // A target that is not a version is refused by the one-step rules.
    let talos_target = match inputs.talos_target.map(TalosVersion::parse).transpose() {
        Ok(target) => target,
        Err(_) => return Course::OneStep { forget },
    };
    let kubernetes_target = match inputs
        .kubernetes_target
        .map(KubernetesVersion::parse)
        .transpose()
    {
        Ok(target) => target,
        Err(_) => return Course::OneStep { forget },
    };
    let start = Start {
        talos: inputs
            .talos_current
            .and_then(|v| TalosVersion::parse(v).ok()),
        kubernetes: inputs
            .kubernetes_current
            .and_then(|v| KubernetesVersion::parse(v).ok()),
    };
    let targets = Targets {
        talos: talos_target,
        kubernetes: kubernetes_target,
    };
    let mut plan = Plan {
        talos_target: inputs.talos_target.map(str::to_string),
        kubernetes_target: inputs.kubernetes_target.map(str::to_string),
        hops: Vec::new(),
        done: 0,
        refused: None,
    };
    match compute(&start, &targets, inputs.catalog) {
        Ok(hops) if needs_plan(&hops) => {
            plan.hops = hops;
            let notes = vec![plan.computed(), plan.hop_started()];
            Course::Follow { plan, notes }
        }
        Ok(_) | Err(PlanError::OneStep(_)) => Course::OneStep { forget },
        Err(PlanError::NoVersions(kind)) => Course::Waiting(kind),
        Err(error) => {
            let message = error.to_string();
            plan.refused = Some(message.clone());
            Course::Follow {
                plan,
                notes: vec![Note::warning(Reason::PlanRefused, message)],
            }
        }
    }
}

/// The report of a kind whose target no plan reaches: `failed`, with the plan's reason.
pub fn refused_report(kind: UpgradeKind, message: &str) -> KindReport {
    let mut report = KindReport::new(kind, UpgradeStatus::Failed, message.to_string());
    report.condition_reason = Some(ConditionReason::Failed);
    report
}

/// The message of a kind whose plan waits for the cluster's versions.
pub fn waiting_message(kind: UpgradeKind) -> String {
    format!(
        "Waiting: the upgrade plan is computed once the {} version the cluster runs is known",
        kind.name()
    )
}

#[cfg(test)]
mod tests;

/// What a kind's run record says, for the plan to move on: the target value it was for, and whether
/// it completed or failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunEnd<'a> {
    pub requested: &'a str,
    pub completed: bool,
    pub failed: bool,
}

impl<'a> RunEnd<'a> {
    /// How `run` ended, as the plan reads it. A rollback (Talos `talos-rollback`) took the nodes back
    /// off the hop's version: the plan stops at that hop as after a failure, and never moves on.
    pub fn of<R: crate::run::Record>(run: &'a R) -> RunEnd<'a> {
        let rolled_back = run.is_rollback() && run.is_finished();
        RunEnd {
            requested: run.requested(),
            completed: matches!(run.outcome(), Some(Outcome::Completed { .. })) && !rolled_back,
            failed: matches!(run.outcome(), Some(Outcome::Failed { .. })) || rolled_back,
        }
    }
}

/// The plan layer of one reconcile: what the two runs are given as targets (the hop's version in place
/// of the user's), and what the reconcile shows and keeps of the plan afterwards. Without the opt-in
/// it gives the runs the user's annotations unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    plan: Option<Plan>,
    /// A stored plan to drop (no plan any more).
    forget: bool,
    /// The plan waits for the versions of this kind.
    waiting: Option<UpgradeKind>,
    /// The user's targets (trimmed), to tell which kinds a waiting plan is for.
    targets: [Option<String>; 2],
    /// `upgrade-plan` has a value that is not a mode.
    invalid: Option<String>,
    /// `resume` was set: a refused plan consumes it (the runs are given no target to consume it).
    resume: bool,
    notes: Vec<Note>,
}

/// How a reconcile ends for the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Concluded {
    /// The plan to keep in the progress record (`None`: none).
    pub keep: Option<Plan>,
    /// Events to publish.
    pub notes: Vec<Note>,
    /// `plan-message`: `None` removes it.
    pub message: Option<String>,
    /// Look again at once: a hop finished and the next starts.
    pub again: bool,
    /// The plan waits for the cluster's versions: look again at the poll (not at once: nodes that do
    /// not answer would be asked every second).
    pub waiting: bool,
    /// The kind of the hop in progress, while a plan runs: the only kind `status.phase` shows (see
    /// [`Concluded::phase_reports`]).
    pub phase_kind: Option<UpgradeKind>,
}

impl Concluded {
    /// The reports as `status.phase` reads them: while a plan runs, a kind that only waits for its next
    /// hop is not upgrading, so the phase shows the kind of the hop in progress (`UpgradingTalos` during
    /// a Talos hop, though Kubernetes hops are left and `kubernetes-status` is `in-progress`).
    pub fn phase_reports(&self, reports: [&KindReport; 2]) -> [KindReport; 2] {
        reports.map(|report| {
            let mut report = report.clone();
            if let Some(kind) = self.phase_kind
                && report.kind != kind
                && report.status == UpgradeStatus::InProgress
            {
                report.status = UpgradeStatus::Idle;
            }
            report
        })
    }
}

impl Layer {
    pub fn new(
        intent: &UpgradeIntent,
        annotations: &BTreeMap<String, String>,
        stored: Option<Plan>,
        catalog: &Catalog,
    ) -> Layer {
        let talos_target = crate::intent::value(annotations, crate::annotations::TALOS_TARGET);
        let kubernetes_target =
            crate::intent::value(annotations, crate::annotations::KUBERNETES_TARGET);
        let (mode, invalid) = match &intent.upgrade_plan {
            Ok(mode) => (*mode, None),
            // The safe reading: one step (a refusal can be taken back, hops cannot).
            Err(invalid) => (
                PlanMode::SingleStep,
                Some(format!("{invalid}; one-step upgrades until it is fixed")),
            ),
        };
        let course = course(&Inputs {
            mode,
            talos_target,
            kubernetes_target,
            talos_current: crate::intent::value(annotations, crate::annotations::TALOS_CURRENT),
            kubernetes_current: crate::intent::value(
                annotations,
                crate::annotations::KUBERNETES_CURRENT,
            ),
            stored,
            resume: intent.resume,
            reset: intent.talos_reset || intent.kubernetes_reset,
            catalog,
        });
        let mut layer = Layer {
            plan: None,
            forget: false,
            waiting: None,
            targets: [
                talos_target.map(str::to_string),
                kubernetes_target.map(str::to_string),
            ],
            invalid,
            resume: intent.resume,
            notes: Vec::new(),
        };
        match course {
            Course::OneStep { forget } => layer.forget = forget,
            Course::Waiting(kind) => layer.waiting = Some(kind),
            Course::Follow { plan, notes } => {
                // A refused plan is announced once, with the `resume` it consumed (if any).
                layer.plan = Some(plan);
                layer.notes = notes;
            }
        }
        layer
    }

    /// The plan being followed, if any.
    pub fn plan(&self) -> Option<&Plan> {
        self.plan.as_ref()
    }

    /// Whether the runs are given something else than the user's targets.
    pub fn is_active(&self) -> bool {
        self.plan.is_some() || self.waiting.is_some()
    }

    /// The target value `kind`'s run is given.
    fn target_of(&self, kind: UpgradeKind) -> Option<&str> {
        let user = self.targets[kind_index(kind)].as_deref();
        match (&self.plan, self.waiting) {
            (_, Some(_)) => None,
            (Some(plan), None) if plan.refused.is_some() => None,
            // The last hop is the target as the user wrote it (`v1.14.1`), so the run for it is the
            // run the user asked for, and stands as such should the plan be dropped.
            (Some(plan), None) => match (plan.effective_target(kind, user), user) {
                (Some(value), Some(user)) if same_version(kind, value, user) => Some(user),
                (value, _) => value,
            },
            (None, None) => user,
        }
    }

    /// The intent and annotations the two runs are given: the user's, with each target replaced by
    /// the value the plan gives that kind this reconcile.
    pub fn effective(
        &self,
        intent: &UpgradeIntent,
        annotations: &BTreeMap<String, String>,
    ) -> (UpgradeIntent, BTreeMap<String, String>) {
        let mut intent = intent.clone();
        let mut annotations = annotations.clone();
        if !self.is_active() {
            return (intent, annotations);
        }
        for kind in UpgradeKind::ALL {
            let value = self.target_of(kind).map(str::to_string);
            match &value {
                Some(value) => annotations.insert(kind.target_key().to_string(), value.clone()),
                None => annotations.remove(kind.target_key()),
            };
            match kind {
                UpgradeKind::Talos => {
                    intent.talos_target = match value {
                        Some(value) => match TalosVersion::parse(&value) {
                            Ok(version) => Target::Version(version),
                            Err(reason) => Target::Invalid { raw: value, reason },
                        },
                        None => Target::Absent,
                    }
                }
                UpgradeKind::Kubernetes => {
                    intent.kubernetes_target = match value {
                        Some(value) => match KubernetesVersion::parse(&value) {
                            Ok(version) => Target::Version(version),
                            Err(reason) => Target::Invalid { raw: value, reason },
                        },
                        None => Target::Absent,
                    }
                }
            }
        }
        (intent, annotations)
    }

    /// After both runs: moves the plan past a hop its run completed, shapes the two reports as the
    /// plan shows them, and says what to keep and tell. `ends` are the kinds' run records as saved
    /// (Talos, Kubernetes); `shown` the `plan-message` the cluster shows now.
    pub fn conclude(
        mut self,
        ends: [Option<RunEnd<'_>>; 2],
        reports: [&mut KindReport; 2],
        shown: Option<&str>,
    ) -> Concluded {
        let mut notes = std::mem::take(&mut self.notes);
        let mut again = false;
        if let Some(waiting) = self.waiting {
            for report in reports {
                if self.targets[kind_index(report.kind)].is_some() {
                    report.status = UpgradeStatus::InProgress;
                    report.condition_reason = Some(ConditionReason::InProgress);
                    report.message = waiting_message(waiting);
                }
            }
            return Concluded {
                keep: None,
                notes,
                message: Some(waiting_message(waiting)),
                again: false,
                waiting: true,
                phase_kind: None,
            };
        }
        let Some(mut plan) = self.plan else {
            let message = self.invalid.clone();
            if let Some(invalid) = &self.invalid
                && shown != Some(invalid.as_str())
            {
                notes.push(Note::warning(Reason::InvalidOption, invalid.clone()));
            }
            return Concluded {
                keep: None,
                notes,
                message,
                again: false,
                waiting: false,
                phase_kind: None,
            };
        };
        if let Some(refused) = plan.refused.clone() {
            let [talos, kubernetes] = reports;
            if self.resume {
                talos.consumed.push(crate::annotations::RESUME);
            }
            for report in [talos, kubernetes] {
                if self.targets[kind_index(report.kind)].is_some() {
                    report.status = UpgradeStatus::Failed;
                    report.condition_reason = Some(ConditionReason::Failed);
                    report.message = refused.clone();
                }
            }
            return Concluded {
                message: Some(plan.progress_line(false)),
                keep: Some(plan),
                notes,
                again: false,
                waiting: false,
                phase_kind: None,
            };
        }
        let mut failed = false;
        if let Some(hop) = plan.current() {
            let kind = hop.kind.upgrade_kind();
            if let Some(end) = ends[kind_index(kind)]
                && same_version(kind, &hop.to, end.requested)
            {
                failed = end.failed;
                let moved = plan.advance(kind, end.requested, end.completed);
                again = !moved.is_empty() && !plan.is_finished();
                notes.extend(moved);
            }
        }
        for report in reports {
            plan.shape(report);
        }
        Concluded {
            message: Some(plan.progress_line(failed)),
            phase_kind: plan.current().map(|hop| hop.kind.upgrade_kind()),
            keep: Some(plan),
            notes,
            again,
            waiting: false,
        }
    }

    /// Whether a stored plan must be dropped.
    pub fn forgets(&self) -> bool {
        self.forget
    }
}

/// Whether two target values name the same version of `kind` (`1.14.1` and `v1.14.1` do).
fn same_version(kind: UpgradeKind, a: &str, b: &str) -> bool {
    let (a, b) = (a.trim(), b.trim());
    a == b
        || match kind {
            UpgradeKind::Talos => TalosVersion::parse(a)
                .ok()
                .zip(TalosVersion::parse(b).ok())
                .is_some_and(|(a, b)| a == b),
            UpgradeKind::Kubernetes => KubernetesVersion::parse(a)
                .ok()
                .zip(KubernetesVersion::parse(b).ok())
                .is_some_and(|(a, b)| a == b),
        }
}

fn kind_index(kind: UpgradeKind) -> usize {
    match kind {
        UpgradeKind::Talos => 0,
        UpgradeKind::Kubernetes => 1,
    }
}
