//! Simulator configuration: the cluster, its nodes and the timings of the simulated machine lifecycle.
//!
//! The configuration is YAML-loadable so a demo can describe a cluster in a file; unknown fields are
//! rejected so a typo (`reboot_secs`) fails loudly instead of silently using a default. Timings are in
//! milliseconds so tests can run a whole upgrade in well under a second while a demo uses minutes.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpSocket};

use super::compat;

/// Errors found while loading or validating a [`SimConfig`].
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML did not match the schema (unknown field, wrong type, missing field, ...).
    #[error("invalid simulator config: {0}")]
    Parse(#[from] serde_yaml::Error),
    /// The file could not be read.
    #[error("cannot read simulator config {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The config parsed but is not usable.
    #[error("invalid simulator config: {0}")]
    Invalid(String),
}

/// Role of a simulated node, spelled as in a Talos machine config (`machine.type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Role {
    #[serde(rename = "controlplane")]
    ControlPlane,
    #[serde(rename = "worker")]
    Worker,
}

impl Role {
    /// The `machine.type` spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::ControlPlane => "controlplane",
            Role::Worker => "worker",
        }
    }

    pub fn is_control_plane(self) -> bool {
        self == Role::ControlPlane
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The whole simulated cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// Cluster name; also the talosconfig context name.
    pub cluster_name: String,
    /// apid port every node listens on (each node has its own IP, so they can all use 50000).
    #[serde(default = "default_port")]
    pub port: u16,
    pub nodes: Vec<NodeConfig>,
    #[serde(default)]
    pub timings: Timings,
    /// An admin kubeconfig of the workload cluster (a real API server the nodes are mirrored into),
    /// which the control planes hand out through `MachineService.Kubeconfig`: `talosctl kubeconfig`,
    /// and the Kubernetes steps of `talosctl health` and `upgrade-k8s`. It must be shaped as Talos
    /// generates one (client certificate, no token); see docs/simulator.md. Also settable while
    /// running: `Simulator::set_workload_kubeconfig`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_kubeconfig: Option<PathBuf>,
}

/// One simulated node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Hostname and Kubernetes node name.
    pub name: String,
    pub role: Role,
    /// Listen address; auto-assigned from a free 127.X.Y.0/24 block when absent.
    #[serde(default)]
    pub address: Option<Ipv4Addr>,
    /// Running Talos version, e.g. "1.11.6" (a leading "v" is accepted).
    pub talos_version: String,
    /// Kubernetes version of kubelet and the control-plane static pods, e.g. "1.34.1".
    pub kubernetes_version: String,
    /// Installer image in the machine config; defaults to what `talosctl gen config` of the node's
    /// Talos release writes: `ghcr.io/siderolabs/installer:v<talos>` below 1.14, the Image Factory's
    /// `factory.talos.dev/metal-installer/<empty schematic>:v<talos>` from 1.14 on. A factory image
    /// (`<host>/<…>installer[-secureboot]/<schematic>`) also means the node booted from a factory-built
    /// asset: it reports the `schematic` extension (and, from 1.14, `ImageFactorySchematic`).
    #[serde(default)]
    pub installer_image: Option<String>,
    /// A registry mirror the machine config takes the Kubernetes component images from
    /// (`<registry>/kube-apiserver:v1.34.1`, `<registry>/kubelet:v1.34.1`, …) instead of the upstream ones.
    #[serde(default)]
    pub image_registry: Option<String>,
    /// The node's config puts its install image in an `UnattendedInstallConfig` document
    /// (`installer.image`), as configs created on Talos 1.14 do, instead of `machine.install.image`
    /// (machinery v1.14.1 `config/types/runtime/unattended_install.go`).
    #[serde(default)]
    pub unattended_install: bool,
    /// The platform the node booted on, as Talos names it (machinery v1.14.1 `platforms/platforms.go`:
    /// `metal` or a cloud platform such as `aws`; or `container`); `metal` when absent.
    #[serde(default)]
    pub platform: Option<String>,
    /// The node's config is shaped as created on Talos 1.14 (machinery v1.14.1 `config/generate` with
    /// the 1.14 contract): `KubeletConfig`, and on control planes `KubeAPIServerConfig`,
    /// `KubeControllerManagerConfig`, `KubeSchedulerConfig` and `KubeProxyConfig` documents carry the
    /// component images instead of `.machine.kubelet` and `.cluster.{apiServer,…}`. Talos ≥ 1.14 only.
    #[serde(default)]
    pub kubernetes_documents: bool,
}

