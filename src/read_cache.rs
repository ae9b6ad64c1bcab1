//! Reads the reconciles reuse, and what a metadata-only watch last saw of one kind of object, so that a
//! reconcile can reuse what it read before instead of asking the API server again.
//!
//! Every reconcile used to read a cluster's progress ConfigMap and list its Machines, although they rarely
//! change between two reconciles a second apart. A cached read is reused only while the watch has seen
//! exactly the same objects at exactly the same resourceVersions as the read returned (its
//! [`Fingerprint`]); anything else (an edit, a deletion, a new Machine, the watch not yet synced or broken)
//! makes the next reconcile read again. The watch carries object metadata only, and this keeps only
//! names and resourceVersions.
//!
//! The cache can never serve something the watch knows to be out of date; it can serve something a
//! write not yet seen by the watch has changed, which is why progress is still written with
//! `resourceVersion` (a stale read ends in a conflict, never in an overwrite). A value this process
//! wrote itself is served while the watch has not seen that write yet but still shows what it
//! replaced ([`CachedReads::keep_written`]): under load the watch is behind, and a reconcile right
//! after a save would otherwise read the record again.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;

/// The names and resourceVersions of a group of objects, reduced to a number. Two reads of the same
/// objects at the same versions have the same fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(u64);

impl Fingerprint {
    /// The fingerprint of objects given as (name, resourceVersion), in any order.
    pub fn of<'a>(objects: impl IntoIterator<Item = (&'a str, &'a str)>) -> Fingerprint {
        let sorted: BTreeMap<&str, &str> = objects.into_iter().collect();
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        sorted.hash(&mut hasher);
        Fingerprint(hasher.finish())
    }

    /// The fingerprint of no objects (a ConfigMap that does not exist, a cluster without Machines).
    pub fn none() -> Fingerprint {
        Fingerprint::of([])
    }
}

/// The watch's view: objects grouped by key `K` (name → resourceVersion).
struct View<K> {
    /// False until the first complete list arrived, and again after an error until the watch is back.
    synced: bool,
    /// A complete list arrived once (a watch that breaks afterwards resumes where it stopped).
    listed: bool,
    groups: HashMap<K, BTreeMap<String, String>>,
    /// The objects of a relist in progress, swapped in when it is complete.
    relisting: Option<HashMap<K, BTreeMap<String, String>>>,
}

impl<K> View<K> {
    /// A watch that delivers a change after an error resumed where it stopped (one that cannot resume
    /// relists instead), so nothing was missed.
    fn resumed(&mut self) {
        if self.listed && self.relisting.is_none() {
            self.synced = true;
        }
    }
}

/// A metadata watch's view of one kind, grouped by `K`.
pub struct SeenVersions<K> {
    view: Mutex<View<K>>,
}

impl<K> Default for SeenVersions<K> {
    fn default() -> Self {
        SeenVersions {
            view: Mutex::new(View {
                synced: false,
                listed: false,
                groups: HashMap::new(),
                relisting: None,
            }),
        }
    }
}

/// One change the watch reports, reduced to what [`SeenVersions`] keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen<K> {
    /// The watch (re)starts listing everything.
    Relist,
    /// An object during a relist, or created or changed afterwards.
    Present {
        key: K,
        name: String,
        version: String,
    },
    Deleted {
        key: K,
        name: String,
    },
    /// The relist is complete.
    Listed,
    /// The watch failed; it retries, and until it is back nothing it saw can be trusted.
    Broken,
}

impl<K: Hash + Eq + Clone> SeenVersions<K> {
    fn view(&self) -> std::sync::MutexGuard<'_, View<K>> {
        self.view
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The fingerprint of the group `key` as the watch last saw it; `None` while the watch is not
    /// synced (nothing may be reused then).
    pub fn fingerprint(&self, key: &K) -> Option<Fingerprint> {
        let view = self.view();
        if !view.synced {
            return None;
        }
        Some(
            view.groups
                .get(key)
                .map_or_else(Fingerprint::none, |group| {
                    Fingerprint::of(group.iter().map(|(n, v)| (n.as_str(), v.as_str())))
                }),
        )
    }

