//! Which nodes a cluster has: vitistack `Machine` objects when the cluster has them, otherwise the
//! workload cluster's `Node`s. Each node gets its Kubernetes name, role and Talos API address.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Mutex;

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
            .follow(
                api,
                kube::runtime::watcher::Config::default()
                    .timeout(crate::read_cache::WATCH_TIMEOUT_SECS),
                "Machines",
                |machine| {
                    let cluster = machine.labels().get(MACHINE_CLUSTER_LABEL)?;
                    Some((machine.namespace().unwrap_or_default(), cluster.clone()))
                },
            )
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
    /// The Talos version in `status.nodeInfo.osImage`, when it reads as one (see
    /// [`talos_version_of_os_image`]).
    pub os_talos_version: Option<semver::Version>,
    /// `status.nodeInfo.bootID`: the boot the kubelet that wrote `osImage` runs in (see
    /// [`SeenNode::boot_id`]).
    pub boot_id: Option<String>,
}

/// The Talos version a Node's `status.nodeInfo.osImage` names: `Talos (v1.11.6)` → 1.11.6. The
/// kubelet reports the `PRETTY_NAME` of the os-release of the system it runs on, which Talos writes
/// as `"<name> (<version tag>)"` (talos pkg/machinery v1.14.1 `constants/constants.go`
/// `OSReleaseTemplate`, filled by `version/osrelease.go` `OSReleaseFor` with the build's tag).
/// `None` for anything else (another OS, a development build named by its commit).
pub fn talos_version_of_os_image(os_image: &str) -> Option<semver::Version> {
    let (_, tag) = os_image.trim().strip_suffix(')')?.rsplit_once(" (")?;
    semver::Version::parse(tag.trim_start_matches('v')).ok()
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
    workload_inventory(
        listed
            .iter()
            .map(|node| (node.name_any(), workload_node(node))),
        addresses,
    )
}

/// What the controller needs of one workload Node; `None` when it has no IPv4 `InternalIP` (it cannot
/// be reached or checked).
pub fn workload_node(node: &Node) -> Option<WorkloadNodeInfo> {
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
        .find(IpAddr::is_ipv4)?;
    let kubelet_version = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|info| info.kubelet_version.trim_start_matches('v').to_string())
        .filter(|v| !v.is_empty());
    let os_talos_version = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .and_then(|info| talos_version_of_os_image(&info.os_image));
    let boot_id = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|info| info.boot_id.trim().to_string())
        .filter(|boot_id| !boot_id.is_empty());
    Some(WorkloadNodeInfo {
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
        os_talos_version,
        boot_id,
    })
}

/// The workload Nodes (name, what [`workload_node`] made of it) as the inventory part of a cluster's
/// access: sorted by name, an error when there are none, or when one has no address and `addresses`
/// requires them.
pub fn workload_inventory(
    listed: impl IntoIterator<Item = (String, Option<WorkloadNodeInfo>)>,
    addresses: AddressNeed,
) -> Result<Vec<WorkloadNodeInfo>, InventoryError> {
    let mut inventory = Vec::new();
    let mut without_address = Vec::new();
    let mut any = false;
    for (name, info) in listed {
        any = true;
        match info {
            Some(info) => inventory.push(info),
            None => without_address.push(name),
        }
    }
    if !any {
        return Err(InventoryError::Empty {
            source_desc: "no Machines and no workload Nodes".to_string(),
        });
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

/// One workload Node as a watch last saw it: (Ready, cordoned), and what [`workload_node`] made of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenNode {
    pub ready: bool,
    pub cordoned: bool,
    /// `status.nodeInfo.bootID`, as the kubelet reports it (the kernel's
    /// `/proc/sys/kernel/random/boot_id`, the boot id Talos reads too): a new one means the node
    /// booted again and its kubelet runs.
    pub boot_id: Option<String>,
    pub info: Option<WorkloadNodeInfo>,
}

impl SeenNode {
    pub fn of(node: &Node) -> SeenNode {
        SeenNode {
            ready: node_ready(node),
            cordoned: node
                .spec
                .as_ref()
                .and_then(|spec| spec.unschedulable)
                .unwrap_or(false),
            boot_id: node
                .status
                .as_ref()
                .and_then(|status| status.node_info.as_ref())
                .map(|info| info.boot_id.trim().to_string())
                .filter(|boot_id| !boot_id.is_empty()),
            info: workload_node(node),
        }
    }
}

/// One change a watch of the workload Nodes reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeChange {
    /// The watch (re)starts listing every Node.
    Relist,
    /// A Node during a relist, or created or changed afterwards.
    Present {
        name: String,
        seen: SeenNode,
    },
    Deleted {
        name: String,
    },
    /// The relist is complete.
    Listed,
    /// The watch failed; until it is back nothing it saw can be trusted.
    Broken,
    /// The watch stopped (no node of the cluster is followed any more).
    Stopped,
}