/// How long the simulated lifecycle steps take, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timings {
    /// Machine off: the port refuses connections for this long.
    pub reboot_ms: u64,
    /// Boot sequence: BOOTING until RUNNING.
    pub boot_ms: u64,
    /// RUNNING until ready (node Ready, static pods up).
    pub ready_ms: u64,
    /// Installer run (LifecycleService.Upgrade) and the legacy upgrade's pre-reboot phases.
    pub install_ms: u64,
    /// Image pull.
    pub pull_ms: u64,
    /// A machine config change taking effect (static pods restarted, kubelet restarted).
    pub apply_ms: u64,
    /// Each step above takes its time ± up to this percentage, drawn anew every time, so that nodes
    /// started together drift apart the way real machines do. 0 (the default): exactly the times above.
    pub jitter_percent: u64,
}

impl Default for Timings {
    /// Demo-friendly values: an upgrade takes a few seconds, visible in a terminal.
    fn default() -> Self {
        Timings {
            reboot_ms: 3000,
            boot_ms: 2000,
            ready_ms: 2000,
            install_ms: 3000,
            pull_ms: 1000,
            apply_ms: 1000,
            jitter_percent: 0,
        }
    }
}

impl Timings {
    /// Short timings for tests: a full upgrade in a few hundred milliseconds.
    pub fn fast() -> Self {
        Timings {
            reboot_ms: 150,
            boot_ms: 60,
            ready_ms: 60,
            install_ms: 80,
            pull_ms: 30,
            apply_ms: 50,
            jitter_percent: 0,
        }
    }

    /// The fastest end of the user guide's per-node times (docs: download 30–60 s, stage 10–30 s, reboot
    /// 30–90 s, rejoin 30–60 s), each ± 20 %: about 100 s per node, 2–4 minutes on real machines.
    pub fn like_the_guide() -> Self {
        Timings {
            reboot_ms: 30_000,
            boot_ms: 15_000,
            ready_ms: 15_000,
            install_ms: 10_000,
            pull_ms: 30_000,
            apply_ms: 10_000,
            jitter_percent: 20,
        }
    }

    /// `ms` ± up to `jitter_percent` of it.
    fn jittered(&self, ms: u64) -> Duration {
        if self.jitter_percent == 0 {
            return Duration::from_millis(ms);
        }
        let spread = ms.saturating_mul(self.jitter_percent.min(100)) / 100;
        // Uniform in [ms - spread, ms + spread].
        let offset = next_random() % (2 * spread + 1);
        Duration::from_millis(ms - spread + offset)
    }

    pub(crate) fn reboot(&self) -> Duration {
        self.jittered(self.reboot_ms)
    }
    pub(crate) fn boot(&self) -> Duration {
        self.jittered(self.boot_ms)
    }
    pub(crate) fn ready(&self) -> Duration {
        self.jittered(self.ready_ms)
    }
    pub(crate) fn install(&self) -> Duration {
        self.jittered(self.install_ms)
    }
    pub(crate) fn pull(&self) -> Duration {
        self.jittered(self.pull_ms)
    }
    pub(crate) fn apply(&self) -> Duration {
        self.jittered(self.apply_ms)
    }
}

