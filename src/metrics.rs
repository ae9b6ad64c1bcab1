//! Prometheus metrics of the controller, exported in OpenMetrics text format at `GET /metrics`
//! (see [`crate::admin`]).
//!
//! Every metric name lives in this module; the controller updates metrics only through the typed
//! methods of [`Metrics`]. All names start with `talos_upgrade_`. Counters get their `_total` suffix
//! and histograms their `_bucket`/`_sum`/`_count` series from the encoder.
//!
//! # Metrics
//!
//! Per-cluster metrics carry `namespace` and `cluster` (the `KubernetesCluster` object's namespace and
//! name) and, where the value belongs to one upgrade, `kind` = `talos` | `kubernetes`.
//!
//! | name | type | labels | meaning |
//! |---|---|---|---|
//! | `talos_upgrade_cluster_phase` | gauge | `namespace`, `cluster`, `phase` | Always 1. The cluster's `status.phase` (`Ready`, `UpgradingTalos`, `UpgradingKubernetes`, `UpgradeFailed`, or a phase owned by the provisioning operator). Exactly one series per cluster. |
//! | `talos_upgrade_cluster_status` | gauge | `namespace`, `cluster`, `kind`, `status` | Always 1. The upgrade's status annotation: `idle`, `in-progress`, `completed`, `failed`, `blocked`. Exactly one series per cluster and kind. |
//! | `talos_upgrade_cluster_nodes` | gauge | `namespace`, `cluster`, `kind` | Nodes in scope of the upgrade (the `total` of the progress annotation). |
//! | `talos_upgrade_cluster_nodes_completed` | gauge | `namespace`, `cluster`, `kind` | Nodes verified on the target version; nodes already on it count (the `done` of the progress annotation). |
//! | `talos_upgrade_cluster_nodes_failed` | gauge | `namespace`, `cluster`, `kind` | Nodes that failed in the last run (the `failed-nodes` annotation). |
//! | `talos_upgrade_cluster_nodes_in_flight` | gauge | `namespace`, `cluster`, `kind` | Nodes being upgraded right now. |
//! | `talos_upgrade_cluster_upgrading_node` | gauge | `namespace`, `cluster`, `kind`, `node` | Always 1, one series per node being upgraded right now (at most `max-parallel-workers`); no series when none. The only metric with a node label; old nodes are removed, never accumulated. |
//! | `talos_upgrade_cluster_version_info` | gauge | `namespace`, `cluster`, `kind`, `current`, `target`, `available` | Always 1. Current (lowest running), target and available versions as in the annotations, without a leading `v`; an empty label means unknown or none. One series per cluster and kind. |
//! | `talos_upgrade_cluster_run_started_timestamp_seconds` | gauge | `namespace`, `cluster`, `kind` | Unix time the current or last run started; no series when no run is known. |
//! | `talos_upgrade_cluster_last_success_timestamp_seconds` | gauge | `namespace`, `cluster`, `kind` | Unix time the last run completed successfully; no series before the first success seen by this process. |
//! | `talos_upgrade_node_upgrade_duration_seconds` | histogram | `namespace`, `cluster`, `kind`, `role` | Time from starting a node's upgrade to the node verified on the target. `role` = `control-plane` or `worker`. Buckets 1 s .. 1 h. |
//! | `talos_upgrade_runs_total` | counter | `namespace`, `cluster`, `kind`, `result` | Finished upgrade runs; `result` = `completed` or `failed`. |
//! | `talos_upgrade_preflight_failures_total` | counter | `namespace`, `cluster`, `kind`, `check` | Failed pre-node checks (e.g. `nodes-ready`, `talos-api`, `etcd-health`, `etcd-quorum`, `etcd-leader`), by check. |
//! | `talos_upgrade_holds_total` | counter | `namespace`, `cluster`, `kind`, `gate`, `reason` | Holds of a run by one of the operator's gates before its next node (`canary`, `maintenance-window`, `soak`, `alerts`, `health-checks`), by why (`canary-pause`, `outside-window`, `after-node`, `after-control-planes`, `failing`, `unknown`), counted when a hold begins (or its message changes), not per pass. |
//! | `talos_upgrade_hold` | gauge | `namespace`, `cluster`, `kind`, `gate` | 1 for the gate holding the run's next node right now, 0 for the others; no series for a cluster never held. |
//! | `talos_upgrade_reconcile_duration_seconds` | histogram | | Duration of one reconcile of one `KubernetesCluster`. Buckets 5 ms .. 2 min. Its `_count` is the number of reconciles. |
//! | `talos_upgrade_reconcile_errors_total` | counter | `category` | Reconciles that ended in an error, by low-cardinality error category. |
//! | `talos_upgrade_talos_api_calls_total` | counter | `method`, `code` | Talos API calls by gRPC method short name (e.g. `Version`, `Upgrade`, `EtcdMemberList`) and gRPC status code name (`OK`, `Unavailable`, `DeadlineExceeded`, ...). |
//! | `talos_upgrade_silence_requests_total` | counter | `operation`, `result` | Requests to Alertmanager for the silences during Talos runs (`--alertmanager-url`): `operation` = `list`, `create`, `extend` or `expire`, `result` = `ok` or `error`. An error never stops a run; it is also said by a `SilenceFailed` Event. |
//! | `talos_upgrade_etcd_snapshots_total` | counter | `destination`, `result` | etcd snapshots taken before the first control plane of a Talos run, or of a Kubernetes run with `etcd-snapshot: talos-and-kubernetes` (`--etcd-snapshot-dir` or `--etcd-snapshot-s3-bucket`; the kind is in the snapshot's name): `destination` = `dir` or `s3`, `result` = `ok` (stored and verified) or `failed` (the run stopped before any control plane; its message says why). |
//! | `talos_upgrade_rollbacks_total` | counter | `namespace`, `cluster`, `result` | Talos rollbacks (`talos-rollback`): `result` = `completed`, `failed` (a node did not come back on its previous version; the message says which) or `refused` (counted once per refusal message: a bad value, an unknown node, a node with no previous system; no node touched). |
//! | `talos_upgrade_nodes_rolled_back_total` | counter | `namespace`, `cluster`, `kind` | Nodes verified back on their previous version by a rollback (`kind` = `talos`). Rolled-back nodes are not counted by `talos_upgrade_node_upgrade_duration_seconds`. |
//! | `talos_upgrade_build_info` | info | `version` | Always 1; the controller's version. |
//!
//! Cardinality: per cluster and kind a bounded number of series (two roles, two results, the fixed set
//! of preflight checks, at most `max-parallel-workers` upgrading nodes); a deleted cluster's series are
//! removed by [`Metrics::forget_cluster`].

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};
use talos_upgrade_core::holds::{Gate, HoldReason};
use talos_upgrade_core::lifecycle::GateHold;

