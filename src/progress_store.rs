//! Where upgrade progress is persisted: a ConfigMap the controller owns, next to the cluster.
//!
//! Why a ConfigMap: vitistack's `KubernetesCluster` schema prunes fields it does not know, so progress
//! cannot live in the cluster's status; annotations are the user's interface and too small for a plan.
//! The ConfigMap is owned by the cluster (deleted with it by the garbage collector), written with the
//! resourceVersion it was read at (a second writer gets a conflict instead of silently overwriting), and
//! holds one JSON document per upgrade kind.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::core::PartialObjectMeta;

use crate::read_cache::{CachedReads, Fingerprint};
use talos_upgrade_core::kubernetes::{KubeRun, Kubernetes};
use talos_upgrade_core::lifecycle::{Act, Kind};
use talos_upgrade_core::talos::{Run, Talos};

const TALOS_KEY: &str = "talos.json";
const KUBERNETES_KEY: &str = "kubernetes.json";
/// The cluster's `status.phase` as a provisioning operator wrote it when one of the controller's runs
/// replaced it, given back when the run ends (see [`talos_upgrade_core::report::PhaseChange`]).
const PHASE_BEFORE_UPGRADE_KEY: &str = "phase-before-upgrade";
const MANAGED_BY: &str = "talos-upgrade-controller";
/// The multi-hop upgrade plan (`core::plan::Plan`) with the targets it was computed for; kept among
/// the other keys, so a controller that does not know plans keeps it too.
const PLAN_KEY: &str = "plan.json";
/// Label naming the cluster a progress ConfigMap belongs to.
pub const CLUSTER_LABEL: &str = "upgrade.vitistack.io/cluster";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("upgrade progress {namespace}/{name}: {source}")]
    Kube {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// Someone else wrote the progress since it was read; decide again from a fresh read.
    #[error("upgrade progress {namespace}/{name} changed since it was read")]
    Conflict { namespace: String, name: String },
    #[error("upgrade progress {namespace}/{name} key {key} is not valid: {reason}")]
    Corrupt {
        namespace: String,
        name: String,
        key: &'static str,
        reason: String,
    },
}

/// The progress of one cluster, as read (with the version it was read at).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Progress {
    pub talos: Option<Run>,
    pub kubernetes: Option<KubeRun>,
    /// The phase to give back when the controller's own phase goes (see [`PHASE_BEFORE_UPGRADE_KEY`]).
    phase_before_upgrade: Option<String>,
    /// Keys written by other versions of the controller are kept as they are.
    other: BTreeMap<String, String>,
    resource_version: Option<String>,
    /// The uid of the `KubernetesCluster` the record was written for (its owner reference).
    owner_uid: Option<String>,
}

impl Progress {
    /// The run of kind `K`.
    pub fn run<K: Stored>(&self) -> Option<&K::Run> {
        K::slot(self).as_ref()
    }

    /// The `status.phase` a provisioning operator had written when a run of this controller replaced
    /// it, to give back when the controller's own phase goes.
    pub fn phase_before_upgrade(&self) -> Option<&str> {
        self.phase_before_upgrade.as_deref()
    }

    /// The multi-hop plan being followed. One that cannot be read is no plan: it is computed again
    /// from the versions shown, and every hop's run checks its own start anyway.
    pub fn plan(&self) -> Option<talos_upgrade_core::plan::Plan> {
        self.other
            .get(PLAN_KEY)
            .and_then(|json| serde_json::from_str(json).ok())
    }

    /// The record as the cluster whose uid is `owner` may use it. A record written for another object
    /// of the same name (a cluster deleted and created again before the garbage collector removed the
    /// old one's record) is not this cluster's: it reads as empty, and the first save replaces it.
    pub fn of_owner(self, owner: Option<&str>) -> Progress {
        match (self.owner_uid.as_deref(), owner) {
            (Some(written_for), Some(owner)) if written_for != owner => Progress {
                resource_version: self.resource_version,
                owner_uid: self.owner_uid,
                ..Progress::default()
            },
            _ => self,
        }
    }
}

/// A kind of upgrade whose run the progress record holds (one JSON document per kind).
pub trait Stored: Kind {
    fn slot(progress: &Progress) -> &Option<Self::Run>;
    fn slot_mut(progress: &mut Progress) -> &mut Option<Self::Run>;
}

impl Stored for Talos {
    fn slot(progress: &Progress) -> &Option<Run> {
        &progress.talos
    }

    fn slot_mut(progress: &mut Progress) -> &mut Option<Run> {
        &mut progress.talos
    }
}

impl Stored for Kubernetes {
    fn slot(progress: &Progress) -> &Option<KubeRun> {
        &progress.kubernetes
    }

    fn slot_mut(progress: &mut Progress) -> &mut Option<KubeRun> {
        &mut progress.kubernetes
    }
}

