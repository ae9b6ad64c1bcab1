//! Fault injection: per-node switches a test flips while the simulator runs, to reproduce the failure
//! modes a controller must survive (talos-api.md §8 "Failure modes to simulate").

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// A failure to inject into one node. Faults stay active until [`crate::Simulator::clear_faults`],
/// except `FailNextCalls`, which counts down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Fault {
    /// Pulling an installer image fails (legacy Upgrade RPC error, ImageService.Pull `NotFound`,
    /// LifecycleService.Upgrade exit code 5 from a 1.14 or later installer, 1 from an older one).
    InstallerPullFails,
    /// After the next power-off the node stays down (connection refused) until the fault is cleared.
    NeverReturns,
    /// The newly installed A/B slot fails to boot: the node comes back on its old version.
    BootsOldVersion,
    /// As [`Fault::BootsOldVersion`], but only a new system of this Talos version (`1.14.1` or
    /// `v1.14.1`) fails to boot; other versions boot. Lets a test fail one hop of a multi-hop plan
    /// without racing the run to the node.
    BootsOldVersionOf(String),
    /// This node's etcd member fails health checks (quorum reads), so CP upgrades are refused.
    EtcdUnhealthy,
    /// The next n API calls routed to this node answer `Unavailable`.
    FailNextCalls(u32),
    /// After boot, readiness comes this much later than `ready_ms` (unmet `nodeReady`).
    ReadyDelay(Duration),
    /// ApplyConfiguration is refused with `InvalidArgument`.
    ApplyConfigRejected,
    /// The next `Reboot` call is lost on its way to machined: apid answers `Unavailable` and the node
    /// keeps running (one call, then the fault is spent).
    RebootLost,
    /// `ImageService.Pull` and `LifecycleService.Upgrade` answer `Unavailable` every time (recorded with
    /// that result): the new system is never installed, while every other call is served. Stays until
    /// cleared.
    InstallUnavailable,
    /// The next `count` installer runs (LifecycleService.Upgrade) fail with exit code `code` and a line
    /// of output naming its category (machinery v1.14.1 `constants/constants.go`, "Installer/imager exit
    /// codes"); an installer image older than 1.14 exits 1 whatever `code` is. `count` 0: every run
    /// until the fault is cleared.
    InstallerExits { code: i32, count: u32 },
    /// `EtcdSnapshot` on this node fails: after a few chunks the stream ends with the error Talos
    /// answers when etcd's snapshot read fails (`failed reading etcd snapshot: …`). Stays until cleared.
    EtcdSnapshotFails,
    /// `EtcdSnapshot` on this node ends early without an error (a cut-off stream): what arrives lacks
    /// the end of the database and the SHA-256 etcd appends, which a client that verifies it notices.
    /// Stays until cleared.
    EtcdSnapshotTruncated,
    /// This node's apid does not fan calls out to several nodes (the `nodes` metadata): it answers
    /// `InvalidArgument`, as a Talos without one-to-many proxying would (deprecated in 1.14, marked
    /// for removal in 2.0), while still proxying one-to-one (`node`). Stays until cleared.
    NoOneToMany,
}

/// The `installer-exits` fault as it stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct InstallerExits {
    pub code: i32,
    /// Runs still to fail; `None`: until cleared.
    pub remaining: Option<u32>,
}

/// The faults active on a node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ActiveFaults {
    pub installer_pull_fails: bool,
    pub never_returns: bool,
    pub boots_old_version: bool,
    /// The version whose new system fails to boot ([`Fault::BootsOldVersionOf`]), without `v`.
    pub boots_old_version_of: Option<String>,
    pub etcd_unhealthy: bool,
    pub fail_next_calls: u32,
    pub ready_delay: Option<Duration>,
    pub apply_config_rejected: bool,
    pub reboot_lost: bool,
    pub install_unavailable: bool,
    pub installer_exits: Option<InstallerExits>,
    pub etcd_snapshot_fails: bool,
    pub etcd_snapshot_truncated: bool,
    pub no_one_to_many: bool,
}

/// A node's faults behind a watch channel, so waiting code (a node kept down, a delayed readiness)
/// wakes up as soon as a test clears a fault.
#[derive(Debug)]
pub(crate) struct FaultSet {
    tx: watch::Sender<ActiveFaults>,
}

