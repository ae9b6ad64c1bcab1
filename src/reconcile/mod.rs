//! The reconciler: for each `KubernetesCluster`, read the user's intent from its annotations, then run
//! the lifecycle of each kind of upgrade (Talos, then Kubernetes) through the one flow they share, and
//! write one report.
//!
//! ```text
//! annotations ──► intent ──────────┐
//! progress ConfigMap ──► records ──┼─► flow::drive(Talos) ──► flow::drive(Kubernetes) ──► report
//! Secret, Machines/Nodes ─► access ┘      (core lifecycle: look → decide → save → publish → call)
//! ```
//!
//! Every decision is the core's ([`talos_upgrade_core::lifecycle`]); this module and its submodules
//! only carry them out: `acknowledge` keeps the last looks for the early `in-progress`, `flow`
//! drives a kind's lifecycle with its IO ([`crate::kind_io`]), [`report`] writes, `forget` drops what
//! is remembered of a deleted cluster; the cluster is reached through [`crate::cluster_access`] and the
//! nodes in flight followed by [`crate::followers`].

mod acknowledge;
mod coexist;
mod flow;
mod forget;
pub mod report;

use std::sync::Arc;
use std::time::Duration;

use crate::event_recorder::EventRecorder;
use futures::StreamExt;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use tracing::Instrument;

use crate::admin::HealthState;
use crate::catalog_sources::CatalogHandle;
use crate::cluster_access::{Connections, SharedAccess};
use crate::etcd_snapshot::SnapshotContext;
use crate::followers::Wakeups;
use crate::holds::{GateConfig, GateContext};
use crate::kubernetes_upgrade::KubernetesIo;
use crate::metrics::{ClusterKey, ClusterUpgradeGauges, Metrics};
use crate::progress_store::{ProgressStore, Records, Stored};
use crate::talos_upgrade::TalosIo;
use talos_api::ConnectOptions;
use talos_upgrade_core::acknowledgement;
use talos_upgrade_core::annotations::{self, UpgradeKind};
use talos_upgrade_core::catalog::Catalog;
use talos_upgrade_core::coexistence::{self, Standing};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::gates::Gates;
use talos_upgrade_core::holds::MaintenanceWindows;
use talos_upgrade_core::intent::UpgradeIntent;
use talos_upgrade_core::kubernetes::Kubernetes;
use talos_upgrade_core::lifecycle::{self, Inputs, Lifecycle, Limits, Revisit};
use talos_upgrade_core::plan;
use talos_upgrade_core::report::phase_change;
use talos_upgrade_core::talos::Talos;

/// How often a run whose nodes in flight are all rebooting, and all followed, is looked at anyway. The
/// followers wake the reconcile when a node is back (Talos events and the Node watch; the Talos
/// stream replays the whole boot on reconnect), and a follower waiting for its node tries again by
/// itself at least every minute (`followers::RECONNECT_AWAY`), so this poll only bounds what a
/// follower that ended costs and notices a node deadline. Two minutes: a real node is away 2–4
/// minutes and the guide's simulated ones about 70 s, so the poll looks at the cluster once or twice
/// per real node (each look asks every node in flight: its boot id, status and, once booted,
/// `Version`) and not at all while a node's followers bring it back sooner. Never shorter than
/// `--poll-interval`, and never longer than a quarter of `--node-deadline` (see [`followed_poll`]),
/// so a node past its deadline is failed close to it.
const FOLLOWED_POLL_INTERVAL: Duration = Duration::from_secs(120);

/// The safety-net poll while every node in flight is rebooting and followed.
fn followed_poll(settings: &Settings) -> Duration {
    FOLLOWED_POLL_INTERVAL
        .min(settings.limits.node_deadline / 4)
        .max(settings.poll_interval)
}

/// How often a run held by a gate that asks outside the cluster (alerts, health checks) asks again:
/// a hold lasts minutes, and each look costs a query.
const CHECKING_POLL_INTERVAL: Duration = Duration::from_secs(15);

/// Where every decision's `now` comes from: the system clock, or a test's.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> jiff::Timestamp + Send + Sync>);

impl Clock {
    pub fn system() -> Self {
        Clock(Arc::new(jiff::Timestamp::now))
    }

    /// A clock that reads `now` (tests: a time set by the test, moving on or not).
    pub fn from_fn(now: impl Fn() -> jiff::Timestamp + Send + Sync + 'static) -> Self {
        Clock(Arc::new(now))
    }

    pub fn now(&self) -> jiff::Timestamp {
        (self.0)()
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::system()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Clock({})", self.now())
    }
}

