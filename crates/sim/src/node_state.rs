//! The state of one simulated node as machined holds it: A/B slots, machine stage, services, running
//! components, the active config and the sequencer lock.
//!
//! Plain data: `node.rs` keeps it behind a mutex and publishes snapshots from it, `node_resources.rs`
//! derives the COSI resources from it, and the sequences and services change it through
//! `Node::update`. It sits below them so that deriving resources does not need the `Node` that
//! publishes them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use semver::Version;
use serde::Serialize;
use uuid::Uuid;

use super::machine_config::ParsedConfig;
use talos_api::proto::machine;
use talos_api::proto::talos::resource::definitions::enums::RuntimeMachineStage;

/// Machine stage, as in `MachineStatusEvent.MachineStage` and the `MachineStatus` resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MachineStage {
    Unknown,
    Booting,
    Installing,
    Maintenance,
    Running,
    Rebooting,
    ShuttingDown,
    Resetting,
    Upgrading,
}

impl MachineStage {
    pub(crate) fn to_event(self) -> machine::machine_status_event::MachineStage {
        use machine::machine_status_event::MachineStage as E;
        match self {
            MachineStage::Unknown => E::Unknown,
            MachineStage::Booting => E::Booting,
            MachineStage::Installing => E::Installing,
            MachineStage::Maintenance => E::Maintenance,
            MachineStage::Running => E::Running,
            MachineStage::Rebooting => E::Rebooting,
            MachineStage::ShuttingDown => E::ShuttingDown,
            MachineStage::Resetting => E::Resetting,
            MachineStage::Upgrading => E::Upgrading,
        }
    }

    pub(crate) fn to_resource(self) -> RuntimeMachineStage {
        use RuntimeMachineStage as R;
        match self {
            MachineStage::Unknown => R::MachineStageUnknown,
            MachineStage::Booting => R::MachineStageBooting,
            MachineStage::Installing => R::MachineStageInstalling,
            MachineStage::Maintenance => R::MachineStageMaintenance,
            MachineStage::Running => R::MachineStageRunning,
            MachineStage::Rebooting => R::MachineStageRebooting,
            MachineStage::ShuttingDown => R::MachineStageShuttingDown,
            MachineStage::Resetting => R::MachineStageResetting,
            MachineStage::Upgrading => R::MachineStageUpgrading,
        }
    }

    /// The resource's YAML spelling (`shutting down` has a space).
    pub(crate) fn yaml_name(self) -> &'static str {
        match self {
            MachineStage::Unknown => "unknown",
            MachineStage::Booting => "booting",
            MachineStage::Installing => "installing",
            MachineStage::Maintenance => "maintenance",
            MachineStage::Running => "running",
            MachineStage::Rebooting => "rebooting",
            MachineStage::ShuttingDown => "shutting down",
            MachineStage::Resetting => "resetting",
            MachineStage::Upgrading => "upgrading",
        }
    }

    /// machined cordons the Kubernetes node in these stages (and uncordons after boot if it did).
    pub fn cordons(self) -> bool {
        matches!(
            self,
            MachineStage::Upgrading | MachineStage::ShuttingDown | MachineStage::Resetting
        )
    }
}

/// An unmet readiness condition (`MachineStatus.status.unmetConditions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UnmetCondition {
    pub name: String,
    pub reason: String,
}

impl UnmetCondition {
    pub(crate) fn new(name: &str, reason: &str) -> Self {
        UnmetCondition {
            name: name.to_string(),
            reason: reason.to_string(),
        }
    }
}

/// An installed A/B slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Slot {
    pub version: Version,
    pub installer_image: String,
}

/// A Talos service as ServiceList and the `Services` resource show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceStatus {
    pub state: &'static str,
    pub healthy: bool,
    pub since: SystemTime,
}

/// A running component instance (kubelet or a static pod).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RunningComponent {
    pub image: String,
    pub config_version: u64,
    pub running: bool,
}

/// Everything machined knows about one node, cloned for each publish.
#[derive(Debug, Clone)]
pub(crate) struct NodeState {
    pub current: Slot,
    pub previous: Option<Slot>,
    pub next_boot: Option<Slot>,
    pub boot_id: Uuid,
    pub stage: MachineStage,
    pub ready: bool,
    pub unmet: Vec<UnmetCondition>,
    /// machined's own cordon (see `NodeSnapshot::cordoned`).
    pub cordoned: bool,
    pub down: bool,
    pub services: BTreeMap<String, ServiceStatus>,
    /// Active machine config, byte-exact as applied.
    pub config: Vec<u8>,
    pub parsed: ParsedConfig,
    /// Config persisted for the next boot (STAGED mode).
    pub staged_config: Option<Vec<u8>>,
    pub kubelet: RunningComponent,
    pub apiserver: RunningComponent,
    pub controller_manager: RunningComponent,
    pub scheduler: RunningComponent,
    /// Name of the running sequence (machined's sequencer lock).
    pub sequence: Option<&'static str>,
    /// A LifecycleService.Upgrade is running.
    pub installing: bool,
    pub pulled_images: BTreeSet<String>,
}
