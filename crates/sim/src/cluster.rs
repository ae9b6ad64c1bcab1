//! State shared by every node server, sequence task and the public handle.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::config::Timings;
use super::etcd::EtcdCluster;
use super::node::Node;
use super::pki::CertAuthority;
use super::record::Recorder;

#[derive(Debug)]
pub(crate) struct Cluster {
    pub cluster_name: String,
    pub port: u16,
    pub timings: Timings,
    pub ca: CertAuthority,
    pub nodes: Vec<Arc<Node>>,
    pub etcd: EtcdCluster,
    pub record: Recorder,
    /// Cancelled by `Simulator::shutdown`/drop; every boot token is a child, so this also kills all
    /// connections, and every background task watches it.
    pub shutdown: CancellationToken,
}

impl Cluster {
    pub(crate) fn by_name(&self, name: &str) -> Option<&Arc<Node>> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Resolve a `node` header value: an IP address or a hostname, as apid accepts.
    pub(crate) fn resolve(&self, target: &str) -> Option<&Arc<Node>> {
        let target = target.trim();
        self.nodes
            .iter()
            .find(|n| n.name == target || n.address.to_string() == target)
    }

    /// etcd membership or health changed: every control plane's snapshot shows leader/health.
    pub(crate) fn publish_control_planes(&self) {
        for node in self.nodes.iter().filter(|n| n.role.is_control_plane()) {
            node.publish(&self.etcd);
        }
    }

    /// Sync a node's EtcdUnhealthy fault into the etcd model.
    pub(crate) fn sync_etcd_fault(&self, node: &Node) {
        if node.role.is_control_plane() {
            self.etcd
                .set_faulted(&node.name, node.faults.current().etcd_unhealthy);
            self.publish_control_planes();
        }
    }

    /// IPs of the control planes: talosconfig endpoints.
    pub(crate) fn control_plane_addresses(&self) -> Vec<std::net::Ipv4Addr> {
        self.nodes
            .iter()
            .filter(|n| n.role.is_control_plane())
            .map(|n| n.address)
            .collect()
    }
}
