//! The Talos OS upgrade of one cluster, one reconcile at a time: intent and persisted progress in,
//! observation, decision, write-ahead, calls, and a report out.

use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use kube::{Resource, ResourceExt};
use semver::Version;

use super::Context;
use super::access::{Access, SharedAccess};
use super::acknowledge::LastLook;
use super::report::{self, KindReport};
use super::wakeups::FollowedNode;
use crate::credentials;
use crate::drain;
use crate::inventory::{self, AddressNeed, WorkloadNodeInfo};
use crate::progress_store::{Progress, ProgressStore};
use crate::talos_fleet::{InventoryNode, TalosFleet, control_planes};
use talos_api::{LegacyUpgradeOptions, RebootMode, TalosError};
use talos_upgrade_core::annotations::{self, UpgradeKind, UpgradeStatus};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::intent::{Target, UpgradeIntent};
use talos_upgrade_core::run::{NodeRole, Note, NoteType, Outcome, RunState};
use talos_upgrade_core::talos::{
    self as rollout, Action, Decision, NodeObservation, NodeStep, Observation, Run, Settings,
    TalosState, UpgradeApi,
};
use talos_upgrade_core::versions::{self, KubernetesVersion, TalosVersion};

/// How often a run whose nodes in flight are all rebooting, and all followed, is looked at anyway. The
/// followers wake the reconcile when a node is back; this poll only bounds what a lost stream costs
/// and notices a node deadline. Never shorter than `--poll-interval`.
const FOLLOWED_POLL_INTERVAL: Duration = Duration::from_secs(15);

/// What the reconcile reports and when it wants to look again.
pub struct FlowOutcome {
    pub report: KindReport,
    /// Events still to publish.
    pub notes: Vec<Note>,
    /// Reasons of events this reconcile already published (before its calls).
    pub announced: Vec<&'static str>,
    /// Nodes this reconcile found done, with how long each took from its upgrade call (for metrics).
    pub nodes_finished: Vec<(NodeRole, f64)>,
    /// When the run being reported started (Unix seconds).
    pub run_started_at: Option<f64>,
    /// A preflight check that started holding the run in this reconcile (counted once per hold).
    pub preflight_failure: Option<&'static str>,
    pub requeue: Option<Duration>,
    /// Nodes in flight after this reconcile, to follow until they are back (empty: follow none).
    pub follow: Vec<FollowedNode>,
    /// The cluster as written by a report made during the flow (before its calls), if any.
    pub reported: Option<KubernetesCluster>,
}

/// The cluster as observed for the Talos upgrade.
struct Observed {
    observation: Observation,
    fleet: Arc<TalosFleet>,
    inventory: Vec<InventoryNode>,
    /// Lowest and highest Talos version among the nodes that answered.
    talos_range: Option<(Version, Version)>,
    /// Lowest kubelet version reported by the workload Nodes.
    kubernetes: Option<String>,
    /// The workload cluster, for cordon, drain and uncordon.
    workload: kube::Client,
    /// When the nodes' Talos APIs were asked: a follower started later replays what changed since.
    observed_at: std::time::Instant,
}

fn kind_report(status: UpgradeStatus, message: String) -> KindReport {
    KindReport::new(UpgradeKind::Talos, status, message)
}

/// An outcome with nothing but a report, its events and when to look again.
pub(super) fn outcome(
    report: KindReport,
    notes: Vec<Note>,
    requeue: Option<Duration>,
) -> FlowOutcome {
    FlowOutcome {
        report,
        notes,
        announced: Vec::new(),
        nodes_finished: Vec::new(),
        run_started_at: None,
        preflight_failure: None,
        requeue,
        follow: Vec::new(),
        reported: None,
    }
}

