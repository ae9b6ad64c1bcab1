//! `--talosctl-comparison`: the real `talosctl upgrade --wait`, run node by node as the runbook of seed
//! 002 does, against the controller, each on its own fresh world with one identical 3 + 2 cluster (same
//! API server setup, same simulated kubelets, same node timings). Measures both wall times and their
//! ratio, repeated; nothing here judges the numbers.
//!
//! - talosctl: `talosctl --talosconfig <admin> --nodes <ip> upgrade --image <installer>:v<target>
//!   --preserve --wait` (and `--drain=false` on the LifecycleService generation), one node at a time
//!   in the run's order, each started when the previous one returned. Wall time: just before the first
//!   command starts → the last command returned.
//! - controller: the release binary with production defaults; the cluster annotated with
//!   `talos-target` (and `upgrade-order` when control planes go first). Wall time: just before the
//!   annotation patch → `talos-status: completed` seen by the benchmark's watch.
//!
//! Per node, both sides are read from the same records: the simulator's record of the node's first
//! upgrade call (`MachineService.Upgrade` on the legacy generation, `ImageService.Pull` before
//! `LifecycleService.Upgrade` on the other), the node's state changes (Ready on the target) and the
//! simulated kubelet's writes (Node Ready and uncordoned).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use kube::api::{Api, Patch, PatchParams};
use serde::Serialize;
use talos_sim::{ClientRole, Role, Timings};
use talos_upgrade_core::crd::KubernetesCluster;

use crate::world::{
    ControllerProcess, KUBERNETES, NAMESPACE, SimCluster, TALOS_FROM, TALOS_TO, World,
};

/// Which Talos upgrade API the nodes speak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Generation {
    /// 1.11.6 → 1.12.0 (the fleet benchmark's versions): `MachineService.Upgrade`, after which Talos
    /// cordons and drains the node itself; talosctl and the controller make the same call.
    Legacy,
    /// 1.13.4 → 1.13.5: `ImageService.Pull`, `LifecycleService.Upgrade`, then a reboot. The controller
    /// cordons and drains the node itself; talosctl runs with `--drain=false` (its drain needs the
    /// cluster's kubeconfig through `MachineService.Kubeconfig`, which the simulator does not serve), so
    /// nobody drains the node on the talosctl side.
    Lifecycle,
}

impl Generation {
    pub fn from(self) -> &'static str {
        match self {
            Generation::Legacy => TALOS_FROM,
            Generation::Lifecycle => "1.13.4",
        }
    }

    pub fn to(self) -> &'static str {
        match self {
            Generation::Legacy => TALOS_TO,
            Generation::Lifecycle => "1.13.5",
        }
    }

    fn kubernetes(self) -> &'static str {
        match self {
            Generation::Legacy => KUBERNETES,
            Generation::Lifecycle => "1.35.0",
        }
    }

    /// talosctl's flags besides `--nodes`, `--image` and `--wait`: the runbook's `--preserve` (a
    /// deprecated flag of the legacy call, which the controller sets too; the new API has no such
    /// field), and on the new API no drain (see [`Generation::Lifecycle`]).
    fn talosctl_flags(self) -> &'static [&'static str] {
        match self {
            Generation::Legacy => &["--preserve"],
            Generation::Lifecycle => &["--preserve", "--drain=false"],
        }
    }

    /// The installer both sides upgrade to: the image the simulated nodes were installed from
    /// (`ghcr.io/siderolabs/installer`, what `talosctl gen config` below 1.14 writes) at the target
    /// version. The controller derives the same image from the nodes' machine configs; the run checks
    /// that every install call of both sides carried it.
    pub fn installer(self) -> String {
        format!("ghcr.io/siderolabs/installer:v{}", self.to())
    }

    /// The image of the call that installs (one per node), if `call` is one.
    fn install_call(self, call: &talos_sim::CallRecord) -> Option<&serde_json::Value> {
        let install = match self {
            Generation::Legacy => "/machine.MachineService/Upgrade",
            Generation::Lifecycle => "/machine.LifecycleService/Upgrade",
        };
        (call.method == install).then(|| &call.params["image"])
    }

    /// Whether a call starts a node's upgrade: the install itself, or the pull before it.
    fn starts_node(self, call: &talos_sim::CallRecord) -> bool {
        self.install_call(call).is_some()
            || (self == Generation::Lifecycle && call.method == "/machine.ImageService/Pull")
    }
}