    /// Whether a read of group `key` whose result had fingerprint `read` is still what the watch sees.
    pub fn still_current(&self, key: &K, read: Fingerprint) -> bool {
        self.fingerprint(key) == Some(read)
    }

    /// Takes in one change.
    pub fn record(&self, seen: Seen<K>) {
        let mut view = self.view();
        let view = &mut *view;
        match seen {
            Seen::Relist => view.relisting = Some(HashMap::new()),
            Seen::Present { key, name, version } => {
                let groups = view.relisting.as_mut().unwrap_or(&mut view.groups);
                groups.entry(key).or_default().insert(name, version);
                view.resumed();
            }
            Seen::Deleted { key, name } => {
                let groups = view.relisting.as_mut().unwrap_or(&mut view.groups);
                if let Some(group) = groups.get_mut(&key) {
                    group.remove(&name);
                    if group.is_empty() {
                        groups.remove(&key);
                    }
                }
                view.resumed();
            }
            Seen::Listed => {
                if let Some(listed) = view.relisting.take() {
                    view.groups = listed;
                }
                view.synced = true;
                view.listed = true;
            }
            Seen::Broken => view.synced = false,
        }
    }

    /// Follows `api`'s objects until the controller stops, grouping them by `key_of` (objects it returns
    /// `None` for are not kept). Metadata only: `Api<PartialObjectMeta<_>>` asks for nothing else.
    ///
    /// After an error the watch starts over with a list, after a pause. kube's watcher would resume
    /// from where it stopped and say nothing when it is back, so the view stayed broken until the next
    /// change: for the Machines, which rarely change, every reconcile of every cluster listed them
    /// again after one broken watch (a 1-cluster run with the guide's timings: 11 Machine lists).
    pub async fn follow<R>(
        &self,
        api: Api<PartialObjectMeta<R>>,
        config: watcher::Config,
        what: &'static str,
        key_of: impl Fn(&PartialObjectMeta<R>) -> Option<K>,
    ) where
        R: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let mut pause = WATCH_RETRY_MIN;
        loop {
            let started = std::time::Instant::now();
            let events = watcher::watcher(api.clone(), config.clone());
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                let present = |object: &PartialObjectMeta<R>| {
                    key_of(object).map(|key| Seen::Present {
                        key,
                        name: object.name_any(),
                        version: object.resource_version().unwrap_or_default(),
                    })
                };
                let seen = match event {
                    Ok(watcher::Event::Init) => Some(Seen::Relist),
                    Ok(watcher::Event::InitApply(object) | watcher::Event::Apply(object)) => {
                        present(&object)
                    }
                    Ok(watcher::Event::Delete(object)) => {
                        key_of(&object).map(|key| Seen::Deleted {
                            key,
                            name: object.name_any(),
                        })
                    }
                    Ok(watcher::Event::InitDone) => Some(Seen::Listed),
                    Err(error) => {
                        // Debug only: a kind that is not installed (no Machine CRD) fails this way
                        // for good, and reads then simply go to the API server every time.
                        tracing::debug!(%error, what, "metadata watch failed; reading without it until it is back");
                        self.record(Seen::Broken);
                        break;
                    }
                };
                if let Some(seen) = seen {
                    self.record(seen);
                }
            }
            // A watch that ran a while starts again soon; one that keeps failing, ever later.
            pause = if started.elapsed() > WATCH_RETRY_MAX {
                WATCH_RETRY_MIN
            } else {
                (pause * 2).min(WATCH_RETRY_MAX)
            };
            tokio::time::sleep(pause).await;
        }
    }
}

/// How long each watch request of the controller's own watches lasts (kube's default: 290 s, under
/// kube's 295 s read timeout). Every renewal is a request; client-go's reflectors ask for 5 to 10
/// minutes. The connections are HTTP/2 with pings (see [`crate::api_client`]) and the API server sends
/// a bookmark about every minute, so a longer watch does not run into the read timeout; a watch that
/// something in between cuts short is renewed (closed) or started over (an error, see
/// [`SeenVersions::follow`]), as before.
pub const WATCH_TIMEOUT_SECS: u32 = 600;

