//! The Kubernetes version upgrade of one cluster, one reconcile at a time: intent and persisted progress
//! in, observation, version rules, decision, write-ahead, one call, and a report out. The decision itself
//! is [`talos_upgrade_core::kubernetes`]; the calls are [`crate::kubernetes_upgrade`].

use std::time::Duration;

use jiff::Timestamp;
use kube::{Resource, ResourceExt};

use super::Context;
use super::access::SharedAccess;
use super::report::{self, KindReport};
use super::talos_flow::{FlowOutcome, outcome};
use crate::kubernetes_upgrade::{self, ExecuteError, ManifestMode};
use crate::progress_store::{Progress, ProgressStore};
use talos_upgrade_core::annotations::{self, UpgradeKind, UpgradeStatus};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::intent::{Target, UpgradeIntent};
use talos_upgrade_core::kubernetes::{
    self as rollout, Action, KubeRun, Observation, Settings, TalosApi,
};
use talos_upgrade_core::run::{Note, NoteType, Outcome, Report, RunState};
use talos_upgrade_core::versions::{self, KubernetesVersion, TalosVersion};

/// What the Talos upgrade of the same cluster means for the Kubernetes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TalosGate {
    /// A Talos upgrade is pending or running: Kubernetes waits (`blocked`) until it is done.
    pub upgrading: bool,
}

const WAITING_FOR_TALOS: &str = "Waiting for Talos upgrade to complete";

fn kind_report(status: UpgradeStatus, message: String) -> KindReport {
    KindReport::new(UpgradeKind::Kubernetes, status, message)
}

/// An event announced once per distinct Kubernetes message: a hold that lasts many passes is told once.
fn once(cluster: &KubernetesCluster, reason: &'static str, message: &str) -> Vec<Note> {
    report::note_once(
        cluster,
        UpgradeKind::Kubernetes,
        NoteType::Normal,
        reason,
        message,
    )
}

#[allow(clippy::too_many_arguments)]
pub async fn reconcile(
    cluster: &KubernetesCluster,
    ctx: &Context,
    intent: &UpgradeIntent,
    store: &ProgressStore,
    progress: &mut Progress,
    access: &SharedAccess<'_>,
    talos: TalosGate,
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    let name = cluster.name_any();
    let owner = cluster.controller_owner_ref(&());
    // A Talos run that has touched nodes and is not finished holds Kubernetes back even when its status
    // says otherwise for the moment (a bad option reported as failed mid-run, a lost Secret).
    let talos = TalosGate {
        upgrading: talos.upgrading
            || progress
                .talos
                .as_ref()
                .is_some_and(|run| !run.is_finished() && !run.nodes.is_empty()),
    };

    if intent.kubernetes_reset {
        if progress.kubernetes.take().is_some() {
            store.save(&name, owner, progress).await?;
        }
        let mut report = kind_report(
            UpgradeStatus::Idle,
            "Kubernetes upgrade state was reset; no node was touched".to_string(),
        );
        report.condition_reason = Some("Reset");
        report.consumed = vec![
            annotations::KUBERNETES_RESET_UPGRADE_STATE,
            annotations::KUBERNETES_TARGET,
        ];
        let notes = vec![Note {
            type_: NoteType::Normal,
            reason: "UpgradeReset",
            message: report.message.clone(),
        }];
        return Ok(outcome(report, notes, None));
    }

    let raw_target = cluster
        .annotations()
        .get(annotations::KUBERNETES_TARGET)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
    match (&intent.kubernetes_target, raw_target) {
        (Target::Absent, _) | (_, None) => {
            idle(cluster, ctx, access, &name, owner, store, progress, talos).await
        }
        (Target::Invalid { reason, .. }, Some(raw)) => {
            let message = format!("Invalid kubernetes-target: {reason}. No node was touched.");
            decided_failure(&name, owner, store, progress, &raw, &message, now).await
        }
        (Target::Version(target), Some(raw)) => {
            let request = Request {
                cluster,
                ctx,
                access,
                intent,
                name: &name,
                owner,
                store,
                raw: &raw,
                target,
                talos,
                now,
            };
            requested(request, progress).await
        }
    }
}