/// A Warning event, announced only when the Talos message is new.
fn warn_once(cluster: &KubernetesCluster, reason: &'static str, message: &str) -> Vec<Note> {
    report::note_once(
        cluster,
        UpgradeKind::Talos,
        NoteType::Warning,
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
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    let name = cluster.name_any();
    let owner = cluster.controller_owner_ref(&());

    // 1. Reset: forget everything about the Talos upgrade, touch no node.
    if intent.talos_reset {
        if progress.talos.take().is_some() {
            store.save(&name, owner, progress).await?;
        }
        let mut report = kind_report(
            UpgradeStatus::Idle,
            "Talos upgrade state was reset; no node was touched".to_string(),
        );
        report.condition_reason = Some("Reset");
        report.consumed = vec![
            annotations::TALOS_RESET_UPGRADE_STATE,
            annotations::TALOS_TARGET,
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
        .get(annotations::TALOS_TARGET)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());

    match (&intent.talos_target, raw_target) {
        (Target::Absent, _) | (_, None) => {
            absent(cluster, ctx, access, &name, owner, store, progress, now).await
        }
        (Target::Invalid { reason, .. }, Some(raw)) => {
            // The parse error quotes the value and says what to write instead (`"1.12" is not a
            // version: use MAJOR.MINOR.PATCH, e.g. 1.12.0`).
            let message = format!("Invalid talos-target: {reason}. No node was touched.");
            let mut result =
                decided_failure(&name, owner, store, progress, &raw, &message, now).await?;
            // Nothing to resume while the value is not a version: the key is consumed, not left
            // behind to act on some later target.
            if intent.resume {
                result.report.consumed.push(annotations::RESUME);
            }
            Ok(result)
        }
        (Target::Version(target), Some(raw)) => {
            requested(
                cluster, ctx, access, intent, &name, owner, store, progress, &raw, target, now,
            )
            .await
        }
    }
}

/// No target: finish nodes in flight, then forget the run; report the running version.
#[allow(clippy::too_many_arguments)]
async fn absent(
    cluster: &KubernetesCluster,
    ctx: &Context,
    access: &SharedAccess<'_>,
    name: &str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &ProgressStore,
    progress: &mut Progress,
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    let in_flight = progress.talos.as_ref().is_some_and(|run| {
        !run.is_finished()
            && run
                .nodes
                .iter()
                .any(|n| matches!(n.step, NodeStep::Issued { .. }))
    });
    if in_flight {
        let observed = observe(access, &StartingNodes::Named(Vec::new())).await;
        // Nodes in flight that cannot be seen right now (a transient API error, every node slow to answer)
        // are not given up on: the run is kept until they are seen finished.
        if let Err(problem) = &observed {
            let mut report = kind_report(
                UpgradeStatus::InProgress,
                format!(
                    "Talos target removed: finishing the node(s) in flight before stopping ({problem})"
                ),
            );
            keep_run_shown(&mut report, progress.talos.as_ref());
            report.condition_reason = Some("InProgress");
            return Ok(outcome(
                report,
                Vec::new(),
                Some(ctx.settings.poll_interval),
            ));
        }
        if let (Ok(observed), Some(run)) = (&observed, progress.talos.as_ref()) {
            // Paused: only the node(s) in flight are followed, so the order plays no part.
            let settings = Settings {
                paused: true,
                ..settings(ctx, talos_upgrade_core::intent::UpgradeOrder::default())
            };
            let decision =
                rollout::advance(run, &settings, &observed.observation, &derive_image, now);
            if decision.run != *run {
                progress.talos = Some(decision.run.clone());
                store.save(name, owner.clone(), progress).await?;
            }
            if !decision.report.in_flight.is_empty() {
                let mut report = kind_report(
                    UpgradeStatus::InProgress,
                    format!(
                        "Talos target removed: finishing {} before stopping",
                        decision.report.in_flight.join(", ")
                    ),
                );
                report.progress = Some((decision.report.done, decision.report.total));
                report.condition_reason = Some("InProgress");
                let mut result = outcome(
                    report,
                    decision.report.notes,
                    Some(ctx.settings.poll_interval),
                );
                result.follow = followed(observed, &decision.report.in_flight);
                return Ok(result);
            }
        }
    }
    let dropped = progress.talos.take();
    let stopped = dropped.as_ref().is_some_and(|run| !run.is_finished());
    // Removing the target of a failed run is the documented way to clear the failure: the condition
    // must not go on saying `Failed` while the status is `idle` and the phase `Ready`.
    let cleared_failure = dropped
        .as_ref()
        .is_some_and(|run| matches!(run.outcome, Some(Outcome::Failed { .. })));
    if dropped.is_some() {
        store.save(name, owner, progress).await?;
    }
    let (current, available, look) = idle_versions(ctx, access, now).await;
    ctx.last_looks.note(super::cluster_key(cluster), look);
    let message = match (&current, &available) {
        (Some(version), Some(Some(next))) => format!("Upgrade available: {version} → {next}"),
        (Some(version), _) => format!("Talos {version} is running; no upgrade requested"),
        (None, _) => "No Talos upgrade requested".to_string(),
    };
    let mut report = kind_report(UpgradeStatus::Idle, message);
    report.current = current;
    report.available = available;
    if stopped {
        report.condition_reason = Some("Reset");
        report.message = "Talos upgrade stopped: the target was removed".to_string();
    } else if cleared_failure {
        report.condition_reason = Some("Reset");
    }
    Ok(outcome(report, Vec::new(), None))
}

/// A target refused before touching any node: recorded once, so it is not decided again until the
/// annotation changes (or `resume`/reset).
#[allow(clippy::too_many_arguments)]
async fn decided_failure(
    name: &str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &ProgressStore,
    progress: &mut Progress,
    raw: &str,
    message: &str,
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    let already = progress.talos.as_ref().is_some_and(|run| {
        run.requested == raw && matches!(run.outcome, Some(Outcome::Failed { .. }))
    });
    let mut notes = Vec::new();
    if !already {
        progress.talos = Some(Run {
            requested: raw.to_string(),
            target: String::new(),
            started_at: now,
            outcome: Some(Outcome::Failed {
                at: now,
                node: None,
                reason: message.to_string(),
            }),
            nodes: Vec::new(),
        });
        store.save(name, owner, progress).await?;
        notes.push(Note {
            type_: NoteType::Warning,
            reason: "InvalidTarget",
            message: message.to_string(),
        });
    }
    let recorded = progress
        .talos
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

#[allow(clippy::too_many_arguments)]
async fn requested(
    cluster: &KubernetesCluster,
    ctx: &Context,
    access: &SharedAccess<'_>,
    intent: &UpgradeIntent,
    name: &str,
    owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    store: &ProgressStore,
    progress: &mut Progress,
    raw: &str,
    target: &TalosVersion,
    now: Timestamp,
) -> Result<FlowOutcome, super::Error> {
    // Bad options stop a run from starting (or going on) until they are fixed.
    let (order, parallel) = match (&intent.order, &intent.max_parallel_workers) {
        (Ok(order), Ok(parallel)) => (*order, parallel.get() as usize),
        (Err(invalid), _) | (_, Err(invalid)) => {
            let message = format!("Talos upgrade not started: {invalid}");
            let mut report = kind_report(UpgradeStatus::Failed, message.clone());
            report.condition_reason = Some("Failed");
            return Ok(outcome(
                report,
                warn_once(cluster, "InvalidOption", &message),
                None,
            ));
        }
    };
    let mut consumed = Vec::new();
    let mut notes = Vec::new();
    let mut existing = progress.talos.clone().filter(|run| run.requested == raw);
    // `resume` on a target refused before any node was touched decides it again from scratch: the
    // cluster may have changed since (Kubernetes upgraded, a node replaced), and a refusal that still
    // holds is announced again, since the user asked.
    if intent.resume
        && existing.as_ref().is_some_and(|run| {
            run.nodes.is_empty() && matches!(run.outcome, Some(Outcome::Failed { .. }))
        })
    {
        existing = None;
        progress.talos = None;
    }

    // A decision already made for this value stands, unless the user asks to resume a failed run.
    if let Some(run) = &existing
        && run.is_finished()
    {
        let failed = matches!(run.outcome, Some(Outcome::Failed { .. }));
        if !(failed && intent.resume && !run.nodes.is_empty()) {
            if intent.resume {
                consumed.push(annotations::RESUME);
            }
            let decision = rollout::advance(
                run,
                &settings(ctx, order),
                &Observation::default(),
                &derive_image,
                now,
            );
            let mut report = report_from(&decision);
            report.consumed = consumed;
            if run.nodes.is_empty()
                && let Some(Outcome::Failed { reason, .. }) = &run.outcome
            {
                report.message = reason.clone();
            }
            let mut result = outcome(report, Vec::new(), None);
            // Only runs that touched nodes have a start worth showing; a refused target has none.
            if !run.nodes.is_empty() {
                result.run_started_at = Some(run.started_at.as_millisecond() as f64 / 1000.0);
            }
            return Ok(result);
        }
    }

    let settings = Settings {
        max_parallel_workers: parallel,
        paused: intent.paused,
        ..settings(ctx, order)
    };
    // The machine configs (installer images) of the nodes this pass may start are read together with
    // every node's state, not one round trip after it: the run under way names them; a run about to
    // start begins with the nodes of the role its order puts first.
    let may_start_next = match &existing {
        Some(run) if !run.is_finished() => StartingNodes::Named(
            rollout::may_start(run, &settings)
                .into_iter()
                .map(str::to_string)
                .collect(),
        ),
        Some(_) => StartingNodes::Named(Vec::new()),
        None => StartingNodes::FirstInOrder(order),
    };
    let observed = observe(access, &may_start_next).await;
    ctx.last_looks.note(
        super::cluster_key(cluster),
        observed.as_ref().ok().and_then(|observed| {
            Some(LastLook {
                talos: observed.talos_range.clone()?,
                kubernetes: observed.kubernetes.clone(),
                at: now,
            })
        }),
    );
    let mut observed = match observed {
        Ok(observed) => observed,
        Err(problem) => {
            let message = format!("Talos upgrade cannot proceed: {problem}");
            let mut report = kind_report(
                if existing.as_ref().is_some_and(|r| !r.is_finished()) {
                    UpgradeStatus::InProgress
                } else {
                    UpgradeStatus::Failed
                },
                message.clone(),
            );
            keep_run_shown(&mut report, existing.as_ref());
            report.condition_reason = Some(if report.status == UpgradeStatus::Failed {
                "Failed"
            } else {
                "InProgress"
            });
            return Ok(outcome(
                report,
                warn_once(cluster, "UpgradeBlocked", &message),
                Some(ctx.settings.poll_interval.max(Duration::from_secs(5))),
            ));
        }
    };
    let current = observed
        .talos_range
        .as_ref()
        .map(|(low, _)| low.to_string());

    let run = match existing {
        Some(mut run) if run.is_finished() => {
            // Resume: the failed node goes back to pending; everything done stays done.
            for node in &mut run.nodes {
                if matches!(node.step, NodeStep::Failed { .. }) {
                    node.step = NodeStep::Pending;
                }
            }
            run.outcome = None;
            consumed.push(annotations::RESUME);
            notes.push(Note {
                type_: NoteType::Normal,
                reason: "UpgradeResumed",
                message: format!("Resuming the Talos upgrade to {}", run.target),
            });
            run
        }
        Some(run) => run,
        None => {
            if intent.resume {
                consumed.push(annotations::RESUME);
            }
            let Some((lowest, highest)) = &observed.talos_range else {
                let mut report = kind_report(
                    UpgradeStatus::InProgress,
                    "Waiting: no node's Talos API answers yet".to_string(),
                );
                report.condition_reason = Some("InProgress");
                report.consumed = consumed;
                return Ok(outcome(
                    report,
                    Vec::new(),
                    Some(ctx.settings.poll_interval),
                ));
            };
            let lowest = TalosVersion::from_semver(lowest.clone());
            let highest = TalosVersion::from_semver(highest.clone());
            let refusal =
                check_new_run(&lowest, &highest, observed.kubernetes.as_deref(), target).err();
            if let Some(reason) = refusal {
                // The version rules' sentences may end in a full stop of their own.
                let reason = reason.trim_end_matches('.');
                let message = format!("Talos upgrade refused: {reason}. No node was touched.");
                let mut result =
                    decided_failure(name, owner, store, progress, raw, &message, now).await?;
                result.report.current = current;
                result.report.consumed = consumed;
                return Ok(result);
            }
            // Never both at once: a Kubernetes upgrade under way (static pods being patched, kubelets
            // restarting) finishes before any node reboots for Talos.
            if let Some(kubernetes) = progress
                .kubernetes
                .as_ref()
                .filter(|run| !run.is_finished() && !run.steps.is_empty())
            {
                let mut report = kind_report(
                    UpgradeStatus::InProgress,
                    format!(
                        "Waiting: the Kubernetes upgrade to {} is running; the Talos upgrade starts when it is done",
                        kubernetes.target
                    ),
                );
                report.condition_reason = Some("InProgress");
                report.current = current;
                report.consumed = consumed;
                let notes = report::note_once(
                    cluster,
                    UpgradeKind::Talos,
                    NoteType::Normal,
                    "UpgradeWaiting",
                    &report.message,
                );
                return Ok(outcome(report, notes, Some(ctx.settings.poll_interval)));
            }
            let run = rollout::start_run(raw, target.semver(), order, &observed.observation, now);
            notes.push(Note {
                type_: NoteType::Normal,
                reason: "UpgradeStarted",
                message: format!(
                    "Upgrading Talos from {lowest} to {target} on {} nodes ({} already on {target})",
                    run.nodes.len(),
                    run.counts().0
                ),
            });
            run
        }
    };

    drain_pass(&run, &mut observed).await;
    read_installer_images(&mut observed, &rollout::may_start(&run, &settings)).await;
    let mut decision = rollout::advance(&run, &settings, &observed.observation, &derive_image, now);
    let nodes_finished = newly_done(&run, &decision.run);
    notes.append(&mut decision.report.notes);
    let pass = Pass {
        ctx,
        cluster,
        store,
        name,
        owner: &owner,
        current: &current,
        consumed: &consumed,
        now,
    };
    let mut acted = pass.act(progress, &observed, &decision, &notes).await?;
    let mut announced: Vec<&'static str> = notes.drain(..).map(|note| note.reason).collect();
    // etcd leadership moved off the next control plane: etcd is looked at once more, and when that
    // fresh look shows it healthy with another leader, the control plane is upgraded in this same
    // reconcile rather than after another read of the Secret and the Nodes. (The fresh look is what
    // the upgrade needs: Talos's legacy upgrade checks every etcd member when it gets the call, and an
    // election still in progress would fail it.) Otherwise the next reconcile comes at once.
    if acted.calls.leadership_moved && acted.calls.failed_call.is_none() {
        observed.observation.etcd = observed
            .fleet
            .observe_etcd(&control_planes(&observed.inventory))
            .await;
        let mut next = rollout::advance(
            &acted.run,
            &settings,
            &observed.observation,
            &derive_image,
            now,
        );
        if !next.actions.is_empty() && !next.actions.iter().any(is_leadership_move) {
            notes.append(&mut next.report.notes);
            let second = pass.act(progress, &observed, &next, &notes).await?;
            announced.extend(notes.drain(..).map(|note| note.reason));
            acted = Acted {
                reported: second.reported.or(acted.reported),
                ..second
            };
            decision = next;
        }
    }
    let Acted {
        reported,
        calls:
            Calls {
                failed_call,
                installed,
                answered,
                leadership_moved,
            },
        mut run,
    } = acted;
    if (installed || answered) && failed_call.is_none() {
        // Draining starts with the next pass; the run must say so before anything else happens.
        progress.talos = Some(run.clone());
        store.save(name, owner.clone(), progress).await?;
        decision.run = run.clone();
    }
    if let Some((node, reason)) = failed_call {
        let cleanup = rollout::fail_node(&mut run, &node, &reason, now);
        progress.talos = Some(run.clone());
        store.save(name, owner, progress).await?;
        if let Some(cleanup) = cleanup
            && let Err((node, reason)) = execute(&observed, &cleanup).await
        {
            tracing::warn!(%node, %reason, "uncordoning after a failed upgrade");
        }
        let mut failed =
            rollout::advance(&run, &settings, &observed.observation, &derive_image, now);
        // `advance` on an already-failed run announces nothing; this failure is new.
        failed.report.notes.push(Note {
            type_: NoteType::Warning,
            reason: "UpgradeFailed",
            message: failed.report.message.clone(),
        });
        decision = Decision {
            actions: Vec::new(),
            ..failed
        };
    }
    notes.append(&mut decision.report.notes);
    let mut report = report_from(&decision);
    report.current = current;
    report.available = available(ctx, &observed);
    report.consumed = consumed;
    // A hold (preflight, etcd, pause) is announced once when it starts or changes, not on every pass.
    let hold_started = decision.actions.is_empty()
        && report.message.starts_with("Waiting:")
        && cluster.annotations().get(annotations::TALOS_MESSAGE) != Some(&report.message);
    let preflight_failure = decision
        .report
        .hold
        .filter(|check| hold_started && check.is_failure())
        .map(|check| check.as_str());
    if hold_started {
        notes.push(Note {
            type_: NoteType::Normal,
            reason: "UpgradeWaiting",
            message: report.message.clone(),
        });
    }
    let follow = followed(&observed, &decision.report.in_flight);
    let requeue = match decision.report.state {
        // etcd leadership moved off the next control plane: upgrade it now, not a poll later. (A call
        // that failed has failed the run: `fail_node` ends it, so the state is no longer in progress.)
        RunState::InProgress if leadership_moved => Some(Duration::ZERO),
        // Every node in flight is rebooting and followed: its follower wakes the reconcile when it is
        // back, so the poll is only the safety net (a lost stream, the node deadline).
        RunState::InProgress
            if decision.report.awaiting_reboots
                && follow.len() == decision.report.in_flight.len() =>
        {
            Some(ctx.settings.poll_interval.max(FOLLOWED_POLL_INTERVAL))
        }
        RunState::InProgress | RunState::Paused => Some(ctx.settings.poll_interval),
        RunState::Completed | RunState::Failed => None,
    };
    let mut result = outcome(report, notes, requeue);
    result.announced = announced;
    result.nodes_finished = nodes_finished;
    result.preflight_failure = preflight_failure;
    result.run_started_at = Some(run.started_at.as_millisecond() as f64 / 1000.0);
    result.follow = follow;
    result.reported = reported;
    Ok(result)
}

/// What one reconcile needs to act on a decision.
struct Pass<'a> {
    ctx: &'a Context,
    cluster: &'a KubernetesCluster,
    store: &'a ProgressStore,
    name: &'a str,
    owner: &'a Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    current: &'a Option<String>,
    consumed: &'a [&'static str],
    now: Timestamp,
}

/// What acting on a decision did.
struct Acted {
    /// The cluster as written by the report made before the calls, if one was.
    reported: Option<KubernetesCluster>,
    calls: Calls,
    /// The run after the calls (answered calls recorded).
    run: Run,
}

fn is_leadership_move(action: &Action) -> bool {
    matches!(action, Action::ForfeitEtcdLeadership { .. })
}

impl Pass<'_> {
    /// Reports what is about to happen, announces it, saves the run and makes the decided calls.
    ///
    /// The status says what is about to happen before the calls: an install (Talos >= 1.13 pulls and
    /// writes the new image first) can take minutes, and `kubectl wait` and the message should show
    /// the run and the node being upgraded during it, not after it. The events announce it before it
    /// is done too: if the controller dies during the calls, the next one resumes from the saved run
    /// and would never tell them. Report, events and the write-ahead go out together, and the calls
    /// wait for the write-ahead and the events only, not for the report (two patches of the cluster,
    /// the slowest writes): a node's return costs no round trip to the API server before the next
    /// call but the write-ahead, and recording a call and making it stay as close as they can be (a
    /// controller killed between the two leaves the call recorded as unanswered, and `advance` makes
    /// it again once the node is seen not to have got it). Should the save fail, no call is made and
    /// the next reconcile decides, reports and announces again (a repeated event counts up its
    /// series). The reconcile's own report follows the calls, once the early one is written.
    ///
    /// Moving etcd leadership changes no node and takes a moment: it is neither reported before
    /// (the report after it, or the upgrade it makes way for, says what happened) nor kept waiting
    /// for the save.
    async fn act(
        &self,
        progress: &mut Progress,
        observed: &Observed,
        decision: &Decision,
        notes: &[Note],
    ) -> Result<Acted, super::Error> {
        let Pass {
            ctx,
            cluster,
            store,
            name,
            owner,
            current,
            consumed,
            now,
        } = *self;
        let changes_nodes = decision.actions.iter().any(|a| !is_leadership_move(a));
        let early = changes_nodes.then(|| {
            let mut early = report_from(decision);
            early.current = current.clone();
            early.consumed = consumed.to_vec();
            early
        });
        let api: &kube::Api<KubernetesCluster> =
            &kube::Api::namespaced(ctx.client.clone(), &cluster.namespace().unwrap_or_default());
        let write_early = early.as_ref().map(|early| async move {
            report::write(api, &ctx.recorder, cluster, &[(early, &[])], now).await
        });
        // Write-ahead: the run, with every call about to be made recorded as issued, is saved first.
        let write_ahead = async {
            if progress.talos.as_ref() != Some(&decision.run) {
                progress.talos = Some(decision.run.clone());
                store.save(name, owner.clone(), progress).await?;
            }
            Ok::<(), super::Error>(())
        };
        let mut run = decision.run.clone();
        let announce_save_and_call = async {
            let announce = report::publish(&ctx.recorder, cluster, UpgradeKind::Talos, notes);
            if changes_nodes {
                let ((), saved) = tokio::join!(announce, write_ahead);
                saved?;
                Ok(make_calls(observed, &decision.actions, &mut run, now).await)
            } else {
                let ((), saved, calls) = tokio::join!(
                    announce,
                    write_ahead,
                    make_calls(observed, &decision.actions, &mut run, now)
                );
                saved.map(|()| calls)
            }
        };
        let (written, calls) = tokio::join!(
            futures::future::OptionFuture::from(write_early),
            announce_save_and_call,
        );
        let reported = match written.transpose() {
            Ok(written) => written.flatten(),
            // Not fatal: the report after the calls says it all again.
            Err(error) => {
                tracing::warn!(%error, "reporting the run before its calls");
                None
            }
        };
        Ok(Acted {
            reported,
            calls: calls?,
            run,
        })
    }
}

