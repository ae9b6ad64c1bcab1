//! A complete test world for end-to-end tests: the shared real API server, with a simulated Talos
//! cluster registered in the test's namespace as vitistack would (the `test-world` crate builds it: the
//! CRDs, the simulator, its Machines, credentials Secret and `KubernetesCluster`, its nodes as workload
//! Nodes), and the controller itself (watching only the test's namespace, so tests in one binary do not
//! share a controller), with what the tests wait on and assert.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::Api;
use talos_api::ConnectOptions;
use talos_sim::workload::WorkloadMirror;
use talos_sim::{ClientRole, Simulator, Timings};
use talos_upgrade_controller::admin::HealthState;
use talos_upgrade_controller::catalog_sources::CatalogHandle;
use talos_upgrade_controller::metrics::Metrics;
use talos_upgrade_controller::reconcile::{self, Settings};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::lifecycle::Limits;
use test_world::{ClusterShape, Registration, SpecData};
use testenv::{ControlPlane, TestNamespace};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

// The releases of the user guide's example: Talos 1.11.6 → 1.12.0, Kubernetes 1.34.1 → 1.35.0.
pub use test_world::guide_releases;

/// Selects the KubernetesCluster CRD the end-to-end suites run under: `project` (deploy/crd.yaml, the
/// default) or `vitistack` (vitistack's own, which prunes unknown fields and requires `phase`,
/// `conditions` and `state` once a status exists). The two cannot coexist in one API server, and a test
/// binary has one, so `scripts/test.sh` runs the end-to-end binaries once under each.
pub const CRD_ENV: &str = "TUC_E2E_CRD";

/// The CRD chosen by [`CRD_ENV`].
pub fn cluster_crd() -> &'static str {
    match std::env::var(CRD_ENV).as_deref() {
        Err(_) | Ok("") | Ok("project") => test_world::PROJECT_CLUSTER_CRD,
        Ok("vitistack") => test_world::VITISTACK_CLUSTER_CRD,
        Ok(other) => panic!("{CRD_ENV}={other:?}: use \"project\" or \"vitistack\""),
    }
}

/// The key of `status.phase` in an [`AnnotationLog`] state.
pub const PHASE_KEY: &str = "status.phase";

/// Every distinct state of the cluster's `upgrade.vitistack.io/` annotations (and its `status.phase`,
/// under [`PHASE_KEY`]), in the order the API server saw them (from a watch, so no intermediate state is missed). See [`World::record_annotations`].
#[derive(Clone, Default)]
pub struct AnnotationLog {
    states: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
}

impl AnnotationLog {
    /// The states so far, keys without the `upgrade.vitistack.io/` prefix.
    pub fn states(&self) -> Vec<BTreeMap<String, String>> {
        self.states
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The successive distinct values of one key (absent reads as "").
    pub fn values(&self, key: &str) -> Vec<String> {
        let mut values: Vec<String> = Vec::new();
        for state in self.states() {
            let value = state.get(key).cloned().unwrap_or_default();
            if values.last() != Some(&value) {
                values.push(value);
            }
        }
        values
    }
}

/// One Event on the cluster as `kubectl get events` shows it.
#[derive(Debug, Clone)]
pub struct ClusterEvent {
    pub type_: String,
    pub reason: String,
    pub message: String,
    /// Occurrences: a series of repeats counts as its count.
    pub count: u64,
}

pub struct World {
    pub ns: TestNamespace,
    pub sim: Simulator,
    pub cluster: String,
    /// The controller's metrics; shared by every controller instance this world starts, so counters
    /// (e.g. the reconcile count) keep growing across restarts.
    pub metrics: Metrics,
    /// Stops everything: the simulator's workload mirror and the controller.
    stop: CancellationToken,
    settings: Settings,
    /// Where the controller's own API client connects, as the controller binary builds it
    /// (`api_client`: HTTP/2 to the API server), from the namespace's kubeconfig.
    controller_config: kube::Config,
    /// The running controller, if any (see [`World::stop_controller`] and [`World::start_controller`]).
    controller: Mutex<Option<RunningController>>,
    /// How many controller instances were started, to give each its own event reporter instance.
    generation: Mutex<u32>,
    /// How far the controller's clock is ahead of the system's (see [`World::set_clock`]); shared by
    /// every controller instance, so a restarted one keeps the test's time.
    clock_offset: Arc<Mutex<jiff::SignedDuration>>,
    /// The Alertmanager of the silences (tests/e2e/silences.rs): each controller instance gets a
    /// client of its own, as a new process would (nothing it listed carried over).
    silences: Option<talos_upgrade_controller::silences::AlertmanagerConfig>,
}

/// One controller instance: its own stop token (a child of the world's) and its task.
struct RunningController {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(running) = self
            .controller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            running.task.abort();
        }
    }
}

