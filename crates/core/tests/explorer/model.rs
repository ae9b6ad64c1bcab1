//! The world the explorer's controller runs against: nodes with a Talos API and a Kubernetes side, in
//! virtual time, with every behaviour a schedule can give them. It answers the lifecycle's looks and
//! calls as the controller's shell would (`src/talos_upgrade.rs`, `src/kubernetes_upgrade/io.rs`), and
//! checks, at the moment a call reaches a node, the promises a call can break.

use std::collections::BTreeMap;

use jiff::Timestamp;
use semver::Version;
use talos_upgrade_core::kubernetes::{
    self, Component, ConfigVersions, ConfiguredImages, ImageField, KubeRun, StaticPod, TalosApi,
};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::talos::{
    self, DrainStatus, EtcdObservation, NodeStep, Run, TalosState, UpgradeApi,
};
use talos_upgrade_core::versions::{KubernetesVersion, TalosVersion};

/// How long a node takes to reboot, normally and when slow.
pub const REBOOT_SECS: u64 = 30;
pub const SLOW_REBOOT_SECS: u64 = 600;
/// How long a patched static pod or kubelet takes to run the new image.
pub const RESTART_SECS: u64 = 10;

/// What a node does when it is called; set and cleared by the schedule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Behaviour {
    /// Reboots take ten minutes instead of thirty seconds.
    pub slow: bool,
    /// Goes down and never comes back (until healed).
    pub never_returns: bool,
    /// Comes back on the version it ran (A/B fallback).
    pub falls_back: bool,
    /// Refuses changing calls for good.
    pub refuses: bool,
    /// Changing calls answer `Unavailable`; some of them reach the node anyway (the answer is lost).
    pub unavailable: bool,
    /// The installer fails (Talos ≥ 1.13 install).
    pub install_fails: bool,
    /// The pull and the install fail in a way worth retrying; nothing is installed.
    pub install_flaky: bool,
    /// A PodDisruptionBudget refuses every eviction.
    pub drain_blocked: bool,
}

#[derive(Debug, Clone)]
pub struct ModelPod {
    pub component: Component,
    pub image: String,
    pub config_version: u32,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub role: NodeRole,
    pub talos: Version,
    pub boot: u32,
    pub up: bool,
    /// When a node that is down comes back (`None`: never).
    pub back_at: Option<u64>,
    pub ready: bool,
    pub cordoned: bool,
    /// The run (requested, started) whose drain cordoned it (it was schedulable before).
    pub cordoned_by: Option<(String, String)>,
    pub pods: usize,
    /// A new system installed and not booted yet.
    pub staged: Option<Version>,
    pub behaviour: Behaviour,
    /// In the cluster's inventory (a removed node is gone from it).
    pub present: bool,
    pub kubelet: KubernetesVersion,
    pub images: ConfiguredImages,
    pub config_versions: [u32; 3],
    pub static_pods: Vec<ModelPod>,
    /// Image changes taking effect later: (when, component or kubelet, image, config version).
    pub restarts: Vec<(u64, Option<Component>, String, u32)>,
}

impl Node {
    pub fn new(name: &str, role: NodeRole, talos: &Version, kube: &KubernetesVersion) -> Node {
        let control_plane = role == NodeRole::ControlPlane;
        let image = |field: ImageField| format!("{}:{}", field.default_repository(), kube.tag());
        let cp_image = |field: ImageField| control_plane.then(|| image(field));
        Node {
            name: name.to_string(),
            role,
            talos: talos.clone(),
            boot: 1,
            up: true,
            back_at: None,
            ready: true,
            cordoned: false,
            cordoned_by: None,
            pods: 2,
            staged: None,
            behaviour: Behaviour::default(),
            present: true,
            kubelet: kube.clone(),
            images: ConfiguredImages {
                api_server: cp_image(ImageField::ApiServer),
                controller_manager: cp_image(ImageField::ControllerManager),
                scheduler: cp_image(ImageField::Scheduler),
                proxy: cp_image(ImageField::Proxy),
                kubelet: Some(image(ImageField::Kubelet)),
            },
            config_versions: [1, 1, 1],
            static_pods: if control_plane {
                Component::ALL
                    .iter()
                    .map(|component| ModelPod {
                        component: *component,
                        image: image(component.image_field()),
                        config_version: 1,
                    })
                    .collect()
            } else {
                Vec::new()
            },
            restarts: Vec::new(),
        }
    }