/// The controller's tunables (flags of the `run` command).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The deadlines of a run: per node, per drain, per Kubernetes step, and the grace before an
    /// unanswered call is made again.
    pub limits: Limits,
    /// How often a cluster with an upgrade in flight is looked at again.
    pub poll_interval: Duration,
    /// How often an idle cluster is refreshed (versions) without any change to it.
    pub idle_interval: Duration,
    /// Credentials Secret name; `{clusterId}` and `{name}` are replaced by the cluster's values.
    pub secret_name_template: String,
    pub talos: ConnectOptions,
    /// Known releases, for `talos-available` and `kubernetes-available`.
    pub catalog: CatalogHandle,
    /// Only the KubernetesClusters whose labels match this selector (`shard=a`, `!shard`, ...): one
    /// shard of a fleet split across several controllers. A cluster relabelled out of it leaves this
    /// controller's watch as if deleted (it is forgotten, nothing on it is touched) and enters the
    /// watch of the shard it now matches, which goes on from its progress record.
    pub watch_label_selector: Option<String>,
    /// The time of every decision (maintenance windows, soak, deadlines): the system clock, unless a
    /// test sets it.
    pub clock: Clock,
    /// The operator's configuration of the gates before each node that need IO.
    pub gates: GateConfig,
    /// `--maintenance-window`: the windows of a cluster without the annotation (`None`: any time).
    pub maintenance_window: Option<MaintenanceWindows>,
    /// `--alertmanager-url`: the Alertmanager of the silences during Talos runs (`None`: none).
    pub silences: Option<crate::silences::Alertmanager>,
    /// `--etcd-snapshot-dir` or `--etcd-snapshot-s3-*`: where the etcd snapshot before the control
    /// planes goes (`None`: no snapshot; see [`crate::etcd_snapshot`]).
    pub etcd_snapshots: Option<crate::etcd_snapshot::SnapshotConfig>,
    /// `--max-concurrent-reconciles`: how many clusters are reconciled at once (0: no bound).
    pub max_concurrent_reconciles: u16,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            limits: Limits::default(),
            poll_interval: Duration::from_secs(2),
            idle_interval: Duration::from_secs(10 * 60),
            secret_name_template: "{clusterId}".to_string(),
            talos: ConnectOptions::default(),
            catalog: CatalogHandle::fixed(Catalog::builtin()),
            watch_label_selector: None,
            clock: Clock::system(),
            gates: GateConfig::default(),
            maintenance_window: None,
            silences: None,
            etcd_snapshots: None,
            max_concurrent_reconciles: 0,
        }
    }
}

/// The controller's clients of the management cluster.
#[derive(Clone)]
pub struct ApiClients {
    /// Reads, records, events, reports: everything but what `intake` carries.
    pub main: Client,
    /// The way a user's annotation travels to `in-progress`: the watch of the KubernetesClusters and
    /// the acknowledgement of a new target (`in-progress` before the first look). Over HTTP/2 all of a
    /// client's requests share one connection, which the API server serves in one loop and on which it
    /// allows 100 streams (its default); with a fleet annotated at once `main` is that busy for
    /// seconds, and both the watch's events and an acknowledgement would wait behind the other clusters'
    /// reads and records. On a connection of their own they do not: one watch, and one small patch
    /// per run start.
    pub intake: Client,
}

impl ApiClients {
    /// Both clients for the API server `config` describes, each with its own connection.
    pub fn connect(config: &kube::Config) -> Result<Self, crate::api_client::ApiClientError> {
        Ok(ApiClients {
            main: crate::api_client::client(config.clone())?,
            intake: crate::api_client::client(config.clone())?,
        })
    }
}

/// One client for everything (one connection over HTTP/2; tests, and callers that do not mind).
impl From<Client> for ApiClients {
    fn from(client: Client) -> Self {
        ApiClients {
            main: client.clone(),
            intake: client,
        }
    }
}

/// Shared by every reconcile.
pub struct Context {
    pub client: Client,
    /// See [`ApiClients::intake`].
    intake: Client,
    pub recorder: EventRecorder,
    pub metrics: Metrics,
    pub settings: Settings,
    /// How each cluster is reached: its credentials, inventory and connections, kept across reconciles.
    connections: Connections,
    /// Followers of the nodes in flight, which wake a cluster's reconcile when a node changes.
    wakeups: Wakeups,
    /// Progress records reused between reconciles while unchanged (kept current by the metadata watch
    /// [`run`] starts; without it every reconcile reads).
    progress_reads: Arc<crate::progress_store::ProgressCache>,
    /// What the last reconcile of each cluster saw of its versions, for acknowledging a new target
    /// before looking again (see [`acknowledge`]).
    last_looks: acknowledge::LastLooks,
    /// The clusters as the controller's watch last saw them: whether one is still there.
    clusters: Store<KubernetesCluster>,
    /// Which object each cluster's memory above belongs to, to forget it once deleted (see [`forget`]).
    known: forget::Known,
    /// What was last said of each cluster the controller stands aside from (see [`coexist`]).
    said: coexist::Said,
}

/// A cluster's key in the controller's own per-cluster memory: (namespace, name).
fn cluster_key(cluster: &KubernetesCluster) -> (String, String) {
    (cluster.namespace().unwrap_or_default(), cluster.name_any())
}

/// The object `cluster` as the controller's memory of it is kept: its uid and Machine inventory key.
fn remembered(cluster: &KubernetesCluster) -> Option<forget::Remembered> {
    Some(forget::Remembered {
        uid: cluster.uid()?,
        cluster_id: cluster
            .cluster_id()
            .map_or_else(|| cluster.name_any(), str::to_string),
    })
}

