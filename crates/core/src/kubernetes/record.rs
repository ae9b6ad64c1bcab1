//! What the controller remembers about a Kubernetes upgrade run between reconciles and across restarts.
//!
//! Like the Talos run ([`crate::talos::Run`]) the record is written *before* every call that
//! changes a node (write-ahead) and lives in a ConfigMap the controller owns, as JSON. Other controller
//! versions may read it, so field names and tags are part of the format: add fields with defaults, never
//! rename.

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::run::Outcome;

/// One run: the cluster's Kubernetes taken from `from` to `target`, step by step in an order fixed when
/// the run started (the order of `talosctl upgrade-k8s`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeRun {
    /// The target as the user wrote it (`v1.35.0` or `1.35.0`); a different annotation value is a new run.
    pub requested: String,
    /// The normalised target version, without a leading `v`.
    pub target: String,
    /// The lowest version running when the run started, without a leading `v`.
    pub from: String,
    pub started_at: Timestamp,
    /// Set once the run ends; a finished run is never decided again for the same `requested` value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Every step of the run, in the order they are taken; the order never changes within a run. Empty
    /// for a target refused before any step (the outcome then says why).
    #[serde(default)]
    pub steps: Vec<StepProgress>,
    /// The etcd snapshot before the first step that restarts something on a control plane
    /// (`etcd-snapshot: talos-and-kubernetes`, see [`crate::etcd_snapshot`]); written before the
    /// call, like every step. Absent in runs that take none, and in records of older controllers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_snapshot: Option<crate::etcd_snapshot::Snapshot>,
}

/// One step and where it stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepProgress {
    #[serde(flatten)]
    pub step: Step,
    #[serde(flatten)]
    pub state: StepState,
}

/// A control-plane component Talos runs as a static pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Component {
    KubeApiserver,
    KubeControllerManager,
    KubeScheduler,
}

impl Component {
    /// The order `talosctl upgrade-k8s` upgrades them in: the API server first, so the controllers
    /// never talk to an API server older than themselves.
    pub const ALL: [Component; 3] = [
        Component::KubeApiserver,
        Component::KubeControllerManager,
        Component::KubeScheduler,
    ];

    /// `kube-apiserver`, …: the static pod's `k8s-app` label and the name in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::KubeApiserver => "kube-apiserver",
            Component::KubeControllerManager => "kube-controller-manager",
            Component::KubeScheduler => "kube-scheduler",
        }
    }
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One unit of work, verified before the next one starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "step"
)]
pub enum Step {
    /// Pull the new images the node needs, so the restarts that follow are short.
    PrePull { node: String },
    /// Move one control-plane component of one node to the new image.
    ControlPlane { component: Component, node: String },
    /// Set the node's `cluster.proxy.image` (control planes render the kube-proxy DaemonSet from it).
    KubeProxy { node: String },
    /// Move the node's kubelet to the new image.
    Kubelet { node: String },
    /// Apply the bootstrap manifests (kube-proxy, CoreDNS, …) the control planes render.
    Manifests,
}

impl Step {
    /// The node the step works on; `None` for the cluster-wide manifest sync.
    pub fn node(&self) -> Option<&str> {
        match self {
            Step::PrePull { node }
            | Step::ControlPlane { node, .. }
            | Step::KubeProxy { node }
            | Step::Kubelet { node } => Some(node),
            Step::Manifests => None,
        }
    }

    /// Whether the step restarts something the cluster runs on (a control-plane pod, a kubelet): those
    /// start only when the whole cluster is healthy.
    pub fn restarts_something(&self) -> bool {
        match self {
            Step::ControlPlane { .. } | Step::Kubelet { .. } => true,
            Step::PrePull { .. } | Step::KubeProxy { .. } | Step::Manifests => false,
        }
    }

