//! What a cluster's Talos looks leave for the next reconcile, kept with the cluster's connections
//! (its `TalosFleet`, until its credentials Secret changes): each node's state as last asked, and whose turn it is to
//! answer the idle refresh's one `Version` call.
//!
//! A node's version (and platform) is kept with the boot it was asked in: a running system's version
//! changes only with a new boot, so a look that finds a node on the same boot does not ask `Version`
//! again ([`KeptLooks::running`]). The relay's version, looked up by its address, decides whether
//! its apid is asked to fan calls out ([`KeptLooks::version_at`]).
//!
//! A pass that can start no node asks only the nodes in flight (`StartingNodes::InFlight`, decided
//! in the core by `talos::only_in_flight_may_change`) and takes the other nodes from here; the core
//! looks at everything again before any node starts or the run finishes.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use talos_upgrade_core::talos::TalosState;

use crate::inventory::InventoryNode;

/// How long a node's answer that it is up and ready stands for a look that would ask it again
/// ([`KeptLooks::just_asked_ready`]).
pub const JUST_ASKED: Duration = Duration::from_secs(1);

/// One cluster's kept looks. Held by the cluster's [`crate::talos_fleet::TalosFleet`], so they last
/// as long as its connections (rebuilt when its credentials Secret changes or the cluster is
/// forgotten): new credentials start from a look at everything.
#[derive(Default)]
pub struct KeptLooks {
    kept: Mutex<Kept>,
}

/// A node's running Talos version and the platform it reports (`MachineService.Version`), both fixed
/// for a boot: Talos changes its system only through a reboot (the upgrade installs into the other
/// boot slot), which changes the boot id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    pub version: semver::Version,
    pub platform: String,
}

#[derive(Default)]
struct Kept {
    /// Each node's Talos state as last asked, by node name, without its installer image (read again
    /// whenever a node may start), when it was asked, and whether the node was in flight then.
    nodes: HashMap<String, (TalosState, Instant, bool)>,
    /// Counts the idle refreshes that asked one node only: the next is asked at this index.
    turn: usize,
    /// Each node's platform as last asked, with the boot it was asked in.
    platforms: HashMap<String, (String, String)>,
    /// The version of the node last asked at each address where it answered: the fleet knows its
    /// relay by address only.
    versions_at: HashMap<IpAddr, semver::Version>,
}

