use std::time::Duration;

use jiff::{Timestamp, ToSpan};
use semver::Version;

use super::*;
use crate::run::{NoteType, Reason, Record};

const DEADLINE: Duration = Duration::from_secs(15 * 60);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5 * 60);

fn t0() -> Timestamp {
    "2026-11-25T10:00:00Z".parse().expect("timestamp")
}

fn v(text: &str) -> Version {
    Version::parse(text).expect("version")
}

fn settings() -> Settings {
    Settings {
        order: UpgradeOrder::WorkersFirst,
        max_parallel_workers: 1,
        paused: false,
        node_deadline: DEADLINE,
        drain_timeout: DRAIN_TIMEOUT,
        unanswered_grace: Duration::from_secs(60),
        retry_after: Duration::from_secs(30),
        installer: None,
        gates: Default::default(),
        etcd_snapshot: false,
    }
}

/// Swaps the tag, keeping repository and schematic: enough for these tests; the real derivation lives in
/// the versions module.
fn image_for(current: &InstallSource, target: &Version) -> Result<String, String> {
    let current = &current.image;
    let repo = current
        .rsplit_once(':')
        .map(|(repo, _)| repo)
        .ok_or_else(|| format!("{current:?} has no tag"))?;
    Ok(format!("{repo}:v{target}"))
}

fn node(name: &str, role: NodeRole, version: &str) -> NodeObservation {
    NodeObservation {
        name: name.into(),
        role,
        talos: TalosState::Up {
            version: v(version),
            boot_id: format!("{name}-boot-1"),
            ready: true,
            install: Some(InstallSource::new(
                format!("factory.talos.dev/installer/abc123:v{version}"),
                Some("metal"),
            )),
        },
        kubernetes_ready: true,
        cordoned: false,
        drain: None,
        kubelet_version: None,
    }
}

/// Three control planes and two workers, all healthy on `version`.
fn cluster(version: &str) -> Observation {
    Observation {
        nodes: vec![
            node("cp-1", NodeRole::ControlPlane, version),
            node("cp-2", NodeRole::ControlPlane, version),
            node("cp-3", NodeRole::ControlPlane, version),
            node("worker-1", NodeRole::Worker, version),
            node("worker-2", NodeRole::Worker, version),
        ],
        etcd: EtcdObservation {
            problem: None,
            leader: Some("cp-3".into()),
        },
        gates: Default::default(),
        scope: Default::default(),
    }
}

/// Changes the observed node `name` (the rollback's tests use it too).
pub(super) fn set(obs: &mut Observation, name: &str, change: impl FnOnce(&mut NodeObservation)) {
    change(
        obs.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .expect("node in observation"),
    );
}

/// The node rebooted into `version` with a new boot id, ready or not.
fn rebooted(obs: &mut Observation, name: &str, version: &str, ready: bool) {
    set(obs, name, |n| {
        n.talos = TalosState::Up {
            version: v(version),
            boot_id: format!("{name}-boot-2"),
            ready,
            install: Some(InstallSource::new(
                format!("factory.talos.dev/installer/abc123:v{version}"),
                Some("metal"),
            )),
        };
        n.kubernetes_ready = ready;
    });
}

/// The node stopped answering (the rollback's tests use it too).
pub(super) fn down(obs: &mut Observation, name: &str) {
    set(obs, name, |n| {
        n.talos = TalosState::Unreachable {
            reason: "connection refused".into(),
        };
        n.kubernetes_ready = false;
    });
}

fn names(run: &Run) -> Vec<&str> {
    run.nodes.iter().map(|n| n.name.as_str()).collect()
}

fn upgraded_nodes(actions: &[Action]) -> Vec<&str> {
    actions
        .iter()
        .filter_map(|a| match a {
            // A node's upgrade starts with its call: the legacy upgrade, or (Talos ≥ 1.13) the pull
            // of its installer.
            Action::Upgrade { node, .. } | Action::Pull { node, .. } => Some(node.as_str()),
            _ => None,
        })
        .collect()
}

/// A run to `target`, workers first, started at t0.
fn workers_first(target: &str, observation: &Observation) -> Run {
    start_run(
        target,
        &v(target),
        UpgradeOrder::WorkersFirst,
        observation,
        t0(),
    )
}

/// A workers-first run whose workers are all done: the control planes come next.
fn workers_done(target: &str, observation: &Observation) -> Run {
    let mut run = workers_first(target, observation);
    for n in run.nodes.iter_mut().filter(|n| n.role == NodeRole::Worker) {
        n.step = NodeStep::Done {
            at: t0(),
            started_at: Some(t0()),
        };
    }
    run
}

/// Decides on a run whose pre-pull is over: the tests of what comes after it start there (the
/// pre-pull's own tests use [`decide_with_prepull`]).
fn decide(run: &Run, settings: &Settings, obs: &Observation, now: Timestamp) -> Decision {
    let mut run = run.clone();
    run.gates.prepull.done_at.get_or_insert(t0());
    advance(&run, settings, obs, &image_for, now)
}

fn decide_with_prepull(
    run: &Run,
    settings: &Settings,
    obs: &Observation,
    now: Timestamp,
) -> Decision {
    advance(run, settings, obs, &image_for, now)
}

#[test]
fn the_order_is_fixed_at_the_start() {
    let obs = cluster("1.11.6");
    let cases = [
        (
            UpgradeOrder::WorkersFirst,
            vec!["worker-1", "worker-2", "cp-1", "cp-2", "cp-3"],
        ),
        (
            UpgradeOrder::ControlPlanesFirst,
            vec!["cp-1", "cp-2", "cp-3", "worker-1", "worker-2"],
        ),
    ];
    for (order, expected) in cases {
        let run = start_run("1.12.0", &v("1.12.0"), order, &obs, t0());
        assert_eq!(names(&run), expected, "{order:?}");
        assert_eq!(run.counts(), (0, 5));
    }
}

#[test]
fn nodes_already_on_the_target_count_as_done() {
    let mut obs = cluster("1.11.6");
    rebooted(&mut obs, "worker-2", "1.12.0", true);
    let run = start_run(
        "v1.12.0",
        &v("1.12.0"),
        UpgradeOrder::WorkersFirst,
        &obs,
        t0(),
    );
    assert_eq!(run.counts(), (1, 5));
    assert_eq!(run.requested, "v1.12.0");
    assert_eq!(run.target, "1.12.0");
}

#[test]
fn batches_respect_the_role_and_max_parallel_workers() {
    // (max parallel workers, nodes issued in the first decision)
    let cases = [
        (1, vec!["worker-1"]),
        (2, vec!["worker-1", "worker-2"]),
        (5, vec!["worker-1", "worker-2"]),
    ];
    for (parallel, expected) in cases {
        let obs = cluster("1.11.6");
        let run = workers_first("1.12.0", &obs);
        let settings = Settings {
            max_parallel_workers: parallel,
            ..settings()
        };
        let decision = decide(&run, &settings, &obs, t0());
        assert_eq!(
            upgraded_nodes(&decision.actions),
            expected,
            "parallel {parallel}"
        );
        assert_eq!(decision.report.in_flight, expected);
    }
}

#[test]
fn control_planes_go_one_at_a_time_even_with_parallel_workers() {
    let obs = cluster("1.11.6");
    let run = start_run(
        "1.12.0",
        &v("1.12.0"),
        UpgradeOrder::ControlPlanesFirst,
        &obs,
        t0(),
    );
    let settings = Settings {
        max_parallel_workers: 3,
        ..settings()
    };
    let decision = decide(&run, &settings, &obs, t0());
    assert_eq!(upgraded_nodes(&decision.actions), vec!["cp-1"]);
}

#[test]
fn the_upgrade_call_is_recorded_before_it_is_made_and_never_repeated() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let first = decide(&run, &settings(), &obs, t0());
    assert_eq!(
        first.actions,
        vec![Action::Upgrade {
            node: "worker-1".into(),
            installer_image: "factory.talos.dev/installer/abc123:v1.12.0".into(),
            api: UpgradeApi::Legacy,
        }]
    );
    match &first.run.nodes[0].step {
        NodeStep::Issued {
            boot_id,
            from_version,
            ..
        } => {
            assert_eq!(boot_id, "worker-1-boot-1");
            assert_eq!(from_version, "1.11.6");
        }
        other => panic!("worker-1 should be issued, is {other:?}"),
    }
    // A restarted controller decides again from the persisted run: nothing is re-issued.
    for obs_now in [obs.clone(), {
        let mut o = obs.clone();
        down(&mut o, "worker-1");
        o
    }] {
        let again = decide(&first.run, &settings(), &obs_now, t0() + 1.minutes());
        assert!(again.actions.is_empty(), "{:?}", again.actions);
        assert_eq!(again.report.message, "Upgrading node worker-1 (1/5)");
    }
}

#[test]
fn a_node_is_done_only_after_a_reboot_into_the_target_and_ready() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let mut issued = decide(&run, &settings(), &obs, t0()).run;
    // The node acknowledged the call.
    answered(&mut issued, "worker-1");
    let later = t0() + 2.minutes();

    // (observation of worker-1, done?)
    let mut same_boot = obs.clone();
    set(&mut same_boot, "worker-1", |n| n.kubernetes_ready = true);
    let mut unreachable = obs.clone();
    down(&mut unreachable, "worker-1");
    let mut booting = obs.clone();
    rebooted(&mut booting, "worker-1", "1.12.0", false);
    let mut ready = obs.clone();
    rebooted(&mut ready, "worker-1", "1.12.0", true);
    let cases = [
        ("same boot id", same_boot, false),
        ("unreachable", unreachable, false),
        ("rebooted, not ready", booting, false),
        ("rebooted and ready", ready, true),
    ];
    for (what, observation, done) in cases {
        let decision = decide(&issued, &settings(), &observation, later);
        let is_done = matches!(decision.run.nodes[0].step, NodeStep::Done { .. });
        assert_eq!(is_done, done, "{what}");
        if done {
            // No time lost: the next node starts in the same decision.
            assert_eq!(
                upgraded_nodes(&decision.actions),
                vec!["worker-2"],
                "{what}"
            );
            assert!(
                decision
                    .report
                    .notes
                    .iter()
                    .any(|n| n.reason == Reason::NodeUpgraded),
                "{what}"
            );
        } else {
            assert!(decision.actions.is_empty(), "{what}");
        }
    }
}

#[test]
fn deadlines_and_fallbacks_fail_the_run_naming_the_node() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let mut issued = decide(&run, &settings(), &obs, t0()).run;
    // The node acknowledged the call.
    answered(&mut issued, "worker-1");
    let late = t0() + 16.minutes();

    let mut never_back = obs.clone();
    down(&mut never_back, "worker-1");
    let mut never_rebooted = obs.clone();
    set(&mut never_rebooted, "worker-1", |n| {
        n.kubernetes_ready = true
    });
    let mut never_ready = obs.clone();
    rebooted(&mut never_ready, "worker-1", "1.12.0", false);
    let mut fallback = obs.clone();
    rebooted(&mut fallback, "worker-1", "1.11.6", true);
    let cases = [
        (
            "down",
            never_back,
            late,
            "Talos upgrade failed: node worker-1 did not come back online within 15m",
        ),
        (
            "not rebooted",
            never_rebooted,
            late,
            "Talos upgrade failed: node worker-1 did not reboot into the new version within 15m",
        ),
        (
            "not ready",
            never_ready,
            late,
            "Talos upgrade failed: node worker-1 did not become Ready within 15m",
        ),
        (
            // An A/B fallback fails at once, deadline or not.
            "fallback",
            fallback,
            t0() + 1.minutes(),
            "Talos upgrade failed: node worker-1 came back on Talos 1.11.6 instead of 1.12.0",
        ),
    ];
    for (what, observation, now, message) in cases {
        let decision = decide(&issued, &settings(), &observation, now);
        assert_eq!(decision.report.state, RunState::Failed, "{what}");
        assert!(
            decision.report.message.starts_with(message),
            "{what}: {}",
            decision.report.message
        );
        assert!(decision.actions.is_empty(), "{what}: no further calls");
        assert_eq!(decision.report.failed_nodes, vec!["worker-1"], "{what}");
        assert_eq!(
            decision
                .report
                .notes
                .iter()
                .filter(|n| n.reason == Reason::UpgradeFailed && n.type_ == NoteType::Warning)
                .count(),
            1,
            "{what}"
        );
        // Terminal: deciding again changes nothing and announces nothing.
        let again = decide(
            &decision.run,
            &settings(),
            &cluster("1.11.6"),
            now + 1.hours(),
        );
        assert_eq!(again.report.state, RunState::Failed);
        assert!(
            again.actions.is_empty() && again.report.notes.is_empty(),
            "{what}"
        );
    }
}

