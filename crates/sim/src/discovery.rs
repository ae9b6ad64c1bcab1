//! Cluster discovery's resources in the `cluster` namespace: `Affiliates.cluster.talos.dev` and
//! `Members.cluster.talos.dev`, what `talosctl get members` prints and `talosctl health --server=false`
//! reads to find the cluster's nodes (talosctl `cmd/talos/health.go`, `buildClusterInfo`).
//!
//! On Talos (v1.14.1 `internal/app/machined/pkg/controllers/cluster/`) each node publishes itself as
//! its local Affiliate (`local_affiliate.go`, owner `cluster.LocalAffiliateController`: id = the node's
//! persistent random `NodeID`, hostname, nodename, machine type, routed addresses, operating system
//! `"Talos (<tag>)"`, the local API server port of a control plane), learns the others' through the
//! discovery registry (`affiliate_merge.go`, owner `cluster.AffiliateMergeController`) and makes a
//! Member of every affiliate with a nodename, the nodename as id (`member.go`, owner
//! `cluster.MemberController`). A node that goes away stays in the registry until its TTL runs out, so
//! the others keep listing it while it reboots; once it is back it publishes its new version.
//!
//! The simulator computes the same from the cluster's nodes whenever a client reads the namespace (and,
//! during a watch, whenever a node changes), writing it into the queried node's store so versions and
//! watch events behave as for every other resource. A node takes part unless its config turns
//! discovery off (`cluster.discovery.enabled: false`): `talosctl gen config` turns it on, and the
//! configs the simulator generates leave the section out.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::net::Ipv4Addr;

use futures::future::select_all;
use prost::Message;
use semver::Version;
use serde::Serialize;
use tokio::sync::watch;

use super::cluster::Cluster;
use super::compat;
use super::config::Role;
use super::node::{Node, NodeSnapshot};
use super::node_resources::{AFFILIATE_TYPE, MEMBER_TYPE};
use super::resources::{CLUSTER_NS, DesiredResource, ResourceKey};
use talos_api::proto::resource::config as cfg;

/// `common.NetIP` (talos `api/common/common.proto`): the address as `netip.Addr.MarshalBinary`.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct NetIp {
    #[prost(bytes = "vec", tag = "1")]
    pub ip: Vec<u8>,
}

/// `ControlPlane` (talos `api/resource/definitions/cluster/cluster.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ControlPlane {
    #[prost(int64, tag = "1")]
    pub api_server_port: i64,
}

/// `MemberSpec` (talos `api/resource/definitions/cluster/cluster.proto`; machinery
/// `resources/cluster/member.go` encodes its Go struct with the same field numbers).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct MemberSpec {
    #[prost(string, tag = "1")]
    pub node_id: String,
    #[prost(message, repeated, tag = "2")]
    pub addresses: Vec<NetIp>,
    #[prost(string, tag = "3")]
    pub hostname: String,
    /// `enums.MachineType`, numbered as the config's `MachineType`.
    #[prost(int32, tag = "4")]
    pub machine_type: i32,
    #[prost(string, tag = "5")]
    pub operating_system: String,
    #[prost(message, optional, tag = "6")]
    pub control_plane: Option<ControlPlane>,
}

/// `AffiliateSpec` (talos `api/resource/definitions/cluster/cluster.proto`); KubeSpan (field 7) is
/// never enabled in the simulator.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct AffiliateSpec {
    #[prost(string, tag = "1")]
    pub node_id: String,
    #[prost(message, repeated, tag = "2")]
    pub addresses: Vec<NetIp>,
    #[prost(string, tag = "3")]
    pub hostname: String,
    #[prost(string, tag = "4")]
    pub nodename: String,
    #[prost(string, tag = "5")]
    pub operating_system: String,
    #[prost(int32, tag = "6")]
    pub machine_type: i32,
    #[prost(message, optional, tag = "8")]
    pub control_plane: Option<ControlPlane>,
}

/// The YAML of `MemberSpec`: its Go struct's `yaml` tags, in field order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct MemberYaml<'a> {
    node_id: &'a str,
    addresses: Vec<String>,
    hostname: &'a str,
    machine_type: &'a str,
    operating_system: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    control_plane: Option<PortYaml>,
}

/// The YAML of `AffiliateSpec` (`kubespan` is omitted while empty).
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct AffiliateYaml<'a> {
    node_id: &'a str,
    addresses: Vec<String>,
    hostname: &'a str,
    nodename: &'a str,
    operating_system: &'a str,
    machine_type: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    control_plane: Option<PortYaml>,
}

#[derive(Serialize)]
struct PortYaml {
    port: i64,
}

/// The local port of the API server: `cluster.apiServer` has no override in the simulated configs, so
/// Talos's default (machinery `constants.DefaultControlPlanePort`).
const API_SERVER_PORT: i64 = 6443;