    pub fn healthy(&self) -> bool {
        self.present && self.up && self.ready
    }

    fn boot_id(&self) -> String {
        format!("{}-boot-{}", self.name, self.boot)
    }

    fn go_down(&mut self, now: u64) {
        self.up = false;
        self.ready = false;
        let after = if self.behaviour.slow {
            SLOW_REBOOT_SECS
        } else {
            REBOOT_SECS
        };
        self.back_at = (!self.behaviour.never_returns).then_some(now + after);
    }
}

/// The controller's progress record, as the ConfigMap keeps it.
#[derive(Debug, Clone, Default)]
pub struct Store {
    pub talos: Option<Run>,
    pub kubernetes: Option<KubeRun>,
    /// A phase the controller did not write, to give back when its run ends.
    pub phase_kept: Option<String>,
}

/// A call that reached a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reached {
    pub at: u64,
    pub node: String,
    pub call: String,
}

/// Everything the explorer keeps of one schedule's world.
pub struct World {
    pub now: u64,
    pub nodes: Vec<Node>,
    pub leader: Option<String>,
    pub annotations: BTreeMap<String, String>,
    pub phase: Option<String>,
    /// The phase the provisioning operator wrote last, if it did.
    pub foreign_phase: Option<String>,
    /// Events as (reason, message).
    pub events: Vec<(String, String)>,
    pub store: Store,
    pub reached: Vec<Reached>,
    /// The next save of the progress record fails with a conflict.
    pub conflict_next_save: bool,
    /// The controller dies during its next calls, after this many.
    pub crash_after_calls: Option<usize>,
    /// Broken promises, as sentences.
    pub violations: Vec<String>,
    /// Per Talos run (requested, started) and node: disruptive calls (legacy upgrade, reboot into a
    /// new system) that reached it since the user last said `resume`.
    pub disruptive: BTreeMap<(String, String, String), u32>,
    coin: u64,
}

pub fn t0() -> Timestamp {
    "2026-11-27T00:00:00Z".parse().expect("timestamp")
}

impl World {
    pub fn new(nodes: Vec<Node>, coin: u64) -> World {
        let leader = nodes
            .iter()
            .find(|n| n.role == NodeRole::ControlPlane)
            .map(|n| n.name.clone());
        World {
            now: 0,
            nodes,
            leader,
            annotations: BTreeMap::new(),
            phase: None,
            foreign_phase: None,
            events: Vec::new(),
            store: Store::default(),
            reached: Vec::new(),
            conflict_next_save: false,
            crash_after_calls: None,
            violations: Vec::new(),
            disruptive: BTreeMap::new(),
            coin,
        }
    }

    pub fn timestamp(&self) -> Timestamp {
        t0() + jiff::SignedDuration::from_secs(self.now as i64)
    }