#[derive(Default)]
struct NodesView {
    /// True while the watch runs and has delivered a complete list with nothing missed since.
    synced: bool,
    /// A complete list arrived and the watch has not stopped since.
    listed: bool,
    nodes: BTreeMap<String, SeenNode>,
    relisting: Option<BTreeMap<String, SeenNode>>,
    /// The watch failed since it last (re)started listing.
    failed: bool,
}

/// A cluster's workload Nodes as a watch sees them, while one runs: the followers watch every Node of a
/// cluster with a Talos node in flight (see [`crate::followers`]), and each reconcile meanwhile takes
/// the Nodes from here instead of listing them. Only what [`SeenNode`] keeps is kept.
#[derive(Default)]
pub struct WatchedNodes {
    view: Mutex<NodesView>,
    /// Told when the first list is in, or the watch broke or stopped.
    settled: tokio::sync::Notify,
}

/// How long a reconcile waits for a watch's first list of the Nodes before listing them itself: the
/// watch starts as the reconcile that started a node ends, and the next reconcile (the node's
/// install ending wakes it) can come before that list is in.
pub const FIRST_LIST_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

impl WatchedNodes {
    fn view(&self) -> std::sync::MutexGuard<'_, NodesView> {
        self.view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The Nodes as [`from_workload_nodes`] would list them now; `None` while the watch is not synced
    /// (not running, not listed yet, or broken): then they are listed.
    pub fn current(
        &self,
        addresses: AddressNeed,
    ) -> Option<Result<Vec<WorkloadNodeInfo>, InventoryError>> {
        let view = self.view();
        view.synced.then(|| {
            workload_inventory(
                view.nodes
                    .iter()
                    .map(|(name, seen)| (name.clone(), seen.info.clone())),
                addresses,
            )
        })
    }

    /// [`current`](Self::current), waiting up to `wait` for a watch whose first list is on its way.
    pub async fn current_soon(
        &self,
        addresses: AddressNeed,
        wait: std::time::Duration,
    ) -> Option<Result<Vec<WorkloadNodeInfo>, InventoryError>> {
        let settled = self.settled.notified();
        let mut settled = std::pin::pin!(settled);
        // Registered before the state is looked at, so a list that comes in between is not missed.
        settled.as_mut().enable();
        if let Some(current) = self.current(addresses) {
            return Some(current);
        }
        let listing = {
            let view = self.view();
            !view.listed && view.relisting.is_some() && !view.failed
        };
        if !listing {
            return None;
        }
        let _ = tokio::time::timeout(wait, settled).await;
        self.current(addresses)
    }

    /// The Node `name` as last seen, while the watch is synced.
    pub fn node(&self, name: &str) -> Option<SeenNode> {
        let view = self.view();
        if !view.synced {
            return None;
        }
        view.nodes.get(name).cloned()
    }