impl KeptLooks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps what a look asked of these nodes.
    pub fn keep_nodes<'a>(
        &self,
        asked: impl IntoIterator<Item = (&'a InventoryNode, &'a TalosState)>,
    ) {
        self.keep(asked, false);
    }

    /// Keeps what a look at the nodes in flight asked of them ([`KeptLooks::just_asked_ready`]).
    pub fn keep_in_flight_nodes<'a>(
        &self,
        asked: impl IntoIterator<Item = (&'a InventoryNode, &'a TalosState)>,
    ) {
        self.keep(asked, true);
    }

    fn keep<'a>(
        &self,
        asked: impl IntoIterator<Item = (&'a InventoryNode, &'a TalosState)>,
        in_flight: bool,
    ) {
        let mut kept = self.lock();
        for (node, state) in asked {
            let name = node.name.as_str();
            let state = match state {
                TalosState::Up {
                    version,
                    boot_id,
                    ready,
                    install,
                } => {
                    kept.versions_at.insert(node.address, version.clone());
                    if let Some(install) = install {
                        kept.platforms.insert(
                            name.to_string(),
                            (
                                boot_id.clone(),
                                install.platform.clone().unwrap_or_default(),
                            ),
                        );
                    }
                    TalosState::Up {
                        version: version.clone(),
                        boot_id: boot_id.clone(),
                        ready: *ready,
                        install: None,
                    }
                }
                unreachable @ TalosState::Unreachable { .. } => {
                    kept.versions_at.remove(&node.address);
                    unreachable.clone()
                }
            };
            kept.nodes
                .insert(name.to_string(), (state, Instant::now(), in_flight));
        }
    }

    /// The node's state as last asked, if it was.
    pub fn node(&self, name: &str) -> Option<TalosState> {
        self.lock().nodes.get(name).map(|(state, ..)| state.clone())
    }

    /// The node's state as asked less than [`JUST_ASKED`] ago, if it was then up and ready: what
    /// asking again would answer. Both followers of a node wake its cluster when it is back,
    /// milliseconds apart (Talos reports it ready, its kubelet writes its Node Ready), and the
    /// reconcile the second one wakes would ask Talos what the first one's has just been told. A
    /// state that was not (yet) ready is always asked again: that is the change a wake-up is about.
    /// Only a look at the nodes in flight counts: one from before a node's upgrade was sent saw the
    /// system it is leaving, and a pass does not always know which nodes are in flight.
    pub fn just_asked_ready(&self, name: &str) -> Option<TalosState> {
        let kept = self.lock();
        let (state, at, asked_in_flight) = kept.nodes.get(name)?;
        (matches!(state, TalosState::Up { ready: true, .. })
            && at.elapsed() < JUST_ASKED
            && *asked_in_flight)
            .then(|| state.clone())
    }

    /// The node's running version (and, with `platform`, the platform it reports) when the last
    /// look that asked it found it on `boot_id`: the same system is still running.
    pub fn running(&self, name: &str, boot_id: &str, platform: bool) -> Option<Running> {
        let kept = self.lock();
        let (
            TalosState::Up {
                version,
                boot_id: kept_boot,
                ..
            },
            ..,
        ) = kept.nodes.get(name)?
        else {
            return None;
        };
        if kept_boot != boot_id {
            return None;
        }
        let platform = if platform {
            let (platform_boot, platform) = kept.platforms.get(name)?;
            if platform_boot != boot_id {
                return None;
            }
            platform.clone()
        } else {
            String::new()
        };
        Some(Running {
            version: version.clone(),
            platform,
        })
    }

    /// The version the node at `address` ran when a look last asked it (`None` when none did, or
    /// it did not answer): what the fleet knows of its relay's Talos ([`crate::talos_fleet::fans_out`]).
    /// A node rebooted into another Talos is taken for the old one until a look asks it again; one
    /// the controller reboots is seen down (unknown) in between.
    pub fn version_at(&self, address: IpAddr) -> Option<semver::Version> {
        self.lock().versions_at.get(&address).cloned()
    }

    /// What an idle refresh learnt of the node at `address` (its `Version` answer, or the Talos its
    /// Ready Node reports in `osImage`), kept where no look has asked it yet: the first look of a
    /// run then knows whether its relay fans calls out, instead of asking each node on its own.
    pub fn learn_version_at(&self, address: IpAddr, version: &semver::Version) {
        self.lock()
            .versions_at
            .entry(address)
            .or_insert_with(|| version.clone());
    }

    /// Which of `count` nodes answers this idle refresh's one `Version` call: each in turn.
    pub fn next_turn(&self, count: usize) -> usize {
        let mut kept = self.lock();
        let turn = kept.turn;
        kept.turn = kept.turn.wrapping_add(1);
        turn % count.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, address: &str) -> InventoryNode {
        InventoryNode {
            name: name.into(),
            address: address.parse().unwrap(),
            role: talos_upgrade_core::run::NodeRole::ControlPlane,
            held: false,
        }
    }

    /// The fleet knows its relay by address: the version a look found there while it answered.
    #[test]
    fn the_version_at_an_address_is_known_while_the_node_there_answered() {
        let kept = KeptLooks::default();
        let cp1 = node("cp-1", "10.5.0.2");
        let up = |minor| TalosState::Up {
            version: semver::Version::new(1, minor, 0),
            boot_id: format!("b{minor}"),
            ready: true,
            install: None,
        };
        assert_eq!(kept.version_at(cp1.address), None, "never asked");
        kept.keep_nodes([(&cp1, &up(13))]);
        assert_eq!(
            kept.version_at(cp1.address),
            Some(semver::Version::new(1, 13, 0))
        );
        assert_eq!(kept.version_at("10.5.0.3".parse().unwrap()), None);
        let down = TalosState::Unreachable {
            reason: "rebooting".into(),
        };
        kept.keep_nodes([(&cp1, &down)]);
        assert_eq!(kept.version_at(cp1.address), None, "not known while down");
        kept.keep_nodes([(&cp1, &up(14))]);
        assert_eq!(
            kept.version_at(cp1.address),
            Some(semver::Version::new(1, 14, 0))
        );
    }

    /// An idle refresh's version fills in only what no look asked: a look's answer is the newer.
    #[test]
    fn an_idle_refresh_tells_the_version_at_an_address_no_look_asked() {
        let kept = KeptLooks::default();
        let cp1 = node("cp-1", "10.5.0.2");
        kept.learn_version_at(cp1.address, &semver::Version::new(1, 11, 6));
        assert_eq!(
            kept.version_at(cp1.address),
            Some(semver::Version::new(1, 11, 6))
        );
        kept.keep_nodes([(
            &cp1,
            &TalosState::Up {
                version: semver::Version::new(1, 12, 0),
                boot_id: "b2".into(),
                ready: true,
                install: None,
            },
        )]);
        kept.learn_version_at(cp1.address, &semver::Version::new(1, 11, 6));
        assert_eq!(
            kept.version_at(cp1.address),
            Some(semver::Version::new(1, 12, 0)),
            "a look's answer stands"
        );
    }

    /// Only an answer of up and ready stands for a second look, and only for a moment.
    #[test]
    fn a_node_just_asked_up_and_ready_is_not_asked_again_within_a_second() {
        let kept = KeptLooks::default();
        let w1 = node("w-1", "10.5.0.4");
        let w2 = node("w-2", "10.5.0.5");
        let up = |ready| TalosState::Up {
            version: semver::Version::new(1, 12, 0),
            boot_id: "b2".into(),
            ready,
            install: None,
        };
        assert_eq!(kept.just_asked_ready("w-1"), None, "never asked");
        kept.keep_nodes([(&w1, &up(true))]);
        assert_eq!(
            kept.just_asked_ready("w-1"),
            None,
            "asked by a look that did not have it in flight: maybe the system it leaves"
        );
        kept.keep_in_flight_nodes([(&w1, &up(true)), (&w2, &up(false))]);
        assert_eq!(
            kept.just_asked_ready("w-1"),
            Some(up(true)),
            "back, as the look at the nodes in flight saw"
        );
        assert_eq!(kept.just_asked_ready("w-2"), None, "not ready: asked again");
        kept.keep_in_flight_nodes([(
            &w2,
            &TalosState::Unreachable {
                reason: "rebooting".into(),
            },
        )]);
        assert_eq!(kept.just_asked_ready("w-2"), None, "down: asked again");
        // Aged past the moment: asked again.
        kept.lock().nodes.get_mut("w-1").unwrap().1 = Instant::now() - JUST_ASKED;
        assert_eq!(kept.just_asked_ready("w-1"), None);
        assert_eq!(kept.node("w-1"), Some(up(true)), "still kept");
    }

    #[test]
    fn a_kept_state_leaves_out_the_installer_image_and_turns_go_round() {
        let kept = KeptLooks::default();
        let up = TalosState::Up {
            version: semver::Version::new(1, 11, 6),
            boot_id: "b1".into(),
            ready: true,
            install: Some(talos_upgrade_core::talos::InstallSource::new(
                "ghcr.io/siderolabs/installer:v1.11.6",
                Some("metal"),
            )),
        };
        kept.keep_nodes([(&node("w-1", "10.5.0.4"), &up)]);
        assert_eq!(
            kept.node("w-1"),
            Some(TalosState::Up {
                version: semver::Version::new(1, 11, 6),
                boot_id: "b1".into(),
                ready: true,
                install: None,
            })
        );
        assert_eq!(kept.node("w-2"), None);
        let turns: Vec<usize> = (0..4).map(|_| kept.next_turn(3)).collect();
        assert_eq!(turns, [0, 1, 2, 0]);
        assert_eq!(kept.next_turn(0), 0);
    }
}
