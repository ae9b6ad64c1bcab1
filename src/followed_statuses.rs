//! The machine statuses the followers' watches report, standing in for a look's own `MachineStatus`
//! read while they are live.
//!
//! While a Talos run is in progress every node of the cluster is followed (see [`crate::followers`]):
//! a COSI watch of its `MachineStatus` (`runtime/MachineStatuses/machine`, the resource a look reads),
//! which reports the current state first and then every change. A look that reads the node's boot id
//! takes the readiness from the watch instead of asking the node again, and asks only the nodes no
//! live watch speaks for. The check is the same (the node's own `MachineStatus`); the repeat goes.
//!
//! A watch speaks for the boot it was opened in and ends with it (the node's reboot closes its
//! connection). A connection that has not broken yet while the node already runs a new boot (a
//! power cut the relay has not noticed) must not pass for the new boot, so each watch carries the
//! boot ids the node was known to run just before it opened: the one the cluster's last look read,
//! and the one its kubelet reported on its `Node`. A look that reads one of those boot ids knows the
//! node ran that boot when the watch opened and still does (a boot id never comes back), so the
//! watch is on the boot the look sees. Any other boot id, and the look reads the status itself.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use talos_api::proto::talos::resource::definitions::runtime::MachineStatusSpec;

/// One cluster's live machine-status watches, by node address. Held by the cluster's
/// [`crate::talos_fleet::TalosFleet`].
#[derive(Default)]
pub struct FollowedStatuses {
    watches: Mutex<Watches>,
    opened: AtomicU64,
}

#[derive(Default)]
struct Watches {
    live: HashMap<IpAddr, Watch>,
    /// The nodes whose watch last reported a stage that takes the node down, until a watch of the
    /// node opens again: when the node relays, every other node's watch breaks with it.
    going_down: HashSet<IpAddr>,
}

struct Watch {
    /// Tells this watch from the one that replaces it (a follower started again for the node).
    id: u64,
    /// The boots the node was known to run when the watch opened.
    boots: Vec<String>,
    /// The last status the watch reported; `None` before its first event, or after the resource
    /// was destroyed.
    status: Option<MachineStatusSpec>,
}

impl FollowedStatuses {
    fn lock(&self) -> std::sync::MutexGuard<'_, Watches> {
        self.watches
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A watch of the node at `address` opened, the node known to run one of `boots` just before.
    /// It speaks for the node until the returned guard is dropped.
    pub fn opened(&self, address: IpAddr, boots: Vec<String>) -> OpenWatch<'_> {
        let id = self.opened.fetch_add(1, Ordering::Relaxed);
        let mut watches = self.lock();
        watches.going_down.remove(&address);
        watches.live.insert(
            address,
            Watch {
                id,
                boots,
                status: None,
            },
        );
        OpenWatch {
            statuses: self,
            address,
            id,
        }
    }

    /// Whether a live watch follows the node at `address`: a look need not ask its status alongside
    /// its boot id, only if the watch turns out not to speak for the boot it reads
    /// ([`FollowedStatuses::status`]).
    pub fn follows(&self, address: IpAddr) -> bool {
        self.lock()
            .live
            .get(&address)
            .is_some_and(|watch| watch.status.is_some())
    }

    /// The node's status as its live watch last reported it, if the watch speaks for `boot_id`.
    pub fn status(&self, address: IpAddr, boot_id: &str) -> Option<MachineStatusSpec> {
        let watches = self.lock();
        let watch = watches.live.get(&address)?;
        watch
            .boots
            .iter()
            .any(|boot| boot == boot_id)
            .then(|| watch.status.clone())
            .flatten()
    }

    /// Whether the node at `address` was last seen going down (upgrading, rebooting, shutting down,
    /// resetting) and has not been watched since: a watch through it that breaks now broke with it.
    pub fn going_down(&self, address: IpAddr) -> bool {
        self.lock().going_down.contains(&address)
    }
}

/// A live watch's place in [`FollowedStatuses`]; dropping it (the watch ended, or its follower was
/// stopped) takes the node's status out.
pub struct OpenWatch<'a> {
    statuses: &'a FollowedStatuses,
    address: IpAddr,
    id: u64,
}