/// Where the nodes' configs keep their Kubernetes component images (Talos 1.14 moved them to documents;
/// machinery v1.14.1 `config/types/k8s/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigShape {
    /// In the v1alpha1 document, as every config created before Talos 1.14 (and kept through upgrades).
    V1alpha1,
    /// In the `Kube*Config` documents, as configs created on Talos 1.14.
    Documents,
    /// Control planes in v1alpha1 (upgraded from 1.13), workers in documents (created on 1.14).
    Mixed,
}

pub struct WorldSpec {
    pub control_planes: usize,
    pub workers: usize,
    pub talos: &'static str,
    pub kubernetes: &'static str,
    pub node_deadline: Duration,
    /// How long a drain may take (Talos ≥ 1.13).
    pub drain_timeout: Duration,
    /// The releases the controller knows; `None`: the user guide's (examples/release-catalog.yaml),
    /// with newer targets allowed (the suites upgrade to Talos 1.13 and 1.14 beyond it).
    pub catalog: Option<CatalogHandle>,
    /// Start the in-process controller (tests that run the controller binary themselves say no).
    pub start_controller: bool,
    /// A registry mirror the nodes take their Kubernetes images from (`None`: the upstream ones).
    pub image_registry: Option<&'static str>,
    /// The installer image repository the nodes were installed from (`<repository>:v<talos>`), e.g. an
    /// Image Factory one with a schematic; `None`: `ghcr.io/siderolabs/installer`.
    pub installer_repository: Option<&'static str>,
    /// The nodes' configs carry the install image in an `UnattendedInstallConfig` document (configs
    /// created on Talos 1.14).
    pub unattended_install: bool,
    /// The platform the nodes report (`None`: `metal`).
    pub platform: Option<&'static str>,
    /// Which nodes keep their Kubernetes component images in the Talos 1.14 `Kube*Config` documents.
    pub config_shape: ConfigShape,
    /// The simulated nodes' timings; [`Timings::fast`] by default.
    pub timings: Timings,
    /// How often the controller looks again at a cluster with an upgrade in flight (100 ms by default,
    /// so tests do not wait on it).
    pub poll_interval: Duration,
    /// How often the controller looks again at an idle cluster (its versions, `*-available`); the
    /// controller's default (10 min) unless a test needs to see a refresh.
    pub idle_interval: Duration,
    /// Run on a control plane of its own instead of the one the test binary shares: for a test that
    /// restarts the API server, which would disturb every other test running beside it.
    pub own_control_plane: bool,
}

impl Default for WorldSpec {
    fn default() -> Self {
        WorldSpec {
            control_planes: 3,
            workers: 2,
            talos: "1.11.6",
            kubernetes: "1.34.1",
            node_deadline: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(60),
            catalog: None,
            start_controller: true,
            image_registry: None,
            installer_repository: None,
            unattended_install: false,
            platform: None,
            config_shape: ConfigShape::V1alpha1,
            timings: Timings::fast(),
            poll_interval: Duration::from_millis(100),
            idle_interval: Settings::default().idle_interval,
            own_control_plane: false,
        }
    }
}

/// What vitistack records about the tests' clusters besides their id.
const SPEC_DATA: SpecData = SpecData {
    cluster_uid: "a30fbc8d-596f-48d0-8541-dbc23bca28a1",
    environment: "dev",
    datacenter: "test-south-az1",
    region: "south",
    zone: "az1",
    project: "e2e",
    workspace: "e2e",
    workorder: "e2e",
};