/// What a node publishes about itself.
struct Affiliate {
    node_id: String,
    name: String,
    role: Role,
    address: Ipv4Addr,
    version: Version,
}

impl Affiliate {
    fn of(cluster: &Cluster, node: &Node) -> Option<Affiliate> {
        let (version, config) = node.read(|s| (s.current.version.clone(), s.config.clone()));
        discovery_enabled(&config).then(|| Affiliate {
            node_id: node_id(&cluster.cluster_name, &node.name),
            name: node.name.clone(),
            role: node.role,
            address: node.address,
            version,
        })
    }

    /// `fmt.Sprintf("%s (%s)", version.Name, version.Tag)`.
    fn operating_system(&self) -> String {
        format!("Talos ({})", compat::tag(&self.version))
    }

    fn machine_type(&self) -> i32 {
        match self.role {
            Role::ControlPlane => cfg::MachineType::ControlPlane as i32,
            Role::Worker => cfg::MachineType::Worker as i32,
        }
    }

    fn control_plane(&self) -> Option<ControlPlane> {
        self.role.is_control_plane().then_some(ControlPlane {
            api_server_port: API_SERVER_PORT,
        })
    }

    fn addresses(&self) -> Vec<NetIp> {
        vec![NetIp {
            ip: self.address.octets().to_vec(),
        }]
    }

    fn affiliate(&self, owner: &str) -> DesiredResource {
        let operating_system = self.operating_system();
        let spec = AffiliateSpec {
            node_id: self.node_id.clone(),
            addresses: self.addresses(),
            hostname: self.name.clone(),
            nodename: self.name.clone(),
            operating_system: operating_system.clone(),
            machine_type: self.machine_type(),
            control_plane: self.control_plane(),
        };
        let yaml = to_yaml(&AffiliateYaml {
            node_id: &self.node_id,
            addresses: vec![self.address.to_string()],
            hostname: &self.name,
            nodename: &self.name,
            operating_system: &operating_system,
            machine_type: self.role.as_str(),
            control_plane: self.control_plane().map(|c| PortYaml {
                port: c.api_server_port,
            }),
        });
        resource(AFFILIATE_TYPE, &self.node_id, owner, &spec, yaml)
    }

    fn member(&self) -> DesiredResource {
        let operating_system = self.operating_system();
        let spec = MemberSpec {
            node_id: self.node_id.clone(),
            addresses: self.addresses(),
            hostname: self.name.clone(),
            machine_type: self.machine_type(),
            operating_system: operating_system.clone(),
            control_plane: self.control_plane(),
        };
        let yaml = to_yaml(&MemberYaml {
            node_id: &self.node_id,
            addresses: vec![self.address.to_string()],
            hostname: &self.name,
            machine_type: self.role.as_str(),
            operating_system: &operating_system,
            control_plane: self.control_plane().map(|c| PortYaml {
                port: c.api_server_port,
            }),
        });
        resource(
            MEMBER_TYPE,
            &self.name,
            "cluster.MemberController",
            &spec,
            yaml,
        )
    }
}

fn resource(
    type_: &str,
    id: &str,
    owner: &str,
    spec: &impl Message,
    yaml: String,
) -> DesiredResource {
    DesiredResource {
        key: ResourceKey {
            namespace: CLUSTER_NS.to_string(),
            type_: type_.to_string(),
            id: id.to_string(),
        },
        owner: owner.to_string(),
        proto_spec: spec.encode_to_vec(),
        yaml_spec: yaml,
        labels: Default::default(),
        annotations: Default::default(),
    }
}

fn to_yaml(value: &impl Serialize) -> String {
    // Plain structs of strings, numbers and lists: serializing cannot fail.
    serde_yaml::to_string(value).unwrap_or_default()
}

/// Does a machine config leave cluster discovery on? Off only where the v1alpha1 document says
/// `cluster.discovery.enabled: false`.
fn discovery_enabled(config: &[u8]) -> bool {
    use serde::Deserialize;
    !serde_yaml::Deserializer::from_slice(config)
        .filter_map(|document| serde_yaml::Value::deserialize(document).ok())
        .any(|document| document["cluster"]["discovery"]["enabled"].as_bool() == Some(false))
}

/// A node's `NodeID`: 32 random bytes in base62 on Talos (`adapters/cluster/identity.go`), kept across
/// reboots and upgrades. Here the bytes come from the cluster and node names, so a node keeps its id.
fn node_id(cluster: &str, node: &str) -> String {
    let mut bytes = Vec::with_capacity(32);
    for round in 0u8..4 {
        let mut hasher = DefaultHasher::new();
        (cluster, node, round).hash(&mut hasher);
        bytes.extend_from_slice(&hasher.finish().to_be_bytes());
    }
    base62(&bytes)
}

