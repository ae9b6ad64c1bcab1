//! The promises checked after every reconcile (those checked when a call reaches a node are in
//! [`crate::model`]): what the annotations show against what the controller looked at, failures that
//! say why, progress that does not go back, cordons that end with the run, calls the record knows of.
//! Each broken promise is a sentence that starts with its name, which the shrinker keeps to.

use std::collections::BTreeMap;

use talos_upgrade_core::annotations::{self as keys, UpgradeKind};
use talos_upgrade_core::catalog::Catalog;
use talos_upgrade_core::kubernetes::Kubernetes;
use talos_upgrade_core::lifecycle::Kind;
use talos_upgrade_core::talos::{NodeStep, Talos};

use crate::controller::Looked;
use crate::model::World;

/// What the checks remember between reconciles.
#[derive(Debug, Default)]
pub struct Watch {
    /// The Talos progress shown last, per run (requested, started).
    progress: BTreeMap<(String, String), usize>,
    /// The saved Talos run (requested, started) when it was under way after the reconcile before.
    talos_running: Option<(String, String)>,
}

impl Watch {
    /// The user said `resume`: progress may go back once.
    pub fn resumed(&mut self) {
        self.progress.clear();
    }

    pub fn after_reconcile(&mut self, w: &mut World, looked: &Looked, catalog: &Catalog) {
        let mut broken = Vec::new();
        let get = |key: &str| w.annotations.get(key).map(String::as_str);

        // `*-current` and `*-available` match the last look.
        if let Some(versions) = &looked.talos {
            let current = Talos::current(versions).map(|v| v.to_string());
            if current.is_some() && get(keys::TALOS_CURRENT) != current.as_deref() {
                broken.push(format!(
                    "stale current: talos-current is {:?} but the look saw {current:?}",
                    get(keys::TALOS_CURRENT)
                ));
            }
            if let Some(available) = Talos::available(versions, catalog) {
                let available = available.map(|v| v.to_string());
                if get(keys::TALOS_AVAILABLE) != available.as_deref() {
                    broken.push(format!(
                        "stale available: talos-available is {:?} but the look says {available:?}",
                        get(keys::TALOS_AVAILABLE)
                    ));
                }
            }
        }
        if let Some(versions) = &looked.kubernetes {
            let current = Kubernetes::current(versions).map(|v| v.to_string());
            if current.is_some() && get(keys::KUBERNETES_CURRENT) != current.as_deref() {
                broken.push(format!(
                    "stale current: kubernetes-current is {:?} but the look saw {current:?}",
                    get(keys::KUBERNETES_CURRENT)
                ));
            }
        }

        // Every failed or blocked report says why; a failed run names its failed nodes.
        for kind in UpgradeKind::ALL {
            let status = get(kind.status_key()).unwrap_or_default();
            let message = get(kind.message_key()).unwrap_or_default();
            if matches!(status, "failed" | "blocked") && message.trim().is_empty() {
                broken.push(format!(
                    "no reason: {} is {status} without a message",
                    kind.status_key()
                ));
            }
        }
        if get(keys::TALOS_STATUS) == Some("failed") {
            let message = get(keys::TALOS_MESSAGE).unwrap_or_default();
            for node in get(keys::FAILED_NODES).unwrap_or_default().split(',') {
                if !node.is_empty() && !message.contains(node) {
                    broken.push(format!(
                        "no reason: the failure does not name failed node {node}: {message:?}"
                    ));
                }
            }
        }

        // A node the controller cordoned is uncordoned when the run ends, or the end names it.
        // A run ends when the saved run under way is finished, dropped or replaced.
        let running = w
            .store
            .talos
            .as_ref()
            .filter(|run| run.outcome.is_none())
            .map(|run| (run.requested.clone(), run.started_at.to_string()));
        let ended = self.talos_running.is_some() && running != self.talos_running;
        let ended_run = std::mem::replace(&mut self.talos_running, running);
        if ended {
            let message = get(keys::TALOS_MESSAGE).unwrap_or_default();
            for node in w.nodes.iter().filter(|n| n.present) {
                if node.cordoned_by == ended_run && node.cordoned && !message.contains(&node.name) {
                    broken.push(format!(
                        "left cordoned: the Talos run ended ({:?}: {message:?}) with {} cordoned by it, unnamed",
                        get(keys::TALOS_STATUS),
                        node.name
                    ));
                }
            }
        }

        // The phase shows the controller's runs and failures only, and a phase it did not write is
        // given back when they end.
        let running =
            |kind: UpgradeKind| matches!(get(kind.status_key()), Some("in-progress" | "failed"));
        if !running(UpgradeKind::Talos) && !running(UpgradeKind::Kubernetes) {
            let phase = w.phase.as_deref();
            if matches!(
                phase,
                Some("UpgradingTalos" | "UpgradingKubernetes" | "UpgradeFailed")
            ) {
                broken.push(format!(
                    "phase: {phase:?} with no run going or failed ({:?}, {:?})",
                    get(keys::TALOS_STATUS),
                    get(keys::KUBERNETES_STATUS)
                ));
            }
            if let Some(foreign) = &w.foreign_phase
                && phase == Some("Ready")
            {
                broken.push(format!(
                    "phase: Ready where the provisioning operator's {foreign:?} should have been given back"
                ));
            }
        }

        // Progress never goes back within a run (unless the user resumed it).
        if let Some(run) = &w.store.talos
            && let Some((done, _)) = get(keys::TALOS_PROGRESS).and_then(|p| p.split_once('/'))
            && let Ok(done) = done.parse::<usize>()
            && get(keys::TALOS_STATUS) != Some("idle")
        {
            let key = (run.requested.clone(), run.started_at.to_string());
            let before = self.progress.entry(key).or_insert(done);
            if done < *before {
                broken.push(format!(
                    "progress back: talos-progress went from {before} to {done} in one run"
                ));
            }
            *before = done.max(*before);
        }

        // What the record says was called is what the nodes saw: a node whose upgrade reached it is
        // never back to pending in the saved run (unless the user resumed).
        if let Some(run) = &w.store.talos {
            for ((requested, started, node), count) in &w.disruptive {
                if *count > 0
                    && *requested == run.requested
                    && *started == run.started_at.to_string()
                    && matches!(run.node(node).map(|n| &n.step), Some(NodeStep::Pending))
                {
                    broken.push(format!(
                        "record lost a call: {node} got its upgrade but the saved run says pending"
                    ));
                }
            }
        }
        w.violations.extend(broken);
    }

    /// Whether every run has ended, or is held by the user (paused, or an option to fix).
    pub fn settled(&self, w: &World) -> bool {
        let get = |key: &str| w.annotations.get(key).map(String::as_str);
        // `paused` holds with any value but "false" (an unrecognised one reads as paused).
        let held = get(keys::PAUSED).is_some_and(|p| p.trim() != "false")
            || get(keys::TALOS_MESSAGE).is_some_and(|m| {
                // An option to fix, or a node to reboot before a new run may install on it.
                m.contains(" upgrade held: ") || m.contains("a new run would install over it")
            });
        let going = |kind: UpgradeKind| get(kind.status_key()) == Some("in-progress");
        held || !(going(UpgradeKind::Talos) || going(UpgradeKind::Kubernetes))
    }
}