/// The order the nodes go in, on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Workers, then control planes, by name within a role: the controller's default.
    WorkersFirst,
    /// Control planes, then workers, by name within a role: the order of seed 002's runbook (its
    /// step 7 upgrades the control planes, step 8 the workers).
    ControlPlanesFirst,
}

impl Order {
    fn annotation(self) -> Option<&'static str> {
        match self {
            Order::WorkersFirst => None,
            Order::ControlPlanesFirst => Some("control-planes-first"),
        }
    }
}

/// What the comparison needs from the command line.
pub struct Options<'a> {
    pub repeats: usize,
    pub generation: Generation,
    pub order: Order,
    pub timings: Timings,
    pub talosctl: PathBuf,
    pub controller: &'a Path,
    pub controller_args: &'a [String],
    pub timeout: Duration,
}

/// One node of one side's run. Times are seconds since the side's start (talosctl: just before the
/// first command; controller: just before the annotation patch).
#[derive(Debug, Clone, Serialize)]
pub struct NodeRun {
    pub node: String,
    pub control_plane: bool,
    /// The node received the first call of its upgrade (the simulator's record): `MachineService.Upgrade`,
    /// or `ImageService.Pull` on the LifecycleService generation.
    pub call: f64,
    /// The install call arrived (the same as `call` on the legacy generation).
    pub install: f64,
    /// The `MachineService.Reboot` call that follows the install on the LifecycleService generation.
    pub reboot: Option<f64>,
    /// Legacy generation, control planes: whether the node led etcd when its Upgrade call arrived (the
    /// controller moves leadership off a control plane first; talosctl does not).
    pub etcd_leader: Option<bool>,
    /// The node ran the target, powered on, in stage running and ready (its state, as the simulator
    /// changed it).
    pub ready: f64,
    /// The simulated kubelet's write of the node's Kubernetes Node Ready and uncordoned, on the target,
    /// answered by the API server.
    pub node_ready_written: f64,
    /// talosctl only: the talosctl command for this node started and returned.
    pub command_started: Option<f64>,
    pub command_returned: Option<f64>,
    /// The node's own time: its first call → Ready on the target.
    pub own: f64,
    /// Its share of the wall time: its first call → the next node's first call (the last node: → the
    /// side's end).
    pub span: f64,
}