impl Context {
    /// `clusters` is the store the controller's watch of the clusters fills.
    pub fn new(
        clients: ApiClients,
        metrics: Metrics,
        mut settings: Settings,
        instance: String,
        clusters: Store<KubernetesCluster>,
    ) -> Self {
        let ApiClients {
            main: client,
            intake,
        } = clients;
        // Whether the runs take etcd snapshots follows from having somewhere to put them.
        settings.limits.etcd_snapshot = settings.etcd_snapshots.is_some();
        // Every Talos API call of every cluster is counted by operation and result code.
        if settings.talos.observer.is_none() {
            let metrics = metrics.clone();
            settings.talos.observer = Some(talos_api::CallObserver::new(move |op, code| {
                metrics.record_talos_call(op, code)
            }));
        }
        let recorder =
            EventRecorder::new(client.clone(), "talos-upgrade-controller", Some(instance));
        Context {
            connections: Connections::new(
                client.clone(),
                settings.secret_name_template.clone(),
                settings.talos.clone(),
            ),
            client,
            intake,
            recorder,
            metrics,
            settings,
            wakeups: Wakeups::default(),
            progress_reads: Arc::default(),
            last_looks: Default::default(),
            clusters,
            known: forget::Known::default(),
            said: coexist::Said::default(),
        }
    }

    /// Forgets everything remembered of the cluster `name` (see [`forget`]). `object` is the deleted
    /// object when the caller knows it (a reconcile's end): the watch's `Delete` may have taken what
    /// was remembered already, while the reconcile still worked and wrote (a silence) for it.
    fn forget(&self, name: &forget::ClusterName, object: Option<forget::Remembered>) {
        let remembered = self.known.take(name).or(object);
        self.forget_memory(name, remembered.as_ref());
        // A deleted cluster's run ended with it: its silences are expired (in the background).
        if let (Some(alertmanager), Some(remembered)) = (&self.settings.silences, &remembered) {
            alertmanager.forget_cluster(&name.0, &name.1, &remembered.uid, &self.metrics);
        }
    }

    /// Drops the memory of `name`: its metric series, connections, Machine inventory, progress record
    /// as last read, last look and followers.
    fn forget_memory(&self, name: &forget::ClusterName, remembered: Option<&forget::Remembered>) {
        let (namespace, cluster) = name;
        tracing::info!(%namespace, %cluster, "forgetting a deleted cluster");
        self.metrics
            .forget_cluster(&ClusterKey::new(namespace, cluster));
        self.connections
            .forget(name, remembered.map(|r| r.cluster_id.as_str()));
        self.last_looks.forget(name);
        self.said.forget(name);
        self.wakeups
            .follow(&ObjectRef::new(cluster).within(namespace), Vec::new());
        self.progress_reads.forget(&(
            namespace.clone(),
            crate::progress_store::configmap_name(cluster),
        ));
    }

    /// Takes in one event of the watch of the clusters, after the store did: a deleted cluster is
    /// forgotten, and so, after a relist, is every cluster remembered that the list no longer holds.
    fn watched(&self, event: &watcher::Event<KubernetesCluster>) {
        match event {
            watcher::Event::Delete(cluster) => self.forget(&cluster_key(cluster), None),
            watcher::Event::InitDone => {
                let listed = |(namespace, name): &forget::ClusterName| {
                    self.clusters
                        .get(&ObjectRef::new(name).within(namespace))
                        .and_then(|cluster| cluster.uid())
                };
                for name in self.known.gone(listed) {
                    self.forget(&name, None);
                }
            }
            _ => {}
        }
    }

    /// A reconcile of `cluster` begins: what is remembered under its name is its own from now on, and
    /// what was remembered of an older object of that name (deleted, then created again) is dropped.
    fn begin(&self, cluster: &KubernetesCluster) {
        let Some(object) = remembered(cluster) else {
            return;
        };
        let name = cluster_key(cluster);
        if let Some(older) = self.known.begin(&name, object) {
            self.forget_memory(&name, Some(&older));
        }
    }

    /// A reconcile of `cluster` ended: if the cluster was deleted meanwhile (the store no longer holds
    /// this object), what the reconcile remembered after the deletion was seen is dropped too, and
    /// the silences it may have written after the deletion's own expiry are expired.
    fn end(&self, cluster: &KubernetesCluster) {
        let now = self
            .clusters
            .get(&ObjectRef::from_obj(cluster))
            .and_then(|now| now.uid());
        if now.is_none() || now != cluster.uid() {
            self.forget(&cluster_key(cluster), remembered(cluster));
        }
    }

    /// Follows the progress ConfigMaps and the Machines (metadata only) until dropped, so that
    /// reconciles reuse what they read while it is unchanged.
    fn watch_reads(self: &Arc<Self>, namespace: Option<String>) -> AbortOnDrop {
        let progress = {
            let ctx = self.clone();
            let namespace = namespace.clone();
            tokio::spawn(async move {
                crate::progress_store::follow_progress(
                    &ctx.progress_reads,
                    ctx.client.clone(),
                    namespace.as_deref(),
                )
                .await;
            })
        };
        let machines = {
            let ctx = self.clone();
            tokio::spawn(async move {
                ctx.connections
                    .machines
                    .follow(ctx.client.clone(), namespace.as_deref())
                    .await;
            })
        };
        AbortOnDrop(vec![progress.abort_handle(), machines.abort_handle()])
    }
}

