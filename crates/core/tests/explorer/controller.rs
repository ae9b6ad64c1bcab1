//! The controller as the explorer runs it: one reconcile is what `src/reconcile/mod.rs` does, with the
//! world of [`crate::model`] in place of the Kubernetes API and the Talos nodes. The intent is read
//! from the annotations, the Talos lifecycle then the Kubernetes one are driven step by step (the
//! write-ahead save before every call), and their reports are written back as the annotations,
//! phase and Events a user sees. The controller keeps nothing in memory between reconciles: a restart
//! is a reconcile cut short.

use talos_upgrade_core::catalog::Catalog;
use talos_upgrade_core::gates::Gates;
use talos_upgrade_core::intent::UpgradeIntent;
use talos_upgrade_core::kubernetes::{Kubernetes, KubernetesVersions};
use talos_upgrade_core::lifecycle::{
    self, Called, Conclusion, Inputs, Kind, Lifecycle, Limits, Look, Step,
};
use talos_upgrade_core::report::{annotation_changes, phase_change};
use talos_upgrade_core::talos::{self, Talos, TalosVersions};

use crate::model::World;

/// How a reconcile ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Reported,
    /// A save conflicted: nothing more was done (the shell retries at once).
    Conflict,
    /// The controller died during its calls.
    Crashed,
}

/// What one reconcile looked at, for the invariants.
#[derive(Debug, Default)]
pub struct Looked {
    pub talos: Option<TalosVersions>,
    pub kubernetes: Option<KubernetesVersions>,
}

/// One kind's IO against the world.
trait Io<K: Kind> {
    fn versions(&mut self, w: &mut World, looked: &mut Looked) -> K::Versions;
    fn cluster(
        &mut self,
        w: &mut World,
        request: &K::Request,
        looked: &mut Looked,
    ) -> K::Observation;
    fn further(&mut self, w: &mut World, work: &[K::Further]) -> Vec<K::FurtherLooked>;
    fn call(&mut self, w: &mut World, action: &K::Action) -> Called;
    fn save(w: &mut World, run: Option<K::Run>);
    fn saved(w: &World) -> Option<K::Run>;
}

struct TalosIo;
struct KubernetesIo;

impl Io<Talos> for TalosIo {
    fn versions(&mut self, w: &mut World, looked: &mut Looked) -> TalosVersions {
        let versions = w.talos_versions();
        looked.talos = Some(versions.clone());
        versions
    }

    fn cluster(
        &mut self,
        w: &mut World,
        request: &talos::StartingNodes,
        looked: &mut Looked,
    ) -> talos::Observation {
        let named: Vec<(&str, _)> = w
            .nodes
            .iter()
            .filter(|n| n.present)
            .map(|n| (n.name.as_str(), n.role))
            .collect();
        let reading = request.names(&named);
        let mut observation = w.talos_observation(&reading);
        // The shell asks only the nodes in flight then, and keeps the others' last look: the
        // core treats the look as such (and looks at everything again before anything moves on).
        // etcd is asked only when a control plane is among the nodes that may start, as the shell
        // does: the core looks at it before deciding where it needs it.
        let control_plane_starts = reading.iter().any(|name| {
            named.iter().any(|(n, role)| {
                n == name && *role == talos_upgrade_core::run::NodeRole::ControlPlane
            })
        });
        let etcd_asked = match request {
            talos::StartingNodes::Every => true,
            talos::StartingNodes::Named(_) => control_plane_starts,
            talos::StartingNodes::InFlight { .. } => false,
        };
        if !etcd_asked {
            observation.etcd = talos::EtcdObservation {
                problem: Some("etcd was not looked at in this pass".to_string()),
                leader: None,
            };
            observation.scope = talos::Scope::WithoutEtcd;
        }
        if let talos::StartingNodes::InFlight { .. } = request {
            observation.scope = talos::Scope::InFlight;
        }
        looked.talos = Some(Talos::versions_of(&observation));
        observation
    }

    fn further(&mut self, w: &mut World, work: &[talos::Further]) -> Vec<talos::FurtherLooked> {
        let mut looked = Vec::new();
        for further in work {
            looked.push(match further {
                talos::Further::Drain(nodes) => talos::FurtherLooked::Drained(w.drain(nodes)),
                talos::Further::InstallerImages(nodes) => {
                    talos::FurtherLooked::InstallerImages(w.installer_images(nodes))
                }
                talos::Further::Etcd => talos::FurtherLooked::Etcd(w.etcd()),
                talos::Further::Refresh(request) => talos::FurtherLooked::Refreshed(Ok(
                    self.cluster(w, request, &mut Looked::default())
                )),
            });
        }
        looked
    }

    fn call(&mut self, w: &mut World, action: &talos::Action) -> Called {
        w.talos_call(action)
    }

    fn save(w: &mut World, run: Option<talos::Run>) {
        w.store.talos = run;
    }

    fn saved(w: &World) -> Option<talos::Run> {
        w.store.talos.clone()
    }
}

impl Io<Kubernetes> for KubernetesIo {
    fn versions(&mut self, w: &mut World, looked: &mut Looked) -> KubernetesVersions {
        let versions = KubernetesVersions::of(&w.kubernetes_observation());
        looked.kubernetes = Some(versions.clone());
        versions
    }

    fn cluster(
        &mut self,
        w: &mut World,
        _: &talos_upgrade_core::kubernetes::Request,
        looked: &mut Looked,
    ) -> talos_upgrade_core::kubernetes::Observation {
        let observation = w.kubernetes_observation();
        looked.kubernetes = Some(KubernetesVersions::of(&observation));
        observation
    }

