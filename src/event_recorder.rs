//! Publishing the controller's Kubernetes Events (`events.k8s.io/v1`), as kube's
//! `kube::runtime::events::Recorder` does, with a cache sized to what it holds.
//!
//! Like kube's recorder, an Event that repeats one published less than [`SERIES_TTL`] ago (same type,
//! reason, action, regarding and related object, from the same controller and instance) is not a new
//! object: the first one's `series` counts it (`count` from 2, `lastObservedTime`). Which Events
//! become a series is kube's rule, unchanged: `report::event_action` puts a digest of the message in
//! the action so that only identical messages fold.
//!
//! What differs is the cache. kube's keeps, for every series of the last six minutes, a full copy
//! of the Event and of its key (about 1.4 KB in the table alone, and the strings besides), and sweeps
//! the whole table under one write lock on every publish: with a fleet upgrading, that is a table
//! of every Event the fleet was told in six minutes (at 1,000 nodes, about 2,500 Events, a hash
//! table of 5.9 MB in the heap profile, docs/performance.md), scanned 2,500 times. Here a series is a
//! 64-bit digest of its key, the Event's name and its count (under 100 bytes with the name), and
//! the sweep runs at most once a minute.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};

/// How long an Event stays the start of a series its repeats count up (kube's recorder: six
/// minutes).
pub const SERIES_TTL: SignedDuration = SignedDuration::from_mins(6);

/// How often the series older than [`SERIES_TTL`] are let go of.
const SWEEP_EVERY: SignedDuration = SignedDuration::from_mins(1);

/// One series: the Event object that counts it.
struct Series {
    /// The Event's `metadata.name`.
    name: String,
    /// Times published: 1 for the object alone, then its `series.count`.
    count: i32,
    last_observed: Timestamp,
}

struct Cache {
    /// Series by the digest of their key ([`EventRecorder::key`]). A 64-bit keyed SipHash: two keys
    /// of the few thousand kept at once share a digest with odds of about 1 in 10^12, and then
    /// a repeat counts up the other Event's series rather than a new object; nothing else.
    series: HashMap<u64, Series>,
    swept: Timestamp,
}

/// Publishes Events for the objects the controller works on (see the module's comment).
pub struct EventRecorder {
    client: kube::Client,
    controller: String,
    instance: String,
    keys: std::collections::hash_map::RandomState,
    cache: Mutex<Cache>,
}

impl EventRecorder {
    /// Events reported by `controller` (`reportingController`), from `instance`
    /// (`reportingInstance`; the controller's name without one).
    pub fn new(client: kube::Client, controller: &str, instance: Option<String>) -> EventRecorder {
        EventRecorder {
            client,
            controller: controller.to_string(),
            instance: instance.unwrap_or_else(|| controller.to_string()),
            keys: std::collections::hash_map::RandomState::new(),
            cache: Mutex::new(Cache {
                series: HashMap::new(),
                swept: Timestamp::now(),
            }),
        }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// What makes two Events one series: kube's `EventKey` (type, action, reason, the reporting
    /// controller and instance, the regarding and related objects' references).
    fn key(&self, event: &Event, regarding: &ObjectReference) -> u64 {
        let mut hasher = self.keys.build_hasher();
        matches!(event.type_, EventType::Warning).hash(&mut hasher);
        event.action.hash(&mut hasher);
        event.reason.hash(&mut hasher);
        self.controller.hash(&mut hasher);
        self.instance.hash(&mut hasher);
        hash_reference(regarding, &mut hasher);
        match &event.secondary {
            Some(related) => {
                true.hash(&mut hasher);
                hash_reference(related, &mut hasher);
            }
            None => false.hash(&mut hasher),
        }
        hasher.finish()
    }

    /// Publishes `event` about `regarding`: a new Event object, or one more of the series it repeats.
    /// The Event goes to the regarding object's namespace (`default` for a cluster-scoped one).
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = self.key(event, regarding);
        let repeat = {
            let mut cache = self.cache();
            if cache.swept + SWEEP_EVERY <= now {
                cache
                    .series
                    .retain(|_, series| series.last_observed + SERIES_TTL > now);
                cache.swept = now;
            }
            cache
                .series
                .get(&key)
                .filter(|series| series.last_observed + SERIES_TTL > now)
                .map(|series| (series.name.clone(), series.count + 1))
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), namespace);
        let (name, count) = match repeat {
            Some((name, count)) => {
                let patch = serde_json::json!({
                    "series": { "count": count, "lastObservedTime": MicroTime(now) }
                });
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                (name, count)
            }
            None => {
                let object = self.new_event(event, regarding, now);
                let name = object.metadata.name.clone().unwrap_or_default();
                events.create(&PostParams::default(), &object).await?;
                (name, 1)
            }
        };
        self.cache().series.insert(
            key,
            Series {
                name,
                count,
                last_observed: now,
            },
        );
        Ok(())
    }

    /// A new Event object, as kube's recorder makes it (its name: the regarding object's name and
    /// the time in nanoseconds, in hex).
    fn new_event(&self, event: &Event, regarding: &ObjectReference, now: Timestamp) -> K8sEvent {
        K8sEvent {
            action: Some(event.action.clone()),
            reason: Some(event.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            note: event.note.clone(),
            metadata: ObjectMeta {
                namespace: regarding.namespace.clone(),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(&self.controller),
                    now.as_nanosecond()
                )),
                ..ObjectMeta::default()
            },
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            type_: Some(
                match event.type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_string(),
            ),
            related: event.secondary.clone(),
            ..K8sEvent::default()
        }
    }

    /// How many series are kept now.
    pub fn series_kept(&self) -> usize {
        self.cache().series.len()
    }
}

/// Every field of the reference, as kube's key compares them: taken apart by name so that a field a
/// newer k8s-openapi adds fails to compile here rather than be left out of the key.
fn hash_reference(reference: &ObjectReference, hasher: &mut impl Hasher) {
    let ObjectReference {
        api_version,
        field_path,
        kind,
        name,
        namespace,
        resource_version,
        uid,
    } = reference;
    (
        api_version,
        field_path,
        kind,
        name,
        namespace,
        resource_version,
        uid,
    )
        .hash(hasher);
}