#[test]
fn preflight_holds_name_the_node_and_the_reason() {
    let mut worker_not_ready = cluster("1.11.6");
    set(&mut worker_not_ready, "worker-2", |n| {
        n.kubernetes_ready = false
    });
    let mut cp_unreachable = cluster("1.11.6");
    down(&mut cp_unreachable, "cp-1");
    let mut etcd_sick = cluster("1.11.6");
    etcd_sick.etcd.problem = Some("member cp-2 is unhealthy".into());

    let cases = [
        (
            worker_not_ready,
            "Waiting: node worker-2 is not ready; holding before upgrading cp-1 (2/5 done)",
        ),
        (
            cp_unreachable,
            "Waiting: node cp-1's Talos API is unreachable: connection refused (2/5 done)",
        ),
        (
            etcd_sick,
            "Waiting: etcd is not healthy (member cp-2 is unhealthy); holding before control plane cp-1 (2/5 done)",
        ),
    ];
    for (obs, message) in cases {
        let run = workers_done("1.12.0", &obs);
        let decision = decide(&run, &settings(), &obs, t0());
        assert!(decision.actions.is_empty(), "{message}");
        assert_eq!(decision.report.state, RunState::InProgress);
        assert_eq!(decision.report.message, message);
    }
}

#[test]
fn leadership_moves_off_a_control_plane_before_its_upgrade() {
    let mut obs = cluster("1.11.6");
    obs.etcd.leader = Some("cp-1".into());
    let run = start_run(
        "1.12.0",
        &v("1.12.0"),
        UpgradeOrder::ControlPlanesFirst,
        &obs,
        t0(),
    );
    let decision = decide(&run, &settings(), &obs, t0());
    assert_eq!(
        decision.actions,
        vec![Action::ForfeitEtcdLeadership {
            node: "cp-1".into()
        }]
    );
    assert!(matches!(decision.run.nodes[0].step, NodeStep::Pending));

    obs.etcd.leader = Some("cp-2".into());
    let next = decide(&decision.run, &settings(), &obs, t0());
    assert_eq!(upgraded_nodes(&next.actions), vec!["cp-1"]);
}

#[test]
fn paused_runs_finish_in_flight_nodes_and_start_none() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let mut issued = decide(&run, &settings(), &obs, t0()).run;
    // The node acknowledged the call.
    answered(&mut issued, "worker-1");
    let paused = Settings {
        paused: true,
        ..settings()
    };

    let finishing = decide(&issued, &paused, &obs, t0());
    assert_eq!(finishing.report.state, RunState::Paused);
    assert_eq!(
        finishing.report.message,
        "Pausing: finishing worker-1 before holding (0/5 done)"
    );

    let mut back = obs.clone();
    rebooted(&mut back, "worker-1", "1.12.0", true);
    let held = decide(&issued, &paused, &back, t0() + 1.minutes());
    assert!(held.actions.is_empty());
    assert_eq!(
        held.report.message,
        "Paused after 1/5 nodes; remove the paused annotation to continue"
    );

    let resumed = decide(&held.run, &settings(), &back, t0() + 2.minutes());
    assert_eq!(upgraded_nodes(&resumed.actions), vec!["worker-2"]);
}

#[test]
fn the_api_generation_follows_the_running_version() {
    let cases = [
        ("1.11.6", "1.12.0", UpgradeApi::Legacy),
        ("1.12.9", "1.13.0", UpgradeApi::Legacy),
        ("1.13.0", "1.14.0", UpgradeApi::Lifecycle),
    ];
    for (from, to, api) in cases {
        let obs = cluster(from);
        let run = start_run(to, &v(to), UpgradeOrder::WorkersFirst, &obs, t0());
        let decision = decide(&run, &settings(), &obs, t0());
        // Talos ≥ 1.13 starts with the pull of the installer, then installs.
        let first = match &decision.actions[0] {
            Action::Upgrade { api, .. } => Some(*api),
            Action::Pull { .. } => Some(UpgradeApi::Lifecycle),
            _ => None,
        };
        assert_eq!(first, Some(api), "{from} -> {to}: {:?}", decision.actions);
    }
}

#[test]
fn an_underivable_installer_image_fails_before_any_call() {
    let mut obs = cluster("1.11.6");
    set(&mut obs, "worker-1", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = Some(InstallSource::new("no-tag-here", Some("metal")));
        }
    });
    let run = workers_first("1.12.0", &obs);
    let decision = decide(&run, &settings(), &obs, t0());
    assert!(decision.actions.is_empty());
    assert_eq!(decision.report.state, RunState::Failed);
    assert!(
        decision
            .report
            .message
            .contains("node worker-1 has an installer image"),
        "{}",
        decision.report.message
    );
}

#[test]
fn a_failed_call_fails_the_run_once() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let mut issued = decide(&run, &settings(), &obs, t0()).run;
    fail_node(
        &mut issued,
        "worker-1",
        "refused the upgrade: error validating installer image",
        t0(),
    );
    let decision = decide(&issued, &settings(), &obs, t0());
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        "Talos upgrade failed: node worker-1 refused the upgrade: error validating installer image"
    );
    assert!(decision.actions.is_empty());
}

/// Drives a simulated cluster through whole runs with every order and batch size, on both API
/// generations, checking the invariants the brief promises on every step.
#[test]
fn whole_runs_keep_every_promise() {
    for (from, to) in [("1.11.6", "1.12.0"), ("1.13.0", "1.14.0")] {
        for order in [UpgradeOrder::WorkersFirst, UpgradeOrder::ControlPlanesFirst] {
            for parallel in 1..=3 {
                whole_run(from, to, order, parallel);
            }
        }
    }
}

fn whole_run(from: &str, to: &str, order: UpgradeOrder, parallel: usize) {
    let case = format!("{from}->{to} {order:?}/{parallel}");
    let settings = Settings {
        order,
        max_parallel_workers: parallel,
        ..settings()
    };
    let mut obs = cluster(from);
    let mut run = start_run(to, &v(to), order, &obs, t0());
    let mut now = t0();
    let mut prepulls: Vec<String> = Vec::new();
    let mut upgrade_calls: Vec<String> = Vec::new();
    let mut reboots: Vec<String> = Vec::new();
    let mut going_down: Vec<String> = Vec::new();
    for _ in 0..200 {
        let decision = decide_with_prepull(&run, &settings, &obs, now);
        run = decision.run;
        if decision.report.state == RunState::Completed {
            break;
        }
        assert_eq!(decision.report.state, RunState::InProgress, "{case}");
        for action in &decision.actions {
            // Nothing disrupts a node before every node pulled, once.
            if !matches!(action, Action::PrePull { .. }) {
                let mut pulled = prepulls.clone();
                pulled.sort();
                pulled.dedup();
                assert!(
                    pulled.len() == 5 && prepulls.len() == 5,
                    "{case}: {action:?} before the pre-pull ended: {prepulls:?}"
                );
            }
            match action {
                Action::Rollback { .. } => panic!("{case}: an upgrade makes no rollback"),
                Action::Upgrade {
                    node,
                    api: UpgradeApi::Legacy,
                    ..
                } => {
                    upgrade_calls.push(node.clone());
                    going_down.push(node.clone());
                }
                Action::Upgrade {
                    node,
                    api: UpgradeApi::Lifecycle,
                    ..
                } => {
                    upgrade_calls.push(node.clone());
                    installed(&mut run, node, false, now);
                    // The next pass cordons and evicts; this cluster has nothing to evict.
                    drain(&mut obs, node, 0, None);
                }
                Action::Pull { node, .. } => pulled(&mut run, node),
                Action::PrePull { node, .. } => {
                    prepulls.push(node.clone());
                    run.gates.prepull.pulled(node, now);
                }
                Action::Reboot { node } => {
                    reboots.push(node.clone());
                    going_down.push(node.clone());
                }
                Action::Uncordon { node } => set(&mut obs, node, |n| n.cordoned = false),
                Action::ForfeitEtcdLeadership { node } => {
                    let other = if node == "cp-1" { "cp-2" } else { "cp-1" };
                    obs.etcd.leader = Some(other.into());
                }
                Action::EtcdSnapshot { .. } => panic!("{case}: no snapshot was asked for"),
            }
        }
        for name in &going_down {
            down(&mut obs, name);
        }
        let down_now: Vec<&str> = obs
            .nodes
            .iter()
            .filter(|n| matches!(n.talos, TalosState::Unreachable { .. }))
            .map(|n| n.name.as_str())
            .collect();
        let cps_down = down_now.iter().filter(|n| n.starts_with("cp-")).count();
        let workers_down = down_now.len() - cps_down;
        assert!(cps_down <= 1, "{case}: two control planes down at once");
        assert!(
            cps_down == 0 || workers_down == 0,
            "{case}: roles never mix in flight"
        );
        assert!(
            workers_down <= parallel,
            "{case}: batch larger than {parallel}"
        );
        // The nodes come back on the target one step later.
        now += 3.minutes();
        for name in going_down.drain(..) {
            rebooted(&mut obs, &name, to, true);
            set(&mut obs, &name, |n| n.drain = None);
        }
    }
    assert_eq!(run.counts(), (5, 5), "{case}");
    assert!(
        obs.nodes.iter().all(|n| !n.cordoned),
        "{case}: no node left cordoned"
    );
    let exactly_once = |calls: &[String]| {
        let mut sorted = calls.to_vec();
        sorted.sort();
        sorted.dedup();
        sorted.len() == 5 && calls.len() == 5
    };
    assert!(
        exactly_once(&upgrade_calls),
        "{case}: each node upgraded exactly once: {upgrade_calls:?}"
    );
    if UpgradeApi::for_running(&v(from)) == UpgradeApi::Lifecycle {
        assert!(
            exactly_once(&reboots),
            "{case}: each node rebooted exactly once: {reboots:?}"
        );
    }
    let first_cp = upgrade_calls.iter().position(|n| n.starts_with("cp-"));
    let last_worker = upgrade_calls.iter().rposition(|n| n.starts_with("worker-"));
    match order {
        UpgradeOrder::WorkersFirst => assert!(last_worker < first_cp, "{case}"),
        UpgradeOrder::ControlPlanesFirst => assert!(
            first_cp < upgrade_calls.iter().position(|n| n.starts_with("worker-")),
            "{case}"
        ),
    }
}

// ----- Talos >= 1.13: install, cordon and drain, reboot, uncordon -----

fn lifecycle_stage(run: &Run, name: &str) -> Option<LifecycleStage> {
    match &run.node(name).expect("node in run").step {
        NodeStep::Issued { lifecycle, .. } => lifecycle.clone(),
        other => panic!("{name} is not in flight: {other:?}"),
    }
}

/// A run to 1.14.0 from 1.13.0 whose first node (worker-1) is installed and draining since t0.
fn draining_run() -> (Run, Observation) {
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);
    let mut run = installing(&run, "worker-1", &obs);
    installed(&mut run, "worker-1", false, t0());
    (run, obs)
}

/// `run` decided at t0, `node`'s installer pulled, and decided again: its install is sent.
fn installing(run: &Run, node: &str, obs: &Observation) -> Run {
    let mut run = decide(run, &settings(), obs, t0()).run;
    pulled(&mut run, node);
    decide(&run, &settings(), obs, t0()).run
}

fn drain(obs: &mut Observation, name: &str, remaining: usize, blocked: Option<&str>) {
    set(obs, name, |n| {
        n.cordoned = true;
        n.drain = Some(DrainStatus {
            remaining,
            blocked: blocked.map(String::from),
        });
    });
}

#[test]
fn on_talos_1_13_the_upgrade_call_installs_only_and_draining_follows() {
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);
    // The installer is pulled first, each step recorded before it is sent: a pull found unfinished
    // is made again (it changes nothing the node boots), an install never is (see below).
    let pull = decide(&run, &settings(), &obs, t0());
    assert_eq!(
        pull.actions,
        vec![Action::Pull {
            node: "worker-1".into(),
            installer_image: "factory.talos.dev/installer/abc123:v1.14.0".into(),
        }]
    );
    assert_eq!(
        lifecycle_stage(&pull.run, "worker-1"),
        Some(LifecycleStage::Pulling { failed: None })
    );
    let again = decide(&pull.run, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(again.actions, pull.actions, "a pull found unfinished");
    let mut pulled_run = pull.run.clone();
    pulled(&mut pulled_run, "worker-1");
    let first = decide(&pulled_run, &settings(), &obs, t0());
    assert_eq!(
        first.actions,
        vec![Action::Upgrade {
            node: "worker-1".into(),
            installer_image: "factory.talos.dev/installer/abc123:v1.14.0".into(),
            api: UpgradeApi::Lifecycle,
        }]
    );
    assert_eq!(
        lifecycle_stage(&first.run, "worker-1"),
        Some(LifecycleStage::Installing {
            retry: false,
            failed: None
        })
    );

    // The install went through: draining starts; a node someone else had cordoned stays cordoned after.
    for (already_cordoned, uncordon) in [(false, true), (true, false)] {
        let mut run = first.run.clone();
        installed(&mut run, "worker-1", already_cordoned, t0() + 1.minutes());
        assert_eq!(
            lifecycle_stage(&run, "worker-1"),
            Some(LifecycleStage::Draining {
                since: t0() + 1.minutes(),
                uncordon
            })
        );
        assert_eq!(draining(&run), vec!["worker-1"]);
    }
}