    /// What the step does, as the subject of a sentence: `updating kube-apiserver on node cp-1`.
    pub fn activity(&self) -> String {
        match self {
            Step::PrePull { node } => format!("pre-pulling images on node {node}"),
            Step::ControlPlane { component, node } => {
                format!("updating {component} on node {node}")
            }
            Step::KubeProxy { node } => format!("updating kube-proxy on node {node}"),
            Step::Kubelet { node } => format!("updating the kubelet on node {node}"),
            Step::Manifests => "syncing the bootstrap manifests".to_string(),
        }
    }
}

/// Where a step is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "state"
)]
pub enum StepState {
    /// Not started.
    Pending,
    /// Started at `at`: the call was (or is about to be) made. Every call of this upgrade is idempotent,
    /// so unlike a Talos OS upgrade an issued step may be called again when its effect is not seen.
    Issued {
        at: Timestamp,
        /// The image the step sets, for steps that patch one: fixed when the step starts, so a re-sent
        /// patch and the verification use the same image even if the node's config changes meanwhile.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        image: Option<String>,
    },
    /// Verified.
    Done {
        at: Timestamp,
        /// When the step started (absent for steps that were already satisfied when they came up).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<Timestamp>,
    },
    Failed {
        at: Timestamp,
        reason: String,
    },
}

impl StepState {
    pub fn is_done(&self) -> bool {
        matches!(self, StepState::Done { .. })
    }

    /// Whether work on the step began in this run (as opposed to it being found already satisfied).
    pub fn was_started(&self) -> bool {
        match self {
            StepState::Pending
            | StepState::Done {
                started_at: None, ..
            } => false,
            StepState::Issued { .. }
            | StepState::Done {
                started_at: Some(_),
                ..
            }
            | StepState::Failed { .. } => true,
        }
    }
}

impl KubeRun {
    /// The nodes of the run, in the order their first step comes (control planes, then workers).
    pub fn nodes(&self) -> Vec<&str> {
        let mut nodes: Vec<&str> = Vec::new();
        for node in self.steps.iter().filter_map(|s| s.step.node()) {
            if !nodes.contains(&node) {
                nodes.push(node);
            }
        }
        nodes
    }

    /// The control planes of the run, in run order.
    pub fn control_planes(&self) -> Vec<&str> {
        let mut nodes: Vec<&str> = Vec::new();
        for step in &self.steps {
            if let Step::KubeProxy { node } = &step.step
                && !nodes.contains(&node.as_str())
            {
                nodes.push(node);
            }
        }
        nodes
    }

    /// Whether every step of `node` is done.
    pub fn node_done(&self, node: &str) -> bool {
        self.steps
            .iter()
            .filter(|s| s.step.node() == Some(node))
            .all(|s| s.state.is_done())
    }

    /// Nodes finished (every step of theirs done) and the total, as `kubernetes-progress` shows them.
    pub fn counts(&self) -> (usize, usize) {
        let nodes = self.nodes();
        let done = nodes.iter().filter(|n| self.node_done(n)).count();
        (done, nodes.len())
    }

    /// Nodes with a failed step.
    pub fn failed_nodes(&self) -> Vec<&str> {
        let mut nodes: Vec<&str> = Vec::new();
        for step in &self.steps {
            if let (StepState::Failed { .. }, Some(node)) = (&step.state, step.step.node())
                && !nodes.contains(&node)
            {
                nodes.push(node);
            }
        }
        nodes
    }

    /// Whether a step that restarts something on a control plane is still to come while the run's
    /// etcd snapshot is not taken: only then does a run that wants one look at etcd.
    pub fn snapshot_due(&self) -> bool {
        if self.outcome.is_some()
            || self
                .etcd_snapshot
                .as_ref()
                .is_some_and(crate::etcd_snapshot::Snapshot::is_taken)
        {
            return false;
        }
        let control_planes = self.control_planes();
        self.steps.iter().any(|s| {
            !s.state.is_done()
                && s.step.restarts_something()
                && s.step.node().is_some_and(|n| control_planes.contains(&n))
        })
    }

