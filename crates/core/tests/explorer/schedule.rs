//! Schedules: a cluster to start from and a list of events (time passing and reconciles, what users
//! do, what nodes do, restarts and conflicts), generated from one seed, run against the model, and
//! shrunk when a promise breaks.

use semver::Version;
use talos_upgrade_core::annotations::{self as keys};
use talos_upgrade_core::catalog::Catalog;
use talos_upgrade_core::lifecycle::Limits;
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::versions::{self, KubernetesVersion, TalosVersion};

use crate::controller::{self, Ended};
use crate::invariants::Watch;
use crate::model::{Behaviour, Node, World};

/// The releases the explorer's clusters know: both Talos API generations (1.11–1.12 legacy, 1.13
/// lifecycle), and Kubernetes releases each of them supports.
pub fn catalog() -> Catalog {
    Catalog::new(
        ["1.11.6", "1.12.0", "1.12.1", "1.13.0", "1.13.1"]
            .map(|v| TalosVersion::parse(v).expect("version")),
        ["1.33.2", "1.34.1", "1.35.0", "1.36.0"]
            .map(|v| KubernetesVersion::parse(v).expect("version")),
    )
}

/// The controller's deadlines in the explorer: the defaults.
pub fn limits() -> Limits {
    Limits::default()
}

/// A small deterministic generator (SplitMix64): one seed gives one schedule, on every machine.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The cluster a schedule starts from.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub talos: String,
    pub kubernetes: String,
    pub control_planes: usize,
    pub workers: usize,
}

/// What a node may be made to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trait {
    Slow,
    NeverReturns,
    FallsBack,
    Refuses,
    Unavailable,
    InstallFails,
    /// The pull and the installer fail in a way worth retrying (a registry hiccup, exit code 5).
    InstallFlaky,
    DrainBlocked,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Virtual time passes, then the controller reconciles.
    Tick(u64),
    /// An annotation set (`Some`) or removed (`None`) by a user.
    Annotate(&'static str, Option<String>),
    /// Node `index` (modulo the nodes) gets or loses a behaviour.
    Behave(usize, Trait, bool),
    /// Node `index` crashes on its own and is back a minute later.
    NodeCrash(usize),
    /// A worker joins, on the version the cluster started on.
    NodeJoins,
    /// Node `index` leaves the cluster's inventory (or comes back to it).
    NodeLeaves(usize, bool),
    /// The controller dies during its next calls, after this many.
    Crash(usize),
    /// The next save of the progress record conflicts.
    Conflict,
    /// The provisioning operator writes its own phase.
    ForeignPhase,
}

#[derive(Debug, Clone)]
pub struct Schedule {
    pub seed: u64,
    pub scenario: Scenario,
    pub events: Vec<Event>,
}

const TALOS: [&str; 5] = ["1.11.6", "1.12.0", "1.12.1", "1.13.0", "1.13.1"];
const KUBERNETES: [&str; 4] = ["1.33.2", "1.34.1", "1.35.0", "1.36.0"];

impl Schedule {
    pub fn generate(seed: u64) -> Schedule {
        let mut rng = Rng::new(seed);
        let starts = ["1.11.6", "1.12.0", "1.13.0", "1.12.1"];
        let talos = *rng.pick(&starts);
        let supported: Vec<&str> = KUBERNETES
            .iter()
            .copied()
            .filter(|k| {
                versions::check_kubernetes_target_supported(
                    &TalosVersion::parse(talos).expect("version"),
                    &KubernetesVersion::parse(k).expect("version"),
                )
                .is_ok()
            })
            .collect();
        let kubernetes = *rng.pick(&supported[..supported.len().saturating_sub(1).max(1)]);
        let scenario = Scenario {
            talos: talos.to_string(),
            kubernetes: kubernetes.to_string(),
            // One or three: two etcd members never survive one going down, so a two-control-plane
            // cluster holds for ever, by design (src/talos_fleet.rs `quorum_problem`).
            control_planes: if rng.chance(40) { 1 } else { 3 },
            workers: rng.below(4) as usize,
        };
        let length = 10 + rng.below(60) as usize;
        let events = (0..length).map(|_| event(&mut rng)).collect();
        Schedule {
            seed,
            scenario,
            events,
        }
    }
}

fn event(rng: &mut Rng) -> Event {
    let roll = rng.below(100);
    match roll {
        0..=44 => Event::Tick(match rng.below(10) {
            0 => 60 + rng.below(1200),
            1..=3 => 20 + rng.below(40),
            _ => 1 + rng.below(10),
        }),
        45..=69 => user(rng),
        70..=87 => {
            let node = rng.below(8) as usize;
            match rng.below(10) {
                0 => Event::NodeCrash(node),
                1 => Event::NodeJoins,
                2 => Event::NodeLeaves(node, rng.chance(50)),
                _ => {
                    let traits = [
                        Trait::Slow,
                        Trait::NeverReturns,
                        Trait::FallsBack,
                        Trait::Refuses,
                        Trait::Unavailable,
                        Trait::InstallFails,
                        Trait::InstallFlaky,
                        Trait::DrainBlocked,
                    ];
                    Event::Behave(node, *rng.pick(&traits), rng.chance(60))
                }
            }
        }
        88..=92 => Event::Crash(rng.below(3) as usize),
        93..=96 => Event::Conflict,
        _ => Event::ForeignPhase,
    }
}

