//! Which nodes a cluster has: vitistack `Machine` objects when the cluster has them, otherwise the
//! workload cluster's `Node`s. Each node gets its Kubernetes name, role and Talos API address.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::core::PartialObjectMeta;

use crate::read_cache::{CachedReads, Fingerprint};
use talos_upgrade_core::run::NodeRole;

/// A node of the cluster as the inventory (vitistack Machines or the workload Nodes) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InventoryNode {
    /// Kubernetes node name.
    pub name: String,
    pub role: NodeRole,
    /// Address of its Talos API.
    pub address: IpAddr,
    /// Its Machine (or, for a workload Node, the Node) is annotated `upgrade.vitistack.io/hold:
    /// "true"`: runs skip it.
    pub held: bool,
}

/// Whether an object's annotations hold its node out of Talos runs (`"true"`, as every flag reads).
fn held(annotations: &std::collections::BTreeMap<String, String>) -> bool {
    annotations
        .get(talos_upgrade_core::annotations::NODE_HOLD)
        .is_some_and(|value| value.trim().eq_ignore_ascii_case("true"))
}

/// Label vitistack puts on a cluster's Machines.
pub const MACHINE_CLUSTER_LABEL: &str = "vitistack.io/clusterid";
/// Label holding a Machine's role (`control-plane`; anything else is a worker).
pub const MACHINE_ROLE_LABEL: &str = "vitistack.io/node-role";
const CONTROL_PLANE_NODE_LABEL: &str = "node-role.kubernetes.io/control-plane";

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("listing {what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// Nodes without an address cannot be upgraded or checked; the run holds rather than skip them.
    #[error("{what} {names} {verb} no IPv4 address{where_}")]
    NoAddress {
        what: &'static str,
        names: String,
        verb: &'static str,
        where_: &'static str,
    },
    #[error("the cluster has no nodes ({source_desc})")]
    Empty { source_desc: String },
}

fn machine_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
        "machines",
    )
}

/// The cluster's Machines, or `None` when there are none (or the Machine CRD is not installed).
pub async fn from_machines(
    client: kube::Client,
    namespace: &str,
    cluster_id: &str,
) -> Result<Option<Vec<InventoryNode>>, InventoryError> {
    list_machines(client, namespace, cluster_id)
        .await
        .map(|(nodes, _)| nodes)
}

/// Machine inventories kept between reconciles, keyed by (namespace, cluster id): reused while a
/// metadata watch of the Machines shows the cluster's Machines unchanged (none added, changed or
/// removed). Machines change when the provisioning operator adds, replaces or readdresses a node.
#[derive(Default)]
pub struct MachineInventories {
    pub reads: CachedReads<(String, String), Option<Vec<InventoryNode>>>,
}

impl MachineInventories {
    /// [`from_machines`], reusing the last read while the cluster's Machines are unchanged.
    pub async fn get(
        &self,
        client: kube::Client,
        namespace: &str,
        cluster_id: &str,
    ) -> Result<Option<Vec<InventoryNode>>, InventoryError> {
        let key = (namespace.to_string(), cluster_id.to_string());
        if let Some(kept) = self.reads.get(&key) {
            return Ok(kept);
        }
        let (nodes, read) = list_machines(client, namespace, cluster_id).await?;
        self.reads.keep(key, read, nodes.clone());
        Ok(nodes)
    }

    /// Follows every Machine in `namespace` (or everywhere), metadata only, until the controller stops.
    pub async fn follow(&self, client: kube::Client, namespace: Option<&str>) {
        let api: Api<PartialObjectMeta<DynamicObject>> = match namespace {
            Some(namespace) => Api::namespaced_with(client, namespace, &machine_resource()),
            None => Api::all_with(client, &machine_resource()),
        };
        self.reads
            .seen
            .follow(api, Default::default(), "Machines", |machine| {
                let cluster = machine.labels().get(MACHINE_CLUSTER_LABEL)?;
                Some((machine.namespace().unwrap_or_default(), cluster.clone()))
            })
            .await;
    }
}