/// Something the progress record holds as written: the only form in which the calls of a decision
/// are made (see [`Records::write_ahead`]), so no call can be sent before the run that records it is
/// saved. Only this module makes one.
#[derive(Debug)]
pub struct Saved<T>(T);

impl<T> Saved<T> {
    pub fn get(&self) -> &T {
        &self.0
    }
}

/// One cluster's progress record in a reconcile, and where it is saved: shared by both kinds, so each
/// kind's run is written over the other's latest version.
pub struct Records<'a> {
    store: &'a ProgressStore,
    cluster: String,
    owner: Option<OwnerReference>,
    progress: Progress,
}

impl<'a> Records<'a> {
    pub fn new(
        store: &'a ProgressStore,
        cluster: &str,
        owner: Option<OwnerReference>,
        progress: Progress,
    ) -> Self {
        Records {
            store,
            cluster: cluster.to_string(),
            owner,
            progress,
        }
    }

    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Keeps `run` as the run of kind `K`, saving the record when that changes it.
    pub async fn keep<K: Stored>(&mut self, run: Option<K::Run>) -> Result<(), StoreError> {
        if *K::slot(&self.progress) == run {
            return Ok(());
        }
        *K::slot_mut(&mut self.progress) = run;
        self.store
            .save(&self.cluster, self.owner.clone(), &mut self.progress)
            .await
    }

    /// Keeps `phase` as the phase to give back, saving the record when that changes it.
    pub async fn keep_phase_before_upgrade(
        &mut self,
        phase: Option<String>,
    ) -> Result<(), StoreError> {
        if self.progress.phase_before_upgrade == phase {
            return Ok(());
        }
        self.progress.phase_before_upgrade = phase;
        self.store
            .save(&self.cluster, self.owner.clone(), &mut self.progress)
            .await
    }

    /// Keeps `plan` as the multi-hop plan, saving the record when that changes it.
    pub async fn keep_plan(
        &mut self,
        plan: Option<&talos_upgrade_core::plan::Plan>,
    ) -> Result<(), StoreError> {
        if self.progress.plan().as_ref() == plan {
            return Ok(());
        }
        match plan {
            Some(plan) => self.progress.other.insert(
                PLAN_KEY.to_string(),
                serde_json::to_string_pretty(plan).expect("a plan always serializes"),
            ),
            None => self.progress.other.remove(PLAN_KEY),
        };
        self.store
            .save(&self.cluster, self.owner.clone(), &mut self.progress)
            .await
    }

    /// The write-ahead: saves the run with every call about to be made recorded, and only then hands
    /// the calls back, as [`Saved`]. Should the save fail, no call is made; the next reconcile decides
    /// again from a fresh read.
    pub async fn write_ahead<K: Stored>(
        &mut self,
        act: Act<K>,
    ) -> Result<Saved<Act<K>>, StoreError> {
        self.keep::<K>(Some(act.run.clone())).await?;
        Ok(Saved(act))
    }
}

/// Progress records kept between reconciles, keyed by (namespace, ConfigMap name): a reconcile reuses
/// the record the last one read or wrote while a watch of the progress ConfigMaps shows it unchanged,
/// and that there is none, for at most [`ABSENCE_REREAD`] (see [`ProgressStore::remember`]).
pub type ProgressCache = CachedReads<(String, String), KeptProgress>;

/// A progress record as kept between reconciles.
#[derive(Debug, Clone)]
pub struct KeptProgress {
    progress: Progress,
    /// When the record was read and found absent.
    absent_since: Option<std::time::Instant>,
}

/// How long that a cluster has no progress record is reused at most: a record made by hand without
/// the controller's label is not seen by the watch (see [`ProgressStore::remember`]).
pub const ABSENCE_REREAD: std::time::Duration = std::time::Duration::from_secs(60 * 60);

/// Keeps `cache` current: follows the progress ConfigMaps in `namespace` (or everywhere), metadata only
/// and by their label, until the controller stops.
pub async fn follow_progress(cache: &ProgressCache, client: kube::Client, namespace: Option<&str>) {
    let api: Api<PartialObjectMeta<ConfigMap>> = match namespace {
        Some(namespace) => Api::namespaced(client, namespace),
        None => Api::all(client),
    };
    let selector = format!("app.kubernetes.io/managed-by={MANAGED_BY}");
    let config = kube::runtime::watcher::Config::default()
        .labels(&selector)
        .timeout(crate::read_cache::WATCH_TIMEOUT_SECS);
    cache
        .seen
        .follow(api, config, "progress ConfigMaps", |configmap| {
            Some((
                configmap.namespace().unwrap_or_default(),
                configmap.name_any(),
            ))
        })
        .await;
}

