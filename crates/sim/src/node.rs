//! One simulated node: its mutable state, the snapshot tests and the workload mirror observe, and the
//! plumbing that keeps events, COSI resources and snapshots in step with the state.
//!
//! All state lives in [`NodeState`] behind a std mutex that is never held across an await. Every
//! mutation goes through [`Node::update`], which republishes the derived views (snapshot + resources)
//! under a publish lock so concurrent updates cannot publish out of order.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex, MutexGuard};

use semver::Version;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::config::Role;
use super::etcd::{EtcdCluster, EtcdMemberSnapshot};
use super::events::EventLog;
use super::faults::FaultSet;
use super::machine_config::{self, ComponentImages, ParsedConfig};
use super::node_resources;
use super::node_state::{MachineStage, NodeState, RunningComponent, Slot, UnmetCondition};
use super::resources::ResourceStore;

/// A running (or last run) component: kubelet or a control-plane static pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ComponentSnapshot {
    /// Image the component runs now.
    pub image: String,
    /// Version from the running image's tag, e.g. "1.34.1".
    pub version: String,
    /// The component runs (kubelet service up / static pod running and Ready).
    pub running: bool,
    /// Image the machine config asks for; differs from `image` while a change is being applied.
    pub desired_image: String,
    /// Config resource version the running component was rendered from: the value of the
    /// `talos.dev/config-version` pod annotation (APIServerConfig etc.), or the KubeletSpec version.
    pub config_version: u64,
}

/// Control-plane components of a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ControlPlaneSnapshot {
    pub apiserver: ComponentSnapshot,
    pub controller_manager: ComponentSnapshot,
    pub scheduler: ComponentSnapshot,
    /// kube-proxy image in this node's config (rendered into the `10-kube-proxy` manifest).
    pub proxy_image: String,
}

/// Everything observable about a node, cheap to clone; published on every change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeSnapshot {
    pub name: String,
    pub role: Role,
    pub address: Ipv4Addr,
    /// The platform the node booted on (`metal`, `aws`, …), as `Version` and `PlatformMetadata` report it.
    pub platform: String,
    /// Running Talos version, e.g. "1.11.6".
    pub talos_version: String,
    /// Installer image of the running slot.
    pub installer_image: String,
    /// Version installed into the other A/B slot and booted at the next reboot, if any.
    pub installed_version: Option<String>,
    /// Version in the other A/B slot that `Rollback` would boot.
    pub previous_version: Option<String>,
    /// `/proc/sys/kernel/random/boot_id`; changes on every boot.
    pub boot_id: String,
    pub stage: MachineStage,
    pub ready: bool,
    pub unmet_conditions: Vec<UnmetCondition>,
    /// Powered off: the port refuses connections.
    pub down: bool,
    /// machined holds the Kubernetes node cordoned: set when the stage becomes upgrading, shutting
    /// down or resetting, kept through the reboot, lifted when the next boot reaches booting/running.
    pub cordoned: bool,
    /// `MachineConfigs.config.talos.dev/v1alpha1` resource version.
    pub machine_config_version: u64,
    pub kubelet: ComponentSnapshot,
    /// Control-plane nodes only.
    pub control_plane: Option<ControlPlaneSnapshot>,
    /// Control-plane nodes only.
    pub etcd: Option<EtcdMemberSnapshot>,
}

/// Services every node runs, then the control-plane extras (ServiceList order is by id).
pub(crate) const BASE_SERVICES: &[&str] = &[
    "apid",
    "containerd",
    "cri",
    "kubelet",
    "machined",
    "syslogd",
    "udevd",
];
pub(crate) const CONTROL_PLANE_SERVICES: &[&str] = &["etcd", "trustd"];

/// Services stopped by the upgrade's `stopServices` phase and the reboot's `stopEverything`.
pub(crate) const WORKLOAD_SERVICES: &[&str] = &["kubelet", "etcd", "cri"];

