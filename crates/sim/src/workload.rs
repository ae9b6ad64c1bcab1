//! The simulated nodes' workload Kubernetes cluster: what kubelet and Talos would write into it.
//!
//! A real Talos node registers itself as a Kubernetes `Node`, runs the control-plane components as static
//! pods (which appear as mirror `Pod`s in `kube-system`), goes `NotReady` while it reboots, and is cordoned
//! by Talos during an upgrade. The controller watches exactly these objects, so the simulator reproduces
//! them in a real API server: a [`WorkloadMirror`] turns each [`WorkloadNode`] view into Node and Pod
//! objects, and [`WorkloadMirror::run_kubelet`] plays the kubelet's part for ordinary pods bound to
//! simulated nodes (running them, and finishing their deletion when they are evicted).

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;

/// Field manager of everything the simulator writes, so its fields never collide with the controller's.
pub const FIELD_MANAGER: &str = "talos-sim";
/// Talos marks nodes it cordoned itself with this annotation, and uncordons only those after boot.
pub const TALOS_CORDONED_ANNOTATION: &str = "talos.dev/cordoned";
/// Static pods carry the revision of the Talos config resource they were rendered from.
pub const CONFIG_VERSION_ANNOTATION: &str = "talos.dev/config-version";
const CONTROL_PLANE_LABEL: &str = "node-role.kubernetes.io/control-plane";
const STATIC_POD_NAMESPACE: &str = "kube-system";

/// What the workload cluster should show for one simulated node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadNode {
    pub name: String,
    pub address: Ipv4Addr,
    pub control_plane: bool,
    /// Talos version without a leading `v`, e.g. `1.11.6`.
    pub talos_version: String,
    /// kubelet version without a leading `v`, e.g. `1.34.1`.
    pub kubelet_version: String,
    pub boot_id: String,
    /// kubelet is running and posting node status (false while the node is down or booting).
    pub kubelet_posting: bool,
    /// The node reports Ready (kubelet posting and the node healthy).
    pub ready: bool,
    /// Talos cordons a node while it upgrades, shuts down or resets.
    pub talos_cordoned: bool,
    /// Control-plane static pods; empty on workers.
    pub static_pods: Vec<StaticPod>,
}

/// A control-plane component running as a static pod on a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticPod {
    /// `kube-apiserver`, `kube-controller-manager` or `kube-scheduler`.
    pub component: String,
    pub image: String,
    /// `metadata.version` of the Talos config resource the pod was rendered from.
    pub config_version: String,
    pub ready: bool,
}

/// What a sync wrote for one node: the state, and the Ready condition as written (its transition time
/// is kept across writes that do not change it, as kubelet keeps it).
struct Written {
    node: WorkloadNode,
    ready_since: ReadySince,
}

#[derive(Debug, Clone)]
struct ReadySince {
    status: String,
    since: Option<Time>,
}

impl WorkloadNode {
    /// The Node's labels, taints and Talos cordon (the object, not its status) would be written
    /// differently.
    fn metadata_differs(&self, other: &WorkloadNode) -> bool {
        self.name != other.name
            || self.control_plane != other.control_plane
            || self.talos_cordoned != other.talos_cordoned
    }

    /// The Node's status would be written differently.
    fn status_differs(&self, other: &WorkloadNode) -> bool {
        self.name != other.name
            || self.address != other.address
            || self.talos_version != other.talos_version
            || self.kubelet_version != other.kubelet_version
            || self.boot_id != other.boot_id
            || self.kubelet_posting != other.kubelet_posting
            || self.ready != other.ready
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("workload cluster: {action}: {source}")]
    Kube {
        action: String,
        #[source]
        source: kube::Error,
    },
}

/// Parameters of the status patches, under the simulator's field manager.
fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    }
}

fn kube_error(action: impl Into<String>) -> impl FnOnce(kube::Error) -> WorkloadError {
    let action = action.into();
    move |source| WorkloadError::Kube { action, source }
}

/// Writes simulated nodes into the workload cluster.
#[derive(Clone)]
pub struct WorkloadMirror {
    client: Client,
    /// Put on every Node and mirror Pod written (the benchmark tells its clusters apart by one).
    extra_labels: BTreeMap<String, String>,
}

impl WorkloadMirror {
    pub fn new(client: Client) -> Self {
        WorkloadMirror {
            client,
            extra_labels: BTreeMap::new(),
        }
    }

    /// Also label every Node and mirror Pod written with `labels`.
    pub fn with_labels(mut self, labels: BTreeMap<String, String>) -> Self {
        self.extra_labels = labels;
        self
    }

    /// Brings the Node and its static pods in line with `node`, writing every object. Idempotent.
    pub async fn sync(&self, node: &WorkloadNode) -> Result<(), WorkloadError> {
        self.sync_since(None, node).await.map(|_| ())
    }