/// Big-endian bytes as a base62 number (digits, upper case, lower case).
fn base62(bytes: &[u8]) -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut number = bytes.to_vec();
    let mut digits = Vec::new();
    while number.iter().any(|&b| b != 0) {
        let mut remainder = 0u32;
        for byte in number.iter_mut() {
            let value = (remainder << 8) | u32::from(*byte);
            *byte = (value / 62) as u8;
            remainder = value % 62;
        }
        digits.push(ALPHABET[remainder as usize]);
    }
    digits.reverse();
    String::from_utf8(digits).unwrap_or_default()
}

/// The `cluster` namespace as `node` sees it now: its own affiliate, the merged affiliates of the other
/// nodes and a member per affiliate; empty while `node` has discovery turned off.
pub(crate) fn desired(cluster: &Cluster, node: &Node) -> Vec<DesiredResource> {
    let Some(local) = Affiliate::of(cluster, node) else {
        return Vec::new();
    };
    let mut out = vec![
        local.affiliate("cluster.LocalAffiliateController"),
        local.member(),
    ];
    for other in cluster.nodes.iter().filter(|n| n.name != node.name) {
        if let Some(affiliate) = Affiliate::of(cluster, other) {
            out.push(affiliate.affiliate("cluster.AffiliateMergeController"));
            out.push(affiliate.member());
        }
    }
    out
}

/// Bring `node`'s `cluster` namespace up to date with the cluster.
pub(crate) fn refresh(cluster: &Cluster, node: &Node) {
    node.store
        .reconcile_namespace(CLUSTER_NS, desired(cluster, node));
}

/// Changes to any node of the cluster, for a watch of the `cluster` namespace to refresh on.
pub(crate) struct ClusterChanges {
    receivers: Vec<watch::Receiver<NodeSnapshot>>,
}

impl ClusterChanges {
    pub(crate) fn new(cluster: &Cluster) -> Self {
        ClusterChanges {
            receivers: cluster.nodes.iter().map(|n| n.subscribe()).collect(),
        }
    }

    /// Wait until some node's state changes (forever if no node can change any more).
    pub(crate) async fn changed(&mut self) {
        loop {
            if self.receivers.is_empty() {
                return std::future::pending().await;
            }
            let (result, index, _) =
                select_all(self.receivers.iter_mut().map(|r| Box::pin(r.changed()))).await;
            match result {
                Ok(()) => return,
                // That node's state is gone (the simulator shut down): stop listening to it.
                Err(_) => {
                    self.receivers.swap_remove(index);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_look_like_talos_ones_and_stay() {
        let id = node_id("demo", "cp-1");
        assert_eq!(id, node_id("demo", "cp-1"));
        assert_ne!(id, node_id("demo", "cp-2"));
        assert!(
            id.len() >= 40 && id.chars().all(|c| c.is_ascii_alphanumeric()),
            "{id}"
        );
    }

    #[test]
    fn base62_is_a_number() {
        assert_eq!(base62(&[0, 61]), "z");
        assert_eq!(base62(&[0, 62]), "10");
        assert_eq!(base62(&[1, 0]), "48");
    }

    #[test]
    fn discovery_is_off_only_when_the_config_says_so() {
        assert!(discovery_enabled(
            b"version: v1alpha1\ncluster:\n    clusterName: demo\n"
        ));
        assert!(discovery_enabled(
            b"version: v1alpha1\ncluster:\n    discovery:\n        enabled: true\n"
        ));
        assert!(!discovery_enabled(
            b"version: v1alpha1\ncluster:\n    discovery:\n        enabled: false\n---\napiVersion: v1alpha1\nkind: KubeletConfig\n"
        ));
    }

    #[test]
    fn member_spec_decodes_as_talos_encodes() {
        let affiliate = Affiliate {
            node_id: "abc".into(),
            name: "cp-1".into(),
            role: Role::ControlPlane,
            address: Ipv4Addr::new(10, 5, 0, 2),
            version: Version::new(1, 11, 6),
        };
        let member = affiliate.member();
        assert_eq!(member.key.id, "cp-1");
        let spec = MemberSpec::decode(member.proto_spec.as_slice()).unwrap();
        assert_eq!(spec.operating_system, "Talos (v1.11.6)");
        assert_eq!(spec.addresses[0].ip, [10, 5, 0, 2]);
        assert_eq!(spec.control_plane.unwrap().api_server_port, 6443);
        let yaml: serde_yaml::Value = serde_yaml::from_str(&member.yaml_spec).unwrap();
        assert_eq!(yaml["machineType"], "controlplane");
        assert_eq!(yaml["addresses"][0], "10.5.0.2");
        assert_eq!(yaml["controlPlane"]["port"], 6443);
    }
}