/// The listener task of the current boot and its two tokens: `boot` ends the boot (streams finish,
/// apid shuts down gracefully, the port closes), `kill` drops whatever connections remain.
#[derive(Debug)]
struct Power {
    boot: CancellationToken,
    kill: CancellationToken,
    server: Option<JoinHandle<()>>,
}

/// What [`Node::cut_power`] hands back so the caller can wait for a graceful stop and escalate.
#[derive(Debug)]
pub(crate) struct PowerCut {
    pub server: Option<JoinHandle<()>>,
    pub kill: CancellationToken,
}

pub(crate) struct Node {
    pub index: usize,
    pub name: String,
    pub role: Role,
    pub address: Ipv4Addr,
    pub platform: String,
    state: Mutex<NodeState>,
    publish_lock: Mutex<()>,
    snapshot: watch::Sender<NodeSnapshot>,
    pub events: EventLog,
    pub store: ResourceStore,
    pub faults: FaultSet,
    power: Mutex<Power>,
    pub tls: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("name", &self.name)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // State updates are small closures that do not panic midway in practice; if a test thread panics
    // while holding a lock, later readers still get the last consistent value.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct NodeInit {
    pub index: usize,
    pub name: String,
    pub role: Role,
    pub address: Ipv4Addr,
    pub platform: String,
    pub talos_version: Version,
    pub installer_image: String,
    pub config: Vec<u8>,
    pub parsed: ParsedConfig,
    pub tls: Arc<rustls::ServerConfig>,
    pub boot: CancellationToken,
}

impl Node {
    pub(crate) fn new(init: NodeInit) -> Node {
        let images = init.parsed.images.clone();
        let component = |image: &str| RunningComponent {
            image: image.to_string(),
            config_version: 0,
            running: false,
        };
        let state = NodeState {
            current: Slot {
                version: init.talos_version,
                installer_image: init.installer_image,
            },
            previous: None,
            next_boot: None,
            boot_id: Uuid::new_v4(),
            stage: MachineStage::Booting,
            ready: false,
            unmet: Vec::new(),
            cordoned: false,
            down: false,
            services: BTreeMap::new(),
            config: init.config,
            parsed: init.parsed,
            staged_config: None,
            kubelet: component(&images.kubelet),
            apiserver: component(&images.apiserver),
            controller_manager: component(&images.controller_manager),
            scheduler: component(&images.scheduler),
            sequence: None,
            installing: false,
            pulled_images: BTreeSet::new(),
        };
        let snapshot = build_snapshot(
            &init.name,
            init.role,
            init.address,
            &init.platform,
            &state,
            None,
            &ResourceStore::new(),
        );
        Node {
            index: init.index,
            name: init.name,
            role: init.role,
            address: init.address,
            platform: init.platform,
            state: Mutex::new(state),
            publish_lock: Mutex::new(()),
            snapshot: watch::Sender::new(snapshot),
            events: EventLog::new(),
            store: ResourceStore::new(),
            faults: FaultSet::new(),
            power: Mutex::new(Power {
                kill: init.boot.clone(),
                boot: init.boot,
                server: None,
            }),
            tls: init.tls,
        }
    }