/// What the calls of one pass did.
struct Calls {
    /// The node whose call failed, and why (the calls after it were not made).
    failed_call: Option<(String, String)>,
    /// A Talos >= 1.13 install succeeded.
    installed: bool,
    /// A legacy upgrade or a reboot was answered.
    answered: bool,
    /// etcd leadership moved off a control plane.
    leadership_moved: bool,
}

/// Makes the decided calls in order, recording in `run` each one the node answered; stops at the
/// first failed call.
async fn make_calls(
    observed: &Observed,
    actions: &[Action],
    run: &mut Run,
    now: Timestamp,
) -> Calls {
    let mut calls = Calls {
        failed_call: None,
        installed: false,
        answered: false,
        leadership_moved: false,
    };
    for action in actions {
        match execute(observed, action).await {
            // An install is made again next pass; a legacy upgrade or a reboot stays recorded as
            // unanswered, and is made again only if the node is then seen not to have got it.
            Ok(Called::NotReached) => {}
            Ok(Called::Done) => {
                if let Action::ForfeitEtcdLeadership { .. } = action {
                    calls.leadership_moved = true;
                }
                if let Action::Upgrade {
                    node,
                    api: UpgradeApi::Legacy,
                    ..
                }
                | Action::Reboot { node } = action
                {
                    rollout::answered(run, node);
                    calls.answered = true;
                }
                if let Action::Upgrade {
                    node,
                    api: UpgradeApi::Lifecycle,
                    ..
                } = action
                {
                    let cordoned = observed
                        .observation
                        .nodes
                        .iter()
                        .any(|n| &n.name == node && n.cordoned);
                    rollout::installed(run, node, cordoned, now);
                    calls.installed = true;
                }
            }
            Err((node, reason)) => {
                calls.failed_call = Some((node, reason));
                break;
            }
        }
    }
    calls
}

