//! The rollback's rules, table by table: what `talos-rollback` reads as, which nodes a rollback
//! takes (or why it is refused), the decisions of a whole rollback, and the lifecycle around it.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::{Timestamp, ToSpan};
use semver::Version;

use super::*;
use crate::annotations::{self, UpgradeStatus};
use crate::catalog::Catalog;
use crate::gates::Gates;
use crate::intent::UpgradeIntent;
use crate::lifecycle::{Called, Conclusion, Inputs, Kind, Lifecycle, Limits, Look, Step};
use crate::talos::tests::{down, set};
use crate::talos::{EtcdObservation, InstallSource, PendingInstall, Talos};
use crate::versions::{KubernetesVersion, TalosVersion};

fn t0() -> Timestamp {
    "2026-11-28T10:00:00Z".parse().expect("timestamp")
}

fn settings() -> Settings {
    Settings {
        paused: false,
        ..Talos::stopping(&Limits::default())
    }
}

fn node(name: &str, role: NodeRole, version: &str, boot: u32) -> NodeObservation {
    NodeObservation {
        name: name.into(),
        role,
        talos: TalosState::Up {
            version: Version::parse(version).expect("version"),
            boot_id: format!("{name}-boot-{boot}"),
            ready: true,
            install: Some(InstallSource::new(
                format!("ghcr.io/siderolabs/installer:v{version}"),
                Some("metal"),
            )),
        },
        kubernetes_ready: true,
        cordoned: false,
        drain: None,
        kubelet_version: Some(KubernetesVersion::new(1, 34, 1)),
    }
}

/// Two control planes and two workers on 1.12.0 after the last run (boot 2), cp-1 leading etcd.
fn upgraded_cluster() -> Observation {
    Observation {
        nodes: vec![
            node("cp-1", NodeRole::ControlPlane, "1.12.0", 2),
            node("cp-2", NodeRole::ControlPlane, "1.12.0", 2),
            node("w-1", NodeRole::Worker, "1.12.0", 2),
            node("w-2", NodeRole::Worker, "1.12.0", 2),
        ],
        etcd: EtcdObservation {
            problem: None,
            leader: Some("cp-1".into()),
        },
        gates: Default::default(),
        scope: Default::default(),
    }
}

fn boot(obs: &mut Observation, name: &str, version: &str, boot: u32, ready: bool) {
    set(obs, name, |n| {
        let role = n.role;
        *n = node(name, role, version, boot);
        if let TalosState::Up { ready: r, .. } = &mut n.talos {
            *r = ready;
        }
        n.kubernetes_ready = ready;
    });
}

fn done(started: bool) -> NodeStep {
    NodeStep::Done {
        at: t0() - 30.minutes(),
        started_at: started.then(|| t0() - 40.minutes()),
    }
}

fn failed() -> NodeStep {
    NodeStep::Failed {
        at: t0() - 30.minutes(),
        reason: "did not become Ready within 15m".into(),
        installed: None,
    }
}

/// The last run to 1.12.0: every node upgraded from 1.11.6 except as `steps` says.
fn last_run(steps: &[(&str, NodeRole, NodeStep)], outcome: Outcome) -> Run {
    Run {
        requested: "1.12.0".into(),
        target: "1.12.0".into(),
        started_at: t0() - 1.hours(),
        outcome: Some(outcome),
        gates: Default::default(),
        previous: steps
            .iter()
            .filter(|(_, _, step)| !matches!(step, NodeStep::Pending))
            .map(|(name, _, _)| (name.to_string(), "1.11.6".to_string()))
            .collect(),
        rollback: None,
        nodes: steps
            .iter()
            .map(|(name, role, step)| NodeProgress {
                name: name.to_string(),
                role: *role,
                step: step.clone(),
            })
            .collect(),
    }
}

fn completed_run() -> Run {
    last_run(
        &[
            ("w-1", NodeRole::Worker, done(true)),
            ("w-2", NodeRole::Worker, done(true)),
            ("cp-1", NodeRole::ControlPlane, done(true)),
            ("cp-2", NodeRole::ControlPlane, done(true)),
        ],
        Outcome::Completed {
            at: t0() - 10.minutes(),
        },
    )
}