impl World {
    pub async fn start(prefix: &str, spec: WorldSpec) -> World {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let control_plane: &'static ControlPlane = if spec.own_control_plane {
            // Kept until the test binary ends (its processes die with it).
            Box::leak(Box::new(
                ControlPlane::start()
                    .await
                    .expect("a control plane of the test's own"),
            ))
        } else {
            ControlPlane::shared()
        };
        let ns = control_plane.test_namespace(prefix).await;
        test_world::install_crd(&ns.client, cluster_crd())
            .await
            .expect("the KubernetesCluster CRD");
        test_world::install_crd(&ns.client, test_world::MACHINE_CRD)
            .await
            .expect("the Machine CRD");

        // The cluster is named after the namespace, and so are its nodes (`<namespace>-cp-1`, ...):
        // Node names are cluster-wide in the API server.
        let shape = ClusterShape {
            control_planes: spec.control_planes,
            workers: spec.workers,
            talos: spec.talos.to_string(),
            kubernetes: spec.kubernetes.to_string(),
            timings: spec.timings,
            image_registry: spec.image_registry.map(str::to_string),
            installer_repository: spec.installer_repository.map(str::to_string),
            unattended_install: spec.unattended_install,
        };
        let knobs = test_world::NodeKnobs {
            platform: spec.platform.map(str::to_string),
            kubernetes_documents: spec.config_shape == ConfigShape::Documents,
        };
        let mut config = shape.sim_config_with(&ns.name, &knobs);
        if spec.config_shape == ConfigShape::Mixed {
            // Workers joined after the cluster moved to 1.14, created with 1.14's config shape.
            for node in config
                .nodes
                .iter_mut()
                .filter(|n| !n.role.is_control_plane())
            {
                node.kubernetes_documents = true;
                node.unattended_install = true;
            }
        }
        let sim = Simulator::start(config).await.expect("simulator");
        let stop = CancellationToken::new();

        // The workload cluster is the test API server itself.
        test_world::mirror_workload(&sim, &WorkloadMirror::new(ns.client.clone()), &stop)
            .expect("the workload mirror");

        // Machines, the credentials Secret (named after the cluster id, as vitistack does, with the
        // namespace's kubeconfig as the workload cluster's) and the KubernetesCluster.
        let cluster = "my-cluster".to_string();
        let cluster_id = format!("{}-id", ns.name);
        let kubeconfig = std::fs::read_to_string(ns.kubeconfig()).expect("kubeconfig");
        let registration = Registration {
            namespace: &ns.name,
            name: &cluster,
            cluster_id: &cluster_id,
            data: &SPEC_DATA,
            kubeconfig: &kubeconfig,
        };
        test_world::register_cluster(&ns.client, &sim, &shape, &registration)
            .await
            .expect("the cluster's Machines, Secret and KubernetesCluster");