impl FaultSet {
    pub(crate) fn new() -> Self {
        FaultSet {
            tx: watch::Sender::new(ActiveFaults::default()),
        }
    }

    pub(crate) fn inject(&self, fault: Fault) {
        self.tx.send_modify(|f| match fault {
            Fault::InstallerPullFails => f.installer_pull_fails = true,
            Fault::NeverReturns => f.never_returns = true,
            Fault::BootsOldVersion => f.boots_old_version = true,
            Fault::BootsOldVersionOf(version) => {
                f.boots_old_version_of = Some(version.trim_start_matches('v').to_string());
            }
            Fault::EtcdUnhealthy => f.etcd_unhealthy = true,
            Fault::FailNextCalls(n) => f.fail_next_calls = f.fail_next_calls.saturating_add(n),
            Fault::ReadyDelay(delay) => f.ready_delay = Some(delay),
            Fault::ApplyConfigRejected => f.apply_config_rejected = true,
            Fault::RebootLost => f.reboot_lost = true,
            Fault::InstallUnavailable => f.install_unavailable = true,
            Fault::InstallerExits { code, count } => {
                f.installer_exits = Some(InstallerExits {
                    code,
                    remaining: (count > 0).then_some(count),
                });
            }
            Fault::EtcdSnapshotFails => f.etcd_snapshot_fails = true,
            Fault::EtcdSnapshotTruncated => f.etcd_snapshot_truncated = true,
            Fault::NoOneToMany => f.no_one_to_many = true,
        });
    }

    pub(crate) fn clear(&self) {
        self.tx.send_replace(ActiveFaults::default());
    }

    pub(crate) fn current(&self) -> ActiveFaults {
        self.tx.borrow().clone()
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<ActiveFaults> {
        self.tx.subscribe()
    }

    /// Consume a lost reboot; true if this `Reboot` call must be lost.
    pub(crate) fn take_lost_reboot(&self) -> bool {
        self.tx
            .send_if_modified(|f| std::mem::replace(&mut f.reboot_lost, false))
    }

    /// Consume one injected installer failure: the exit code this installer run must end with.
    pub(crate) fn take_installer_exit(&self) -> Option<i32> {
        let mut code = None;
        self.tx.send_if_modified(|f| {
            let Some(exits) = &mut f.installer_exits else {
                return false;
            };
            code = Some(exits.code);
            match &mut exits.remaining {
                None => false,
                Some(1) => {
                    f.installer_exits = None;
                    true
                }
                Some(n) => {
                    *n -= 1;
                    true
                }
            }
        });
        code
    }

    /// Consume one injected call failure; true if this call must fail.
    pub(crate) fn take_call_failure(&self) -> bool {
        self.tx.send_if_modified(|f| {
            if f.fail_next_calls > 0 {
                f.fail_next_calls -= 1;
                true
            } else {
                false
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_next_calls_counts_down() {
        let faults = FaultSet::new();
        faults.inject(Fault::FailNextCalls(2));
        assert!(faults.take_call_failure());
        assert!(faults.take_call_failure());
        assert!(!faults.take_call_failure());
        faults.inject(Fault::EtcdUnhealthy);
        assert!(faults.current().etcd_unhealthy);
        faults.clear();
        assert_eq!(faults.current(), ActiveFaults::default());
    }

    #[test]
    fn installer_exits_count_down_or_stay() {
        let faults = FaultSet::new();
        assert_eq!(faults.take_installer_exit(), None);
        faults.inject(Fault::InstallerExits { code: 5, count: 2 });
        assert_eq!(faults.take_installer_exit(), Some(5));
        assert_eq!(
            faults.current().installer_exits.and_then(|e| e.remaining),
            Some(1)
        );
        assert_eq!(faults.take_installer_exit(), Some(5));
        assert_eq!(faults.take_installer_exit(), None);
        faults.inject(Fault::InstallerExits { code: 3, count: 0 });
        for _ in 0..3 {
            assert_eq!(faults.take_installer_exit(), Some(3));
        }
        faults.clear();
        assert_eq!(faults.take_installer_exit(), None);
    }

    #[test]
    fn a_lost_reboot_is_spent_by_one_reboot() {
        let faults = FaultSet::new();
        assert!(!faults.take_lost_reboot());
        faults.inject(Fault::RebootLost);
        assert!(faults.take_lost_reboot());
        assert!(!faults.take_lost_reboot());
    }
}
