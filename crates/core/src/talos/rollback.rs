//! Rolling nodes back to the Talos they ran before the last run (`talos-rollback`), as a pure decision.
//!
//! A rollback is a Talos run of its own, recorded in place of the run it rolls back (same `requested`
//! value, so the target stays decided: the controller does not upgrade the nodes again on its own) and
//! marked by [`Run::rollback`]. Each node gets `MachineService.Rollback`, which makes the other A/B slot
//! the boot default and reboots (talosctl rollback; Talos `internal/app/machined/pkg/runtime/v1alpha1`
//! `Rollback`): it goes back to the system the last run replaced. The same promises as an upgrade hold:
//! - nodes go one at a time, workers first then control planes (or the order the user chose);
//! - before a node starts, every other node is up and Ready, the node's Talos API answers, and for a
//!   control plane etcd is healthy and leadership has moved off it;
//! - the call is recorded before it is made (write-ahead) and made at most once per node: a call
//!   without an answer is made again only when the node is seen, well after it, still on the same
//!   boot, running and ready (it never got it);
//! - a node is done only when it rebooted (new boot id), runs the version it ran before the last run,
//!   reports ready and its Node is Ready; past the node deadline, or back on another version, the
//!   rollback fails and touches no further node.
//!
//! What is rolled back is decided when the rollback starts ([`start`]): the last run's failed nodes
//! (`failed`), its failed and upgraded nodes (`run`), or the nodes named. A node the last run did not
//! take off a previous version has nothing to go back to, and the rollback is refused, touching no node.

use std::collections::BTreeMap;

use jiff::Timestamp;
use semver::Version;
use serde::{Deserialize, Serialize};

use super::{
    Action, Decision, NodeObservation, NodeProgress, NodeStep, Observation, Run, Settings,
    TalosState, UpgradeOrder, is_healthy, plural, role_rank,
};
use crate::run::{
    NodeRole, Note, Outcome, PreflightCheck, Reason, Report, RunState, human_duration,
};

/// What `talos-rollback` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackRequest {
    /// `failed`: the last run's failed nodes.
    Failed,
    /// `run`: the last run's failed nodes and those it upgraded.
    Run,
    /// A comma-separated list of node names.
    Nodes(Vec<String>),
}

impl RollbackRequest {
    /// Reads the annotation's value; `Err` says what is accepted.
    pub fn parse(text: &str) -> Result<RollbackRequest, String> {
        let text = text.trim();
        match text {
            "failed" => return Ok(RollbackRequest::Failed),
            "run" => return Ok(RollbackRequest::Run),
            _ => {}
        }
        let names: Vec<String> = text.split(',').map(|n| n.trim().to_string()).collect();
        let valid = |name: &String| {
            !name.is_empty()
                && name.len() <= 253
                && name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        };
        if text.is_empty() || !names.iter().all(valid) {
            return Err(
                "use failed (the last run's failed nodes), run (its failed and upgraded \
                 nodes) or a comma-separated list of node names"
                    .to_string(),
            );
        }
        Ok(RollbackRequest::Nodes(names))
    }
}

/// What a rollback run records beside its nodes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rollback {
    /// The annotation's value as the user wrote it.
    pub asked: String,
    /// The version the rolled-back run upgraded to (what the nodes leave).
    pub from: String,
    /// Per node, the version it goes back to: what it ran before the last run took it.
    pub to: BTreeMap<String, String>,
}

impl Rollback {
    /// `Talos 1.11.5`, or `their previous Talos versions` when they differ.
    fn to_words(&self) -> String {
        let mut versions: Vec<&String> = self.to.values().collect();
        versions.sort();
        versions.dedup();
        match versions.as_slice() {
            [one] => format!("Talos {one}"),
            _ => "their previous Talos versions".to_string(),
        }
    }
}

/// The version a node of `last` ran before `last` took it, if it did.
fn previous_version(last: &Run, node: &NodeProgress) -> Option<String> {
    match &node.step {
        NodeStep::Failed {
            installed: Some(pending),
            ..
        } => Some(pending.from_version.clone()),
        NodeStep::Failed { .. }
        | NodeStep::Done {
            started_at: Some(_),
            ..
        } => last.previous.get(&node.name).cloned(),
        NodeStep::Pending | NodeStep::Issued { .. } | NodeStep::Done { .. } => None,
    }
}