/// Stops background tasks when the controller stops.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// Why a reconcile could not finish; retried with backoff. Problems of the cluster itself (bad target,
/// missing Secret, unreachable nodes) are not errors: they are reported on the cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] crate::progress_store::StoreError),
    #[error("writing the cluster's annotations or status: {0}")]
    Report(#[source] kube::Error),
}

/// What kind of failure ended a reconcile: the reconcile-errors metric's `category` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCategory {
    /// Someone else wrote the progress record since it was read; decided again at once.
    ProgressConflict,
    /// The progress record could not be read or written.
    ProgressStore,
    /// The cluster's annotations or status could not be written.
    Report,
}

impl ErrorCategory {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCategory::ProgressConflict => "progress_conflict",
            ErrorCategory::ProgressStore => "progress_store",
            ErrorCategory::Report => "report",
        }
    }
}

impl Error {
    pub fn category(&self) -> ErrorCategory {
        match self {
            Error::Store(crate::progress_store::StoreError::Conflict { .. }) => {
                ErrorCategory::ProgressConflict
            }
            Error::Store(_) => ErrorCategory::ProgressStore,
            Error::Report(_) => ErrorCategory::Report,
        }
    }
}

/// One reconcile of one cluster, in a span naming it: every log line of the reconcile (its flows, its
/// calls) can be found by the cluster's namespace and name.
pub async fn reconcile(
    cluster: Arc<KubernetesCluster>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let span = tracing::info_span!(
        "reconcile",
        namespace = %cluster.namespace().unwrap_or_default(),
        cluster = %cluster.name_any(),
    );
    ctx.begin(&cluster);
    // The followers' wake-ups meanwhile wait for its end (see `followers::Reconciling`).
    let reconciling = ctx.wakeups.reconciling(&ObjectRef::from_obj(&*cluster));
    let result = reconcile_cluster(cluster.clone(), ctx.clone())
        .instrument(span)
        .await;
    ctx.end(&cluster);
    drop(reconciling);
    result
}

