//! Every path of an upgrade, explored: seeded random schedules of what users, nodes and the
//! controller's own process do, run against the pure core's lifecycle with a model of the nodes and of
//! the Kubernetes side, in virtual time (no sockets, no sleeps), with the controller's promises checked
//! after every step.
//!
//! A hand-written generator and shrinker rather than `proptest`'s state-machine support: a schedule is
//! a flat list of events from one `u64` seed, replayed bit for bit with one environment variable, and
//! shrunk by dropping events, which keeps every shrunk schedule a valid one (a state-machine strategy
//! would regenerate transitions against a reference model we do not have: the world here *is* the
//! model, and the lifecycle under test decides).
//!
//! - `EXPLORER_SCHEDULES=N`: how many schedules (default 20 000, what CI runs: about 30 s in a debug build).
//! - `EXPLORER_SEED=S`: run only schedule `S`, printing every event and reconcile.
//! - `EXPLORER_FIRST_SEED=S`: where the seeds start (default 1).

mod controller;
mod invariants;
mod model;
mod schedule;

use schedule::{Schedule, run, shrink};

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|value| {
        value
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number"))
    })
}

#[test]
fn every_schedule_keeps_every_promise() {
    if let Some(seed) = env("EXPLORER_SEED") {
        let schedule = Schedule::generate(seed);
        println!("seed {seed}: {:?}", schedule.scenario);
        let outcome = run(&schedule, true);
        for line in &outcome.trace {
            println!("{line}");
        }
        assert!(
            outcome.violations.is_empty(),
            "seed {seed} broke: {:#?}",
            outcome.violations
        );
        return;
    }
    let count = env("EXPLORER_SCHEDULES").unwrap_or(20_000);
    let first = env("EXPLORER_FIRST_SEED").unwrap_or(1);
    let (mut reconciles, mut calls, mut events) = (0, 0, 0);
    for seed in first..first + count {
        let schedule = Schedule::generate(seed);
        let outcome = run(&schedule, false);
        reconciles += outcome.reconciles;
        calls += outcome.calls;
        events += schedule.events.len();
        if let Some(broken) = outcome.violations.first() {
            let kind = broken.split(':').next().unwrap_or_default().to_string();
            let shrunk = shrink(&schedule, &kind);
            let replay = run(&shrunk, true);
            panic!(
                "seed {seed} broke a promise: {broken}\n\
                 replay: EXPLORER_SEED={seed} cargo test -p talos-upgrade-core --test explorer\n\
                 shrunk schedule ({} of {} events, {:?}):\n  {}\n\
                 its trace:\n  {}\n\
                 what it broke: {:#?}",
                shrunk.events.len(),
                schedule.events.len(),
                shrunk.scenario,
                shrunk
                    .events
                    .iter()
                    .map(|e| format!("{e:?}"))
                    .collect::<Vec<_>>()
                    .join("\n  "),
                replay.trace.join("\n  "),
                replay.violations,
            );
        }
    }
    println!(
        "explored {count} schedules (seeds {first}..{}): {events} events, {reconciles} reconciles, {calls} calls that reached a node; every promise kept",
        first + count
    );
}
