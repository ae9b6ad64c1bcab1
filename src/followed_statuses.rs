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
//!
//! A node back from its reboot is usually found by a look (woken by its kubelet's `Node`) before
//! its follower has opened the watch again. Such a look does not read the status beside the boot id:
//! it tells the follower the boot it read and that the node answers ([`FollowedStatuses::await_watch`]),
//! and waits for the watch's first report, which speaks for that boot because the watch opens after
//! the look read it. If no watch reports within [`AWAIT_WATCH`] (it could not be opened, or opened
//! without that boot), the look reads the status itself, as before: the check is the same, only the
//! read the watch makes anyway goes.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use talos_api::proto::talos::resource::definitions::runtime::MachineStatusSpec;

/// How long a look waits for a node's follower to report after telling it that the node answers
/// on a new boot ([`FollowedStatuses::await_watch`]): opening the watch is one round trip, and its
/// first event comes with the answer. Past that the look reads the status itself.
pub const AWAIT_WATCH: Duration = Duration::from_secs(1);

/// One cluster's live machine-status watches, by node address. Held by the cluster's
/// [`crate::talos_fleet::TalosFleet`].
#[derive(Default)]
pub struct FollowedStatuses {
    watches: Mutex<Watches>,
    opened: AtomicU64,
    /// Told of every report: what a look waiting for a watch wakes on.
    reported: Notify,
}

#[derive(Default)]
struct Watches {
    live: HashMap<IpAddr, Watch>,
    /// The nodes whose watch last reported a stage that takes the node down, until a watch of the
    /// node opens again: when the node relays, every other node's watch breaks with it.
    going_down: HashSet<IpAddr>,
    /// The nodes that have a follower, and how to tell it to open its watch now.
    followers: HashMap<IpAddr, Arc<Notify>>,
    /// The boot a look read while the node's follower had no watch open, until the follower opens
    /// its next watch, which then speaks for that boot too.
    read_while_away: HashMap<IpAddr, String>,
    /// The boot a look waited for in vain ([`FollowedStatuses::await_watch`]), until a watch of
    /// the node opens: the next looks read that boot's status without waiting.
    waited_in_vain: HashMap<IpAddr, String>,
}

/// What a node's watch says of a boot, as far as a look is concerned.
enum Reported {
    Status(MachineStatusSpec),
    /// A watch reports, but for other boots: the look reads the status itself.
    OtherBoots,
    /// No watch has reported yet.
    Nothing,
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
        watches.waited_in_vain.remove(&address);
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
        match self.reported(address, boot_id) {
            Reported::Status(status) => Some(status),
            Reported::OtherBoots | Reported::Nothing => None,
        }
    }

    fn reported(&self, address: IpAddr, boot_id: &str) -> Reported {
        let watches = self.lock();
        let Some(watch) = watches.live.get(&address) else {
            return Reported::Nothing;
        };
        match &watch.status {
            None => Reported::Nothing,
            Some(_) if !watch.boots.iter().any(|boot| boot == boot_id) => Reported::OtherBoots,
            Some(status) => Reported::Status(status.clone()),
        }
    }

    /// The node at `address` has a follower, and no watch of it reports: its follower is waiting
    /// for the node (or opening its watch). A look that reads the node's boot id may then leave the
    /// status to the watch ([`FollowedStatuses::await_watch`]) instead of reading it alongside.
    pub fn awaited(&self, address: IpAddr) -> bool {
        let watches = self.lock();
        watches.followers.contains_key(&address)
            && watches
                .live
                .get(&address)
                .is_none_or(|watch| watch.status.is_none())
    }

    /// A look read `boot_id` from the node at `address`, whose follower has no watch reporting:
    /// tells the follower to open its watch now, for that boot too, and waits up to `within` for its
    /// report. `None`: no report for that boot came (the watch could not be opened, or it opened
    /// before it was told); the look reads the status itself.
    pub async fn await_watch(
        &self,
        address: IpAddr,
        boot_id: &str,
        within: Duration,
    ) -> Option<MachineStatusSpec> {
        {
            let mut watches = self.lock();
            if watches.waited_in_vain.get(&address).map(String::as_str) == Some(boot_id) {
                return None;
            }
            let poke = watches.followers.get(&address)?.clone();
            watches.read_while_away.insert(address, boot_id.to_string());
            poke.notify_one();
        }
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let reported = self.reported.notified();
            tokio::pin!(reported);
            // Registered before the check, so a report between the two is not missed.
            reported.as_mut().enable();
            match self.reported(address, boot_id) {
                Reported::Status(status) => return Some(status),
                Reported::OtherBoots => return None,
                Reported::Nothing => {}
            }
            if tokio::time::timeout_at(deadline, reported).await.is_err() {
                tracing::debug!(node = %address, "no watch reported in time: reading the status");
                self.lock()
                    .waited_in_vain
                    .insert(address, boot_id.to_string());
                return None;
            }
        }
    }

    /// The boot a look read while the follower of the node at `address` had no watch reporting
    /// ([`FollowedStatuses::await_watch`]): the follower takes it before it opens its next watch,
    /// which speaks for it (the node ran that boot before the watch opened).
    pub fn take_boot_read_while_away(&self, address: IpAddr) -> Option<String> {
        self.lock().read_while_away.remove(&address)
    }

    /// The node at `address` is followed from now on; `open_now` tells its follower to open its
    /// watch at once. Until the returned guard is dropped.
    pub fn followed_by(&self, address: IpAddr, open_now: Arc<Notify>) -> Follower<'_> {
        self.lock().followers.insert(address, open_now.clone());
        Follower {
            statuses: self,
            address,
            open_now,
        }
    }

    /// Whether the node at `address` was last seen going down (upgrading, rebooting, shutting down,
    /// resetting) and has not been watched since: a watch through it that breaks now broke with it.
    pub fn going_down(&self, address: IpAddr) -> bool {
        self.lock().going_down.contains(&address)
    }
}

