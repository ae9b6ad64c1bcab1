//! The Talos node simulator: N simulated Talos nodes speaking the real Talos gRPC API over mutual TLS.
//!
//! Each node listens on its own loopback address (`127.X.Y.n:50000` by default) with a certificate
//! from a generated Talos OS CA, and serves `machine.MachineService`, `machine.ImageService`,
//! `machine.LifecycleService` and `cosi.resource.State` with the semantics documented in
//! `shared/reference/talos-api.md`: roles from client certificates, `node`/`nodes` proxying, legacy and
//! 1.13+ upgrades with a real outage during reboots, events, COSI resources and watches, etcd checks.
//! Tests drive it with stock gRPC clients and observe it through [`Simulator::subscribe`], the call
//! record and injected [`Fault`]s.
//!
//! What is simplified compared with a real node (talos-api.md §8):
//! - every config change the simulator models applies live (`AUTO` → `NO_REBOOT`); `TRY` reverts after
//!   its timeout; `STAGED` applies at the next boot; `REBOOT` applies and reboots (Unimplemented ≥ 1.14);
//! - the installer's upgrade-path pre-flight (§3.5) is checked when the image is validated (legacy
//!   Upgrade RPC error) or by the installer (LifecycleService.Upgrade exit code 4 from a 1.14 or later
//!   installer, 1 from an older one);
//! - pulls ask a registry model: no generic installer for Talos ≥ 1.14, only installers on the Image
//!   Factory, everything elsewhere (docs/simulator.md "Talos 1.14");
//! - legacy `stage=true` runs the normal upgrade sequence; Talos 1.7's `preserve=false` extras are not
//!   modelled; Reboot/Rollback during another sequence answer with a LOCKED event instead of taking over;
//! - one-to-many (`nodes`) aggregation is emulated for unary MachineService calls only;
//! - at power-off apid drains gracefully: open streams get every event emitted before the cut, then
//!   `Unavailable`; the port is closed (connection refused) from then until the node boots again;
//! - COSI label/id queries and watch tail options are not supported.
//!
//! ```no_run
//! # async fn demo() -> Result<(), talos_sim::SimError> {
//! use talos_sim::{ClientRole, SimConfig, Simulator, Timings};
//! let config = SimConfig::uniform("demo", 3, 2, "1.11.6", "1.34.1").with_timings(Timings::fast());
//! let sim = Simulator::start(config).await?;
//! let talosconfig = sim.talosconfig(ClientRole::Admin);
//! # let _ = talosconfig;
//! # Ok(()) }
//! ```

// Layering: a module uses only modules of its own or an earlier group, so imports never go round in a
// circle. (1) auth, compat, config, etcd, events, faults, image_ref, kubeconfig, machine_config, meta,
// node_state, pki, record, registry, resources; (2) node_resources; (3) node; (4) cluster; (5) discovery,
// routing, sequences; (6) cosi, lifecycle_service, logs, machine_service; (7) cluster_service (which asks
// machine_service what a node answers); (8) server. The sequences restart a node's apid through
// `Cluster::start_apid`, which `Simulator::start` points at `server::start`.
mod auth;
mod cluster;
mod cluster_service;
mod compat;
pub mod config;
mod cosi;
mod discovery;
mod etcd;
mod events;
pub mod faults;
mod image_ref;
mod kubeconfig;
mod lifecycle_service;
mod logs;
mod machine_config;
mod machine_service;
mod meta;
mod node;
mod node_resources;
mod node_state;
pub mod pki;
pub mod record;
mod registry;
mod resources;
mod routing;
mod sequences;
mod server;

// Written separately (keep these lines): the workload cluster mirror and the HTTP control API.
pub mod control;
pub mod workload;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use cluster::Cluster;
use node::{Node, NodeInit};

pub use config::{ConfigError, NodeConfig, Role, SimConfig, Timings};
pub use etcd::EtcdMemberSnapshot;
pub use faults::{ActiveFaults, Fault};
pub use node::{ComponentSnapshot, ControlPlaneSnapshot, NodeSnapshot};
pub use node_state::{MachineStage, UnmetCondition};
pub use pki::{CertAuthority, ClientIdentity, ClientRole, PkiError, Validity};
pub use record::{CallRecord, PowerEvent, PowerKind, max_concurrently_down};
pub use server::TlsSetupError;

/// Errors of the simulator's public API.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error(transparent)]
    Tls(#[from] TlsSetupError),
    #[error("no simulated node named {0:?}")]
    UnknownNode(String),
    #[error("node {node}: condition not met within {timeout:?}; last snapshot: {last:?}")]
    Timeout {
        node: String,
        timeout: Duration,
        last: Box<NodeSnapshot>,
    },
}

