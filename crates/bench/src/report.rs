//! The results of one size, their statistics, and the tables printed with the targets.

use std::collections::BTreeMap;

use serde::Serialize;
use talos_sim::Timings;

use crate::counts::{self, CountRow};
use crate::world::WorldCpu;

/// Nearest-rank percentiles of a sample.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Stats {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Stats {
    pub fn of(values: &[f64]) -> Stats {
        if values.is_empty() {
            return Stats::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let rank = |p: f64| {
            let index = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1;
            sorted[index]
        };
        Stats {
            count: sorted.len(),
            p50: rank(0.50),
            p99: rank(0.99),
            max: sorted[sorted.len() - 1],
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
        }
    }

    pub fn three(&self) -> String {
        format!("{:.3} / {:.3} / {:.3}", self.p50, self.p99, self.max)
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SizeResult {
    pub clusters: usize,
    pub nodes: usize,
    pub timings: Timings,
    /// Extra arguments given to `talos-upgrade-controller run` (empty: production defaults).
    pub controller_args: Vec<String>,
    pub setup_seconds: f64,
    /// Controller start until every cluster showed `talos-current`.
    pub first_look_seconds: f64,
    /// First annotation until the last cluster was seen `completed`.
    pub upgrade_seconds: f64,
    /// A node Ready on the target → the next node's upgrade call, same cluster (4 per cluster).
    pub overhead_seconds: Stats,
    /// The first part of the overhead: the node Ready → the simulated kubelet's write of its Node Ready
    /// and uncordoned answered by the API server (the benchmark's own work, on the same machine).
    pub overhead_kubelet_seconds: Stats,
    /// The rest: that write answered → the next node's upgrade call (the controller's part).
    pub overhead_controller_seconds: Stats,
    /// Annotation → the cluster's first upgrade call.
    pub first_call_seconds: Stats,
    /// The last node Ready on the target → `talos-status: completed` seen.
    pub finish_seconds: Stats,
    /// One node's own time: its upgrade call → Ready on the target.
    pub node_physical_seconds: Stats,
    /// Annotation → `in-progress` seen by the benchmark's watch.
    pub annotate_to_in_progress_seconds: Stats,
    /// Annotation → the API server's answer to the controller's patch setting `in-progress` (when
    /// any reader can see it; the watch above adds its delivery to the benchmark process).
    pub annotate_to_in_progress_written_seconds: Stats,
    /// Its first part: the benchmark's annotation patch answered by the API server (what `kubectl
    /// annotate` waits for; the controller can only see the annotation after that write).
    pub annotation_write_seconds: Stats,
    /// The rest: that answer → the answer to the controller's `in-progress` patch (the controller's
    /// part: its watch, its first reconcile, the patch).
    pub in_progress_controller_seconds: Stats,
    /// Annotation → `completed` seen, per cluster.
    pub cluster_wall_seconds: Stats,
    /// The sum of the 5 nodes' own times, per cluster: the physical limit of a sequential upgrade.
    pub cluster_physical_seconds: Stats,
    pub wall_over_physical: Stats,
    pub upgrade_calls: usize,
    pub kube_requests_upgrade: u64,
    pub kube_requests_per_node: f64,
    pub talos_calls_upgrade: f64,
    pub talos_calls_per_node: f64,
    pub idle_seconds: u64,
    /// The pause between the last `completed` and the idle window, and what the controller did in it.
    pub settle_seconds: u64,
    pub kube_requests_settle: u64,
    pub talos_calls_settle: f64,
    pub kube_requests_idle_per_minute: f64,
    pub talos_calls_idle_per_minute: f64,
    pub kube_upgrade_breakdown: BTreeMap<String, u64>,
    pub kube_idle_breakdown: BTreeMap<String, u64>,
    /// The controller's Talos calls by method over the upgrade and the idle window, most first, with
    /// the simulators' record of the mutating ones (counts.rs).
    pub talos_calls_by_method: Vec<CountRow>,
    /// The controller's Kubernetes requests by `scope verb resource` over both windows, most first.
    pub kube_requests_by_request: Vec<CountRow>,
    /// Of the upgrade window's Kubernetes requests, the watches.
    pub kube_watches_upgrade: u64,
    /// Watches the API server itself closed during the upgrade window because their reader did not
    /// take the events in time (its `apiserver_terminated_watchers_total`, by resource): every client
    /// of the API server counts, the controller's watches (through the proxy) nearly all of them.
    /// A watch closed so is reopened by its client, and the reopen is one of the watches above.
    pub apiserver_closed_watches_upgrade: BTreeMap<String, f64>,
    /// Consistent lists the API server read from etcd during the upgrade window because its watch
    /// cache had not caught up within 3 s (its `apiserver_watch_cache_consistent_read_total` with
    /// `fallback="true"`, by resource). Such a list of a cluster's Nodes reads every Node the API
    /// server holds, whatever its label selector.
    pub apiserver_lists_from_etcd_upgrade: BTreeMap<String, f64>,
    /// Idle Kubernetes requests per cluster per 5 minutes, watches left out (issue #27's idle goal).
    pub kube_idle_per_cluster_per_5min: f64,
    /// Idle watch requests (a watch the API server ended and the controller opened again) per cluster
    /// per 5 minutes.
    pub kube_idle_watches_per_cluster_per_5min: f64,
    /// Idle Talos calls per cluster per 5 minutes, the followers' watches left out.
    pub talos_idle_per_cluster_per_5min: f64,
    /// Idle follower watches (`COSI Watch`) opened per cluster per 5 minutes.
    pub talos_idle_streams_per_cluster_per_5min: f64,
    pub peak_rss_mib: f64,
    /// The anonymous and the file-backed part of the controller's resident memory at its highest
    /// sample (`world::PeakResident`): its data, and the pages of its binary mapped in.
    pub peak_rss_anon_mib: f64,
    pub peak_rss_file_mib: f64,
    pub cpu_seconds_total: f64,
    pub cpu_seconds_upgrade: f64,
    pub cpu_seconds_idle: f64,
    /// Upgrade-window controller CPU ÷ nodes upgraded, milliseconds.
    pub controller_cpu_ms_per_node: f64,
    /// Upgrade-window controller CPU ÷ the API server's over the same window.
    pub controller_over_apiserver_cpu: f64,
    /// `--with-floor`: the same size's floor run, for the API server's CPU with no controller.
    pub floor: Option<crate::floor::Share>,
    /// What the rest of the machine used during the upgrade (annotation → last `completed`): everything
    /// runs on the same CPUs as the controller.
    pub world_cpu_seconds_upgrade: WorldCpu,
    /// CPUs the machine has, to tell how busy it was.
    pub cpus: usize,
    /// Reconciles finished over the controller's whole life (its metric).
    pub reconciles: f64,
    /// Mean duration of one reconcile over the controller's life (its metric's sum ÷ count).
    pub reconcile_mean_seconds: f64,
    /// /proc/loadavg at the end of the idle window.
    pub load_average_after: String,
}

/// The machine the benchmark ran on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub load_average: String,
    pub date: String,
}

impl Machine {
    pub fn current() -> Machine {
        let memory_kb: f64 = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0.0);
        let kernel = std::process::Command::new("uname")
            .arg("-a")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        Machine {
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_gib: memory_kb / 1024.0 / 1024.0,
            kernel,
            load_average: std::fs::read_to_string("/proc/loadavg")
                .unwrap_or_default()
                .trim()
                .to_string(),
            date: std::process::Command::new("date")
                .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .unwrap_or_default(),
        }
    }

    pub fn summary(&self) -> String {
        format!(
            "{} CPUs, {:.1} GiB, {}, load {}, {}",
            self.cpus, self.memory_gib, self.kernel, self.load_average, self.date
        )
    }
}