/// The connections to follow the named nodes in flight with.
fn followed(observed: &Observed, in_flight: &[String]) -> Vec<FollowedNode> {
    observed
        .inventory
        .iter()
        .filter(|node| in_flight.contains(&node.name))
        .filter_map(|node| {
            let seen = observed
                .observation
                .nodes
                .iter()
                .find(|n| n.name == node.name)
                .map(|n| (n.kubernetes_ready, n.cordoned));
            Some(FollowedNode {
                name: node.name.clone(),
                talos: observed.fleet.client(node.address).ok()?,
                workload: observed.workload.clone(),
                observed_at: observed.observed_at,
                seen,
            })
        })
        .collect()
}

/// `talos-available` from the release catalog: the newest target the nodes' versions and the running
/// Kubernetes allow. `None` when the nodes' versions are not known this time (the annotation stays).
fn available(ctx: &Context, observed: &Observed) -> Option<Option<String>> {
    available_for(
        ctx,
        observed.talos_range.as_ref()?,
        observed.kubernetes.as_deref(),
    )
}

fn available_for(
    ctx: &Context,
    (lowest, highest): &(Version, Version),
    kubernetes: Option<&str>,
) -> Option<Option<String>> {
    let running: Vec<KubernetesVersion> = kubernetes
        .and_then(|v| KubernetesVersion::parse(v).ok())
        .into_iter()
        .collect();
    let catalog = ctx.settings.catalog.snapshot();
    Some(
        talos_upgrade_core::catalog::talos_available(
            &catalog,
            &TalosVersion::from_semver(lowest.clone()),
            &TalosVersion::from_semver(highest.clone()),
            &running,
        )
        .map(|v| v.to_string()),
    )
}