    /// Brings the workload cluster from `written` (what the last successful sync wrote, if known) to
    /// `node`, writing only the objects whose content changed, as a kubelet posts only what changed.
    /// Each change of a simulated node used to rewrite the Node, its status and every static pod (nine
    /// sequential requests for a control plane); at a thousand nodes on one API server that was a large
    /// part of its load and delayed the one write that mattered, the Node's Ready.
    async fn sync_since(
        &self,
        written: Option<&Written>,
        node: &WorkloadNode,
    ) -> Result<Written, WorkloadError> {
        let before = written.map(|w| &w.node);
        if before.is_none_or(|b| b.metadata_differs(node)) {
            self.apply_node(node).await?;
        }
        let ready_since = match written {
            Some(w) if !w.node.status_differs(node) => w.ready_since.clone(),
            _ => {
                self.apply_node_status(written.map(|w| &w.ready_since), node)
                    .await?
            }
        };
        for pod in &node.static_pods {
            let unchanged = before.is_some_and(|b| {
                b.kubelet_posting == node.kubelet_posting
                    && b.address == node.address
                    && b.static_pods.contains(pod)
            });
            if !unchanged {
                let known = before.and_then(|b| {
                    b.static_pods
                        .iter()
                        .find(|p| p.component == pod.component)
                        .map(|p| p.config_version == pod.config_version && p.image == pod.image)
                });
                self.sync_static_pod(node, pod, known.unwrap_or(false))
                    .await?;
            }
        }
        Ok(Written {
            node: node.clone(),
            ready_since,
        })
    }