async fn reconcile_cluster(
    cluster: Arc<KubernetesCluster>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_timer();
    let namespace = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let key = cluster_key(&cluster);
    // First of all, before any progress read or node access: may the controller act on it at all?
    let standing = coexistence::standing(cluster.annotations(), &coexist::writers(&cluster));
    if standing != Standing::Act {
        return stand_aside(&cluster, &ctx, &standing).await;
    }
    ctx.said.forget(&key);
    let intent = UpgradeIntent::from_annotations(cluster.annotations())
        .with_default_window(ctx.settings.maintenance_window.as_ref());
    let store =
        ProgressStore::new(ctx.client.clone(), &namespace).with_cache(ctx.progress_reads.clone());
    let api: Api<KubernetesCluster> = Api::namespaced(ctx.client.clone(), &namespace);
    let intake: Api<KubernetesCluster> = Api::namespaced(ctx.intake.clone(), &namespace);
    let now = ctx.settings.clock.now();
    // A record left by an earlier cluster of this name is not this one's.
    let uid = cluster.metadata.uid.as_deref();
    let reporter = report::Reporter {
        api: &api,
        recorder: &ctx.recorder,
        now,
    };

    // A dry run (`plan-preview`): the plan the controller would run is shown, and nothing else is
    // decided, called or written.
    if intent.plan_preview {
        return preview_plan(&cluster, &ctx, &intent, &store, &reporter, uid).await;
    }

    // One progress record and one access per reconcile, shared by both kinds: the Kubernetes part
    // works on the record as the Talos part left it (saved or not).
    let access = SharedAccess::new(&cluster, &ctx.connections);
    let acknowledgement = acknowledgement::acknowledgement(
        cluster.annotations(),
        &intent,
        ctx.last_looks.get(&key).as_ref(),
        now,
        ctx.settings.idle_interval * 2,
    );
    let acknowledge = |acknowledgement: acknowledgement::Acknowledgement| {
        let intake = report::Reporter {
            api: &intake,
            ..reporter
        };
        let cluster = &cluster;
        async move {
            intake
                .write_annotations(cluster, &acknowledgement.report)
                .await
                // Not fatal: the reconcile's own report says it again.
                .inspect_err(|error| tracing::warn!(%error, "acknowledging the Talos target"))
                .ok()
                .flatten()
        }
    };
    // A new Talos target is acknowledged (`in-progress`) before the cluster is read and looked at, not
    // beside it: with a fleet annotated at once, the acknowledgements then reach the API server ahead
    // of every cluster's reads and Talos looks instead of queueing behind them.
    let (progress, acknowledged) = match acknowledgement {
        // The record says whether this value was decided already; it is nearly always kept in memory
        // (a run was recorded), and the access is read on first use.
        Some(acknowledgement) if acknowledgement.needs_progress() => {
            let progress = store.load(&name).await?.of_owner(uid);
            let written = if acknowledgement
                .still_undecided(progress.run::<Talos>(), progress.run::<Kubernetes>())
            {
                acknowledge(acknowledgement).await
            } else {
                None
            };
            (progress, written)
        }
        // Nearly every reconcile needs the cluster's access; it is read while the record loads (after
        // the acknowledgement, when the annotations alone allow one).
        acknowledgement => {
            let written = match acknowledgement {
                Some(acknowledgement) => acknowledge(acknowledgement).await,
                None => None,
            };
            // Boxed: see `flow::drive`'s calls.
            let (progress, _) = tokio::join!(Box::pin(store.load(&name)), Box::pin(access.get()));
            (progress?.of_owner(uid), written)
        }
    };
    // The acknowledged object is what later writes compare against, unless the user changed something
    // in between (then this reconcile goes on with what it was woken for, and the change wakes another).
    let acknowledged = acknowledged.filter(|object| user_inputs(object) == user_inputs(&cluster));
    let seen: &KubernetesCluster = acknowledged.as_ref().unwrap_or(&cluster);
    let mut records = Records::new(&store, &name, cluster.controller_owner_ref(&()), progress);
    let catalog = ctx.settings.catalog.snapshot();
    // The multi-hop plan (opt-in): the runs are given the hop's version as their target, and
    // everything below reads the targets from these annotations (see `core::plan::Layer`).
    let plan_layer = plan::Layer::new(
        &intent,
        seen.annotations(),
        records.progress().plan(),
        &catalog,
    );
    if plan_layer.forgets() {
        records.keep_plan(None).await?;
    }
    let (run_intent, run_annotations) = plan_layer.effective(&intent, seen.annotations());
    let pass = PassInputs {
        intent: &run_intent,
        annotations: &run_annotations,
        limits: ctx.settings.limits,
        catalog: &catalog,
        now,
    };

    let note_look = |look| ctx.last_looks.note(key.clone(), look);
    // The end of an install wakes the next reconcile at once (see `talos_upgrade`).
    let wake = ctx.wakeups.waker(&ObjectRef::from_obj(&*cluster));
    // A copy: the record is written during the drive, the gates read it as this reconcile found it.
    let talos_run = records.progress().run::<Talos>().cloned();
    let gates = GateContext {
        cluster: &cluster,
        intent: &run_intent,
        config: &ctx.settings.gates,
        now,
        talos_run: talos_run.as_ref(),
    };
    // The Alertmanager silences of the Talos run: synced before its calls and after the reconcile.
    let silences = match (&ctx.settings.silences, &intent.alert_silences) {
        (Some(alertmanager), Ok(mode)) => Some(crate::silences::RunSilences::new(
            alertmanager,
            &cluster,
            *mode,
            run_annotations
                .get(UpgradeKind::Talos.target_key())
                .map(|target| target.trim())
                .filter(|target| !target.is_empty()),
            intent.paused,
            now,
            &ctx.metrics,
        )),
        // An invalid mode: no run starts; the silences are left to end on their own.
        _ => None,
    };
    // Where each kind's etcd snapshot goes (the Kubernetes run's only with `talos-and-kubernetes`).
    let snapshots = || {
        ctx.settings
            .etcd_snapshots
            .as_ref()
            .map(|config| SnapshotContext {
                config,
                namespace: namespace.clone(),
                cluster: name.clone(),
                metrics: &ctx.metrics,
            })
    };
    let mut talos_io = TalosIo::new(&access, &note_look, now, wake, gates)
        .with_silences(silences.as_ref())
        .with_snapshots(snapshots());
    let talos_gates = Gates::for_talos(
        records.progress().run::<Kubernetes>(),
        run_annotations
            .get(UpgradeKind::Kubernetes.target_key())
            .map(|target| target.trim()),
    );
    let mut talos = flow::drive(
        Lifecycle::new(pass.inputs::<Talos>(&records, talos_gates)),
        &mut talos_io,
        &mut records,
        &reporter,
        seen,
    )
    .instrument(kind_span(UpgradeKind::Talos, seen))
    .await?;
    let kubernetes_gates = Gates::for_kubernetes(
        records.progress().run::<Talos>(),
        talos.conclusion.report.status,
    );
    let mut kubernetes_io = KubernetesIo::new(&access, now).with_snapshots(snapshots());
    let mut kubernetes = flow::drive(
        Lifecycle::new(pass.inputs::<Kubernetes>(&records, kubernetes_gates)),
        &mut kubernetes_io,
        &mut records,
        &reporter,
        seen,
    )
    .instrument(kind_span(UpgradeKind::Kubernetes, seen))
    .await?;

    // The plan moves past a hop its run completed, and shows in both kinds' reports.
    let plan_concluded = plan_layer.conclude(
        [
            run_end(records.progress().run::<Talos>()),
            run_end(records.progress().run::<Kubernetes>()),
        ],
        [
            &mut talos.conclusion.report,
            &mut kubernetes.conclusion.report,
        ],
        seen.annotations()
            .get(annotations::PLAN_MESSAGE)
            .map(String::as_str),
    );
    records.keep_plan(plan_concluded.keep.as_ref()).await?;

    // What the object says now: as a report made before the calls left it, if one was written.
    let baseline: &KubernetesCluster = kubernetes
        .reported
        .as_ref()
        .or(talos.reported.as_ref())
        .unwrap_or(seen);
    let reports = [&talos.conclusion.report, &kubernetes.conclusion.report];
    // The phase shows the controller's runs and failures; one it did not write is kept in the record
    // before it is replaced, and forgotten only once it is written back (so a controller stopped in
    // between still gives it back).
    let kept = records
        .progress()
        .phase_before_upgrade()
        .map(str::to_string);
    // A plan's kind that only waits for its next hop does not show in the phase.
    let [talos_phase, kubernetes_phase] = plan_concluded.phase_reports(reports);
    let phase = phase_change(
        &[&talos_phase, &kubernetes_phase],
        baseline.phase(),
        kept.as_deref(),
    );
    if phase.keeps_first(kept.as_deref()) {
        records
            .keep_phase_before_upgrade(phase.give_back.clone())
            .await?;
    }
    reporter
        .write(baseline, &reports, phase.phase.as_deref())
        .await
        .map_err(Error::Report)?;
    records
        .keep_phase_before_upgrade(phase.give_back.clone())
        .await?;
    let invalid_flags = lifecycle::invalid_flag_notes(&intent);
    let talos_notes = [talos.conclusion.notes.as_slice(), &invalid_flags].concat();
    reporter
        .publish(baseline, UpgradeKind::Talos, &talos_notes)
        .await;
    reporter
        .publish(
            baseline,
            UpgradeKind::Kubernetes,
            &kubernetes.conclusion.notes,
        )
        .await;
    reporter
        .write_plan_message(baseline, plan_concluded.message.as_deref())
        .await
        .map_err(Error::Report)?;
    reporter
        .publish(baseline, UpgradeKind::Talos, &plan_concluded.notes)
        .await;
    // The Alertmanager silences of the Talos run as this reconcile left it (never fatal).
    if let Some(silences) = &silences {
        silences.sync(records.progress().run::<Talos>()).await;
        reporter
            .publish(baseline, UpgradeKind::Talos, &silences.take_notes())
            .await;
    }

    let metrics_key = ClusterKey::new(&namespace, &name);
    if let Some(phase) = phase.phase.or_else(|| baseline.phase().map(str::to_string)) {
        ctx.metrics.set_cluster_phase(&metrics_key, &phase);
    }
    export_metrics(&ctx.metrics, &cluster, &metrics_key, &talos, now);
    export_metrics(&ctx.metrics, &cluster, &metrics_key, &kubernetes, now);
    // Nodes in flight are followed, so the reconcile runs again as soon as one of them changes.
    ctx.wakeups.follow(
        &kube::runtime::reflector::ObjectRef::from_obj(&*cluster),
        talos.follow.clone(),
    );
    let requeue = [
        requeue_after(&ctx.settings, &talos, now),
        requeue_after(&ctx.settings, &kubernetes, now),
    ]
    .into_iter()
    .flatten()
    // The next hop of a plan starts at once; a plan waiting for the versions looks again at the poll.
    .chain(plan_concluded.again.then_some(PLAN_AGAIN))
    .chain(plan_concluded.waiting.then_some(ctx.settings.poll_interval))
    .min()
    .unwrap_or(ctx.settings.idle_interval);
    // One line per reconcile that looked at the cluster, in kube's span that names what woke it
    // (`object.reason`; the followers' wake-ups are logged by the followers as they are sent): what
    // explains a reconcile that found nothing to do.
    tracing::debug!(
        talos = ?talos.conclusion.revisit,
        kubernetes = ?kubernetes.conclusion.revisit,
        talos_in_flight = talos.conclusion.report.in_flight.len(),
        next_look_in = ?requeue,
        "reconciled"
    );
    Ok(Action::requeue(requeue))
}