/// splitmix64 over a process-wide counter: cheap, good enough to spread simulated step times, and no
/// random-number crate for a simulator that needs no other randomness of this kind.
fn next_random() -> u64 {
    static STATE: AtomicU64 = AtomicU64::new(0x2545_f491_4f6c_dd1d);
    let mut z = STATE
        .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn default_port() -> u16 {
    50000
}

impl NodeConfig {
    /// A control-plane node with an auto-assigned address.
    pub fn control_plane(name: &str, talos_version: &str, kubernetes_version: &str) -> Self {
        Self::new(name, Role::ControlPlane, talos_version, kubernetes_version)
    }

    /// A worker node with an auto-assigned address.
    pub fn worker(name: &str, talos_version: &str, kubernetes_version: &str) -> Self {
        Self::new(name, Role::Worker, talos_version, kubernetes_version)
    }

    fn new(name: &str, role: Role, talos_version: &str, kubernetes_version: &str) -> Self {
        NodeConfig {
            name: name.to_string(),
            role,
            address: None,
            talos_version: talos_version.to_string(),
            kubernetes_version: kubernetes_version.to_string(),
            installer_image: None,
            unattended_install: false,
            image_registry: None,
            platform: None,
            kubernetes_documents: false,
        }
    }

    /// Boots the node on `platform` (a Talos platform name such as `aws`).
    pub fn with_platform(mut self, platform: &str) -> Self {
        self.platform = Some(platform.to_string());
        self
    }

    /// Shapes the node's config as created on Talos 1.14: the Kube* documents, and the install image
    /// in an `UnattendedInstallConfig` document.
    pub fn created_on_1_14(mut self) -> Self {
        self.kubernetes_documents = true;
        self.unattended_install = true;
        self
    }

    /// The node's platform, with the default filled in.
    pub fn platform_or_default(&self) -> &str {
        self.platform
            .as_deref()
            .unwrap_or(super::registry::DEFAULT_PLATFORM)
    }

    /// Takes the Kubernetes component images from `registry` (a mirror), as an air-gapped cluster does.
    pub fn with_image_registry(mut self, registry: &str) -> Self {
        self.image_registry = Some(registry.to_string());
        self
    }

    /// The installer image, with the default filled in (see [`NodeConfig::installer_image`]).
    pub fn installer_image_or_default(&self) -> String {
        match (
            &self.installer_image,
            compat::parse_version(&self.talos_version),
        ) {
            (Some(image), _) => image.clone(),
            (None, Ok(talos)) => super::registry::default_installer_image(&talos),
            // Not a version: validate() refuses the config; keep the old spelling for the message.
            (None, Err(_)) => format!(
                "ghcr.io/siderolabs/installer:v{}",
                self.talos_version.trim_start_matches('v')
            ),
        }
    }
}

impl SimConfig {
    /// An empty cluster with the default port and timings; add nodes with [`SimConfig::with_node`].
    pub fn new(cluster_name: &str) -> Self {
        SimConfig {
            cluster_name: cluster_name.to_string(),
            port: default_port(),
            nodes: Vec::new(),
            timings: Timings::default(),
            workload_kubeconfig: None,
        }
    }

    pub fn with_node(mut self, node: NodeConfig) -> Self {
        self.nodes.push(node);
        self
    }

    pub fn with_timings(mut self, timings: Timings) -> Self {
        self.timings = timings;
        self
    }

    /// `control_planes` control-plane nodes `cp-1..` and `workers` workers `worker-1..`, all on the same
    /// versions: the shape most tests want.
    pub fn uniform(
        cluster_name: &str,
        control_planes: usize,
        workers: usize,
        talos_version: &str,
        kubernetes_version: &str,
    ) -> Self {
        let mut config = SimConfig::new(cluster_name);
        for i in 1..=control_planes {
            config = config.with_node(NodeConfig::control_plane(
                &format!("cp-{i}"),
                talos_version,
                kubernetes_version,
            ));
        }
        for i in 1..=workers {
            config = config.with_node(NodeConfig::worker(
                &format!("worker-{i}"),
                talos_version,
                kubernetes_version,
            ));
        }
        config
    }

    /// Parse and validate a YAML config.
    pub fn from_yaml(yaml: &str) -> Result<Self, ConfigError> {
        let config: SimConfig = serde_yaml::from_str(yaml)?;
        config.validate()?;
        Ok(config)
    }

    /// Read, parse and validate a YAML config file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_yaml(&text)
    }

    /// Check what serde cannot: names, versions, addresses.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |msg: String| Err(ConfigError::Invalid(msg));
        // The cluster name becomes a YAML key in the talosconfig and a DNS-ish label; keep it plain.
        if self.cluster_name.is_empty() || !self.cluster_name.chars().all(is_name_char) {
            return invalid(format!(
                "cluster_name {:?} must be non-empty and use only letters, digits, '-', '_' and '.'",
                self.cluster_name
            ));
        }
        if self.nodes.is_empty() {
            return invalid("nodes must list at least one node".into());
        }
        if !self.nodes.iter().any(|n| n.role.is_control_plane()) {
            // talosconfig endpoints and etcd need a control plane.
            return invalid("nodes must include at least one controlplane node".into());
        }
        let mut names = HashSet::new();
        let mut addresses = HashSet::new();
        for node in &self.nodes {
            if node.name.is_empty() || !node.name.chars().all(is_name_char) {
                return invalid(format!(
                    "node name {:?} must be non-empty and use only letters, digits, '-', '_' and '.'",
                    node.name
                ));
            }
            if !names.insert(node.name.as_str()) {
                return invalid(format!("node name {:?} is used twice", node.name));
            }
            if let Some(address) = node.address
                && !addresses.insert(address)
            {
                return invalid(format!("address {address} is used by two nodes"));
            }
            let talos = match compat::parse_version(&node.talos_version) {
                Ok(talos) => talos,
                Err(e) => {
                    return invalid(format!(
                        "node {}: talos_version {:?}: {e}",
                        node.name, node.talos_version
                    ));
                }
            };
            if let Some(platform) = &node.platform
                && !super::registry::is_platform(platform)
            {
                return invalid(format!(
                    "node {}: platform {platform:?} is not a Talos platform (one of {}, {})",
                    node.name,
                    super::registry::PLATFORMS.join(", "),
                    super::registry::NODE_ONLY_PLATFORMS.join(", ")
                ));
            }
            if node.kubernetes_documents && !compat::knows_kubernetes_documents(&talos) {
                // Such a config is created on 1.14; an older node could not even decode it.
                return invalid(format!(
                    "node {}: kubernetes_documents needs Talos 1.14 or later, not {talos}",
                    node.name
                ));
            }
            if let Err(e) = compat::parse_version(&node.kubernetes_version) {
                return invalid(format!(
                    "node {}: kubernetes_version {:?}: {e}",
                    node.name, node.kubernetes_version
                ));
            }
            if let Some(image) = &node.installer_image
                && let Err(e) = super::image_ref::ImageRef::parse(image)
            {
                return invalid(format!("node {}: installer_image: {e}", node.name));
            }
        }
        Ok(())
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'
}

