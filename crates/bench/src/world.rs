//! One benchmark world: a fresh API server, N simulated Talos clusters registered in it (built as the
//! tests build theirs, by the `test-world` crate), and the controller binary as a separate process
//! talking to the API server through the counting proxy.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use talos_sim::workload::WorkloadMirror;
use talos_sim::{MachineStage, Simulator, Timings};
use talos_upgrade_core::crd::KubernetesCluster;
use test_world::{ClusterShape, Registration, SpecData};
use testenv::ControlPlane;
use tokio_util::sync::CancellationToken;

use crate::proxy::Proxy;

pub const NAMESPACE: &str = "bench";
pub const TALOS_FROM: &str = "1.11.6";
pub const TALOS_TO: &str = "1.12.0";
pub const KUBERNETES: &str = "1.34.1";

/// What vitistack records about the benchmark's clusters besides their id.
const SPEC_DATA: SpecData = SpecData {
    cluster_uid: "00000000-0000-4000-8000-000000000000",
    environment: "bench",
    datacenter: "bench-az1",
    region: "bench",
    zone: "az1",
    project: "bench",
    workspace: "bench",
    workorder: "bench",
};

/// A node's state change as the benchmark saw it (timestamped on receipt from the simulator's watch
/// channel, in the same process as the simulator).
#[derive(Debug, Clone)]
pub struct NodeState {
    pub at: SystemTime,
    pub version: String,
    pub ready_running_up: bool,
}

/// A state of a node the simulated kubelet finished writing into the API server (timestamped when
/// its last write was answered).
#[derive(Debug, Clone)]
pub struct NodeWritten {
    pub at: SystemTime,
    pub version: String,
    /// The Node is Ready and Talos's cordon is lifted: what the controller waits for.
    pub ready_uncordoned: bool,
}

/// One simulated cluster.
pub struct SimCluster {
    pub name: String,
    pub sim: Simulator,
    /// Node name → its state changes, oldest first.
    pub states: Arc<Mutex<BTreeMap<String, Vec<NodeState>>>>,
    /// Node name → the states its workload mirror wrote, oldest first.
    pub written: Arc<Mutex<BTreeMap<String, Vec<NodeWritten>>>>,
}

/// Per cluster: when it was annotated and when the watch saw it `in-progress` and `completed`.
#[derive(Debug, Clone, Default)]
pub struct ClusterTimes {
    pub annotated: Option<SystemTime>,
    /// When the API server answered the benchmark's annotation patch (`kubectl annotate` returning).
    pub annotation_answered: Option<SystemTime>,
    pub in_progress: Option<SystemTime>,
    pub completed: Option<SystemTime>,
    pub failed: Option<String>,
    pub talos_current: Option<String>,
}

pub struct World {
    /// Kept for its lifetime: dropping it stops etcd and kube-apiserver.
    control_plane: ControlPlane,
    pub admin: kube::Client,
    pub proxy: Proxy,
    pub clusters: Vec<SimCluster>,
    pub times: Arc<Mutex<BTreeMap<String, ClusterTimes>>>,
    /// Every cluster's: 3 control planes and 2 workers on [`TALOS_FROM`] and [`KUBERNETES`] (or the
    /// versions given to [`World::start_on`]).
    shape: ClusterShape,
    /// Stops the workload mirrors.
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The API server's CA, base64, for the controller's kubeconfigs (the proxy serves its certificate).
    pub ca_base64: String,
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.cancel();
        for task in &self.tasks {
            task.abort();
        }
        for cluster in &self.clusters {
            cluster.sim.shutdown();
        }
    }
}

pub fn cluster_name(i: usize) -> String {
    format!("c{i:03}")
}

/// A kubeconfig for `server` (the proxy), trusting `ca` (base64 PEM: the API server's CA, which signed
/// the certificate the proxy serves).
fn kubeconfig(server: &str, ca: &str) -> String {
    let ca = format!("    certificate-authority-data: {ca}\n");
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: bench\n  cluster:\n{ca}    server: {server}\nusers:\n- name: bench\n  user: {{}}\ncontexts:\n- name: bench\n  context:\n    cluster: bench\n    user: bench\n    namespace: default\ncurrent-context: bench\n"
    )
}

/// The patch every measured run annotates its clusters with: `talos-target` set to [`TALOS_TO`].
pub fn target_patch() -> Patch<serde_json::Value> {
    Patch::Merge(serde_json::json!({
        "metadata": {"annotations": {talos_upgrade_core::annotations::TALOS_TARGET: TALOS_TO}}
    }))
}