    /// Takes in one change.
    pub fn record(&self, change: NodeChange) {
        let settles = matches!(
            change,
            NodeChange::Listed | NodeChange::Broken | NodeChange::Stopped
        );
        let mut guard = self.view();
        let view = &mut *guard;
        // A watch that delivers a change after an error resumed where it stopped (one that cannot
        // resume relists instead), so nothing was missed.
        let resumed = |view: &mut NodesView| {
            if view.listed && view.relisting.is_none() {
                view.synced = true;
            }
        };
        match change {
            NodeChange::Relist => {
                view.relisting = Some(BTreeMap::new());
                view.failed = false;
            }
            NodeChange::Present { name, seen } => {
                view.relisting
                    .as_mut()
                    .unwrap_or(&mut view.nodes)
                    .insert(name, seen);
                resumed(view);
            }
            NodeChange::Deleted { name } => {
                view.relisting
                    .as_mut()
                    .unwrap_or(&mut view.nodes)
                    .remove(&name);
                resumed(view);
            }
            NodeChange::Listed => {
                if let Some(listed) = view.relisting.take() {
                    view.nodes = listed;
                }
                view.synced = true;
                view.listed = true;
            }
            NodeChange::Broken => {
                view.synced = false;
                view.failed = true;
            }
            NodeChange::Stopped => *view = NodesView::default(),
        }
        drop(guard);
        if settles {
            self.settled.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(name: &str, ready: bool) -> NodeChange {
        NodeChange::Present {
            name: name.to_string(),
            seen: SeenNode {
                ready,
                boot_id: None,
                cordoned: false,
                info: Some(WorkloadNodeInfo {
                    node: InventoryNode {
                        name: name.to_string(),
                        role: NodeRole::Worker,
                        address: "10.5.0.2".parse().expect("address"),
                        held: false,
                    },
                    ready,
                    kubelet_version: Some("1.34.1".to_string()),
                    unschedulable: false,
                    os_talos_version: None,
                    boot_id: None,
                }),
            },
        }
    }

    fn ready_names(nodes: &WatchedNodes) -> Option<Vec<(String, bool)>> {
        nodes.current(AddressNeed::Required).map(|listed| {
            listed
                .expect("nodes")
                .into_iter()
                .map(|n| (n.node.name, n.ready))
                .collect()
        })
    }

    #[tokio::test]
    async fn a_reconcile_waits_for_a_first_list_on_its_way_and_for_nothing_else() {
        let wait = std::time::Duration::from_secs(30);
        let nodes = std::sync::Arc::new(WatchedNodes::default());
        // No watch: listed by the reconcile at once.
        assert!(
            nodes
                .current_soon(AddressNeed::Required, wait)
                .await
                .is_none()
        );

        // A watch whose first list is on its way: its list is used once in.
        nodes.record(NodeChange::Relist);
        let watch = {
            let nodes = nodes.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                nodes.record(seen("w1", true));
                nodes.record(NodeChange::Listed);
            })
        };
        let listed = nodes
            .current_soon(AddressNeed::Required, wait)
            .await
            .expect("the watch's list")
            .expect("nodes");
        assert_eq!(listed.len(), 1);
        watch.await.expect("watch");

        // A watch that failed while listing: not waited for.
        let nodes = WatchedNodes::default();
        nodes.record(NodeChange::Relist);
        nodes.record(NodeChange::Broken);
        assert!(
            nodes
                .current_soon(AddressNeed::Required, wait)
                .await
                .is_none()
        );
    }

    #[test]
    fn the_watched_nodes_stand_in_for_a_list_only_while_the_watch_is_synced() {
        let nodes = WatchedNodes::default();
        assert_eq!(ready_names(&nodes), None, "before any list");
        nodes.record(NodeChange::Relist);
        nodes.record(seen("w1", true));
        assert_eq!(ready_names(&nodes), None, "during the first list");
        nodes.record(seen("w2", false));
        nodes.record(NodeChange::Listed);
        assert_eq!(
            ready_names(&nodes),
            Some(vec![("w1".into(), true), ("w2".into(), false)])
        );
        nodes.record(seen("w2", true));
        assert_eq!(nodes.node("w2").map(|n| n.ready), Some(true));

        nodes.record(NodeChange::Broken);
        assert_eq!(ready_names(&nodes), None, "broken");
        assert_eq!(nodes.node("w2"), None);
        nodes.record(NodeChange::Deleted { name: "w2".into() });
        assert_eq!(
            ready_names(&nodes),
            Some(vec![("w1".into(), true)]),
            "resumed with a change"
        );

        nodes.record(NodeChange::Broken);
        nodes.record(NodeChange::Relist);
        nodes.record(seen("w3", true));
        assert_eq!(ready_names(&nodes), None, "relisting after an error");
        nodes.record(NodeChange::Listed);
        assert_eq!(
            ready_names(&nodes),
            Some(vec![("w3".into(), true)]),
            "the relist replaces what was seen"
        );

        nodes.record(NodeChange::Stopped);
        assert_eq!(ready_names(&nodes), None, "stopped");
        nodes.record(seen("w3", true));
        assert_eq!(ready_names(&nodes), None, "a change after the stop");
    }

    #[test]
    fn the_talos_version_is_read_from_the_os_image_talos_writes() {
        let cases = [
            ("Talos (v1.11.6)", Some(semver::Version::new(1, 11, 6))),
            (
                "Talos (v1.14.0-beta.1)",
                semver::Version::parse("1.14.0-beta.1").ok(),
            ),
            // A build named otherwise (OSReleaseFor takes the name as given).
            ("Talos New (v1.12.0)", Some(semver::Version::new(1, 12, 0))),
            // A development build: its commit instead of a tag.
            ("Talos (1a2b3c4)", None),
            ("Ubuntu 24.04.1 LTS", None),
            ("", None),
        ];
        for (os_image, expected) in cases {
            assert_eq!(
                talos_version_of_os_image(os_image),
                expected,
                "{os_image:?}"
            );
        }
    }
}