#[test]
fn an_install_whose_answer_was_lost_is_never_made_again_before_a_reboot() {
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);
    let mut run = decide(&run, &settings(), &obs, t0()).run;
    pulled(&mut run, "worker-1");
    let first = decide(&run, &settings(), &obs, t0());

    // The install call never got to the node: nothing was installed, so it is installed again.
    let mut not_reached = first.run.clone();
    <Talos as crate::lifecycle::Kind>::not_reached(&mut not_reached, &first.actions[0]);
    let again = decide(&not_reached, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(again.actions, first.actions);
    assert_eq!(
        lifecycle_stage(&again.run, "worker-1"),
        Some(LifecycleStage::Installing {
            retry: false,
            failed: None
        }),
        "recorded before it is made again"
    );

    // A controller restarted mid-install (or an install without an answer): it may have happened,
    // so the node is drained and rebooted instead of installed again over a pending install.
    let found = decide(&first.run, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(found.actions, vec![]);
    // Found only after the node deadline (the controller was away): still possibly installed, so
    // never "runs its old version" (explorer seed 30063), and drained as well.
    let found_late = decide(&first.run, &settings(), &obs, t0() + 20.minutes());
    assert_eq!(found_late.report.state, RunState::InProgress);
    assert_eq!(draining(&found_late.run), vec!["worker-1"]);
    assert!(
        found.report.message.contains("install got no answer"),
        "{}",
        found.report.message
    );
    assert_eq!(draining(&found.run), vec!["worker-1"]);
    let mut drained_obs = obs.clone();
    drain(&mut drained_obs, "worker-1", 0, None);
    let rebooting = decide(&found.run, &settings(), &drained_obs, t0() + 2.minutes());
    assert_eq!(
        rebooting.actions,
        vec![Action::Reboot {
            node: "worker-1".into()
        }]
    );
    let mut rebooting_run = rebooting.run.clone();
    answered(&mut rebooting_run, "worker-1");

    // Back on the target: the install had taken; the node is done once uncordoned.
    let mut on_target = drained_obs.clone();
    rebooted(&mut on_target, "worker-1", "1.14.0", true);
    set(&mut on_target, "worker-1", |n| n.drain = None);
    let back = decide(&rebooting_run, &settings(), &on_target, t0() + 3.minutes());
    assert_eq!(
        back.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );

    // Back on its old version: the install did not take, or the new system did not boot; either
    // way the node is not upgraded again unasked, and the failure says both.
    let mut old = drained_obs.clone();
    rebooted(&mut old, "worker-1", "1.13.0", true);
    set(&mut old, "worker-1", |n| n.drain = None);
    let failing = decide(&rebooting_run, &settings(), &old, t0() + 3.minutes());
    assert_eq!(
        failing.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );
    assert!(
        upgraded_nodes(&failing.actions).is_empty(),
        "nothing starts"
    );
    let failed = uncordoned_then(
        &failing,
        &mut old,
        "worker-1",
        t0() + 3.minutes() + 5.seconds(),
    );
    assert_eq!(failed.report.state, RunState::Failed);
    assert_eq!(
        failed.report.message,
        "Talos upgrade failed: node worker-1 came back on Talos 1.13.0 instead of 1.14.0 after a \
         reboot whose install got no answer: either the install did not take or the new system did \
         not boot (A/B fallback); it was not upgraded again: set resume to install it again"
    );
    assert_eq!(failed.actions, vec![]);
}

#[test]
fn a_reboot_without_an_answer_is_sent_again_only_if_the_node_never_got_it() {
    let (run, mut obs) = draining_run();
    drain(&mut obs, "worker-1", 0, None);
    set(&mut obs, "worker-1", |n| n.drain = None);
    let reboot = vec![Action::Reboot {
        node: "worker-1".into(),
    }];
    let mut drained_obs = obs.clone();
    drain(&mut drained_obs, "worker-1", 0, None);
    let drained = decide(&run, &settings(), &drained_obs, t0() + 2.minutes());
    assert_eq!(drained.actions, reboot);
    // Recorded before it is sent, as unanswered until the call returns.
    assert!(matches!(
        lifecycle_stage(&drained.run, "worker-1"),
        Some(LifecycleStage::Rebooting {
            unanswered: true,
            ..
        })
    ));

    let mut going_down = obs.clone();
    set(&mut going_down, "worker-1", |n| {
        if let TalosState::Up { ready, .. } = &mut n.talos {
            *ready = false;
        }
    });
    let mut gone = obs.clone();
    down(&mut gone, "worker-1");
    // (case, observation, when, reboot sent again?)
    let cases = [
        (
            "untouched, within the grace",
            &obs,
            t0() + 2.minutes() + 30.seconds(),
            false,
        ),
        (
            "going down, past the grace",
            &going_down,
            t0() + 4.minutes(),
            false,
        ),
        (
            "unreachable, past the grace",
            &gone,
            t0() + 4.minutes(),
            false,
        ),
        ("untouched, past the grace", &obs, t0() + 4.minutes(), true),
    ];
    for (case, observation, now, sent_again) in cases {
        let decision = decide(&drained.run, &settings(), observation, now);
        let expected: &[Action] = if sent_again { &reboot } else { &[] };
        assert_eq!(decision.actions, expected, "{case}");
        assert_eq!(
            decision
                .report
                .notes
                .iter()
                .any(|n| n.reason == Reason::NodeRebootResent
                    && n.message
                        .starts_with("Node worker-1 is still running its old system")),
            sent_again,
            "{case}: {:?}",
            decision.report.notes
        );
        assert_eq!(decision.report.state, RunState::InProgress, "{case}");
    }

    // Sent again, the grace and the deadline count from the new reboot.
    let resent = decide(&drained.run, &settings(), &obs, t0() + 4.minutes()).run;
    assert!(matches!(
        lifecycle_stage(&resent, "worker-1"),
        Some(LifecycleStage::Rebooting { at, unanswered: true, .. }) if at == t0() + 4.minutes()
    ));
    let soon = decide(
        &resent,
        &settings(),
        &obs,
        t0() + 4.minutes() + 30.seconds(),
    );
    assert!(soon.actions.is_empty(), "{:?}", soon.actions);

    // An answered reboot is never sent again: a node that stays on its old boot runs into its deadline.
    let mut answered_run = drained.run.clone();
    answered(&mut answered_run, "worker-1");
    let waiting = decide(&answered_run, &settings(), &obs, t0() + 4.minutes());
    assert!(waiting.actions.is_empty(), "{:?}", waiting.actions);
    assert_eq!(waiting.report.state, RunState::InProgress);
    let late = decide(
        &answered_run,
        &settings(),
        &obs,
        t0() + 2.minutes() + DEADLINE + 1.seconds(),
    );
    // Uncordoned before the failure is recorded, so a restart in between cannot forget it.
    assert_eq!(late.report.state, RunState::InProgress);
    assert_eq!(
        late.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );
    let failed = uncordoned_then(
        &late,
        &mut obs,
        "worker-1",
        t0() + 2.minutes() + DEADLINE + 5.seconds(),
    );
    assert_eq!(failed.report.state, RunState::Failed);
    assert_eq!(
        failed.report.message,
        "Talos upgrade failed: node worker-1 did not reboot into the new version within 15m"
    );
}

/// The node was uncordoned as `decision` asked: the next decision, at `now`.
fn uncordoned_then(
    decision: &Decision,
    obs: &mut Observation,
    node: &str,
    now: Timestamp,
) -> Decision {
    set(obs, node, |n| n.cordoned = false);
    decide(&decision.run, &settings(), obs, now)
}

#[test]
fn draining_waits_for_the_pods_and_says_what_holds_it() {
    let (run, mut obs) = draining_run();
    let blocked = "eviction of pod shop/web-1 refused: Cannot evict pod as it would violate the \
                   pod's disruption budget";
    let cases = [
        (
            2,
            None,
            "Upgrading node worker-1 (1/5): draining worker-1, 2 pods left",
        ),
        (
            1,
            Some(blocked),
            &*format!("Upgrading node worker-1 (1/5): draining worker-1, 1 pod left; {blocked}"),
        ),
    ];
    for (remaining, why, message) in cases {
        drain(&mut obs, "worker-1", remaining, why);
        let decision = decide(&run, &settings(), &obs, t0() + 4.minutes());
        assert!(decision.actions.is_empty(), "{:?}", decision.actions);
        assert_eq!(decision.report.message, message);
        assert_eq!(decision.report.in_flight, vec!["worker-1"]);
    }
}

#[test]
fn a_drain_past_its_timeout_fails_the_run_and_leaves_the_installed_node_cordoned() {
    let (run, mut obs) = draining_run();
    let blocked = "eviction of pod shop/web-1 refused: Cannot evict pod as it would violate the \
                   pod's disruption budget";
    drain(&mut obs, "worker-1", 1, Some(blocked));
    let decision = decide(&run, &settings(), &obs, t0() + 5.minutes() + 1.seconds());
    // The new system is installed and boots at the next reboot: the node takes no pods meanwhile.
    assert_eq!(decision.actions, vec![]);
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        format!(
            "Talos upgrade failed: node worker-1 could not be drained within 5m: {blocked}; it was \
             not rebooted: it runs Talos 1.13.0, and Talos 1.14.0 is installed and boots at its next \
             reboot. It is left cordoned: set resume to drain and reboot it, or uncordon it to keep \
             it on 1.13.0 until it reboots"
        )
    );
    assert_eq!(decision.report.failed_nodes, vec!["worker-1"]);
    assert!(
        decision
            .report
            .notes
            .iter()
            .any(|n| n.reason == Reason::UpgradeFailed),
        "{:?}",
        decision.report.notes
    );

    // Resumed, the node is drained and rebooted again; it is never installed a second time.
    let mut resumed = decision.run.clone();
    <Talos as crate::lifecycle::Kind>::resume(&mut resumed, t0() + 30.minutes());
    drain(&mut obs, "worker-1", 0, None);
    let again = decide(&resumed, &settings(), &obs, t0() + 30.minutes());
    assert_eq!(
        again.actions,
        vec![Action::Reboot {
            node: "worker-1".into()
        }]
    );
}

#[test]
fn an_install_that_never_gets_through_fails_at_the_node_deadline() {
    let obs = cluster("1.13.0");
    let fresh = workers_first("1.14.0", &obs);
    let first = decide(&fresh, &settings(), &obs, t0());
    // Its pull does not get through, again and again.
    let mut installing = first.run.clone();
    <Talos as crate::lifecycle::Kind>::not_reached(&mut installing, &first.actions[0]);
    // Within the deadline the install is made again; past it the node fails, untouched.
    let retried = decide(&installing, &settings(), &obs, t0() + 10.minutes());
    assert_eq!(upgraded_nodes(&retried.actions), vec!["worker-1"]);
    let late = decide(
        &installing,
        &settings(),
        &obs,
        t0() + 15.minutes() + 1.seconds(),
    );
    assert_eq!(late.actions, vec![]);
    assert_eq!(
        late.report.message,
        "Talos upgrade failed: node worker-1 could not install Talos 1.14.0 within 15m; it was \
         not rebooted and runs its old version"
    );
}

#[test]
fn a_node_that_stays_cordoned_after_its_upgrade_fails_at_the_node_deadline() {
    let (run, mut obs) = draining_run();
    drain(&mut obs, "worker-1", 0, None);
    let rebooting = decide(&run, &settings(), &obs, t0() + 2.minutes()).run;
    rebooted(&mut obs, "worker-1", "1.14.0", true);
    set(&mut obs, "worker-1", |n| {
        n.drain = None;
        n.cordoned = true;
    });
    // First seen back (late: the controller was away for a while): the uncordon is sent, and the
    // deadline counts from now, not from the reboot.
    let back = decide(&rebooting, &settings(), &obs, t0() + 30.minutes());
    assert_eq!(back.report.state, RunState::InProgress);
    assert_eq!(
        back.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );
    // Something cordons it again after every uncordon.
    let soon = decide(&back.run, &settings(), &obs, t0() + 40.minutes());
    assert_eq!(soon.report.state, RunState::InProgress);
    let late = decide(
        &back.run,
        &settings(),
        &obs,
        t0() + 45.minutes() + 1.seconds(),
    );
    assert_eq!(late.report.state, RunState::Failed);
    assert_eq!(
        late.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );
    assert!(
        late.report
            .message
            .contains("still cordoned 15m after it came back"),
        "{}",
        late.report.message
    );
}

