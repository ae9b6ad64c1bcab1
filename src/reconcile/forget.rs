//! Forgetting a deleted cluster: its metric series, its connections, credentials and Machine
//! inventory, its progress record as last read, its last look and the followers of its nodes.
//!
//! Where the controller learns of a deletion, and why there:
//!
//! - **The watch of the clusters** (`run`), not a reconcile: kube's `Controller` never reconciles an
//!   object that is gone, and a finalizer, which would make it, would let this controller hold up the
//!   deletion of a cluster (it must never). The watch's `Delete` event forgets the cluster at once.
//! - **A relist** (`InitDone`): a deletion made while the watch was down has no `Delete` event; the
//!   relisted store no longer holds the cluster, and every cluster remembered but not listed is
//!   forgotten.
//! - **A reconcile's end**: a reconcile already running when its cluster is deleted may remember it
//!   again after the `Delete` event (a last look, metrics, followers, and a silence it wrote after the
//!   `Delete` event's expiry of them). So every reconcile, when it ends, forgets its cluster if the
//!   store no longer holds it (or holds a new one of the same name), by the object it reconciled: the
//!   `Delete` event took that object from [`Known`] already, and the silences are found by its uid.
//!   The controller never runs two reconciles of one name at once, so this never forgets a newer one's
//!   work.
//! - **A cluster re-created under the same name** is another object (another uid): the first reconcile
//!   of the new one forgets what was remembered of the old one before it begins, so it starts clean.
//!
//! What is remembered of a cluster is keyed by its namespace and name; [`Known`] keeps which object
//! (uid) that memory belongs to and its cluster id (the key of its Machine inventory).

use std::collections::HashMap;
use std::sync::Mutex;

/// A cluster's key in the controller's memory: (namespace, name).
pub type ClusterName = (String, String);

/// The object the controller's memory of a cluster belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remembered {
    /// The object's uid: a cluster deleted and created again under the same name has another.
    pub uid: String,
    /// Its `spec.data.clusterId` (or its name): the key of its Machine inventory.
    pub cluster_id: String,
}

/// Every cluster the controller remembers something of, with the object it belongs to.
#[derive(Debug, Default)]
pub struct Known(Mutex<HashMap<ClusterName, Remembered>>);

impl Known {
    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<ClusterName, Remembered>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A reconcile of `object` begins under `name`: from now on the memory of `name` is the object's.
    /// Returns what was remembered of another object of that name (a cluster deleted and created
    /// again), which the caller forgets first.
    pub fn begin(&self, name: &ClusterName, object: Remembered) -> Option<Remembered> {
        self.known()
            .insert(name.clone(), object.clone())
            .filter(|before| before.uid != object.uid)
    }

    /// Stops remembering `name`; returns what was remembered of it.
    pub fn take(&self, name: &ClusterName) -> Option<Remembered> {
        self.known().remove(name)
    }

    /// The clusters remembered under a name for which `present` gives no object with the same uid: the
    /// ones deleted (or replaced) since.
    pub fn gone(&self, present: impl Fn(&ClusterName) -> Option<String>) -> Vec<ClusterName> {
        let mut gone: Vec<ClusterName> = self
            .known()
            .iter()
            .filter(|(name, remembered)| present(name).as_deref() != Some(&remembered.uid))
            .map(|(name, _)| name.clone())
            .collect();
        gone.sort();
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(name: &str) -> ClusterName {
        ("ns".to_string(), name.to_string())
    }

    fn object(uid: &str) -> Remembered {
        Remembered {
            uid: uid.to_string(),
            cluster_id: format!("{uid}-id"),
        }
    }

    #[test]
    fn a_name_taken_by_another_object_hands_back_the_old_one_to_forget() {
        let known = Known::default();
        assert_eq!(known.begin(&name("a"), object("u1")), None, "first seen");
        assert_eq!(
            known.begin(&name("a"), object("u1")),
            None,
            "the same object"
        );
        // Deleted and created again under the same name while the controller was not watching.
        assert_eq!(known.begin(&name("a"), object("u2")), Some(object("u1")));
        assert_eq!(known.take(&name("a")), Some(object("u2")));
        assert_eq!(known.take(&name("a")), None, "forgotten");
    }

    #[test]
    fn the_clusters_gone_are_the_ones_not_listed_with_the_same_uid() {
        let known = Known::default();
        known.begin(&name("kept"), object("u1"));
        known.begin(&name("deleted"), object("u2"));
        known.begin(&name("replaced"), object("u3"));
        let listed = |cluster: &ClusterName| match cluster.1.as_str() {
            "kept" => Some("u1".to_string()),
            "replaced" => Some("u4".to_string()),
            _ => None,
        };
        assert_eq!(known.gone(listed), [name("deleted"), name("replaced")]);
        // Listing changes nothing by itself: the caller forgets what is gone.
        assert_eq!(known.gone(|_| None).len(), 3);
    }
}