fn user(rng: &mut Rng) -> Event {
    let set = |key, value: &str| Event::Annotate(key, Some(value.to_string()));
    match rng.below(20) {
        0..=4 => {
            let value = if rng.chance(85) {
                rng.pick(&TALOS).to_string()
            } else {
                rng.pick(&["banana", "v1.99.0", "1.12", " "]).to_string()
            };
            Event::Annotate(keys::TALOS_TARGET, Some(value))
        }
        5 | 6 => Event::Annotate(keys::TALOS_TARGET, None),
        7..=9 => {
            let value = if rng.chance(85) {
                rng.pick(&KUBERNETES).to_string()
            } else {
                rng.pick(&["1.40.0", "latest"]).to_string()
            };
            Event::Annotate(keys::KUBERNETES_TARGET, Some(value))
        }
        10 => Event::Annotate(keys::KUBERNETES_TARGET, None),
        11 => set(keys::PAUSED, rng.pick::<&str>(&["true", "false", "maybe"])),
        12 => Event::Annotate(keys::PAUSED, None),
        13 | 14 => set(keys::RESUME, "true"),
        15 => set(
            *rng.pick(&[
                keys::TALOS_RESET_UPGRADE_STATE,
                keys::KUBERNETES_RESET_UPGRADE_STATE,
            ]),
            "true",
        ),
        16 => set(
            keys::UPGRADE_ORDER,
            rng.pick::<&str>(&["workers-first", "control-planes-first", "sideways"]),
        ),
        17 => Event::Annotate(keys::UPGRADE_ORDER, None),
        18 => set(
            keys::MAX_PARALLEL_WORKERS,
            rng.pick::<&str>(&["1", "2", "3", "0", "x"]),
        ),
        _ => Event::Annotate(keys::MAX_PARALLEL_WORKERS, None),
    }
}

/// What running a schedule came to.
#[derive(Debug, Default)]
pub struct Outcome {
    pub violations: Vec<String>,
    pub reconciles: u64,
    pub calls: usize,
    /// The trace of every reconcile (when asked for): time, then the controller's annotations.
    pub trace: Vec<String>,
}

/// How long, in virtual time, a run may take to end once every node behaves: every node's reboot
/// and deadlines with room to spare.
const SETTLE_SECS: u64 = 6 * 3600;
const SETTLE_STEP: u64 = 5;

pub fn run(schedule: &Schedule, trace: bool) -> Outcome {
    let scenario = &schedule.scenario;
    let talos = Version::parse(&scenario.talos).expect("version");
    let kubernetes = KubernetesVersion::parse(&scenario.kubernetes).expect("version");
    let mut nodes = Vec::new();
    for i in 1..=scenario.control_planes {
        nodes.push(Node::new(
            &format!("cp-{i}"),
            NodeRole::ControlPlane,
            &talos,
            &kubernetes,
        ));
    }
    for i in 1..=scenario.workers {
        nodes.push(Node::new(
            &format!("worker-{i}"),
            NodeRole::Worker,
            &talos,
            &kubernetes,
        ));
    }
    let mut world = World::new(nodes, schedule.seed ^ 0x5eed);
    let catalog = catalog();
    let mut watch = Watch::default();
    let mut outcome = Outcome::default();
    let reconcile = |world: &mut World, outcome: &mut Outcome, watch: &mut Watch| {
        let (ended, looked) = controller::reconcile(world, &catalog, limits());
        outcome.reconciles += 1;
        if ended == Ended::Reported {
            watch.after_reconcile(world, &looked, &catalog);
        }
        if trace {
            outcome.trace.push(format!(
                "t={:>6}s {ended:?} phase={:?} {}",
                world.now,
                world.phase,
                shown(world)
            ));
        }
    };
    for event in &schedule.events {
        if trace {
            outcome
                .trace
                .push(format!("t={:>6}s event {event:?}", world.now));
        }
        apply(&mut world, event, &mut watch);
        if let Event::Tick(secs) = event {
            world.advance(*secs);
            reconcile(&mut world, &mut outcome, &mut watch);
        }
        if !world.violations.is_empty() {
            break;
        }
    }
    // Every node behaves from now on: any run the user does not hold ends within the bound.
    if world.violations.is_empty() {
        if trace {
            outcome
                .trace
                .push(format!("t={:>6}s every node behaves", world.now));
        }
        for node in &mut world.nodes {
            node.behaviour = Behaviour::default();
            if !node.up && node.back_at.is_none() {
                node.back_at = Some(world.now + 30);
            }
        }
        world.crash_after_calls = None;
        world.conflict_next_save = false;
        let until = world.now + SETTLE_SECS;
        while world.now < until && world.violations.is_empty() {
            world.advance(SETTLE_STEP);
            reconcile(&mut world, &mut outcome, &mut watch);
            if watch.settled(&world) {
                break;
            }
        }
        if world.violations.is_empty() && !watch.settled(&world) {
            world.violations.push(format!(
                "no end: {} hours after every node behaves, the runs are still going: {}",
                SETTLE_SECS / 3600,
                shown(&world)
            ));
        }
    }
    outcome.violations = world.violations.clone();
    outcome.calls = world.reached.len();
    outcome
}