impl OpenWatch<'_> {
    /// The watch reported `status` (`None`: the resource is gone, the status is not known).
    pub fn saw(&self, status: Option<MachineStatusSpec>) {
        let mut watches = self.statuses.lock();
        let Some(watch) = watches.live.get_mut(&self.address) else {
            return;
        };
        if watch.id != self.id {
            return;
        }
        let down = status
            .as_ref()
            .is_some_and(talos_api::resources::machine_status::takes_node_down);
        watch.status = status;
        if down {
            watches.going_down.insert(self.address);
        } else {
            watches.going_down.remove(&self.address);
        }
    }
}

impl Drop for OpenWatch<'_> {
    fn drop(&mut self) {
        let mut watches = self.statuses.lock();
        if watches
            .live
            .get(&self.address)
            .is_some_and(|watch| watch.id == self.id)
        {
            watches.live.remove(&self.address);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use talos_api::proto::talos::resource::definitions::enums::RuntimeMachineStage;
    use talos_api::proto::talos::resource::definitions::runtime::MachineStatusStatus;

    fn status(ready: bool) -> MachineStatusSpec {
        MachineStatusSpec {
            stage: RuntimeMachineStage::MachineStageRunning as i32,
            status: Some(MachineStatusStatus {
                ready,
                unmet_conditions: Vec::new(),
            }),
        }
    }

    #[test]
    fn a_watch_speaks_for_the_boots_known_when_it_opened_while_it_is_open() {
        let statuses = FollowedStatuses::default();
        let node: IpAddr = "127.0.0.11".parse().unwrap();
        assert!(!statuses.follows(node));

        let watch = statuses.opened(node, vec!["boot-1".into()]);
        assert!(!statuses.follows(node), "nothing reported yet");
        assert_eq!(statuses.status(node, "boot-1"), None);

        watch.saw(Some(status(true)));
        assert!(statuses.follows(node));
        assert_eq!(statuses.status(node, "boot-1"), Some(status(true)));
        // A boot the node was not known to run when the watch opened: the look asks itself.
        assert_eq!(statuses.status(node, "boot-2"), None);

        watch.saw(Some(status(false)));
        assert_eq!(statuses.status(node, "boot-1"), Some(status(false)));
        watch.saw(None);
        assert!(!statuses.follows(node), "the resource is gone");

        watch.saw(Some(status(true)));
        drop(watch);
        assert!(!statuses.follows(node), "the watch ended");
        assert_eq!(statuses.status(node, "boot-1"), None);
    }

    #[test]
    fn a_node_seen_going_down_counts_as_down_until_it_is_watched_again() {
        let statuses = FollowedStatuses::default();
        let relay: IpAddr = "127.0.0.11".parse().unwrap();
        let watch = statuses.opened(relay, vec!["boot-1".into()]);
        watch.saw(Some(status(true)));
        assert!(!statuses.going_down(relay));
        watch.saw(Some(MachineStatusSpec {
            stage: RuntimeMachineStage::MachineStageUpgrading as i32,
            status: None,
        }));
        assert!(statuses.going_down(relay));
        drop(watch);
        assert!(statuses.going_down(relay), "its watch ended with it");
        let watch = statuses.opened(relay, vec!["boot-2".into()]);
        assert!(!statuses.going_down(relay), "it answers again");
        drop(watch);
    }

    #[test]
    fn the_end_of_a_replaced_watch_leaves_its_successor_in_place() {
        let statuses = FollowedStatuses::default();
        let node: IpAddr = "127.0.0.11".parse().unwrap();
        let old = statuses.opened(node, vec!["boot-1".into()]);
        let new = statuses.opened(node, vec!["boot-2".into()]);
        old.saw(Some(status(false)));
        new.saw(Some(status(true)));
        drop(old);
        assert_eq!(statuses.status(node, "boot-2"), Some(status(true)));
        assert_eq!(statuses.status(node, "boot-1"), None);
        drop(new);
        assert!(!statuses.follows(node));
    }
}