/// How often a cluster whose upgrade fields another controller writes is looked at again: reading its
/// managedFields costs nothing (the watch holds the object), and the other controller's writes, which
/// are of controller keys, do not wake a reconcile (see [`user_inputs`]), nor does a user removing
/// them to hand the cluster over.
const CONTESTED_POLL_INTERVAL: Duration = Duration::from_secs(30);

/// The reconcile of a cluster the controller does not act on: nothing read, no node looked at, no
/// record written, nothing followed; only said, once (see [`coexist`]).
async fn stand_aside(
    cluster: &KubernetesCluster,
    ctx: &Context,
    standing: &Standing,
) -> Result<Action, Error> {
    tracing::info!(?standing, "not acting on the cluster");
    // Nodes in flight when it was excluded are no longer followed.
    ctx.wakeups
        .follow(&ObjectRef::from_obj(cluster), Vec::new());
    let api: Api<KubernetesCluster> =
        Api::namespaced(ctx.client.clone(), &cluster.namespace().unwrap_or_default());
    coexist::stand_aside(&api, &ctx.recorder, &ctx.said, cluster, standing)
        .await
        .map_err(Error::Report)?;
    Ok(Action::requeue(match standing {
        Standing::Contested(_) => CONTESTED_POLL_INTERVAL.max(ctx.settings.poll_interval),
        Standing::Act | Standing::Excluded => ctx.settings.idle_interval,
    }))
}