#[test]
fn a_rebooted_node_is_done_only_once_uncordoned() {
    let (run, mut obs) = draining_run();
    drain(&mut obs, "worker-1", 0, None);
    let rebooting = decide(&run, &settings(), &obs, t0() + 2.minutes()).run;
    rebooted(&mut obs, "worker-1", "1.14.0", true);
    set(&mut obs, "worker-1", |n| n.drain = None);

    let back = decide(&rebooting, &settings(), &obs, t0() + 3.minutes());
    assert_eq!(
        back.actions,
        vec![Action::Uncordon {
            node: "worker-1".into()
        }]
    );
    assert_eq!(back.report.in_flight, vec!["worker-1"]);

    set(&mut obs, "worker-1", |n| n.cordoned = false);
    let done = decide(&back.run, &settings(), &obs, t0() + 4.minutes());
    assert!(matches!(
        done.run.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Done { .. })
    ));
    // The next node starts in the same decision: no time is lost between nodes.
    assert_eq!(upgraded_nodes(&done.actions), vec!["worker-2"]);

    // A node found cordoned before the controller touched it is left cordoned.
    let (mut run, mut obs) = draining_run();
    run.nodes[0].step = NodeStep::Issued {
        at: t0(),
        boot_id: "worker-1-boot-1".into(),
        from_version: "1.13.0".into(),
        installer_image: "factory.talos.dev/installer/abc123:v1.14.0".into(),
        lifecycle: Some(LifecycleStage::Rebooting {
            at: t0() + 1.minutes(),
            uncordon: false,
            unanswered: false,
        }),
        unanswered: false,
        install_unconfirmed: false,
    };
    rebooted(&mut obs, "worker-1", "1.14.0", true);
    set(&mut obs, "worker-1", |n| n.cordoned = true);
    let done = decide(&run, &settings(), &obs, t0() + 2.minutes());
    assert!(!done.actions.contains(&Action::Uncordon {
        node: "worker-1".into()
    }));
    assert!(matches!(
        done.run.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Done { .. })
    ));
}

#[test]
fn the_deadline_counts_from_the_reboot_and_a_late_node_is_uncordoned() {
    let (run, mut obs) = draining_run();
    drain(&mut obs, "worker-1", 0, None);
    // A long drain: the reboot is sent ten minutes after the install.
    let rebooting = decide(&run, &settings(), &obs, t0() + 10.minutes()).run;
    down(&mut obs, "worker-1");
    let cases = [
        (t0() + 20.minutes(), vec![]),
        (
            t0() + 25.minutes() + 1.seconds(),
            vec![Action::Uncordon {
                node: "worker-1".into(),
            }],
        ),
    ];
    for (now, actions) in cases {
        let decision = decide(&rebooting, &settings(), &obs, now);
        assert_eq!(
            decision.report.state,
            RunState::InProgress,
            "{}",
            decision.report.message
        );
        assert_eq!(decision.actions, actions);
    }
    // Late: uncordoned first, then failed.
    let late = decide(
        &rebooting,
        &settings(),
        &obs,
        t0() + 25.minutes() + 1.seconds(),
    );
    let failed = uncordoned_then(
        &late,
        &mut obs,
        "worker-1",
        t0() + 25.minutes() + 5.seconds(),
    );
    assert_eq!(failed.report.state, RunState::Failed);
    assert_eq!(failed.actions, vec![]);
}

#[test]
fn a_refused_call_uncordons_only_a_node_without_a_pending_install() {
    let (run, _) = draining_run();
    let mut refused = run.clone();
    // Installed and being drained: the new system boots at the next reboot, so the node stays
    // cordoned and the failure says so.
    assert_eq!(
        fail_node(&mut refused, "worker-1", "refused the reboot: boom", t0()),
        None
    );
    assert_eq!(refused.failed_nodes(), vec!["worker-1"]);
    assert!(
        refused
            .failure()
            .is_some_and(|reason| reason.contains("is installed and boots at its next reboot")),
        "{refused:?}"
    );

    let obs = cluster("1.13.0");
    let fresh = workers_first("1.14.0", &obs);
    let mut installing = decide(&fresh, &settings(), &obs, t0()).run;
    assert_eq!(
        fail_node(
            &mut installing,
            "worker-1",
            "refused the installation",
            t0()
        ),
        None,
        "a node that was never cordoned needs no uncordon"
    );
}

#[test]
fn an_upgrade_call_without_an_answer_is_made_again_only_if_the_node_never_got_it() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let issued = decide(&run, &settings(), &obs, t0()).run;
    assert!(matches!(
        issued.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Issued {
            unanswered: true,
            ..
        })
    ));

    // Within the grace period nothing is made again, whatever the node looks like.
    let early = decide(&issued, &settings(), &obs, t0() + 30.seconds());
    assert!(early.actions.is_empty(), "{:?}", early.actions);

    // The node got the call: it is upgrading (not ready), then rebooted: never called twice.
    let mut upgrading = obs.clone();
    set(&mut upgrading, "worker-1", |n| {
        if let TalosState::Up { ready, .. } = &mut n.talos {
            *ready = false;
        }
    });
    let later = decide(&issued, &settings(), &upgrading, t0() + 2.minutes());
    assert!(later.actions.is_empty(), "{:?}", later.actions);
    let mut back = obs.clone();
    rebooted(&mut back, "worker-1", "1.12.0", true);
    let done = decide(&later.run, &settings(), &back, t0() + 3.minutes());
    assert!(matches!(
        done.run.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Done { .. })
    ));
    assert_eq!(upgraded_nodes(&done.actions), vec!["worker-2"]);

    // The node never got it: same boot, running and ready past the grace: the call is made again.
    let again = decide(&issued, &settings(), &obs, t0() + 2.minutes());
    assert_eq!(upgraded_nodes(&again.actions), vec!["worker-1"]);

    // An answered call is never made again, even if the node looks untouched.
    let mut answered_run = issued.clone();
    answered(&mut answered_run, "worker-1");
    let waiting = decide(&answered_run, &settings(), &obs, t0() + 2.minutes());
    assert!(waiting.actions.is_empty(), "{:?}", waiting.actions);
}

#[test]
fn only_nodes_waiting_for_their_reboot_let_the_reconciler_rely_on_following_them() {
    // Legacy path: recorded before the call (its answer not yet seen), then answered.
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let recorded = decide(&run, &settings(), &obs, t0()).run;
    let mut answered_run = recorded.clone();
    answered(&mut answered_run, "worker-1");
    let mut worker_1_down = obs.clone();
    down(&mut worker_1_down, "worker-1");
    // Talos >= 1.13: installing, draining, rebooting.
    let obs_13 = cluster("1.13.0");
    let run_13 = workers_first("1.14.0", &obs_13);
    let installing = decide(&run_13, &settings(), &obs_13, t0()).run;
    let (draining_run, mut drained_obs) = draining_run();
    drain(&mut drained_obs, "worker-1", 0, None);
    let rebooting_unanswered = decide(&draining_run, &settings(), &drained_obs, t0()).run;
    let mut rebooting = rebooting_unanswered.clone();
    answered(&mut rebooting, "worker-1");
    let mut rebooting_down = drained_obs.clone();
    down(&mut rebooting_down, "worker-1");
    // A node in flight that is back on the target and ready is done: nothing is awaited any more.
    let mut worker_1_back = obs.clone();
    rebooted(&mut worker_1_back, "worker-1", "1.12.0", true);

    // (case, run, observation, awaiting reboots only?)
    let cases: [(&str, &Run, &Observation, bool); 8] = [
        ("nothing in flight yet", &run, &obs, false),
        ("legacy call unanswered", &recorded, &worker_1_down, false),
        ("legacy call answered", &answered_run, &worker_1_down, true),
        ("1.13 installing", &installing, &obs_13, false),
        ("1.13 draining", &draining_run, &obs_13, false),
        (
            "1.13 reboot unanswered",
            &rebooting_unanswered,
            &rebooting_down,
            false,
        ),
        ("1.13 reboot answered", &rebooting, &rebooting_down, true),
        ("the node came back", &answered_run, &worker_1_back, false),
    ];
    for (case, run, observation, expected) in cases {
        let decision = decide(run, &settings(), observation, t0() + 1.minutes());
        assert_eq!(decision.report.awaiting_reboots, expected, "{case}");
    }

    // The decisions that send the calls: awaiting only once their calls are answered (the legacy
    // upgrade and the 1.13 reboot), never for the 1.13 install (draining comes next).
    // (case, run, observation, actions, awaiting now?, once answered?)
    let sending: [(&str, &Run, &Observation, &str, bool, bool); 3] = [
        ("legacy upgrade sent", &run, &obs, "Upgrade", false, true),
        ("1.13 install sent", &run_13, &obs_13, "Pull", false, false),
        (
            "1.13 reboot sent",
            &draining_run,
            &drained_obs,
            "Reboot",
            false,
            true,
        ),
    ];
    for (case, run, observation, action, now, once_answered) in sending {
        let decision = decide(run, &settings(), observation, t0());
        let sent: Vec<String> = decision
            .actions
            .iter()
            .map(|action| format!("{action:?}"))
            .collect();
        assert!(
            sent.iter().any(|sent| sent.starts_with(action)),
            "{case}: {sent:?}"
        );
        assert_eq!(decision.report.awaiting_reboots, now, "{case}");
        assert_eq!(
            decision.report.awaiting_reboots_once_answered, once_answered,
            "{case}"
        );
    }

    // Two workers allowed in parallel, the second held back by its own failing preflight check: the
    // run waits on something no follower reports, so it is not only awaiting reboots.
    let parallel = Settings {
        max_parallel_workers: 2,
        ..settings()
    };
    let mut both_down = worker_1_down.clone();
    down(&mut both_down, "worker-2");
    let decision = decide(&answered_run, &parallel, &both_down, t0() + 1.minutes());
    assert_eq!(decision.report.in_flight, vec!["worker-1"]);
    assert!(decision.actions.is_empty(), "{:?}", decision.actions);
    assert!(!decision.report.awaiting_reboots);
}

#[test]
fn only_the_nodes_that_may_start_next_need_their_machine_config() {
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let recorded = decide(&run, &settings(), &obs, t0()).run;
    let mut answered_run = recorded.clone();
    answered(&mut answered_run, "worker-1");
    let mut workers_done = workers_done("1.12.0", &obs);
    workers_done.gates.prepull.done_at = Some(t0());
    let paused = Settings {
        paused: true,
        ..settings()
    };
    let mut finished = run.clone();
    finished.outcome = Some(Outcome::Completed { at: t0() });
    let mut prepulled = run.clone();
    prepulled.gates.prepull.done_at = Some(t0());

    let mut held = prepulled.clone();
    held.gates.held.insert("worker-1".to_string());
    let two_workers = Settings {
        max_parallel_workers: 2,
        ..settings()
    };
    let mut cp_1_done = workers_done.clone();
    assert_eq!(cp_1_done.nodes[2].name, "cp-1");
    cp_1_done.nodes[2].step = NodeStep::Done {
        at: t0(),
        started_at: None,
    };

    // (case, run, settings, nodes whose machine config is read)
    let cases: [(&str, &Run, &Settings, &[&str]); 10] = [
        // The pre-pull pulls on every node the run upgrades, each with its own installer.
        (
            "a fresh run, before its pre-pull",
            &run,
            &settings(),
            &["worker-1", "worker-2", "cp-1", "cp-2", "cp-3"],
        ),
        // The batch has room for one: the next worker only (one the look finds on the target
        // already is passed over when the pass decides, `starting` in kind.rs).
        ("a fresh run", &prepulled, &settings(), &["worker-1"]),
        (
            "a fresh run, two workers at a time",
            &prepulled,
            &two_workers,
            &["worker-1", "worker-2"],
        ),
        // Held as recorded, or unheld since: either may be next.
        (
            "worker-1 held",
            &held,
            &settings(),
            &["worker-1", "worker-2"],
        ),
        // worker-1 may come back in this very pass, and worker-2 start in the same decision.
        (
            "worker-1 in flight",
            &answered_run,
            &settings(),
            &["worker-2"],
        ),
        // A call without an answer may be taken back and made again.
        (
            "worker-1's call unanswered",
            &recorded,
            &settings(),
            &["worker-1", "worker-2"],
        ),
        // Control planes one at a time: the next only.
        ("the workers done", &workers_done, &settings(), &["cp-1"]),
        ("cp-1 done", &cp_1_done, &settings(), &["cp-2"]),
        ("paused", &run, &paused, &[]),
        ("finished", &finished, &settings(), &[]),
    ];
    for (case, run, settings, expected) in cases {
        assert_eq!(may_start(run, settings), expected, "{case}");
    }

    // A node the run would start whose config was not read is held, never failed.
    let mut unread = obs.clone();
    set(&mut unread, "worker-1", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = None;
        }
    });
    let held = decide(&run, &settings(), &unread, t0());
    assert!(held.actions.is_empty(), "{:?}", held.actions);
    assert_eq!(held.report.state, RunState::InProgress);
    assert_eq!(
        held.report.message,
        "Waiting: node worker-1's machine config was not read; holding before upgrading it (0/5 done)"
    );
}

