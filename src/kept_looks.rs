//! What a cluster's Talos looks leave for the next reconcile, kept with the cluster's connections
//! (its `TalosFleet`, until its credentials Secret changes): each node's state as last asked, and whose turn it is to
//! answer the idle refresh's one `Version` call.
//!
//! A pass that can start no node asks only the nodes in flight (`StartingNodes::InFlight`, decided
//! in the core by `talos::only_in_flight_may_change`) and takes the other nodes from here; the core
//! looks at everything again before any node starts or the run finishes.

use std::collections::HashMap;
use std::sync::Mutex;

use talos_upgrade_core::talos::TalosState;

/// One cluster's kept looks. Held by the cluster's [`crate::talos_fleet::TalosFleet`], so they last
/// as long as its connections (rebuilt when its credentials Secret changes or the cluster is
/// forgotten): new credentials start from a look at everything.
#[derive(Default)]
pub struct KeptLooks {
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// Each node's Talos state as last asked, by node name, without its installer image (read again
    /// whenever a node may start).
    nodes: HashMap<String, TalosState>,
    /// Counts the idle refreshes that asked one node only: the next is asked at this index.
    turn: usize,
}

impl KeptLooks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Keeps what a look asked of these nodes.
    pub fn keep_nodes<'a>(&self, asked: impl IntoIterator<Item = (&'a str, &'a TalosState)>) {
        let mut kept = self.lock();
        for (name, state) in asked {
            let state = match state {
                TalosState::Up {
                    version,
                    boot_id,
                    ready,
                    ..
                } => TalosState::Up {
                    version: version.clone(),
                    boot_id: boot_id.clone(),
                    ready: *ready,
                    install: None,
                },
                unreachable @ TalosState::Unreachable { .. } => unreachable.clone(),
            };
            kept.nodes.insert(name.to_string(), state);
        }
    }

    /// The node's state as last asked, if it was.
    pub fn node(&self, name: &str) -> Option<TalosState> {
        self.lock().nodes.get(name).cloned()
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
        kept.keep_nodes([("w-1", &up)]);
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