/// The plan preview of a cluster (`plan-preview: "true"`): the Event and `plan-message`, once per
/// change of what it says. Its nodes come from the cluster's inventory; no node is called.
async fn preview_plan(
    cluster: &KubernetesCluster,
    ctx: &Context,
    intent: &UpgradeIntent,
    store: &ProgressStore,
    reporter: &report::Reporter<'_>,
    uid: Option<&str>,
) -> Result<Action, Error> {
    let progress = store.load(&cluster.name_any()).await?.of_owner(uid);
    let access = SharedAccess::new(cluster, &ctx.connections);
    let nodes = access
        .get()
        .await
        .map(|access| crate::plan_preview::preview_nodes(&access.inventory))
        .map_err(|error| error.to_string());
    let catalog = ctx.settings.catalog.snapshot();
    let preview = plan::preview::preview(&plan::preview::PreviewInputs {
        annotations: cluster.annotations(),
        intent,
        stored: progress.plan(),
        catalog: &catalog,
        nodes: nodes.as_deref().map_err(Clone::clone),
        now: reporter.now,
    });
    let message = preview.message();
    if cluster.annotations().get(annotations::PLAN_MESSAGE) != Some(&message) {
        reporter
            .write_plan_message(cluster, Some(&message))
            .await
            .map_err(Error::Report)?;
        reporter
            .publish(
                cluster,
                UpgradeKind::Talos,
                &[talos_upgrade_core::run::Note::normal(
                    talos_upgrade_core::run::Reason::PlanPreview,
                    message,
                )],
            )
            .await;
    }
    Ok(Action::requeue(ctx.settings.idle_interval))
}

/// How soon a cluster whose plan moved to its next hop is looked at again.
const PLAN_AGAIN: Duration = Duration::from_secs(1);

/// What a kind's saved run says to the plan.
fn run_end<R: talos_upgrade_core::run::Record>(run: Option<&R>) -> Option<plan::RunEnd<'_>> {
    // A finished rollback reads as its hop stopped (`RunEnd::of`).
    run.map(plan::RunEnd::of)
}

/// What both kinds' lifecycles start from in one reconcile.
struct PassInputs<'a> {
    intent: &'a UpgradeIntent,
    annotations: &'a std::collections::BTreeMap<String, String>,
    limits: Limits,
    catalog: &'a Catalog,
    now: jiff::Timestamp,
}