/// The cluster's Machines as [`from_machines`] gives them, with the fingerprint of what was listed.
async fn list_machines(
    client: kube::Client,
    namespace: &str,
    cluster_id: &str,
) -> Result<(Option<Vec<InventoryNode>>, Fingerprint), InventoryError> {
    let machines: Api<DynamicObject> = Api::namespaced_with(client, namespace, &machine_resource());
    let listed = match machines
        .list(&ListParams::default().labels(&format!("{MACHINE_CLUSTER_LABEL}={cluster_id}")))
        .await
    {
        Ok(list) => list.items,
        // No Machine CRD here: this is not a vitistack installation. (Nothing is reused then: the
        // Machine watch fails the same way and never syncs.)
        Err(kube::Error::Api(status)) if status.code == 404 => {
            return Ok((None, Fingerprint::none()));
        }
        Err(source) => {
            return Err(InventoryError::Kube {
                what: format!("Machines in {namespace}"),
                source,
            });
        }
    };
    let read = Fingerprint::of(listed.iter().map(|machine| {
        (
            machine.metadata.name.as_deref().unwrap_or_default(),
            machine
                .metadata
                .resource_version
                .as_deref()
                .unwrap_or_default(),
        )
    }));
    if listed.is_empty() {
        return Ok((None, read));
    }
    let mut nodes = Vec::new();
    let mut without_address = Vec::new();
    for machine in &listed {
        let name = machine.name_any();
        let role = match machine.labels().get(MACHINE_ROLE_LABEL).map(String::as_str) {
            Some("control-plane") => NodeRole::ControlPlane,
            _ => NodeRole::Worker,
        };
        let address = machine.data["status"]["publicIPAddresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|ip| ip.as_str()?.parse::<IpAddr>().ok())
            .find(IpAddr::is_ipv4);
        match address {
            Some(address) => nodes.push(InventoryNode {
                name,
                role,
                address,
                held: held(machine.annotations()),
            }),
            None => without_address.push(name),
        }
    }
    if !without_address.is_empty() {
        return Err(no_address(
            "Machine",
            without_address,
            " in status.publicIPAddresses",
        ));
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((Some(nodes), read))
}

/// A workload cluster Node as the controller needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadNodeInfo {
    pub node: InventoryNode,
    /// The `Ready` condition is `True`.
    pub ready: bool,
    /// `status.nodeInfo.kubeletVersion` without the leading `v`, when reported.
    pub kubelet_version: Option<String>,
    /// `spec.unschedulable`: the node is cordoned.
    pub unschedulable: bool,
}

/// Whether a workload Node without an address is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddressNeed {
    /// The Nodes are the inventory: a node without an address cannot be upgraded, so it is reported.
    Required,
    /// The inventory comes from Machines and the Nodes only tell readiness: a Node without an address
    /// (one still registering, or another cluster's) is left out.
    Optional,
}

/// The workload cluster's Nodes, with their Ready state and kubelet version.
pub async fn from_workload_nodes(
    workload: kube::Client,
    addresses: AddressNeed,
) -> Result<Vec<WorkloadNodeInfo>, InventoryError> {
    let nodes: Api<Node> = Api::all(workload);
    let listed = nodes
        .list(&ListParams::default())
        .await
        .map_err(|source| InventoryError::Kube {
            what: "the workload cluster's Nodes".to_string(),
            source,
        })?
        .items;
    if listed.is_empty() {
        return Err(InventoryError::Empty {
            source_desc: "no Machines and no workload Nodes".to_string(),
        });
    }
    let mut inventory = Vec::new();
    let mut without_address = Vec::new();
    for node in &listed {
        let name = node.name_any();
        let role = if node.labels().contains_key(CONTROL_PLANE_NODE_LABEL) {
            NodeRole::ControlPlane
        } else {
            NodeRole::Worker
        };
        let address = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse::<IpAddr>().ok())
            .find(IpAddr::is_ipv4);
        let kubelet_version = node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|info| info.kubelet_version.trim_start_matches('v').to_string())
            .filter(|v| !v.is_empty());
        match address {
            Some(address) => inventory.push(WorkloadNodeInfo {
                node: InventoryNode {
                    name,
                    role,
                    address,
                    held: held(node.annotations()),
                },
                ready: node_ready(node),
                unschedulable: node
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.unschedulable)
                    .unwrap_or(false),
                kubelet_version,
            }),
            None => without_address.push(name),
        }
    }
    if !without_address.is_empty() && addresses == AddressNeed::Required {
        return Err(no_address("Node", without_address, " (InternalIP)"));
    }
    inventory.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    Ok(inventory)
}

fn no_address(what: &'static str, names: Vec<String>, where_: &'static str) -> InventoryError {
    let verb = if names.len() == 1 { "has" } else { "have" };
    let what = if names.len() == 1 { what } else { plural(what) };
    InventoryError::NoAddress {
        what,
        names: names.join(", "),
        verb,
        where_,
    }
}

fn plural(what: &'static str) -> &'static str {
    match what {
        "Machine" => "Machines",
        "Node" => "Nodes",
        other => other,
    }
}

/// The Node's `Ready` condition is `True`.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}
