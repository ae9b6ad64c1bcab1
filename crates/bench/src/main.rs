//! `tuc-bench`: upgrades N simulated Talos clusters at once with the real controller binary and reports
//! how long the controller adds on top of the nodes' own time, how fast it reacts, how many API requests
//! it makes and what it costs. See docs/performance.md for what each number means and how it is taken.
//!
//! ```text
//! cargo build --release -p talos-upgrade-controller -p bench --bins
//! target/release/tuc-bench --clusters 1,50,200 --json bench.json
//! ```

mod counts;
mod floor;
mod headline;
mod proxy;
mod report;
mod talosctl;
mod world;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use clap::Parser;
use talos_sim::Timings;

use crate::report::{SizeResult, Stats};
use crate::world::{ControllerProcess, PeakResident, TALOS_FROM, TALOS_TO, World};

#[derive(Debug, Parser)]
#[command(
    about = "Benchmark talos-upgrade-controller: N clusters of 5 simulated Talos nodes, upgraded at once"
)]
struct Args {
    /// Cluster counts to run, one fresh API server each, e.g. 1,50,200.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    clusters: Vec<usize>,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// How long to watch the controller idle after every upgrade completed. The controller refreshes an
    /// idle cluster every 10 minutes (`--idle-interval`), so a shorter window can miss that refresh
    /// entirely.
    #[arg(long, default_value_t = 605)]
    idle_secs: u64,
    /// Seconds between the last `completed` and the start of the idle window, so the reconciles that
    /// the final status writes trigger are not counted as idle traffic.
    #[arg(long, default_value_t = 10)]
    settle_secs: u64,
    /// Give up (and fail) if the upgrades have not all completed after this many seconds.
    #[arg(long, default_value_t = 1800)]
    timeout_secs: u64,
    /// The controller binary (default: talos-upgrade-controller next to this binary).
    #[arg(long)]
    controller_bin: Option<PathBuf>,
    /// How long the simulated nodes take: `fast` (the tests' timings: a node upgrades in about half a
    /// second, so the whole fleet's upgrade is squeezed into seconds and its API traffic with it) or
    /// `demo` (the demo's: about 11 s per node, still several times faster than a real Talos node) or
    /// `guide` (the fastest end of the user guide's per-node times, each step ± 20 %: about 100 s per
    /// node, where real nodes take 2–4 minutes; a run of one size takes about 10 minutes). Default:
    /// `fast`, and `demo` with `--talosctl-comparison`.
    #[arg(long, value_enum)]
    node_timings: Option<NodeTimings>,
    /// Extra arguments for `talos-upgrade-controller run` (none by default: production defaults), e.g.
    /// --controller-arg=--poll-interval=500ms.
    #[arg(long = "controller-arg", allow_hyphen_values = true)]
    controller_args: Vec<String>,
    /// Write a timeline of each size to `<path>.<clusters>`, one line per event, Unix milliseconds
    /// first: every Kubernetes request the controller made (arrival and answer), every Talos call a
    /// simulator received, each node's Ready in the simulator and its Node written Ready, and each
    /// cluster's annotation, `in-progress` and `completed`. For reading where a node's time went.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Run no controller and measure only the floor under annotate → in-progress: each cluster
    /// annotated and, as soon as that is answered, patched `in-progress` by the benchmark itself, all
    /// clusters at once. What the API server alone takes on this machine; no controller can be faster.
    #[arg(long)]
    floor: bool,
    /// After each size's run, also measure that size's floor on a fresh world (as `--floor` does) and
    /// keep the API server's CPU over a window as long as the run's upgrade, for the controller's share:
    /// kube-apiserver CPU with the controller ÷ in the floor run (see docs/performance.md).
    #[arg(long, conflicts_with_all = ["floor", "talosctl_comparison"])]
    with_floor: bool,
    /// Instead of the fleet benchmark: the real `talosctl upgrade --wait` (v1.14.1, built by
    /// scripts/build-talosctl.sh), node by node as the runbook of seed 002 does, against the controller,
    /// each on a fresh world with one identical 3 + 2 cluster (demo timings unless --node-timings says
    /// otherwise). Prints both wall times, their ratio and per-node times, `--repeats` times.
    #[arg(long)]
    talosctl_comparison: bool,
    /// Rounds of `--talosctl-comparison` (each runs both sides, alternating which goes first).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// The Talos upgrade API of `--talosctl-comparison`: `legacy` (1.11.6 → 1.12.0,
    /// `MachineService.Upgrade`) or `lifecycle` (1.13.4 → 1.13.5, `ImageService` and
    /// `LifecycleService`; talosctl with `--drain=false`, the controller draining).
    #[arg(long, value_enum, default_value_t = talosctl::Generation::Legacy)]
    generation: talosctl::Generation,
    /// The node order of `--talosctl-comparison`, on both sides.
    #[arg(long, value_enum, default_value_t = talosctl::Order::WorkersFirst)]
    order: talosctl::Order,
    /// The talosctl binary for `--talosctl-comparison` (default: the one scripts/build-talosctl.sh
    /// builds or finds in its cache).
    #[arg(long)]
    talosctl_bin: Option<PathBuf>,
}