/// No target: forget the run (a component being restarted finishes on its own); report versions.
#[allow(clippy::too_many_arguments)]
async fn idle(
    cluster: &KubernetesCluster,
    ctx: &Context,
    access: &SharedAccess<'_>,
    name: &str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &ProgressStore,
    progress: &mut Progress,
    talos: TalosGate,
) -> Result<FlowOutcome, super::Error> {
    let dropped = progress.kubernetes.take();
    if dropped.is_some() {
        store.save(name, owner, progress).await?;
    }
    // While Talos rolls across the nodes, the Kubernetes versions cannot change (only a Kubernetes run
    // changes them, and none is running), and every reconcile of the run would otherwise list the
    // control-plane pods again. The idle report already written stays as it is; the reconcile that
    // ends the Talos run refreshes it.
    if talos.upgrading
        && dropped.is_none()
        && let Some(message) = cluster.annotations().get(annotations::KUBERNETES_MESSAGE)
        && cluster
            .annotations()
            .get(annotations::KUBERNETES_STATUS)
            .map(String::as_str)
            == Some(UpgradeStatus::Idle.as_str())
    {
        return Ok(outcome(
            kind_report(UpgradeStatus::Idle, message.clone()),
            Vec::new(),
            None,
        ));
    }
    let observation = versions_only(access).await;
    let current = observation.as_ref().and_then(rollout::kubernetes_current);
    let available = observation
        .as_ref()
        .and_then(|o| available(ctx, o, current.as_ref()));
    let message = match (&current, &available) {
        (Some(version), Some(Some(next))) => format!("Upgrade available: {version} → {next}"),
        (Some(version), _) => format!("Kubernetes {version} is running; no upgrade requested"),
        (None, _) => "No Kubernetes upgrade requested".to_string(),
    };
    let mut report = kind_report(UpgradeStatus::Idle, message);
    report.current = current.map(|v| v.to_string());
    report.available = available;
    if let Some(run) = dropped {
        report.condition_reason = Some("Reset");
        if run.outcome.is_none() {
            report.message = "Kubernetes upgrade stopped: the target was removed".to_string();
        }
    }
    Ok(outcome(report, Vec::new(), None))
}

/// The versions of a cluster with no Kubernetes upgrade in flight; `None` when it cannot be reached.
async fn versions_only(access: &SharedAccess<'_>) -> Option<Observation> {
    let access = access.get().await.ok()?;
    let talos_versions = access.talos_versions().await;
    Some(
        kubernetes_upgrade::observe_versions(
            &access.inventory,
            talos_versions,
            &access.workload,
            &access.workload_nodes,
        )
        .await,
    )
}

/// `kubernetes-available`: the newest catalog release one step ahead that Talos on every node supports;
/// `None` when the cluster could not be seen (the annotation stays as it is).
fn available(
    ctx: &Context,
    observation: &Observation,
    current: Option<&KubernetesVersion>,
) -> Option<Option<String>> {
    let current = current?;
    let mut talos = Vec::new();
    for node in &observation.nodes {
        match &node.talos {
            TalosApi::Up { version, .. } => talos.push(version.clone()),
            // A node whose Talos is unknown could be one that does not support the next release.
            TalosApi::Unreachable { .. } => return None,
        }
    }
    let catalog = ctx.settings.catalog.snapshot();
    Some(
        talos_upgrade_core::catalog::kubernetes_available(&catalog, current, &talos)
            .map(|v| v.to_string()),
    )
}