/// Reads and writes progress ConfigMaps in one namespace.
#[derive(Clone)]
pub struct ProgressStore {
    api: Api<ConfigMap>,
    namespace: String,
    cache: Option<Arc<ProgressCache>>,
}

/// The ConfigMap name for a cluster's progress.
pub fn configmap_name(cluster: &str) -> String {
    // Cluster names are DNS subdomains of at most 253 characters; keep the result within that.
    let mut name = format!("talos-upgrade-{cluster}");
    name.truncate(253);
    name
}

impl ProgressStore {
    pub fn new(client: kube::Client, namespace: &str) -> Self {
        ProgressStore {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_string(),
            cache: None,
        }
    }

    /// Reuses records through `cache` (see [`ProgressCache`]).
    pub fn with_cache(mut self, cache: Arc<ProgressCache>) -> Self {
        self.cache = Some(cache);
        self
    }

    fn cache_key(&self, name: &str) -> (String, String) {
        (self.namespace.clone(), name.to_string())
    }

    /// Keeps what was just read or written, as the ConfigMap at `progress.resource_version`.
    ///
    /// That there is no record is kept too, while the watch shows no ConfigMap of that name, and for at
    /// most [`ABSENCE_REREAD`]: a cluster that never had a run would otherwise read its absent record at
    /// every idle refresh and again when its first run starts. The watch sees only ConfigMaps with the
    /// controller's label, and a record someone creates by hand (a restore, a mistake) may carry none;
    /// such a record is still never written over: the first save creates the ConfigMap, which the API
    /// server refuses when one exists (a conflict: the record is read again and decided on), and
    /// otherwise it is read within the hour. A record the controller wrote keeps its label, and losing
    /// it looks like a deletion to the watch.
    fn remember(&self, name: &str, progress: &Progress) {
        let Some(cache) = &self.cache else {
            return;
        };
        let (read, absent_since) = match &progress.resource_version {
            Some(version) => (Fingerprint::of([(name, version.as_str())]), None),
            None => (Fingerprint::none(), Some(std::time::Instant::now())),
        };
        cache.keep(
            self.cache_key(name),
            read,
            KeptProgress {
                progress: progress.clone(),
                absent_since,
            },
        );
    }

    /// Keeps what was just written over the ConfigMap at `replaced` (`None`: created): reused while
    /// the watch shows it or, not having seen the write yet, what it replaced (see
    /// [`CachedReads::keep_written`]). Under load the watch is often behind: a reconcile right after
    /// a save (a node back, the next one started) would otherwise read the record again.
    fn remember_written(&self, name: &str, replaced: Option<&str>, progress: &Progress) {
        let (Some(cache), Some(version)) = (&self.cache, &progress.resource_version) else {
            return self.remember(name, progress);
        };
        cache.keep_written(
            self.cache_key(name),
            replaced.map_or_else(Fingerprint::none, |replaced| {
                Fingerprint::of([(name, replaced)])
            }),
            Fingerprint::of([(name, version.as_str())]),
            KeptProgress {
                progress: progress.clone(),
                absent_since: None,
            },
        );
    }

    /// Drops the kept record (after a failed save: the next load reads).
    fn forget(&self, name: &str) {
        if let Some(cache) = &self.cache {
            cache.forget(&self.cache_key(name));
        }
    }

    fn kube_error(&self, name: &str) -> impl FnOnce(kube::Error) -> StoreError {
        let (namespace, name) = (self.namespace.clone(), name.to_string());
        move |source| StoreError::Kube {
            namespace,
            name,
            source,
        }
    }

    /// The cluster's progress; empty when nothing was ever written.
    pub async fn load(&self, cluster: &str) -> Result<Progress, StoreError> {
        let name = configmap_name(cluster);
        if let Some(kept) = self
            .cache
            .as_ref()
            .and_then(|cache| cache.get(&self.cache_key(&name)))
            .filter(|kept| {
                kept.absent_since
                    .is_none_or(|since| since.elapsed() < ABSENCE_REREAD)
            })
        {
            return Ok(kept.progress);
        }
        let progress = self.read(&name).await?;
        self.remember(&name, &progress);
        Ok(progress)
    }