fn failed_run() -> Run {
    last_run(
        &[
            ("w-1", NodeRole::Worker, done(true)),
            ("w-2", NodeRole::Worker, failed()),
            ("cp-1", NodeRole::ControlPlane, NodeStep::Pending),
            ("cp-2", NodeRole::ControlPlane, NodeStep::Pending),
        ],
        Outcome::Failed {
            at: t0() - 10.minutes(),
            node: Some("w-2".into()),
            reason: "node w-2 did not become Ready within 15m".into(),
        },
    )
}

#[test]
fn the_annotation_reads_as_failed_run_or_node_names() {
    let nodes =
        |names: &[&str]| RollbackRequest::Nodes(names.iter().map(|n| n.to_string()).collect());
    let cases: [(&str, Result<RollbackRequest, ()>); 8] = [
        ("failed", Ok(RollbackRequest::Failed)),
        (" run ", Ok(RollbackRequest::Run)),
        ("w-1", Ok(nodes(&["w-1"]))),
        ("w-1, cp-2", Ok(nodes(&["w-1", "cp-2"]))),
        ("", Err(())),
        ("w-1,,w-2", Err(())),
        ("Failed!", Err(())),
        ("all nodes", Err(())),
    ];
    for (text, expected) in cases {
        assert_eq!(
            RollbackRequest::parse(text).map_err(|_| ()),
            expected,
            "{text:?}"
        );
    }
    let why = RollbackRequest::parse("yes please").expect_err("invalid");
    assert!(why.contains("use failed"), "{why}");
}

#[test]
fn a_rollback_takes_the_nodes_asked_for_or_is_refused_with_the_reason() {
    let obs = upgraded_cluster();
    let mut fallback = failed_run();
    // w-2 fell back to its old slot: it runs its previous version already.
    let mut on_old = obs.clone();
    boot(&mut on_old, "w-2", "1.11.6", 3, true);
    let pending = |boot_id: &str| NodeStep::Failed {
        at: t0(),
        reason: "could not be drained within 5m".into(),
        installed: Some(PendingInstall {
            boot_id: boot_id.into(),
            from_version: "1.11.6".into(),
            installer_image: "ghcr.io/siderolabs/installer:v1.12.0".into(),
            uncordon: true,
        }),
    };
    let with_pending = last_run(
        &[("w-1", NodeRole::Worker, pending("w-1-boot-2"))],
        Outcome::Failed {
            at: t0(),
            node: Some("w-1".into()),
            reason: "drain".into(),
        },
    );
    let mut unrecorded = completed_run();
    unrecorded.previous.remove("cp-2");
    let mut rolled_back = completed_run();
    rolled_back.rollback = Some(Rollback {
        asked: "run".into(),
        from: "1.12.0".into(),
        to: BTreeMap::new(),
    });
    fallback.outcome = failed_run().outcome;
    let refused_target = <Run as crate::run::Record>::refused("1.12.0", "refused", t0());
    type Case<'a> = (
        &'a str,
        Run,
        &'a str,
        &'a Observation,
        Result<&'a [(&'a str, bool)], &'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "failed: the failed node only",
            failed_run(),
            "failed",
            &obs,
            Ok(&[("w-2", false)]),
        ),
        (
            "run: failed and upgraded, workers first",
            failed_run(),
            "run",
            &obs,
            Ok(&[("w-1", false), ("w-2", false)]),
        ),
        (
            "a whole completed run, workers then control planes",
            completed_run(),
            "run",
            &obs,
            Ok(&[
                ("w-1", false),
                ("w-2", false),
                ("cp-1", false),
                ("cp-2", false),
            ]),
        ),
        (
            "named nodes, in the run's order",
            completed_run(),
            "cp-2,w-1",
            &obs,
            Ok(&[("w-1", false), ("cp-2", false)]),
        ),
        (
            "a name written twice is one node",
            completed_run(),
            "w-1, w-1",
            &obs,
            Ok(&[("w-1", false)]),
        ),
        (
            "a node back on its old version is done at once",
            failed_run(),
            "failed",
            &on_old,
            Ok(&[("w-2", true)]),
        ),
        (
            "an unknown node",
            completed_run(),
            "w-1,w-9",
            &obs,
            Err("unknown node w-9: not in the cluster's node list"),
        ),
        (
            "a node the run did not upgrade",
            failed_run(),
            "cp-1",
            &obs,
            Err(
                "node cp-1 was not upgraded by the last Talos run (to 1.12.0), so it has no previous system to go back to",
            ),
        ),
        (
            "failed, but nothing failed",
            completed_run(),
            "failed",
            &obs,
            Err(
                "the last Talos run (to 1.12.0) has no failed node; use run to roll back the nodes it upgraded, or name them",
            ),
        ),
        (
            "no previous version recorded",
            unrecorded,
            "cp-2",
            &obs,
            Err(
                "node cp-2 has no previous Talos version recorded by the last run, so it has no previous system to go back to",
            ),
        ),
        (
            "a rollback is not rolled back",
            rolled_back,
            "run",
            &obs,
            Err(
                "the last Talos run was itself a rollback (of run) off Talos 1.12.0; change talos-target to upgrade again",
            ),
        ),
        (
            "a refused target touched nothing",
            refused_target,
            "run",
            &obs,
            Err(
                "the last Talos run (talos-target 1.12.0) touched no node, so there is nothing to roll back",
            ),
        ),
        (
            "installed, never booted",
            with_pending,
            "failed",
            &obs,
            Err(
                "node w-1 never booted Talos 1.12.0: it runs Talos 1.11.6 with Talos 1.12.0 installed for its next reboot, so there is nothing to roll back (set resume to finish its upgrade, or reset the Talos upgrade state)",
            ),
        ),
    ];
    for (case, last, asked, obs, expected) in cases {
        let request = RollbackRequest::parse(asked).expect("request");
        let started = start(
            &last,
            &request,
            asked,
            UpgradeOrder::WorkersFirst,
            obs,
            t0(),
        );
        match (started, expected) {
            (Ok((run, sentence)), Ok(expected)) => {
                let got: Vec<(&str, bool)> = run
                    .nodes
                    .iter()
                    .map(|n| (n.name.as_str(), matches!(n.step, NodeStep::Done { .. })))
                    .collect();
                assert_eq!(got, expected, "{case}");
                let rollback = run.rollback.as_ref().expect("a rollback run");
                assert!(
                    expected.iter().all(|(n, _)| rollback.to[*n] == "1.11.6"),
                    "{case}"
                );
                assert_eq!(
                    run.requested, last.requested,
                    "{case}: the target stays decided"
                );
                assert!(sentence.starts_with("Rolling back"), "{case}: {sentence}");
            }
            (Err(why), Err(expected)) => assert_eq!(why, expected, "{case}"),
            (got, expected) => panic!("{case}: got {got:?}, expected {expected:?}"),
        }
    }
}

