//! A node's in-memory COSI resource store: versioned resources plus a change feed for `Watch`.
//!
//! The node's state is the single source of truth; after every change the node computes the full set of
//! resources it should expose and [`ResourceStore::reconcile`]s it here. The store bumps
//! `metadata.version` only when a spec really changes, creates and destroys resources as they appear
//! and disappear, and broadcasts each change with the previous version (COSI's `old` on UPDATED).
//! Like Talos's in-memory state, the store is emptied on reboot, so versions start again at 1.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::SystemTime;

use tokio::sync::broadcast;

use talos_api::proto::cosi::resource as cosi;

/// Talos's `cluster` namespace (machinery `resources/cluster/cluster.go`): what cluster discovery
/// learns about the other nodes, kept apart from what a node derives from its own state.
pub(crate) const CLUSTER_NS: &str = "cluster";

/// Namespace, type and id of a resource.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ResourceKey {
    pub namespace: String,
    pub type_: String,
    pub id: String,
}

/// What a node wants a resource to look like (everything except the bookkeeping).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct DesiredResource {
    pub key: ResourceKey,
    pub owner: String,
    pub proto_spec: Vec<u8>,
    pub yaml_spec: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// A stored resource with its version and timestamps.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredResource {
    pub desired: DesiredResource,
    pub version: u64,
    pub created: SystemTime,
    pub updated: SystemTime,
}

impl StoredResource {
    pub(crate) fn key(&self) -> &ResourceKey {
        &self.desired.key
    }

    pub(crate) fn to_proto(&self) -> cosi::Resource {
        let d = &self.desired;
        cosi::Resource {
            metadata: Some(cosi::Metadata {
                namespace: d.key.namespace.clone(),
                r#type: d.key.type_.clone(),
                id: d.key.id.clone(),
                version: self.version.to_string(),
                owner: d.owner.clone(),
                phase: "running".to_string(),
                created: Some(self.created.into()),
                updated: Some(self.updated.into()),
                finalizers: Vec::new(),
                labels: d.labels.clone().into_iter().collect(),
                annotations: d.annotations.clone().into_iter().collect(),
            }),
            spec: Some(cosi::Spec {
                proto_spec: d.proto_spec.clone(),
                yaml_spec: d.yaml_spec.clone(),
            }),
        }
    }
}