    async fn apply_node(&self, node: &WorkloadNode) -> Result<(), WorkloadError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let mut labels = BTreeMap::from([
            ("kubernetes.io/hostname".to_string(), node.name.clone()),
            ("kubernetes.io/os".to_string(), "linux".to_string()),
            ("kubernetes.io/arch".to_string(), "amd64".to_string()),
        ]);
        let mut taints = Vec::new();
        labels.extend(self.extra_labels.clone());
        if node.control_plane {
            labels.insert(CONTROL_PLANE_LABEL.to_string(), String::new());
            taints.push(json!({"key": CONTROL_PLANE_LABEL, "effect": "NoSchedule"}));
        }
        // Only while Talos holds its own cordon does the simulator own `unschedulable` and the annotation;
        // leaving them out of the next apply releases them (Talos's uncordon after boot). A cordon put there
        // by someone else (the controller, an operator) is never touched: those fields are not ours.
        let mut metadata = json!({"name": node.name, "labels": labels});
        let mut spec = json!({"taints": taints});
        if node.talos_cordoned {
            metadata["annotations"] = json!({TALOS_CORDONED_ANNOTATION: "true"});
            spec["unschedulable"] = json!(true);
        }
        let body = json!({"apiVersion": "v1", "kind": "Node", "metadata": metadata, "spec": spec});
        nodes
            .patch(
                &node.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(body),
            )
            .await
            .map_err(kube_error(format!("applying Node {}", node.name)))?;
        Ok(())
    }

    /// Writes the Node's status and returns its Ready condition's status and transition time. The
    /// transition time is kept from the last write when the condition did not change; without a last
    /// write it is read from the Node.
    async fn apply_node_status(
        &self,
        last_written: Option<&ReadySince>,
        node: &WorkloadNode,
    ) -> Result<ReadySince, WorkloadError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let (status, reason, message) = match (node.kubelet_posting, node.ready) {
            (true, true) => ("True", "KubeletReady", "kubelet is posting ready status"),
            (true, false) => ("False", "KubeletNotReady", "node is booting"),
            // What the node lifecycle controller writes when kubelet goes silent (the node rebooted).
            (false, _) => (
                "Unknown",
                "NodeStatusUnknown",
                "Kubelet stopped posting node status.",
            ),
        };
        let now = Time(jiff::Timestamp::now());
        let previous = match last_written {
            Some(ready_since) => Some(ready_since.clone()),
            None => nodes
                .get_status(&node.name)
                .await
                .map_err(kube_error(format!("reading Node {}", node.name)))?
                .status
                .and_then(|s| s.conditions)
                .and_then(|conditions| conditions.into_iter().find(|c| c.type_ == "Ready"))
                .map(|c| ReadySince {
                    status: c.status,
                    since: c.last_transition_time,
                }),
        };
        let transition = match previous {
            Some(ReadySince {
                status: previous,
                since: Some(since),
            }) if previous == status => since,
            _ => now.clone(),
        };
        // A strategic merge patch, as kubelet sends its node status (conditions and addresses merge
        // by type): far cheaper for the API server than a server-side apply of the same fields.
        let body = json!({
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": node.address.to_string()},
                    {"type": "Hostname", "address": node.name},
                ],
                "conditions": [{
                    "type": "Ready",
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": transition,
                }],
                "nodeInfo": {
                    "machineID": node.name,
                    "systemUUID": node.name,
                    "bootID": node.boot_id,
                    "kernelVersion": "6.12.0-talos",
                    "osImage": format!("Talos (v{})", node.talos_version),
                    "containerRuntimeVersion": "containerd://2.1.0",
                    "kubeletVersion": format!("v{}", node.kubelet_version),
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        });
        nodes
            .patch_status(&node.name, &merge_params(), &Patch::Strategic(body))
            .await
            .map_err(kube_error(format!("updating Node {} status", node.name)))?;
        Ok(ReadySince {
            status: status.to_string(),
            since: Some(transition),
        })
    }

    /// Creates a static pod's mirror Pod, or replaces it when the manifest it was rendered from changed.
    async fn ensure_static_pod(
        &self,
        pods: &Api<Pod>,
        name: &str,
        node: &WorkloadNode,
        pod: &StaticPod,
    ) -> Result<(), WorkloadError> {
        let existing = pods
            .get_opt(name)
            .await
            .map_err(kube_error(format!("reading Pod {name}")))?;
        let rendered_from = existing.as_ref().and_then(|p| {
            p.annotations()
                .get(CONFIG_VERSION_ANNOTATION)
                .map(|v| (v.clone(), first_image(p)))
        });
        let up_to_date = rendered_from.as_ref().is_some_and(|(version, image)| {
            *version == pod.config_version && image.as_deref() == Some(&pod.image)
        });
        if !up_to_date {
            // kubelet replaces a static pod whose manifest changed: the mirror pod is deleted and created
            // again (a new UID), which is what `talosctl upgrade-k8s` waits for.
            if existing.is_some() {
                pods.delete(name, &DeleteParams::default().grace_period(0))
                    .await
                    .map_err(kube_error(format!("replacing Pod {name}")))?;
            }
            let mut labels = BTreeMap::from([
                ("k8s-app".to_string(), pod.component.clone()),
                ("tier".to_string(), "control-plane".to_string()),
            ]);
            labels.extend(self.extra_labels.clone());
            let mirror: Pod = serde_json::from_value(json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": STATIC_POD_NAMESPACE,
                    "labels": labels,
                    "annotations": {
                        CONFIG_VERSION_ANNOTATION: pod.config_version,
                        "kubernetes.io/config.source": "file",
                        "kubernetes.io/config.mirror": pod.config_version,
                    },
                },
                "spec": {
                    "nodeName": node.name,
                    "hostNetwork": true,
                    "priorityClassName": "system-cluster-critical",
                    "containers": [{"name": pod.component, "image": pod.image}],
                },
            }))
            .expect("a static pod manifest is a valid Pod");
            pods.create(&PostParams::default(), &mirror)
                .await
                .map_err(kube_error(format!("creating Pod {name}")))?;
        }
        Ok(())
    }

    /// Writes a static pod's mirror Pod: created again when its manifest changed, then its status.
    /// `known_current`: the last sync wrote this very manifest, so the Pod need not be read to know it.
    async fn sync_static_pod(
        &self,
        node: &WorkloadNode,
        pod: &StaticPod,
        known_current: bool,
    ) -> Result<(), WorkloadError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), STATIC_POD_NAMESPACE);
        let name = format!("{}-{}", pod.component, node.name);
        if !known_current {
            self.ensure_static_pod(&pods, &name, node, pod).await?;
        }
        let ready = if pod.ready && node.kubelet_posting {
            "True"
        } else {
            "False"
        };
        // Strategic merge, as kubelet patches pod status (conditions by type, containers by name).
        let status = json!({
            "status": {
                "phase": "Running",
                "hostIP": node.address.to_string(),
                "podIP": node.address.to_string(),
                "conditions": [{"type": "Ready", "status": ready}],
                "containerStatuses": [{
                    "name": pod.component,
                    "image": pod.image,
                    "imageID": "",
                    "ready": ready == "True",
                    "restartCount": 0,
                    "started": node.kubelet_posting,
                }],
            },
        });
        pods.patch_status(&name, &merge_params(), &Patch::Strategic(status))
            .await
            .map_err(kube_error(format!("updating Pod {name} status")))?;
        Ok(())
    }

    /// Plays kubelet for ordinary pods bound to the simulated nodes until the stream of pod changes ends:
    /// a pod scheduled there is reported Running and Ready, and a pod being deleted (an eviction during a
    /// drain) is finished off, as kubelet does once its containers stop. Without this, evicted pods would
    /// stay `Terminating` for ever on a cluster with no kubelet.
    pub async fn run_kubelet(&self, node_names: BTreeSet<String>) -> Result<(), WorkloadError> {
        let all_pods: Api<Pod> = Api::all(self.client.clone());
        // Backoff between failed watch attempts: without it a watch against an API server that went away
        // fails instantly, over and over, and the task never yields.
        let mut changes = watcher::watcher(all_pods, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        loop {
            let pod = match changes.try_next().await {
                Ok(Some(pod)) => pod,
                Ok(None) => return Ok(()),
                // The watcher re-lists by itself after errors; log and carry on as kubelet would.
                Err(error) => {
                    tracing::warn!(%error, "workload pod watch");
                    continue;
                }
            };
            let Some(node_name) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            if !node_names.contains(&node_name) || is_mirror_pod(&pod) {
                continue;
            }
            let namespace = pod.namespace().unwrap_or_default();
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
            let name = pod.name_any();
            let result = if pod.metadata.deletion_timestamp.is_some() {
                pods.delete(&name, &DeleteParams::default().grace_period(0))
                    .await
                    .map(|_| ())
            } else if !is_running(&pod) {
                let status = json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": namespace},
                    "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
                });
                pods.patch_status(
                    &name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(status),
                )
                .await
                .map(|_| ())
            } else {
                Ok(())
            };
            match result {
                // Gone already: someone else finished the deletion.
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(error) => tracing::warn!(%error, pod = %name, "kubelet emulation"),
                Ok(()) => {}
            }
        }
    }
}