/// The simulated nodes' timings a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NodeTimings {
    Fast,
    Demo,
    Guide,
}

impl NodeTimings {
    fn timings(self) -> Timings {
        match self {
            NodeTimings::Fast => Timings::fast(),
            NodeTimings::Demo => Timings::default(),
            NodeTimings::Guide => Timings::like_the_guide(),
        }
    }
}

/// The fleet benchmark's and the floor's node timings: `fast` unless asked otherwise.
fn node_timings(args: &Args) -> NodeTimings {
    args.node_timings.unwrap_or(NodeTimings::Fast)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    if args.floor {
        return floor_only(&args).await;
    }
    let binary = match &args.controller_bin {
        Some(path) => path.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the directory of tuc-bench")?
            .join("talos-upgrade-controller"),
    };
    if !binary.exists() {
        bail!(
            "{} not found: build it first (cargo build --release -p talos-upgrade-controller -p bench --bins) or pass --controller-bin",
            binary.display()
        );
    }
    let machine = report::Machine::current();
    eprintln!("machine: {}", machine.summary());
    if args.talosctl_comparison {
        return talosctl_comparison(&args, &binary, &machine).await;
    }
    let mut results = Vec::new();
    for &n in &args.clusters {
        eprintln!("\n=== {n} cluster(s), {} nodes ===", 5 * n);
        warn_if_few_files(5 * n);
        let mut result = run_size(n, &binary, &args)
            .await
            .with_context(|| format!("the run with {n} cluster(s)"))?;
        if args.with_floor {
            result.floor = Some(
                floor_share(n, &args, Duration::from_secs_f64(result.upgrade_seconds))
                    .await
                    .with_context(|| format!("the floor run with {n} cluster(s)"))?,
            );
        }
        results.push(result);
        let result = &results[results.len() - 1];
        // The goals first (every size so far, so the 5,000-node RSS goal sees the 1,000-node figure),
        // then this size's details.
        println!(
            "\n{} cluster(s): issue #27's goals, sizes so far\n\n{}",
            n,
            headline::table(&headline::goals(&results), &results)
        );
        println!("{}", report::size_table(result));
        // After every size, so a later size that fails leaves the earlier results on disk.
        if let Some(path) = &args.json {
            write_json(
                path,
                serde_json::json!({
                    "machine": machine,
                    "headline": headline::goals(&results),
                    "results": results,
                }),
            )?;
        }
    }
    println!(
        "\n## Issue #27's goals\n\n{}",
        headline::table(&headline::goals(&results), &results)
    );
    println!("## Details\n{}", report::summary_table(&results));
    Ok(())
}

/// `--with-floor`: a fresh world of `n` clusters, no controller; the floor and the API server's CPU
/// over `window` (the measured run's upgrade time).
async fn floor_share(n: usize, args: &Args, window: Duration) -> anyhow::Result<floor::Share> {
    eprintln!(
        "floor: {n} cluster(s), no controller, {:.1} s window",
        window.as_secs_f64()
    );
    let mut world = World::start(n, node_timings(args).timings(), None).await?;
    // As in the measured run, whose window the benchmark's own watch also ran through.
    world.watch_clusters().await?;
    floor::measure_share(&world, window).await
}