/// A 1.13 run with every worker done and cp-1 installed and draining.
fn control_plane_draining() -> (Run, Observation) {
    let obs = cluster("1.13.0");
    let run = workers_done("1.14.0", &obs);
    let mut run = installing(&run, "cp-1", &obs);
    installed(&mut run, "cp-1", false, t0());
    (run, obs)
}

#[test]
fn a_drained_control_plane_reboots_only_with_etcd_healthy_and_leadership_off_it() {
    // Explorer seed 2141: cp-3 went down while cp-1 drained; rebooting cp-1 then took two down.
    let (run, mut obs) = control_plane_draining();
    assert_eq!(draining(&run), vec!["cp-1"]);
    drain(&mut obs, "cp-1", 0, None);
    down(&mut obs, "cp-3");
    obs.etcd.problem = Some("control plane cp-3 does not answer for etcd".into());
    let held = decide(&run, &settings(), &obs, t0() + 10.minutes());
    assert_eq!(held.actions, vec![]);
    assert!(
        held.report.message.contains(
            "cp-1 is drained; holding its reboot: etcd is not healthy (control plane cp-3 does not \
             answer for etcd)"
        ),
        "{}",
        held.report.message
    );
    // A drain that is done is not timed out while it holds.
    assert_eq!(held.report.state, RunState::InProgress);

    // etcd healthy again, but cp-1 leads now: leadership moves first, then the reboot.
    rebooted(&mut obs, "cp-3", "1.13.0", true);
    obs.etcd = EtcdObservation {
        problem: None,
        leader: Some("cp-1".into()),
    };
    let moving = decide(&run, &settings(), &obs, t0() + 11.minutes());
    assert_eq!(
        moving.actions,
        vec![Action::ForfeitEtcdLeadership {
            node: "cp-1".into()
        }]
    );
    obs.etcd.leader = Some("cp-2".into());
    let rebooting = decide(&run, &settings(), &obs, t0() + 11.minutes());
    assert_eq!(
        rebooting.actions,
        vec![Action::Reboot {
            node: "cp-1".into()
        }]
    );
}

#[test]
fn a_node_not_started_that_leaves_the_node_list_is_dropped_from_the_run() {
    // Explorer seed 147: the run waited for ever for a node that was gone.
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let mut gone = obs.clone();
    gone.nodes.retain(|n| n.name != "worker-2");
    let decision = decide(&run, &settings(), &gone, t0());
    assert!(decision.run.node("worker-2").is_none());
    assert_eq!(decision.report.total, 4);
    assert_eq!(upgraded_nodes(&decision.actions), vec!["worker-1"]);
    assert!(
        decision.report.notes.iter().any(|n| n.reason == Reason::NodeLeft
            && n.message
                == "Node worker-2 is no longer in the cluster's node list; the run goes on without it"),
        "{:?}",
        decision.report.notes
    );
}

/// A pull or install refused for a reason that may pass (a registry that did not answer, an installer
/// exit code worth retrying) is made again after `retry_after`, saying so, until the node's deadline;
/// past it the node fails with the last attempt's reason, never having been rebooted.
#[test]
fn a_retryable_failure_is_retried_within_the_node_deadline_then_fails_with_its_reason() {
    use crate::lifecycle::Kind as _;
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);

    // The pull: made again after retry_after, not before.
    let pull = decide(&run, &settings(), &obs, t0());
    let mut pull_failed = pull.run.clone();
    assert!(Talos::retry(
        &mut pull_failed,
        &pull.actions[0],
        "registry answered 503",
        t0()
    ));
    let soon = decide(&pull_failed, &settings(), &obs, t0() + 10.seconds());
    assert_eq!(soon.actions, vec![]);
    assert!(
        soon.report
            .message
            .contains("worker-1's installer pull failed (registry answered 503), tried 1 time; trying again until"),
        "{}",
        soon.report.message
    );
    let later = decide(&pull_failed, &settings(), &obs, t0() + 31.seconds());
    assert_eq!(later.actions, pull.actions);
    let retried: Vec<&str> = later
        .report
        .notes
        .iter()
        .filter(|n| n.reason == Reason::NodeInstallRetried)
        .map(|n| n.message.as_str())
        .collect();
    assert_eq!(retried.len(), 1, "{:?}", later.report.notes);
    assert!(
        retried[0].starts_with("Node worker-1: registry answered 503; trying again (attempt 2"),
        "{}",
        retried[0]
    );
    assert!(
        soon.report
            .notes
            .iter()
            .all(|n| n.reason != Reason::NodeInstallRetried),
        "not announced while waiting"
    );

    // The install: made again (it never made its system the boot default), counted.
    let mut run = pull.run.clone();
    pulled(&mut run, "worker-1");
    let install = decide(&run, &settings(), &obs, t0() + 1.minutes());
    let mut failed = install.run.clone();
    let reason = "installer exited with code 5 (a dependency failed)";
    assert!(Talos::retry(
        &mut failed,
        &install.actions[0],
        reason,
        t0() + 1.minutes()
    ));
    let held = decide(&failed, &settings(), &obs, t0() + 1.minutes() + 5.seconds());
    assert_eq!(held.actions, vec![]);
    assert_eq!(held.report.state, RunState::InProgress);
    let again = decide(&failed, &settings(), &obs, t0() + 2.minutes());
    assert_eq!(again.actions, install.actions);
    let mut twice = again.run.clone();
    assert!(Talos::retry(
        &mut twice,
        &again.actions[0],
        reason,
        t0() + 2.minutes()
    ));
    let Some(LifecycleStage::Installing {
        retry: true,
        failed: Some(attempt),
    }) = lifecycle_stage(&twice, "worker-1")
    else {
        panic!("{:?}", lifecycle_stage(&twice, "worker-1"));
    };
    assert_eq!(attempt.failures, 2);

    // Past the node's deadline: the node fails, with the installer's reason, and nothing is called.
    let late = decide(&twice, &settings(), &obs, t0() + DEADLINE + 1.minutes());
    assert_eq!(late.actions, vec![]);
    assert_eq!(late.report.state, RunState::Failed);
    assert!(
        late.report
            .message
            .contains(&format!("(the last attempt: {reason})"))
            && late.report.message.contains("runs its old version"),
        "{}",
        late.report.message
    );

    // A legacy upgrade call has no exit code to classify: the run has no retry for it.
    let legacy_obs = cluster("1.12.0");
    let legacy = decide(
        &workers_first("1.13.0", &legacy_obs),
        &settings(),
        &legacy_obs,
        t0(),
    );
    let mut legacy_run = legacy.run.clone();
    assert!(!Talos::retry(
        &mut legacy_run,
        &legacy.actions[0],
        reason,
        t0()
    ));
}

/// The cluster's only node (tuppr#310): nowhere to move its pods, so after its install it is neither
/// cordoned nor drained (no drain pass is asked for) but rebooted at once, saying why; it is not
/// uncordoned afterwards, since it never was cordoned.
#[test]
fn the_only_node_of_a_cluster_is_rebooted_without_a_drain() {
    use crate::lifecycle::Kind as _;
    let mut obs = cluster("1.13.0");
    obs.nodes.retain(|n| n.name == "cp-1");
    let run = workers_first("1.13.1", &obs);
    let mut run = decide(&run, &settings(), &obs, t0()).run;
    pulled(&mut run, "cp-1");
    let install = decide(&run, &settings(), &obs, t0());
    let mut installed_run = install.run.clone();
    installed(&mut installed_run, "cp-1", false, t0());
    assert!(
        Talos::before_deciding(&installed_run, &settings(), &obs)
            .iter()
            .all(|further| !matches!(further, Further::Drain(_))),
        "no drain pass for the only node"
    );
    let reboot = decide(&installed_run, &settings(), &obs, t0() + 1.seconds());
    assert_eq!(
        reboot.actions,
        vec![Action::Reboot {
            node: "cp-1".into()
        }]
    );
    assert!(matches!(
        lifecycle_stage(&reboot.run, "cp-1"),
        Some(LifecycleStage::Rebooting {
            uncordon: false,
            ..
        })
    ));
    let said: Vec<&str> = reboot
        .report
        .notes
        .iter()
        .filter(|n| n.reason == Reason::NodeDrained)
        .map(|n| n.message.as_str())
        .collect();
    assert_eq!(
        said,
        [
            "Node cp-1 is the cluster's only node: no other node can take its pods, so it is not \
          drained; rebooting it into Talos 1.13.1, and its pods restart with it"
        ]
    );

    // With a second node, the same install is followed by a drain.
    let two = cluster("1.13.0");
    let mut two_run = workers_first("1.13.1", &two);
    two_run = decide(&two_run, &settings(), &two, t0()).run;
    pulled(&mut two_run, "worker-1");
    two_run = decide(&two_run, &settings(), &two, t0()).run;
    installed(&mut two_run, "worker-1", false, t0());
    assert!(
        Talos::before_deciding(&two_run, &settings(), &two)
            .iter()
            .any(|further| matches!(further, Further::Drain(_)))
    );
}

/// At the start every node's install source is read: every node no installer can be chosen for is
/// named at once, and the run fails before the first call to any node, not after the nodes before
/// them in the order were upgraded.
#[test]
fn nodes_without_an_installer_fail_the_run_before_any_call_all_named() {
    let mut obs = cluster("1.13.0");
    for name in ["worker-2", "cp-3"] {
        set(&mut obs, name, |n| {
            if let TalosState::Up { install, .. } = &mut n.talos {
                *install = Some(InstallSource::new("no-tag-here", Some("metal")));
            }
        });
    }
    let run = workers_first("1.13.1", &obs);
    let decision = decide(&run, &settings(), &obs, t0());
    assert_eq!(decision.actions, vec![]);
    assert_eq!(decision.report.state, RunState::Failed);
    let mut failed = decision.report.failed_nodes.clone();
    failed.sort();
    assert_eq!(failed, ["cp-3", "worker-2"]);
    assert!(
        decision
            .report
            .message
            .contains("node worker-2 has an installer image")
            && decision
                .report
                .message
                .contains("node cp-3 has an installer image"),
        "{}",
        decision.report.message
    );
    // A node whose source was not read (a run under way reads only those it may start) is not judged.
    let mut unread = obs.clone();
    set(&mut unread, "cp-3", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = None;
        }
    });
    set(&mut unread, "worker-2", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = None;
        }
    });
    let going = decide(&run, &settings(), &unread, t0());
    assert_eq!(going.report.state, RunState::InProgress);
    assert_eq!(going.actions.len(), 1, "{:?}", going.actions);
}

// ----- the operator's gates before each node (issue #23) -----

fn with_gates(gates: crate::holds::GateSettings) -> Settings {
    Settings {
        gates,
        ..settings()
    }
}

/// A workers-first run with worker-1 upgraded (done at t0 + 1m) and the rest pending.
fn worker_1_done(obs: &Observation) -> Run {
    let mut run = workers_first("1.12.0", obs);
    run.nodes[0].step = NodeStep::Done {
        at: t0() + 1.minutes(),
        started_at: Some(t0()),
    };
    run
}

#[test]
fn held_nodes_are_skipped_announced_once_and_left_out_when_only_they_remain() {
    let mut obs = cluster("1.11.6");
    obs.gates.held_nodes = ["worker-1".to_string()].into();
    let run = workers_first("1.12.0", &obs);
    let first = decide(&run, &settings(), &obs, t0());
    assert_eq!(upgraded_nodes(&first.actions), ["worker-2"]);
    let held: Vec<&Note> = first
        .report
        .notes
        .iter()
        .filter(|n| n.reason == Reason::NodeHeld)
        .collect();
    assert_eq!(held.len(), 1);
    assert!(
        held[0].message.starts_with("Node worker-1 is held"),
        "{}",
        held[0].message
    );
    assert!(first.run.gates.held.contains("worker-1"));
    // Once per run.
    let again = decide(&first.run, &settings(), &obs, t0() + 1.seconds());
    assert!(
        again
            .report
            .notes
            .iter()
            .all(|n| n.reason != Reason::NodeHeld)
    );

    // Every other node done: the run completes without worker-1, naming it.
    let mut done = first.run.clone();
    for n in done.nodes.iter_mut().filter(|n| n.name != "worker-1") {
        n.step = NodeStep::Done {
            at: t0(),
            started_at: Some(t0()),
        };
    }
    let end = decide(&done, &settings(), &obs, t0() + 1.hours());
    assert_eq!(end.report.state, RunState::Completed);
    assert_eq!(
        end.report.message,
        "Talos upgrade completed: now running 1.12.0; held and not upgraded: worker-1 (remove \
         upgrade.vitistack.io/hold to upgrade it)"
    );
    assert!(
        end.report
            .notes
            .iter()
            .any(|n| n.reason == Reason::UpgradeCompleted && n.message.contains("worker-1")),
        "{:?}",
        end.report.notes
    );
    assert_eq!(names(&end.run), ["worker-2", "cp-1", "cp-2", "cp-3"]);
    assert!(end.run.gates.skipped.contains("worker-1"));

    // Unheld later: taken in like a node that joined, while still held it is not.
    let mut reopened = end.run.clone();
    assert!(<Talos as crate::lifecycle::Kind>::join(&mut reopened, &obs, false, t0()).is_empty());
    obs.gates.held_nodes.clear();
    let notes = <Talos as crate::lifecycle::Kind>::join(&mut reopened, &obs, false, t0());
    assert_eq!(notes.len(), 1);
    assert_eq!(
        notes[0].message,
        "Node worker-1 is no longer held; upgrading it from Talos 1.11.6 to 1.12.0"
    );
    assert!(reopened.outcome.is_none() && reopened.gates.skipped.is_empty());
}