fn verdict(pass: bool) -> &'static str {
    if pass { "pass" } else { "FAIL" }
}

/// (measurement, value, target, verdict) rows of one size.
fn rows(r: &SizeResult) -> Vec<[String; 4]> {
    vec![
        [
            "controller overhead per node, s (p50 / p99 / max)".into(),
            r.overhead_seconds.three(),
            "p50 ≤ 0.5, p99 ≤ 2".into(),
            format!(
                "p50 {}, p99 {}",
                verdict(r.overhead_seconds.p50 <= 0.5),
                verdict(r.overhead_seconds.p99 <= 2.0)
            ),
        ],
        untargeted(
            "… node Ready → its Node Ready written by the simulated kubelet, s (p50 / p99 / max)",
            r.overhead_kubelet_seconds.three(),
        ),
        untargeted(
            "… that write answered → next upgrade call, s (p50 / p99 / max)",
            r.overhead_controller_seconds.three(),
        ),
        untargeted(
            "annotate → first upgrade call, s (p50 / p99 / max)",
            r.first_call_seconds.three(),
        ),
        untargeted("last node Ready → completed, s (p50 / p99 / max)", r.finish_seconds.three()),
        untargeted("cluster wall time, s (p50 / p99 / max)", r.cluster_wall_seconds.three()),
        untargeted(
            "physical limit per cluster (5 nodes' own time), s (p50 / p99 / max)",
            r.cluster_physical_seconds.three(),
        ),
        untargeted(
            "wall time ÷ physical limit (p50 / p99 / max)",
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.wall_over_physical.p50, r.wall_over_physical.p99, r.wall_over_physical.max
            ),
        ),
        [
            "annotate → talos-status in-progress written (API server's answer), s (p50 / p99 / max)"
                .into(),
            r.annotate_to_in_progress_written_seconds.three(),
            "≤ 1 (judged on p99)".into(),
            verdict(r.annotate_to_in_progress_written_seconds.p99 <= 1.0).into(),
        ],
        untargeted(
            "… the annotation patch answered by the API server (the benchmark's write), s \
             (p50 / p99 / max)",
            r.annotation_write_seconds.three(),
        ),
        untargeted(
            "… that answer → in-progress written (the controller's part), s (p50 / p99 / max)",
            r.in_progress_controller_seconds.three(),
        ),
        [
            "annotate → talos-status in-progress seen by the benchmark's watch, s (p50 / p99 / max)"
                .into(),
            r.annotate_to_in_progress_seconds.three(),
            "≤ 1 (for comparison)".into(),
            verdict(r.annotate_to_in_progress_seconds.p99 <= 1.0).into(),
        ],
        untargeted(
            "Kubernetes API requests per node upgraded",
            format!("{:.1}", r.kube_requests_per_node),
        ),
        untargeted(
            "… watches the API server closed as unresponsive during the upgrade (its \
             apiserver_terminated_watchers_total): Nodes / every resource",
            nodes_of_all(&r.apiserver_closed_watches_upgrade),
        ),
        untargeted(
            "… consistent lists the API server read from etcd during the upgrade, its watch cache \
             3 s behind (apiserver_watch_cache_consistent_read_total, fallback): Nodes / every \
             resource",
            nodes_of_all(&r.apiserver_lists_from_etcd_upgrade),
        ),
        untargeted("Talos API calls per node upgraded", format!("{:.1}", r.talos_calls_per_node)),
        untargeted(
            format!(
                "Kubernetes API requests per cluster per 5 min idle, beyond the watches ({} s window)",
                r.idle_seconds
            ),
            format!("{:.2}", r.kube_idle_per_cluster_per_5min),
        ),
        untargeted(
            "… watch requests per cluster per 5 min idle",
            format!("{:.2}", r.kube_idle_watches_per_cluster_per_5min),
        ),
        untargeted(
            format!(
                "Talos API calls per cluster per 5 min idle, beyond the followers' watches ({} s window)",
                r.idle_seconds
            ),
            format!("{:.2}", r.talos_idle_per_cluster_per_5min),
        ),
        untargeted(
            "… follower watches (COSI Watch) per cluster per 5 min idle",
            format!("{:.2}", r.talos_idle_streams_per_cluster_per_5min),
        ),
        untargeted("controller peak RSS (VmHWM), MiB", format!("{:.1}", r.peak_rss_mib)),
        untargeted(
            "… at its highest sample (every 0.25 s): anonymous (data) / file-backed (the binary's \
             pages), MiB",
            format!("{:.1} / {:.1}", r.peak_rss_anon_mib, r.peak_rss_file_mib),
        ),
        untargeted(
            "controller CPU seconds: upgrade / idle / whole run",
            format!(
                "{:.1} / {:.1} / {:.1}",
                r.cpu_seconds_upgrade, r.cpu_seconds_idle, r.cpu_seconds_total
            ),
        ),
        untargeted(
            "CPU seconds during the upgrade: kube-apiserver / etcd / benchmark process (simulated nodes, \
             proxy) / controller",
            format!(
                "{:.1} / {:.1} / {:.1} / {:.1}",
                r.world_cpu_seconds_upgrade.kube_apiserver,
                r.world_cpu_seconds_upgrade.etcd,
                r.world_cpu_seconds_upgrade.benchmark,
                r.cpu_seconds_upgrade
            ),
        ),
        untargeted(
            format!(
                "machine busy during the upgrade: those four ÷ ({} CPUs × upgrade time)",
                r.cpus
            ),
            format!("{:.0} %", 100.0 * machine_busy(r)),
        ),
        untargeted(
            "controller CPU per node upgraded, ms (upgrade-window CPU ÷ nodes)",
            format!("{:.1}", r.controller_cpu_ms_per_node),
        ),
        untargeted(
            "controller CPU ÷ kube-apiserver CPU during the upgrade",
            format!("{:.2}", r.controller_over_apiserver_cpu),
        ),
        untargeted(
            "floor run (no controller, same size, as long as the upgrade): kube-apiserver / etcd CPU \
             seconds",
            r.floor.as_ref().map_or_else(
                || "– (--with-floor)".to_string(),
                |f| format!("{:.2} / {:.2} over {:.1} s", f.cpu.kube_apiserver, f.cpu.etcd, f.window_seconds),
            ),
        ),
        untargeted(
            "kube-apiserver CPU with the controller ÷ in the floor run",
            apiserver_over_floor(r).map_or_else(|| "– (--with-floor)".to_string(), |x| format!("{x:.1}")),
        ),
    ]
}

