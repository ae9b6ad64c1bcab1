//! The plan preview (`plan-preview: "true"`, and the binary's `plan` subcommand): the plan the
//! controller would run for a cluster, its node order per hop, the gates that apply and what would
//! keep it from starting now. One renderer for both: the Event and `plan-message` join its lines
//! with `; `, the subcommand prints them one a line.

use std::collections::BTreeMap;

use jiff::Timestamp;

use super::{Hop, HopKind, Plan, PlanError, PlanMode, Start, Targets, compute, needs_plan};
use crate::annotations::{self, UpgradeKind};
use crate::catalog::Catalog;
use crate::intent::{Target, UpgradeIntent};
use crate::run::{NodeRole, human_duration};
use crate::talos::role_rank;
use crate::versions::{KubernetesVersion, TalosVersion};

/// A node as the inventory lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreviewNode {
    pub name: String,
    pub role: NodeRole,
    /// Held by its Machine's or Node's `upgrade.vitistack.io/hold`: Talos runs skip it.
    pub held: bool,
}

/// What a preview is made from.
pub struct PreviewInputs<'a> {
    /// The cluster's annotations (targets, `*-current`, `*-status`).
    pub annotations: &'a BTreeMap<String, String>,
    pub intent: &'a UpgradeIntent,
    /// The plan the progress record holds, if any.
    pub stored: Option<Plan>,
    pub catalog: &'a Catalog,
    /// The nodes, or why they could not be listed.
    pub nodes: Result<&'a [PreviewNode], String>,
    pub now: Timestamp,
}

/// The preview, as lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preview {
    pub lines: Vec<String>,
}

/// An Event's message is at most 1 KiB; the preview's is cut (on a character) to fit.
const MESSAGE_LIMIT: usize = 1000;

impl Preview {
    /// One line, for the Event and `plan-message`.
    pub fn message(&self) -> String {
        let message = format!("Plan preview: {}", self.lines.join("; "));
        match message.char_indices().nth(MESSAGE_LIMIT) {
            Some((at, _)) => format!("{}…", &message[..at]),
            None => message,
        }
    }

    /// One line each, for the `plan` subcommand.
    pub fn text(&self) -> String {
        let mut text = self.lines.join("\n");
        text.push('\n');
        text
    }
}

/// The plan the controller would run now, how, and what would hold it.
pub fn preview(inputs: &PreviewInputs<'_>) -> Preview {
    let annotations = inputs.annotations;
    let intent = inputs.intent;
    let talos_raw = crate::intent::value(annotations, annotations::TALOS_TARGET);
    let kubernetes_raw = crate::intent::value(annotations, annotations::KUBERNETES_TARGET);
    let mode = intent.upgrade_plan.clone().unwrap_or_default();
    let mut lines = Vec::new();
    let mut blocks = Vec::new();
    if talos_raw.is_none() && kubernetes_raw.is_none() {
        lines.push("no target is set (talos-target, kubernetes-target): nothing to run".into());
    }
    // The stored plan for these targets is the one being run; otherwise the one that would be.
    let hops: Option<(Vec<Hop>, usize)> = match &inputs.stored {
        Some(plan) if plan.is_for(talos_raw, kubernetes_raw) && plan.refused.is_none() => {
            Some((plan.hops.clone(), plan.done))
        }
        _ => {
            let targets = Targets {
                talos: match &intent.talos_target {
                    Target::Version(version) => Some(version.clone()),
                    Target::Absent => None,
                    Target::Invalid { reason, .. } => {
                        blocks.push(format!("talos-target is invalid: {reason}"));
                        None
                    }
                },
                kubernetes: match &intent.kubernetes_target {
                    Target::Version(version) => Some(version.clone()),
                    Target::Absent => None,
                    Target::Invalid { reason, .. } => {
                        blocks.push(format!("kubernetes-target is invalid: {reason}"));
                        None
                    }
                },
            };
            let start = Start {
                talos: crate::intent::value(annotations, annotations::TALOS_CURRENT)
                    .and_then(|v| TalosVersion::parse(v).ok()),
                kubernetes: crate::intent::value(annotations, annotations::KUBERNETES_CURRENT)
                    .and_then(|v| KubernetesVersion::parse(v).ok()),
            };
            match compute(&start, &targets, inputs.catalog) {
                Ok(hops) => Some((hops, 0)),
                Err(PlanError::NoVersions(kind)) => {
                    blocks.push(format!(
                        "the {} version the cluster runs is not known yet (talos-current, kubernetes-current)",
                        kind.name()
                    ));
                    None
                }
                Err(error) => {
                    blocks.push(error.to_string());
                    None
                }
            }
        }
    };
    let nodes = inputs.nodes.as_ref().ok().copied();
    if let Err(why) = &inputs.nodes {
        blocks.push(format!("the nodes could not be listed: {why}"));
    }
    if let Some((hops, done)) = &hops {
        if mode == PlanMode::SingleStep && needs_plan(hops) {
            blocks.push(
                "one step is not enough and the cluster has not opted in to plans: set upgrade.vitistack.io/upgrade-plan=multi-hop (without it the target is refused)".into(),
            );
        }
        if !hops.is_empty() {
            lines.push(format!(
                "{} hop{}{}",
                hops.len(),
                if hops.len() == 1 { "" } else { "s" },
                match done {
                    0 => String::new(),
                    done => format!(", {done} done"),
                }
            ));
        } else if talos_raw.is_some() || kubernetes_raw.is_some() {
            lines.push("the cluster already runs the targets: nothing to run".into());
        }
        for (index, hop) in hops.iter().enumerate() {
            let state = match index.cmp(done) {
                std::cmp::Ordering::Less => " (done)",
                std::cmp::Ordering::Equal if *done > 0 => " (in progress)",
                _ => "",
            };
            lines.push(format!(
                "hop {}/{}: {hop}{state}; {}",
                index + 1,
                hops.len(),
                node_order(hop, nodes, intent)
            ));
        }
    }
    lines.push(format!(
        "gates: {}",
        gates(intent, hops.as_ref()).join(", ")
    ));
    blocks.extend(blocking_now(inputs));
    lines.push(match blocks.is_empty() {
        true => "nothing would hold it now".into(),
        false => format!("would hold now: {}", blocks.join("; ")),
    });
    Preview { lines }
}