#[test]
fn a_held_worker_does_not_keep_the_control_planes_waiting() {
    let mut obs = cluster("1.11.6");
    obs.gates.held_nodes = ["worker-2".to_string()].into();
    let run = worker_1_done(&obs);
    let decision = decide(&run, &settings(), &obs, t0() + 2.minutes());
    assert_eq!(upgraded_nodes(&decision.actions), ["cp-1"]);
}

#[test]
fn a_soak_holds_the_next_node_until_it_ends() {
    let obs = cluster("1.11.6");
    let soak = with_gates(crate::holds::GateSettings {
        soak_after_node: Some(Duration::from_secs(600)),
        ..Default::default()
    });
    let run = worker_1_done(&obs);
    let held = decide(&run, &soak, &obs, t0() + 5.minutes());
    assert!(held.actions.is_empty());
    assert_eq!(
        held.report.message,
        "Waiting: soaking after node worker-1 until 2026-11-25 10:11:00 UTC (1/5 done)"
    );
    let hold = held.report.gate.expect("a gate holds");
    assert_eq!(hold.gate, crate::holds::Gate::Soak);
    assert_eq!(hold.until, Some(t0() + 11.minutes()));
    let going = decide(&run, &soak, &obs, t0() + 11.minutes());
    assert_eq!(upgraded_nodes(&going.actions), ["worker-2"]);
}

#[test]
fn control_planes_first_soak_after_the_control_planes_before_the_first_worker() {
    let obs = cluster("1.11.6");
    let settings = Settings {
        order: UpgradeOrder::ControlPlanesFirst,
        ..with_gates(crate::holds::GateSettings {
            soak_after_control_planes: Some(Duration::from_secs(1800)),
            ..Default::default()
        })
    };
    let mut run = start_run(
        "1.12.0",
        &v("1.12.0"),
        UpgradeOrder::ControlPlanesFirst,
        &obs,
        t0(),
    );
    for n in run
        .nodes
        .iter_mut()
        .filter(|n| n.role == NodeRole::ControlPlane)
    {
        n.step = NodeStep::Done {
            at: t0() + 10.minutes(),
            started_at: Some(t0()),
        };
    }
    let held = decide(&run, &settings, &obs, t0() + 20.minutes());
    assert_eq!(
        held.report.message,
        "Waiting: soaking after the control planes until 2026-11-25 10:40:00 UTC (3/5 done)"
    );
    let going = decide(&run, &settings, &obs, t0() + 40.minutes());
    assert_eq!(upgraded_nodes(&going.actions), ["worker-1"]);
}

#[test]
fn the_canary_pauses_once_after_n_nodes_until_resumed_or_unpaused() {
    let obs = cluster("1.11.6");
    let canary = crate::holds::GateSettings {
        pause_after_nodes: std::num::NonZeroU32::new(1),
        ..Default::default()
    };
    let run = worker_1_done(&obs);
    let paused = decide(&run, &with_gates(canary.clone()), &obs, t0() + 2.minutes());
    assert!(paused.actions.is_empty());
    assert_eq!(paused.report.state, RunState::Paused);
    assert!(
        paused.report.message.starts_with(
            "Paused by the canary pause after 1 upgraded node: check the cluster, then set \
             upgrade.vitistack.io/resume"
        ),
        "{}",
        paused.report.message
    );
    assert!(paused.report.message.ends_with("(1/5 done)"));
    // Still held on the next pass; the user pauses (no node starts either way), then unpauses.
    let still = decide(
        &paused.run,
        &with_gates(canary.clone()),
        &obs,
        t0() + 3.minutes(),
    );
    assert!(still.actions.is_empty());
    let user_paused = Settings {
        paused: true,
        ..with_gates(canary.clone())
    };
    let pausing = decide(&still.run, &user_paused, &obs, t0() + 4.minutes());
    let unpaused = decide(
        &pausing.run,
        &with_gates(canary.clone()),
        &obs,
        t0() + 5.minutes(),
    );
    assert_eq!(upgraded_nodes(&unpaused.actions), ["worker-2"]);
    assert!(matches!(
        unpaused.run.gates.canary,
        Some(crate::holds::Canary::Released { .. })
    ));
    // Or resume releases it.
    let resumed = decide(
        &still.run,
        &with_gates(crate::holds::GateSettings {
            resume: true,
            ..canary.clone()
        }),
        &obs,
        t0() + 4.minutes(),
    );
    assert_eq!(upgraded_nodes(&resumed.actions), ["worker-2"]);
    // Once per run: after it, more nodes go on.
    let mut later = unpaused.run.clone();
    later.nodes[1].step = NodeStep::Done {
        at: t0() + 6.minutes(),
        started_at: Some(t0() + 5.minutes()),
    };
    let next = decide(&later, &with_gates(canary), &obs, t0() + 7.minutes());
    assert_eq!(upgraded_nodes(&next.actions), ["cp-1"]);
}

#[test]
fn outside_a_window_no_node_starts_unless_forced_once() {
    let obs = cluster("1.11.6");
    // t0 is Wednesday 10:00 UTC, outside 22:00-02:00 Oslo time.
    let windows = crate::holds::GateSettings {
        maintenance_window: Some(
            crate::holds::MaintenanceWindows::parse("Mon-Fri 22:00 4h Europe/Oslo")
                .expect("windows"),
        ),
        ..Default::default()
    };
    let run = workers_first("1.12.0", &obs);
    let held = decide(&run, &with_gates(windows.clone()), &obs, t0());
    assert!(held.actions.is_empty());
    assert_eq!(
        held.report.message,
        "Waiting: outside the maintenance window (Mon-Fri 22:00 4h Europe/Oslo); the next opens \
         at Wed 2026-11-25 22:00 Europe/Oslo (2026-11-25 21:00:00 UTC) (0/5 done)"
    );
    assert_eq!(
        held.report.gate.and_then(|hold| hold.until),
        Some("2026-11-25T21:00:00Z".parse().expect("time"))
    );
    assert!(held.report.consumed.is_empty());
    // Inside the window it goes.
    let inside = decide(
        &run,
        &with_gates(windows.clone()),
        &obs,
        "2026-11-25T21:00:00Z".parse().expect("time"),
    );
    assert_eq!(upgraded_nodes(&inside.actions), ["worker-1"]);

    let forced = decide(
        &run,
        &with_gates(crate::holds::GateSettings {
            force_start: true,
            ..windows.clone()
        }),
        &obs,
        t0(),
    );
    assert_eq!(upgraded_nodes(&forced.actions), ["worker-1"]);
    assert_eq!(forced.run.gates.force_started_at, Some(t0()));
    assert_eq!(forced.report.consumed, [crate::annotations::FORCE_START]);
    assert!(
        forced
            .report
            .notes
            .iter()
            .any(|n| n.reason == Reason::MaintenanceWindowOverridden),
        "{:?}",
        forced.report.notes
    );
    // Taken in: the run goes on outside the windows without the annotation.
    let mut next = forced.run.clone();
    next.nodes[0].step = NodeStep::Done {
        at: t0() + 1.minutes(),
        started_at: Some(t0()),
    };
    let after = decide(&next, &with_gates(windows), &obs, t0() + 2.minutes());
    assert_eq!(upgraded_nodes(&after.actions), ["worker-2"]);
}

// ----- the pre-pull (issue 23 item 6) -----

fn prepulled_nodes(actions: &[Action]) -> Vec<(&str, UpgradeApi)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::PrePull { node, api, .. } => Some((node.as_str(), *api)),
            _ => None,
        })
        .collect()
}

/// Which nodes pull before the run disrupts any, with which API: every node the run upgrades (not
/// those on the target, not the held ones), each with its own installer; nothing while paused.
#[test]
fn the_pre_pull_pulls_on_every_node_the_run_upgrades_first() {
    use UpgradeApi::{Legacy, Lifecycle};
    let mut on_target = cluster("1.13.0");
    rebooted(&mut on_target, "cp-3", "1.14.0", true);
    let mut held = cluster("1.13.0");
    held.gates.held_nodes.insert("worker-2".into());
    let mut mixed = cluster("1.12.4");
    set(&mut mixed, "worker-1", |n| {
        n.talos = TalosState::Up {
            version: v("1.13.0"),
            boot_id: "worker-1-boot-1".into(),
            ready: true,
            install: Some(InstallSource::new(
                "registry.local/installer:v1.13.0",
                Some("metal"),
            )),
        }
    });
    let paused = Settings {
        paused: true,
        ..settings()
    };
    let all_13 = [
        ("worker-1", Lifecycle),
        ("worker-2", Lifecycle),
        ("cp-1", Lifecycle),
        ("cp-2", Lifecycle),
        ("cp-3", Lifecycle),
    ];
    // (case, observation, target, settings, pulls)
    type Case<'a> = (
        &'a str,
        Observation,
        &'a str,
        Settings,
        Vec<(&'a str, UpgradeApi)>,
    );
    let cases: [Case; 5] = [
        (
            "1.13 -> 1.14",
            cluster("1.13.0"),
            "1.14.0",
            settings(),
            all_13.to_vec(),
        ),
        (
            "a node on the target",
            on_target,
            "1.14.0",
            settings(),
            all_13[..4].to_vec(),
        ),
        (
            "a held node",
            held,
            "1.14.0",
            settings(),
            vec![
                ("worker-1", Lifecycle),
                ("cp-1", Lifecycle),
                ("cp-2", Lifecycle),
                ("cp-3", Lifecycle),
            ],
        ),
        (
            "1.12 nodes check with the legacy pull",
            mixed,
            "1.13.1",
            settings(),
            vec![
                ("worker-1", Lifecycle),
                ("worker-2", Legacy),
                ("cp-1", Legacy),
                ("cp-2", Legacy),
                ("cp-3", Legacy),
            ],
        ),
        ("paused", cluster("1.13.0"), "1.14.0", paused, vec![]),
    ];
    for (case, obs, target, settings, pulls) in cases {
        let run = workers_first(target, &obs);
        let decision = decide_with_prepull(&run, &settings, &obs, t0());
        assert_eq!(prepulled_nodes(&decision.actions), pulls, "{case}");
        assert!(
            decision
                .actions
                .iter()
                .all(|a| matches!(a, Action::PrePull { .. })),
            "{case}: {:?}",
            decision.actions
        );
        assert!(decision.report.in_flight.is_empty(), "{case}");
        if !pulls.is_empty() {
            assert_eq!(decision.report.state, RunState::InProgress, "{case}");
            assert!(
                decision.report.message.starts_with("Pulling ")
                    && decision.report.message.contains(&format!(
                        "on {} nodes before upgrading any (0/{} pulled)",
                        pulls.len(),
                        pulls.len()
                    )),
                "{case}: {}",
                decision.report.message
            );
        }
    }
    // Each node pulls its own installer (the image its upgrade uses).
    let mut mixed_images = cluster("1.13.0");
    set(&mut mixed_images, "cp-1", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = Some(InstallSource::new("mirror.local/installer:v1.13.0", None));
        }
    });
    let run = workers_first("1.14.0", &mixed_images);
    let decision = decide_with_prepull(&run, &settings(), &mixed_images, t0());
    let images: Vec<&str> = decision
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::PrePull {
                node,
                installer_image,
                ..
            } if node == "cp-1" || node == "cp-2" => Some(installer_image.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        images,
        [
            "mirror.local/installer:v1.14.0",
            "factory.talos.dev/installer/abc123:v1.14.0"
        ]
    );
    assert!(
        decision
            .report
            .message
            .starts_with("Pulling the installer images on 5 nodes"),
        "{}",
        decision.report.message
    );
}