/// A target refused before touching any node, recorded once.
async fn decided_failure(
    name: &str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &ProgressStore,
    progress: &mut Progress,
    raw: &str,
    message: &str,
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    let already = progress.kubernetes.as_ref().is_some_and(|run| {
        run.requested == raw && matches!(run.outcome, Some(Outcome::Failed { .. }))
    });
    let mut notes = Vec::new();
    if !already {
        progress.kubernetes = Some(KubeRun {
            requested: raw.to_string(),
            target: String::new(),
            from: String::new(),
            started_at: now,
            outcome: Some(Outcome::Failed {
                at: now,
                node: None,
                reason: message.to_string(),
            }),
            steps: Vec::new(),
        });
        store.save(name, owner, progress).await?;
        notes.push(Note {
            type_: NoteType::Warning,
            reason: "InvalidTarget",
            message: message.to_string(),
        });
    }
    let recorded = progress
        .kubernetes
        .as_ref()
        .and_then(|run| match &run.outcome {
            Some(Outcome::Failed { reason, .. }) => Some(reason.clone()),
            _ => None,
        })
        .unwrap_or_else(|| message.to_string());
    let mut report = kind_report(UpgradeStatus::Failed, recorded);
    report.condition_reason = Some("Failed");
    Ok(outcome(report, notes, None))
}

struct Request<'a> {
    cluster: &'a KubernetesCluster,
    ctx: &'a Context,
    access: &'a SharedAccess<'a>,
    intent: &'a UpgradeIntent,
    name: &'a str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &'a ProgressStore,
    raw: &'a str,
    target: &'a KubernetesVersion,
    talos: TalosGate,
    now: Timestamp,
}