/// Bind a listening socket the way a restarted apid would: SO_REUSEADDR so a reboot can re-listen on the
/// port while old connections are still in TIME_WAIT.
pub(crate) fn bind_listener(addr: SocketAddrV4) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(SocketAddr::V4(addr))?;
    socket.listen(1024)
}

/// Distinguishes blocks chosen by several simulators in one process.
static BLOCK_COUNTER: AtomicU32 = AtomicU32::new(0);

/// How many /24 blocks to try before giving up; collisions are rare, so this is generous.
const MAX_BLOCK_ATTEMPTS: u32 = 64;

/// Resolve every node's address and bind its listener.
///
/// Nodes with an explicit address get it; the others share one 127.X.Y.0/24 block (host numbers 1..N in
/// config order). X and Y are derived from the process id and a per-process counter so parallel tests
/// in one process and across processes rarely collide, and every address is verified by binding it
/// (kept bound, so nothing can take it between the check and the server start).
pub(crate) fn allocate_listeners(
    config: &SimConfig,
) -> Result<Vec<(Ipv4Addr, TcpListener)>, ConfigError> {
    let auto_count = config.nodes.iter().filter(|n| n.address.is_none()).count();
    if auto_count > 254 {
        return Err(ConfigError::Invalid(format!(
            "{auto_count} nodes without an address do not fit in one /24 block"
        )));
    }
    let pid = std::process::id();
    for _ in 0..MAX_BLOCK_ATTEMPTS {
        let counter = BLOCK_COUNTER.fetch_add(1, Ordering::Relaxed);
        let (x, y) = block_for(pid, counter);
        match try_block(config, x, y) {
            Ok(listeners) => return Ok(listeners),
            Err(BlockError::Taken) => continue,
            Err(BlockError::Fatal(e)) => return Err(e),
        }
    }
    Err(ConfigError::Invalid(format!(
        "no free 127.X.Y.0/24 block with port {} found after {MAX_BLOCK_ATTEMPTS} attempts",
        config.port
    )))
}

