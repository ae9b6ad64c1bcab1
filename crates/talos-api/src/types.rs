//! Typed results of the Talos calls, converted from the generated protobuf messages so callers do not
//! deal with envelopes, `Option` sub-messages or raw enum integers.

use std::fmt;

use crate::proto::machine;

/// How a machine config is applied (`ApplyConfigurationRequest.Mode`): `Reboot`, `Auto`, `NoReboot`,
/// `Staged`, `Try`.
pub type ApplyMode = machine::apply_configuration_request::Mode;
/// How `Reboot` reboots: `Default` (kexec where possible), `Powercycle`, `Force` (Talos 1.12+).
pub type RebootMode = machine::reboot_request::Mode;
/// How the legacy `Upgrade` reboots into the new version: `Default` (kexec) or `Powercycle`.
pub type UpgradeRebootMode = machine::upgrade_request::RebootMode;
/// containerd namespace for the legacy `ImagePull`: `NsSystem` (installer, kubelet) or `NsCri` (pods).
pub type ContainerdNamespace = crate::proto::common::ContainerdNamespace;
/// Role of a machine (`MachineTypes.config.talos.dev`): `Init`, `ControlPlane`, `Worker`.
pub type MachineType = crate::proto::resource::config::MachineType;

/// Talos version and platform of a node (`MachineService.Version`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VersionInfo {
    /// Talos tag, for example `v1.10.3`.
    pub tag: String,
    pub sha: String,
    pub built: String,
    pub go_version: String,
    pub os: String,
    /// `amd64` or `arm64`.
    pub arch: String,
    /// Platform name, for example `metal` or `aws`.
    pub platform: String,
    /// Platform mode: `metal`, `cloud` or `container`.
    pub platform_mode: String,
    /// True once a machine config is loaded.
    pub rbac: bool,
}

impl From<machine::Version> for VersionInfo {
    fn from(v: machine::Version) -> Self {
        let info = v.version.unwrap_or_default();
        let platform = v.platform.unwrap_or_default();
        VersionInfo {
            tag: info.tag,
            sha: info.sha,
            built: info.built,
            go_version: info.go_version,
            os: info.os,
            arch: info.arch,
            platform: platform.name,
            platform_mode: platform.mode,
            rbac: v.features.is_some_and(|f| f.rbac),
        }
    }
}

/// One Talos service (`MachineService.ServiceList`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ServiceInfo {
    /// `apid`, `etcd`, `kubelet`, `machined`, `trustd`, `containerd`, `cri`, `udevd`, ...
    pub id: String,
    /// `Initialized`, `Starting`, `Preparing`, `Waiting`, `Running`, `Stopping`, `Finished`, `Failed`,
    /// `Skipped` or `Unknown`.
    pub state: String,
    pub healthy: bool,
    /// The service has no health check (or it has not run yet).
    pub health_unknown: bool,
    pub health_message: String,
}

impl ServiceInfo {
    /// Running, and healthy or without health check: what Talos's own readiness check requires.
    pub fn is_running_and_healthy(&self) -> bool {
        self.state == "Running" && (self.healthy || self.health_unknown)
    }
}

impl From<machine::ServiceInfo> for ServiceInfo {
    fn from(s: machine::ServiceInfo) -> Self {
        let health = s.health.unwrap_or_default();
        ServiceInfo {
            id: s.id,
            state: s.state,
            healthy: health.healthy,
            health_unknown: health.unknown,
            health_message: health.last_message,
        }
    }
}

/// Status of the node's etcd member (`MachineService.EtcdStatus`, control-plane nodes only).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EtcdMemberStatus {
    pub member_id: u64,
    /// Member id of the current leader.
    pub leader: u64,
    /// etcd server version, for example `3.5.16`.
    pub protocol_version: String,
    /// Storage version (Talos 1.11+; empty before).
    pub storage_version: String,
    pub db_size: i64,
    pub db_size_in_use: i64,
    pub raft_index: u64,
    pub raft_term: u64,
    pub raft_applied_index: u64,
    pub is_learner: bool,
    /// Alarms and errors the member reports; empty when healthy.
    pub errors: Vec<String>,
}

impl EtcdMemberStatus {
    /// This member is the etcd leader.
    pub fn is_leader(&self) -> bool {
        self.member_id != 0 && self.leader == self.member_id
    }
}

