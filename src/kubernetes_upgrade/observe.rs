//! Filling the Kubernetes upgrade's [`Observation`]: each node's Talos API (version, readiness, the
//! images its machine config sets, the control-plane config-resource versions), the workload
//! cluster (the Node's kubelet version and readiness, the control-plane mirror pods) and, while the
//! run's etcd snapshot is due, etcd's health as the control planes report it.

use std::collections::HashMap;

use futures::future::join_all;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams};

use super::machine_config;
use crate::inventory::InventoryNode;
use crate::inventory::WorkloadNodeInfo;
use crate::talos_fleet::{TalosFleet, control_planes, parse_talos_tag};
use talos_api::{TalosClient, TalosError, resources};
use talos_upgrade_core::kubernetes::{
    Component, ConfigVersions, ConfiguredImages, NodeObservation, Observation, StaticPod, TalosApi,
};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::versions::{KubernetesVersion, TalosVersion};

/// Where Talos runs the control-plane static pods' mirror pods.
const STATIC_POD_NAMESPACE: &str = "kube-system";
/// Talos labels its static pods with their component (`k8s-app=kube-apiserver`, …).
const COMPONENT_LABEL: &str = "k8s-app";
/// kubelet sets this annotation on every mirror pod; ordinary pods with the same label never carry it.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// The config-resource version Talos rendered the static pod from.
const CONFIG_VERSION_ANNOTATION: &str = "talos.dev/config-version";

/// What the Talos API of one node says.
struct TalosSide {
    talos: TalosApi,
    images: ConfiguredImages,
    config_versions: ConfigVersions,
}

/// What the workload cluster says, read once per observation.
#[derive(Default)]
struct KubeSide {
    nodes: HashMap<String, NodeFacts>,
    pods: Vec<Pod>,
}

/// What the upgrade needs of one workload Node.
struct NodeFacts {
    /// A kubelet version that does not parse is left out, as the decision core expects.
    kubelet_version: Option<KubernetesVersion>,
    ready: bool,
}

impl NodeFacts {
    fn of(node: &Node) -> NodeFacts {
        NodeFacts {
            kubelet_version: node
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                // `v1.34.1`; the parser takes the `v`.
                .and_then(|info| KubernetesVersion::parse(&info.kubelet_version).ok()),
            ready: crate::inventory::node_ready(node),
        }
    }
}

pub(super) async fn observe(
    fleet: &TalosFleet,
    inventory: &[InventoryNode],
    workload: &kube::Client,
    etcd: bool,
    listed: Option<&[WorkloadNodeInfo]>,
) -> Observation {
    let talos = join_all(inventory.iter().map(|node| observe_talos(fleet, node)));
    // etcd beside the nodes, in the same round trip, and only when the decision reads it: a run
    // that takes no snapshot (or has taken it) makes no etcd calls.
    let etcd = async {
        if etcd {
            fleet.observe_etcd(&control_planes(inventory)).await
        } else {
            Default::default()
        }
    };
    let (talos, kube, etcd) = tokio::join!(talos, observe_kube(workload, inventory, listed), etcd);
    let nodes = inventory
        .iter()
        .zip(talos)
        .map(|(node, talos)| node_observation(node, talos, &kube))
        .collect();
    Observation { nodes, etcd }
}

/// Only what `kubernetes-current` and `kubernetes-available` need, for a cluster with no Kubernetes
/// upgrade in flight: the nodes' Talos versions (already asked, in inventory order), the kubelets and the
/// control-plane mirror pods. No machine config and no component config is read; a node shows not ready.
pub(super) async fn observe_versions(
    inventory: &[InventoryNode],
    talos_versions: &[Result<semver::Version, String>],
    workload: &kube::Client,
    workload_nodes: &[WorkloadNodeInfo],
) -> Observation {
    // The Nodes were listed already (with the inventory); only the mirror pods are read here.
    let kube = KubeSide {
        nodes: node_facts(workload_nodes),
        pods: list_static_pods(workload).await,
    };
    let nodes = inventory
        .iter()
        .zip(talos_versions)
        .map(|(node, version)| {
            let talos = match version {
                Ok(version) => TalosApi::Up {
                    version: TalosVersion::from_semver(version.clone()),
                    ready: false,
                },
                Err(reason) => TalosApi::Unreachable {
                    reason: reason.clone(),
                },
            };
            let side = TalosSide {
                talos,
                images: ConfiguredImages::default(),
                config_versions: ConfigVersions::default(),
            };
            node_observation(node, side, &kube)
        })
        .collect();
    Observation {
        nodes,
        // Versions only: no decision is made on this observation.
        etcd: Default::default(),
    }
}

fn node_observation(node: &InventoryNode, talos: TalosSide, kube: &KubeSide) -> NodeObservation {
    let k8s_node = kube.nodes.get(&node.name);
    let kubelet_version = k8s_node.and_then(|n| n.kubelet_version.clone());
    let kubernetes_ready = k8s_node.is_some_and(|n| n.ready);
    let static_pods = if node.role == NodeRole::ControlPlane {
        static_pods_of(&node.name, &kube.pods)
    } else {
        Vec::new()
    };
    NodeObservation {
        name: node.name.clone(),
        role: node.role,
        talos: talos.talos,
        images: talos.images,
        config_versions: talos.config_versions,
        static_pods,
        kubelet_version,
        kubernetes_ready,
    }
}