    /// The step being worked on: the first one not done, if it is issued.
    pub fn step_in_flight(&self) -> Option<usize> {
        self.steps
            .iter()
            .position(|s| !s.state.is_done())
            .filter(|&i| matches!(self.steps[i].state, StepState::Issued { .. }))
    }

    pub fn is_finished(&self) -> bool {
        self.outcome.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_round_trips_through_json_with_stable_field_names() {
        let at: Timestamp = "2026-11-25T10:00:00Z".parse().expect("timestamp");
        let run = KubeRun {
            requested: "v1.35.0".into(),
            target: "1.35.0".into(),
            from: "1.34.1".into(),
            started_at: at,
            outcome: None,
            steps: vec![
                StepProgress {
                    step: Step::PrePull {
                        node: "cp-1".into(),
                    },
                    state: StepState::Done {
                        at,
                        started_at: Some(at),
                    },
                },
                StepProgress {
                    step: Step::ControlPlane {
                        component: Component::KubeApiserver,
                        node: "cp-1".into(),
                    },
                    state: StepState::Issued {
                        at,
                        image: Some("registry.k8s.io/kube-apiserver:v1.35.0".into()),
                    },
                },
                StepProgress {
                    step: Step::Kubelet { node: "w-1".into() },
                    state: StepState::Failed {
                        at,
                        reason: "boom".into(),
                    },
                },
                StepProgress {
                    step: Step::Manifests,
                    state: StepState::Pending,
                },
            ],
            etcd_snapshot: Some(crate::etcd_snapshot::Snapshot::Taking {
                node: "cp-2".into(),
                at,
            }),
        };
        let json = serde_json::to_value(&run).expect("serialize");
        assert_eq!(json["startedAt"], "2026-11-25T10:00:00Z");
        assert_eq!(json["from"], "1.34.1");
        assert_eq!(json["steps"][0]["step"], "prePull");
        assert_eq!(json["steps"][0]["startedAt"], "2026-11-25T10:00:00Z");
        assert_eq!(json["steps"][1]["step"], "controlPlane");
        assert_eq!(json["steps"][1]["component"], "kube-apiserver");
        assert_eq!(json["steps"][1]["node"], "cp-1");
        assert_eq!(json["steps"][1]["state"], "issued");
        assert_eq!(
            json["steps"][1]["image"],
            "registry.k8s.io/kube-apiserver:v1.35.0"
        );
        assert_eq!(json["steps"][2]["state"], "failed");
        assert_eq!(json["steps"][3]["step"], "manifests");
        assert_eq!(json["steps"][3]["state"], "pending");
        assert_eq!(json["etcdSnapshot"]["state"], "taking");
        assert_eq!(json["etcdSnapshot"]["node"], "cp-2");
        let back: KubeRun = serde_json::from_value(json).expect("deserialize");
        assert_eq!(back, run);
        assert_eq!(run.nodes(), vec!["cp-1", "w-1"]);
        assert_eq!(run.failed_nodes(), vec!["w-1"]);
        assert_eq!(run.counts(), (0, 2));
        assert_eq!(run.step_in_flight(), Some(1));
    }

    #[test]
    fn a_run_written_by_an_older_controller_still_reads() {
        // Optional fields may be missing; they read as absent.
        let json = serde_json::json!({
            "requested": "1.35.0",
            "target": "1.35.0",
            "from": "1.34.1",
            "startedAt": "2026-11-25T10:00:00Z",
            "steps": [
                {"step": "kubeProxy", "node": "cp-1", "state": "issued", "at": "2026-11-25T10:00:00Z"},
                {"step": "kubelet", "node": "cp-1", "state": "done", "at": "2026-11-25T10:00:00Z"}
            ]
        });
        let run: KubeRun = serde_json::from_value(json).expect("deserialize");
        assert!(run.outcome.is_none());
        assert!(run.etcd_snapshot.is_none());
        assert!(matches!(
            run.steps[0].state,
            StepState::Issued { image: None, .. }
        ));
        assert!(!run.steps[1].state.was_started());
    }
}