/// Prefix of every metric name.
pub const PREFIX: &str = "talos_upgrade";

/// Upper bounds of the node upgrade duration histogram, in seconds: 1 s .. 1 h.
pub const NODE_UPGRADE_BUCKETS: [f64; 15] = [
    1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0, 300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0, 2700.0,
    3600.0,
];

/// Upper bounds of the reconcile duration histogram, in seconds: 5 ms .. 2 min.
pub const RECONCILE_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Longest label value taken from user input (version annotations); longer values are cut.
const MAX_VERSION_LABEL_LEN: usize = 64;

/// Identifies one `KubernetesCluster` object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClusterKey {
    pub namespace: String,
    pub cluster: String,
}

impl ClusterKey {
    pub fn new(namespace: impl Into<String>, cluster: impl Into<String>) -> Self {
        ClusterKey {
            namespace: namespace.into(),
            cluster: cluster.into(),
        }
    }
}

impl fmt::Display for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.cluster)
    }
}

/// Which upgrade of a cluster a metric describes (label `kind`) and its status (label `status`): the
/// annotation types themselves, so a metric and an annotation can never disagree on a value.
pub use talos_upgrade_core::annotations::{UpgradeKind, UpgradeStatus};

/// How an upgrade run ended (label `result`): the core's own type.
pub use talos_upgrade_core::run::RunResult;

/// How a rollback ended (label `result`): the core's own type.
pub use talos_upgrade_core::run::RollbackResult;

/// A node's role (label `role`): the rollout's own type, so the two never drift apart.
pub use talos_upgrade_core::run::NodeRole;

/// The observed state of one upgrade kind of one cluster, as exported by
/// [`Metrics::set_cluster_state`]. Versions are given without a leading `v`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterUpgradeGauges {
    pub status: UpgradeStatus,
    pub nodes_total: u32,
    pub nodes_completed: u32,
    pub nodes_failed: u32,
    pub nodes_in_flight: u32,
    /// Nodes being upgraded right now (at most `max-parallel-workers`; one for control planes).
    pub upgrading_nodes: Vec<String>,
    pub current_version: Option<String>,
    pub target_version: Option<String>,
    pub available_version: Option<String>,
    /// Unix time (seconds) the current or last run started.
    pub run_started_at: Option<f64>,
}