/// Says so if this process may run out of file descriptors: it holds every simulated node's listener
/// and the connections to it, and the proxy's connections of every cluster (the controller and the
/// API server inherit the same limit).
fn warn_if_few_files(nodes: usize) {
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| open_files_limit(&limits));
    // A listener and a connection or two per node, a workload connection pair per cluster, and room.
    let needed = 3 * nodes + 1024;
    if let Some(limit) = limit.filter(|limit| *limit < needed as u64) {
        eprintln!(
            "warning: the open-files limit is {limit}; {nodes} nodes may need about {needed} (ulimit -n)"
        );
    }
}

/// The soft limit of `Max open files` in the text of `/proc/<pid>/limits`.
fn open_files_limit(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `--talosctl-comparison`: talosctl and the controller side by side (see `talosctl.rs`).
async fn talosctl_comparison(
    args: &Args,
    binary: &std::path::Path,
    machine: &report::Machine,
) -> anyhow::Result<()> {
    let talosctl = match &args.talosctl_bin {
        Some(path) => path.clone(),
        None => talosctl::build_talosctl().await?,
    };
    let comparison = talosctl::compare(&talosctl::Options {
        repeats: args.repeats,
        generation: args.generation,
        order: args.order,
        timings: args.node_timings.unwrap_or(NodeTimings::Demo).timings(),
        talosctl,
        controller: binary,
        controller_args: &args.controller_args,
        timeout: Duration::from_secs(args.timeout_secs),
    })
    .await?;
    if let Some(path) = &args.json {
        write_json(
            path,
            serde_json::json!({"machine": machine, "talosctl_comparison": comparison}),
        )?;
    }
    Ok(())
}

/// `--floor`: no controller, only the API server's own time from the annotations to `in-progress`.
async fn floor_only(args: &Args) -> anyhow::Result<()> {
    let machine = report::Machine::current();
    eprintln!("machine: {}", machine.summary());
    let mut floors = Vec::new();
    for &n in &args.clusters {
        eprintln!("\n=== floor: {n} cluster(s), no controller ===");
        let world = World::start(n, node_timings(args).timings(), None).await?;
        let floor = floor::measure(&world).await?;
        println!("{}", floor::table(&floor));
        floors.push(floor);
        if let Some(path) = &args.json {
            write_json(
                path,
                serde_json::json!({"machine": machine, "floor": floors}),
            )?;
        }
    }
    Ok(())
}

fn write_json(path: &std::path::Path, json: serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Removes the run's directory (controller kubeconfig and log) when dropped, unless asked to keep it.
struct TempDir(PathBuf, bool);
impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.1 {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

async fn run_size(n: usize, binary: &std::path::Path, args: &Args) -> anyhow::Result<SizeResult> {
    let timings = node_timings(args).timings();
    let mut dir = TempDir(
        std::env::temp_dir().join(format!("tuc-bench-{}-{n}", std::process::id())),
        false,
    );
    std::fs::create_dir_all(&dir.0)?;

    let setup = Instant::now();
    eprintln!("starting the API server and {n} simulated cluster(s) ...");
    let timeline = args
        .timeline
        .as_ref()
        .map(|path| PathBuf::from(format!("{}.{n}", path.display())));
    let mut world = World::start(n, timings, timeline.as_deref()).await?;
    world.watch_clusters().await?;
    let setup_s = setup.elapsed().as_secs_f64();
    let image_env: Vec<String> = talos_upgrade_controller::IMAGE_ENV
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    eprintln!(
        "setup took {setup_s:.1}s; starting the controller with the image's {}",
        image_env.join(" ")
    );

    let mut controller = ControllerProcess::start(
        binary,
        &dir.0,
        &world.proxy.management_url(),
        &world.ca_base64,
        &args.controller_args,
    )
    .await?;
    let outcome = measure(n, &mut world, &mut controller, args).await;
    if timeline.is_some() {
        // The timeline's reader wants the controller's own account beside it.
        dir.1 = true;
        eprintln!("controller log kept in {}", controller.log.display());
    }
    if outcome.is_err() {
        dir.1 = true;
        eprintln!(
            "controller log kept in {} (last lines below)\n{}",
            controller.log.display(),
            controller.log_tail()
        );
    }
    let _ = controller.child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(10), controller.child.wait()).await;
    if let Some(path) = &timeline {
        world.proxy.flush_log();
        world::append_timeline(&world, path)?;
    }
    drop(world);
    let mut result = outcome?;
    result.setup_seconds = setup_s;
    result.timings = timings;
    result.controller_args = args.controller_args.clone();
    Ok(result)
}

async fn wait_for(
    world: &World,
    controller: &mut ControllerProcess,
    timeout: Duration,
    what: &str,
    check: impl Fn(&std::collections::BTreeMap<String, world::ClusterTimes>) -> Result<bool, String>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = controller.exited() {
            bail!("the controller exited ({status}) while waiting for {what}");
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match world
            .wait_times(left.min(Duration::from_secs(1)), what, &check)
            .await
        {
            Ok(()) => return Ok(()),
            Err(error)
                if Instant::now() >= deadline || !error.to_string().contains("timed out") =>
            {
                return Err(error);
            }
            Err(_) => {}
        }
    }
}

async fn measure(
    n: usize,
    world: &mut World,
    controller: &mut ControllerProcess,
    args: &Args,
) -> anyhow::Result<SizeResult> {
    let resident = PeakResident::follow(controller.pid);
    // The controller's first look at every cluster: it reports the version the nodes run.
    let started = Instant::now();
    wait_for(
        world,
        controller,
        // Every cluster's first reconcile, one after another on a busy machine at 1,000 clusters.
        Duration::from_secs(300 + n as u64),
        "the controller's first look at every cluster (talos-current)",
        |times| {
            Ok(times.len() == n
                && times
                    .values()
                    .all(|t| t.talos_current.as_deref() == Some(TALOS_FROM)))
        },
    )
    .await?;
    let first_look_s = started.elapsed().as_secs_f64();
    eprintln!("the controller saw every cluster after {first_look_s:.1}s; annotating all at once");
    // Let the first reconciles' own writes settle.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let kube_before = world.proxy.counts();
    let talos_before = controller.talos_calls().await?;
    let window_started = SystemTime::now();
    let apiserver_before = world.apiserver_counts().await?;
    let (_, cpu_before) = controller.usage()?;
    let world_cpu_before = world.cpu()?;
    let upgrade_started = Instant::now();
    world.annotate_all().await?;
    wait_for(
        world,
        controller,
        Duration::from_secs(args.timeout_secs),
        "every cluster to complete its upgrade",
        |times| {
            if let Some((name, t)) = times.iter().find(|(_, t)| t.failed.is_some()) {
                return Err(format!(
                    "cluster {name} failed: {}",
                    t.failed.clone().unwrap_or_default()
                ));
            }
            Ok(times.values().filter(|t| t.completed.is_some()).count() == n)
        },
    )
    .await?;
    let upgrade_s = upgrade_started.elapsed().as_secs_f64();
    let kube_upgrade = world.proxy.counts();
    let talos_upgrade = controller.talos_calls().await?;
    let window_ended = SystemTime::now();
    let apiserver_upgrade = world.apiserver_counts().await?.since(&apiserver_before);
    let (_, cpu_upgrade) = controller.usage()?;
    let world_cpu_upgrade = world.cpu()?.minus(world_cpu_before);
    eprintln!(
        "all {n} cluster(s) completed after {upgrade_s:.1}s; {}s to settle, then watching the idle controller for {}s",
        args.settle_secs, args.idle_secs
    );
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;
    let kube_settled = world.proxy.counts();
    let talos_settled = controller.talos_calls().await?;
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let kube_idle = world.proxy.counts();
    let talos_idle = controller.talos_calls().await?;
    let (peak_rss, cpu_total) = controller.usage()?;
    let peak_resident = resident.highest();
    let reconciles = controller
        .counter_sum("talos_upgrade_reconcile_duration_seconds_count")
        .await?;
    let reconcile_seconds = controller
        .counter_sum("talos_upgrade_reconcile_duration_seconds_sum")
        .await?;
    let load_average = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string();
    if let Some(status) = controller.exited() {
        bail!("the controller exited ({status}) while idle");
    }

    // Per-cluster timings from the simulators' call records and the nodes' state changes.
    let times = world
        .times
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut overhead = Vec::new();
    let mut kubelet_part = Vec::new();
    let mut controller_part = Vec::new();
    let mut first_call = Vec::new();
    let mut finish = Vec::new();
    let mut in_progress = Vec::new();
    let mut in_progress_written = Vec::new();
    let mut annotation_write = Vec::new();
    let mut in_progress_controller_part = Vec::new();
    let written_at = world.proxy.in_progress_written();
    let mut wall = Vec::new();
    let mut physical = Vec::new();
    let mut node_physical = Vec::new();
    let mut upgrade_calls_total = 0usize;
    for cluster in &world.clusters {
        let t = times
            .get(&cluster.name)
            .with_context(|| format!("no times for {}", cluster.name))?;
        let annotated = t.annotated.context("not annotated")?;
        let completed = t.completed.context("not completed")?;
        let progressing = t.in_progress.with_context(|| {
            format!(
                "{}: the watch never saw talos-status=in-progress",
                cluster.name
            )
        })?;
        in_progress.push(secs(annotated, progressing));
        let written = written_at.get(&cluster.name).with_context(|| {
            format!(
                "{}: the controller never patched talos-status=in-progress",
                cluster.name
            )
        })?;
        in_progress_written.push(secs(annotated, *written));
        let answered = t
            .annotation_answered
            .context("annotation patch not answered")?;
        annotation_write.push(secs(annotated, answered));
        in_progress_controller_part.push(secs(answered, *written));
        wall.push(secs(annotated, completed));

        let calls: Vec<(String, SystemTime)> = cluster
            .sim
            .record()
            .into_iter()
            .filter(|c| c.method.ends_with("/Upgrade"))
            .map(|c| (c.node, c.time))
            .collect();
        upgrade_calls_total += calls.len();
        let mut seen = std::collections::BTreeSet::new();
        for (node, _) in &calls {
            if !seen.insert(node.clone()) {
                bail!("{node} received more than one upgrade call");
            }
        }
        if calls.len() != 5 {
            bail!(
                "{}: {} upgrade calls, expected 5",
                cluster.name,
                calls.len()
            );
        }
        let states = cluster
            .states
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let written = cluster
            .written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut physical_sum = 0.0;
        let mut last_ready = None;
        for (i, (node, called)) in calls.iter().enumerate() {
            let ready = states
                .get(node)
                .into_iter()
                .flatten()
                .find(|s| s.at >= *called && s.version == TALOS_TO && s.ready_running_up)
                .map(|s| s.at)
                .with_context(|| format!("{node} never became ready on {TALOS_TO}"))?;
            let own = secs(*called, ready);
            physical_sum += own;
            node_physical.push(own);
            if i == 0 {
                first_call.push(secs(annotated, *called));
            }
            if let Some((_, next)) = calls.get(i + 1) {
                overhead.push(secs(ready, *next));
                // Split at the moment the simulated kubelet's write of the node's return was answered.
                let in_api_server = written
                    .get(node)
                    .into_iter()
                    .flatten()
                    .find(|w| w.at >= *called && w.version == TALOS_TO && w.ready_uncordoned)
                    .map(|w| w.at)
                    .with_context(|| {
                        format!("{node}'s Node was never written Ready on {TALOS_TO}")
                    })?;
                kubelet_part.push(secs(ready, in_api_server));
                controller_part.push(secs(in_api_server, *next));
            }
            last_ready = Some(ready);
        }
        physical.push(physical_sum);
        if let Some(ready) = last_ready {
            finish.push(secs(ready, completed));
        }
    }
    let ratio: Vec<f64> = wall.iter().zip(&physical).map(|(w, p)| w / p).collect();
    let nodes = 5 * n;
    let upgrade_requests = kube_upgrade.since(&kube_before);
    let idle_requests = kube_idle.since(&kube_settled);
    let settle_requests = kube_settled.since(&kube_upgrade);
    let idle_minutes = args.idle_secs as f64 / 60.0;
    let scale = counts::Scale {
        nodes,
        clusters: n,
        idle_seconds: args.idle_secs as f64,
    };
    let talos_upgrade_window = talos_upgrade.since(&talos_before);
    let talos_idle_window = talos_idle.since(&talos_settled);
    let (talos_idle_streams, talos_idle_others) = talos_idle_window.streams_and_others();
    let (kube_watches_upgrade, _) = upgrade_requests.watches_and_others();
    let (kube_idle_watches, kube_idle_others) = idle_requests.watches_and_others();
    let cpu_seconds_upgrade = cpu_upgrade - cpu_before;
    Ok(SizeResult {
        clusters: n,
        nodes,
        timings: Timings::fast(),
        controller_args: Vec::new(),
        setup_seconds: 0.0,
        first_look_seconds: first_look_s,
        upgrade_seconds: upgrade_s,
        overhead_seconds: Stats::of(&overhead),
        overhead_kubelet_seconds: Stats::of(&kubelet_part),
        overhead_controller_seconds: Stats::of(&controller_part),
        first_call_seconds: Stats::of(&first_call),
        finish_seconds: Stats::of(&finish),
        node_physical_seconds: Stats::of(&node_physical),
        annotate_to_in_progress_seconds: Stats::of(&in_progress),
        annotate_to_in_progress_written_seconds: Stats::of(&in_progress_written),
        annotation_write_seconds: Stats::of(&annotation_write),
        in_progress_controller_seconds: Stats::of(&in_progress_controller_part),
        cluster_wall_seconds: Stats::of(&wall),
        cluster_physical_seconds: Stats::of(&physical),
        wall_over_physical: Stats::of(&ratio),
        upgrade_calls: upgrade_calls_total,
        kube_requests_upgrade: upgrade_requests.total(),
        kube_requests_per_node: upgrade_requests.total() as f64 / nodes as f64,
        talos_calls_upgrade: talos_upgrade_window.total(),
        talos_calls_per_node: scale.per_node(talos_upgrade_window.total()),
        idle_seconds: args.idle_secs,
        kube_requests_idle_per_minute: idle_requests.total() as f64 / idle_minutes,
        talos_calls_idle_per_minute: talos_idle_window.total() / idle_minutes,
        settle_seconds: args.settle_secs,
        kube_requests_settle: settle_requests.total(),
        talos_calls_settle: talos_settled.since(&talos_upgrade).total(),
        kube_upgrade_breakdown: upgrade_requests.breakdown(),
        kube_idle_breakdown: idle_requests.breakdown(),
        talos_calls_by_method: counts::talos_rows(
            &talos_upgrade_window,
            &talos_idle_window,
            &world.simulator_calls(window_started, window_ended),
            scale,
        ),
        kube_requests_by_request: counts::count_rows(
            &upgrade_requests.by_request(),
            &idle_requests.by_request(),
            scale,
        ),
        kube_watches_upgrade,
        apiserver_closed_watches_upgrade: apiserver_upgrade.closed_watches,
        apiserver_lists_from_etcd_upgrade: apiserver_upgrade.lists_from_etcd,
        kube_idle_per_cluster_per_5min: scale.per_cluster_per_period(kube_idle_others as f64),
        kube_idle_watches_per_cluster_per_5min: scale
            .per_cluster_per_period(kube_idle_watches as f64),
        talos_idle_per_cluster_per_5min: scale.per_cluster_per_period(talos_idle_others),
        talos_idle_streams_per_cluster_per_5min: scale.per_cluster_per_period(talos_idle_streams),
        peak_rss_mib: peak_rss as f64 / (1024.0 * 1024.0),
        peak_rss_anon_mib: peak_resident.anon_kb as f64 / 1024.0,
        peak_rss_file_mib: peak_resident.file_kb as f64 / 1024.0,
        cpu_seconds_total: cpu_total,
        cpu_seconds_upgrade,
        cpu_seconds_idle: cpu_total - cpu_upgrade,
        controller_cpu_ms_per_node: 1000.0 * scale.per_node(cpu_seconds_upgrade),
        controller_over_apiserver_cpu: if world_cpu_upgrade.kube_apiserver > 0.0 {
            cpu_seconds_upgrade / world_cpu_upgrade.kube_apiserver
        } else {
            0.0
        },
        floor: None,
        world_cpu_seconds_upgrade: world_cpu_upgrade,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        reconciles,
        reconcile_mean_seconds: if reconciles > 0.0 {
            reconcile_seconds / reconciles
        } else {
            0.0
        },
        load_average_after: load_average,
    })
}

fn secs(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_the_open_files_limit() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             95000                95000                processes \n\
                      Max open files            20000                40000                files     \n";
        assert_eq!(super::open_files_limit(limits), Some(20000));
        assert_eq!(super::open_files_limit("Max processes 1 1\n"), None);
    }
}