/// Starts the rollback `request` asks for of `last`, a finished run: the nodes in order, each pending
/// (or done at once if it already runs its previous version), and the sentence of the start. `Err` is
/// why it is refused; no node is touched then.
pub fn start(
    last: &Run,
    request: &RollbackRequest,
    asked: &str,
    order: UpgradeOrder,
    observation: &Observation,
    now: Timestamp,
) -> Result<(Run, String), String> {
    if let Some(before) = &last.rollback {
        return Err(format!(
            "the last Talos run was itself a rollback (of {}) off Talos {}; change talos-target to \
             upgrade again",
            before.asked, before.from
        ));
    }
    if last.nodes.is_empty() {
        return Err(format!(
            "the last Talos run (talos-target {}) touched no node, so there is nothing to roll back",
            last.requested
        ));
    }
    let upgraded = |n: &&NodeProgress| {
        matches!(
            n.step,
            NodeStep::Failed { .. }
                | NodeStep::Done {
                    started_at: Some(_),
                    ..
                }
        )
    };
    let chosen: Vec<&NodeProgress> = match request {
        RollbackRequest::Failed => last
            .nodes
            .iter()
            .filter(|n| matches!(n.step, NodeStep::Failed { .. }))
            .collect(),
        RollbackRequest::Run => last.nodes.iter().filter(upgraded).collect(),
        RollbackRequest::Nodes(names) => {
            let unknown: Vec<&str> = names
                .iter()
                .filter(|name| observation.node(name).is_none())
                .map(String::as_str)
                .collect();
            if !unknown.is_empty() {
                return Err(format!(
                    "unknown node{} {}: not in the cluster's node list",
                    plural(unknown.len()),
                    unknown.join(", ")
                ));
            }
            let mut chosen: Vec<&NodeProgress> = Vec::new();
            for name in names {
                // A name written twice is one node, rolled back once.
                if chosen.iter().any(|n| n.name == *name) {
                    continue;
                }
                match last.node(name).filter(upgraded) {
                    Some(node) => chosen.push(node),
                    None => {
                        return Err(format!(
                            "node {name} was not upgraded by the last Talos run (to {}), so it has \
                             no previous system to go back to",
                            last.target
                        ));
                    }
                }
            }
            chosen
        }
    };
    if chosen.is_empty() {
        return Err(match request {
            RollbackRequest::Failed => format!(
                "the last Talos run (to {}) has no failed node; use run to roll back the nodes it \
                 upgraded, or name them",
                last.target
            ),
            RollbackRequest::Run | RollbackRequest::Nodes(_) => {
                format!("the last Talos run (to {}) upgraded no node", last.target)
            }
        });
    }
    let mut to = BTreeMap::new();
    for node in &chosen {
        // Installed for its next reboot and never booted: the node still runs what it ran.
        if let NodeStep::Failed {
            installed: Some(pending),
            ..
        } = &node.step
            && let Some(observed) = observation.node(&node.name)
            && matches!(&observed.talos, TalosState::Up { boot_id, .. } if *boot_id == pending.boot_id)
        {
            return Err(format!(
                "node {} never booted Talos {}: it runs Talos {} with Talos {} installed for its \
                 next reboot, so there is nothing to roll back (set resume to finish its upgrade, \
                 or reset the Talos upgrade state)",
                node.name, last.target, pending.from_version, last.target
            ));
        }
        let Some(previous) = previous_version(last, node) else {
            return Err(format!(
                "node {} has no previous Talos version recorded by the last run, so it has no \
                 previous system to go back to",
                node.name
            ));
        };
        to.insert(node.name.clone(), previous);
    }
    let mut nodes: Vec<NodeProgress> = chosen
        .into_iter()
        .map(|n| NodeProgress {
            name: n.name.clone(),
            role: n.role,
            step: NodeStep::Pending,
        })
        .collect();
    nodes.sort_by_key(|n| (role_rank(n.role, order), n.name.clone()));
    // Already on its previous version (an A/B fallback, a pull that failed): nothing to call.
    let mut already = Vec::new();
    for node in &mut nodes {
        if running(observation.node(&node.name))
            .is_some_and(|v| Some(&v.to_string()) == to.get(&node.name))
        {
            node.step = NodeStep::Done {
                at: now,
                started_at: None,
            };
            already.push(node.name.clone());
        }
    }
    let rollback = Rollback {
        asked: asked.trim().to_string(),
        from: last.target.clone(),
        to,
    };
    let mut sentence = format!(
        "Rolling back {} node{} from Talos {} to {} ({}): {}",
        nodes.len(),
        plural(nodes.len()),
        last.target,
        rollback.to_words(),
        rollback.asked,
        nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if !already.is_empty() {
        sentence.push_str(&format!(
            "; {} already run{} {} previous version",
            already.join(", "),
            if already.len() == 1 { "s" } else { "" },
            if already.len() == 1 { "its" } else { "their" }
        ));
    }
    Ok((
        Run {
            requested: last.requested.clone(),
            target: last.target.clone(),
            started_at: now,
            outcome: None,
            nodes,
            gates: Default::default(),
            previous: BTreeMap::new(),
            rollback: Some(rollback),
        },
        sentence,
    ))
}

fn running(observed: Option<&NodeObservation>) -> Option<&Version> {
    match observed.map(|n| &n.talos) {
        Some(TalosState::Up { version, .. }) => Some(version),
        _ => None,
    }
}

/// Decides the next step of a rollback run.
pub(super) fn advance(
    run: &Run,
    rollback: &Rollback,
    settings: &Settings,
    observation: &Observation,
    now: Timestamp,
) -> Decision {
    let mut run = run.clone();
    let mut notes = Vec::new();
    if run.outcome.is_some() {
        return report(run, rollback, Vec::new(), notes, None, false);
    }
    // Pending nodes gone from the cluster's node list: the rollback goes on without them.
    if !observation.nodes.is_empty() {
        run.nodes.retain(|progress| {
            let gone = matches!(progress.step, NodeStep::Pending)
                && observation.node(&progress.name).is_none();
            if gone {
                notes.push(Note::normal(
                    Reason::NodeLeft,
                    format!(
                        "Node {} is no longer in the cluster's node list; the rollback goes on \
                         without it",
                        progress.name
                    ),
                ));
            }
            !gone
        });
    }
    let deadline = human_duration(settings.node_deadline);
    // 1. The node in flight: back on its previous version, still going, or failed.
    for progress in &mut run.nodes {
        let name = progress.name.clone();
        let NodeStep::Issued {
            at,
            boot_id,
            unanswered,
            ..
        } = &progress.step
        else {
            continue;
        };
        let observed = observation.node(&name);
        // The call got no answer and the node is still on the same boot, running and ready, well
        // after it: it never got the call (the controller stopped mid-call). It is called again.
        // Otherwise never: a second Rollback on a node that got the first would flip it back.
        if *unanswered
            && !settings.paused
            && now.duration_since(*at).unsigned_abs() > settings.unanswered_grace
            && super::untouched_since(observed, boot_id)
        {
            progress.step = NodeStep::Pending;
            continue;
        }
        let to = rollback.to.get(&name).cloned().unwrap_or_default();
        let waiting = match observed.map(|n| (&n.talos, n.kubernetes_ready)) {
            None | Some((TalosState::Unreachable { .. }, _)) => {
                format!("did not come back online within {deadline}")
            }
            Some((
                TalosState::Up {
                    boot_id: now_boot, ..
                },
                _,
            )) if now_boot == boot_id => {
                format!("did not reboot into its previous system within {deadline}")
            }
            Some((TalosState::Up { version, .. }, _)) if version.to_string() != to => {
                progress.step = NodeStep::Failed {
                    at: now,
                    reason: format!(
                        "came back on Talos {version} instead of {to}: the rollback did not take; \
                         it was not rolled back again"
                    ),
                    installed: None,
                };
                continue;
            }
            Some((TalosState::Up { ready: true, .. }, true)) => {
                notes.push(Note::normal(
                    Reason::NodeRolledBack,
                    format!(
                        "Node {name} is running Talos {to} again (rolled back from {})",
                        rollback.from
                    ),
                ));
                progress.step = NodeStep::Done {
                    at: now,
                    started_at: Some(*at),
                };
                continue;
            }
            Some(_) => format!("did not become Ready within {deadline}"),
        };
        if now.duration_since(*at).unsigned_abs() > settings.node_deadline {
            progress.step = NodeStep::Failed {
                at: now,
                reason: waiting,
                installed: None,
            };
        }
    }
    // 2. A failure stops the rollback: no node starts after it.
    let failed: Vec<(String, String)> = run
        .nodes
        .iter()
        .filter_map(|n| match &n.step {
            NodeStep::Failed { reason, .. } => Some((n.name.clone(), reason.clone())),
            _ => None,
        })
        .collect();
    if let Some((first, _)) = failed.first() {
        if run.in_flight().is_empty() {
            run.outcome = Some(Outcome::Failed {
                at: now,
                node: Some(first.clone()),
                reason: failed
                    .iter()
                    .map(|(node, why)| format!("node {node} {why}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
            return report(run, rollback, Vec::new(), notes, None, true);
        }
        return report(run, rollback, Vec::new(), notes, None, false);
    }
    if run
        .nodes
        .iter()
        .all(|n| matches!(n.step, NodeStep::Done { .. }))
    {
        run.outcome = Some(Outcome::Completed { at: now });
        return report(run, rollback, Vec::new(), notes, None, true);
    }
    // 3. The next node, one at a time, behind the same preflight checks as an upgrade.
    let mut actions = Vec::new();
    let held = if settings.paused || !run.in_flight().is_empty() {
        None
    } else {
        start_next(
            &mut run,
            rollback,
            observation,
            now,
            &mut notes,
            &mut actions,
        )
    };
    if run
        .nodes
        .iter()
        .all(|n| matches!(n.step, NodeStep::Done { .. }))
    {
        run.outcome = Some(Outcome::Completed { at: now });
        return report(run, rollback, actions, notes, None, true);
    }
    report(run, rollback, actions, notes, held, false)
}

/// Starts the next pending node, or says what holds it.
fn start_next(
    run: &mut Run,
    rollback: &Rollback,
    observation: &Observation,
    now: Timestamp,
    notes: &mut Vec<Note>,
    actions: &mut Vec<Action>,
) -> Option<(PreflightCheck, String)> {
    for index in 0..run.nodes.len() {
        if !matches!(run.nodes[index].step, NodeStep::Pending) {
            continue;
        }
        let name = run.nodes[index].name.clone();
        let to = rollback.to.get(&name).cloned().unwrap_or_default();
        let Some(node) = observation.node(&name) else {
            return Some((
                PreflightCheck::NodeInventory,
                format!("node {name} is not in the cluster's node list"),
            ));
        };
        let (version, boot_id) = match &node.talos {
            TalosState::Up {
                version, boot_id, ..
            } => (version, boot_id),
            TalosState::Unreachable { reason } => {
                return Some((
                    PreflightCheck::TalosApi,
                    format!("node {name}'s Talos API is unreachable: {reason}"),
                ));
            }
        };
        // Back on its previous version meanwhile (a call whose answer was lost, or by hand): done.
        if version.to_string() == to {
            run.nodes[index].step = NodeStep::Done {
                at: now,
                started_at: None,
            };
            continue;
        }
        if !matches!(node.talos, TalosState::Up { ready: true, .. }) {
            return Some((
                PreflightCheck::NodesReady,
                format!("node {name} is not ready; holding before rolling it back"),
            ));
        }
        if let Some(blocker) = observation
            .nodes
            .iter()
            .find(|other| other.name != name && !is_healthy(other))
        {
            return Some((
                PreflightCheck::NodesReady,
                format!(
                    "node {} is not ready; holding before rolling back {name}",
                    blocker.name
                ),
            ));
        }
        if node.role == NodeRole::ControlPlane {
            if let Some(problem) = &observation.etcd.problem {
                return Some((
                    PreflightCheck::EtcdHealth,
                    format!("etcd is not healthy ({problem}); holding before control plane {name}"),
                ));
            }
            if observation.etcd.leader.as_deref() == Some(name.as_str()) {
                actions.push(Action::ForfeitEtcdLeadership { node: name.clone() });
                return Some((
                    PreflightCheck::EtcdLeader,
                    format!("moving etcd leadership off {name} before rolling it back"),
                ));
            }
        }
        run.nodes[index].step = NodeStep::Issued {
            at: now,
            boot_id: boot_id.clone(),
            from_version: version.to_string(),
            installer_image: String::new(),
            lifecycle: None,
            // Until its answer is recorded (see `super::answered`).
            unanswered: true,
            install_unconfirmed: false,
        };
        notes.push(Note::normal(
            Reason::NodeRollbackStarted,
            format!("Rolling back node {name} from Talos {version} to {to}"),
        ));
        actions.push(Action::Rollback { node: name });
        return None;
    }
    None
}

/// The report of a rollback after a decision; `announce` adds the completion or failure Event.
fn report(
    run: Run,
    rollback: &Rollback,
    actions: Vec<Action>,
    mut notes: Vec<Note>,
    held: Option<(PreflightCheck, String)>,
    announce: bool,
) -> Decision {
    let (done, total) = run.counts();
    let in_flight = run.in_flight();
    let failed_nodes: Vec<String> = run.failed_nodes().into_iter().map(String::from).collect();
    let to = rollback.to_words();
    let (state, message) = match &run.outcome {
        Some(Outcome::Completed { .. }) => {
            let message = format!(
                "Talos rollback completed: {total} node{} back on {to} (rolled back from {}: {}); \
                 talos-target {} stays decided: change it to upgrade again",
                plural(total),
                rollback.from,
                rollback.asked,
                run.requested
            );
            if announce {
                notes.push(Note::normal(Reason::RollbackCompleted, message.clone()));
            }
            (RunState::Completed, message)
        }
        Some(Outcome::Failed { reason, .. }) => {
            let message = format!("Talos rollback failed: {reason}");
            if announce {
                notes.push(Note::warning(Reason::RollbackFailed, message.clone()));
            }
            (RunState::Failed, message)
        }
        None => {
            let prefix = format!("Rolling back {total} node{} to {to}", plural(total));
            let message = match (in_flight.as_slice(), &held, failed_nodes.first()) {
                (_, _, Some(failed)) => format!(
                    "{prefix}: stopping after node {failed} failed; finishing {} first \
                     ({done}/{total} done)",
                    in_flight.join(", ")
                ),
                ([one, ..], _, None) => format!("{prefix}: {one} rebooting ({done}/{total} done)"),
                ([], Some((_, why)), None) => {
                    format!("{prefix}: waiting: {why} ({done}/{total} done)")
                }
                ([], None, None) => format!("{prefix} ({done}/{total} done)"),
            };
            (RunState::InProgress, message)
        }
    };
    let hold = match (&state, in_flight.is_empty(), &held) {
        (RunState::InProgress, true, Some((check, _))) => Some(*check),
        _ => None,
    };
    // Every node in flight only waits to come back, counting the nodes this decision sends their
    // rollback as answered for `awaiting_reboots_once_answered` (see `Report`).
    let rolling_back: Vec<&str> = actions
        .iter()
        .filter_map(|action| match action {
            Action::Rollback { node } => Some(node.as_str()),
            _ => None,
        })
        .collect();
    let only_rebooting = |answering: &[&str]| {
        state == RunState::InProgress
            && !in_flight.is_empty()
            && held.is_none()
            && run.nodes.iter().all(|n| match n.step {
                NodeStep::Issued {
                    unanswered: true, ..
                } => answering.contains(&n.name.as_str()),
                _ => true,
            })
    };
    let awaiting_reboots = only_rebooting(&[]);
    let awaiting_reboots_once_answered = only_rebooting(&rolling_back);
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
            awaiting_reboots,
            awaiting_reboots_once_answered,
        },
    }
}

#[cfg(test)]
mod tests;