/// The API server's CPU during the upgrade ÷ its CPU over the same length of time in the floor run.
pub fn apiserver_over_floor(r: &SizeResult) -> Option<f64> {
    let floor = r.floor.as_ref()?;
    (floor.cpu.kube_apiserver > 0.0)
        .then(|| r.world_cpu_seconds_upgrade.kube_apiserver / floor.cpu.kube_apiserver)
}

/// `nodes / all` of one of the API server's counters by resource.
fn nodes_of_all(by_resource: &BTreeMap<String, f64>) -> String {
    let nodes = by_resource.get("nodes").copied().unwrap_or(0.0);
    // Folded from +0: an empty `sum()` of floats is -0, which prints as "-0".
    let all = crate::counts::sum(by_resource.values().copied());
    format!("{nodes:.0} / {all:.0}")
}

/// A row the issue sets no target for.
fn untargeted(measurement: impl Into<String>, value: String) -> [String; 4] {
    [measurement.into(), value, "–".into(), "–".into()]
}

pub fn size_table(r: &SizeResult) -> String {
    let mut out = format!(
        "\n{} cluster(s), {} nodes: setup {:.1} s, controller's first look {:.1} s, all upgraded in {:.1} s, {} upgrade calls, {} reconciles (mean {:.3} s), load average after: {}\n\n",
        r.clusters,
        r.nodes,
        r.setup_seconds,
        r.first_look_seconds,
        r.upgrade_seconds,
        r.upgrade_calls,
        r.reconciles,
        r.reconcile_mean_seconds,
        r.load_average_after
    );
    let t = &r.timings;
    out.push_str(&format!(
        "Simulated node timings, ms: pull {}, install {}, reboot (port closed) {}, boot {}, running → ready {}\n\n",
        t.pull_ms, t.install_ms, t.reboot_ms, t.boot_ms, t.ready_ms
    ));
    out.push_str("| measurement | value | target | verdict |\n|---|---|---|---|\n");
    for [a, b, c, d] in rows(r) {
        out.push_str(&format!("| {a} | {b} | {c} | {d} |\n"));
    }
    out.push_str(&format!(
        "\nTalos calls per node upgraded by method ({}; the controller's {}; simulators recorded: \
         the mutating calls they received, the cross-check)\n\n",
        size_heading(r),
        counts::TALOS_CALLS_FAMILY
    ));
    out.push_str(&counts::render(
        &r.talos_calls_by_method,
        "method",
        true,
        r.idle_seconds,
    ));
    out.push_str(&format!(
        "\nKubernetes requests per node upgraded by scope, verb and resource ({}; the counting \
         proxy; {} of the upgrade window's are watches)\n\n",
        size_heading(r),
        r.kube_watches_upgrade
    ));
    out.push_str(&counts::render(
        &r.kube_requests_by_request,
        "scope verb resource",
        false,
        r.idle_seconds,
    ));
    out.push_str(&format!(
        "\nBy scope: {}\n",
        counts::by_first_word(&r.kube_requests_by_request)
    ));
    out.push_str(&format!(
        "\nSettling ({} s after the last completed, not counted as idle): {} Kubernetes requests, {} Talos calls\n",
        r.settle_seconds, r.kube_requests_settle, r.talos_calls_settle
    ));
    if let Some(share) = &r.floor {
        out.push_str(&format!(
            "\n--with-floor: a fresh world of {} cluster(s), no controller, CPU over {:.1} s: \
             kube-apiserver {:.2} s, etcd {:.2} s\n\n{}",
            r.clusters,
            share.window_seconds,
            share.cpu.kube_apiserver,
            share.cpu.etcd,
            crate::floor::table(&share.floor)
        ));
    }
    out
}