async fn requested(
    request: Request<'_>,
    progress: &mut Progress,
) -> Result<FlowOutcome, super::Error> {
    let Request {
        cluster,
        ctx,
        access,
        intent,
        name,
        owner,
        store,
        raw,
        target,
        talos,
        now,
    } = request;
    let mut consumed = Vec::new();
    let mut notes = Vec::new();
    let mut existing = progress
        .kubernetes
        .clone()
        .filter(|run| run.requested == raw);
    // `resume` on a target refused before any node was touched decides it again from scratch.
    if intent.resume
        && existing.as_ref().is_some_and(|run| {
            run.steps.is_empty() && matches!(run.outcome, Some(Outcome::Failed { .. }))
        })
    {
        existing = None;
        progress.kubernetes = None;
    }
    let settings = Settings {
        paused: intent.paused,
        step_deadline: ctx.settings.step_deadline,
    };

    // A decision already made for this value stands, unless the user asks to resume a failed run.
    if let Some(run) = &existing
        && run.is_finished()
    {
        let failed = matches!(run.outcome, Some(Outcome::Failed { .. }));
        if !(failed && intent.resume && !run.steps.is_empty()) {
            if intent.resume {
                consumed.push(annotations::RESUME);
            }
            let decision = rollout::advance(run, &settings, &Observation::default(), now);
            let mut report = report_from(&decision.report);
            report.consumed = consumed;
            if run.steps.is_empty()
                && let Some(Outcome::Failed { reason, .. }) = &run.outcome
            {
                report.message = reason.clone();
            }
            // The versions still move (a later Talos upgrade changes what is available).
            if let Some(observation) = versions_only(access).await {
                let current = rollout::kubernetes_current(&observation);
                report.available = available(ctx, &observation, current.as_ref());
                report.current = current.map(|v| v.to_string());
            }
            return Ok(outcome(report, Vec::new(), None));
        }
    }

    let access = match access.get().await {
        Ok(access) => access,
        Err(problem) => {
            let message = format!("Kubernetes upgrade cannot proceed: {problem}");
            let running = existing.as_ref().is_some_and(|r| !r.is_finished());
            let mut report = kind_report(
                if running {
                    UpgradeStatus::InProgress
                } else {
                    UpgradeStatus::Failed
                },
                message.clone(),
            );
            report.condition_reason = Some(if running { "InProgress" } else { "Failed" });
            let mut notes = once(cluster, "UpgradeBlocked", &message);
            for note in &mut notes {
                note.type_ = NoteType::Warning;
            }
            return Ok(outcome(
                report,
                notes,
                Some(ctx.settings.poll_interval.max(Duration::from_secs(5))),
            ));
        }
    };
    let observation =
        kubernetes_upgrade::observe(&access.fleet, &access.inventory, &access.workload).await;
    let range = rollout::kubernetes_range(&observation);
    let current = range.as_ref().map(|(low, _)| low.to_string());
    let lowest_talos = observation
        .nodes
        .iter()
        .filter_map(|n| match &n.talos {
            TalosApi::Up { version, .. } => Some(version.semver().clone()),
            TalosApi::Unreachable { .. } => None,
        })
        .min();

    let mut run = match existing {
        Some(mut run) if run.is_finished() => {
            rollout::resume(&mut run);
            consumed.push(annotations::RESUME);
            notes.push(Note {
                type_: NoteType::Normal,
                reason: "UpgradeResumed",
                message: format!("Resuming the Kubernetes upgrade to {}", run.target),
            });
            run
        }
        Some(run) => run,
        None => {
            if intent.resume {
                consumed.push(annotations::RESUME);
            }
            let Some((lowest, highest)) = &range else {
                let mut report = kind_report(
                    UpgradeStatus::InProgress,
                    "Waiting: no node reports its Kubernetes version yet".to_string(),
                );
                report.condition_reason = Some("InProgress");
                report.consumed = consumed;
                return Ok(outcome(
                    report,
                    Vec::new(),
                    Some(ctx.settings.poll_interval),
                ));
            };
            // Invalid targets first: they are refused whatever Talos does.
            if let Err(refusal) = versions::check_kubernetes_upgrade_across(lowest, highest, target)
            {
                let reason = refusal.to_string();
                let message = format!(
                    "Kubernetes upgrade refused: {}. No node was touched.",
                    reason.trim_end_matches('.')
                );
                let mut result =
                    decided_failure(name, owner, store, progress, raw, &message, now).await?;
                result.report.current = current;
                result.report.consumed = consumed;
                return Ok(result);
            }
            if let Some(block) = blocked(&observation, target, talos) {
                let mut report = kind_report(UpgradeStatus::Blocked, block.clone());
                report.condition_reason = Some("Blocked");
                report.current = current;
                report.consumed = consumed;
                report.available = available(ctx, &observation, range.as_ref().map(|r| &r.0));
                return Ok(outcome(
                    report,
                    once(cluster, "UpgradeBlocked", &block),
                    Some(ctx.settings.poll_interval.max(Duration::from_secs(1))),
                ));
            }
            let run = rollout::start_run(raw, target, lowest, &observation, now);
            notes.push(Note {
                type_: NoteType::Normal,
                reason: "UpgradeStarted",
                message: format!(
                    "Upgrading Kubernetes from {lowest} to {target} on {} nodes",
                    run.nodes().len()
                ),
            });
            run
        }
    };

    let mode = lowest_talos
        .as_ref()
        .map(ManifestMode::for_lowest_talos)
        .unwrap_or(ManifestMode::Legacy);
    // Decide, save (write-ahead), announce, call; a step whose call is its whole effect (a pull, the
    // manifest sync) is completed at once and the next step decided in the same pass, so no time is lost
    // between steps. A patch is verified by observation, in a later pass.
    let mut announced: Vec<&'static str> = Vec::new();
    let mut decision;
    loop {
        decision = rollout::advance(&run, &settings, &observation, now);
        if progress.kubernetes.as_ref() != Some(&decision.run) {
            progress.kubernetes = Some(decision.run.clone());
            store.save(name, owner.clone(), progress).await?;
        }
        run = decision.run.clone();
        notes.append(&mut decision.report.notes);
        report::publish(&ctx.recorder, cluster, UpgradeKind::Kubernetes, &notes).await;
        announced.extend(notes.drain(..).map(|note| note.reason));

        let (Some(action), Some(index)) = (decision.actions.first(), decision.step) else {
            break;
        };
        let result = kubernetes_upgrade::execute(
            &access.fleet,
            &access.inventory,
            &access.workload,
            action,
            mode,
        )
        .await;
        match result {
            Ok(()) => match action {
                // Nothing to observe for these: the call's success is the step's end.
                Action::PullImages { .. } | Action::SyncManifests { .. } => {
                    if !rollout::complete_step(&mut run, index, now) {
                        break;
                    }
                }
                Action::PatchImage { .. } => break,
            },
            Err(ExecuteError::Refused(reason)) => {
                if rollout::fail_step(&mut run, index, &reason, now) {
                    progress.kubernetes = Some(run.clone());
                    store.save(name, owner.clone(), progress).await?;
                    let failed = rollout::advance(&run, &settings, &observation, now);
                    decision = rollout::Decision {
                        actions: Vec::new(),
                        ..failed
                    };
                    // `advance` on a finished run announces nothing; this failure is new.
                    notes.push(Note {
                        type_: NoteType::Warning,
                        reason: "UpgradeFailed",
                        message: decision.report.message.clone(),
                    });
                }
                break;
            }
            Err(ExecuteError::Transient(reason)) => {
                // Left as issued: the next pass makes the call again, until the step's deadline.
                tracing::warn!(cluster = %name, %reason, "Kubernetes upgrade call");
                break;
            }
        }
    }

    let mut report = report_from(&decision.report);
    report.current = current.clone();
    report.consumed = consumed;
    if matches!(decision.report.state, RunState::Completed) {
        report.current = Some(run.target.clone());
    }
    report.available = available(ctx, &observation, range.as_ref().map(|r| &r.0));
    let mut preflight_failure = None;
    if decision.actions.is_empty() && report.message.starts_with("Waiting:") {
        let hold = once(cluster, "UpgradeWaiting", &report.message);
        if !hold.is_empty() {
            preflight_failure = decision.report.hold.map(|check| check.as_str());
        }
        notes.extend(hold);
    }
    let requeue = match decision.report.state {
        RunState::InProgress | RunState::Paused => Some(ctx.settings.poll_interval),
        RunState::Completed | RunState::Failed => None,
    };
    let mut result = outcome(report, notes, requeue);
    result.announced = announced;
    result.run_started_at = Some(run.started_at.as_millisecond() as f64 / 1000.0);
    result.preflight_failure = preflight_failure;
    Ok(result)
}