// ----- label sets -----

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct PhaseLabels {
    namespace: String,
    cluster: String,
    phase: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct KindLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StatusLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct NodeLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    node: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct VersionLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    current: String,
    target: String,
    available: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RoleLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    role: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ResultLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RollbackLabels {
    namespace: String,
    cluster: String,
    result: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CheckLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    check: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct GateLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    gate: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct HoldLabels {
    namespace: String,
    cluster: String,
    kind: &'static str,
    gate: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct ErrorLabels {
    category: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CallLabels {
    method: &'static str,
    code: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SnapshotLabels {
    destination: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct SilenceLabels {
    operation: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

fn kind_labels(key: &ClusterKey, kind: UpgradeKind) -> KindLabels {
    KindLabels {
        namespace: key.namespace.clone(),
        cluster: key.cluster.clone(),
        kind: kind.as_str(),
    }
}

fn node_histogram() -> Histogram {
    Histogram::new(NODE_UPGRADE_BUCKETS)
}

type TimestampGauge = Gauge<f64, AtomicU64>;

/// The metric families; [`Metrics::new`] registers each under its name.
#[derive(Debug)]
struct Families {
    phase: Family<PhaseLabels, Gauge>,
    status: Family<StatusLabels, Gauge>,
    nodes: Family<KindLabels, Gauge>,
    nodes_completed: Family<KindLabels, Gauge>,
    nodes_failed: Family<KindLabels, Gauge>,
    nodes_in_flight: Family<KindLabels, Gauge>,
    upgrading_node: Family<NodeLabels, Gauge>,
    version_info: Family<VersionLabels, Gauge>,
    run_started: Family<KindLabels, TimestampGauge>,
    last_success: Family<KindLabels, TimestampGauge>,
    node_upgrade_duration: Family<RoleLabels, Histogram, fn() -> Histogram>,
    runs: Family<ResultLabels, Counter>,
    rollbacks: Family<RollbackLabels, Counter>,
    nodes_rolled_back: Family<KindLabels, Counter>,
    preflight_failures: Family<CheckLabels, Counter>,
    holds: Family<HoldLabels, Counter>,
    hold: Family<GateLabels, Gauge>,
    reconcile_duration: Histogram,
    reconcile_errors: Family<ErrorLabels, Counter>,
    talos_api_calls: Family<CallLabels, Counter>,
    silence_requests: Family<SilenceLabels, Counter>,
    etcd_snapshots: Family<SnapshotLabels, Counter>,
}

/// The free-form label sets (phase, node, versions, checks) exported for one cluster, so that a
/// replacement or [`Metrics::forget_cluster`] removes exactly them. Label sets built from enums are
/// removed by enumerating the enum instead.
#[derive(Debug, Default)]
struct ClusterSeries {
    phase: Option<PhaseLabels>,
    upgrading: HashMap<UpgradeKind, Vec<NodeLabels>>,
    versions: HashMap<UpgradeKind, VersionLabels>,
    checks: HashSet<CheckLabels>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    families: Families,
    /// Held while a cluster's series change and while encoding, so a scrape never sees a
    /// half-replaced cluster (no phase, or two phases).
    clusters: Mutex<HashMap<ClusterKey, ClusterSeries>>,
}

/// The controller's metrics. Cheap to clone; all clones share one registry.
#[derive(Clone, Debug)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric of the table in the module documentation registered.
    pub fn new() -> Self {
        let families = Families {
            phase: Family::default(),
            status: Family::default(),
            nodes: Family::default(),
            nodes_completed: Family::default(),
            nodes_failed: Family::default(),
            nodes_in_flight: Family::default(),
            upgrading_node: Family::default(),
            version_info: Family::default(),
            run_started: Family::default(),
            last_success: Family::default(),
            node_upgrade_duration: Family::new_with_constructor(node_histogram),
            runs: Family::default(),
            rollbacks: Family::default(),
            nodes_rolled_back: Family::default(),
            preflight_failures: Family::default(),
            holds: Family::default(),
            hold: Family::default(),
            reconcile_duration: Histogram::new(RECONCILE_BUCKETS),
            reconcile_errors: Family::default(),
            talos_api_calls: Family::default(),
            silence_requests: Family::default(),
            etcd_snapshots: Family::default(),
        };
        let f = &families;
        let mut r = Registry::with_prefix(PREFIX);
        r.register(
            "cluster_phase",
            "Always 1; the cluster's status.phase, one series per cluster",
            f.phase.clone(),
        );
        r.register(
            "cluster_status",
            "Always 1; the upgrade status, one series per cluster and kind",
            f.status.clone(),
        );
        r.register(
            "cluster_nodes",
            "Nodes in scope of the upgrade",
            f.nodes.clone(),
        );
        r.register(
            "cluster_nodes_completed",
            "Nodes verified on the target version, including nodes already on it",
            f.nodes_completed.clone(),
        );
        r.register(
            "cluster_nodes_failed",
            "Nodes that failed in the last run",
            f.nodes_failed.clone(),
        );
        r.register(
            "cluster_nodes_in_flight",
            "Nodes being upgraded right now",
            f.nodes_in_flight.clone(),
        );
        r.register(
            "cluster_upgrading_node",
            "Always 1; one series per node being upgraded right now",
            f.upgrading_node.clone(),
        );
        r.register(
            "cluster_version_info",
            "Always 1; current, target and available versions (empty: unknown or none)",
            f.version_info.clone(),
        );
        r.register_with_unit(
            "cluster_run_started_timestamp",
            "Unix time the current or last upgrade run started",
            Unit::Seconds,
            f.run_started.clone(),
        );
        r.register_with_unit(
            "cluster_last_success_timestamp",
            "Unix time the last upgrade run completed successfully",
            Unit::Seconds,
            f.last_success.clone(),
        );
        r.register_with_unit(
            "node_upgrade_duration",
            "Time from starting a node's upgrade to the node verified on the target",
            Unit::Seconds,
            f.node_upgrade_duration.clone(),
        );
        r.register("runs", "Finished upgrade runs by result", f.runs.clone());
        r.register(
            "rollbacks",
            "Talos rollbacks by result (completed, failed, refused)",
            f.rollbacks.clone(),
        );
        r.register(
            "nodes_rolled_back",
            "Nodes verified back on their previous version by a rollback",
            f.nodes_rolled_back.clone(),
        );
        r.register(
            "preflight_failures",
            "Failed pre-node checks by check",
            f.preflight_failures.clone(),
        );
        r.register(
            "holds",
            "Holds by a gate before a run's next node, counted when a hold begins",
            f.holds.clone(),
        );
        r.register(
            "hold",
            "1 for the gate holding the run's next node now, 0 for the others",
            f.hold.clone(),
        );
        r.register_with_unit(
            "reconcile_duration",
            "Duration of one reconcile of one KubernetesCluster",
            Unit::Seconds,
            f.reconcile_duration.clone(),
        );
        r.register(
            "reconcile_errors",
            "Reconciles that ended in an error, by category",
            f.reconcile_errors.clone(),
        );
        r.register(
            "talos_api_calls",
            "Talos API calls by gRPC method and status code",
            f.talos_api_calls.clone(),
        );
        r.register(
            "silence_requests",
            "Requests to Alertmanager for silences during Talos runs, by operation and result",
            f.silence_requests.clone(),
        );
        r.register(
            "etcd_snapshots",
            "etcd snapshots taken before the control planes of a Talos run (or a Kubernetes run that asks), by destination and result",
            f.etcd_snapshots.clone(),
        );
        r.register(
            "build",
            "The controller's version",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION"),
            }),
        );
        Metrics {
            inner: Arc::new(Inner {
                registry: r,
                families,
                clusters: Mutex::new(HashMap::new()),
            }),
        }
    }

    fn families(&self) -> &Families {
        &self.inner.families
    }

    fn lock_clusters(&self) -> MutexGuard<'_, HashMap<ClusterKey, ClusterSeries>> {
        // Every update leaves the families consistent before it can panic, so a poisoned lock is safe.
        self.inner
            .clusters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// All metrics in OpenMetrics text format, ending with `# EOF`.
    pub fn encode(&self) -> String {
        let _clusters = self.lock_clusters();
        let mut out = String::new();
        if let Err(error) = text::encode(&mut out, &self.inner.registry) {
            // Writing into a String does not fail; keep whatever was encoded.
            tracing::error!(%error, "encoding metrics failed");
        }
        out
    }

    /// Export the cluster's `status.phase`, replacing the previous phase series of the cluster.
    pub fn set_cluster_phase(&self, key: &ClusterKey, phase: &str) {
        let mut clusters = self.lock_clusters();
        let series = clusters.entry(key.clone()).or_default();
        let labels = PhaseLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            phase: phase.to_owned(),
        };
        let f = self.families();
        if let Some(old) = series.phase.replace(labels.clone())
            && old != labels
        {
            f.phase.remove(&old);
        }
        f.phase.get_or_create(&labels).set(1);
    }

    /// Export the state of one upgrade kind of the cluster. Replaces the previous status, node
    /// counts, upgrading nodes, version info and run start of that cluster and kind: label sets that
    /// no longer apply disappear. Leaves the last success time, histograms and counters alone.
    pub fn set_cluster_state(
        &self,
        key: &ClusterKey,
        kind: UpgradeKind,
        state: &ClusterUpgradeGauges,
    ) {
        let mut clusters = self.lock_clusters();
        let series = clusters.entry(key.clone()).or_default();
        let f = self.families();
        let base = kind_labels(key, kind);

        for status in UpgradeStatus::ALL {
            let labels = StatusLabels {
                namespace: key.namespace.clone(),
                cluster: key.cluster.clone(),
                kind: kind.as_str(),
                status: status.as_str(),
            };
            if status == state.status {
                f.status.get_or_create(&labels).set(1);
            } else {
                f.status.remove(&labels);
            }
        }

        f.nodes
            .get_or_create(&base)
            .set(i64::from(state.nodes_total));
        f.nodes_completed
            .get_or_create(&base)
            .set(i64::from(state.nodes_completed));
        f.nodes_failed
            .get_or_create(&base)
            .set(i64::from(state.nodes_failed));
        f.nodes_in_flight
            .get_or_create(&base)
            .set(i64::from(state.nodes_in_flight));

        let mut upgrading: Vec<NodeLabels> = Vec::with_capacity(state.upgrading_nodes.len());
        for node in &state.upgrading_nodes {
            let labels = NodeLabels {
                namespace: key.namespace.clone(),
                cluster: key.cluster.clone(),
                kind: kind.as_str(),
                node: node.clone(),
            };
            if !upgrading.contains(&labels) {
                upgrading.push(labels);
            }
        }
        for old in series.upgrading.remove(&kind).unwrap_or_default() {
            if !upgrading.contains(&old) {
                f.upgrading_node.remove(&old);
            }
        }
        for labels in &upgrading {
            f.upgrading_node.get_or_create(labels).set(1);
        }
        if !upgrading.is_empty() {
            series.upgrading.insert(kind, upgrading);
        }

        let versions = [
            &state.current_version,
            &state.target_version,
            &state.available_version,
        ];
        let new_version = versions.iter().any(|v| v.is_some()).then(|| VersionLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            kind: kind.as_str(),
            current: version_label(&state.current_version),
            target: version_label(&state.target_version),
            available: version_label(&state.available_version),
        });
        if let Some(old) = series.versions.remove(&kind)
            && Some(&old) != new_version.as_ref()
        {
            f.version_info.remove(&old);
        }
        if let Some(labels) = new_version {
            f.version_info.get_or_create(&labels).set(1);
            series.versions.insert(kind, labels);
        }

        match state.run_started_at {
            Some(at) => {
                f.run_started.get_or_create(&base).set(at);
            }
            None => {
                f.run_started.remove(&base);
            }
        }
    }

    /// Record that a run of `kind` completed successfully at `unix_seconds`.
    pub fn record_last_success(&self, key: &ClusterKey, kind: UpgradeKind, unix_seconds: f64) {
        let _clusters = self.lock_clusters();
        self.families()
            .last_success
            .get_or_create(&kind_labels(key, kind))
            .set(unix_seconds);
    }

    /// Observe the time one node took from the start of its upgrade to verified done.
    pub fn observe_node_upgrade(
        &self,
        key: &ClusterKey,
        kind: UpgradeKind,
        role: NodeRole,
        seconds: f64,
    ) {
        let _clusters = self.lock_clusters();
        let labels = RoleLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            kind: kind.as_str(),
            role: role.as_str(),
        };
        self.families()
            .node_upgrade_duration
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// Count a finished run of `kind`.
    pub fn record_run_result(&self, key: &ClusterKey, kind: UpgradeKind, result: RunResult) {
        let _clusters = self.lock_clusters();
        let labels = ResultLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            kind: kind.as_str(),
            result: result.as_str(),
        };
        self.families().runs.get_or_create(&labels).inc();
    }

    /// Count a rollback that ended or was refused.
    pub fn record_rollback(&self, key: &ClusterKey, result: RollbackResult) {
        let _clusters = self.lock_clusters();
        let labels = RollbackLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            result: result.as_str(),
        };
        self.families().rollbacks.get_or_create(&labels).inc();
    }

    /// Count a node verified back on its previous version by a rollback of `kind`.
    pub fn record_node_rolled_back(&self, key: &ClusterKey, kind: UpgradeKind) {
        let _clusters = self.lock_clusters();
        self.families()
            .nodes_rolled_back
            .get_or_create(&kind_labels(key, kind))
            .inc();
    }

    /// Count a failed pre-node check. `check` is a fixed name from the code (`etcd-health`, ...),
    /// never built from input, to keep the label set bounded.
    pub fn record_preflight_failure(
        &self,
        key: &ClusterKey,
        kind: UpgradeKind,
        check: &'static str,
    ) {
        let mut clusters = self.lock_clusters();
        let labels = CheckLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            kind: kind.as_str(),
            check,
        };
        self.families()
            .preflight_failures
            .get_or_create(&labels)
            .inc();
        clusters
            .entry(key.clone())
            .or_default()
            .checks
            .insert(labels);
    }

    /// The gate holding a run's next node now (`None`: none), and whether its hold `began` in this
    /// reconcile (counted once per hold). A cluster never held has no series.
    pub fn set_hold(&self, key: &ClusterKey, kind: UpgradeKind, hold: Option<GateHold>) {
        let _clusters = self.lock_clusters();
        let f = self.families();
        let labels = |gate: Gate| GateLabels {
            namespace: key.namespace.clone(),
            cluster: key.cluster.clone(),
            kind: kind.as_str(),
            gate: gate.as_str(),
        };
        if let Some(hold) = hold
            && hold.began
        {
            f.holds
                .get_or_create(&HoldLabels {
                    namespace: key.namespace.clone(),
                    cluster: key.cluster.clone(),
                    kind: kind.as_str(),
                    gate: hold.gate.as_str(),
                    reason: hold.reason.as_str(),
                })
                .inc();
        }
        let gate = hold.map(|hold| hold.gate);
        for each in Gate::ALL {
            let value = i64::from(Some(each) == gate);
            // Series appear with the first hold, and then go to 0 rather than vanish.
            if gate.is_some() || f.hold.get(&labels(each)).is_some() {
                f.hold.get_or_create(&labels(each)).set(value);
            }
        }
    }

    /// Remove every series of the cluster (on deletion of the `KubernetesCluster`).
    pub fn forget_cluster(&self, key: &ClusterKey) {
        let mut clusters = self.lock_clusters();
        let f = self.families();
        if let Some(series) = clusters.remove(key) {
            if let Some(phase) = series.phase {
                f.phase.remove(&phase);
            }
            for labels in series.upgrading.into_values().flatten() {
                f.upgrading_node.remove(&labels);
            }
            for labels in series.versions.into_values() {
                f.version_info.remove(&labels);
            }
            for labels in series.checks {
                f.preflight_failures.remove(&labels);
            }
        }
        for result in RollbackResult::ALL {
            f.rollbacks.remove(&RollbackLabels {
                namespace: key.namespace.clone(),
                cluster: key.cluster.clone(),
                result: result.as_str(),
            });
        }
        for kind in UpgradeKind::ALL {
            let base = kind_labels(key, kind);
            for family in [
                &f.nodes,
                &f.nodes_completed,
                &f.nodes_failed,
                &f.nodes_in_flight,
            ] {
                family.remove(&base);
            }
            f.run_started.remove(&base);
            f.last_success.remove(&base);
            f.nodes_rolled_back.remove(&base);
            for status in UpgradeStatus::ALL {
                f.status.remove(&StatusLabels {
                    namespace: key.namespace.clone(),
                    cluster: key.cluster.clone(),
                    kind: kind.as_str(),
                    status: status.as_str(),
                });
            }
            for role in NodeRole::ALL {
                f.node_upgrade_duration.remove(&RoleLabels {
                    namespace: key.namespace.clone(),
                    cluster: key.cluster.clone(),
                    kind: kind.as_str(),
                    role: role.as_str(),
                });
            }
            for gate in Gate::ALL {
                let labels = GateLabels {
                    namespace: key.namespace.clone(),
                    cluster: key.cluster.clone(),
                    kind: kind.as_str(),
                    gate: gate.as_str(),
                };
                for reason in HoldReason::ALL {
                    f.holds.remove(&HoldLabels {
                        namespace: key.namespace.clone(),
                        cluster: key.cluster.clone(),
                        kind: kind.as_str(),
                        gate: gate.as_str(),
                        reason: reason.as_str(),
                    });
                }
                f.hold.remove(&labels);
            }
            for result in RunResult::ALL {
                f.runs.remove(&ResultLabels {
                    namespace: key.namespace.clone(),
                    cluster: key.cluster.clone(),
                    kind: kind.as_str(),
                    result: result.as_str(),
                });
            }
        }
    }

    /// Observe the duration of one reconcile.
    pub fn observe_reconcile(&self, duration_seconds: f64) {
        self.families().reconcile_duration.observe(duration_seconds);
    }

    /// A guard that observes the reconcile duration when dropped.
    pub fn reconcile_timer(&self) -> ReconcileTimer {
        ReconcileTimer {
            metrics: self.clone(),
            start: Instant::now(),
        }
    }

    /// Count a reconcile that ended in an error. `category` is a fixed, low-cardinality name
    /// (e.g. the error enum's `category()`).
    pub fn record_reconcile_error(&self, category: &'static str) {
        self.families()
            .reconcile_errors
            .get_or_create(&ErrorLabels { category })
            .inc();
    }

    /// Count one Talos API call: `method` is the gRPC method short name (`Upgrade`), `code` the
    /// status code name (see [`talos_api::grpc_code_name`]).
    pub fn record_talos_call(&self, method: &'static str, code: &'static str) {
        self.families()
            .talos_api_calls
            .get_or_create(&CallLabels { method, code })
            .inc();
    }

    /// Count one request to Alertmanager: `operation` is `list`, `create`, `extend` or `expire`.
    pub fn record_silence_request(&self, operation: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.families()
            .silence_requests
            .get_or_create(&SilenceLabels { operation, result })
            .inc();
    }

    /// Count one etcd snapshot: `destination` is `dir` or `s3`.
    pub fn record_etcd_snapshot(&self, destination: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.families()
            .etcd_snapshots
            .get_or_create(&SnapshotLabels {
                destination,
                result,
            })
            .inc();
    }
}