    /// Read the state.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&NodeState) -> R) -> R {
        f(&lock(&self.state))
    }

    /// Mutate the state, then republish snapshot and resources.
    pub(crate) fn update<R>(&self, etcd: &EtcdCluster, f: impl FnOnce(&mut NodeState) -> R) -> R {
        let out = f(&mut lock(&self.state));
        self.publish(etcd);
        out
    }

    /// Recompute the derived views from the current state.
    pub(crate) fn publish(&self, etcd: &EtcdCluster) {
        let _serial = lock(&self.publish_lock);
        let state = lock(&self.state).clone();
        let member = if self.role.is_control_plane() {
            etcd.snapshot_for(&self.name)
        } else {
            None
        };
        self.store.reconcile(node_resources::desired(
            &node_resources::NodeIdentity {
                name: &self.name,
                role: self.role,
                address: self.address,
                platform: &self.platform,
            },
            &state,
            member.as_ref(),
        ));
        let snapshot = build_snapshot(
            &self.name,
            self.role,
            self.address,
            &self.platform,
            &state,
            member,
            &self.store,
        );
        self.snapshot.send_if_modified(|current| {
            if *current == snapshot {
                false
            } else {
                *current = snapshot;
                true
            }
        });
    }

    pub(crate) fn snapshot(&self) -> NodeSnapshot {
        self.snapshot.borrow().clone()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<NodeSnapshot> {
        self.snapshot.subscribe()
    }

    pub(crate) fn version(&self) -> Version {
        self.read(|s| s.current.version.clone())
    }

    pub(crate) fn is_down(&self) -> bool {
        self.read(|s| s.down)
    }

    /// Default component images for this node's Talos version, for config fields left out.
    pub(crate) fn default_images(&self) -> ComponentImages {
        let version = self.version();
        machine_config::default_images(&super::compat::default_kubernetes_version(&version))
    }

    /// The token that ends when the current boot ends (power-off kills connections and streams).
    pub(crate) fn boot_token(&self) -> CancellationToken {
        lock(&self.power).boot.clone()
    }

    /// Install the listener task of a new boot, with the tokens that end it.
    pub(crate) fn set_power_on(
        &self,
        boot: CancellationToken,
        kill: CancellationToken,
        server: JoinHandle<()>,
    ) {
        let mut power = lock(&self.power);
        power.boot = boot;
        power.kill = kill;
        if let Some(old) = power.server.replace(server) {
            old.abort();
        }
    }

    /// Cut the power: end the boot. apid stops accepting (the port closes), open streams flush what
    /// happened so far and end with `Unavailable`, connections close once their streams are done.
    pub(crate) fn cut_power(&self) -> PowerCut {
        let mut power = lock(&self.power);
        power.boot.cancel();
        PowerCut {
            server: power.server.take(),
            kill: power.kill.clone(),
        }
    }

    /// Drop everything at once (simulator shutdown).
    pub(crate) fn kill(&self) {
        let mut power = lock(&self.power);
        power.boot.cancel();
        power.kill.cancel();
        if let Some(server) = power.server.take() {
            server.abort();
        }
    }
}

fn component_snapshot(running: &RunningComponent, desired_image: &str) -> ComponentSnapshot {
    ComponentSnapshot {
        image: running.image.clone(),
        version: machine_config::image_version(&running.image),
        running: running.running,
        desired_image: desired_image.to_string(),
        config_version: running.config_version,
    }
}

fn build_snapshot(
    name: &str,
    role: Role,
    address: Ipv4Addr,
    platform: &str,
    state: &NodeState,
    etcd: Option<EtcdMemberSnapshot>,
    store: &ResourceStore,
) -> NodeSnapshot {
    let images = &state.parsed.images;
    let control_plane = role.is_control_plane().then(|| ControlPlaneSnapshot {
        apiserver: component_snapshot(&state.apiserver, &images.apiserver),
        controller_manager: component_snapshot(
            &state.controller_manager,
            &images.controller_manager,
        ),
        scheduler: component_snapshot(&state.scheduler, &images.scheduler),
        proxy_image: images.proxy.clone(),
    });
    NodeSnapshot {
        name: name.to_string(),
        role,
        address,
        platform: platform.to_string(),
        talos_version: state.current.version.to_string(),
        installer_image: state.current.installer_image.clone(),
        installed_version: state
            .next_boot
            .as_ref()
            .filter(|s| *s != &state.current)
            .map(|s| s.version.to_string()),
        previous_version: state.previous.as_ref().map(|s| s.version.to_string()),
        boot_id: state.boot_id.to_string(),
        stage: state.stage,
        ready: state.ready,
        unmet_conditions: state.unmet.clone(),
        down: state.down,
        cordoned: state.cordoned,
        machine_config_version: store.version_of(
            node_resources::CONFIG_NS,
            node_resources::MACHINE_CONFIG_TYPE,
            "v1alpha1",
        ),
        kubelet: component_snapshot(&state.kubelet, &images.kubelet),
        control_plane,
        etcd,
    }
}