/// `1 cluster (5 nodes)`, `3 clusters (15 nodes)`: a size's column heading.
pub fn size_heading(r: &SizeResult) -> String {
    let s = if r.clusters == 1 { "" } else { "s" };
    format!("{} cluster{s} ({} nodes)", r.clusters, r.nodes)
}

/// One row per measurement, one column per size.
pub fn summary_table(results: &[SizeResult]) -> String {
    if results.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n| measurement | target |");
    for r in results {
        out.push_str(&format!(" {} |", size_heading(r)));
    }
    out.push_str("\n|---|---|");
    for _ in results {
        out.push_str("---|");
    }
    out.push('\n');
    let all: Vec<Vec<[String; 4]>> = results.iter().map(rows).collect();
    for i in 0..all[0].len() {
        out.push_str(&format!("| {} | {} |", all[0][i][0], all[0][i][2]));
        for rows in &all {
            let [_, value, _, verdict] = &rows[i];
            if verdict == "–" {
                out.push_str(&format!(" {value} |"));
            } else {
                out.push_str(&format!(" {value} ({verdict}) |"));
            }
        }
        out.push('\n');
    }
    out
}

/// The share of the machine's CPU time the API server, etcd, the benchmark process and the controller
/// used between the first annotation and the last `completed`.
pub fn machine_busy(r: &SizeResult) -> f64 {
    let cpu = &r.world_cpu_seconds_upgrade;
    let used = cpu.kube_apiserver + cpu.etcd + cpu.benchmark + r.cpu_seconds_upgrade;
    let available = r.upgrade_seconds * r.cpus.max(1) as f64;
    if available > 0.0 {
        used / available
    } else {
        0.0
    }
}