async fn observe_talos(fleet: &TalosFleet, node: &InventoryNode) -> TalosSide {
    match try_observe_talos(fleet, node).await {
        Ok(side) => side,
        // Unreadable is reported as unreachable, never as empty images: `None` in `ConfiguredImages`
        // means "unset", and the decision would patch the default repository over a mirror.
        Err(reason) => TalosSide {
            talos: TalosApi::Unreachable { reason },
            images: ConfiguredImages::default(),
            config_versions: ConfigVersions::default(),
        },
    }
}

async fn try_observe_talos(fleet: &TalosFleet, node: &InventoryNode) -> Result<TalosSide, String> {
    let control_plane = node.role == NodeRole::ControlPlane;
    let (version, status, config, config_versions) = fleet
        .ask(node.address, |client| async move {
            futures::try_join!(
                client.version(),
                client.machine_status(),
                client.machine_config(),
                config_versions(&client, control_plane),
            )
        })
        .await
        .map_err(|e| e.to_string())?;
    let version = parse_talos_tag(&version.tag).map(TalosVersion::from_semver)?;
    let ready = resources::machine_status::is_running_and_ready(&status);
    let images =
        machine_config::configured_images(config.as_bytes(), control_plane).map_err(|e| {
            format!(
                "the machine config of node {} cannot be read: {e}",
                node.name
            )
        })?;
    Ok(TalosSide {
        talos: TalosApi::Up { version, ready },
        images,
        config_versions,
    })
}

/// The prefix of the config resources Talos 1.14 renders the static pods from (`final-kube-apiserver`,
/// …): machinery v1.14.1 `resources/k8s/k8s.go` `FinalPrefix`, and `FinalAPIServerConfigID` &c. in
/// `resources/k8s/{apiserver,controllermanager,scheduler}_config.go`.
const FINAL_PREFIX: &str = "final-";

/// The `metadata.version` of the control-plane component config resources; nothing on workers. A
/// resource that does not exist (the component is disabled, or not rendered yet) is `None`.
async fn config_versions(
    client: &TalosClient,
    control_plane: bool,
) -> Result<ConfigVersions, TalosError> {
    if !control_plane {
        return Ok(ConfigVersions::default());
    }
    use resources::{api_server_config, controller_manager_config, scheduler_config};
    let (api_server, controller_manager, scheduler) = futures::try_join!(
        config_version(
            client,
            api_server_config::NAMESPACE,
            api_server_config::TYPE,
            api_server_config::ID,
        ),
        config_version(
            client,
            controller_manager_config::NAMESPACE,
            controller_manager_config::TYPE,
            controller_manager_config::ID,
        ),
        config_version(
            client,
            scheduler_config::NAMESPACE,
            scheduler_config::TYPE,
            scheduler_config::ID,
        ),
    )?;
    Ok(ConfigVersions {
        api_server,
        controller_manager,
        scheduler,
    })
}

/// The version of the config resource a static pod's `talos.dev/config-version` is compared with:
/// `final-<id>` where the node has it, `<id>` otherwise.
///
/// Talos 1.14 merges `<id>` with its defaults into `final-<id>`, renders the static pod from that
/// one and writes *its* version in the annotation (talos 1.14 machined,
/// `controllers/k8s/control_plane_static_pod.go` reads the `Final*ConfigID` resources, and
/// `k8stemplates` annotates with their version). The two resources are versioned separately, so
/// comparing with `<id>` cannot tell whether the pod is current: `talosctl upgrade-k8s` 1.14.0 did
/// and failed, 1.14.1 waits on `final-<id>` (talos v1.14.1 `pkg/cluster/kubernetes/talos_managed.go`). Older Talos has no `final-` resource and annotates
/// with `<id>`'s version. Telling them apart by the resource rather than by the Talos version also
/// covers pre-releases. A 1.14 node without the `final-` resource (not produced yet, or Talos refused
/// to merge the config) shows `<id>`'s version, which its pods do not carry, so the decision waits,
/// as it would on `None`.
///
/// Only the metadata counts, so the spec is not decoded (`()` skips it).
async fn config_version(
    client: &TalosClient,
    namespace: &str,
    resource_type: &str,
    id: &str,
) -> Result<Option<String>, TalosError> {
    let final_id = format!("{FINAL_PREFIX}{id}");
    let resource = match client
        .cosi_get::<()>(namespace, resource_type, &final_id)
        .await?
    {
        Some(resource) => Some(resource),
        None => client.cosi_get::<()>(namespace, resource_type, id).await?,
    };
    Ok(resource.map(|r| r.metadata.version.to_string()))
}