/// Once every node pulled, the first node starts in the same decision, with the `InstallerPulled`
/// Event; a restarted controller pulls again only what is not recorded as pulled, and starts nothing
/// before.
#[test]
fn the_first_node_starts_only_once_every_pull_is_recorded() {
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);
    let first = decide_with_prepull(&run, &settings(), &obs, t0());
    assert_eq!(prepulled_nodes(&first.actions).len(), 5);
    // Three answered, then the controller restarted: the two others are made again, nothing else.
    let mut restarted = first.run.clone();
    for node in ["worker-1", "cp-1", "cp-3"] {
        restarted.gates.prepull.pulled(node, t0());
    }
    let again = decide_with_prepull(&restarted, &settings(), &obs, t0() + 1.minute());
    assert_eq!(
        prepulled_nodes(&again.actions),
        [
            ("worker-2", UpgradeApi::Lifecycle),
            ("cp-2", UpgradeApi::Lifecycle)
        ]
    );
    assert_eq!(
        again.report.message,
        "Pulling factory.talos.dev/installer/abc123:v1.14.0 on 5 nodes before upgrading any (3/5 pulled)"
    );
    let mut pulled = again.run.clone();
    for node in ["worker-2", "cp-2"] {
        pulled.gates.prepull.pulled(node, t0());
    }
    let start = decide_with_prepull(&pulled, &settings(), &obs, t0() + 2.minutes());
    assert!(start.run.gates.prepull.is_done());
    assert_eq!(upgraded_nodes(&start.actions), ["worker-1"]);
    assert_eq!(
        start
            .report
            .notes
            .iter()
            .map(|n| n.reason)
            .collect::<Vec<_>>(),
        [Reason::InstallerPulled, Reason::NodeUpgradeStarted]
    );
    assert_eq!(
        start.report.notes[0].message,
        "Installer factory.talos.dev/installer/abc123:v1.14.0 pulled on 5 nodes; upgrading them to Talos 1.14.0"
    );
    // Pulled a moment ago: worker-1 is installed at once, with no second pull.
    assert!(
        matches!(
            &start.actions[..],
            [Action::Upgrade {
                node,
                api: UpgradeApi::Lifecycle,
                ..
            }] if node == "worker-1"
        ),
        "{:?}",
        start.actions
    );
    assert!(matches!(
        lifecycle_stage(&start.run, "worker-1"),
        Some(LifecycleStage::Installing {
            retry: false,
            failed: None
        })
    ));
    // Pulled longer ago than Talos keeps an unused image for sure: it pulls again first.
    let late = decide_with_prepull(&pulled, &settings(), &obs, t0() + 45.minutes());
    assert!(
        matches!(&late.actions[..], [Action::Pull { node, .. }] if node == "worker-1"),
        "{:?}",
        late.actions
    );
    // A node that joins after the pre-pull pulls before its own upgrade, as before.
    assert_eq!(
        prepulled_nodes(&decide_with_prepull(&start.run, &settings(), &obs, t0()).actions),
        []
    );
}

/// A pull refused for good, or failing [`crate::prepull::ATTEMPTS`] times, fails the run naming
/// the node and the registry's answer, with no node started; `resume` pulls again on that node only
/// and then goes on.
#[test]
fn a_node_that_cannot_pull_fails_the_run_before_any_node_starts_and_resume_pulls_again() {
    use crate::lifecycle::Kind as _;
    let obs = cluster("1.13.0");
    let run = workers_first("1.14.0", &obs);
    let first = decide_with_prepull(&run, &settings(), &obs, t0());
    let pull = |node: &str| {
        first
            .actions
            .iter()
            .find(|a| a.node() == node)
            .cloned()
            .expect("a pull")
    };
    let answer = "rpc error: code = NotFound desc = error pulling image: failed to pull image \
                  \"factory.talos.dev/installer/abc123:v1.14.0\": not found";

    // Refused for good.
    let mut refused = first.run.clone();
    refused.gates.prepull.pulled("worker-1", t0());
    let cleanup = Talos::refused(&mut refused, &pull("worker-2"), answer, t0());
    assert!(cleanup.is_empty());
    let failed = decide_with_prepull(&refused, &settings(), &obs, t0());
    assert_eq!(failed.report.state, RunState::Failed);
    assert_eq!(failed.report.failed_nodes, ["worker-2"]);
    assert_eq!(
        failed.report.message,
        format!(
            "Talos upgrade failed: node worker-2 could not pull its installer \
             factory.talos.dev/installer/abc123:v1.14.0: {answer}; the run stopped before upgrading \
             any node (none was cordoned or rebooted): fix the image or the registry, then set \
             resume to pull again"
        )
    );
    assert!(failed.actions.is_empty());
    assert!(
        failed
            .run
            .nodes
            .iter()
            .all(|n| matches!(n.step, NodeStep::Pending | NodeStep::Failed { .. }))
    );

    // A failure that may pass: retried after the retry interval, then the run fails on the third.
    let mut flaky = first.run.clone();
    let cp = pull("cp-1");
    assert!(Talos::retry(&mut flaky, &cp, "Unavailable: no route", t0()));
    let waiting = decide_with_prepull(&flaky, &settings(), &obs, t0() + 10.seconds());
    assert!(
        prepulled_nodes(&waiting.actions)
            .iter()
            .all(|(n, _)| *n != "cp-1")
    );
    assert!(
        waiting
            .report
            .message
            .contains("cp-1's pull failed (Unavailable: no route), tried 1 of 3 times; trying again at 10:00:30 UTC"),
        "{}",
        waiting.report.message
    );
    let retried = decide_with_prepull(&flaky, &settings(), &obs, t0() + 31.seconds());
    assert!(prepulled_nodes(&retried.actions).contains(&("cp-1", UpgradeApi::Lifecycle)));
    assert!(
        retried
            .report
            .notes
            .iter()
            .any(|n| n.reason == Reason::NodeInstallRetried && n.message.contains("attempt 2 of 3"))
    );
    assert!(Talos::retry(&mut flaky, &cp, "Unavailable: no route", t0()));
    assert!(!Talos::retry(
        &mut flaky,
        &cp,
        "Unavailable: no route",
        t0()
    ));
    Talos::refused(&mut flaky, &cp, "Unavailable: no route", t0());
    let failed = decide_with_prepull(&flaky, &settings(), &obs, t0());
    assert!(
        failed
            .report
            .message
            .contains("node cp-1 could not pull its installer factory.talos.dev/installer/abc123:v1.14.0 (tried 3 times): Unavailable: no route"),
        "{}",
        failed.report.message
    );

    // resume: only worker-2 pulls again (worker-1's pull is kept, the others were never answered
    // and are made again), and no node starts before.
    let mut resumed = refused.clone();
    for node in ["cp-1", "cp-2", "cp-3"] {
        resumed.gates.prepull.pulled(node, t0());
    }
    Talos::resume(&mut resumed, t0() + 5.minutes());
    let again = decide_with_prepull(&resumed, &settings(), &obs, t0() + 5.minutes());
    assert_eq!(
        prepulled_nodes(&again.actions),
        [("worker-2", UpgradeApi::Lifecycle)]
    );
    assert_eq!(again.report.state, RunState::InProgress);
}

// ----- the etcd snapshot before the first control plane (issue 24 item 3) -----

fn snapshotting() -> Settings {
    Settings {
        etcd_snapshot: true,
        ..settings()
    }
}

fn stored() -> crate::etcd_snapshot::Stored {
    crate::etcd_snapshot::Stored {
        location: "file:///snapshots/default/c1/20261129T020000Z-talos-1.12.0.snapshot".into(),
        size: 262_176,
        sha256: "5e".repeat(32),
    }
}

/// Where the first control plane would start, the snapshot comes first: from a healthy follower, the
/// call recorded before it is made; nothing when it is not asked for, or not yet the control planes'
/// turn, or before the checks that hold a control plane anyway.
#[test]
fn the_snapshot_is_taken_where_the_first_control_plane_would_start() {
    use crate::etcd_snapshot::Snapshot;
    struct Case {
        name: &'static str,
        order: UpgradeOrder,
        workers_done: bool,
        snapshot: bool,
        change: fn(&mut Observation),
        actions: Vec<Action>,
        message: &'static str,
    }
    let snap = |node: &str| Action::EtcdSnapshot { node: node.into() };
    let cases = [
        Case {
            name: "workers done: from the first follower by name",
            order: UpgradeOrder::WorkersFirst,
            workers_done: true,
            snapshot: true,
            change: |_| {},
            actions: vec![snap("cp-1")],
            message: "Taking an etcd snapshot from cp-1 before upgrading control plane cp-1",
        },
        Case {
            name: "control planes first: before the very first node",
            order: UpgradeOrder::ControlPlanesFirst,
            workers_done: false,
            snapshot: true,
            change: |_| {},
            actions: vec![snap("cp-1")],
            message: "Taking an etcd snapshot from cp-1 before upgrading control plane cp-1",
        },
        Case {
            name: "workers first: the workers start without one",
            order: UpgradeOrder::WorkersFirst,
            workers_done: false,
            snapshot: true,
            change: |_| {},
            actions: vec![Action::Upgrade {
                node: "worker-1".into(),
                installer_image: "factory.talos.dev/installer/abc123:v1.12.0".into(),
                api: UpgradeApi::Legacy,
            }],
            message: "Upgrading node worker-1 (1/5)",
        },
        Case {
            name: "not asked for: the control plane starts",
            order: UpgradeOrder::WorkersFirst,
            workers_done: true,
            snapshot: false,
            change: |_| {},
            actions: vec![Action::Upgrade {
                node: "cp-1".into(),
                installer_image: "factory.talos.dev/installer/abc123:v1.12.0".into(),
                api: UpgradeApi::Legacy,
            }],
            message: "Upgrading node cp-1 (3/5)",
        },
        Case {
            name: "etcd unhealthy: the control planes' own hold comes first",
            order: UpgradeOrder::WorkersFirst,
            workers_done: true,
            snapshot: true,
            change: |obs| obs.etcd.problem = Some("member cp-2 is unhealthy".into()),
            actions: vec![],
            message: "Waiting: etcd is not healthy (member cp-2 is unhealthy); holding before \
                      control plane cp-1 (2/5 done)",
        },
        Case {
            name: "the first control plane is the leader: leadership moves first",
            order: UpgradeOrder::WorkersFirst,
            workers_done: true,
            snapshot: true,
            change: |obs| obs.etcd.leader = Some("cp-1".into()),
            actions: vec![Action::ForfeitEtcdLeadership {
                node: "cp-1".into(),
            }],
            message: "Waiting: moving etcd leadership off cp-1 before upgrading it (2/5 done)",
        },
    ];
    for case in cases {
        let mut obs = cluster("1.11.6");
        (case.change)(&mut obs);
        let mut run = start_run("1.12.0", &v("1.12.0"), case.order, &obs, t0());
        if case.workers_done {
            run = workers_done("1.12.0", &obs);
        }
        let settings = if case.snapshot {
            snapshotting()
        } else {
            settings()
        };
        let decision = decide(&run, &settings, &obs, t0());
        assert_eq!(decision.actions, case.actions, "{}", case.name);
        assert_eq!(decision.report.message, case.message, "{}", case.name);
        let taking = matches!(
            &decision.run.gates.etcd_snapshot,
            Some(Snapshot::Taking { node, at }) if node == "cp-1" && *at == t0()
        );
        let wants_snapshot = case
            .actions
            .iter()
            .any(|a| matches!(a, Action::EtcdSnapshot { .. }));
        assert_eq!(
            taking, wants_snapshot,
            "{}: recorded before the call",
            case.name
        );
        // No control plane was touched by any of these decisions.
        assert!(
            decision
                .run
                .nodes
                .iter()
                .filter(|n| n.role == NodeRole::ControlPlane)
                .all(|n| case.name.starts_with("not asked") || matches!(n.step, NodeStep::Pending)),
            "{}",
            case.name
        );
    }
}

/// Stored and verified: the first control plane starts in the same pass, and where the snapshot went
/// is announced once. A call found recorded but unanswered is made again.
#[test]
fn a_stored_snapshot_lets_the_first_control_plane_start_and_is_announced_once() {
    use crate::etcd_snapshot::Snapshot;
    use crate::lifecycle::{Answered, Kind as _};
    let obs = cluster("1.11.6");
    let run = workers_done("1.12.0", &obs);
    let first = decide(&run, &snapshotting(), &obs, t0());
    let action = first.actions[0].clone();

    // Unanswered (the controller stopped during it): taken again, from the same node.
    let again = decide(&first.run, &snapshotting(), &obs, t0() + 10.seconds());
    assert_eq!(again.actions, vec![action.clone()]);

    let mut answered = first.run.clone();
    let next = Talos::stored(&mut answered, &action, &stored(), &obs, t0() + 5.seconds());
    assert_eq!(next, Answered::DecideAgain);
    let started = decide(&answered, &snapshotting(), &obs, t0() + 5.seconds());
    assert_eq!(upgraded_nodes(&started.actions), vec!["cp-1"]);
    let taken: Vec<&str> = started
        .report
        .notes
        .iter()
        .filter(|n| n.reason == Reason::EtcdSnapshotTaken)
        .map(|n| n.message.as_str())
        .collect();
    assert_eq!(
        taken,
        vec![format!(
            "etcd snapshot from cp-1 stored at \
             file:///snapshots/default/c1/20261129T020000Z-talos-1.12.0.snapshot (262176 bytes, \
             sha256 {}); upgrading the control planes",
            "5e".repeat(32)
        )]
    );
    assert!(matches!(
        &started.run.gates.etcd_snapshot,
        Some(Snapshot::Taken { node, announced: true, stored: s, .. }) if node == "cp-1" && *s == stored()
    ));
    // The next control plane needs none, and nothing is announced twice.
    let mut later = started.run.clone();
    for n in later.nodes.iter_mut().filter(|n| n.name == "cp-1") {
        n.step = NodeStep::Done {
            at: t0(),
            started_at: Some(t0()),
        };
    }
    let second = decide(&later, &snapshotting(), &obs, t0() + 10.minutes());
    assert_eq!(upgraded_nodes(&second.actions), vec!["cp-2"]);
    assert!(
        second
            .report
            .notes
            .iter()
            .all(|n| n.reason != Reason::EtcdSnapshotTaken)
    );
}