impl<'a> PassInputs<'a> {
    /// The inputs of kind `K`'s lifecycle: its run as the record holds it now, and its gates.
    fn inputs<K: Stored>(&self, records: &Records<'_>, gates: Gates) -> Inputs<'a, K> {
        Inputs {
            intent: self.intent,
            annotations: self.annotations,
            record: records.progress().run::<K>().cloned(),
            gates,
            limits: self.limits,
            catalog: self.catalog,
            now: self.now,
        }
    }
}

/// The span of one kind's part of a reconcile, with its target where there is one.
fn kind_span(kind: UpgradeKind, cluster: &KubernetesCluster) -> tracing::Span {
    let target = cluster
        .annotations()
        .get(kind.target_key())
        .map(|target| target.trim())
        .filter(|target| !target.is_empty())
        .unwrap_or("none");
    tracing::info_span!("upgrade", kind = kind.as_str(), target)
}

/// When a kind wants its cluster looked at again (`None`: at the idle refresh).
fn requeue_after<K: Stored>(
    settings: &Settings,
    outcome: &flow::KindOutcome<K>,
    now: jiff::Timestamp,
) -> Option<Duration> {
    let poll = settings.poll_interval;
    match outcome.conclusion.revisit {
        Revisit::Idle => None,
        Revisit::Poll => Some(poll),
        Revisit::AfterProblem => Some(poll.max(Duration::from_secs(5))),
        Revisit::Blocked => Some(poll.max(Duration::from_secs(1))),
        Revisit::Now => Some(Duration::ZERO),
        // Every node in flight is rebooting: when each is followed, its follower wakes the reconcile
        // when it is back, and the poll is only the safety net (a lost stream, the node deadline).
        Revisit::AwaitingReboots
            if outcome.follow.iter().filter(|node| node.in_flight).count()
                == outcome.conclusion.report.in_flight.len() =>
        {
            Some(followed_poll(settings))
        }
        Revisit::AwaitingReboots => Some(poll),
        // A time gate: when it opens (never sooner than the poll, never later than the idle
        // refresh, which also catches a clock moved by hand); the canary: when the user acts (a
        // change of the annotations wakes the reconcile), or at the idle refresh.
        Revisit::Held { until } => Some(
            until
                .map(|until| until.duration_since(now).unsigned_abs())
                .map_or(settings.idle_interval, |wait| {
                    wait.clamp(poll, settings.idle_interval.max(poll))
                }),
        ),
        // A gate that asks Prometheus or the workload cluster: not more often than every 15 s.
        Revisit::Checking => Some(poll.max(CHECKING_POLL_INTERVAL)),
    }
}

/// Mirrors what the reconcile reported for one upgrade kind into the per-cluster metrics.
fn export_metrics<K: Stored>(
    metrics: &Metrics,
    cluster: &KubernetesCluster,
    key: &ClusterKey,
    outcome: &flow::KindOutcome<K>,
    now: jiff::Timestamp,
) {
    let conclusion = &outcome.conclusion;
    let report = &conclusion.report;
    let kind = report.kind;
    let (done, total) = report.progress.unwrap_or((0, 0));
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    metrics.set_cluster_state(
        key,
        kind,
        &ClusterUpgradeGauges {
            status: report.status,
            nodes_total: count(total),
            nodes_completed: count(done),
            nodes_failed: count(report.failed_nodes.len()),
            nodes_in_flight: count(report.in_flight.len()),
            upgrading_nodes: report.in_flight.clone(),
            current_version: report.current.clone(),
            target_version: cluster
                .annotations()
                .get(kind.target_key())
                .map(|t| t.trim().trim_start_matches('v').to_string()),
            available_version: report.available.clone().flatten(),
            run_started_at: conclusion
                .run_started_at
                .map(|at| at.as_millisecond() as f64 / 1000.0),
        },
    );
    for (role, seconds) in &conclusion.nodes_finished {
        metrics.observe_node_upgrade(key, kind, *role, *seconds);
    }
    if let Some(check) = conclusion.preflight_failure {
        metrics.record_preflight_failure(key, kind, check.as_str());
    }
    metrics.set_hold(key, kind, conclusion.gate);
    // A run ends in exactly one reconcile: the one that announces it.
    let reasons = conclusion.notes.iter().map(|note| note.reason);
    for result in reasons
        .chain(conclusion.announced.iter().copied())
        .filter_map(|reason| reason.run_result())
    {
        metrics.record_run_result(key, kind, result);
        if result == talos_upgrade_core::run::RunResult::Completed {
            metrics.record_last_success(key, kind, now.as_millisecond() as f64 / 1000.0);
        }
    }
    // A rollback ends (or is refused) in the reconcile that announces it; each node rolled back is
    // announced once.
    let reasons = conclusion.notes.iter().map(|note| note.reason);
    for reason in reasons.chain(conclusion.announced.iter().copied()) {
        if let Some(result) = reason.rollback_result() {
            metrics.record_rollback(key, result);
        }
        if reason == talos_upgrade_core::run::Reason::NodeRolledBack {
            metrics.record_node_rolled_back(key, kind);
        }
    }
}

/// A digest of what users and other controllers change on a cluster: its spec (the generation), its
/// labels and every annotation but the ones this controller writes. An event that leaves it unchanged (one
/// of the controller's own report writes, a status written by the provisioning operator) is not a
/// reason to reconcile.
pub fn user_inputs(cluster: &KubernetesCluster) -> Option<u64> {
    Some(cluster.user_inputs())
}

/// Retries failed reconciles: a progress conflict at once (someone else wrote; decide again), anything
/// else after a pause.
pub fn error_policy(_cluster: Arc<KubernetesCluster>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .record_reconcile_error(error.category().as_str());
    tracing::warn!(%error, "reconcile failed");
    match error {
        Error::Store(crate::progress_store::StoreError::Conflict { .. }) => {
            Action::requeue(Duration::from_millis(100))
        }
        _ => Action::requeue(Duration::from_secs(5)),
    }
}

/// Runs the controller until `shutdown` resolves, over every namespace or only `namespace`; marks
/// `health` ready once the initial list of clusters is in.
pub async fn run(
    clients: impl Into<ApiClients>,
    namespace: Option<String>,
    metrics: Metrics,
    settings: Settings,
    health: HealthState,
    instance: String,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let clients = clients.into();
    let clusters: Api<KubernetesCluster> = match &namespace {
        Some(namespace) => Api::namespaced(clients.intake.clone(), namespace),
        None => Api::all(clients.intake.clone()),
    };
    // Readiness comes from the watch stream itself: the reflector store's readiness future wakes only
    // one waiter, which the controller's own runner already is.
    let (reader, writer) = kube::runtime::reflector::store();
    let ctx = Arc::new(Context::new(
        clients,
        metrics,
        settings,
        instance,
        reader.clone(),
    ));
    let _watching_reads = ctx.watch_reads(namespace.clone());
    let mut watch = watcher::Config::default();
    if let Some(selector) = &ctx.settings.watch_label_selector {
        watch = watch.labels(selector);
    }
    let stream = kube::runtime::WatchStreamExt::default_backoff(watcher(clusters, watch)).inspect(
        move |event| {
            if matches!(event, Ok(watcher::Event::InitDone)) {
                health.set_ready();
            }
        },
    );
    // The store keeps of each cluster's managedFields only what the coexistence check reads.
    let stream = kube::runtime::WatchStreamExt::modify(stream, coexist::keep_what_is_read);
    // A deleted cluster is forgotten as the store lets it go (see `forget` for why here).
    let watched = ctx.clone();
    let stream = kube::runtime::WatchStreamExt::reflect(stream, writer).inspect(move |event| {
        if let Ok(event) = event {
            watched.watched(event);
        }
    });
    // The controller's own writes (report annotations, status) change the object too; only what
    // someone else changes (see `user_inputs`) starts a reconcile. The poll and the node followers wake
    // a run in flight; the store still sees every change.
    let stream = kube::runtime::WatchStreamExt::predicate_filter(
        kube::runtime::WatchStreamExt::touched_objects(stream),
        user_inputs,
        Default::default(),
    );
    // A catalog with new releases (live sources) is shown on every cluster at once, not at each one's
    // idle refresh.
    let releases = ctx.settings.catalog.release_changes();
    // At most `max_concurrent_reconciles` at once (0: no bound); the others wait for a free place
    // in the controller's queue, each cluster once.
    let config = kube::runtime::controller::Config::default()
        .concurrency(ctx.settings.max_concurrent_reconciles);
    let controller = Controller::for_stream(stream, reader)
        .with_config(config)
        .reconcile_on(ctx.wakeups.triggers())
        .reconcile_all_on(releases);
    controller
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "reconcile loop");
            }
        })
        .await;
}