/// `talos-current` and `talos-available` of a cluster with nothing in flight, from one `Version` call
/// per node and the workload Nodes (no etcd, no machine configs): what an idle refresh costs.
async fn idle_versions(
    ctx: &Context,
    access: &SharedAccess<'_>,
    now: Timestamp,
) -> (Option<String>, Option<Option<String>>, Option<LastLook>) {
    let Ok(access) = access.get().await else {
        return (None, None, None);
    };
    let versions: Vec<&Version> = access
        .talos_versions()
        .await
        .iter()
        .filter_map(|answer| answer.as_ref().ok())
        .collect();
    let Some(range) = version_range(&versions) else {
        return (None, None, None);
    };
    let kubernetes = kubelet_floor(access);
    (
        Some(range.0.to_string()),
        available_for(ctx, &range, kubernetes.as_deref()),
        Some(LastLook {
            talos: range,
            kubernetes,
            at: now,
        }),
    )
}

/// The version rules a new run's start applies to what the nodes run: the one-step path from the
/// lowest node, no downgrade of the highest, and a target that supports the running Kubernetes (when
/// it is known). `Err` is the refusal's sentence. The acknowledgement of a new target judges the last
/// look by the same rules (`super::acknowledge`).
pub(super) fn check_new_run(
    lowest: &TalosVersion,
    highest: &TalosVersion,
    kubernetes: Option<&str>,
    target: &TalosVersion,
) -> Result<versions::TalosStep, String> {
    let step =
        versions::check_talos_upgrade_across(lowest, highest, target).map_err(|e| e.to_string())?;
    if let Some(running) = kubernetes.and_then(|v| KubernetesVersion::parse(v).ok()) {
        versions::check_talos_target_supports(target, &running).map_err(|e| e.to_string())?;
    }
    Ok(step)
}