/// Observes the elapsed time into `talos_upgrade_reconcile_duration_seconds` when dropped.
#[derive(Debug)]
pub struct ReconcileTimer {
    metrics: Metrics,
    start: Instant,
}

impl Drop for ReconcileTimer {
    fn drop(&mut self) {
        self.metrics
            .observe_reconcile(self.start.elapsed().as_secs_f64());
    }
}

/// A version label value: as given, empty when unknown, cut to a bounded length since target values
/// come from user annotations.
fn version_label(version: &Option<String>) -> String {
    let Some(v) = version else {
        return String::new();
    };
    if v.len() <= MAX_VERSION_LABEL_LEN {
        return v.clone();
    }
    let mut end = MAX_VERSION_LABEL_LEN;
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    v[..end].to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric name in the module documentation table, as encoded.
    const DOCUMENTED: [&str; 23] = [
        "talos_upgrade_cluster_phase",
        "talos_upgrade_cluster_status",
        "talos_upgrade_cluster_nodes",
        "talos_upgrade_cluster_nodes_completed",
        "talos_upgrade_cluster_nodes_failed",
        "talos_upgrade_cluster_nodes_in_flight",
        "talos_upgrade_cluster_upgrading_node",
        "talos_upgrade_cluster_version_info",
        "talos_upgrade_cluster_run_started_timestamp_seconds",
        "talos_upgrade_cluster_last_success_timestamp_seconds",
        "talos_upgrade_node_upgrade_duration_seconds",
        "talos_upgrade_runs_total",
        "talos_upgrade_preflight_failures_total",
        "talos_upgrade_holds_total",
        "talos_upgrade_hold",
        "talos_upgrade_reconcile_duration_seconds",
        "talos_upgrade_reconcile_errors_total",
        "talos_upgrade_talos_api_calls_total",
        "talos_upgrade_silence_requests_total",
        "talos_upgrade_etcd_snapshots_total",
        "talos_upgrade_rollbacks_total",
        "talos_upgrade_nodes_rolled_back_total",
        "talos_upgrade_build_info",
    ];

    /// The sample lines of metric `name` (exactly that name, not a longer one).
    fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
            })
            .collect()
    }

    fn in_progress(node: &str) -> ClusterUpgradeGauges {
        ClusterUpgradeGauges {
            status: UpgradeStatus::InProgress,
            nodes_total: 5,
            nodes_completed: 2,
            nodes_failed: 0,
            nodes_in_flight: 1,
            upgrading_nodes: vec![node.to_owned()],
            current_version: Some("1.11.6".to_owned()),
            target_version: Some("1.12.0".to_owned()),
            available_version: Some("1.12.0".to_owned()),
            run_started_at: Some(1_700_000_000.0),
        }
    }

    /// A hold of `gate` as a pass reports it (soak after a node, or an external check failing).
    fn held(gate: Gate, began: bool) -> GateHold {
        let reason = match gate {
            Gate::Soak => HoldReason::SoakAfterNode,
            Gate::MaintenanceWindow => HoldReason::OutsideWindow,
            Gate::Canary => HoldReason::CanaryPause,
            Gate::Alerts | Gate::HealthChecks => HoldReason::CheckFailing,
        };
        GateHold {
            gate,
            reason,
            began,
        }
    }

    fn exercise_all(m: &Metrics, key: &ClusterKey) {
        m.set_cluster_phase(key, "UpgradingTalos");
        m.set_cluster_state(key, UpgradeKind::Talos, &in_progress("cp-1"));
        m.record_last_success(key, UpgradeKind::Talos, 1_700_000_500.0);
        m.observe_node_upgrade(key, UpgradeKind::Talos, NodeRole::ControlPlane, 95.0);
        m.record_run_result(key, UpgradeKind::Talos, RunResult::Completed);
        m.record_preflight_failure(key, UpgradeKind::Talos, "etcd-health");
        m.set_hold(key, UpgradeKind::Talos, Some(held(Gate::Soak, true)));
        m.observe_reconcile(0.2);
        m.record_reconcile_error("kube");
        m.record_talos_call("Upgrade", talos_api::grpc_code_name(tonic::Code::Ok));
        m.record_silence_request("create", true);
        m.record_etcd_snapshot("dir", true);
        m.record_rollback(key, RollbackResult::Completed);
        m.record_node_rolled_back(key, UpgradeKind::Talos);
    }

    #[test]
    fn every_documented_metric_is_encoded() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        exercise_all(&m, &key);
        let text = m.encode();
        for name in DOCUMENTED {
            // HELP/TYPE name the family: without `_total` (counters) or `_info` (info).
            let family = name
                .strip_suffix("_total")
                .or_else(|| {
                    name.strip_suffix("_build_info")
                        .map(|_| "talos_upgrade_build")
                })
                .unwrap_or(name);
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("# HELP {family} "))),
                "no HELP for {family} in\n{text}"
            );
        }
        // Each family has a sample, not just a descriptor.
        for name in DOCUMENTED {
            let sample = match name {
                "talos_upgrade_node_upgrade_duration_seconds"
                | "talos_upgrade_reconcile_duration_seconds" => format!("{name}_count"),
                _ => name.to_owned(),
            };
            assert!(
                !samples(&text, &sample).is_empty(),
                "no sample of {sample} in\n{text}"
            );
        }
        assert!(text.ends_with("# EOF\n"));
        assert!(text.contains("# TYPE talos_upgrade_runs counter"));
        assert!(text.contains("# TYPE talos_upgrade_cluster_version_info gauge"));
        assert!(text.contains(
            r#"talos_upgrade_cluster_version_info{namespace="ns",cluster="c1",kind="talos",current="1.11.6",target="1.12.0",available="1.12.0"} 1"#
        ));
        assert!(text.contains(
            r#"talos_upgrade_cluster_nodes_completed{namespace="ns",cluster="c1",kind="talos"} 2"#
        ));
        assert!(text.contains(
            r#"talos_upgrade_runs_total{namespace="ns",cluster="c1",kind="talos",result="completed"} 1"#
        ));
        assert!(
            text.contains(r#"talos_upgrade_talos_api_calls_total{method="Upgrade",code="OK"} 1"#)
        );
        assert!(text.contains(&format!(
            r#"talos_upgrade_build_info{{version="{}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        )));
    }

    #[test]
    fn documentation_table_lists_exactly_the_exported_metrics() {
        let documented: Vec<&str> = include_str!("metrics.rs")
            .lines()
            .filter_map(|l| l.strip_prefix("//! | `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        assert_eq!(documented, DOCUMENTED);

        let m = Metrics::new();
        exercise_all(&m, &ClusterKey::new("ns", "c1"));
        let text = m.encode();
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        assert_eq!(families.len(), DOCUMENTED.len(), "{families:?}");
        for family in families {
            assert!(
                DOCUMENTED.iter().any(|d| d.starts_with(family)),
                "{family} is exported but not documented"
            );
        }
    }

    #[test]
    fn replacing_state_leaves_one_series_per_cluster() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        m.set_cluster_phase(&key, "Ready");
        m.set_cluster_phase(&key, "UpgradingTalos");
        m.set_cluster_state(&key, UpgradeKind::Talos, &in_progress("w-1"));
        m.set_cluster_state(&key, UpgradeKind::Talos, &in_progress("cp-1"));
        let text = m.encode();
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_phase"),
            [
                r#"talos_upgrade_cluster_phase{namespace="ns",cluster="c1",phase="UpgradingTalos"} 1"#
            ]
        );
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_upgrading_node"),
            [
                r#"talos_upgrade_cluster_upgrading_node{namespace="ns",cluster="c1",kind="talos",node="cp-1"} 1"#
            ]
        );
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_status"),
            [
                r#"talos_upgrade_cluster_status{namespace="ns",cluster="c1",kind="talos",status="in-progress"} 1"#
            ]
        );

        // Run finished: new status and versions, no node upgrading, no run start.
        let done = ClusterUpgradeGauges {
            status: UpgradeStatus::Completed,
            nodes_total: 5,
            nodes_completed: 5,
            current_version: Some("1.12.0".to_owned()),
            target_version: Some("1.12.0".to_owned()),
            ..ClusterUpgradeGauges::default()
        };
        m.set_cluster_state(&key, UpgradeKind::Talos, &done);
        m.set_cluster_phase(&key, "Ready");
        let text = m.encode();
        assert_eq!(samples(&text, "talos_upgrade_cluster_phase").len(), 1);
        assert!(text.contains(r#"phase="Ready"} 1"#));
        assert!(samples(&text, "talos_upgrade_cluster_upgrading_node").is_empty());
        assert!(samples(&text, "talos_upgrade_cluster_run_started_timestamp_seconds").is_empty());
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_status"),
            [
                r#"talos_upgrade_cluster_status{namespace="ns",cluster="c1",kind="talos",status="completed"} 1"#
            ]
        );
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_version_info"),
            [
                r#"talos_upgrade_cluster_version_info{namespace="ns",cluster="c1",kind="talos",current="1.12.0",target="1.12.0",available=""} 1"#
            ]
        );

        // The other kind has its own series; no versions known means no version series.
        m.set_cluster_state(
            &key,
            UpgradeKind::Kubernetes,
            &ClusterUpgradeGauges::default(),
        );
        let text = m.encode();
        assert_eq!(samples(&text, "talos_upgrade_cluster_status").len(), 2);
        assert_eq!(
            samples(&text, "talos_upgrade_cluster_version_info").len(),
            1
        );
    }

    #[test]
    fn parallel_workers_are_replaced_not_accumulated() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        let mut state = in_progress("w-1");
        state.upgrading_nodes = vec!["w-1".into(), "w-2".into(), "w-1".into()];
        m.set_cluster_state(&key, UpgradeKind::Talos, &state);
        assert_eq!(
            samples(&m.encode(), "talos_upgrade_cluster_upgrading_node").len(),
            2
        );
        state.upgrading_nodes = vec!["w-2".into(), "w-3".into()];
        m.set_cluster_state(&key, UpgradeKind::Talos, &state);
        let text = m.encode();
        let nodes = samples(&text, "talos_upgrade_cluster_upgrading_node");
        assert_eq!(nodes.len(), 2, "{text}");
        assert!(nodes.iter().all(|l| !l.contains(r#"node="w-1""#)));
    }

    #[test]
    fn a_hold_is_counted_once_when_it_begins_and_its_gauge_returns_to_zero() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        let series = |text: &str, name: &str, gate: &str| -> Option<String> {
            samples(text, name)
                .into_iter()
                .find(|l| l.contains(&format!(r#"gate="{gate}""#)))
                .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
        };
        m.set_hold(&key, UpgradeKind::Talos, None);
        assert_eq!(series(&m.encode(), "talos_upgrade_hold", "soak"), None);

        m.set_hold(&key, UpgradeKind::Talos, Some(held(Gate::Soak, true)));
        m.set_hold(&key, UpgradeKind::Talos, Some(held(Gate::Soak, false)));
        let text = m.encode();
        assert_eq!(
            series(&text, "talos_upgrade_hold", "soak").as_deref(),
            Some("1")
        );
        assert_eq!(
            series(&text, "talos_upgrade_hold", "alerts").as_deref(),
            Some("0")
        );
        assert_eq!(
            series(&text, "talos_upgrade_holds_total", "soak").as_deref(),
            Some("1")
        );

        m.set_hold(&key, UpgradeKind::Talos, Some(held(Gate::Alerts, true)));
        m.set_hold(&key, UpgradeKind::Talos, None);
        let text = m.encode();
        assert_eq!(
            series(&text, "talos_upgrade_hold", "soak").as_deref(),
            Some("0")
        );
        assert_eq!(
            series(&text, "talos_upgrade_hold", "alerts").as_deref(),
            Some("0")
        );
        assert_eq!(
            series(&text, "talos_upgrade_holds_total", "alerts").as_deref(),
            Some("1")
        );
        assert_eq!(
            series(&text, "talos_upgrade_holds_total", "soak").as_deref(),
            Some("1")
        );
    }

    #[test]
    fn forget_cluster_removes_its_series_and_keeps_others() {
        let m = Metrics::new();
        let gone = ClusterKey::new("ns", "gone");
        let kept = ClusterKey::new("ns", "kept");
        exercise_all(&m, &gone);
        m.set_cluster_state(&gone, UpgradeKind::Kubernetes, &in_progress("cp-2"));
        m.observe_node_upgrade(&gone, UpgradeKind::Kubernetes, NodeRole::Worker, 30.0);
        m.record_run_result(&gone, UpgradeKind::Kubernetes, RunResult::Failed);
        m.record_preflight_failure(&gone, UpgradeKind::Kubernetes, "nodes-ready");
        m.record_last_success(&gone, UpgradeKind::Kubernetes, 1.0);
        exercise_all(&m, &kept);
        let before = m.encode();
        assert!(before.contains(r#"cluster="gone""#));

        m.forget_cluster(&gone);
        let text = m.encode();
        assert!(!text.contains(r#"cluster="gone""#), "left over:\n{text}");
        for name in DOCUMENTED {
            let kept_before = before
                .lines()
                .filter(|l| l.starts_with(name) && l.contains(r#"cluster="kept""#))
                .count();
            let kept_after = text
                .lines()
                .filter(|l| l.starts_with(name) && l.contains(r#"cluster="kept""#))
                .count();
            assert_eq!(kept_before, kept_after, "{name}");
        }
        // Global metrics stay.
        assert!(!samples(&text, "talos_upgrade_reconcile_errors_total").is_empty());
        // Forgetting an unknown cluster is harmless.
        m.forget_cluster(&ClusterKey::new("other", "never"));
    }

    #[test]
    fn histogram_buckets_are_encoded() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        m.observe_node_upgrade(&key, UpgradeKind::Talos, NodeRole::Worker, 42.0);
        m.observe_node_upgrade(&key, UpgradeKind::Talos, NodeRole::Worker, 4000.0);
        drop(m.reconcile_timer());
        let text = m.encode();
        let prefix = "talos_upgrade_node_upgrade_duration_seconds_bucket{le=";
        let labels = r#",namespace="ns",cluster="c1",kind="talos",role="worker"}"#;
        let buckets: Vec<&str> = text.lines().filter(|l| l.starts_with(prefix)).collect();
        assert_eq!(buckets.len(), NODE_UPGRADE_BUCKETS.len() + 1, "{text}");
        for (le, count) in [("1.0", 0), ("60.0", 1), ("3600.0", 1), ("+Inf", 2)] {
            let line = format!(r#"{prefix}"{le}"{labels} {count}"#);
            assert!(
                buckets.contains(&line.as_str()),
                "no {line} in {buckets:#?}"
            );
        }
        assert!(text.contains("# UNIT talos_upgrade_node_upgrade_duration_seconds seconds"));
        assert!(text.contains(r#"talos_upgrade_reconcile_duration_seconds_bucket{le="0.005"}"#));
        assert!(text.contains("talos_upgrade_reconcile_duration_seconds_count 1"));
    }

    #[test]
    fn user_supplied_versions_are_bounded_and_escaped() {
        let m = Metrics::new();
        let key = ClusterKey::new("ns", "c1");
        let state = ClusterUpgradeGauges {
            target_version: Some(format!("1.12.0\"\n{}", "x".repeat(200))),
            ..ClusterUpgradeGauges::default()
        };
        m.set_cluster_state(&key, UpgradeKind::Talos, &state);
        let text = m.encode();
        let info = samples(&text, "talos_upgrade_cluster_version_info");
        assert_eq!(info.len(), 1, "{text}");
        assert!(info[0].contains(r#"target="1.12.0\"\nxxx"#), "{}", info[0]);
        assert!(info[0].len() < 200, "{}", info[0]);
    }

    #[test]
    fn clones_share_the_registry() {
        let m = Metrics::new();
        let c = m.clone();
        c.record_talos_call(
            "Version",
            talos_api::grpc_code_name(tonic::Code::Unavailable),
        );
        assert!(m.encode().contains(
            r#"talos_upgrade_talos_api_calls_total{method="Version",code="Unavailable"} 1"#
        ));
    }
}