/// A follower's place in [`FollowedStatuses`] (see [`FollowedStatuses::followed_by`]).
pub struct Follower<'a> {
    statuses: &'a FollowedStatuses,
    address: IpAddr,
    open_now: Arc<Notify>,
}

impl Drop for Follower<'_> {
    fn drop(&mut self) {
        let mut watches = self.statuses.lock();
        if watches
            .followers
            .get(&self.address)
            .is_some_and(|open_now| Arc::ptr_eq(open_now, &self.open_now))
        {
            watches.followers.remove(&self.address);
            watches.read_while_away.remove(&self.address);
            watches.waited_in_vain.remove(&self.address);
        }
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
        drop(watches);
        self.statuses.reported.notify_waiters();
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

    /// A look that reads a new boot while the node's follower has no watch reporting tells the
    /// follower (its poke, and the boot it read) and takes the status from the watch the follower
    /// opens then. A watch that reports other boots, or none in time, leaves the look to read the
    /// status itself, and a boot waited for in vain is not waited for again.
    #[tokio::test]
    async fn a_look_at_a_node_back_before_its_watch_waits_for_the_watch_its_follower_opens() {
        use futures::FutureExt;
        let statuses = FollowedStatuses::default();
        let node: IpAddr = "127.0.0.11".parse().unwrap();
        let within = Duration::from_secs(20);
        assert!(!statuses.awaited(node), "no follower");
        assert_eq!(statuses.await_watch(node, "boot-2", within).await, None);

        let poke = Arc::new(Notify::new());
        let follower = statuses.followed_by(node, poke.clone());
        assert!(statuses.awaited(node), "followed, no watch yet");
        // The follower: told, it opens its watch for the boots it knew and the one the look read.
        let follower_opens = async {
            poke.notified().await;
            let read = statuses.take_boot_read_while_away(node);
            assert_eq!(read.as_deref(), Some("boot-2"));
            let watch = statuses.opened(node, vec!["boot-1".into(), read.unwrap()]);
            watch.saw(Some(status(true)));
            watch
        };
        let (looked, watch) =
            tokio::join!(statuses.await_watch(node, "boot-2", within), follower_opens);
        assert_eq!(looked, Some(status(true)));
        assert!(!statuses.awaited(node), "its watch reports");

        // The watch ends (the node reboots again); one that opens without the boot the look read
        // (it opened before it was told) reports for other boots: the look reads the status itself.
        drop(watch);
        assert!(statuses.awaited(node));
        let opens_without_it = async {
            poke.notified().await;
            let other = statuses.opened(node, vec!["boot-2".into()]);
            other.saw(Some(status(true)));
            other
        };
        let (looked, other) = tokio::join!(
            statuses.await_watch(node, "boot-3", within),
            opens_without_it
        );
        assert_eq!(looked, None);
        drop(other);

        // No watch reports in time: the look reads the status, and does not wait for that boot
        // again (nor tell the follower) until a watch opens.
        assert_eq!(
            statuses
                .await_watch(node, "boot-4", Duration::from_millis(10))
                .await,
            None
        );
        assert!(poke.notified().now_or_never().is_some(), "told once");
        assert_eq!(statuses.await_watch(node, "boot-4", within).await, None);
        assert!(poke.notified().now_or_never().is_none(), "not told again");

        drop(follower);
        assert!(!statuses.awaited(node), "no follower");
        assert_eq!(statuses.take_boot_read_while_away(node), None);
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