fn version_range(versions: &[&Version]) -> Option<(Version, Version)> {
    let lowest = versions.iter().min()?;
    let highest = versions.iter().max()?;
    Some(((*lowest).clone(), (*highest).clone()))
}

/// The Kubernetes the Talos target must support: the lowest kubelet among this cluster's Talos nodes.
/// A workload Node that is not in the inventory (not a Talos node of this cluster) does not count.
fn kubelet_floor(access: &Access) -> Option<String> {
    access
        .workload_nodes
        .iter()
        .filter(|n| access.inventory.iter().any(|node| node.name == n.node.name))
        .filter_map(|n| {
            n.kubelet_version
                .as_deref()
                .and_then(|v| Version::parse(v).ok())
        })
        .min()
        .map(|v| v.to_string())
}

/// Nodes that were in flight in `before` and are done in `after`, with their upgrade durations.
fn newly_done(before: &Run, after: &Run) -> Vec<(NodeRole, f64)> {
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

fn settings(ctx: &Context, order: talos_upgrade_core::intent::UpgradeOrder) -> Settings {
    Settings {
        order,
        max_parallel_workers: 1,
        paused: false,
        node_deadline: ctx.settings.node_deadline,
        drain_timeout: ctx.settings.drain_timeout,
        unanswered_grace: ctx.settings.unanswered_grace,
    }
}

fn derive_image(current: &str, target: &Version) -> Result<String, String> {
    versions::installer_image_for(current, &TalosVersion::from_semver(target.clone()))
        .map_err(|e| e.to_string())
}

/// Keeps what the annotations show of a run still under way (`talos-progress`, the nodes in flight for
/// the metrics) in a report made without a decision, when the nodes could not be looked at: the run
/// is held, not gone.
fn keep_run_shown(report: &mut KindReport, run: Option<&Run>) {
    let Some(run) = run.filter(|run| !run.is_finished()) else {
        return;
    };
    let (done, total) = run.counts();
    report.progress = (total > 0).then_some((done, total));
    report.in_flight = run.in_flight();
}

fn report_from(decision: &Decision) -> KindReport {
    let r = &decision.report;
    let (status, reason) = match r.state {
        RunState::InProgress => (UpgradeStatus::InProgress, "InProgress"),
        RunState::Paused => (UpgradeStatus::InProgress, "Paused"),
        RunState::Completed => (UpgradeStatus::Completed, "Completed"),
        RunState::Failed => (UpgradeStatus::Failed, "Failed"),
    };
    KindReport {
        kind: UpgradeKind::Talos,
        status,
        message: r.message.clone(),
        progress: (r.total > 0).then_some((r.done, r.total)),
        current: None,
        available: None,
        failed_nodes: r.failed_nodes.clone(),
        in_flight: r.in_flight.clone(),
        condition_reason: Some(reason),
        consumed: Vec::new(),
    }
}

/// How a call went, when the node did not refuse it.
enum Called {
    /// The call did what it should.
    Done,
    /// The node could not be reached, so it may never have got the call: an install is made again next
    /// pass; a legacy upgrade or a reboot stays recorded as unanswered.
    NotReached,
}

/// Makes one call. `Err((node, reason))` means the node refused for good and the run must fail.
async fn execute(observed: &Observed, action: &Action) -> Result<Called, (String, String)> {
    let node_name = action.node().to_string();
    if let Action::Uncordon { .. } = action {
        // Best effort: while the node is in flight the next pass uncordons it again if this failed.
        if let Err(error) = drain::uncordon(&observed.workload, &node_name).await {
            tracing::warn!(node = %node_name, %error, "uncordoning");
        }
        return Ok(Called::Done);
    }
    let Some(node) = observed.inventory.iter().find(|n| n.name == node_name) else {
        return Err((node_name, "is no longer in the node inventory".to_string()));
    };
    let client = observed
        .fleet
        .client(node.address)
        .map_err(|e| (node_name.clone(), format!("cannot be reached: {e}")))?;
    let (result, what) = match action {
        Action::Uncordon { .. } => return Ok(Called::Done),
        Action::ForfeitEtcdLeadership { .. } => {
            // Best effort: if it fails, the next reconcile sees the same leader and tries again.
            if let Err(error) = client.etcd_forfeit_leadership().await {
                tracing::warn!(node = %node_name, %error, "moving etcd leadership");
            }
            return Ok(Called::Done);
        }
        Action::Upgrade {
            installer_image,
            api: UpgradeApi::Legacy,
            ..
        } => (
            client
                .upgrade_legacy(
                    installer_image,
                    &LegacyUpgradeOptions {
                        preserve: true,
                        ..LegacyUpgradeOptions::default()
                    },
                )
                .await
                .map(|_| ()),
            "the upgrade",
        ),
        Action::Upgrade {
            installer_image,
            api: UpgradeApi::Lifecycle,
            ..
        } => {
            let install = async {
                client.image_pull(installer_image).await?;
                client.lifecycle_upgrade(installer_image).await
            };
            match install.await {
                Ok(_) => return Ok(Called::Done),
                // An install that did not finish has not happened: the node runs its old system
                // untouched, so the next pass installs again.
                Err(error) if error.is_unreachable() => {
                    tracing::warn!(node = %node_name, %error, "installing the new system");
                    return Ok(Called::NotReached);
                }
                Err(error) => (Err(error), "the installation"),
            }
        }
        Action::Reboot { .. } => (
            client.reboot(RebootMode::Default).await.map(|_| ()),
            "the reboot",
        ),
    };
    match (result, action) {
        (Ok(()), _) => Ok(Called::Done),
        // Both the legacy upgrade call and the reboot answer before the node goes down, so no answer
        // means the node may never have got the call (apid answering `Unavailable` is one way): the run
        // keeps it as unanswered, and makes it again only if the node is seen still running its old
        // boot, ready, after a grace period (see `Settings::unanswered_grace`).
        (Err(error), Action::Upgrade { .. } | Action::Reboot { .. }) if error.is_unreachable() => {
            tracing::warn!(node = %node_name, %error, "{what} got no answer");
            Ok(Called::NotReached)
        }
        (Err(error), _) => Err((node_name, format!("refused {what}: {error}"))),
    }
}

/// Cordons and evicts on every node the run is draining, and records what is left in the observation.
/// Only nodes whose run record says they are draining are touched, so this happens strictly after the
/// install was recorded, and never on a node the run has not reached.
async fn drain_pass(run: &Run, observed: &mut Observed) {
    for node in rollout::draining(run) {
        let status = match drain::drain_pass(&observed.workload, node).await {
            Ok(status) => Some(status),
            Err(error) => {
                tracing::warn!(%node, %error, "draining");
                None
            }
        };
        if let Some(observation) = observed
            .observation
            .nodes
            .iter_mut()
            .find(|n| n.name == node)
        {
            observation.drain = status;
        }
    }
}

/// A node's state with its installer image as read: a node up whose config cannot be read cannot be
/// upgraded, so it counts as unreachable, with the reason.
fn with_installer_image_read(state: TalosState, read: Result<String, TalosError>) -> TalosState {
    match (state, read) {
        (
            TalosState::Up {
                version,
                boot_id,
                ready,
                ..
            },
            Ok(image),
        ) => TalosState::Up {
            version,
            boot_id,
            ready,
            installer_image: Some(image),
        },
        (TalosState::Up { .. }, Err(error)) => TalosState::Unreachable {
            reason: error.to_string(),
        },
        (unreachable @ TalosState::Unreachable { .. }, _) => unreachable,
    }
}

/// Reads the installer image of the named nodes that answered, all at once. A node whose config
/// cannot be read counts as unreachable in this pass, as it would have if any other read had failed.
/// (Those the observation already read are not read again.)
async fn read_installer_images(observed: &mut Observed, names: &[&str]) {
    let (fleet, inventory) = (&observed.fleet, &observed.inventory);
    let unread = |n: &NodeObservation| {
        names.contains(&n.name.as_str())
            && matches!(
                n.talos,
                TalosState::Up {
                    installer_image: None,
                    ..
                }
            )
    };
    let reads = observed
        .observation
        .nodes
        .iter_mut()
        .filter(|n| unread(n))
        .filter_map(|observation| {
            let node = inventory.iter().find(|n| n.name == observation.name)?;
            Some(async move {
                let read = fleet.read_installer_image(node).await;
                observation.talos = with_installer_image_read(observation.talos.clone(), read);
            })
        });
    futures::future::join_all(reads).await;
}

/// The nodes whose installer image the observation reads.
enum StartingNodes {
    Named(Vec<String>),
    /// The nodes of the role the order upgrades first (the first role present in the inventory).
    FirstInOrder(talos_upgrade_core::intent::UpgradeOrder),
}

impl StartingNodes {
    fn names(&self, inventory: &[InventoryNode]) -> Vec<String> {
        match self {
            StartingNodes::Named(names) => names.clone(),
            StartingNodes::FirstInOrder(order) => {
                let first = inventory
                    .iter()
                    .map(|n| rollout::role_rank(n.role, *order))
                    .min();
                inventory
                    .iter()
                    .filter(|n| Some(rollout::role_rank(n.role, *order)) == first)
                    .map(|n| n.name.clone())
                    .collect()
            }
        }
    }
}

/// Credentials, inventory and the nodes' state, with the installer image of the nodes `starting`
/// names; a problem is a sentence for the user.
async fn observe(access: &SharedAccess<'_>, starting: &StartingNodes) -> Result<Observed, String> {
    let access = access.get().await?;
    let Access {
        fleet,
        inventory,
        workload_nodes,
        workload: workload_client,
        namespace,
        secret_name,
        ..
    } = access;
    let kubernetes = kubelet_floor(access);

    let control_planes = control_planes(inventory);
    // Every node and etcd at once: one round trip to the nodes, however many there are.
    let with_installer_image = &starting.names(inventory);
    let observed_at = std::time::Instant::now();
    let (states, etcd) = tokio::join!(
        futures::future::join_all(inventory.iter().map(|node| async move {
            if !with_installer_image.contains(&node.name) {
                return fleet.observe_node(node).await;
            }
            let (state, image) =
                tokio::join!(fleet.observe_node(node), fleet.read_installer_image(node));
            with_installer_image_read(state, image)
        })),
        fleet.observe_etcd(&control_planes),
    );
    access.note_talos_versions(
        states
            .iter()
            .map(|state| match state {
                TalosState::Up { version, .. } => Ok(version.clone()),
                TalosState::Unreachable { reason } => Err(reason.clone()),
            })
            .collect(),
    );
    // The Nodes were listed before the nodes were asked. A node that Talos reports running and ready
    // while its Node is not Ready may have turned Ready in between (the kubelet reports right after
    // Talos is ready), so the Nodes are read once more, rather than leaving it to a whole further
    // reconcile to notice.
    let ready_in = |nodes: &[WorkloadNodeInfo], name: &str| {
        nodes.iter().any(|n| n.node.name == name && n.ready)
    };
    let behind = inventory.iter().zip(&states).any(|(node, state)| {
        matches!(state, TalosState::Up { ready: true, .. }) && !ready_in(workload_nodes, &node.name)
    });
    let reread = if behind {
        inventory::from_workload_nodes(workload_client.clone(), AddressNeed::Optional)
            .await
            .inspect_err(|error| tracing::debug!(%error, "reading the workload Nodes again"))
            .ok()
    } else {
        None
    };
    let workload_nodes: &[WorkloadNodeInfo] = reread.as_deref().unwrap_or(workload_nodes);
    let nodes: Vec<NodeObservation> = inventory
        .iter()
        .zip(states)
        .map(|(node, talos)| NodeObservation {
            name: node.name.clone(),
            role: node.role,
            kubernetes_ready: ready_in(workload_nodes, &node.name),
            cordoned: workload_nodes
                .iter()
                .any(|n| n.node.name == node.name && n.unschedulable),
            drain: None,
            talos,
        })
        .collect();
    let versions: Vec<&Version> = nodes
        .iter()
        .filter_map(|n| match &n.talos {
            TalosState::Up { version, .. } => Some(version),
            TalosState::Unreachable { .. } => None,
        })
        .collect();
    let talos_range = version_range(&versions);
    if talos_range.is_none()
        && let Some(problem) = credentials_refused(fleet, inventory, namespace, secret_name).await
    {
        return Err(problem);
    }
    Ok(Observed {
        observation: Observation { nodes, etcd },
        fleet: fleet.clone(),
        inventory: inventory.clone(),
        talos_range,
        kubernetes,
        workload: workload_client.clone(),
        observed_at,
    })
}

/// When no node answers: whether that is because the nodes refuse the Secret's credentials (a client
/// certificate from another cluster's CA, a server certificate the Secret's CA does not sign, a role
/// without access) rather than because they are down. Waiting cannot fix that, so it is reported as the
/// problem, naming the node and the Secret. Asks one node; `None` when it is merely unreachable.
async fn credentials_refused(
    fleet: &TalosFleet,
    inventory: &[InventoryNode],
    namespace: &str,
    secret_name: &str,
) -> Option<String> {
    let node = inventory.first()?;
    let refused = |why: String| {
        format!(
            "the Talos API of node {} refused the credentials in Secret {namespace}/{secret_name} \
             ({why}); put this cluster's talosconfig (os:admin) in the Secret's {:?} key",
            node.name,
            credentials::TALOSCONFIG_KEY
        )
    };
    // Directly: through a relay, a refusal could be the relay's hop rather than these credentials.
    let client = match fleet.direct_client(node.address) {
        Ok(client) => client,
        Err(error) => return Some(refused(error.to_string())),
    };
    match client.version().await {
        Err(TalosError::Tls { reason, .. }) => {
            Some(refused(format!("TLS handshake failed: {reason}")))
        }
        Err(TalosError::PermissionDenied { message, .. }) => {
            Some(refused(format!("permission denied: {message}")))
        }
        Err(TalosError::Config(reason)) => Some(refused(reason)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use talos_upgrade_core::intent::UpgradeOrder;

    fn node(name: &str, role: NodeRole) -> InventoryNode {
        InventoryNode {
            name: name.to_string(),
            role,
            address: "127.0.0.1".parse().unwrap(),
        }
    }

    #[test]
    fn a_run_about_to_start_reads_the_installer_images_of_the_role_its_order_puts_first() {
        let mixed = [
            node("cp-1", NodeRole::ControlPlane),
            node("w-1", NodeRole::Worker),
            node("cp-2", NodeRole::ControlPlane),
            node("w-2", NodeRole::Worker),
        ];
        let control_planes_only = [
            node("cp-1", NodeRole::ControlPlane),
            node("cp-2", NodeRole::ControlPlane),
        ];
        let cases: [(&[InventoryNode], StartingNodes, &[&str]); 5] = [
            (
                &mixed,
                StartingNodes::FirstInOrder(UpgradeOrder::WorkersFirst),
                &["w-1", "w-2"],
            ),
            (
                &mixed,
                StartingNodes::FirstInOrder(UpgradeOrder::ControlPlanesFirst),
                &["cp-1", "cp-2"],
            ),
            // No workers: the control planes come first whatever the order.
            (
                &control_planes_only,
                StartingNodes::FirstInOrder(UpgradeOrder::WorkersFirst),
                &["cp-1", "cp-2"],
            ),
            (
                &[],
                StartingNodes::FirstInOrder(UpgradeOrder::WorkersFirst),
                &[],
            ),
            (&mixed, StartingNodes::Named(vec!["cp-2".into()]), &["cp-2"]),
        ];
        for (inventory, starting, expected) in cases {
            assert_eq!(starting.names(inventory), expected, "{inventory:?}");
        }
    }

    #[test]
    fn a_node_up_whose_config_cannot_be_read_counts_as_unreachable() {
        let up = || TalosState::Up {
            version: Version::new(1, 11, 6),
            boot_id: "boot-1".into(),
            ready: true,
            installer_image: None,
        };
        let refused = || TalosError::Unreachable {
            endpoint: "node cp-1".into(),
            reason: "connection refused".into(),
        };
        assert_eq!(
            with_installer_image_read(up(), Ok("ghcr.io/siderolabs/installer:v1.11.6".into())),
            TalosState::Up {
                version: Version::new(1, 11, 6),
                boot_id: "boot-1".into(),
                ready: true,
                installer_image: Some("ghcr.io/siderolabs/installer:v1.11.6".into()),
            }
        );
        assert!(matches!(
            with_installer_image_read(up(), Err(refused())),
            TalosState::Unreachable { reason } if reason.contains("connection refused")
        ));
        let down = TalosState::Unreachable {
            reason: "node cp-1 is rebooting".into(),
        };
        assert_eq!(
            with_installer_image_read(down.clone(), Err(refused())),
            down
        );
    }
}