impl From<machine::EtcdMemberStatus> for EtcdMemberStatus {
    fn from(s: machine::EtcdMemberStatus) -> Self {
        EtcdMemberStatus {
            member_id: s.member_id,
            leader: s.leader,
            protocol_version: s.protocol_version,
            storage_version: s.storage_version,
            db_size: s.db_size,
            db_size_in_use: s.db_size_in_use,
            raft_index: s.raft_index,
            raft_term: s.raft_term,
            raft_applied_index: s.raft_applied_index,
            is_learner: s.is_learner,
            errors: s.errors,
        }
    }
}

/// One etcd cluster member (`MachineService.EtcdMemberList`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EtcdMember {
    pub id: u64,
    /// Member name; empty for a member that was added but has not started.
    pub hostname: String,
    pub peer_urls: Vec<String>,
    pub client_urls: Vec<String>,
    pub is_learner: bool,
}

impl EtcdMember {
    /// The id as Talos writes it in resources (`EtcdMembers.etcd.talos.dev`): 16 lowercase hex digits.
    pub fn id_hex(&self) -> String {
        format!("{:016x}", self.id)
    }
}

impl From<machine::EtcdMember> for EtcdMember {
    fn from(m: machine::EtcdMember) -> Self {
        EtcdMember {
            id: m.id,
            hostname: m.hostname,
            peer_urls: m.peer_urls,
            client_urls: m.client_urls,
            is_learner: m.is_learner,
        }
    }
}

/// Options of the legacy `MachineService.Upgrade`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LegacyUpgradeOptions {
    /// Keep the ephemeral partition. Always effectively true since Talos 1.8; send true for 1.7.
    pub preserve: bool,
    /// Stage the upgrade and apply it early in the next boot (reboots twice).
    pub stage: bool,
    /// Skip the etcd health checks on control-plane nodes.
    pub force: bool,
    pub reboot_mode: UpgradeRebootMode,
}

/// Result of `MachineService.ApplyConfiguration`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// The mode the node actually used (`Auto` resolves to `NoReboot` or `Reboot`).
    pub mode: ApplyMode,
    pub warnings: Vec<String>,
    /// Human-readable explanation.
    pub mode_details: String,
}

/// Result of `LifecycleService.Upgrade` (Talos 1.13+) when the installer exited 0. A non-zero exit is
/// returned as [`TalosError::UpgradeFailed`](super::TalosError::UpgradeFailed) instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleUpgradeOutcome {
    pub exit_code: i32,
    /// The installer's progress lines, in order.
    pub messages: Vec<String>,
}

/// A machine config as stored on the node (all YAML documents, byte-exact).
///
/// Machine configs hold cluster secrets (CA keys, tokens), so `Debug` prints only the size.
#[derive(Clone, PartialEq, Eq)]
pub struct MachineConfigBytes(Vec<u8>);

impl MachineConfigBytes {
    pub fn new(bytes: Vec<u8>) -> Self {
        MachineConfigBytes(bytes)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for MachineConfigBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MachineConfigBytes(<{} bytes redacted>)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions() {
        let v = VersionInfo::from(machine::Version {
            metadata: None,
            version: Some(machine::VersionInfo {
                tag: "v1.10.3".into(),
                arch: "amd64".into(),
                ..Default::default()
            }),
            platform: Some(machine::PlatformInfo {
                name: "metal".into(),
                mode: "metal".into(),
            }),
            features: Some(machine::FeaturesInfo { rbac: true }),
        });
        assert_eq!(
            (v.tag.as_str(), v.arch.as_str(), v.platform.as_str(), v.rbac),
            ("v1.10.3", "amd64", "metal", true)
        );

        let s = EtcdMemberStatus {
            member_id: 5,
            leader: 5,
            ..Default::default()
        };
        assert!(s.is_leader());
        assert!(!EtcdMemberStatus::default().is_leader());
        assert_eq!(
            EtcdMember {
                id: 0xab,
                ..Default::default()
            }
            .id_hex(),
            "00000000000000ab"
        );

        let svc = ServiceInfo {
            state: "Running".into(),
            health_unknown: true,
            ..Default::default()
        };
        assert!(svc.is_running_and_healthy());
    }

    #[test]
    fn machine_config_debug_is_redacted() {
        let cfg = MachineConfigBytes::new(b"machine:\n  token: supersecret\n".to_vec());
        let debug = format!("{cfg:?}");
        assert!(
            !debug.contains("supersecret") && debug.contains("redacted"),
            "{debug}"
        );
    }
}