/// A COSI tombstone: metadata and an empty spec, version undefined, for a watched resource that does not exist.
pub(crate) fn tombstone(key: &ResourceKey) -> cosi::Resource {
    cosi::Resource {
        metadata: Some(cosi::Metadata {
            namespace: key.namespace.clone(),
            r#type: key.type_.clone(),
            id: key.id.clone(),
            version: "undefined".to_string(),
            phase: "running".to_string(),
            ..Default::default()
        }),
        // An empty spec, not none: the COSI runtime marshals every resource with a `Spec` message
        // (cosi-project/runtime v1.16.2 `pkg/resource/protobuf/resource.go` `Marshal`), and its
        // client refuses one without ("spec is missing"), e.g. talosctl upgrade-k8s probing the
        // `final-` configs Talos 1.13 does not have.
        spec: Some(cosi::Spec::default()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Created,
    Updated,
    Destroyed,
}

/// One change to the store.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    /// Store generation (bumped by every reboot's `clear`).
    pub generation: u64,
    pub kind: ChangeKind,
    /// The new resource (for Destroyed: the last version before it went away).
    pub resource: StoredResource,
    /// The previous version, on Updated.
    pub old: Option<StoredResource>,
}

#[derive(Debug)]
pub(crate) struct ResourceStore {
    resources: Mutex<Inner>,
    tx: broadcast::Sender<Change>,
}

/// Watchers slower than this many changes are cut off (COSI does the same with its buffer).
const CHANGE_BUFFER: usize = 1024;

#[derive(Debug, Default)]
struct Inner {
    generation: u64,
    map: BTreeMap<ResourceKey, StoredResource>,
}

impl ResourceStore {
    pub(crate) fn new() -> Self {
        ResourceStore {
            resources: Mutex::new(Inner::default()),
            tx: broadcast::Sender::new(CHANGE_BUFFER),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Each mutation is a single map operation, so a poisoned map is still consistent.
        self.resources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Make the store hold exactly `desired` outside the [`CLUSTER_NS`] namespace (which
    /// [`ResourceStore::reconcile_namespace`] keeps): create, update (only on a real change) and destroy.
    pub(crate) fn reconcile(&self, desired: Vec<DesiredResource>) {
        self.reconcile_where(|key| key.namespace != CLUSTER_NS, desired);
    }

    /// Make the store hold exactly `desired` in `namespace`, leaving every other namespace alone: the
    /// resources a node learns from the rest of the cluster rather than derives from its own state.
    pub(crate) fn reconcile_namespace(&self, namespace: &str, desired: Vec<DesiredResource>) {
        debug_assert!(desired.iter().all(|d| d.key.namespace == namespace));
        self.reconcile_where(|key| key.namespace == namespace, desired);
    }

    /// Reconcile the resources whose key is `in_scope` with `desired`.
    fn reconcile_where(
        &self,
        in_scope: impl Fn(&ResourceKey) -> bool,
        desired: Vec<DesiredResource>,
    ) {
        let now = SystemTime::now();
        let mut inner = self.lock();
        let generation = inner.generation;
        let map = &mut inner.map;
        let wanted: HashSet<ResourceKey> = desired.iter().map(|d| d.key.clone()).collect();
        let gone: Vec<ResourceKey> = map
            .keys()
            .filter(|k| in_scope(k) && !wanted.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(resource) = map.remove(&key) {
                let _ = self.tx.send(Change {
                    generation,
                    kind: ChangeKind::Destroyed,
                    resource,
                    old: None,
                });
            }
        }
        for d in desired {
            match map.get_mut(&d.key) {
                Some(existing) if existing.desired == d => {}
                Some(existing) => {
                    let old = existing.clone();
                    existing.desired = d;
                    existing.version += 1;
                    existing.updated = now;
                    let _ = self.tx.send(Change {
                        generation,
                        kind: ChangeKind::Updated,
                        resource: existing.clone(),
                        old: Some(old),
                    });
                }
                None => {
                    let resource = StoredResource {
                        desired: d,
                        version: 1,
                        created: now,
                        updated: now,
                    };
                    map.insert(resource.key().clone(), resource.clone());
                    let _ = self.tx.send(Change {
                        generation,
                        kind: ChangeKind::Created,
                        resource,
                        old: None,
                    });
                }
            }
        }
    }

    /// Forget everything without events (a reboot: every watcher's connection is gone anyway).
    pub(crate) fn clear(&self) {
        let mut inner = self.lock();
        inner.map.clear();
        inner.generation += 1;
    }

    pub(crate) fn get(&self, key: &ResourceKey) -> Option<StoredResource> {
        self.lock().map.get(key).cloned()
    }

    pub(crate) fn version_of(&self, namespace: &str, type_: &str, id: &str) -> u64 {
        let key = ResourceKey {
            namespace: namespace.to_string(),
            type_: type_.to_string(),
            id: id.to_string(),
        };
        self.get(&key).map_or(0, |r| r.version)
    }

    /// All resources of a kind, ordered by id.
    pub(crate) fn list(&self, namespace: &str, type_: &str) -> Vec<StoredResource> {
        self.lock()
            .map
            .values()
            .filter(|r| r.key().namespace == namespace && r.key().type_ == type_)
            .cloned()
            .collect()
    }

    /// Current resources of a kind, a change receiver and the store generation, taken atomically.
    pub(crate) fn watch(
        &self,
        namespace: &str,
        type_: &str,
    ) -> (Vec<StoredResource>, broadcast::Receiver<Change>, u64) {
        let inner = self.lock();
        let rx = self.tx.subscribe();
        let current = inner
            .map
            .values()
            .filter(|r| r.key().namespace == namespace && r.key().type_ == type_)
            .cloned()
            .collect();
        (current, rx, inner.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desired(id: &str, spec: &[u8]) -> DesiredResource {
        DesiredResource {
            key: ResourceKey {
                namespace: "runtime".into(),
                type_: "T".into(),
                id: id.into(),
            },
            owner: String::new(),
            proto_spec: spec.to_vec(),
            yaml_spec: String::new(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn versions_bump_only_on_change() {
        let store = ResourceStore::new();
        let (_, mut rx, _) = store.watch("runtime", "T");
        store.reconcile(vec![desired("a", b"1")]);
        store.reconcile(vec![desired("a", b"1")]);
        store.reconcile(vec![desired("a", b"2")]);
        assert_eq!(store.version_of("runtime", "T", "a"), 2);
        assert_eq!(rx.try_recv().unwrap().kind, ChangeKind::Created);
        let update = rx.try_recv().unwrap();
        assert_eq!(update.kind, ChangeKind::Updated);
        assert_eq!(update.old.unwrap().version, 1);
        store.reconcile(vec![]);
        assert_eq!(rx.try_recv().unwrap().kind, ChangeKind::Destroyed);
        assert!(rx.try_recv().is_err());
    }

    #[test]
    fn the_cluster_namespace_is_reconciled_apart() {
        let store = ResourceStore::new();
        let mut member = desired("m", b"1");
        member.key.namespace = CLUSTER_NS.into();
        store.reconcile_namespace(CLUSTER_NS, vec![member]);
        store.reconcile(vec![desired("a", b"1")]);
        // The node's own reconcile leaves what discovery put there, and the other way round.
        assert_eq!(store.version_of(CLUSTER_NS, "T", "m"), 1);
        store.reconcile_namespace(CLUSTER_NS, vec![]);
        assert_eq!(store.version_of(CLUSTER_NS, "T", "m"), 0);
        assert_eq!(store.version_of("runtime", "T", "a"), 1);
    }
}