/// Why the upgrade cannot start yet although the target is valid: a Talos upgrade to finish first, or a
/// node whose Talos does not support the target (the protocol's sentence, naming the lowest such Talos).
fn blocked(
    observation: &Observation,
    target: &KubernetesVersion,
    talos: TalosGate,
) -> Option<String> {
    if talos.upgrading {
        return Some(WAITING_FOR_TALOS.to_string());
    }
    let mut versions: Vec<&TalosVersion> = Vec::new();
    for node in &observation.nodes {
        match &node.talos {
            TalosApi::Up { version, .. } => versions.push(version),
            TalosApi::Unreachable { reason } => {
                return Some(format!(
                    "Waiting: node {}'s Talos API is unreachable ({reason}), so its support for K8s \
                     {target} cannot be checked",
                    node.name
                ));
            }
        }
    }
    versions.sort();
    versions
        .into_iter()
        .find_map(|talos| versions::check_kubernetes_target_supported(talos, target).err())
        .map(|refusal| refusal.to_string())
}

fn report_from(report: &Report) -> KindReport {
    let (status, reason) = match report.state {
        RunState::InProgress => (UpgradeStatus::InProgress, "InProgress"),
        RunState::Paused => (UpgradeStatus::InProgress, "Paused"),
        RunState::Completed => (UpgradeStatus::Completed, "Completed"),
        RunState::Failed => (UpgradeStatus::Failed, "Failed"),
    };
    KindReport {
        kind: UpgradeKind::Kubernetes,
        status,
        message: report.message.clone(),
        progress: (report.total > 0).then_some((report.done, report.total)),
        current: None,
        available: None,
        failed_nodes: report.failed_nodes.clone(),
        in_flight: report.in_flight.clone(),
        condition_reason: Some(reason),
        consumed: Vec::new(),
    }
}
