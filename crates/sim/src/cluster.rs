//! State shared by every node server, sequence task and the public handle.
//!
//! It also carries the entry point that starts a node's apid ([`StartApid`]), so that the sequences,
//! which power nodes on, need not depend on the server and the API services above them, which start
//! those sequences.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::config::Timings;
use super::etcd::EtcdCluster;
use super::kubeconfig::WorkloadKubeconfig;
use super::node::Node;
use super::pki::CertAuthority;
use super::record::Recorder;

/// Serves a node's API on `listener` for the boot that starts now (the boot's tokens and listener
/// task go into the node). The simulator passes `server::start`.
pub(crate) type StartApid = fn(&Arc<Cluster>, &Arc<Node>, TcpListener);

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
    /// How a booting node starts listening; see [`StartApid`].
    pub apid: StartApid,
    /// The workload cluster's admin kubeconfig the control planes hand out, if one was given.
    pub workload_kubeconfig: WorkloadKubeconfig,
}

impl Cluster {
    /// Serve `node`'s API on `listener` until its new boot ends.
    pub(crate) fn start_apid(self: &Arc<Self>, node: &Arc<Node>, listener: TcpListener) {
        (self.apid)(self, node, listener);
    }

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