        let metrics = Metrics::new();
        let clock_offset = Arc::new(Mutex::new(jiff::SignedDuration::ZERO));
        let offset = clock_offset.clone();
        let settings = Settings {
            // The system's time, shifted by what the test set: time keeps moving (deadlines, soak),
            // from wherever the test put it (a maintenance window).
            clock: reconcile::Clock::from_fn(move || {
                jiff::Timestamp::now() + *offset.lock().unwrap_or_else(|p| p.into_inner())
            }),
            limits: Limits {
                node_deadline: spec.node_deadline,
                drain_timeout: spec.drain_timeout,
                // Fast simulated nodes start an upgrade sequence within milliseconds of the call.
                unanswered_grace: Duration::from_secs(3),
                retry_after: Duration::from_millis(200),
                step_deadline: Duration::from_secs(60),
                // Set from `etcd_snapshots` when the controller starts.
                etcd_snapshot: false,
            },
            catalog: spec
                .catalog
                .unwrap_or_else(test_world::guide_catalog_allowing_unknown),
            poll_interval: spec.poll_interval,
            idle_interval: spec.idle_interval,
            talos: ConnectOptions {
                port: sim.config().port,
                connect_timeout: Duration::from_secs(2),
                ..ConnectOptions::default()
            },
            ..Settings::default()
        };
        let controller_config =
            talos_upgrade_controller::api_client::config_from_file(ns.kubeconfig())
                .await
                .expect("a config from the namespace's kubeconfig");
        let world = World {
            ns,
            sim,
            cluster,
            metrics,
            stop,
            settings,
            controller_config,
            controller: Mutex::new(None),
            generation: Mutex::new(0),
            clock_offset,
            silences: None,
        };
        if spec.start_controller {
            world.start_controller();
        }
        world
    }

    /// Starts a controller instance (a fresh one: no cache, no queue, nothing remembered but what is
    /// in the API server). Panics if one is running.
    pub fn start_controller(&self) {
        let mut controller = self.controller.lock().unwrap_or_else(|p| p.into_inner());
        assert!(controller.is_none(), "a controller is already running");
        let generation = {
            let mut generation = self.generation.lock().unwrap_or_else(|p| p.into_inner());
            *generation += 1;
            *generation
        };
        let stop = self.stop.child_token();
        // Clients of its own, as a new process would have: no connection shared with the last one.
        let clients = reconcile::ApiClients::connect(&self.controller_config)
            .expect("the controller's API clients");
        let mut settings = self.settings.clone();
        settings.silences = self.silences.clone().map(|config| {
            talos_upgrade_controller::silences::Alertmanager::new(config, self.ns.client.clone())
                .expect("the silences' configuration")
        });
        let task = tokio::spawn(reconcile::run(
            clients,
            Some(self.ns.name.clone()),
            self.metrics.clone(),
            settings,
            HealthState::default(),
            format!("test-{}-{generation}", self.ns.name),
            stop.clone().cancelled_owned(),
        ));
        *controller = Some(RunningController { stop, task });
    }

    /// Stops the controller gracefully, as on SIGTERM: reconciles already running finish, no new one
    /// starts; returns once it has stopped. The simulator and the workload mirror keep running.
    pub async fn stop_controller(&self) {
        let running = self
            .controller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .expect("no controller is running");
        running.stop.cancel();
        tokio::time::timeout(Duration::from_secs(60), running.task)
            .await
            .expect("the controller did not stop within 60s")
            .expect("the controller task panicked");
    }

    /// Kills the controller, as a crash or SIGKILL would: its task is dropped wherever it is, in the
    /// middle of a reconcile or not. Returns once it is gone.
    pub async fn kill_controller(&self) {
        let running = self
            .controller
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .expect("no controller is running");
        running.task.abort();
        match running.task.await {
            Ok(()) => {}
            Err(error) if error.is_cancelled() => {}
            Err(error) => panic!("the controller task panicked: {error}"),
        }
    }

    /// Sets the controller's clock to `now`, from where it goes on at the system clock's pace: every
    /// decision from the next reconcile on (a maintenance window) sees this time. Wakes no reconcile.
    pub fn set_clock(&self, now: jiff::Timestamp) {
        *self.clock_offset.lock().unwrap_or_else(|p| p.into_inner()) =
            now.duration_since(jiff::Timestamp::now());
    }

    /// Gives the controller instances started from now on the alert gate `config`
    /// (tests/e2e/alert_gate.rs); its auth Secret is read with the namespace's client.
    pub fn set_alert_gate(
        &mut self,
        config: talos_upgrade_controller::holds::alerts::AlertGateConfig,
    ) {
        self.settings.gates.alerts = Some(
            talos_upgrade_controller::holds::alerts::Prometheus::new(
                config,
                self.ns.client.clone(),
            )
            .expect("the alert gate's configuration"),
        );
    }

    /// Gives the controller instances started from now on Alertmanager silences with `config`
    /// (tests/e2e/silences.rs).
    pub fn set_silences(&mut self, config: talos_upgrade_controller::silences::AlertmanagerConfig) {
        self.silences = Some(config);
    }

    /// Gives the controller instances started from now on an etcd snapshot destination
    /// (tests/e2e/etcd_snapshot.rs).
    pub fn set_etcd_snapshots(
        &mut self,
        config: talos_upgrade_controller::etcd_snapshot::SnapshotConfig,
    ) {
        self.settings.etcd_snapshots = Some(config);
    }

    /// [`World::stop_controller`], then [`World::start_controller`].
    pub async fn restart_controller(&self) {
        self.stop_controller().await;
        self.start_controller();
    }

    /// Starts recording every change of the cluster's `upgrade.vitistack.io/` annotations, for asserting
    /// on the whole story a user watching the object would have seen. Returns once the watch has
    /// delivered the current state.
    pub async fn record_annotations(&self) -> AnnotationLog {
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};

        let log = AnnotationLog::default();
        let api: Api<KubernetesCluster> = Api::namespaced(self.ns.client.clone(), &self.ns.name);
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.cluster));
        let states = log.states.clone();
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        let stop = self.stop.clone();
        tokio::spawn(async move {
            let mut first = Some(first_tx);
            let stream = watcher(api, config).default_backoff().applied_objects();
            futures::pin_mut!(stream);
            loop {
                let next = tokio::select! {
                    next = stream.next() => next,
                    () = stop.cancelled() => return,
                };
                let Some(Ok(cluster)) = next else {
                    if next.is_none() {
                        return;
                    }
                    continue;
                };
                let mut state: BTreeMap<String, String> = cluster
                    .metadata
                    .annotations
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|(k, v)| {
                        k.strip_prefix("upgrade.vitistack.io/")
                            .map(|k| (k.to_string(), v))
                    })
                    .collect();
                // The phase goes along, under a key no annotation can have.
                if let Some(phase) = cluster.status.and_then(|s| s.phase) {
                    state.insert(PHASE_KEY.to_string(), phase);
                }
                {
                    let mut states = states.lock().unwrap_or_else(|p| p.into_inner());
                    if states.last() != Some(&state) {
                        states.push(state);
                    }
                }
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(60), first_rx)
            .await
            .expect("the annotation watch delivered nothing within 60s")
            .expect("the annotation watch ended");
        log
    }

    /// Reconciles finished so far, by every controller instance of this world (the `_count` of
    /// `talos_upgrade_reconcile_duration_seconds`).
    pub fn reconciles(&self) -> u64 {
        let text = self.metrics.encode();
        text.lines()
            .find_map(|line| {
                line.strip_prefix("talos_upgrade_reconcile_duration_seconds_count ")
                    .and_then(|value| value.trim().parse::<f64>().ok())
            })
            .map_or(0, |count| count as u64)
    }

    /// Waits until at least `more` reconciles finished after this call, so a test can say "the
    /// controller looked again (n times) and did nothing" without sleeping. Panics after `timeout`.
    pub async fn wait_for_reconciles(&self, more: u64, timeout: Duration) {
        let target = self.reconciles() + more;
        self.poll(timeout, &format!("{more} more reconciles"), || async {
            self.reconciles() >= target
        })
        .await;
    }

    /// Polls `check` every 50 ms until it is true; panics after `timeout` naming `what`, with the
    /// cluster's annotations and the simulator's call record.
    pub async fn poll<F, Fut>(&self, timeout: Duration, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if check().await {
                return;
            }
            if Instant::now() > deadline {
                let annotations = self.jsonpath("{.metadata.annotations}").await;
                panic!(
                    "timed out after {timeout:?} waiting for {what}\nannotations: {annotations}\nrecord: {}",
                    self.sim.record_json()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls the annotation until `check` accepts its value (absent reads as ""); returns the value.
    pub async fn wait_for_annotation_matching(
        &self,
        key: &str,
        timeout: Duration,
        what: &str,
        check: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.annotation(key).await;
            if check(&value) {
                return value;
            }
            if Instant::now() > deadline {
                let annotations = self.jsonpath("{.metadata.annotations}").await;
                panic!(
                    "timed out after {timeout:?} waiting for {key} to be {what} (last: {value:?})\nannotations: {annotations}\nrecord: {}",
                    self.sim.record_json()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `kubectl annotate --overwrite kubernetescluster my-cluster upgrade.vitistack.io/<key>=<value>`.
    pub async fn annotate(&self, key: &str, value: &str) {
        self.ns
            .kubectl_ok(&[
                "annotate",
                "--overwrite",
                "kubernetescluster",
                &self.cluster,
                &format!("upgrade.vitistack.io/{key}={value}"),
            ])
            .await;
    }

    /// `kubectl annotate kubernetescluster my-cluster upgrade.vitistack.io/<key>-`.
    pub async fn remove_annotation(&self, key: &str) {
        self.ns
            .kubectl_ok(&[
                "annotate",
                "kubernetescluster",
                &self.cluster,
                &format!("upgrade.vitistack.io/{key}-"),
            ])
            .await;
    }

    /// `kubectl annotate --overwrite kubernetescluster my-cluster <key=value | key->` for any key (not only
    /// the controller's own prefix).
    /// Sets two annotations in one `kubectl annotate`, so the controller sees both at once.
    pub async fn annotate_raw_pair(&self, first: &str, second: &str) {
        self.ns
            .kubectl_ok(&[
                "annotate",
                "--overwrite",
                "kubernetescluster",
                &self.cluster,
                first,
                second,
            ])
            .await;
    }

    pub async fn annotate_raw(&self, change: &str) {
        self.ns
            .kubectl_ok(&[
                "annotate",
                "--overwrite",
                "kubernetescluster",
                &self.cluster,
                change,
            ])
            .await;
    }

    /// Makes the controller look at the cluster again (an unrelated annotation changes) and waits until
    /// it has, so a test can then assert that it did nothing new.
    pub async fn poke_and_wait(&self, round: u32) {
        let before = self.reconciles();
        self.annotate_raw(&format!("example.com/poke={round}"))
            .await;
        self.poll(
            Duration::from_secs(120),
            "the controller to reconcile",
            || async { self.reconciles() > before },
        )
        .await;
    }

    /// The Events whose involved object is the cluster, with their counts (a series folded into one
    /// number).
    /// Polls (up to two minutes) until an Event with `reason`, and `message` when given, exists:
    /// Events are published after the annotations are written.
    pub async fn wait_for_event(&self, reason: &str, message: Option<&str>) -> ClusterEvent {
        const PATIENCE: Duration = Duration::from_secs(120);
        let deadline = Instant::now() + PATIENCE;
        loop {
            let all = self.cluster_events().await;
            if let Some(found) = all
                .iter()
                .find(|e| e.reason == reason && message.is_none_or(|m| e.message == m))
            {
                return found.clone();
            }
            let saying = message
                .map(|m| format!(" saying {m:?}"))
                .unwrap_or_default();
            assert!(
                Instant::now() < deadline,
                "no {reason} event{saying} within {PATIENCE:?}: {all:#?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn cluster_events(&self) -> Vec<ClusterEvent> {
        let text = self.ns.kubectl_ok(&["get", "events", "-o", "json"]).await;
        let list: serde_json::Value = serde_json::from_str(&text).expect("events JSON");
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| {
                e["involvedObject"]["kind"] == "KubernetesCluster"
                    && e["involvedObject"]["name"] == self.cluster.as_str()
            })
            .map(|e| ClusterEvent {
                type_: e["type"].as_str().unwrap_or_default().to_string(),
                reason: e["reason"].as_str().unwrap_or_default().to_string(),
                message: e["message"].as_str().unwrap_or_default().to_string(),
                count: e["series"]["count"]
                    .as_u64()
                    .or_else(|| e["count"].as_u64())
                    .unwrap_or(1)
                    .max(1),
            })
            .collect()
    }

    /// How many times an Event with `reason` was reported on the cluster (series folded in).
    pub async fn event_count(&self, reason: &str) -> u64 {
        self.cluster_events()
            .await
            .iter()
            .filter(|e| e.reason == reason)
            .map(|e| e.count)
            .sum()
    }

    /// The messages of the cluster's Events with `reason`.
    pub async fn event_messages(&self, reason: &str) -> Vec<String> {
        self.cluster_events()
            .await
            .into_iter()
            .filter(|e| e.reason == reason)
            .map(|e| e.message)
            .collect()
    }

    /// Reasons of the Events on the cluster, oldest first, with their messages: `(reason, message)`.
    pub async fn events(&self) -> Vec<(String, String)> {
        let text = self
            .ns
            .kubectl_ok(&[
                "get",
                "events",
                "--sort-by=.metadata.creationTimestamp",
                "-o",
                "jsonpath={range .items[*]}{.reason}{\"\\t\"}{.message}{\"\\n\"}{end}",
            ])
            .await;
        text.lines()
            .filter_map(|line| line.split_once('\t'))
            .map(|(reason, message)| (reason.to_string(), message.to_string()))
            .collect()
    }

    /// `reportingInstance` of every Event a controller published on the cluster (only those with
    /// `reason`, if given): which controller process said what.
    pub async fn reporting_instances(&self, reason: Option<&str>) -> Vec<String> {
        let mut selector = format!("regarding.name={}", self.cluster);
        if let Some(reason) = reason {
            selector.push_str(&format!(",reason={reason}"));
        }
        self.ns
            .kubectl_ok(&[
                "get",
                "events.events.k8s.io",
                "--field-selector",
                &selector,
                "-o",
                "jsonpath={range .items[*]}{.reportingInstance}{\"\\n\"}{end}",
            ])
            .await
            .lines()
            .filter(|line| !line.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn node(&self, short: &str) -> String {
        format!("{}-{short}", self.ns.name)
    }

    /// `kubectl get kubernetescluster my-cluster -o jsonpath=...`
    pub async fn jsonpath(&self, path: &str) -> String {
        self.ns
            .kubectl_ok(&[
                "get",
                "kubernetescluster",
                &self.cluster,
                "-o",
                &format!("jsonpath={path}"),
            ])
            .await
    }

    pub async fn annotation(&self, key: &str) -> String {
        self.jsonpath(&format!(
            "{{.metadata.annotations.upgrade\\.vitistack\\.io/{key}}}"
        ))
        .await
    }

    /// The user guide's Talos upgrade: once the controller reports `current`, annotate `target` and
    /// `kubectl wait` for `talos-status=completed` (3 minutes at most).
    pub async fn upgrade_talos(&self, current: &str, target: &str) {
        self.wait_for_annotation("talos-current", current, "60s")
            .await;
        self.annotate("talos-target", target).await;
        self.wait_for_annotation("talos-status", "completed", "180s")
            .await;
    }

    /// The persisted Talos run (`talos.json` of the progress ConfigMap).
    pub async fn persisted_talos_run(&self) -> serde_json::Value {
        self.persisted_run("talos").await
    }

    /// The persisted run of `kind` (`talos` or `kubernetes`): `<kind>.json` of the progress
    /// ConfigMap.
    pub async fn persisted_run(&self, kind: &str) -> serde_json::Value {
        let text = self
            .ns
            .kubectl_ok(&[
                "get",
                "configmap",
                &format!("talos-upgrade-{}", self.cluster),
                "-o",
                &format!("jsonpath={{.data.{kind}\\.json}}"),
            ])
            .await;
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{kind}.json {text:?}: {e}"))
    }

    /// `kubectl wait` for an annotation value, as the user guide does.
    pub async fn wait_for_annotation(&self, key: &str, value: &str, timeout: &str) {
        let output = self
            .ns
            .kubectl(&[
                "wait",
                &format!("kubernetescluster/{}", self.cluster),
                &format!("--for=jsonpath={{.metadata.annotations.upgrade\\.vitistack\\.io/{key}}}={value}"),
                &format!("--timeout={timeout}"),
            ])
            .await;
        if !output.success {
            let annotations = self.jsonpath("{.metadata.annotations}").await;
            panic!(
                "kubectl wait for {key}={value} failed: {}\nannotations: {annotations}\nrecord: {}",
                output.stderr,
                self.sim.record_json()
            );
        }
    }

    /// Asserts that `total` nodes received an upgrade call and none more than one; returns the calls
    /// in order.
    pub fn assert_each_node_upgraded_once(&self, total: usize) -> Vec<String> {
        let calls = self.upgrade_calls();
        let mut per_node: std::collections::BTreeMap<&str, usize> = Default::default();
        for node in &calls {
            *per_node.entry(node.as_str()).or_default() += 1;
        }
        assert_eq!(per_node.len(), total, "every node upgraded: {calls:?}");
        assert!(
            per_node.values().all(|&n| n == 1),
            "each node upgraded exactly once: {calls:?}\nrecord: {}",
            self.sim.record_json()
        );
        calls
    }

    /// The running machine config of node `short` (`cp-1`, `worker-2`), read through its Talos API the
    /// way talosctl reads it (`MachineConfigs.config.talos.dev`).
    pub async fn machine_config(&self, short: &str) -> String {
        use talos_api::{TalosClient, Talosconfig, Target};
        let name = self.node(short);
        let address = self
            .sim
            .nodes()
            .into_iter()
            .find(|node| node.name == name)
            .map(|node| std::net::IpAddr::V4(node.address))
            .expect("the node in the simulator");
        let credentials = Talosconfig::from_yaml(&self.sim.talosconfig(ClientRole::Admin))
            .and_then(|config| config.current_context()?.credentials())
            .expect("the simulator's talosconfig");
        let client = TalosClient::connect(
            &credentials,
            Target::Node(address),
            &ConnectOptions {
                port: self.sim.config().port,
                ..ConnectOptions::default()
            },
        )
        .await
        .expect("connecting to the node");
        let config = client.machine_config().await.expect("the machine config");
        String::from_utf8(config.as_bytes().to_vec()).expect("UTF-8")
    }

    /// Upgrade calls received, per node, in order.
    pub fn upgrade_calls(&self) -> Vec<String> {
        self.sim
            .record()
            .into_iter()
            .filter(|c| {
                matches!(
                    c.method.as_str(),
                    "/machine.MachineService/Upgrade" | "/machine.LifecycleService/Upgrade"
                )
            })
            .map(|c| c.node)
            .collect()
    }
}

/// A small seeded random number generator (xorshift64*), so a chaos run can be replayed from its seed.
pub struct ChaosRng(u64);

impl ChaosRng {
    /// From `TUC_CHAOS_SEED` if set, else `default`; prints the seed so a failure can be replayed.
    pub fn from_env(default: u64) -> ChaosRng {
        let seed = std::env::var("TUC_CHAOS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default);
        println!("chaos seed: {seed} (replay with TUC_CHAOS_SEED={seed})");
        ChaosRng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `range`.
    pub fn between(&mut self, range: std::ops::Range<u64>) -> u64 {
        range.start + self.next() % (range.end - range.start).max(1)
    }

    /// True one time in `n`.
    pub fn one_in(&mut self, n: u64) -> bool {
        self.next().is_multiple_of(n.max(1))
    }
}

impl World {
    /// What must hold after any Talos upgrade run to `target`, however chaotic: every node rebooted into
    /// the target exactly once, never two control planes down at once, no node left cordoned, and the
    /// cluster says completed with the right versions, progress, phase and condition.
    pub async fn assert_talos_run_kept_its_promises(&self, target: &str) {
        self.assert_talos_run_kept_its_promises_rebooting_twice(target, &[])
            .await;
    }

    /// [`World::assert_talos_run_kept_its_promises`], where the nodes in `twice` went down twice: each
    /// had a reboot whose install got no answer, came back on its old version, and was installed and
    /// rebooted again on `resume` (see `tests/e2e/chaos.rs`).
    pub async fn assert_talos_run_kept_its_promises_rebooting_twice(
        &self,
        target: &str,
        twice: &[String],
    ) {
        use talos_sim::{PowerKind, Role, max_concurrently_down};
        let power = self.sim.power_events();
        for node in self.sim.nodes() {
            let downs = power
                .iter()
                .filter(|e| e.node == node.name && e.kind == PowerKind::Down)
                .count();
            let expected = if twice.contains(&node.name) { 2 } else { 1 };
            assert_eq!(
                downs, expected,
                "{} went down {downs} times: {power:?}",
                node.name
            );
            let snapshot = self.sim.node_snapshot(&node.name).expect("node");
            assert_eq!(snapshot.talos_version, target, "{}", node.name);
        }
        assert_eq!(
            max_concurrently_down(&power, Some(Role::ControlPlane)),
            1,
            "never two control planes down at once: {power:?}"
        );
        self.poll(Duration::from_secs(30), "no node left cordoned", || async {
            let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.ns.client.clone());
            let mut cordoned = false;
            for node in self.sim.nodes() {
                let object = nodes.get(&node.name).await.expect("node");
                cordoned |= object.spec.and_then(|s| s.unschedulable).unwrap_or(false);
            }
            !cordoned
        })
        .await;
        assert_eq!(self.annotation("talos-status").await, "completed");
        assert_eq!(self.annotation("talos-current").await, target);
        let total = self.sim.nodes().len();
        assert_eq!(
            self.annotation("talos-progress").await,
            format!("{total}/{total}")
        );
        assert_eq!(
            self.annotation("talos-message").await,
            format!("Talos upgrade completed: now running {target}")
        );
        assert_eq!(self.annotation("failed-nodes").await, "");
        assert_eq!(self.jsonpath("{.status.phase}").await, "Ready");
        assert_eq!(
            self.jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
                .await,
            "Completed"
        );
    }
}