    fn further(
        &mut self,
        _: &mut World,
        work: &[lifecycle::NoFurther],
    ) -> Vec<lifecycle::NoFurther> {
        match work.first() {
            None => Vec::new(),
            Some(nothing) => match *nothing {},
        }
    }

    fn call(&mut self, w: &mut World, action: &talos_upgrade_core::kubernetes::Action) -> Called {
        w.kubernetes_call(action)
    }

    fn save(w: &mut World, run: Option<talos_upgrade_core::kubernetes::KubeRun>) {
        w.store.kubernetes = run;
    }

    fn saved(w: &World) -> Option<talos_upgrade_core::kubernetes::KubeRun> {
        w.store.kubernetes.clone()
    }
}

/// A save of the progress record, which may conflict.
fn save<K: Kind, I: Io<K>>(w: &mut World, run: Option<K::Run>) -> Result<(), Ended> {
    if I::saved(w) == run {
        return Ok(());
    }
    if std::mem::take(&mut w.conflict_next_save) {
        return Err(Ended::Conflict);
    }
    I::save(w, run);
    Ok(())
}

fn drive<K: Kind, I: Io<K>>(
    w: &mut World,
    mut lifecycle: Lifecycle<'_, K>,
    io: &mut I,
    looked: &mut Looked,
) -> Result<Conclusion<K>, Ended> {
    let mut step = lifecycle.start();
    loop {
        step = match step {
            Step::Look(Look::Versions) => {
                let versions = io.versions(w, looked);
                lifecycle.looked_at_versions(Ok(versions))
            }
            Step::Look(Look::Cluster(request)) => {
                let observation = io.cluster(w, &request, looked);
                lifecycle.looked_at_cluster(Ok(observation))
            }
            Step::Further(work) => {
                let results = io.further(w, &work);
                lifecycle.further(results)
            }
            Step::Act(act) => {
                save::<K, I>(w, Some(act.run.clone()))?;
                publish(w, &act.notes);
                let mut results = Vec::new();
                for (made, action) in act.actions.iter().enumerate() {
                    if w.crash_after_calls == Some(made) {
                        w.crash_after_calls = None;
                        return Err(Ended::Crashed);
                    }
                    let result = io.call(w, action);
                    let refused = matches!(result, Called::Refused(_));
                    results.push(result);
                    if refused {
                        break;
                    }
                }
                lifecycle.called(results)
            }
            Step::Done(conclusion) => {
                save::<K, I>(w, conclusion.record.clone())?;
                return Ok(conclusion);
            }
        };
    }
}

fn publish(w: &mut World, notes: &[talos_upgrade_core::run::Note]) {
    for note in notes {
        w.events
            .push((note.reason.as_str().to_string(), note.message.clone()));
    }
}

/// One reconcile of the cluster.
pub fn reconcile(w: &mut World, catalog: &Catalog, limits: Limits) -> (Ended, Looked) {
    let mut looked = Looked::default();
    let ended = reconcile_into(w, catalog, limits, &mut looked);
    (ended, looked)
}

fn reconcile_into(w: &mut World, catalog: &Catalog, limits: Limits, looked: &mut Looked) -> Ended {
    let annotations = w.annotations.clone();
    let intent = UpgradeIntent::from_annotations(&annotations);
    let now = w.timestamp();
    let talos_inputs = Inputs::<Talos> {
        intent: &intent,
        annotations: &annotations,
        record: w.store.talos.clone(),
        gates: Gates::for_talos(
            w.store.kubernetes.as_ref(),
            annotations
                .get(talos_upgrade_core::annotations::KUBERNETES_TARGET)
                .map(|t| t.trim()),
        ),
        limits,
        catalog,
        now,
    };
    let talos = match drive(w, Lifecycle::new(talos_inputs), &mut TalosIo, looked) {
        Ok(conclusion) => conclusion,
        Err(ended) => return ended,
    };
    let kubernetes_inputs = Inputs::<Kubernetes> {
        intent: &intent,
        annotations: &annotations,
        record: w.store.kubernetes.clone(),
        gates: Gates::for_kubernetes(w.store.talos.as_ref(), talos.report.status),
        limits,
        catalog,
        now,
    };
    let kubernetes = match drive(
        w,
        Lifecycle::new(kubernetes_inputs),
        &mut KubernetesIo,
        looked,
    ) {
        Ok(conclusion) => conclusion,
        Err(ended) => return ended,
    };
    let reports = [&talos.report, &kubernetes.report];
    let mut changes = std::collections::BTreeMap::new();
    for report in reports {
        changes.extend(annotation_changes(&w.annotations, report));
    }
    for (key, value) in changes {
        match value {
            Some(value) => w.annotations.insert(key.to_string(), value),
            None => w.annotations.remove(key),
        };
    }
    // The phase as src/reconcile/mod.rs writes it: a foreign phase is kept in the record before it is
    // replaced, and forgotten after it was given back.
    let kept = w.store.phase_kept.clone();
    let change = phase_change(&reports, w.phase.as_deref(), kept.as_deref());
    if change.keeps_first(kept.as_deref()) {
        if std::mem::take(&mut w.conflict_next_save) {
            return Ended::Conflict;
        }
        w.store.phase_kept = change.give_back.clone();
    }
    if let Some(phase) = &change.phase {
        w.phase = Some(phase.clone());
    }
    w.store.phase_kept = change.give_back;
    publish(w, &talos.notes);
    publish(w, &lifecycle::invalid_flag_notes(&intent));
    publish(w, &kubernetes.notes);
    Ended::Reported
}