fn first_image(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()
        .and_then(|spec| spec.containers.first())
        .and_then(|container| container.image.clone())
}

fn is_mirror_pod(pod: &Pod) -> bool {
    pod.annotations()
        .contains_key("kubernetes.io/config.mirror")
}

fn is_running(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Running")
}

impl WorkloadNode {
    /// What the workload cluster shows for a simulated node in this state.
    pub fn from_snapshot(snapshot: &super::node::NodeSnapshot) -> Self {
        // kubelet posts status while the machine is up and its kubelet service runs; the Node is Ready
        // when, in addition, Talos considers the machine ready (a delayed-ready fault keeps it NotReady).
        let kubelet_posting = !snapshot.down && snapshot.kubelet.running;
        let static_pods = snapshot
            .control_plane
            .as_ref()
            .map(|cp| {
                [
                    ("kube-apiserver", &cp.apiserver),
                    ("kube-controller-manager", &cp.controller_manager),
                    ("kube-scheduler", &cp.scheduler),
                ]
                .into_iter()
                .map(|(component, running)| StaticPod {
                    component: component.to_string(),
                    image: running.image.clone(),
                    config_version: running.config_version.to_string(),
                    ready: running.running,
                })
                .collect()
            })
            .unwrap_or_default();
        WorkloadNode {
            name: snapshot.name.clone(),
            address: snapshot.address,
            control_plane: snapshot.role.is_control_plane(),
            talos_version: snapshot.talos_version.clone(),
            kubelet_version: snapshot.kubelet.version.clone(),
            boot_id: snapshot.boot_id.clone(),
            kubelet_posting,
            ready: kubelet_posting && snapshot.ready,
            talos_cordoned: snapshot.cordoned,
            static_pods,
        }
    }
}

impl WorkloadMirror {
    /// Keeps one node's Kubernetes objects in step with its simulated machine until the simulator drops
    /// the channel. Only changes the workload cluster can see are written; a failed write is retried on
    /// the next change or after a short pause, because the API server may itself be restarting.
    pub async fn follow(&self, snapshots: tokio::sync::watch::Receiver<super::node::NodeSnapshot>) {
        self.follow_reporting(snapshots, |_| {}).await
    }

    /// [`WorkloadMirror::follow`], calling `on_written` with each state once it is in the workload
    /// cluster (the benchmark times the simulated kubelet's part of a node's return with it).
    pub async fn follow_reporting(
        &self,
        mut snapshots: tokio::sync::watch::Receiver<super::node::NodeSnapshot>,
        mut on_written: impl FnMut(&WorkloadNode),
    ) {
        let mut written: Option<Written> = None;
        loop {
            let wanted = WorkloadNode::from_snapshot(&snapshots.borrow_and_update());
            if written.as_ref().map(|w| &w.node) != Some(&wanted) {
                match self.sync_since(written.as_ref(), &wanted).await {
                    Ok(now_written) => {
                        on_written(&wanted);
                        written = Some(now_written);
                    }
                    Err(error) => {
                        tracing::warn!(%error, node = %wanted.name, "workload cluster sync failed; retrying");
                        // What the failed sync left behind is unknown: a write whose answer was lost
                        // (an API server going down after committing it) may have landed, and the
                        // node may have moved back to the state last written since. The retry
                        // writes everything again.
                        written = None;
                        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                        continue;
                    }
                }
            }
            if snapshots.changed().await.is_err() {
                return;
            }
        }
    }
}