/// Nodes and control-plane mirror pods, one list each. A failed list leaves its part empty (no
/// kubelet versions, not Ready, no pods): the decision then waits rather than acts, and the next
/// observation tries again.
///
/// `listed`: the Nodes as this reconcile's access listed them a moment ago (its first look), taken
/// instead of listing them again when they hold every inventory node (a Node without an IPv4
/// address is not among them; then they are listed here).
async fn observe_kube(
    client: &kube::Client,
    inventory: &[InventoryNode],
    listed: Option<&[WorkloadNodeInfo]>,
) -> KubeSide {
    let listed = listed.filter(|listed| {
        inventory
            .iter()
            .all(|node| listed.iter().any(|n| n.node.name == node.name))
    });
    if let Some(listed) = listed {
        return KubeSide {
            nodes: node_facts(listed),
            pods: list_static_pods(client).await,
        };
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let params = ListParams::default();
    let (nodes, pods) = tokio::join!(nodes.list(&params), list_static_pods(client));
    let nodes = match nodes {
        Ok(list) => list
            .items
            .iter()
            .map(|node| (node.name_any(), NodeFacts::of(node)))
            .collect(),
        Err(error) => {
            tracing::warn!(%error, "listing the workload cluster's Nodes failed");
            HashMap::new()
        }
    };
    KubeSide { nodes, pods }
}

/// What the upgrade needs of each Node, from the Nodes as the access listed them.
fn node_facts(workload_nodes: &[WorkloadNodeInfo]) -> HashMap<String, NodeFacts> {
    workload_nodes
        .iter()
        .map(|n| {
            let facts = NodeFacts {
                kubelet_version: n
                    .kubelet_version
                    .as_deref()
                    .and_then(|v| KubernetesVersion::parse(v).ok()),
                ready: n.ready,
            };
            (n.node.name.clone(), facts)
        })
        .collect()
}

/// The control-plane components' pods in kube-system (mirror pods among them); none when the list
/// fails (the decision then waits).
async fn list_static_pods(client: &kube::Client) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), STATIC_POD_NAMESPACE);
    let selector = format!(
        "{COMPONENT_LABEL} in ({})",
        Component::ALL.map(Component::as_str).join(",")
    );
    match pods.list(&ListParams::default().labels(&selector)).await {
        Ok(list) => list.items,
        Err(error) => {
            tracing::warn!(%error, "listing the control-plane pods in kube-system failed");
            Vec::new()
        }
    }
}

/// The node's mirror pods, one per component. While kubelet replaces a pod, the old one may still be
/// listed; the newest pod not being deleted is the one that counts.
fn static_pods_of(node: &str, pods: &[Pod]) -> Vec<StaticPod> {
    Component::ALL
        .into_iter()
        .filter_map(|component| {
            pods.iter()
                .filter(|pod| {
                    pod.metadata.deletion_timestamp.is_none()
                        && pod.annotations().contains_key(MIRROR_ANNOTATION)
                        && pod.labels().get(COMPONENT_LABEL).map(String::as_str)
                            == Some(component.as_str())
                        && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
                })
                .max_by_key(|pod| pod.metadata.creation_timestamp.clone())
                .and_then(|pod| static_pod(component, pod))
        })
        .collect()
}

fn static_pod(component: Component, pod: &Pod) -> Option<StaticPod> {
    let containers = &pod.spec.as_ref()?.containers;
    // The component's own container; Talos names it after the component.
    let container = containers
        .iter()
        .find(|c| c.name == component.as_str())
        .or_else(|| containers.first())?;
    let ready = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        });
    Some(StaticPod {
        component,
        image: container.image.clone()?,
        config_version: pod.annotations().get(CONFIG_VERSION_ANNOTATION).cloned(),
        ready,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, node: &str, component: &str, image: &str, created: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "namespace": "kube-system",
                "creationTimestamp": created,
                "labels": {"k8s-app": component},
                "annotations": {MIRROR_ANNOTATION: "x", CONFIG_VERSION_ANNOTATION: "3"},
            },
            "spec": {"nodeName": node, "containers": [{"name": component, "image": image}]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .expect("pod")
    }

    #[test]
    fn mirror_pods_are_matched_by_component_and_node_newest_first() {
        let mut not_mirror = pod(
            "kube-apiserver-x",
            "cp-1",
            "kube-apiserver",
            "other:v1",
            "2026-01-01T00:00:00Z",
        );
        not_mirror.metadata.annotations = None;
        let pods = vec![
            pod(
                "kube-apiserver-cp-1",
                "cp-1",
                "kube-apiserver",
                "old:v1.34.1",
                "2026-01-01T00:00:00Z",
            ),
            pod(
                "kube-apiserver-cp-1",
                "cp-1",
                "kube-apiserver",
                "new:v1.35.0",
                "2026-01-01T00:01:00Z",
            ),
            pod(
                "kube-scheduler-cp-2",
                "cp-2",
                "kube-scheduler",
                "s:v1.34.1",
                "2026-01-01T00:00:00Z",
            ),
            not_mirror,
        ];
        let found = static_pods_of("cp-1", &pods);
        assert_eq!(
            found,
            vec![StaticPod {
                component: Component::KubeApiserver,
                image: "new:v1.35.0".into(),
                config_version: Some("3".into()),
                ready: true,
            }]
        );
    }
}