    /// A fair coin, from the schedule's seed: whether an `Unavailable` call reached the node anyway.
    fn flip(&mut self) -> bool {
        self.coin = self.coin.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.coin;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) & 1 == 1
    }

    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name)
    }

    fn node_mut(&mut self, name: &str) -> Option<&mut Node> {
        self.nodes.iter_mut().find(|n| n.name == name)
    }

    /// Lets virtual time pass: nodes come back, static pods and kubelets restart.
    pub fn advance(&mut self, secs: u64) {
        self.now += secs;
        let now = self.now;
        for node in &mut self.nodes {
            if !node.up && node.back_at.is_some_and(|at| at <= now) {
                node.up = true;
                node.ready = true;
                node.boot += 1;
                node.back_at = None;
                if let Some(staged) = node.staged.take()
                    && !node.behaviour.falls_back
                {
                    node.talos = staged;
                }
            }
            let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut node.restarts)
                .into_iter()
                .partition(|(at, ..)| *at <= now);
            node.restarts = later;
            for (_, component, image, config_version) in due {
                match component {
                    Some(component) => {
                        if let Some(pod) = node
                            .static_pods
                            .iter_mut()
                            .find(|p| p.component == component)
                        {
                            pod.image = image;
                            pod.config_version = config_version;
                        }
                    }
                    None => {
                        if let Some(tag) = kubernetes::image_tag(&image)
                            && let Ok(version) = KubernetesVersion::parse(tag)
                        {
                            node.kubelet = version;
                        }
                    }
                }
            }
        }
        self.move_leader_off_down_nodes();
    }

    fn move_leader_off_down_nodes(&mut self) {
        let leader_up = self
            .leader
            .as_deref()
            .and_then(|name| self.node(name))
            .is_some_and(Node::healthy);
        if !leader_up {
            self.leader = self
                .nodes
                .iter()
                .find(|n| n.role == NodeRole::ControlPlane && n.healthy())
                .map(|n| n.name.clone());
        }
    }

    fn present(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.present)
    }

    // ----- Talos looks -----

    pub fn talos_versions(&self) -> talos::TalosVersions {
        let up: Vec<&Version> = self.present().filter(|n| n.up).map(|n| &n.talos).collect();
        let kubelets: Vec<&KubernetesVersion> = self.present().map(|n| &n.kubelet).collect();
        talos::TalosVersions::of(up, kubelets)
    }

    pub fn talos_observation(&self, reading: &[String]) -> talos::Observation {
        let nodes = self
            .present()
            .map(|n| talos::NodeObservation {
                name: n.name.clone(),
                role: n.role,
                talos: if n.up {
                    TalosState::Up {
                        version: n.talos.clone(),
                        boot_id: n.boot_id(),
                        ready: n.ready,
                        install: reading.contains(&n.name).then(|| install_source(&n.talos)),
                    }
                } else {
                    TalosState::Unreachable {
                        reason: "connection refused".into(),
                    }
                },
                kubernetes_ready: n.up && n.ready,
                cordoned: n.cordoned,
                drain: None,
                kubelet_version: Some(n.kubelet.clone()),
            })
            .collect();
        talos::Observation {
            nodes,
            etcd: self.etcd(),
            gates: Default::default(),
            scope: Default::default(),
        }
    }

    /// etcd as `src/talos_fleet.rs` sees it: every member healthy, and quorum kept with one more
    /// down; a single member has no one to hand leadership to, so it has no leader to move.
    pub fn etcd(&self) -> EtcdObservation {
        let members: Vec<&Node> = self
            .present()
            .filter(|n| n.role == NodeRole::ControlPlane)
            .collect();
        let problem = members
            .iter()
            .find(|n| !n.healthy())
            .map(|n| format!("control plane {} does not answer for etcd", n.name))
            .or_else(|| {
                (members.len() == 2).then(|| {
                    "2 of 2 etcd members are healthy; taking one down would lose quorum (needs 2)"
                        .to_string()
                })
            });
        EtcdObservation {
            problem,
            leader: self.leader.clone().filter(|_| members.len() > 1),
        }
    }

    pub fn installer_images(
        &self,
        names: &[String],
    ) -> Vec<(String, Result<talos::InstallSource, String>)> {
        self.present()
            .filter(|n| names.contains(&n.name))
            .map(|n| {
                let read = if n.up {
                    Ok(install_source(&n.talos))
                } else {
                    Err("connection refused".to_string())
                };
                (n.name.clone(), read)
            })
            .collect()
    }

    /// The drain pass: cordon, evict, say what is left.
    pub fn drain(&mut self, names: &[String]) -> Vec<(String, Option<DrainStatus>)> {
        let mut drained = Vec::new();
        let run = self
            .store
            .talos
            .as_ref()
            .map(|run| (run.requested.clone(), run.started_at.to_string()));
        for name in names {
            let Some(node) = self.node_mut(name).filter(|n| n.present) else {
                drained.push((name.clone(), None));
                continue;
            };
            if !node.cordoned {
                node.cordoned = true;
                node.cordoned_by = run.clone();
            }
            let status = if node.behaviour.drain_blocked && node.pods > 0 {
                DrainStatus {
                    remaining: node.pods,
                    blocked: Some(format!(
                        "eviction of pod shop/web-{name} refused: Cannot evict pod as it would \
                         violate the pod's disruption budget"
                    )),
                }
            } else {
                node.pods = 0;
                DrainStatus::default()
            };
            drained.push((name.clone(), Some(status)));
        }
        drained
    }

    // ----- Talos calls -----

    pub fn talos_call(&mut self, action: &talos::Action) -> talos_upgrade_core::lifecycle::Called {
        use talos_upgrade_core::lifecycle::Called;
        let name = action.node().to_string();
        if let talos::Action::Uncordon { .. } = action {
            if let Some(node) = self.node_mut(&name) {
                node.cordoned = false;
                node.cordoned_by = None;
                node.pods = 2;
            }
            return Called::Done;
        }
        let Some(node) = self.node(&name).filter(|n| n.present).cloned() else {
            return Called::Refused("is no longer in the node inventory".into());
        };
        if let talos::Action::ForfeitEtcdLeadership { .. } = action {
            if node.healthy() {
                self.leader = self
                    .nodes
                    .iter()
                    .find(|n| n.role == NodeRole::ControlPlane && n.healthy() && n.name != name)
                    .map(|n| n.name.clone())
                    .or(self.leader.clone());
            }
            return Called::Done;
        }
        if !node.up {
            return Called::NotReached("connection refused".into());
        }
        if let talos::Action::PrePull { .. } = action {
            return self.pre_pull(action, &node);
        }
        let what = match action {
            talos::Action::PrePull { .. } => unreachable!("handled above"),
            talos::Action::Pull { .. } => "the installation",
            talos::Action::Upgrade {
                api: UpgradeApi::Legacy,
                ..
            } => "the upgrade",
            talos::Action::Upgrade { .. } => "the installation",
            talos::Action::Reboot { .. } => "the reboot",
            _ => unreachable!("handled above"),
        };
        if node.behaviour.refuses {
            return Called::Refused(format!("refused {what}: permission denied"));
        }
        let lost = node.behaviour.unavailable;
        if lost && !self.flip() {
            return Called::NotReached("rpc error: code = Unavailable".into());
        }
        if matches!(
            action,
            talos::Action::Pull { .. }
                | talos::Action::Upgrade {
                    api: UpgradeApi::Lifecycle,
                    ..
                }
        ) && node.behaviour.install_flaky
        {
            return Called::Retry("the installer exited with code 5 (a dependency failed)".into());
        }
        if let talos::Action::Pull { .. } = action {
            // A pull changes nothing the node boots; a lost answer is a pull not reached.
            self.reach(action, &node);
            return if lost {
                Called::NotReached("rpc error: code = Unavailable".into())
            } else {
                Called::Done
            };
        }
        if let talos::Action::Upgrade {
            api: UpgradeApi::Lifecycle,
            ..
        } = action
            && node.behaviour.install_fails
        {
            return Called::Refused("refused the installation: installer exited with 1".into());
        }
        self.reach(action, &node);
        if lost {
            Called::Unanswered("rpc error: code = Unavailable (the answer was lost)".into())
        } else {
            Called::Done
        }
    }

    /// A pre-pull on `node`: recorded in the saved run before it is made (write-ahead); it changes
    /// nothing the node boots. A node whose calls are lost misses some; one that refuses calls refuses
    /// it (the run fails before any node is disrupted).
    fn pre_pull(
        &mut self,
        action: &talos::Action,
        node: &Node,
    ) -> talos_upgrade_core::lifecycle::Called {
        use talos_upgrade_core::lifecycle::Called;
        let name = node.name.clone();
        let recorded = self
            .store
            .talos
            .as_ref()
            .and_then(|run| run.gates.prepull.node(&name))
            .is_some();
        if !recorded {
            self.violations.push(format!(
                "write-ahead: {action:?} reached {name} before the saved run recorded the pull"
            ));
        }
        if node.behaviour.refuses {
            return Called::Refused("rpc error: code = NotFound desc = error pulling image".into());
        }
        if node.behaviour.unavailable && !self.flip() {
            return Called::Retry("rpc error: code = Unavailable".into());
        }
        Called::Done
    }

    /// A changing Talos call reaches `node`: the promises are checked, then it takes effect.
    fn reach(&mut self, action: &talos::Action, node: &Node) {
        let name = node.name.clone();
        let now = self.now;
        self.reached.push(Reached {
            at: now,
            node: name.clone(),
            call: format!("{action:?}"),
        });
        // Write-ahead: the saved run records the call before it is made.
        let saved = self
            .store
            .talos
            .as_ref()
            .and_then(|run| run.node(&name))
            .map(|n| n.step.clone());
        if !matches!(saved, Some(NodeStep::Issued { .. })) {
            self.violations.push(format!(
                "write-ahead: {action:?} reached {name} while the saved run records it as {saved:?}"
            ));
        }
        // An upgrade is the call that boots a new system: the legacy upgrade, or a reboot with one
        // installed (a reboot with none pending upgrades nothing).
        let disruptive = match action {
            talos::Action::Upgrade {
                api: UpgradeApi::Legacy,
                ..
            } => true,
            talos::Action::Reboot { .. } => node.staged.is_some(),
            _ => false,
        };
        // The pre-pull: nothing disrupts a node before the saved run records every pull done.
        if disruptive
            && let Some(run) = &self.store.talos
            && !run.gates.prepull.is_done()
        {
            self.violations.push(format!(
                "pre-pull: {action:?} disrupted {name} before the saved run's pre-pull was done"
            ));
        }
        if disruptive {
            let other_down: Option<String> = self
                .present()
                .find(|n| n.role == NodeRole::ControlPlane && n.name != name && !n.healthy())
                .map(|n| n.name.clone());
            if node.role == NodeRole::ControlPlane
                && let Some(other) = other_down
            {
                self.violations.push(format!(
                    "two control planes down: {action:?} took {name} down while {other} was down or not ready"
                ));
            }
            if let Some(run) = &self.store.talos {
                let key = (
                    run.requested.clone(),
                    run.started_at.to_string(),
                    name.clone(),
                );
                let count = self.disruptive.entry(key).or_default();
                *count += 1;
                if *count > 1 {
                    self.violations.push(format!(
                        "upgraded twice: {name} got a second disruptive call ({action:?}) in one run"
                    ));
                }
            }
        }
        let target = |image: &str| {
            image
                .rsplit_once(':')
                .and_then(|(_, tag)| Version::parse(tag.trim_start_matches('v')).ok())
        };
        let now = self.now;
        let Some(node) = self.node_mut(&name) else {
            return;
        };
        match action {
            // The model's runs upgrade only.
            talos::Action::Rollback { .. } => node.go_down(now),
            talos::Action::Upgrade {
                installer_image,
                api: UpgradeApi::Legacy,
                ..
            } => {
                node.staged = target(installer_image);
                node.go_down(now);
            }
            talos::Action::Upgrade {
                installer_image, ..
            } => {
                if let Some(pending) = &node.staged {
                    let pending = pending.clone();
                    self.violations.push(format!(
                        "second install: {name} was installed again while Talos {pending} waited \
                         for its reboot (the bootloader flips back onto the running slot)"
                    ));
                    return;
                }
                node.staged = target(installer_image);
            }
            talos::Action::Reboot { .. } => node.go_down(now),
            talos::Action::PrePull { .. }
            | talos::Action::Pull { .. }
            | talos::Action::ForfeitEtcdLeadership { .. }
            | talos::Action::Uncordon { .. }
            | talos::Action::EtcdSnapshot { .. } => {}
        }
        self.move_leader_off_down_nodes();
    }

    // ----- Kubernetes looks and calls -----

    pub fn kubernetes_observation(&self) -> kubernetes::Observation {
        let nodes = self
            .present()
            .map(|n| kubernetes::NodeObservation {
                name: n.name.clone(),
                role: n.role,
                talos: if n.up {
                    TalosApi::Up {
                        version: TalosVersion::from_semver(n.talos.clone()),
                        ready: n.ready,
                    }
                } else {
                    TalosApi::Unreachable {
                        reason: "connection refused".into(),
                    }
                },
                images: n.images.clone(),
                config_versions: ConfigVersions {
                    api_server: Some(n.config_versions[0].to_string()),
                    controller_manager: Some(n.config_versions[1].to_string()),
                    scheduler: Some(n.config_versions[2].to_string()),
                },
                static_pods: n
                    .static_pods
                    .iter()
                    .map(|pod| StaticPod {
                        component: pod.component,
                        image: pod.image.clone(),
                        config_version: Some(pod.config_version.to_string()),
                        ready: n.up && n.ready,
                    })
                    .collect(),
                kubelet_version: Some(n.kubelet.clone()),
                kubernetes_ready: n.up && n.ready,
            })
            .collect();
        kubernetes::Observation {
            nodes,
            etcd: Default::default(),
        }
    }

    pub fn kubernetes_call(
        &mut self,
        action: &kubernetes::Action,
    ) -> talos_upgrade_core::lifecycle::Called {
        use talos_upgrade_core::lifecycle::Called;
        let name = match action {
            kubernetes::Action::PullImages { node, .. }
            | kubernetes::Action::PatchImage { node, .. }
            | kubernetes::Action::SyncManifests { node }
            | kubernetes::Action::EtcdSnapshot { node } => node.clone(),
        };
        let Some(node) = self.node(&name).filter(|n| n.present).cloned() else {
            return Called::Refused(format!("node {name} is no longer in the node inventory"));
        };
        if !node.up {
            return Called::NotReached("connection refused".into());
        }
        if node.behaviour.refuses {
            return Called::Refused(format!("node {name} refused the call: permission denied"));
        }
        let lost = node.behaviour.unavailable;
        if lost && !self.flip() {
            return Called::NotReached("rpc error: code = Unavailable".into());
        }
        self.reached.push(Reached {
            at: self.now,
            node: name.clone(),
            call: format!("{action:?}"),
        });
        let in_flight = self
            .store
            .kubernetes
            .as_ref()
            .is_some_and(|run| run.step_in_flight().is_some());
        if !in_flight {
            self.violations.push(format!(
                "write-ahead: {action:?} reached {name} with no step in flight in the saved run"
            ));
        }
        let now = self.now;
        if let kubernetes::Action::PatchImage { field, image, .. } = action
            && let Some(node) = self.node_mut(&name)
        {
            set_image(&mut node.images, *field, image.clone());
            let component = Component::ALL
                .iter()
                .position(|c| c.image_field() == *field);
            match (component, field) {
                (Some(index), _) => {
                    node.config_versions[index] += 1;
                    let version = node.config_versions[index];
                    node.restarts.push((
                        now + RESTART_SECS,
                        Some(Component::ALL[index]),
                        image.clone(),
                        version,
                    ));
                }
                (None, ImageField::Kubelet) => {
                    node.restarts
                        .push((now + RESTART_SECS, None, image.clone(), 0));
                }
                (None, _) => {}
            }
        }
        if lost {
            Called::NotReached("rpc error: code = Unavailable (the answer was lost)".into())
        } else {
            Called::Done
        }
    }
}

/// How a model node was installed: the generic installer of its version, on bare metal.
pub fn install_source(version: &Version) -> talos::InstallSource {
    talos::InstallSource::new(installer_image(version), Some("metal"))
}

pub fn installer_image(version: &Version) -> String {
    format!("ghcr.io/siderolabs/installer:v{version}")
}

fn set_image(images: &mut ConfiguredImages, field: ImageField, image: String) {
    let slot = match field {
        ImageField::ApiServer => &mut images.api_server,
        ImageField::ControllerManager => &mut images.controller_manager,
        ImageField::Scheduler => &mut images.scheduler,
        ImageField::Proxy => &mut images.proxy,
        ImageField::Kubelet => &mut images.kubelet,
    };
    *slot = Some(image);
}