    async fn read(&self, name: &str) -> Result<Progress, StoreError> {
        let Some(configmap) = self
            .api
            .get_opt(name)
            .await
            .map_err(self.kube_error(name))?
        else {
            return Ok(Progress::default());
        };
        let owner_uid = configmap
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|owner| owner.kind == "KubernetesCluster")
            .map(|owner| owner.uid.clone());
        let mut data = configmap.data.unwrap_or_default();
        let talos = self.decode(name, &mut data, TALOS_KEY)?;
        let kubernetes = self.decode(name, &mut data, KUBERNETES_KEY)?;
        let phase_before_upgrade = data.remove(PHASE_BEFORE_UPGRADE_KEY);
        Ok(Progress {
            talos,
            kubernetes,
            phase_before_upgrade,
            other: data,
            resource_version: configmap.metadata.resource_version,
            owner_uid,
        })
    }

    /// Takes one JSON document out of the ConfigMap's data.
    fn decode<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        data: &mut BTreeMap<String, String>,
        key: &'static str,
    ) -> Result<Option<T>, StoreError> {
        data.remove(key)
            .map(|json| {
                serde_json::from_str(&json).map_err(|e| StoreError::Corrupt {
                    namespace: self.namespace.clone(),
                    name: name.to_string(),
                    key,
                    reason: e.to_string(),
                })
            })
            .transpose()
    }

    /// Writes `progress` if nobody else wrote since it was read (or creates it), and remembers the new
    /// version so the same `Progress` can be saved again. Must succeed before any call it records is made.
    pub async fn save(
        &self,
        cluster: &str,
        owner: Option<OwnerReference>,
        progress: &mut Progress,
    ) -> Result<(), StoreError> {
        let name = configmap_name(cluster);
        let owner_uid = owner.as_ref().map(|owner| owner.uid.clone());
        let mut data = progress.other.clone();
        if let Some(run) = &progress.talos {
            data.insert(
                TALOS_KEY.to_string(),
                serde_json::to_string_pretty(run).expect("a run always serializes"),
            );
        }
        if let Some(run) = &progress.kubernetes {
            data.insert(
                KUBERNETES_KEY.to_string(),
                serde_json::to_string_pretty(run).expect("a run always serializes"),
            );
        }
        if let Some(phase) = &progress.phase_before_upgrade {
            data.insert(PHASE_BEFORE_UPGRADE_KEY.to_string(), phase.clone());
        }
        let configmap = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([
                    (
                        "app.kubernetes.io/managed-by".to_string(),
                        MANAGED_BY.to_string(),
                    ),
                    (CLUSTER_LABEL.to_string(), label_value(cluster)),
                ])),
                owner_references: owner.map(|o| vec![o]),
                resource_version: progress.resource_version.clone(),
                ..ObjectMeta::default()
            },
            data: Some(data),
            ..ConfigMap::default()
        };
        let written = match &progress.resource_version {
            None => self.api.create(&PostParams::default(), &configmap).await,
            Some(_) => {
                self.api
                    .replace(&name, &PostParams::default(), &configmap)
                    .await
            }
        };
        match written {
            Ok(stored) => {
                let replaced = progress.resource_version.take();
                progress.resource_version = stored.metadata.resource_version;
                progress.owner_uid = owner_uid;
                self.remember_written(&name, replaced.as_deref(), progress);
                Ok(())
            }
            // 409: replaced at a stale version, or created while someone else created it.
            Err(kube::Error::Api(status)) if status.code == 409 => {
                self.forget(&name);
                Err(StoreError::Conflict {
                    namespace: self.namespace.clone(),
                    name,
                })
            }
            Err(source) => {
                self.forget(&name);
                Err(self.kube_error(&name)(source))
            }
        }
    }
}

/// Label values are at most 63 characters; longer cluster names are cut (the label is informational).
fn label_value(cluster: &str) -> String {
    let mut value: String = cluster.chars().take(63).collect();
    while value.ends_with(['-', '.', '_']) {
        value.pop();
    }
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record_of(owner: Option<&str>) -> Progress {
        Progress {
            talos: Some(Run {
                requested: "1.12.0".to_string(),
                target: "1.12.0".to_string(),
                started_at: jiff::Timestamp::UNIX_EPOCH,
                outcome: None,
                gates: Default::default(),
                previous: Default::default(),
                rollback: None,
                nodes: Vec::new(),
            }),
            phase_before_upgrade: Some("Provisioning".to_string()),
            other: BTreeMap::from([("future.json".to_string(), "{}".to_string())]),
            resource_version: Some("7".to_string()),
            owner_uid: owner.map(str::to_string),
            ..Progress::default()
        }
    }

    #[test]
    fn a_record_written_for_an_earlier_cluster_of_the_same_name_reads_as_empty() {
        // (written for, read by, kept?)
        let cases = [
            (Some("u1"), Some("u1"), true),
            (Some("u1"), Some("u2"), false),
            // No owner to compare: a record made by hand, or an object without a uid.
            (None, Some("u2"), true),
            (Some("u1"), None, true),
        ];
        for (written_for, read_by, kept) in cases {
            let record = record_of(written_for);
            let read = record.clone().of_owner(read_by);
            if kept {
                assert_eq!(read, record, "{written_for:?} read by {read_by:?}");
            } else {
                assert_eq!(read.talos, None);
                assert_eq!(read.phase_before_upgrade(), None);
                assert!(read.other.is_empty());
                // Saved over at the version it was read at.
                assert_eq!(read.resource_version.as_deref(), Some("7"));
            }
        }
    }
}