/// A snapshot that failed or could not be verified fails the run before any control plane, naming
/// the node it was taken from; no node is marked failed; `resume` takes it again.
#[test]
fn a_failed_snapshot_fails_the_run_before_any_control_plane_and_resume_takes_it_again() {
    use crate::lifecycle::Kind as _;
    let obs = cluster("1.11.6");
    let run = workers_done("1.12.0", &obs);
    let first = decide(&run, &snapshotting(), &obs, t0());
    let mut failed = first.run.clone();
    let cleanup = Talos::refused(
        &mut failed,
        &first.actions[0],
        "the stored snapshot is 131088 bytes and lacks the SHA-256 etcd appends (cut short?)",
        t0(),
    );
    assert!(cleanup.is_empty());
    let decision = decide(&failed, &snapshotting(), &obs, t0());
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        "Talos upgrade failed: the etcd snapshot from control plane cp-1 failed: the stored \
         snapshot is 131088 bytes and lacks the SHA-256 etcd appends (cut short?); the run stopped \
         before upgrading any control plane (none was touched): fix the node or the snapshot \
         destination, then set resume to take it again"
    );
    assert!(decision.report.failed_nodes.is_empty());
    assert!(decision.actions.is_empty());
    assert!(
        failed
            .nodes
            .iter()
            .filter(|n| n.role == NodeRole::ControlPlane)
            .all(|n| matches!(n.step, NodeStep::Pending))
    );

    Talos::resume(&mut failed, t0() + 1.minutes());
    let resumed = decide(&failed, &snapshotting(), &obs, t0() + 1.minutes());
    assert_eq!(
        resumed.actions,
        vec![Action::EtcdSnapshot {
            node: "cp-1".into()
        }]
    );
}

#[test]
fn a_pass_looks_only_at_the_nodes_in_flight_while_nothing_else_can_change_its_decision() {
    use crate::lifecycle::Kind;
    let obs = cluster("1.11.6");
    let run = workers_first("1.12.0", &obs);
    let recorded = decide(&run, &settings(), &obs, t0()).run;
    let mut answered_run = recorded.clone();
    answered(&mut answered_run, "worker-1");
    // Talos >= 1.13: installing, draining, rebooting.
    let obs_13 = cluster("1.13.0");
    let installing = decide(
        &workers_first("1.14.0", &obs_13),
        &settings(),
        &obs_13,
        t0(),
    )
    .run;
    let (draining_run, mut drained_obs) = draining_run();
    drain(&mut drained_obs, "worker-1", 0, None);
    let rebooting_unanswered = decide(&draining_run, &settings(), &drained_obs, t0()).run;
    let mut rebooting = rebooting_unanswered.clone();
    answered(&mut rebooting, "worker-1");
    // A control plane in flight (the workers done): one at a time, etcd asked with it.
    let mut cp_answered = decide(&workers_done("1.12.0", &obs), &settings(), &obs, t0()).run;
    for node in ["cp-1", "cp-2", "cp-3"] {
        answered(&mut cp_answered, node);
    }
    let parallel = Settings {
        max_parallel_workers: 2,
        ..settings()
    };
    let paused = Settings {
        paused: true,
        ..settings()
    };
    // worker-2 was held (and announced): unheld, it could start beside worker-1.
    let mut held_waiting = answered_run.clone();
    held_waiting.gates.held.insert("worker-2".into());
    let mut finished = answered_run.clone();
    finished.outcome = Some(Outcome::Completed { at: t0() });

    // (case, run, settings, only the nodes in flight are asked)
    let cases: [(&str, &Run, &Settings, bool); 12] = [
        ("nothing in flight yet", &run, &settings(), false),
        // It may be taken back and called again.
        ("legacy call unanswered", &recorded, &settings(), false),
        ("legacy call answered", &answered_run, &settings(), true),
        ("1.13 installing", &installing, &settings(), false),
        ("1.13 draining", &draining_run, &settings(), false),
        (
            "1.13 reboot unanswered",
            &rebooting_unanswered,
            &settings(),
            false,
        ),
        ("1.13 reboot answered", &rebooting, &settings(), true),
        ("a control plane rebooting", &cp_answered, &settings(), true),
        // Room for worker-2 beside worker-1: it may start in this pass.
        ("room in the batch", &answered_run, &parallel, false),
        ("room in the batch, paused", &answered_run, &paused, true),
        ("a held node waiting", &held_waiting, &settings(), false),
        ("finished", &finished, &settings(), false),
    ];
    for (case, run, settings, expected) in cases {
        assert_eq!(only_in_flight_may_change(run, settings), expected, "{case}");
        let request = Talos::request(Some(run), settings);
        if expected {
            assert_eq!(
                request,
                StartingNodes::InFlight {
                    nodes: run.in_flight()
                },
                "{case}"
            );
        } else {
            assert!(
                !matches!(request, StartingNodes::InFlight { .. }),
                "{case}: {request:?}"
            );
        }
    }
}

#[test]
fn a_look_at_the_nodes_in_flight_is_followed_by_one_at_everything_once_one_is_back() {
    use crate::lifecycle::Kind;
    let obs = cluster("1.11.6");
    let mut run = decide(&workers_first("1.12.0", &obs), &settings(), &obs, t0()).run;
    answered(&mut run, "worker-1");
    let in_flight_only = |change: &dyn Fn(&mut Observation)| {
        let mut look = obs.clone();
        look.scope = Scope::InFlight;
        change(&mut look);
        look
    };
    let refresh = || {
        vec![Further::Refresh(StartingNodes::Named(vec![
            "worker-2".to_string(),
        ]))]
    };
    // (case, observation, further work before deciding)
    let cases: [(&str, Observation, Vec<Further>); 6] = [
        ("down", in_flight_only(&|o| down(o, "worker-1")), vec![]),
        // The legacy install runs before the reboot.
        ("not rebooted yet", in_flight_only(&|_| {}), vec![]),
        (
            "back, not ready yet",
            in_flight_only(&|o| rebooted(o, "worker-1", "1.12.0", false)),
            vec![],
        ),
        (
            "back on the target and ready",
            in_flight_only(&|o| rebooted(o, "worker-1", "1.12.0", true)),
            refresh(),
        ),
        // The run fails: looked at in full first.
        (
            "back on its old version",
            in_flight_only(&|o| rebooted(o, "worker-1", "1.11.6", true)),
            refresh(),
        ),
        // A look at everything goes on as before: worker-2's image is read (it may start once
        // worker-1 is back).
        (
            "a look at everything",
            {
                let mut look = obs.clone();
                rebooted(&mut look, "worker-1", "1.12.0", true);
                look.nodes[4].talos = TalosState::Up {
                    version: v("1.11.6"),
                    boot_id: "worker-2-boot-1".into(),
                    ready: true,
                    install: None,
                };
                look
            },
            vec![Further::InstallerImages(vec!["worker-2".to_string()])],
        ),
    ];
    for (case, observation, expected) in cases {
        assert_eq!(
            Talos::before_deciding(&run, &settings(), &observation),
            expected,
            "{case}"
        );
    }

    // The look at everything replaces the look at the nodes in flight; one that could not be
    // made leaves every node unreachable, so that nothing moves on in that pass.
    let mut look = in_flight_only(&|o| rebooted(o, "worker-1", "1.12.0", true));
    let mut everything = obs.clone();
    rebooted(&mut everything, "worker-1", "1.12.0", true);
    Talos::merge(&mut look, FurtherLooked::Refreshed(Ok(everything.clone())));
    assert_eq!(look, everything);
    Talos::merge(&mut look, FurtherLooked::Refreshed(Err("gone".into())));
    assert_eq!(look.scope, Scope::Everything);
    assert!(
        look.nodes
            .iter()
            .all(|n| matches!(&n.talos, TalosState::Unreachable { reason } if reason == "gone"))
    );
    let decision = decide(&run, &settings(), &look, t0() + 1.minutes());
    assert!(decision.actions.is_empty(), "{:?}", decision.actions);
    assert_eq!(decision.run.outcome, None);
}

#[test]
fn a_next_node_found_on_the_target_has_the_one_after_it_read_before_deciding() {
    use crate::lifecycle::Kind;
    let obs = cluster("1.11.6");
    let mut run = workers_first("1.12.0", &obs);
    run.gates.prepull.done_at = Some(t0());
    // The pass asked worker-1's machine config only (the batch holds one worker) ...
    assert_eq!(
        Talos::request(Some(&run), &settings()),
        StartingNodes::Named(vec!["worker-1".into()])
    );
    // ... and found it upgraded by hand: the pass counts it done and starts worker-2, whose config
    // is read before deciding rather than held for a pass later.
    let mut look = obs.clone();
    set(&mut look, "worker-1", |n| {
        if let TalosState::Up { version, .. } = &mut n.talos {
            *version = v("1.12.0");
        }
    });
    set(&mut look, "worker-2", |n| {
        if let TalosState::Up { install, .. } = &mut n.talos {
            *install = None;
        }
    });
    assert_eq!(
        Talos::before_deciding(&run, &settings(), &look),
        vec![Further::InstallerImages(vec!["worker-2".to_string()])]
    );
    let read = obs.node("worker-2").unwrap().talos.clone();
    Talos::merge(
        &mut look,
        FurtherLooked::InstallerImages(vec![(
            "worker-2".to_string(),
            match read {
                TalosState::Up { install, .. } => Ok(install.unwrap()),
                TalosState::Unreachable { reason } => Err(reason),
            },
        )]),
    );
    let decision = decide(&run, &settings(), &look, t0());
    assert_eq!(decision.run.nodes[0].name, "worker-1");
    assert!(matches!(decision.run.nodes[0].step, NodeStep::Done { .. }));
    assert!(
        matches!(decision.run.nodes[1].step, NodeStep::Issued { .. }),
        "{:?}",
        decision.report.message
    );
}

#[test]
fn a_look_without_etcd_is_followed_by_one_at_etcd_where_a_control_plane_may_need_it() {
    use crate::lifecycle::Kind;
    let obs = cluster("1.11.6");
    let mut without_etcd = obs.clone();
    without_etcd.scope = Scope::WithoutEtcd;
    // Past its pre-pull (which reads every node's installer, control planes' too).
    let mut run = workers_first("1.12.0", &obs);
    run.gates.prepull.done_at = Some(t0());
    let workers_done = workers_done("1.12.0", &obs);
    let mut cp_in_flight = decide(&workers_done, &settings(), &obs, t0()).run;
    // The last control plane in flight: none is left to start.
    for node in ["cp-1", "cp-2"] {
        set_step(
            &mut cp_in_flight,
            node,
            NodeStep::Done {
                at: t0(),
                started_at: Some(t0()),
            },
        );
    }
    answered(&mut cp_in_flight, "cp-3");
    let mut finished = workers_done.clone();
    finished.outcome = Some(Outcome::Completed { at: t0() });
    // In its pre-pull, every node's installer is read, but only the next node may start.
    let prepulling = workers_first("1.12.0", &obs);
    let control_planes_first = start_run(
        "1.12.0",
        &v("1.12.0"),
        UpgradeOrder::ControlPlanesFirst,
        &obs,
        t0(),
    );

    // (case, run, observation, etcd looked at before deciding?)
    let cases: [(&str, &Run, &Observation, bool); 7] = [
        ("the workers go first", &run, &without_etcd, false),
        ("in the pre-pull", &prepulling, &without_etcd, false),
        (
            "control planes first, in the pre-pull",
            &control_planes_first,
            &without_etcd,
            true,
        ),
        (
            "a control plane may start",
            &workers_done,
            &without_etcd,
            true,
        ),
        (
            "a control plane in flight",
            &cp_in_flight,
            &without_etcd,
            true,
        ),
        ("a finished run", &finished, &without_etcd, false),
        ("etcd was looked at", &workers_done, &obs, false),
    ];
    for (case, run, observation, etcd) in cases {
        let further = Talos::before_deciding(run, &settings(), observation);
        assert_eq!(
            further.contains(&Further::Etcd),
            etcd,
            "{case}: {further:?}"
        );
    }

    // The look at etcd completes the look.
    let mut look = without_etcd.clone();
    Talos::merge(&mut look, FurtherLooked::Etcd(obs.etcd.clone()));
    assert_eq!(look, obs);
}

fn set_step(run: &mut Run, name: &str, step: NodeStep) {
    run.nodes
        .iter_mut()
        .find(|n| n.name == name)
        .expect("node in run")
        .step = step;
}