/// Drives the rollback of the whole completed run as the cluster answers, and checks every promise:
/// one call per node, recorded before it is made, one node down at a time, workers first, leadership
/// moved off a control plane first, done only on a new boot of the previous version, ready.
#[test]
fn a_whole_run_rolls_back_one_node_at_a_time_with_one_call_each() {
    let mut obs = upgraded_cluster();
    let request = RollbackRequest::Run;
    let (mut run, _) = start(
        &completed_run(),
        &request,
        "run",
        UpgradeOrder::WorkersFirst,
        &obs,
        t0(),
    )
    .expect("started");
    let settings = settings();
    let mut calls: Vec<String> = Vec::new();
    let mut events = Vec::new();
    let mut now = t0();
    for _ in 0..40 {
        let decision = Talos::advance(&run, &settings, &obs, now);
        events.extend(decision.report.notes.iter().map(|n| n.reason));
        run = decision.run;
        if run.outcome.is_some() {
            assert_eq!(decision.report.state, RunState::Completed);
            assert_eq!(
                decision.report.message,
                "Talos rollback completed: 4 nodes back on Talos 1.11.6 (rolled back from 1.12.0: \
                 run); talos-target 1.12.0 stays decided: change it to upgrade again"
            );
            break;
        }
        let mut boots = Vec::new();
        for action in &decision.actions {
            match action {
                Action::Rollback { node } => {
                    // Recorded (as issued) before it is made.
                    assert!(matches!(
                        run.node(node).map(|n| &n.step),
                        Some(NodeStep::Issued { .. })
                    ));
                    assert_eq!(
                        decision.report.message,
                        format!(
                            "Rolling back 4 nodes to Talos 1.11.6: {node} rebooting ({}/4 done)",
                            calls.iter().filter(|c| !c.starts_with("forfeit")).count()
                        )
                    );
                    calls.push(node.clone());
                    crate::talos::answered(&mut run, node);
                    boots.push(node.clone());
                }
                Action::ForfeitEtcdLeadership { node } => {
                    calls.push(format!("forfeit {node}"));
                    obs.etcd.leader = Some(if node == "cp-1" { "cp-2" } else { "cp-1" }.into());
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        // The node goes down, then comes back on its previous version.
        for name in &boots {
            down(&mut obs, name);
            let down_now = obs
                .nodes
                .iter()
                .filter(|n| matches!(n.talos, TalosState::Unreachable { .. }))
                .count();
            assert_eq!(down_now, 1, "one node down at a time");
        }
        now += 1.minutes();
        for name in obs
            .nodes
            .iter()
            .filter(|n| matches!(n.talos, TalosState::Unreachable { .. }))
            .map(|n| n.name.clone())
            .collect::<Vec<_>>()
        {
            boot(&mut obs, &name, "1.11.6", 3, true);
        }
    }
    assert_eq!(
        calls,
        ["w-1", "w-2", "forfeit cp-1", "cp-1", "forfeit cp-2", "cp-2"],
        "workers first, leadership off each control plane before its call, one call per node"
    );
    assert!(run.nodes.iter().all(|n| matches!(
        n.step,
        NodeStep::Done {
            started_at: Some(_),
            ..
        }
    )));
    assert_eq!(
        events
            .iter()
            .filter(|r| **r == Reason::NodeRollbackStarted)
            .count(),
        4
    );
    assert_eq!(
        events
            .iter()
            .filter(|r| **r == Reason::NodeRolledBack)
            .count(),
        4
    );
    assert_eq!(events.last(), Some(&Reason::RollbackCompleted));
    // Decided again, the completed rollback announces nothing and calls nothing.
    let again = Talos::advance(&run, &settings, &Observation::default(), now);
    assert!(again.actions.is_empty() && again.report.notes.is_empty());
    assert_eq!(again.report.state, RunState::Completed);
}

/// One node in flight, and what each look at it decides.
#[test]
fn a_node_in_flight_is_done_waits_fails_or_is_called_again_only_if_it_never_got_the_call() {
    let obs = upgraded_cluster();
    let (run, _) = start(
        &completed_run(),
        &RollbackRequest::Nodes(vec!["w-1".into()]),
        "w-1",
        UpgradeOrder::WorkersFirst,
        &obs,
        t0(),
    )
    .expect("started");
    let first = Talos::advance(&run, &settings(), &obs, t0());
    assert_eq!(first.actions, vec![Action::Rollback { node: "w-1".into() }]);
    let issued = first.run;
    let mut answered_run = issued.clone();
    crate::talos::answered(&mut answered_run, "w-1");
    let grace = settings().unanswered_grace;
    let deadline = settings().node_deadline;
    let later =
        |d: Duration| t0() + jiff::SignedDuration::try_from(d).expect("duration") + 1.seconds();
    type Look = fn(&mut Observation);
    type Case<'a> = (
        &'a str,
        &'a Run,
        Look,
        Timestamp,
        Result<bool, &'a str>,
        usize,
    );
    let cases: Vec<Case> = vec![
        // (case, run, the look, when, Ok(done?) or Err(failure), Rollback calls)
        (
            "back on its previous version, ready: done",
            &answered_run,
            |o| boot(o, "w-1", "1.11.6", 3, true),
            t0() + 2.minutes(),
            Ok(true),
            0,
        ),
        (
            "back, not Ready yet: waits",
            &answered_run,
            |o| boot(o, "w-1", "1.11.6", 3, false),
            t0() + 2.minutes(),
            Ok(false),
            0,
        ),
        (
            "down: waits",
            &answered_run,
            |o| down(o, "w-1"),
            t0() + 2.minutes(),
            Ok(false),
            0,
        ),
        (
            "back on another version: fails",
            &answered_run,
            |o| boot(o, "w-1", "1.12.0", 3, true),
            t0() + 2.minutes(),
            Err(
                "node w-1 came back on Talos 1.12.0 instead of 1.11.6: the rollback did not take; it was not rolled back again",
            ),
            0,
        ),
        (
            "down past the deadline: fails",
            &answered_run,
            |o| down(o, "w-1"),
            later(deadline),
            Err("node w-1 did not come back online within 15m"),
            0,
        ),
        (
            "same boot past the deadline: fails",
            &answered_run,
            |_| {},
            later(deadline),
            Err("node w-1 did not reboot into its previous system within 15m"),
            0,
        ),
        (
            "answered, same boot, past the grace: never called again",
            &answered_run,
            |_| {},
            later(grace),
            Ok(false),
            0,
        ),
        (
            "unanswered, same boot, ready, past the grace: it never got it",
            &issued,
            |_| {},
            later(grace),
            Ok(false),
            1,
        ),
        (
            "unanswered, within the grace: waits",
            &issued,
            |_| {},
            t0() + 10.seconds(),
            Ok(false),
            0,
        ),
        (
            "unanswered, down: it got it",
            &issued,
            |o| down(o, "w-1"),
            later(grace),
            Ok(false),
            0,
        ),
    ];
    for (case, run, look, now, expected, calls) in cases {
        let mut seen = obs.clone();
        look(&mut seen);
        let decision = Talos::advance(run, &settings(), &seen, now);
        let rollbacks = decision
            .actions
            .iter()
            .filter(|a| matches!(a, Action::Rollback { .. }))
            .count();
        assert_eq!(rollbacks, calls, "{case}: {:?}", decision.actions);
        match expected {
            Ok(true) => assert_eq!(decision.report.state, RunState::Completed, "{case}"),
            Ok(false) => assert_eq!(
                decision.report.state,
                RunState::InProgress,
                "{case}: {}",
                decision.report.message
            ),
            Err(reason) => {
                assert_eq!(decision.report.state, RunState::Failed, "{case}");
                assert_eq!(
                    decision.report.message,
                    format!("Talos rollback failed: {reason}"),
                    "{case}"
                );
                assert!(
                    decision
                        .report
                        .notes
                        .iter()
                        .any(|n| n.reason == Reason::RollbackFailed),
                    "{case}"
                );
            }
        }
    }
}

/// The preflight checks an upgrade has hold a rollback's next node too, naming it.
#[test]
fn the_preflight_checks_hold_the_next_node() {
    let obs = upgraded_cluster();
    let cp_only = |obs: &Observation| {
        start(
            &completed_run(),
            &RollbackRequest::Nodes(vec!["cp-1".into()]),
            "cp-1",
            UpgradeOrder::WorkersFirst,
            obs,
            t0(),
        )
        .expect("started")
        .0
    };
    type Look = fn(&mut Observation);
    type Case<'a> = (&'a str, Look, Option<PreflightCheck>, &'a str, Vec<Action>);
    let cases: Vec<Case> = vec![
        (
            "etcd unhealthy",
            |o| o.etcd.problem = Some("member cp-2 is unhealthy".into()),
            Some(PreflightCheck::EtcdHealth),
            "Rolling back 1 node to Talos 1.11.6: waiting: etcd is not healthy (member cp-2 is unhealthy); holding before control plane cp-1 (0/1 done)",
            vec![],
        ),
        (
            "the leader: leadership moves first",
            |_| {},
            Some(PreflightCheck::EtcdLeader),
            "Rolling back 1 node to Talos 1.11.6: waiting: moving etcd leadership off cp-1 before rolling it back (0/1 done)",
            vec![Action::ForfeitEtcdLeadership {
                node: "cp-1".into(),
            }],
        ),
        (
            "another node not Ready",
            |o| {
                o.etcd.leader = Some("cp-2".into());
                set(o, "w-2", |n| n.kubernetes_ready = false)
            },
            Some(PreflightCheck::NodesReady),
            "Rolling back 1 node to Talos 1.11.6: waiting: node w-2 is not ready; holding before rolling back cp-1 (0/1 done)",
            vec![],
        ),
        (
            "its Talos API down",
            |o| {
                o.etcd.leader = Some("cp-2".into());
                down(o, "cp-1")
            },
            Some(PreflightCheck::TalosApi),
            "Rolling back 1 node to Talos 1.11.6: waiting: node cp-1's Talos API is unreachable: connection refused (0/1 done)",
            vec![],
        ),
        (
            "all clear",
            |o| o.etcd.leader = Some("cp-2".into()),
            None,
            "Rolling back 1 node to Talos 1.11.6: cp-1 rebooting (0/1 done)",
            vec![Action::Rollback {
                node: "cp-1".into(),
            }],
        ),
    ];
    for (case, look, hold, message, actions) in cases {
        let mut seen = obs.clone();
        look(&mut seen);
        let decision = Talos::advance(&cp_only(&obs), &settings(), &seen, t0());
        assert_eq!(decision.report.hold, hold, "{case}");
        assert_eq!(decision.report.message, message, "{case}");
        assert_eq!(decision.actions, actions, "{case}");
    }
    // Paused: nothing starts.
    let paused = Settings {
        paused: true,
        ..settings()
    };
    let mut seen = obs.clone();
    seen.etcd.leader = Some("cp-2".into());
    assert!(
        Talos::advance(&cp_only(&obs), &paused, &seen, t0())
            .actions
            .is_empty()
    );
}

#[test]
fn a_rollback_run_round_trips_and_old_records_read_without_one() {
    let (run, _) = start(
        &completed_run(),
        &RollbackRequest::Run,
        "run",
        UpgradeOrder::WorkersFirst,
        &upgraded_cluster(),
        t0(),
    )
    .expect("started");
    let json = serde_json::to_value(&run).expect("json");
    assert_eq!(json["rollback"]["asked"], "run");
    assert_eq!(json["rollback"]["to"]["cp-1"], "1.11.6");
    assert_eq!(serde_json::from_value::<Run>(json).expect("back"), run);
    let old = serde_json::json!({"requested": "1.12.0", "target": "1.12.0", "startedAt": "2026-11-28T10:00:00Z", "nodes": []});
    let old: Run = serde_json::from_value(old).expect("old record");
    assert!(old.rollback.is_none() && old.previous.is_empty());
}

// ----- the lifecycle around it -----

struct Drove {
    asked_actions: Vec<Action>,
    conclusion: Conclusion<Talos>,
}

fn catalog() -> Catalog {
    Catalog::new(
        [TalosVersion::new(1, 11, 6), TalosVersion::new(1, 12, 0)],
        [
            KubernetesVersion::new(1, 34, 1),
            KubernetesVersion::new(1, 35, 0),
        ],
    )
}

/// Drives a Talos lifecycle with the cluster looking like `obs`, every call answered.
fn drive(pairs: &[(&str, &str)], record: Option<Run>, obs: &Observation) -> Drove {
    drive_answering(pairs, record, obs, Called::Done)
}

/// [`drive`] with every Rollback call answered `rollback`.
fn drive_answering(
    pairs: &[(&str, &str)],
    record: Option<Run>,
    obs: &Observation,
    rollback: Called,
) -> Drove {
    let annotations: BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (format!("upgrade.vitistack.io/{k}"), v.to_string()))
        .collect();
    let intent = UpgradeIntent::from_annotations(&annotations);
    let catalog = catalog();
    let mut lifecycle = Lifecycle::<Talos>::new(Inputs {
        intent: &intent,
        annotations: &annotations,
        record,
        gates: Gates::default(),
        limits: Limits::default(),
        catalog: &catalog,
        now: t0(),
    });
    let mut asked_actions = Vec::new();
    let mut step = lifecycle.start();
    loop {
        step = match step {
            Step::Look(Look::Versions) => lifecycle.looked_at_versions(Ok(Talos::versions_of(obs))),
            Step::Look(Look::Cluster(_)) => lifecycle.looked_at_cluster(Ok(obs.clone())),
            Step::Further(work) => lifecycle.further(
                work.iter()
                    .map(|w| match w {
                        crate::talos::Further::Etcd => {
                            crate::talos::FurtherLooked::Etcd(EtcdObservation {
                                problem: None,
                                leader: Some("cp-2".into()),
                            })
                        }
                        other => panic!("a rollback asks for no {other:?}"),
                    })
                    .collect(),
            ),
            Step::Act(act) => {
                // The write-ahead: the run saved with the call recorded.
                for action in &act.actions {
                    if let Action::Rollback { node } = action {
                        assert!(matches!(
                            act.run.node(node).map(|n| &n.step),
                            Some(NodeStep::Issued { .. })
                        ));
                    }
                }
                asked_actions.extend(act.actions.iter().cloned());
                lifecycle.called(
                    act.actions
                        .iter()
                        .map(|action| match action {
                            Action::Rollback { .. } => rollback.clone(),
                            _ => Called::Done,
                        })
                        .collect(),
                )
            }
            Step::Done(conclusion) => {
                return Drove {
                    asked_actions,
                    conclusion,
                };
            }
        }
    }
}

#[test]
fn the_lifecycle_starts_refuses_or_leaves_a_rollback_and_a_rolled_back_target_stays_decided() {
    let obs = upgraded_cluster();
    let rolling = |run: Run| -> Run {
        drive(
            &[("talos-target", "1.12.0"), ("talos-rollback", "run")],
            Some(run),
            &obs,
        )
        .conclusion
        .record
        .expect("record")
    };
    // Accepted: consumed, announced, the first worker's call made after the save.
    let accepted = drive(
        &[("talos-target", "1.12.0"), ("talos-rollback", "run")],
        Some(completed_run()),
        &obs,
    );
    let report = &accepted.conclusion.report;
    assert_eq!(
        accepted.asked_actions,
        vec![Action::Rollback { node: "w-1".into() }]
    );
    assert_eq!(report.status, UpgradeStatus::InProgress);
    assert_eq!(
        report.message,
        "Rolling back 4 nodes to Talos 1.11.6: w-1 rebooting (0/4 done)"
    );
    assert!(report.consumed.contains(&annotations::TALOS_ROLLBACK));
    assert!(
        accepted
            .conclusion
            .announced
            .contains(&Reason::RollbackStarted)
    );
    // Refused: the reason in the status and an Event, the annotation left, the record kept, no call.
    type Refusal<'a> = (&'a [(&'a str, &'a str)], Option<Run>, &'a str);
    let refusals: [Refusal; 5] = [
        (
            &[("talos-rollback", "run")],
            Some(completed_run()),
            "Talos rollback refused: talos-target is not set, so there is no run to roll back (set it \
             back to the value of the run to roll back). No node was touched.",
        ),
        (
            &[("talos-target", "1.12.0"), ("talos-rollback", "cp-9")],
            Some(completed_run()),
            "Talos rollback refused: unknown node cp-9: not in the cluster's node list. No node was touched.",
        ),
        (
            &[
                ("talos-target", "1.12.0"),
                ("talos-rollback", "everything!"),
            ],
            Some(completed_run()),
            "Talos rollback refused: Annotation upgrade.vitistack.io/talos-rollback has the invalid value \"everything!\": use failed (the last run's failed nodes), run (its failed and upgraded nodes) or a comma-separated list of node names. No node was touched.",
        ),
        (
            &[("talos-target", "1.12.0"), ("talos-rollback", "run")],
            None,
            "Talos rollback refused: there is no finished Talos run for talos-target 1.12.0 to roll back. No node was touched.",
        ),
        (
            &[("talos-target", "1.12.0"), ("talos-rollback", "failed")],
            Some(completed_run()),
            "Talos rollback refused: the last Talos run (to 1.12.0) has no failed node; use run to roll back the nodes it upgraded, or name them. No node was touched.",
        ),
    ];
    for (pairs, record, message) in refusals {
        let refused = drive(pairs, record.clone(), &obs);
        let report = &refused.conclusion.report;
        assert!(refused.asked_actions.is_empty(), "{message}");
        assert_eq!(report.status, UpgradeStatus::Failed, "{message}");
        assert_eq!(report.message, message);
        assert!(
            !report.consumed.contains(&annotations::TALOS_ROLLBACK),
            "{message}"
        );
        assert_eq!(refused.conclusion.record, record, "{message}");
        assert_eq!(
            refused
                .conclusion
                .notes
                .iter()
                .map(|n| n.reason)
                .collect::<Vec<_>>(),
            vec![Reason::RollbackRefused],
            "{message}"
        );
    }
    // Completed: the target stands as rolled back; no node is upgraded again on its own.
    let mut finished = rolling(completed_run());
    for node in &mut finished.nodes {
        node.step = done(true);
    }
    finished.outcome = Some(Outcome::Completed { at: t0() });
    let mut on_previous = obs.clone();
    for name in ["cp-1", "cp-2", "w-1", "w-2"] {
        boot(&mut on_previous, name, "1.11.6", 3, true);
    }
    let stands = drive(
        &[("talos-target", "1.12.0")],
        Some(finished.clone()),
        &on_previous,
    );
    assert!(stands.asked_actions.is_empty());
    assert_eq!(stands.conclusion.report.status, UpgradeStatus::Completed);
    assert!(
        stands
            .conclusion
            .report
            .message
            .starts_with("Talos rollback completed")
    );
    // `resume` on it decides the target afresh: the upgrade starts again.
    let resumed = drive(
        &[("talos-target", "1.12.0"), ("resume", "true")],
        Some(finished),
        &on_previous,
    );
    assert_eq!(resumed.conclusion.report.status, UpgradeStatus::InProgress);
    assert!(
        resumed
            .conclusion
            .record
            .is_some_and(|run| run.rollback.is_none())
    );
}

/// A node that refuses the call (it has no other slot): the rollback fails at once, naming it, with
/// its own Event, and no further node is called.
#[test]
fn a_refused_rollback_call_fails_the_rollback_with_its_own_event() {
    let refused = drive_answering(
        &[("talos-target", "1.12.0"), ("talos-rollback", "run")],
        Some(completed_run()),
        &upgraded_cluster(),
        Called::Refused(
            "refused the rollback: cannot rollback to previous version, label does not exist"
                .into(),
        ),
    );
    assert_eq!(
        refused.asked_actions,
        vec![Action::Rollback { node: "w-1".into() }]
    );
    let report = &refused.conclusion.report;
    assert_eq!(report.status, UpgradeStatus::Failed);
    assert_eq!(
        report.message,
        "Talos rollback failed: node w-1 refused the rollback: cannot rollback to previous version, \
         label does not exist"
    );
    let reasons: Vec<Reason> = refused.conclusion.notes.iter().map(|n| n.reason).collect();
    assert_eq!(reasons, vec![Reason::RollbackFailed]);
}

/// A multi-hop plan never moves past a hop on a completed rollback: it reads as the hop stopped.
#[test]
fn a_plan_reads_a_finished_rollback_as_its_hop_stopped() {
    use crate::plan::RunEnd;
    let upgrade = completed_run();
    let end = RunEnd::of(&upgrade);
    assert!(end.completed && !end.failed);
    let (mut rollback, _) = start(
        &upgrade,
        &RollbackRequest::Run,
        "run",
        UpgradeOrder::WorkersFirst,
        &upgraded_cluster(),
        t0(),
    )
    .expect("started");
    let under_way = RunEnd::of(&rollback);
    assert!(!under_way.completed && !under_way.failed);
    rollback.outcome = Some(Outcome::Completed { at: t0() });
    let end = RunEnd::of(&rollback);
    assert_eq!(end.requested, "1.12.0");
    assert!(!end.completed && end.failed);
}

/// `resume` on a failed rollback continues it from the failed node, and says it is the rollback.
#[test]
fn resume_continues_a_failed_rollback() {
    let obs = upgraded_cluster();
    let (mut failed, _) = start(
        &completed_run(),
        &RollbackRequest::Nodes(vec!["w-1".into()]),
        "w-1",
        UpgradeOrder::WorkersFirst,
        &obs,
        t0(),
    )
    .expect("started");
    failed.nodes[0].step = NodeStep::Failed {
        at: t0(),
        reason: "did not come back online within 15m".into(),
        installed: None,
    };
    failed.outcome = Some(Outcome::Failed {
        at: t0(),
        node: Some("w-1".into()),
        reason: "node w-1 did not come back online within 15m".into(),
    });
    let resumed = drive(
        &[("talos-target", "1.12.0"), ("resume", "true")],
        Some(failed),
        &obs,
    );
    assert_eq!(
        resumed.asked_actions,
        vec![Action::Rollback { node: "w-1".into() }]
    );
    let notes: Vec<(Reason, String)> = resumed
        .conclusion
        .notes
        .iter()
        .map(|n| (n.reason, n.message.clone()))
        .collect();
    assert!(
        resumed
            .conclusion
            .announced
            .contains(&Reason::UpgradeResumed)
            || notes.iter().any(|(r, _)| *r == Reason::UpgradeResumed),
        "{notes:?}"
    );
    assert!(
        resumed
            .conclusion
            .record
            .is_some_and(|run| run.rollback.is_some())
    );
}
