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
    /// whenever a node may start), when it was asked, and whether a look at the nodes in flight
    /// asked it (and no call was made to the node since).
    nodes: HashMap<String, (TalosState, Instant, bool)>,
    /// Counts the idle refreshes that asked one node only: the next is asked at this index.
    turn: usize,
    /// Each node's platform as last asked, with the boot it was asked in.
    platforms: HashMap<String, (String, String)>,
    /// The version of the node last asked at each address where it answered: the fleet knows its
    /// relay by address only.
    versions_at: HashMap<IpAddr, semver::Version>,
    /// Each node's version as its kubelet reports it, with the boot that kubelet runs in
    /// ([`KeptLooks::kubelet_reports`]).
    reported: HashMap<String, (String, semver::Version)>,
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
    /// Only a look at the nodes in flight counts (the nodes in flight, and the others it asked by the
    /// way in the same call), and only until a call is made to the node ([`KeptLooks::calling`]): a
    /// look from before a node's upgrade was sent saw the system it is leaving, and a pass does not
    /// always know which nodes are in flight.
    pub fn just_asked_ready(&self, name: &str) -> Option<TalosState> {
        let kept = self.lock();
        let (state, at, asked_in_flight) = kept.nodes.get(name)?;
        (matches!(state, TalosState::Up { ready: true, .. })
            && at.elapsed() < JUST_ASKED
            && *asked_in_flight)
            .then(|| state.clone())
    }

    /// What the node's workload Node says of the system it runs: `status.nodeInfo.osImage` is the
    /// os-release `PRETTY_NAME` of the system its kubelet runs on, `Talos (v1.12.0)` (see
    /// [`crate::inventory::talos_version_of_os_image`]), and `status.nodeInfo.bootID` that system's
    /// boot id, both written by the same kubelet. A look that reads that boot id from Talos knows
    /// the version without asking `Version` ([`KeptLooks::running`]; the platform, which the Node
    /// does not tell, is still asked where it is needed).
    pub fn kubelet_reports(&self, name: &str, boot_id: &str, version: &semver::Version) {
        let mut kept = self.lock();
        if kept
            .reported
            .get(name)
            .is_some_and(|(boot, known)| boot == boot_id && known == version)
        {
            return;
        }
        kept.reported
            .insert(name.to_string(), (boot_id.to_string(), version.clone()));
    }

    /// A call that may change the node is about to be made: what a look just asked of it no longer
    /// stands for a look that would ask again ([`KeptLooks::just_asked_ready`]).
    pub fn calling(&self, name: &str) {
        if let Some((_, _, just_asked)) = self.lock().nodes.get_mut(name) {
            *just_asked = false;
        }
    }

    /// The node's running version (and, with `platform`, the platform it reports) when the last
    /// look that asked it found it on `boot_id`: the same system is still running. Without
    /// `platform`, also when the node's kubelet reported its version from that boot
    /// ([`KeptLooks::kubelet_reports`]).
    pub fn running(&self, name: &str, boot_id: &str, platform: bool) -> Option<Running> {
        let kept = self.lock();
        let asked = match kept.nodes.get(name) {
            Some((
                TalosState::Up {
                    version,
                    boot_id: kept_boot,
                    ..
                },
                ..,
            )) if kept_boot == boot_id => Some(version),
            _ => None,
        };
        let reported = || {
            kept.reported
                .get(name)
                .filter(|(reported_boot, _)| !platform && reported_boot == boot_id)
                .map(|(_, version)| version)
        };
        let version = asked.or_else(reported)?;
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
        // A call sent to the node (its upgrade): what was just asked is the system it leaves.
        kept.calling("w-1");
        assert_eq!(kept.just_asked_ready("w-1"), None, "a call made since");
        kept.keep_in_flight_nodes([(&w1, &up(true))]);
        // Aged past the moment: asked again.
        kept.lock().nodes.get_mut("w-1").unwrap().1 = Instant::now() - JUST_ASKED;
        assert_eq!(kept.just_asked_ready("w-1"), None);
        assert_eq!(kept.node("w-1"), Some(up(true)), "still kept");
    }

    /// A boot's version is known from a look that asked it, or from the kubelet that runs in it;
    /// the platform only from a look.
    #[test]
    fn a_version_is_known_from_a_look_at_that_boot_or_its_kubelet() {
        let kept = KeptLooks::default();
        let w1 = node("w-1", "10.5.0.4");
        let v = semver::Version::new;
        kept.keep_nodes([(
            &w1,
            &TalosState::Up {
                version: v(1, 11, 6),
                boot_id: "b1".into(),
                ready: true,
                install: Some(talos_upgrade_core::talos::InstallSource::new(
                    "ghcr.io/siderolabs/installer:v1.11.6",
                    Some("metal"),
                )),
            },
        )]);
        let running = |version, platform: &str| {
            Some(Running {
                version,
                platform: platform.to_string(),
            })
        };
        assert_eq!(
            kept.running("w-1", "b1", true),
            running(v(1, 11, 6), "metal")
        );
        assert_eq!(kept.running("w-1", "b2", false), None, "a boot no one told");
        // Still the old boot's kubelet: nothing about b2.
        kept.kubelet_reports("w-1", "b1", &v(1, 11, 6));
        assert_eq!(kept.running("w-1", "b2", false), None);
        // The new boot's kubelet reports the new system.
        kept.kubelet_reports("w-1", "b2", &v(1, 12, 0));
        assert_eq!(kept.running("w-1", "b2", false), running(v(1, 12, 0), ""));
        assert_eq!(
            kept.running("w-1", "b2", true),
            None,
            "the platform is Version's alone"
        );
        assert_eq!(kept.running("w-2", "b2", false), None, "another node");
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