impl World {
    /// What the API server has counted so far of its own trouble, read from its `/metrics` with the
    /// admin's client (see [`ApiServerCounts`]).
    pub async fn apiserver_counts(&self) -> anyhow::Result<ApiServerCounts> {
        let request = http::Request::get("/metrics").body(Vec::new())?;
        let text = self
            .admin
            .request_text(request)
            .await
            .context("reading the API server's /metrics")?;
        Ok(ApiServerCounts::of(&text))
    }

    /// CPU seconds used so far by the API server, etcd and this process.
    pub fn cpu(&self) -> anyhow::Result<WorldCpu> {
        let ids = self.control_plane.process_ids();
        Ok(WorldCpu {
            kube_apiserver: cpu_seconds(ids.kube_apiserver)?,
            etcd: cpu_seconds(ids.etcd)?,
            benchmark: cpu_seconds(std::process::id())?,
        })
    }

    pub async fn start(
        n: usize,
        timings: Timings,
        request_log: Option<&Path>,
    ) -> anyhow::Result<World> {
        World::start_on(n, timings, request_log, TALOS_FROM, KUBERNETES).await
    }

    /// [`World::start`] with the nodes on another Talos and Kubernetes version.
    pub async fn start_on(
        n: usize,
        timings: Timings,
        request_log: Option<&Path>,
        talos: &str,
        kubernetes: &str,
    ) -> anyhow::Result<World> {
        let control_plane = ControlPlane::start()
            .await
            .context("starting etcd and kube-apiserver")?;
        let admin = control_plane.client().await?;
        test_world::install_crd(&admin, test_world::PROJECT_CLUSTER_CRD).await?;
        test_world::install_crd(&admin, test_world::MACHINE_CRD).await?;
        let namespace: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}}))?;
        Api::<Namespace>::all(admin.clone())
            .create(&PostParams::default(), &namespace)
            .await?;
        let admin_config = talos_upgrade_controller::api_client::config_from_file(
            control_plane.admin_kubeconfig(),
        )
        .await?;
        let proxy = Proxy::start(
            admin_config,
            &control_plane.dir().join("apiserver.crt"),
            &control_plane.dir().join("apiserver.key"),
            request_log,
        )
        .await?;

        let shape = ClusterShape {
            control_planes: 3,
            workers: 2,
            talos: talos.to_string(),
            kubernetes: kubernetes.to_string(),
            timings,
            image_registry: None,
            installer_repository: None,
            unattended_install: false,
        };
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let mut clusters = Vec::new();
        // Simulators one at a time (each binds 5 addresses and mints its certificates), the API objects
        // of several clusters at once.
        for i in 1..=n {
            let name = cluster_name(i);
            let sim = Simulator::start(shape.sim_config(&name))
                .await
                .with_context(|| format!("starting the simulator of {name}"))?;
            let states = Arc::new(Mutex::new(BTreeMap::new()));
            let written = Arc::new(Mutex::new(BTreeMap::new()));
            // Nodes and static pods only, labelled with their cluster, each written state timestamped;
            // no kubelet for ordinary pods: the benchmark schedules none, and a pod watch per cluster
            // would add to the load of the API server it measures.
            let mirror = WorkloadMirror::new(admin.clone()).with_labels(BTreeMap::from([(
                crate::proxy::CLUSTER_LABEL.to_string(),
                name.clone(),
            )]));
            let node_written = written.clone();
            tasks.extend(test_world::mirror_nodes(
                &sim,
                &mirror,
                &stop,
                move |node| {
                    node_written
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry(node.name.clone())
                        .or_insert_with(Vec::new)
                        .push(NodeWritten {
                            at: SystemTime::now(),
                            version: node.talos_version.clone(),
                            ready_uncordoned: node.ready && !node.talos_cordoned,
                        });
                },
            )?);
            for node in sim.nodes() {
                let mut rx = sim.subscribe(&node.name)?;
                let states = states.clone();
                tasks.push(tokio::spawn(async move {
                    loop {
                        {
                            let s = rx.borrow_and_update();
                            let state = NodeState {
                                at: SystemTime::now(),
                                version: s.talos_version.clone(),
                                ready_running_up: s.ready
                                    && !s.down
                                    && s.stage == MachineStage::Running,
                            };
                            states
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .entry(s.name.clone())
                                .or_insert_with(Vec::new)
                                .push(state);
                        }
                        if rx.changed().await.is_err() {
                            return;
                        }
                    }
                }));
            }
            clusters.push(SimCluster {
                name,
                sim,
                states,
                written,
            });
        }

        let ca_base64 = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(control_plane.ca_pem())
        };
        let world = World {
            ca_base64,
            control_plane,
            admin,
            proxy,
            clusters,
            times: Arc::new(Mutex::new(BTreeMap::new())),
            shape,
            stop,
            tasks,
        };
        futures::stream::iter(world.clusters.iter())
            .map(|c| world.register(c))
            .buffer_unordered(8)
            .try_collect::<Vec<()>>()
            .await?;
        world.wait_nodes_ready(5 * n).await?;
        Ok(world)
    }

    /// Machines, the credentials Secret and the KubernetesCluster of one simulated cluster. The
    /// Secret's workload kubeconfig points at the proxy, which counts the controller's requests to the
    /// workload cluster apart from those to the management cluster.
    async fn register(&self, cluster: &SimCluster) -> anyhow::Result<()> {
        let name = &cluster.name;
        let registration = Registration {
            namespace: NAMESPACE,
            name,
            cluster_id: &format!("{name}-id"),
            data: &SPEC_DATA,
            kubeconfig: &kubeconfig(&self.proxy.workload_url(name), &self.ca_base64),
        };
        test_world::register_cluster(&self.admin, &cluster.sim, &self.shape, &registration).await
    }

    /// Waits until the workload mirror has registered every simulated node as a Ready Node.
    async fn wait_nodes_ready(&self, count: usize) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(self.admin.clone());
        let deadline = Instant::now() + Duration::from_secs(120 + count as u64 / 5);
        loop {
            let ready = nodes
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .filter(|n| testenv::node_ready(n))
                .count();
            if ready >= count {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("only {ready} of {count} Nodes became Ready");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Watches every KubernetesCluster (with the admin client, not through the proxy) and timestamps
    /// the first `in-progress` and `completed` after each cluster was annotated.
    pub async fn watch_clusters(&mut self) -> anyhow::Result<()> {
        use kube::runtime::{WatchStreamExt, watcher};
        let api: Api<KubernetesCluster> = Api::namespaced(self.admin.clone(), NAMESPACE);
        let times = self.times.clone();
        let (first_tx, first_rx) = tokio::sync::oneshot::channel();
        self.tasks.push(tokio::spawn(async move {
            let mut first = Some(first_tx);
            let stream = watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects();
            futures::pin_mut!(stream);
            while let Some(next) = stream.next().await {
                let Ok(cluster) = next else { continue };
                let now = SystemTime::now();
                let name = cluster.metadata.name.clone().unwrap_or_default();
                let annotations = cluster.metadata.annotations.clone().unwrap_or_default();
                let status = annotations
                    .get(talos_upgrade_core::annotations::TALOS_STATUS)
                    .cloned()
                    .unwrap_or_default();
                {
                    let mut times = times.lock().unwrap_or_else(|p| p.into_inner());
                    let entry = times.entry(name).or_default();
                    entry.talos_current = annotations
                        .get(talos_upgrade_core::annotations::TALOS_CURRENT)
                        .cloned();
                    if entry.annotated.is_some() {
                        match status.as_str() {
                            "in-progress" if entry.in_progress.is_none() => {
                                entry.in_progress = Some(now)
                            }
                            "completed" if entry.completed.is_none() => entry.completed = Some(now),
                            "failed" if entry.failed.is_none() => {
                                entry.failed = Some(
                                    annotations
                                        .get(talos_upgrade_core::annotations::TALOS_MESSAGE)
                                        .cloned()
                                        .unwrap_or_default(),
                                )
                            }
                            _ => {}
                        }
                    }
                }
                if let Some(tx) = first.take() {
                    let _ = tx.send(());
                }
            }
        }));
        tokio::time::timeout(Duration::from_secs(60), first_rx)
            .await
            .context("the KubernetesCluster watch delivered nothing within 60s")??;
        Ok(())
    }

    /// Waits until `check` holds for the cluster times (polled every 100 ms), or fails after `timeout`.
    pub async fn wait_times(
        &self,
        timeout: Duration,
        what: &str,
        check: impl Fn(&BTreeMap<String, ClusterTimes>) -> Result<bool, String>,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let result = {
                let times = self.times.lock().unwrap_or_else(|p| p.into_inner());
                check(&times)
            };
            match result {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(error) => bail!("{what}: {error}"),
            }
            if Instant::now() > deadline {
                bail!("timed out after {timeout:?} waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The calls every simulator recorded as arriving in `[from, to)`, by the name the controller's
    /// metric gives their method. The simulators record only mutating calls (`Upgrade`, `Reboot`,
    /// `EtcdSnapshot`, ...), each when it arrives; the controller counts a call when it ends, and
    /// counts calls that never reached a node (a node rebooting), so the two can differ by the calls
    /// in flight at either end of the window and by those.
    pub fn simulator_calls(&self, from: SystemTime, to: SystemTime) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for cluster in &self.clusters {
            for call in cluster.sim.record() {
                if call.time >= from && call.time < to {
                    *out.entry(crate::counts::metric_method_name(&call.method))
                        .or_insert(0.0) += 1.0;
                }
            }
        }
        out
    }

    /// Annotates every cluster with `talos-target` at once (64 patches in flight), recording the time
    /// just before each patch and when its answer came.
    pub async fn annotate_all(&self) -> anyhow::Result<()> {
        let api: Api<KubernetesCluster> = Api::namespaced(self.admin.clone(), NAMESPACE);
        let patch = target_patch();
        futures::stream::iter(self.clusters.iter())
            .map(|c| {
                let api = api.clone();
                let patch = &patch;
                async move {
                    let note_now = |field: fn(&mut ClusterTimes) -> &mut Option<SystemTime>| {
                        let mut times = self.times.lock().unwrap_or_else(|p| p.into_inner());
                        *field(times.entry(c.name.clone()).or_default()) = Some(SystemTime::now());
                    };
                    note_now(|t| &mut t.annotated);
                    api.patch(&c.name, &PatchParams::default(), patch).await?;
                    note_now(|t| &mut t.annotation_answered);
                    anyhow::Ok(())
                }
            })
            .buffer_unordered(64)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }
}

/// The controller binary, running as its own process against the proxy.
pub struct ControllerProcess {
    pub child: tokio::process::Child,
    pub pid: u32,
    pub metrics_url: String,
    pub log: PathBuf,
}

impl ControllerProcess {
    pub async fn start(
        binary: &Path,
        dir: &Path,
        management_url: &str,
        ca_base64: &str,
        extra_args: &[String],
    ) -> anyhow::Result<ControllerProcess> {
        let kubeconfig_path = dir.join("controller.kubeconfig");
        std::fs::write(&kubeconfig_path, kubeconfig(management_url, ca_base64))?;
        // A free port for /metrics: bind, read, release.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let log = dir.join("controller.log");
        let log_file = std::fs::File::create(&log)?;
        let mut command = tokio::process::Command::new(binary);
        command
            .arg("run")
            .arg("--admin-listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(extra_args)
            .env("KUBECONFIG", &kubeconfig_path)
            // As the image runs it (its allocator setting).
            .envs(talos_upgrade_controller::IMAGE_ENV.iter().copied())
            .env_remove("TUC_NAMESPACE")
            .env_remove("TUC_POLL_INTERVAL")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let pid = child.id().context("the controller exited at once")?;
        Ok(ControllerProcess {
            child,
            pid,
            metrics_url: format!("http://127.0.0.1:{port}/metrics"),
            log,
        })
    }

    /// The controller's `/metrics` text.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        http_get(&self.metrics_url).await
    }

    /// Sum of every sample of a counter family in the controller's metrics.
    pub async fn counter_sum(&self, family: &str) -> anyhow::Result<f64> {
        let text = self.metrics().await?;
        Ok(crate::counts::sum(
            crate::counts::samples(&text, family)
                .into_iter()
                .map(|(_, value)| value),
        ))
    }

    /// The controller's Talos calls so far by method and code, from one scrape of its metrics.
    pub async fn talos_calls(&self) -> anyhow::Result<crate::counts::TalosCalls> {
        Ok(crate::counts::TalosCalls::from_metrics(
            &self.metrics().await?,
        ))
    }

    /// (peak RSS in bytes, CPU seconds user+system) from /proc.
    pub fn usage(&self) -> anyhow::Result<(u64, f64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        let hwm_kb = status_kb(&status, "VmHWM").context("VmHWM in /proc/<pid>/status")?;
        Ok((hwm_kb * 1024, cpu_seconds(self.pid)?))
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// The API server's metric family counting the watches it closed because their reader fell behind
/// (the watch cache's `cacheWatcher` gives up on a watcher whose buffer stays full).
const TERMINATED_WATCHERS: &str = "apiserver_terminated_watchers_total";

/// The API server's metric family counting the consistent lists (no `resourceVersion`) its watch
/// cache was asked for; `fallback="true"` marks those it could not serve because the cache did not
/// catch up with etcd within 3 s, so etcd was read instead (k8s.io/apiserver v0.34
/// `pkg/storage/cacher/delegator.go`, `GetList`).
const CONSISTENT_READS: &str = "apiserver_watch_cache_consistent_read_total";

/// The API server's own counters the benchmark reads before and after the upgrade, by resource.
#[derive(Debug)]
pub struct ApiServerCounts {
    /// Watches closed as unresponsive ([`TERMINATED_WATCHERS`]).
    pub closed_watches: BTreeMap<String, f64>,
    /// Consistent lists read from etcd because the watch cache was behind ([`CONSISTENT_READS`]).
    pub lists_from_etcd: BTreeMap<String, f64>,
}

impl ApiServerCounts {
    pub fn of(metrics: &str) -> ApiServerCounts {
        ApiServerCounts {
            closed_watches: by_resource(metrics, TERMINATED_WATCHERS, |_| true),
            lists_from_etcd: by_resource(metrics, CONSISTENT_READS, |labels| {
                labels.get("fallback").map(String::as_str) == Some("true")
            }),
        }
    }

    /// What was counted since `earlier`.
    pub fn since(&self, earlier: &ApiServerCounts) -> ApiServerCounts {
        ApiServerCounts {
            closed_watches: crate::counts::minus(&self.closed_watches, &earlier.closed_watches),
            lists_from_etcd: crate::counts::minus(&self.lists_from_etcd, &earlier.lists_from_etcd),
        }
    }
}

/// The samples of `family` whose labels `keep` accepts, summed by their `resource` label.
fn by_resource(
    text: &str,
    family: &str,
    keep: impl Fn(&BTreeMap<String, String>) -> bool,
) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (labels, value) in crate::counts::samples(text, family) {
        if !keep(&labels) {
            continue;
        }
        let resource = labels.get("resource").cloned().unwrap_or_default();
        *out.entry(resource).or_default() += value;
    }
    out
}

/// A plain HTTP/1.1 GET on loopback (the controller's metrics endpoint), with a timeout.
async fn http_get(url: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.strip_prefix("http://").context("http:// URL")?;
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let fetch = async {
        let mut stream = tokio::net::TcpStream::connect(host).await?;
        stream
            .write_all(
                format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(String::from_utf8_lossy(&response).into_owned())
    };
    let response = tokio::time::timeout(Duration::from_secs(10), fetch)
        .await
        .context("GET /metrics timed out")??;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {url}: {}", head.lines().next().unwrap_or_default());
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Ok(dechunk(body));
    }
    Ok(body.to_string())
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || after.len() < size {
            break;
        }
        out.push_str(&after[..size]);
        rest = after[size..].trim_start_matches("\r\n");
    }
    out
}

/// A process's resident memory at one moment (`/proc/<pid>/status`), in KiB: the whole (`VmRSS`)
/// and its two parts, anonymous (`RssAnon`: the heap, the stacks) and file-backed (`RssFile`: the
/// pages of the binary's code and read-only data that the kernel mapped in). `VmHWM` gives the
/// highest whole only; the parts say how much of it the program's data is and how much its code.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resident {
    pub total_kb: u64,
    pub anon_kb: u64,
    pub file_kb: u64,
}

impl Resident {
    /// Reads the three from the text of `/proc/<pid>/status`; `None` if one is missing (the
    /// process has exited).
    pub fn from_status(status: &str) -> Option<Resident> {
        Some(Resident {
            total_kb: status_kb(status, "VmRSS")?,
            anon_kb: status_kb(status, "RssAnon")?,
            file_kb: status_kb(status, "RssFile")?,
        })
    }
}

/// One `<name>:  <n> kB` line of the text of `/proc/<pid>/status`, in KiB.
fn status_kb(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
}

/// The controller's resident memory as sampled at its highest, every [`PeakResident::EVERY`] for as
/// long as this lives. The kernel keeps the highest whole (`VmHWM`) but not its parts, so they are
/// sampled; the sample can fall a little short of `VmHWM`, a peak between two samples.
pub struct PeakResident {
    highest: Arc<Mutex<Resident>>,
    task: tokio::task::JoinHandle<()>,
}

impl PeakResident {
    pub const EVERY: Duration = Duration::from_millis(250);

    pub fn follow(pid: u32) -> PeakResident {
        let highest = Arc::new(Mutex::new(Resident::default()));
        let kept = highest.clone();
        let task = tokio::spawn(async move {
            let mut every = tokio::time::interval(Self::EVERY);
            loop {
                every.tick().await;
                let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
                    return;
                };
                if let Some(now) = Resident::from_status(&status) {
                    let mut highest = kept.lock().unwrap_or_else(|e| e.into_inner());
                    if now.total_kb > highest.total_kb {
                        *highest = now;
                    }
                }
            }
        });
        PeakResident { highest, task }
    }

    /// The highest sample so far.
    pub fn highest(&self) -> Resident {
        *self.highest.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for PeakResident {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// CPU seconds (user + system) a process has used so far, from `/proc/<pid>/stat`.
pub fn cpu_seconds(pid: u32) -> anyhow::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may contain spaces) closed by the last ')'.
    let after = &stat[stat.rfind(')').context("/proc/<pid>/stat")? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the name and state.
    let utime: f64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    let stime: f64 = fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
    Ok((utime + stime) / clock_ticks_per_second())
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`, 100 on Linux unless configured otherwise),
/// the unit of `/proc/<pid>/stat`'s CPU times. Asked once.
fn clock_ticks_per_second() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|output| String::from_utf8(output.stdout).ok())
            .and_then(|text| text.trim().parse::<f64>().ok())
            .filter(|ticks| *ticks > 0.0)
            .unwrap_or(100.0)
    })
}

/// CPU seconds used so far by everything on the machine that is not the controller.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct WorldCpu {
    pub kube_apiserver: f64,
    pub etcd: f64,
    /// This process: the simulated Talos nodes, their workload mirror, the counting proxy and the
    /// benchmark's own watches.
    pub benchmark: f64,
}

impl WorldCpu {
    pub fn minus(self, before: WorldCpu) -> WorldCpu {
        WorldCpu {
            kube_apiserver: self.kube_apiserver - before.kube_apiserver,
            etcd: self.etcd - before.etcd,
            benchmark: self.benchmark - before.benchmark,
        }
    }
}

/// Appends the simulators' and the benchmark's own events to the timeline the proxy wrote (see
/// `--timeline`): Talos calls received, nodes Ready, Nodes written Ready, and the clusters' annotation,
/// `in-progress` and `completed`. Lines are not sorted; `sort -n` orders them.
pub fn append_timeline(world: &World, path: &Path) -> anyhow::Result<()> {
    use std::io::Write;
    let millis = crate::proxy::unix_millis;
    let mut out = std::io::BufWriter::new(std::fs::OpenOptions::new().append(true).open(path)?);
    for cluster in &world.clusters {
        let name = &cluster.name;
        for call in cluster.sim.record() {
            let at = millis(call.time);
            let end = at + call.elapsed.as_millis();
            writeln!(
                out,
                "{at} {end} talos {name} {} {} via {}",
                call.node, call.method, call.endpoint
            )?;
        }
        let states = cluster.states.lock().unwrap_or_else(|p| p.into_inner());
        for (node, changes) in states.iter() {
            let mut was_ready = false;
            for change in changes {
                if change.ready_running_up != was_ready {
                    let what = if change.ready_running_up {
                        "ready"
                    } else {
                        "not-ready"
                    };
                    let at = millis(change.at);
                    writeln!(
                        out,
                        "{at} {at} node {name} {node} {what} {}",
                        change.version
                    )?;
                }
                was_ready = change.ready_running_up;
            }
        }
        let written = cluster.written.lock().unwrap_or_else(|p| p.into_inner());
        for (node, writes) in written.iter() {
            for write in writes {
                let at = millis(write.at);
                let what = if write.ready_uncordoned {
                    "Ready"
                } else {
                    "NotReady-or-cordoned"
                };
                writeln!(
                    out,
                    "{at} {at} written {name} {node} {what} {}",
                    write.version
                )?;
            }
        }
    }
    let times = world.times.lock().unwrap_or_else(|p| p.into_inner());
    for (name, t) in times.iter() {
        for (what, at) in [
            ("annotated", t.annotated),
            ("annotation-answered", t.annotation_answered),
            ("in-progress", t.in_progress),
            ("completed", t.completed),
        ] {
            if let Some(at) = at {
                let at = millis(at);
                writeln!(out, "{at} {at} cluster {name} {what}")?;
            }
        }
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_resident_memory_and_its_parts() {
        // As Linux 6.x writes it (the lines around them left out).
        let status = "Name:\ttalos-upgrade-c\nVmHWM:\t  104356 kB\nVmRSS:\t  97412 kB\n\
                      RssAnon:\t   83624 kB\nRssFile:\t   13788 kB\nRssShmem:\t       0 kB\n";
        assert_eq!(
            Resident::from_status(status),
            Some(Resident {
                total_kb: 97412,
                anon_kb: 83624,
                file_kb: 13788,
            })
        );
        // A process that has exited has no memory lines.
        assert_eq!(Resident::from_status("Name:\tzombie\nState:\tZ\n"), None);
    }

    #[test]
    fn reads_the_closed_watches_by_resource_and_takes_the_window() {
        let before = by_resource(
            "# HELP apiserver_terminated_watchers_total [ALPHA] Counter of watchers closed due to unresponsiveness broken by resource type.\n\
             # TYPE apiserver_terminated_watchers_total counter\n\
             apiserver_terminated_watchers_total{group=\"\",resource=\"nodes\"} 10\n\
             apiserver_terminated_watchers_total{group=\"vitistack.io\",resource=\"kubernetesclusters\"} 1\n\
             apiserver_terminated_watchers_totally_other{resource=\"nodes\"} 99\n",
            TERMINATED_WATCHERS,
            |_| true,
        );
        assert_eq!(before["nodes"], 10.0);
        assert_eq!(before["kubernetesclusters"], 1.0);
        assert_eq!(before.len(), 2);
        let after = by_resource(
            "apiserver_terminated_watchers_total{group=\"\",resource=\"nodes\"} 3200\n\
             apiserver_terminated_watchers_total{group=\"vitistack.io\",resource=\"kubernetesclusters\"} 1\n\
             apiserver_terminated_watchers_total{group=\"\",resource=\"pods\"} 37\n",
            TERMINATED_WATCHERS,
            |_| true,
        );
        let window = crate::counts::minus(&after, &before);
        assert_eq!(window.get("nodes"), Some(&3190.0));
        assert_eq!(window.get("pods"), Some(&37.0));
        assert_eq!(
            window.get("kubernetesclusters"),
            None,
            "no change, left out"
        );
    }

    #[test]
    fn counts_only_the_consistent_lists_that_fell_back_to_etcd() {
        let metrics = "# TYPE apiserver_watch_cache_consistent_read_total counter\n\
             apiserver_watch_cache_consistent_read_total{fallback=\"false\",group=\"\",resource=\"nodes\",success=\"true\"} 40\n\
             apiserver_watch_cache_consistent_read_total{fallback=\"true\",group=\"\",resource=\"nodes\",success=\"true\"} 7\n\
             apiserver_watch_cache_consistent_read_total{fallback=\"true\",group=\"\",resource=\"nodes\",success=\"false\"} 2\n\
             apiserver_watch_cache_consistent_read_total{fallback=\"true\",group=\"\",resource=\"pods\",success=\"true\"} 1\n\
             apiserver_terminated_watchers_total{group=\"\",resource=\"nodes\"} 5\n";
        let before = ApiServerCounts::of(metrics);
        assert_eq!(
            before.lists_from_etcd.get("nodes"),
            Some(&9.0),
            "both outcomes"
        );
        assert_eq!(before.lists_from_etcd.get("pods"), Some(&1.0));
        assert_eq!(before.closed_watches.get("nodes"), Some(&5.0));
        let after =
            ApiServerCounts::of(&metrics.replace("success=\"true\"} 7", "success=\"true\"} 1007"));
        let window = after.since(&before);
        assert_eq!(window.lists_from_etcd.get("nodes"), Some(&1000.0));
        assert_eq!(
            window.lists_from_etcd.get("pods"),
            None,
            "no change, left out"
        );
        assert!(window.closed_watches.is_empty());
    }
}