/// The order the hop's run takes the nodes in.
fn node_order(hop: &Hop, nodes: Option<&[PreviewNode]>, intent: &UpgradeIntent) -> String {
    let Some(nodes) = nodes else {
        return "nodes: not known".into();
    };
    let names = |role: NodeRole| -> Vec<&str> {
        let mut names: Vec<&str> = nodes
            .iter()
            .filter(|node| node.role == role && !node.held)
            .map(|node| node.name.as_str())
            .collect();
        names.sort_unstable();
        names
    };
    let held: Vec<&str> = nodes
        .iter()
        .filter(|node| node.held)
        .map(|node| node.name.as_str())
        .collect();
    match hop.kind {
        HopKind::Talos => {
            let order = intent.order.clone().unwrap_or_default();
            let mut roles = [NodeRole::Worker, NodeRole::ControlPlane];
            roles.sort_by_key(|role| role_rank(*role, order));
            let mut text = format!(
                "nodes: {}",
                roles
                    .iter()
                    .map(|role| names(*role).join(", "))
                    .filter(|part| !part.is_empty())
                    .collect::<Vec<_>>()
                    .join(", then ")
            );
            if !held.is_empty() {
                text.push_str(&format!(" (held, skipped: {})", held.join(", ")));
            }
            text
        }
        HopKind::Kubernetes => {
            let mut all: Vec<&str> = nodes.iter().map(|node| node.name.as_str()).collect();
            all.sort_unstable();
            format!(
                "steps: image pulls, control-plane components on {}, kube-proxy, kubelets on {}, bootstrap manifests",
                names(NodeRole::ControlPlane).join(", "),
                all.join(", ")
            )
        }
    }
}

/// The gates every hop's run goes through.
fn gates(intent: &UpgradeIntent, hops: Option<&(Vec<Hop>, usize)>) -> Vec<String> {
    let talos = hops.is_none_or(|(hops, _)| hops.iter().any(|hop| hop.kind == HopKind::Talos));
    let mut gates = Vec::new();
    if talos {
        let order = intent.order.clone().unwrap_or_default();
        let parallel = intent
            .max_parallel_workers
            .as_ref()
            .map(|n| n.get())
            .unwrap_or(1);
        gates.push(format!(
            "Talos: {order}, {parallel} worker{} at a time, every other node up and Ready before each node, etcd healthy and leadership moved off each control plane first, each node done within the node deadline",
            if parallel == 1 { "" } else { "s" }
        ));
        if let Ok(Some(window)) = &intent.maintenance_window {
            gates.push(format!("maintenance window {window}"));
        }
        if let Ok(Some(soak)) = intent.soak_after_node {
            gates.push(format!("soak {} after each node", human_duration(soak)));
        }
        if let Ok(Some(soak)) = intent.soak_after_control_planes {
            gates.push(format!(
                "soak {} after the control planes",
                human_duration(soak)
            ));
        }
        if let Ok(Some(nodes)) = intent.pause_after_nodes {
            gates.push(format!("canary: pause after {nodes} node(s)"));
        }
        if let Ok(Some(_)) = &intent.alert_gate {
            gates.push("the cluster's alert gate".into());
        }
        if let Ok(Some(checks)) = &intent.health_checks {
            gates.push(format!("{} health check(s)", checks.checks.len()));
        }
    }
    if hops.is_none_or(|(hops, _)| hops.iter().any(|hop| hop.kind == HopKind::Kubernetes)) {
        gates.push(
            "Kubernetes: one step at a time, each verified before the next, within the step deadline; never while Talos upgrades".into(),
        );
    }
    gates
}

/// What keeps a run from starting now, whatever the plan.
fn blocking_now(inputs: &PreviewInputs<'_>) -> Vec<String> {
    let intent = inputs.intent;
    let mut blocks = Vec::new();
    if intent.do_not_reconcile {
        blocks.push("do-not-reconcile is set: the controller touches nothing".into());
    }
    if intent.paused {
        blocks.push("paused".into());
    }
    for invalid in intent.invalid_options() {
        blocks.push(invalid.to_string());
    }
    if let Ok(Some(window)) = &intent.maintenance_window
        && !intent.force_start
        && let Some(opening) = window.next_opening(inputs.now)
    {
        blocks.push(format!(
            "outside the maintenance window; it opens {}",
            opening.describe()
        ));
    }
    for kind in UpgradeKind::ALL {
        if crate::intent::value(inputs.annotations, kind.status_key()) == Some("in-progress") {
            blocks.push(format!("a {} run is in progress", kind.name()));
        }
    }
    blocks
}

#[cfg(test)]
mod tests;