/// Where a simulated node listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub role: Role,
    pub address: Ipv4Addr,
    pub port: u16,
}

impl NodeInfo {
    /// `https://<address>:<port>`, what a gRPC client dials.
    pub fn endpoint(&self) -> String {
        format!("https://{}:{}", self.address, self.port)
    }
}

/// A running simulated cluster. Dropping it stops every node.
#[derive(Debug)]
pub struct Simulator {
    cluster: Arc<Cluster>,
    config: SimConfig,
}

impl Simulator {
    /// Generate the PKI, bind every node's address, and boot the nodes (instantly: they start RUNNING
    /// and ready, with a boot sequence in their event history).
    pub async fn start(config: SimConfig) -> Result<Simulator, SimError> {
        config.validate()?;
        let listeners = config::allocate_listeners(&config)?;
        let ca = CertAuthority::generate()?;
        // The CAs every generated config carries, so that the configs pass Talos's own validation.
        let etcd_ca = CertAuthority::generate()?;
        let secrets = machine_config::ConfigSecrets {
            os_ca_crt: ca.cert_pem().to_string(),
            os_ca_key: ca.talos_key_pem(),
            etcd_ca_crt: etcd_ca.cert_pem().to_string(),
            etcd_ca_key: etcd_ca.talos_key_pem(),
        };
        let shutdown = CancellationToken::new();

        let first_cp = config
            .nodes
            .iter()
            .zip(&listeners)
            .find(|(n, _)| n.role.is_control_plane())
            .map(|(_, (addr, _))| *addr)
            .unwrap_or(Ipv4Addr::LOCALHOST);
        let cp_endpoint = format!("https://{first_cp}:6443");

        let mut resolved = config.clone();
        let mut nodes = Vec::with_capacity(config.nodes.len());
        for (index, (node_cfg, (address, _))) in config.nodes.iter().zip(&listeners).enumerate() {
            resolved.nodes[index].address = Some(*address);
            // validate() checked both versions parse.
            let talos_version = compat::parse_version(&node_cfg.talos_version)
                .map_err(|e| ConfigError::Invalid(format!("{}: {e}", node_cfg.name)))?;
            let kubernetes = compat::parse_version(&node_cfg.kubernetes_version)
                .map_err(|e| ConfigError::Invalid(format!("{}: {e}", node_cfg.name)))?;
            let installer_image = node_cfg.installer_image_or_default();
            let text = machine_config::generate(&machine_config::ConfigInputs {
                cluster_name: &config.cluster_name,
                node_name: &node_cfg.name,
                role: node_cfg.role,
                kubernetes_version: &kubernetes,
                installer_image: &installer_image,
                control_plane_endpoint: &cp_endpoint,
                image_registry: node_cfg.image_registry.as_deref(),
                unattended_install: node_cfg.unattended_install,
                kubernetes_documents: node_cfg.kubernetes_documents,
                secrets: &secrets,
            });
            let parsed = machine_config::parse(
                text.as_bytes(),
                &machine_config::default_images(&kubernetes),
            )
            .map_err(|e| {
                ConfigError::Invalid(format!("{}: generated config: {e}", node_cfg.name))
            })?;
            let identity = ca.server_identity(&node_cfg.name, *address)?;
            let tls = server::tls_config(&ca, identity)?;
            nodes.push(Arc::new(Node::new(NodeInit {
                index,
                name: node_cfg.name.clone(),
                role: node_cfg.role,
                address: *address,
                platform: node_cfg.platform_or_default().to_string(),
                talos_version,
                installer_image,
                config: text.into_bytes(),
                parsed,
                tls,
                boot: shutdown.child_token(),
            })));
        }
        let control_planes: Vec<(String, Ipv4Addr)> = nodes
            .iter()
            .filter(|n| n.role.is_control_plane())
            .map(|n| (n.name.clone(), n.address))
            .collect();
        let cluster = Arc::new(Cluster {
            cluster_name: config.cluster_name.clone(),
            port: config.port,
            timings: config.timings,
            ca,
            nodes,
            etcd: etcd::EtcdCluster::new(&control_planes),
            record: record::Recorder::new(),
            shutdown,
            apid: server::start,
            workload_kubeconfig: Default::default(),
        });
        if let Some(path) = &config.workload_kubeconfig {
            let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
                path: path.display().to_string(),
                source,
            })?;
            kubeconfig::validate(&text).map_err(|e| {
                ConfigError::Invalid(format!("workload_kubeconfig {}: {e}", path.display()))
            })?;
            cluster.workload_kubeconfig.set(Some(text));
        }
        for (node, (_, listener)) in cluster.nodes.iter().zip(listeners) {
            cluster.start_apid(node, listener);
            node.update(&cluster.etcd, |s| s.sequence = Some("boot"));
            sequences::emit_sequence(
                node,
                "",
                "boot",
                talos_api::proto::machine::sequence_event::Action::Start,
                None,
            );
            sequences::set_stage(&cluster, node, MachineStage::Booting, false, Vec::new());
            sequences::boot_sequence(&cluster, node, sequences::Pace::Instant).await;
        }
        tracing::info!(
            cluster = %config.cluster_name,
            nodes = cluster.nodes.len(),
            "Talos simulator started"
        );
        Ok(Simulator {
            cluster,
            config: resolved,
        })
    }

    fn node(&self, name: &str) -> Result<&Arc<Node>, SimError> {
        self.cluster
            .by_name(name)
            .ok_or_else(|| SimError::UnknownNode(name.to_string()))
    }

    /// The configuration with every node's address filled in.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Give the control planes the admin kubeconfig of the workload cluster to hand out through
    /// `MachineService.Kubeconfig` (`talosctl kubeconfig`, and the Kubernetes steps of `talosctl
    /// health` and `upgrade-k8s`), or take it away (`None`: they answer `FailedPrecondition`, as Talos
    /// does without what a kubeconfig is made of, and talosctl's health checks skip Kubernetes).
    ///
    /// A Talos node generates it (talos v1.14.1 `pkg/kubeconfig/generate.go`); a simulated node
    /// cannot, so this is the kubeconfig of the real API server the workload mirror writes into. It must
    /// be shaped as Talos generates one, since talosctl refuses anything else: one cluster with its CA
    /// data, one user with a client certificate and key (no token), one context in namespace `default`.
    /// A kubeconfig that is not is refused with talosctl's reasons. It is never logged.
    pub fn set_workload_kubeconfig(&self, kubeconfig: Option<&str>) -> Result<(), SimError> {
        if let Some(text) = kubeconfig {
            kubeconfig::validate(text)
                .map_err(|e| ConfigError::Invalid(format!("workload kubeconfig: {e}")))?;
        }
        self.cluster
            .workload_kubeconfig
            .set(kubeconfig.map(str::to_string));
        Ok(())
    }

    /// The API server the handed-out workload kubeconfig points at, if one was given.
    pub fn workload_api_server(&self) -> Option<String> {
        self.cluster
            .workload_kubeconfig
            .get()
            .and_then(|k| kubeconfig::server_of(&k))
    }

    pub fn cluster_name(&self) -> &str {
        &self.cluster.cluster_name
    }

    /// The Talos OS CA certificate (PEM).
    pub fn ca_pem(&self) -> String {
        self.cluster.ca.cert_pem().to_string()
    }

    /// Every node, in config order.
    pub fn nodes(&self) -> Vec<NodeInfo> {
        self.cluster
            .nodes
            .iter()
            .map(|n| NodeInfo {
                name: n.name.clone(),
                role: n.role,
                address: n.address,
                port: self.cluster.port,
            })
            .collect()
    }

    /// A talosconfig for `role` (a [`ClientRole`] or its Organization string such as `"os:admin"`), as
    /// talosctl writes it: context = cluster name, endpoints = control plane IPs, nodes = the first
    /// node, key under the `ED25519 PRIVATE KEY` label.
    pub fn talosconfig(&self, role: impl Into<ClientRole>) -> String {
        // Minting an Ed25519 certificate from fixed, valid parameters fails only if the OS random
        // generator is unavailable, in which case nothing in the simulator could work anyway.
        self.try_talosconfig(role)
            .expect("minting a client certificate from the simulator's CA")
    }

    /// Writes a talosconfig for `role` ([`Simulator::talosconfig`]) to `path`, replacing what is
    /// there, readable by its owner only (a file that was there is made so before it is written):
    /// it holds the client's private key. For a talosctl (the `talos-sim` binary's state directory,
    /// the demo, the talosctl tests).
    pub fn write_talosconfig(
        &self,
        path: &std::path::Path,
        role: impl Into<ClientRole>,
    ) -> std::io::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)?;
        // `mode` applies to a file it creates only.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        file.write_all(self.talosconfig(role).as_bytes())
    }

    /// [`Simulator::talosconfig`] without the panic on an (unexpected) certificate error.
    pub fn try_talosconfig(&self, role: impl Into<ClientRole>) -> Result<String, SimError> {
        let identity = self
            .cluster
            .ca
            .client_identity(&role.into(), Validity::one_year())?;
        Ok(self.render_talosconfig(&identity))
    }

    /// An admin talosconfig whose client certificate comes from an unrelated CA (the `ca` field is still
    /// the cluster's, so the client trusts the nodes and it is the node that must refuse the client).
    pub fn talosconfig_from_other_ca(&self) -> String {
        // See `talosconfig` for why minting cannot fail in practice.
        self.try_talosconfig_from_other_ca()
            .expect("minting a CA and a client certificate")
    }

    pub fn try_talosconfig_from_other_ca(&self) -> Result<String, SimError> {
        let other = CertAuthority::generate()?;
        let identity = other.client_identity(&ClientRole::Admin, Validity::one_year())?;
        Ok(self.render_talosconfig(&identity))
    }

    fn render_talosconfig(&self, identity: &ClientIdentity) -> String {
        let first = self.cluster.nodes.first().map(|n| n.address);
        pki::talosconfig_yaml(
            &self.cluster.cluster_name,
            &self.cluster.control_plane_addresses(),
            first.as_slice(),
            self.cluster.ca.cert_pem(),
            identity,
        )
    }

    /// A client certificate and key for `role` valid over `validity` (e.g. [`Validity::expired`]), as
    /// `(cert_pem, key_pem)`; the key uses Talos's `ED25519 PRIVATE KEY` label like a talosconfig does.
    pub fn client_identity_pem(
        &self,
        role: impl Into<ClientRole>,
        validity: Validity,
    ) -> (String, String) {
        // See `talosconfig` for why minting cannot fail in practice.
        let identity = self
            .cluster
            .ca
            .client_identity(&role.into(), validity)
            .expect("minting a client certificate from the simulator's CA");
        let key = identity.talos_key_pem();
        (identity.cert_pem, key)
    }

    /// The OS CA, to mint unusual client certificates in tests.
    pub fn ca(&self) -> &CertAuthority {
        &self.cluster.ca
    }

    /// The node's current state.
    pub fn node_snapshot(&self, name: &str) -> Result<NodeSnapshot, SimError> {
        Ok(self.node(name)?.snapshot())
    }

    /// Snapshots of every node, in config order.
    pub fn snapshots(&self) -> Vec<NodeSnapshot> {
        self.cluster.nodes.iter().map(|n| n.snapshot()).collect()
    }

    /// A receiver that sees every change of the node's snapshot.
    pub fn subscribe(&self, name: &str) -> Result<watch::Receiver<NodeSnapshot>, SimError> {
        Ok(self.node(name)?.subscribe())
    }

    /// Wait until `condition` holds for the node's snapshot (checked at once and on every change).
    pub async fn wait_for(
        &self,
        name: &str,
        timeout: Duration,
        mut condition: impl FnMut(&NodeSnapshot) -> bool,
    ) -> Result<NodeSnapshot, SimError> {
        let mut rx = self.subscribe(name)?;
        let waited = tokio::time::timeout(timeout, async {
            loop {
                {
                    let snapshot = rx.borrow_and_update();
                    if condition(&snapshot) {
                        return Some(snapshot.clone());
                    }
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        })
        .await;
        match waited {
            Ok(Some(snapshot)) => Ok(snapshot),
            _ => Err(SimError::Timeout {
                node: name.to_string(),
                timeout,
                last: Box::new(rx.borrow().clone()),
            }),
        }
    }

    /// Turn on a fault on a node (while running).
    pub fn inject_fault(&self, name: &str, fault: Fault) -> Result<(), SimError> {
        let node = self.node(name)?;
        node.faults.inject(fault);
        self.cluster.sync_etcd_fault(node);
        Ok(())
    }

    /// Turn off every fault on a node (a node held down by `NeverReturns` then boots).
    pub fn clear_faults(&self, name: &str) -> Result<(), SimError> {
        let node = self.node(name)?;
        node.faults.clear();
        self.cluster.sync_etcd_fault(node);
        Ok(())
    }

    pub fn active_faults(&self, name: &str) -> Result<ActiveFaults, SimError> {
        Ok(self.node(name)?.faults.current())
    }

    /// Every mutating call received so far (that passed authorization), in arrival order.
    pub fn record(&self) -> Vec<CallRecord> {
        self.cluster.record.calls()
    }

    /// Every power-off and power-on so far, in order.
    pub fn power_events(&self) -> Vec<PowerEvent> {
        self.cluster.record.power_events()
    }

    /// Calls and power events as JSON, for dumping into test logs.
    pub fn record_json(&self) -> serde_json::Value {
        serde_json::json!({
            "calls": self.record(),
            "power": self.power_events(),
        })
    }

    /// Stop every node: all connections drop, listeners close, background sequences stop.
    pub fn shutdown(&self) {
        self.cluster.shutdown.cancel();
        for node in &self.cluster.nodes {
            // No runtime may be left to await the aborted tasks (Drop); aborting is enough.
            node.kill();
        }
    }
}

impl Drop for Simulator {
    fn drop(&mut self) {
        self.shutdown();
    }
}