enum BlockError {
    /// An auto-assigned address was in use: try another block.
    Taken,
    /// An explicit address could not be bound: retrying cannot help.
    Fatal(ConfigError),
}

/// Spread (pid, counter) over 127.1.0.0 – 127.254.255.0: a multiplicative hash so consecutive pids and
/// counters land far apart.
fn block_for(pid: u32, counter: u32) -> (u8, u8) {
    // splitmix64 of (pid, counter): every process tries its own scattered blocks. (A linear walk, the
    // same step for every process, made two processes' walks shifted copies of each other, so a
    // simulator next to one holding hundreds of blocks, like the benchmark's, could meet taken blocks
    // on every attempt.)
    let mut z = (u64::from(pid) << 32 | u64::from(counter)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let slot = z % (254 * 256);
    let x = 1 + (slot / 256) as u8;
    let y = (slot % 256) as u8;
    (x, y)
}

fn try_block(config: &SimConfig, x: u8, y: u8) -> Result<Vec<(Ipv4Addr, TcpListener)>, BlockError> {
    let mut out = Vec::with_capacity(config.nodes.len());
    let mut host = 0u8;
    for node in &config.nodes {
        let (address, explicit) = match node.address {
            Some(a) => (a, true),
            None => {
                host += 1;
                (Ipv4Addr::new(127, x, y, host), false)
            }
        };
        match bind_listener(SocketAddrV4::new(address, config.port)) {
            Ok(listener) => out.push((address, listener)),
            Err(e) if explicit => {
                return Err(BlockError::Fatal(ConfigError::Invalid(format!(
                    "node {}: cannot listen on {address}:{}: {e}",
                    node.name, config.port
                ))));
            }
            // Dropping `out` releases the addresses bound so far in this block.
            Err(_) => return Err(BlockError::Taken),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_jitter_every_step_takes_exactly_its_time() {
        let timings = Timings::fast();
        for _ in 0..20 {
            assert_eq!(timings.reboot(), Duration::from_millis(150));
            assert_eq!(timings.pull(), Duration::from_millis(30));
        }
    }

    #[test]
    fn jitter_spreads_a_step_within_its_bounds() {
        let timings = Timings::like_the_guide();
        let drawn: HashSet<Duration> = (0..200).map(|_| timings.reboot()).collect();
        for reboot in &drawn {
            assert!(
                (Duration::from_secs(24)..=Duration::from_secs(36)).contains(reboot),
                "30 s ± 20 %, drew {reboot:?}"
            );
        }
        assert!(drawn.len() > 100, "200 draws, {} distinct", drawn.len());
    }

    #[test]
    fn yaml_round_trip_with_defaults() {
        let yaml = r#"
cluster_name: demo
nodes:
  - name: cp-1
    role: controlplane
    talos_version: "1.11.6"
    kubernetes_version: "1.34.1"
  - name: w-1
    role: worker
    address: 127.0.0.9
    talos_version: v1.11.6
    kubernetes_version: 1.34.1
timings:
  reboot_ms: 10
"#;
        let config = SimConfig::from_yaml(yaml).unwrap();
        assert_eq!(config.port, 50000);
        assert_eq!(config.timings.reboot_ms, 10);
        assert_eq!(config.timings.boot_ms, Timings::default().boot_ms);
        assert_eq!(config.nodes[1].address, Some(Ipv4Addr::new(127, 0, 0, 9)));
        assert_eq!(
            config.nodes[0].installer_image_or_default(),
            "ghcr.io/siderolabs/installer:v1.11.6"
        );
    }

    #[test]
    fn unknown_fields_are_rejected_by_name() {
        let yaml = "cluster_name: demo\nnodes: []\nreboot_secs: 3\n";
        let err = SimConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("unknown field `reboot_secs`"), "{err}");
        let yaml = "cluster_name: demo\nnodes:\n  - name: a\n    role: controlplane\n    talos_version: 1.11.6\n    kubernetes_version: 1.34.1\n    colour: red\n";
        let err = SimConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains("unknown field `colour`"), "{err}");
    }

    #[test]
    fn validation_catches_duplicates_and_bad_versions() {
        let config = SimConfig::uniform("c", 1, 0, "1.11.6", "1.34.1")
            .with_node(NodeConfig::worker("cp-1", "1.11.6", "1.34.1"));
        assert!(config.validate().unwrap_err().to_string().contains("twice"));
        let config = SimConfig::uniform("c", 1, 0, "eleven", "1.34.1");
        assert!(config.validate().is_err());
        let config = SimConfig::uniform("c", 0, 1, "1.11.6", "1.34.1");
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("controlplane")
        );
    }

    #[test]
    fn talos_1_14_knobs_default_and_are_checked() {
        let yaml = "cluster_name: demo\nnodes:\n  - name: a\n    role: controlplane\n    talos_version: 1.14.1\n    kubernetes_version: 1.37.0\n    platform: aws\n    kubernetes_documents: true\n";
        let config = SimConfig::from_yaml(yaml).unwrap();
        assert_eq!(config.nodes[0].platform_or_default(), "aws");
        assert!(config.nodes[0].kubernetes_documents);
        // Created on 1.14: talosctl's default installer is the factory's metal one, empty schematic.
        assert_eq!(
            config.nodes[0].installer_image_or_default(),
            "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.14.1"
        );
        let plain = NodeConfig::worker("w", "1.13.0", "1.36.0");
        assert_eq!(plain.platform_or_default(), "metal");
        assert!(!plain.kubernetes_documents);

        let config = SimConfig::uniform("c", 1, 0, "1.14.1", "1.37.0")
            .with_node(NodeConfig::worker("w", "1.14.1", "1.37.0").with_platform("mars"));
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("\"mars\" is not a Talos platform"), "{err}");
        let config = SimConfig::uniform("c", 1, 0, "1.13.5", "1.36.0")
            .with_node(NodeConfig::worker("w", "1.13.5", "1.36.0").created_on_1_14());
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("kubernetes_documents needs Talos 1.14"),
            "{err}"
        );
    }

    #[test]
    fn a_process_holding_many_blocks_does_not_crowd_out_another() {
        // One process (the benchmark) holding 300 blocks; every other process still finds a free
        // block within its first few attempts.
        let taken: std::collections::HashSet<(u8, u8)> =
            (0..300).map(|counter| block_for(4242, counter)).collect();
        for pid in 1..2000 {
            let free = (0..MAX_BLOCK_ATTEMPTS)
                .position(|counter| !taken.contains(&block_for(pid, counter)))
                .expect("a free block");
            assert!(free < 4, "pid {pid} met {free} taken blocks in a row");
        }
    }

    #[test]
    fn blocks_avoid_127_0() {
        for pid in [1, 2, 1000, 65535, 4_000_000] {
            for counter in 0..50 {
                let (x, _) = block_for(pid, counter);
                assert!((1..=254).contains(&x));
            }
        }
    }
}