/// One side of one round.
#[derive(Debug, Clone, Serialize)]
pub struct SideRun {
    pub side: &'static str,
    pub wall: f64,
    /// The side's start → the first node's first call.
    pub lead: f64,
    /// The sum of the nodes' own times: what a tool with no overhead at all would need, one node at a
    /// time, on this run's nodes.
    pub own_sum: f64,
    pub nodes: Vec<NodeRun>,
    /// The first install call's parameters as the simulator recorded them (image, preserve, force, …).
    pub upgrade_params: serde_json::Value,
    /// World start (API server, simulator, registration), before the measured part.
    pub setup: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Round {
    pub round: usize,
    /// Which side ran first in this round (they alternate).
    pub first: &'static str,
    pub talosctl: SideRun,
    pub controller: SideRun,
    /// Controller wall time ÷ talosctl wall time.
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub generation: Generation,
    pub talosctl_flags: Vec<String>,
    pub order: Order,
    pub timings: Timings,
    pub talos_from: &'static str,
    pub talos_to: &'static str,
    pub installer: String,
    pub talosctl_version: String,
    pub controller_args: Vec<String>,
    pub rounds: Vec<Round>,
}

/// Builds talosctl (or finds it in the cache) with `scripts/build-talosctl.sh` and returns its path,
/// the script's last line of output.
pub async fn build_talosctl() -> anyhow::Result<PathBuf> {
    let candidates = [
        PathBuf::from("scripts/build-talosctl.sh"),
        testenv::script::path("build-talosctl.sh"),
    ];
    let script = candidates
        .iter()
        .find(|p| p.is_file())
        .context("scripts/build-talosctl.sh not found: run from the repository's root or pass --talosctl-bin")?;
    eprintln!(
        "building talosctl (cached after the first build): {}",
        script.display()
    );
    let script = script.clone();
    let path =
        tokio::task::spawn_blocking(move || testenv::script::try_last_line(&script, &[], &[]))
            .await?
            .map_err(anyhow::Error::msg)?;
    let path = PathBuf::from(path);
    if !path.is_file() {
        bail!("{} is not a file", path.display());
    }
    Ok(path)
}

/// `talosctl version --client --short`'s first line, for the report.
async fn talosctl_version(talosctl: &Path) -> String {
    tokio::process::Command::new(talosctl)
        .args(["version", "--client", "--short"])
        .stdin(Stdio::null())
        .output()
        .await
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .find(|l| !l.trim().is_empty() && !l.starts_with("Client"))
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// Runs the comparison `repeats` times, printing each round as it ends and the summary at the end.
pub async fn compare(options: &Options<'_>) -> anyhow::Result<Comparison> {
    let mut comparison = Comparison {
        generation: options.generation,
        talosctl_flags: options
            .generation
            .talosctl_flags()
            .iter()
            .map(|f| f.to_string())
            .collect(),
        order: options.order,
        timings: options.timings,
        talos_from: options.generation.from(),
        talos_to: options.generation.to(),
        installer: options.generation.installer(),
        talosctl_version: talosctl_version(&options.talosctl).await,
        controller_args: options.controller_args.to_vec(),
        rounds: Vec::new(),
    };
    eprintln!(
        "talosctl {} ({}); nodes {:?}, {} → {}, installer {}, talosctl flags {:?}",
        comparison.talosctl_version,
        options.talosctl.display(),
        options.order,
        comparison.talos_from,
        comparison.talos_to,
        comparison.installer,
        comparison.talosctl_flags
    );
    for round in 1..=options.repeats {
        // Alternate which side goes first, so a machine that gets busier or quieter over the run does not
        // favour one side.
        let talosctl_first = round % 2 == 1;
        let (talosctl, controller) = if talosctl_first {
            let t = run_talosctl(round, options).await?;
            let c = run_controller(round, options).await?;
            (t, c)
        } else {
            let c = run_controller(round, options).await?;
            let t = run_talosctl(round, options).await?;
            (t, c)
        };
        let ratio = controller.wall / talosctl.wall;
        let round = Round {
            round,
            first: if talosctl_first {
                "talosctl"
            } else {
                "controller"
            },
            talosctl,
            controller,
            ratio,
        };
        println!("{}", round_table(&round));
        comparison.rounds.push(round);
    }
    println!("{}", summary_table(&comparison));
    Ok(comparison)
}

/// The nodes of a cluster in the run's order: by name within a role.
fn ordered_nodes(cluster: &SimCluster, order: Order) -> Vec<talos_sim::NodeInfo> {
    let mut nodes = cluster.sim.nodes();
    nodes.sort_by(|a, b| {
        let rank = |role: Role| match (order, role.is_control_plane()) {
            (Order::WorkersFirst, false) | (Order::ControlPlanesFirst, true) => 0,
            _ => 1,
        };
        (rank(a.role), &a.name).cmp(&(rank(b.role), &b.name))
    });
    nodes
}

/// Removes a file however the run ends.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn run_talosctl(round: usize, options: &Options<'_>) -> anyhow::Result<SideRun> {
    eprintln!("\n--- round {round}: talosctl ---");
    let setup = Instant::now();
    let generation = options.generation;
    let world = World::start_on(
        1,
        options.timings,
        None,
        generation.from(),
        generation.kubernetes(),
    )
    .await?;
    let setup = setup.elapsed().as_secs_f64();
    let cluster = &world.clusters[0];
    let talosconfig = TempFile(std::env::temp_dir().join(format!(
        "tuc-bench-talosctl-{}-{round}.talosconfig",
        std::process::id()
    )));
    std::fs::write(&talosconfig.0, cluster.sim.talosconfig(ClientRole::Admin))?;
    let image = generation.installer();
    let nodes = ordered_nodes(cluster, options.order);
    // The talosconfig's endpoints are the three control planes, as `talosctl gen config` writes them;
    // like the runbook, each command names only its node and lets talosctl pick the endpoint.
    let start = SystemTime::now();
    let mut commands = BTreeMap::new();
    for node in &nodes {
        let ip = node.address.to_string();
        let mut args = [
            "--talosconfig",
            &talosconfig.0.to_string_lossy(),
            "--nodes",
            &ip,
            "upgrade",
            "--image",
            &image,
        ]
        .map(str::to_string)
        .to_vec();
        args.extend(generation.talosctl_flags().iter().map(|f| f.to_string()));
        args.push("--wait".to_string());
        let started = SystemTime::now();
        let run = tokio::time::timeout(
            options.timeout,
            tokio::process::Command::new(&options.talosctl)
                .args(&args)
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await;
        let returned = SystemTime::now();
        let output = match run {
            Ok(output) => output.context("running talosctl")?,
            Err(_) => bail!(
                "talosctl {} did not return within {:?}",
                args.join(" "),
                options.timeout
            ),
        };
        if !output.status.success() {
            bail!(
                "talosctl {} exited with {}\n--- stdout\n{}--- stderr\n{}",
                args.join(" "),
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        eprintln!(
            "talosctl upgrade --nodes {ip} ({}) returned after {:.1}s",
            node.name,
            secs(started, returned)
        );
        commands.insert(node.name.clone(), (started, returned));
    }
    let end = commands
        .values()
        .map(|(_, returned)| *returned)
        .max()
        .context("no node")?;
    side_run(
        "talosctl", generation, cluster, &nodes, start, end, &commands, setup,
    )
}

async fn run_controller(round: usize, options: &Options<'_>) -> anyhow::Result<SideRun> {
    eprintln!("\n--- round {round}: controller ---");
    let setup = Instant::now();
    let generation = options.generation;
    let mut world = World::start_on(
        1,
        options.timings,
        None,
        generation.from(),
        generation.kubernetes(),
    )
    .await?;
    world.watch_clusters().await?;
    let setup = setup.elapsed().as_secs_f64();
    let dir =
        std::env::temp_dir().join(format!("tuc-bench-compare-{}-{round}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut controller = ControllerProcess::start(
        options.controller,
        &dir,
        &world.proxy.management_url(),
        &world.ca_base64,
        options.controller_args,
    )
    .await?;
    let outcome = controller_side(&mut world, &mut controller, options, setup).await;
    if outcome.is_err() {
        eprintln!(
            "controller log kept in {} (last lines below)\n{}",
            controller.log.display(),
            controller.log_tail()
        );
    }
    let _ = controller.child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(10), controller.child.wait()).await;
    if outcome.is_ok() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    outcome
}

async fn controller_side(
    world: &mut World,
    controller: &mut ControllerProcess,
    options: &Options<'_>,
    setup: f64,
) -> anyhow::Result<SideRun> {
    // As in the main benchmark: the controller's first look (talos-current), then 3 s for its writes
    // to settle, so the measured part starts from a controller at rest.
    let generation = options.generation;
    crate::wait_for(
        world,
        controller,
        Duration::from_secs(300),
        "the controller's first look at the cluster (talos-current)",
        |times| {
            Ok(times
                .values()
                .any(|t| t.talos_current.as_deref() == Some(generation.from())))
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    let cluster = &world.clusters[0];
    let mut annotations = serde_json::Map::new();
    annotations.insert(
        talos_upgrade_core::annotations::TALOS_TARGET.to_string(),
        generation.to().into(),
    );
    if let Some(order) = options.order.annotation() {
        annotations.insert(
            talos_upgrade_core::annotations::UPGRADE_ORDER.to_string(),
            order.into(),
        );
    }
    let patch = Patch::Merge(serde_json::json!({"metadata": {"annotations": annotations}}));
    let api: Api<KubernetesCluster> = Api::namespaced(world.admin.clone(), NAMESPACE);
    let start = SystemTime::now();
    world
        .times
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(cluster.name.clone())
        .or_default()
        .annotated = Some(start);
    api.patch(&cluster.name, &PatchParams::default(), &patch)
        .await?;
    crate::wait_for(
        world,
        controller,
        options.timeout,
        "the cluster to complete its upgrade",
        |times| {
            let Some(t) = times.values().next() else {
                return Ok(false);
            };
            if let Some(message) = &t.failed {
                return Err(format!("the upgrade failed: {message}"));
            }
            Ok(t.completed.is_some())
        },
    )
    .await?;
    let end = world
        .times
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&cluster.name)
        .and_then(|t| t.completed)
        .context("not completed")?;
    eprintln!("the controller completed after {:.1}s", secs(start, end));
    let nodes = ordered_nodes(cluster, options.order);
    side_run(
        "controller",
        generation,
        cluster,
        &nodes,
        start,
        end,
        &BTreeMap::new(),
        setup,
    )
}

/// Reads one side's per-node times from the simulator's record and the benchmark's observations, and
/// checks the run was what it should be: one install call per node, in `order`, each with the same
/// installer, each node back on the target.
#[allow(clippy::too_many_arguments)]
fn side_run(
    side: &'static str,
    generation: Generation,
    cluster: &SimCluster,
    order: &[talos_sim::NodeInfo],
    start: SystemTime,
    end: SystemTime,
    commands: &BTreeMap<String, (SystemTime, SystemTime)>,
    setup: f64,
) -> anyhow::Result<SideRun> {
    let record = cluster.sim.record();
    let installs: Vec<&talos_sim::CallRecord> = record
        .iter()
        .filter(|c| generation.install_call(c).is_some())
        .collect();
    let installed: Vec<&str> = installs.iter().map(|c| c.node.as_str()).collect();
    let expected: Vec<&str> = order.iter().map(|n| n.name.as_str()).collect();
    if installed != expected {
        bail!(
            "{side}: install calls went to {installed:?}, expected one each in the order {expected:?}"
        );
    }
    let image = generation.installer();
    for call in &installs {
        let used = generation.install_call(call).cloned().unwrap_or_default();
        if used != image.as_str() {
            bail!(
                "{side}: {} was upgraded with {used}, not {image}",
                call.node
            );
        }
    }
    // Each node's first call of its upgrade: the install, or the pull before it.
    let mut calls = Vec::new();
    for name in &expected {
        let first = record
            .iter()
            .find(|c| c.node == *name && generation.starts_node(c))
            .with_context(|| format!("{side}: no upgrade call to {name}"))?;
        calls.push(first);
    }
    if calls.windows(2).any(|w| w[1].time < w[0].time) {
        bail!("{side}: the nodes' first calls are not in the order {expected:?}");
    }
    let target = generation.to();
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
    let mut nodes = Vec::new();
    for (i, ((call, info), install)) in calls.iter().zip(order).zip(&installs).enumerate() {
        let node = &call.node;
        let reboot = record
            .iter()
            .find(|c| {
                c.node == *node
                    && c.method == "/machine.MachineService/Reboot"
                    && c.time >= call.time
            })
            .map(|c| secs(start, c.time));
        let ready = states
            .get(node)
            .into_iter()
            .flatten()
            .find(|s| s.at >= call.time && s.version == target && s.ready_running_up)
            .map(|s| s.at)
            .with_context(|| format!("{side}: {node} never became ready on {target}"))?;
        let node_ready_written = written
            .get(node)
            .into_iter()
            .flatten()
            .find(|w| w.at >= call.time && w.version == target && w.ready_uncordoned)
            .map(|w| w.at)
            .with_context(|| {
                format!("{side}: {node}'s Node was never written Ready on {target}")
            })?;
        let next = calls.get(i + 1).map_or(end, |c| c.time);
        let command = commands.get(node);
        nodes.push(NodeRun {
            node: node.clone(),
            control_plane: info.role.is_control_plane(),
            call: secs(start, call.time),
            install: secs(start, install.time),
            reboot,
            etcd_leader: install.params["etcd_leader"].as_bool(),
            ready: secs(start, ready),
            node_ready_written: secs(start, node_ready_written),
            command_started: command.map(|(s, _)| secs(start, *s)),
            command_returned: command.map(|(_, r)| secs(start, *r)),
            own: secs(call.time, ready),
            span: secs(call.time, next),
        });
    }
    Ok(SideRun {
        side,
        wall: secs(start, end),
        lead: nodes.first().map_or(0.0, |n| n.call),
        own_sum: nodes.iter().map(|n| n.own).sum(),
        nodes,
        upgrade_params: installs
            .first()
            .map(|c| c.params.clone())
            .unwrap_or_default(),
        setup,
    })
}

fn secs(from: SystemTime, to: SystemTime) -> f64 {
    match to.duration_since(from) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

/// One round: both wall times, the ratio, and each side's nodes.
pub fn round_table(round: &Round) -> String {
    let mut out = format!(
        "\nround {} ({} first): talosctl {:.2} s, controller {:.2} s, controller ÷ talosctl {:.3}\n",
        round.round, round.first, round.talosctl.wall, round.controller.wall, round.ratio
    );
    for side in [&round.talosctl, &round.controller] {
        out.push_str(&format!(
            "\n{}: wall {:.2} s, start → first node's first call {:.2} s, nodes' own time {:.2} s (wall ÷ own {:.3})\n",
            side.side,
            side.wall,
            side.lead,
            side.own_sum,
            side.wall / side.own_sum
        ));
        out.push_str(
            "| node | role | first call, s | install call, s | Reboot call, s | Ready on target, s | Node Ready written, s | talosctl returned, s | own (call → Ready), s | span (call → next call or end), s | after Ready, s | led etcd at its install call |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for n in &side.nodes {
            out.push_str(&format!(
                "| {} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {} |\n",
                n.node,
                if n.control_plane {
                    "control plane"
                } else {
                    "worker"
                },
                n.call,
                n.install,
                n.reboot
                    .map_or_else(|| "–".to_string(), |r| format!("{r:.2}")),
                n.ready,
                n.node_ready_written,
                n.command_returned
                    .map_or_else(|| "–".to_string(), |r| format!("{r:.2}")),
                n.own,
                n.span,
                n.span - n.own,
                match n.etcd_leader {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "–",
                },
            ));
        }
    }
    out
}

/// Median (the lower middle for an even count), minimum and maximum.
fn median_min_max(values: &[f64]) -> (f64, f64, f64) {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    if sorted.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    (
        sorted[(sorted.len() - 1) / 2],
        sorted[0],
        sorted[sorted.len() - 1],
    )
}

/// Over all rounds: median / min / max of each wall time, the ratio, and the per-node parts.
pub fn summary_table(c: &Comparison) -> String {
    let rows: Vec<(String, Vec<f64>)> = vec![
        (
            "talosctl wall time, s".into(),
            c.rounds.iter().map(|r| r.talosctl.wall).collect(),
        ),
        (
            "controller wall time, s".into(),
            c.rounds.iter().map(|r| r.controller.wall).collect(),
        ),
        (
            "controller ÷ talosctl".into(),
            c.rounds.iter().map(|r| r.ratio).collect(),
        ),
        (
            "talosctl: start → first call, s".into(),
            c.rounds.iter().map(|r| r.talosctl.lead).collect(),
        ),
        (
            "controller: annotation → first call, s".into(),
            c.rounds.iter().map(|r| r.controller.lead).collect(),
        ),
        (
            "talosctl: nodes' own time (sum of 5), s".into(),
            c.rounds.iter().map(|r| r.talosctl.own_sum).collect(),
        ),
        (
            "controller: nodes' own time (sum of 5), s".into(),
            c.rounds.iter().map(|r| r.controller.own_sum).collect(),
        ),
        (
            "talosctl: per node, Ready on target → next call or end, s".into(),
            c.rounds
                .iter()
                .flat_map(|r| r.talosctl.nodes.iter().map(|n| n.span - n.own))
                .collect(),
        ),
        (
            "controller: per node, Ready on target → next call or end, s".into(),
            c.rounds
                .iter()
                .flat_map(|r| r.controller.nodes.iter().map(|n| n.span - n.own))
                .collect(),
        ),
        (
            "talosctl: per node, Node Ready written − talosctl returned, s".into(),
            c.rounds
                .iter()
                .flat_map(|r| {
                    r.talosctl
                        .nodes
                        .iter()
                        .filter_map(|n| n.command_returned.map(|ret| n.node_ready_written - ret))
                })
                .collect(),
        ),
    ];
    let mut out = format!(
        "\ntalosctl {} upgrade --wait vs the controller, {} round(s), one 3 + 2 cluster each, {} → {}, talosctl flags {:?}, {:?}, timings {:?}\n| measurement | median | min | max | count |\n|---|---|---|---|---|\n",
        c.talosctl_version,
        c.rounds.len(),
        c.talos_from,
        c.talos_to,
        c.talosctl_flags,
        c.order,
        c.timings
    );
    for (name, values) in rows {
        let (median, min, max) = median_min_max(&values);
        out.push_str(&format!(
            "| {name} | {median:.3} | {min:.3} | {max:.3} | {} |\n",
            values.len()
        ));
    }
    for side in ["talosctl", "controller"] {
        let leaders: Vec<bool> = c
            .rounds
            .iter()
            .map(|r| {
                if side == "talosctl" {
                    &r.talosctl
                } else {
                    &r.controller
                }
            })
            .flat_map(|s| s.nodes.iter().filter_map(|n| n.etcd_leader))
            .collect();
        if !leaders.is_empty() {
            out.push_str(&format!(
                "{side}: {} of {} control-plane install calls reached the etcd leader\n",
                leaders.iter().filter(|l| **l).count(),
                leaders.len()
            ));
        }
    }
    out
}