fn apply(world: &mut World, event: &Event, watch: &mut Watch) {
    let count = world.nodes.len().max(1);
    match event {
        Event::Tick(_) => {}
        Event::Annotate(key, value) => {
            match value {
                Some(value) => world.annotations.insert(key.to_string(), value.clone()),
                None => world.annotations.remove(*key),
            };
            if *key == keys::RESUME {
                // The user asks: a node may be upgraded again, and progress may go back.
                world.disruptive.clear();
                watch.resumed();
            }
        }
        Event::Behave(index, which, on) => {
            let node = &mut world.nodes[index % count];
            let flag = match which {
                Trait::Slow => &mut node.behaviour.slow,
                Trait::NeverReturns => &mut node.behaviour.never_returns,
                Trait::FallsBack => &mut node.behaviour.falls_back,
                Trait::Refuses => &mut node.behaviour.refuses,
                Trait::Unavailable => &mut node.behaviour.unavailable,
                Trait::InstallFails => &mut node.behaviour.install_fails,
                Trait::InstallFlaky => &mut node.behaviour.install_flaky,
                Trait::DrainBlocked => &mut node.behaviour.drain_blocked,
            };
            *flag = *on;
        }
        Event::NodeCrash(index) => {
            let now = world.now;
            let node = &mut world.nodes[index % count];
            if node.up {
                node.up = false;
                node.ready = false;
                node.back_at = Some(now + 60);
                // A crash boots whatever is installed: a pending system included.
            }
        }
        Event::NodeJoins => {
            let first = &world.nodes[0];
            let talos = world
                .nodes
                .iter()
                .map(|n| n.talos.clone())
                .min()
                .unwrap_or_else(|| first.talos.clone());
            let kubelet = first.kubelet.clone();
            let name = format!(
                "worker-{}",
                world
                    .nodes
                    .iter()
                    .filter(|n| n.role == NodeRole::Worker)
                    .count()
                    + 1
            );
            world
                .nodes
                .push(Node::new(&name, NodeRole::Worker, &talos, &kubelet));
        }
        Event::NodeLeaves(index, back) => {
            let node = &mut world.nodes[index % count];
            // The last control plane stays: a cluster without one is not a cluster.
            if node.role == NodeRole::Worker {
                node.present = *back;
            }
        }
        Event::Crash(after) => world.crash_after_calls = Some(*after),
        Event::Conflict => world.conflict_next_save = true,
        Event::ForeignPhase => {
            world.phase = Some("Provisioning".into());
            world.foreign_phase = world.phase.clone();
        }
    }
}

/// The controller's annotations, short.
pub fn shown(world: &World) -> String {
    world
        .annotations
        .iter()
        .map(|(key, value)| {
            format!(
                "{}={value:?}",
                key.strip_prefix(keys::PREFIX).unwrap_or(key)
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Shrinks a failing schedule: drops events (halves, then quarters, … then one at a time) while it
/// still fails with the same kind of broken promise.
pub fn shrink(schedule: &Schedule, kind: &str) -> Schedule {
    let fails = |candidate: &Schedule| {
        run(candidate, false)
            .violations
            .iter()
            .any(|v| v.starts_with(kind))
    };
    let mut best = schedule.clone();
    let mut chunk = best.events.len().div_ceil(2).max(1);
    let mut tries = 0;
    while tries < 3000 {
        let mut start = 0;
        let mut shrunk = false;
        while start < best.events.len() && tries < 3000 {
            let mut candidate = best.clone();
            let end = (start + chunk).min(candidate.events.len());
            candidate.events.drain(start..end);
            tries += 1;
            if fails(&candidate) {
                best = candidate;
                shrunk = true;
            } else {
                start += chunk;
            }
        }
        if !shrunk {
            if chunk == 1 {
                break;
            }
            chunk = chunk.div_ceil(2);
        }
    }
    // Fewer nodes, where the failure allows.
    for _ in 0..4 {
        let mut candidate = best.clone();
        if candidate.scenario.workers > 0 {
            candidate.scenario.workers -= 1;
        } else if candidate.scenario.control_planes > 1 {
            candidate.scenario.control_planes -= 1;
        } else {
            break;
        }
        if fails(&candidate) {
            best = candidate;
        } else {
            break;
        }
    }
    best
}
