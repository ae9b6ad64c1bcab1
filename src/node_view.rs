//! What the controller reads of a workload Node, decoded without the rest of it.
//!
//! The watch of each cluster's Nodes (see `followers`) decodes every change a kubelet writes, and the
//! inventory and the Kubernetes run list them. k8s-openapi's `Node` decodes everything a Node carries:
//! its managedFields (each entry's field set as a tree of JSON maps), the image list (dozens of
//! entries with every tag on a real node), capacity, allocatable, daemon endpoints, and so on. The
//! controller reads ten fields of it. [`NodeView`] names only those; serde passes over the fields a
//! struct does not name without building anything for them.
//!
//! Only reads use it: the writes to a Node (the cordon and uncordon of `drain`) keep k8s-openapi's
//! type.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::{ClusterResourceScope, Metadata, Resource};
use serde::{Deserialize, Deserializer};

/// A `v1` Node, as far as the controller reads it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeView {
    /// Name, uid, resourceVersion (the watch resumes from it), labels and annotations; no
    /// managedFields.
    #[serde(default, deserialize_with = "metadata_read")]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: Option<NodeViewSpec>,
    #[serde(default)]
    pub status: Option<NodeViewStatus>,
}

/// `spec`: whether the node is cordoned.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeViewSpec {
    #[serde(default)]
    pub unschedulable: Option<bool>,
}

/// `status`: conditions, addresses and what the kubelet says of the system it runs on.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeViewStatus {
    #[serde(default)]
    pub conditions: Option<Vec<NodeViewCondition>>,
    #[serde(default)]
    pub addresses: Option<Vec<NodeViewAddress>>,
    #[serde(default)]
    pub node_info: Option<NodeViewInfo>,
}

/// One of `status.conditions`: its type and status (`Ready`, `True`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeViewCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
}

/// One of `status.addresses` (`InternalIP`, `10.0.0.2`).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct NodeViewAddress {
    #[serde(rename = "type")]
    pub type_: String,
    pub address: String,
}

/// `status.nodeInfo`: the kubelet's version, the OS's name and the boot it runs in.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeViewInfo {
    #[serde(default, rename = "bootID")]
    pub boot_id: String,
    #[serde(default)]
    pub kubelet_version: String,
    #[serde(default)]
    pub os_image: String,
}

impl Resource for NodeView {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Node";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "nodes";
    type Scope = ClusterResourceScope;
}

impl Metadata for NodeView {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// The part of a Node's metadata the controller and kube's watcher read.
#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataRead {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

fn metadata_read<'de, D: Deserializer<'de>>(deserializer: D) -> Result<ObjectMeta, D::Error> {
    let read = Option::<MetadataRead>::deserialize(deserializer)?.unwrap_or_default();
    Ok(ObjectMeta {
        name: read.name,
        uid: read.uid,
        resource_version: read.resource_version,
        labels: read.labels,
        annotations: read.annotations,
        ..ObjectMeta::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::ResourceExt;

    /// A Node as a kubelet leaves it, abridged: what the controller reads, and the bulk it does not.
    const KUBELET_NODE: &str = r#"{
      "apiVersion": "v1",
      "kind": "Node",
      "metadata": {
        "name": "worker-1",
        "uid": "6c5a3f0e-0000-4000-8000-000000000001",
        "resourceVersion": "4711",
        "labels": {"kubernetes.io/hostname": "worker-1", "node-role.kubernetes.io/control-plane": ""},
        "annotations": {"upgrade.vitistack.io/hold": "true"},
        "managedFields": [
          {"manager": "kubelet", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
           "fieldsV1": {"f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:status": {}}}}}}
        ]
      },
      "spec": {"podCIDR": "10.244.1.0/24", "unschedulable": true, "taints": [{"key": "k", "effect": "NoSchedule"}]},
      "status": {
        "capacity": {"cpu": "4", "memory": "8Gi"},
        "conditions": [
          {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory"},
          {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}
        ],
        "addresses": [{"type": "InternalIP", "address": "127.0.0.12"}, {"type": "Hostname", "address": "worker-1"}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
          "bootID": "f2a1e5a4-0000-4000-8000-00000000b007",
          "kubeletVersion": "v1.34.1",
          "osImage": "Talos (v1.11.6)",
          "machineID": "abc",
          "containerRuntimeVersion": "containerd://2.1.4"
        },
        "images": [{"names": ["registry.k8s.io/pause:3.10"], "sizeBytes": 320368}]
      }
    }"#;

    #[test]
    fn a_kubelets_node_is_read_for_the_fields_the_controller_reads_and_nothing_else() {
        let node: NodeView = serde_json::from_str(KUBELET_NODE).expect("a Node");
        assert_eq!(node.name_any(), "worker-1");
        assert_eq!(node.resource_version().as_deref(), Some("4711"));
        assert_eq!(
            node.uid().as_deref(),
            Some("6c5a3f0e-0000-4000-8000-000000000001")
        );
        assert!(
            node.labels()
                .contains_key("node-role.kubernetes.io/control-plane")
        );
        assert_eq!(
            node.annotations()
                .get("upgrade.vitistack.io/hold")
                .map(String::as_str),
            Some("true")
        );
        assert!(node.metadata.managed_fields.is_none(), "not kept");
        assert_eq!(node.spec.as_ref().and_then(|s| s.unschedulable), Some(true));
        let status = node.status.as_ref().expect("status");
        let conditions = status.conditions.as_deref().unwrap_or_default();
        assert_eq!(
            conditions
                .iter()
                .map(|c| (c.type_.as_str(), c.status.as_str()))
                .collect::<Vec<_>>(),
            [("MemoryPressure", "False"), ("Ready", "True")]
        );
        let addresses = status.addresses.as_deref().unwrap_or_default();
        assert_eq!(addresses[0].type_, "InternalIP");
        assert_eq!(addresses[0].address, "127.0.0.12");
        let info = status.node_info.as_ref().expect("nodeInfo");
        assert_eq!(info.boot_id, "f2a1e5a4-0000-4000-8000-00000000b007");
        assert_eq!(info.kubelet_version, "v1.34.1");
        assert_eq!(info.os_image, "Talos (v1.11.6)");
    }

    #[test]
    fn a_node_without_spec_status_or_metadata_fields_is_still_a_node() {
        let node: NodeView =
            serde_json::from_str(r#"{"metadata": {"name": "n"}}"#).expect("a Node");
        assert_eq!(node.name_any(), "n");
        assert!(node.spec.is_none() && node.status.is_none());
        let node: NodeView = serde_json::from_str(
            r#"{"metadata": null, "spec": {"unschedulable": null}, "status": {"conditions": null, "nodeInfo": {}}}"#,
        )
        .expect("a Node with nulls");
        assert_eq!(node.spec.and_then(|s| s.unschedulable), None);
        assert_eq!(
            node.status.and_then(|s| s.node_info).map(|i| i.boot_id),
            Some(String::new())
        );
    }

    #[test]
    fn kube_finds_the_nodes_by_this_type() {
        use kube::Resource as _;
        assert_eq!(NodeView::kind(&()), "Node");
        assert_eq!(NodeView::api_version(&()), "v1");
        assert_eq!(NodeView::plural(&()), "nodes");
        assert_eq!(NodeView::url_path(&(), None), "/api/v1/nodes");
    }
}
