//! Saying `talos-status: in-progress` as soon as a new Talos target is seen, before the reconcile reads
//! the cluster's credentials and asks its nodes.
//!
//! A reconcile that starts a run first reads the credentials Secret and the workload Nodes, then asks
//! every node and etcd, and only then reports. Alone that is a few tens of milliseconds; with a fleet
//! annotated at once it is every cluster's reads and Talos looks queued in the same API server and
//! the same two CPUs, and the user's `kubectl wait` for `in-progress` waited seconds for work that
//! almost never changes the answer. So the reconcile acknowledges the target first, with one
//! metadata-only patch sent before those reads (not beside them, where it queued behind the reads of
//! every other cluster), when the versions the controller last saw on the cluster's nodes (its last
//! look, kept here in memory) accept it by the rules the run's start applies
//! ([`talos_upgrade_core::acknowledgement`]). The same reconcile then looks at the nodes afresh and
//! decides for good.
//!
//! Only the annotations are written here: `status.phase` and the `TalosUpgrade` condition follow with
//! the reconcile's first full report.

use std::collections::HashMap;
use std::sync::Mutex;

use talos_upgrade_core::acknowledgement::LastLook;

/// The last look of every cluster this controller has looked at since it started, by (namespace,
/// name). A restarted controller knows none, and its first reconciles report as before.
#[derive(Default)]
pub struct LastLooks(Mutex<HashMap<(String, String), LastLook>>);

impl LastLooks {
    pub fn get(&self, key: &(String, String)) -> Option<LastLook> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(key)
            .cloned()
    }

    /// Keeps what a reconcile saw; `None` (it looked and learnt nothing: no node answered, no
    /// credentials) forgets the cluster's last look, so no acknowledgement rests on an older one.
    pub fn note(&self, key: (String, String), look: Option<LastLook>) {
        let mut looks = self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match look {
            Some(look) => {
                looks.insert(key, look);
            }
            None => {
                looks.remove(&key);
            }
        }
    }

    /// Drops the last look of a deleted cluster.
    pub fn forget(&self, key: &(String, String)) {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use talos_upgrade_core::talos::TalosVersions;
    use talos_upgrade_core::versions::TalosVersion;

    fn look(version: &str) -> LastLook {
        let version = TalosVersion::parse(version).expect("version");
        LastLook {
            versions: TalosVersions {
                range: Some((version.clone(), version)),
                kubernetes: None,
            },
            at: "2026-11-27T06:00:00Z".parse().expect("timestamp"),
        }
    }

    #[test]
    fn a_look_that_learnt_nothing_forgets_the_one_before() {
        let looks = LastLooks::default();
        let key = ("ns".to_string(), "c".to_string());
        looks.note(key.clone(), Some(look("1.11.6")));
        assert_eq!(looks.get(&key), Some(look("1.11.6")));
        looks.note(key.clone(), None);
        assert_eq!(looks.get(&key), None);
    }
}