/// The pauses before a metadata watch starts over after an error (see [`SeenVersions::follow`]).
const WATCH_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(500);
const WATCH_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// Reads of one kind kept per key `K`, each reused while [`SeenVersions`] says it is still current.
pub struct CachedReads<K, V> {
    pub seen: SeenVersions<K>,
    reads: Mutex<HashMap<K, Kept<V>>>,
}

/// How many of its own writes in a row the watch may be behind before a kept write is read again.
const OWN_WRITES_AHEAD: usize = 8;

/// One kept read or write.
struct Kept<V> {
    /// The objects as read or written.
    read: Fingerprint,
    value: V,
    /// What this process itself replaced to come to `read`, in a chain of its own writes since the
    /// last read (oldest first): while the watch still shows one of them it is only behind these
    /// writes, and `value` is still the newest (see [`CachedReads::keep_written`]).
    replaced: Vec<Fingerprint>,
}

impl<K, V> Default for CachedReads<K, V> {
    fn default() -> Self {
        CachedReads {
            seen: SeenVersions::default(),
            reads: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone, V: Clone> CachedReads<K, V> {
    fn reads(&self) -> std::sync::MutexGuard<'_, HashMap<K, Kept<V>>> {
        self.reads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The value last read for `key`, if the objects it was read from are unchanged (or, for a value
    /// this process wrote, if the watch has not seen anything since but what that write replaced). A
    /// read that is no longer current is dropped.
    pub fn get(&self, key: &K) -> Option<V> {
        let mut reads = self.reads();
        let kept = reads.get_mut(key)?;
        let seen = self.seen.fingerprint(key);
        if seen == Some(kept.read) {
            // The watch has caught up with the writes.
            kept.replaced.clear();
            return Some(kept.value.clone());
        }
        if seen.is_some_and(|seen| kept.replaced.contains(&seen)) {
            return Some(kept.value.clone());
        }
        reads.remove(key);
        None
    }

    /// Keeps `value`, read (or written) from objects whose fingerprint is `read`.
    pub fn keep(&self, key: K, read: Fingerprint, value: V) {
        self.reads().insert(
            key,
            Kept {
                read,
                value,
                replaced: Vec::new(),
            },
        );
    }

    /// Keeps `value`, just written by this process over the objects at `replaced` (with
    /// resourceVersion preconditions), now at `written`. Under load the watch shows a write a while
    /// after its answer, often after the next reconcile's read; until then it still shows what the
    /// write replaced, or an earlier write of this process's own chain, and that is no reason to read
    /// again. Anything else it shows (someone else's write, a deletion) drops the value as before.
    /// Served before the watch caught up, the value can be older than a write of someone else's not
    /// yet seen: the next write at its resourceVersion then ends in a conflict, as after any stale
    /// read (see the module documentation).
    ///
    /// A write that created the objects (`replaced` is [`Fingerprint::none`]) is kept as a read is:
    /// a version, once replaced, never comes back, but absence does (a deletion after the write), and
    /// the watch showing it then must not serve the deleted value.
    pub fn keep_written(&self, key: K, replaced: Fingerprint, written: Fingerprint, value: V) {
        if replaced == Fingerprint::none() {
            self.keep(key, written, value);
            return;
        }
        let mut reads = self.reads();
        let mut chain = match reads.remove(&key) {
            // A chain of this process's own writes: each replaced what the one before wrote.
            Some(kept) if kept.read == replaced => kept.replaced,
            _ => Vec::new(),
        };
        chain.push(replaced);
        if chain.len() > OWN_WRITES_AHEAD {
            chain.remove(0);
        }
        reads.insert(
            key,
            Kept {
                read: written,
                value,
                replaced: chain,
            },
        );
    }

    /// Drops what is kept for `key` (after a conflict: someone else wrote).
    pub fn forget(&self, key: &K) {
        self.reads().remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn present(key: &str, name: &str, version: &str) -> Seen<String> {
        Seen::Present {
            key: key.into(),
            name: name.into(),
            version: version.into(),
        }
    }

    fn synced(events: Vec<Seen<String>>) -> SeenVersions<String> {
        let seen = SeenVersions::default();
        seen.record(Seen::Relist);
        for event in events {
            seen.record(event);
        }
        seen.record(Seen::Listed);
        seen
    }

    #[test]
    fn a_read_is_reused_only_while_the_watch_sees_the_same_objects_at_the_same_versions() {
        let read = Fingerprint::of([("m1", "10"), ("m2", "11")]);
        let same_in_other_order = Fingerprint::of([("m2", "11"), ("m1", "10")]);
        assert_eq!(read, same_in_other_order);

        struct Case {
            name: &'static str,
            after_list: Vec<Seen<String>>,
            reusable: bool,
        }
        let cases = [
            Case {
                name: "nothing changed",
                after_list: vec![],
                reusable: true,
            },
            Case {
                name: "a Machine changed",
                after_list: vec![present("c", "m2", "12")],
                reusable: false,
            },
            Case {
                name: "a Machine was added",
                after_list: vec![present("c", "m3", "13")],
                reusable: false,
            },
            Case {
                name: "a Machine was deleted",
                after_list: vec![Seen::Deleted {
                    key: "c".into(),
                    name: "m1".into(),
                }],
                reusable: false,
            },
            Case {
                name: "another cluster's Machine changed",
                after_list: vec![present("other", "x1", "14")],
                reusable: true,
            },
            Case {
                name: "the watch broke",
                after_list: vec![Seen::Broken],
                reusable: false,
            },
            Case {
                name: "the watch broke and resumed with a change elsewhere",
                after_list: vec![Seen::Broken, present("other", "x1", "14")],
                reusable: true,
            },
            Case {
                name: "the watch is relisting",
                after_list: vec![Seen::Relist, present("c", "m1", "10")],
                reusable: true,
            },
            Case {
                name: "a relist without one of the Machines",
                after_list: vec![Seen::Relist, present("c", "m1", "10"), Seen::Listed],
                reusable: false,
            },
        ];
        for case in cases {
            let seen = synced(vec![present("c", "m1", "10"), present("c", "m2", "11")]);
            for event in case.after_list {
                seen.record(event);
            }
            let key = "c".to_string();
            assert_eq!(
                seen.still_current(&key, read),
                case.reusable,
                "{}",
                case.name
            );
        }
    }

    #[test]
    fn nothing_is_reused_before_the_first_list_and_an_absent_object_is_a_fingerprint_too() {
        let seen = SeenVersions::<String>::default();
        assert_eq!(seen.fingerprint(&"c".to_string()), None);
        seen.record(present("c", "cm", "5"));
        assert_eq!(
            seen.fingerprint(&"c".to_string()),
            None,
            "a change before any list"
        );

        let seen = synced(vec![]);
        assert!(seen.still_current(&"c".to_string(), Fingerprint::none()));
        seen.record(present("c", "cm", "5"));
        assert!(!seen.still_current(&"c".to_string(), Fingerprint::none()));
        assert!(seen.still_current(&"c".to_string(), Fingerprint::of([("cm", "5")])));
    }

    #[test]
    fn a_kept_read_is_dropped_once_its_objects_change_and_forgotten_after_a_conflict() {
        let reads = CachedReads::<String, &str>::default();
        let key = "c".to_string();
        reads.seen.record(Seen::Relist);
        reads.seen.record(present("c", "cm", "5"));
        reads.seen.record(Seen::Listed);

        reads.keep(key.clone(), Fingerprint::of([("cm", "5")]), "as read at 5");
        assert_eq!(reads.get(&key), Some("as read at 5"));
        // Kept as a read at 6 while the watch shows 5: not reused.
        reads.keep(
            key.clone(),
            Fingerprint::of([("cm", "6")]),
            "as written at 6",
        );
        assert_eq!(reads.get(&key), None);
        reads.keep(
            key.clone(),
            Fingerprint::of([("cm", "6")]),
            "as written at 6",
        );
        reads.seen.record(present("c", "cm", "6"));
        assert_eq!(reads.get(&key), Some("as written at 6"));
        // Someone else writes 7: dropped, and stays dropped.
        reads.seen.record(present("c", "cm", "7"));
        assert_eq!(reads.get(&key), None);
        reads.seen.record(present("c", "cm", "6"));
        assert_eq!(reads.get(&key), None, "a dropped read does not come back");

        reads.keep(
            key.clone(),
            Fingerprint::of([("cm", "6")]),
            "as written at 6",
        );
        reads.forget(&key);
        assert_eq!(reads.get(&key), None);
    }

    #[test]
    fn an_own_write_is_reused_while_the_watch_shows_only_what_it_replaced() {
        let fp = |version: &str| Fingerprint::of([("cm", version)]);
        let key = "c".to_string();
        let listed_at = |version: &str| {
            let reads = CachedReads::<String, &str>::default();
            reads.seen.record(Seen::Relist);
            reads.seen.record(present("c", "cm", version));
            reads.seen.record(Seen::Listed);
            reads
        };

        // Read at 5, then written at 6 and 7 by this process: reused while the watch shows 5 or 6.
        let reads = listed_at("5");
        reads.keep(key.clone(), fp("5"), "read at 5");
        reads.keep_written(key.clone(), fp("5"), fp("6"), "written at 6");
        assert_eq!(reads.get(&key), Some("written at 6"), "the watch at 5");
        reads.keep_written(key.clone(), fp("6"), fp("7"), "written at 7");
        assert_eq!(reads.get(&key), Some("written at 7"), "still at 5");
        reads.seen.record(present("c", "cm", "6"));
        assert_eq!(reads.get(&key), Some("written at 7"), "at 6");
        reads.seen.record(present("c", "cm", "7"));
        assert_eq!(reads.get(&key), Some("written at 7"), "caught up");
        // Someone else's write after it: dropped.
        reads.seen.record(present("c", "cm", "8"));
        assert_eq!(reads.get(&key), None, "someone else wrote 8");

        // Someone else's write (or a deletion) seen before this process's own: dropped.
        for (name, seen) in [("someone else wrote", Some("9")), ("deleted", None::<&str>)] {
            let reads = listed_at("5");
            reads.keep(key.clone(), fp("5"), "read at 5");
            reads.keep_written(key.clone(), fp("5"), fp("6"), "written at 6");
            match seen {
                Some(version) => reads.seen.record(present("c", "cm", version)),
                None => reads.seen.record(Seen::Deleted {
                    key: key.clone(),
                    name: "cm".into(),
                }),
            }
            assert_eq!(reads.get(&key), None, "{name}");
        }

        // A write over a version the kept value was not at starts no chain from it.
        let reads = listed_at("5");
        reads.keep(key.clone(), fp("4"), "read at 4");
        reads.keep_written(key.clone(), fp("5"), fp("6"), "written at 6 over 5");
        reads.seen.record(present("c", "cm", "4"));
        assert_eq!(reads.get(&key), None, "4 was not replaced by this process");

        // A create is kept as a read: absence can come back (a deletion) and must not serve it.
        let reads = CachedReads::<String, &str>::default();
        reads.seen.record(Seen::Relist);
        reads.seen.record(Seen::Listed);
        reads.keep_written(key.clone(), Fingerprint::none(), fp("3"), "created at 3");
        assert_eq!(reads.get(&key), None, "the watch has not seen the create");
        reads.keep_written(key.clone(), Fingerprint::none(), fp("3"), "created at 3");
        reads.seen.record(present("c", "cm", "3"));
        assert_eq!(reads.get(&key), Some("created at 3"));

        // The watch broken: nothing is reused, own writes or not.
        let reads = listed_at("5");
        reads.keep_written(key.clone(), fp("5"), fp("6"), "written at 6");
        reads.seen.record(Seen::Broken);
        assert_eq!(reads.get(&key), None, "broken");
    }
}
