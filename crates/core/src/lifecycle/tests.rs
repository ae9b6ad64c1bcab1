//! The lifecycle's rules, table by table: each case is the annotations, the record, what the looks
//! see and how the calls go, and the test drives the machine as the shell would (with canned answers)
//! and checks what the user would see and what the shell was asked to do.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use semver::Version;

use super::*;
use crate::annotations::UpgradeStatus;
use crate::gates::Gates;
use crate::kubernetes::{
    self, ConfigVersions, ConfiguredImages, KubeRun, Kubernetes, KubernetesVersions, StaticPod,
    TalosApi,
};
use crate::run::{NodeRole, NoteType, Outcome, Reason};
use crate::talos::{
    self, EtcdObservation, InstallSource, LifecycleStage, NodeObservation, NodeProgress, NodeStep,
    Observation, Run, Talos, TalosState, TalosVersions,
};
use crate::versions::{KubernetesVersion, TalosVersion};

fn now() -> Timestamp {
    "2026-11-27T10:00:00Z".parse().expect("timestamp")
}

fn earlier(minutes: i64) -> Timestamp {
    now() - jiff::SignedDuration::from_mins(minutes)
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(key, value)| (format!("upgrade.vitistack.io/{key}"), value.to_string()))
        .collect()
}

// ----- Talos fixtures -----

fn talos_node(name: &str, role: NodeRole, version: &str) -> NodeObservation {
    NodeObservation {
        name: name.into(),
        role,
        talos: TalosState::Up {
            version: Version::parse(version).expect("version"),
            boot_id: format!("{name}-boot-1"),
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

/// One control plane and one worker on `version`, etcd healthy with the control plane leading.
fn talos_cluster(version: &str) -> Observation {
    Observation {
        nodes: vec![
            talos_node("cp-1", NodeRole::ControlPlane, version),
            talos_node("worker-1", NodeRole::Worker, version),
        ],
        etcd: EtcdObservation {
            problem: None,
            leader: Some("cp-1".into()),
        },
        gates: Default::default(),
        scope: Default::default(),
    }
}

fn talos_versions(version: &str) -> TalosVersions {
    Talos::versions_of(&talos_cluster(version))
}

/// A run to 1.12.0 with the worker issued (a legacy call, answered) and the control plane pending.
fn talos_run_in_flight() -> Run {
    Run {
        requested: "1.12.0".into(),
        target: "1.12.0".into(),
        started_at: earlier(5),
        outcome: None,
        // Under way: its pre-pull is over (a new run's is in the tests of its start).
        gates: crate::holds::RunGates {
            prepull: crate::prepull::PrePull {
                nodes: Vec::new(),
                done_at: Some(earlier(5)),
            },
            ..Default::default()
        },
        previous: Default::default(),
        rollback: None,
        nodes: vec![
            NodeProgress {
                name: "worker-1".into(),
                role: NodeRole::Worker,
                step: NodeStep::Issued {
                    at: earlier(1),
                    boot_id: "worker-1-boot-1".into(),
                    from_version: "1.11.6".into(),
                    installer_image: "ghcr.io/siderolabs/installer:v1.12.0".into(),
                    lifecycle: None,
                    unanswered: false,
                    install_unconfirmed: false,
                },
            },
            NodeProgress {
                name: "cp-1".into(),
                role: NodeRole::ControlPlane,
                step: NodeStep::Pending,
            },
        ],
    }
}

fn talos_run_with(outcome: Option<Outcome>, touched: bool) -> Run {
    let mut run = talos_run_in_flight();
    run.outcome = outcome;
    if !touched {
        run.nodes.clear();
        run.target = String::new();
    }
    run
}

fn failed(reason: &str) -> Option<Outcome> {
    Some(Outcome::Failed {
        at: earlier(2),
        node: None,
        reason: reason.into(),
    })
}

fn completed() -> Option<Outcome> {
    Some(Outcome::Completed { at: earlier(2) })
}

// ----- Kubernetes fixtures -----

fn kube_node(
    name: &str,
    role: NodeRole,
    talos: &str,
    kubernetes: &str,
) -> kubernetes::NodeObservation {
    let image = |field: kubernetes::ImageField| {
        Some(format!("{}:v{kubernetes}", field.default_repository()))
    };
    let control_plane = role == NodeRole::ControlPlane;
    kubernetes::NodeObservation {
        name: name.into(),
        role,
        talos: TalosApi::Up {
            version: TalosVersion::parse(talos).expect("talos"),
            ready: true,
        },
        images: ConfiguredImages {
            api_server: control_plane
                .then(|| image(kubernetes::ImageField::ApiServer))
                .flatten(),
            controller_manager: control_plane
                .then(|| image(kubernetes::ImageField::ControllerManager))
                .flatten(),
            scheduler: control_plane
                .then(|| image(kubernetes::ImageField::Scheduler))
                .flatten(),
            proxy: control_plane
                .then(|| image(kubernetes::ImageField::Proxy))
                .flatten(),
            kubelet: image(kubernetes::ImageField::Kubelet),
        },
        config_versions: ConfigVersions::default(),
        static_pods: if control_plane {
            kubernetes::Component::ALL
                .iter()
                .map(|component| StaticPod {
                    component: *component,
                    image: format!(
                        "{}:v{kubernetes}",
                        component.image_field().default_repository()
                    ),
                    config_version: None,
                    ready: true,
                })
                .collect()
        } else {
            Vec::new()
        },
        kubelet_version: Some(KubernetesVersion::parse(kubernetes).expect("kubelet")),
        kubernetes_ready: true,
    }
}

fn kube_cluster(talos: &str, kubernetes: &str) -> kubernetes::Observation {
    kubernetes::Observation {
        nodes: vec![
            kube_node("cp-1", NodeRole::ControlPlane, talos, kubernetes),
            kube_node("worker-1", NodeRole::Worker, talos, kubernetes),
        ],
        etcd: Default::default(),
    }
}

// ----- driving the machine as the shell does -----

/// What the shell was asked to do, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Asked {
    Versions,
    Cluster,
    Further(String),
    Act(Vec<String>),
}

/// Canned answers: what every look sees, and how the calls of each act go (by default, answered).
struct Answers<K: Kind> {
    versions: Looked<K::Versions>,
    cluster: Looked<K::Observation>,
    further: fn(&K::Further) -> K::FurtherLooked,
    calls: Vec<Vec<Called>>,
}

fn talos_answers(version: &str) -> Answers<Talos> {
    Answers {
        versions: Ok(talos_versions(version)),
        cluster: Ok(talos_cluster(version)),
        further: |further| match further {
            talos::Further::Etcd => talos::FurtherLooked::Etcd(EtcdObservation {
                problem: None,
                leader: Some("cp-1".into()),
            }),
            talos::Further::Drain(nodes) => talos::FurtherLooked::Drained(
                nodes
                    .iter()
                    .map(|n| (n.clone(), Some(talos::DrainStatus::default())))
                    .collect(),
            ),
            talos::Further::InstallerImages(nodes) => talos::FurtherLooked::InstallerImages(
                nodes
                    .iter()
                    .map(|n| {
                        (
                            n.clone(),
                            Ok(InstallSource::new(
                                "ghcr.io/siderolabs/installer:v1.11.6",
                                Some("metal"),
                            )),
                        )
                    })
                    .collect(),
            ),
            // Every canned look is of everything: none asks for another.
            talos::Further::Refresh(_) => {
                talos::FurtherLooked::Refreshed(Err("no refresh in these tests".into()))
            }
        },
        calls: Vec::new(),
    }
}

fn kube_answers(talos: &str, kubernetes: &str) -> Answers<Kubernetes> {
    let cluster = kube_cluster(talos, kubernetes);
    Answers {
        versions: Ok(KubernetesVersions::of(&cluster)),
        cluster: Ok(cluster),
        further: |nothing| match *nothing {},
        calls: Vec::new(),
    }
}

fn inputs<'a, K: Kind>(
    intent: &'a UpgradeIntent,
    annotations: &'a BTreeMap<String, String>,
    record: Option<K::Run>,
    gates: Gates,
    catalog: &'a Catalog,
) -> Inputs<'a, K> {
    Inputs {
        intent,
        annotations,
        record,
        gates,
        limits: Limits {
            drain_timeout: Duration::from_secs(300),
            ..Limits::default()
        },
        catalog,
        now: now(),
    }
}

/// Drives the lifecycle to its end with `answers`, as the shell would.
fn drive<K: Kind>(
    annotations: &BTreeMap<String, String>,
    record: Option<K::Run>,
    gates: Gates,
    answers: Answers<K>,
) -> (Vec<Asked>, Conclusion<K>) {
    drive_with(guide_catalog(), annotations, record, gates, answers)
}

/// [`drive`] with the release catalog `catalog`.
fn drive_with<K: Kind>(
    catalog: Catalog,
    annotations: &BTreeMap<String, String>,
    record: Option<K::Run>,
    gates: Gates,
    mut answers: Answers<K>,
) -> (Vec<Asked>, Conclusion<K>) {
    let intent = UpgradeIntent::from_annotations(annotations);
    let mut lifecycle = Lifecycle::new(inputs::<K>(&intent, annotations, record, gates, &catalog));
    let mut asked = Vec::new();
    let mut step = lifecycle.start();
    answers.calls.reverse();
    loop {
        step = match step {
            Step::Look(Look::Versions) => {
                asked.push(Asked::Versions);
                lifecycle.looked_at_versions(answers.versions.clone())
            }
            Step::Look(Look::Cluster(_)) => {
                asked.push(Asked::Cluster);
                lifecycle.looked_at_cluster(answers.cluster.clone())
            }
            Step::Further(work) => {
                asked.extend(work.iter().map(|w| Asked::Further(format!("{w:?}"))));
                lifecycle.further(work.iter().map(answers.further).collect())
            }
            Step::Act(act) => {
                asked.push(Asked::Act(
                    act.actions.iter().map(|a| format!("{a:?}")).collect(),
                ));
                let results = answers
                    .calls
                    .pop()
                    .unwrap_or_else(|| act.actions.iter().map(|_| Called::Done).collect());
                lifecycle.called(results)
            }
            Step::Done(conclusion) => return (asked, conclusion),
        }
    }
}

/// The user guide's releases: Talos 1.11.6 → 1.12.0, Kubernetes 1.34.1 → 1.35.0. Targets beyond
/// them are allowed here: the tables use 1.13 targets to reach the lifecycle API's stages.
fn guide_catalog() -> Catalog {
    strict_guide_catalog().allowing_unknown(true)
}

/// The guide's releases, and nothing newer allowed (the controller's default).
fn strict_guide_catalog() -> Catalog {
    Catalog::new(
        [TalosVersion::new(1, 11, 6), TalosVersion::new(1, 12, 0)],
        [
            KubernetesVersion::new(1, 34, 1),
            KubernetesVersion::new(1, 35, 0),
        ],
    )
}

/// The node rebooted into `version` (a new boot), ready.
fn rebooted(name: &str, role: NodeRole, version: &str) -> NodeObservation {
    let mut node = talos_node(name, role, version);
    if let TalosState::Up { boot_id, .. } = &mut node.talos {
        *boot_id = format!("{name}-boot-2");
    }
    node
}

fn reasons(notes: &[Note]) -> Vec<Reason> {
    notes.iter().map(|note| note.reason).collect()
}

// ----- the tables -----

/// A case: what it is, the annotations, the record, what the shell is asked, what the user sees, and
/// the requested value of the record kept.
type Case = (
    &'static str,
    Vec<(&'static str, &'static str)>,
    Option<Run>,
    Vec<Asked>,
    Shows,
    Option<&'static str>,
);

/// What a case expects the user to see.
struct Shows {
    status: UpgradeStatus,
    message: &'static str,
    condition: Option<ConditionReason>,
    notes: &'static [Reason],
    consumed: &'static [&'static str],
    revisit: Revisit,
}

#[test]
fn talos_without_a_run_in_flight() {
    use UpgradeStatus::*;
    let cases: Vec<Case> = vec![
        (
            "no target, no run: the versions and what is available",
            vec![],
            None,
            vec![Asked::Versions],
            Shows {
                status: Idle,
                message: "Upgrade available: 1.11.6 → 1.12.0",
                condition: None,
                notes: &[],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            None,
        ),
        (
            "the target of a completed run removed: forgotten, the condition stays",
            vec![],
            Some(talos_run_with(completed(), true)),
            vec![Asked::Versions],
            Shows {
                status: Idle,
                message: "Upgrade available: 1.11.6 → 1.12.0",
                condition: None,
                notes: &[],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            None,
        ),
        (
            "the target of a failed run removed: the failure is cleared",
            vec![],
            Some(talos_run_with(failed("node cp-1 did not come back"), true)),
            vec![Asked::Versions],
            Shows {
                status: Idle,
                message: "Upgrade available: 1.11.6 → 1.12.0",
                condition: Some(ConditionReason::Reset),
                notes: &[],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            None,
        ),
        (
            "reset: everything forgotten, no look, both keys consumed",
            vec![
                ("talos-target", "1.12.0"),
                ("talos-reset-upgrade-state", "true"),
            ],
            Some(talos_run_in_flight()),
            vec![],
            Shows {
                status: Idle,
                message: "Talos upgrade state was reset; no node was touched. Node worker-1 had \
                          its upgrade call to Talos 1.12.0 and finishes it by itself",
                condition: Some(ConditionReason::Reset),
                notes: &[Reason::UpgradeReset],
                consumed: &[
                    annotations::TALOS_RESET_UPGRADE_STATE,
                    annotations::TALOS_TARGET,
                ],
                revisit: Revisit::Idle,
            },
            None,
        ),
        (
            "not a version: refused once, no look, resume consumed",
            vec![("talos-target", "1.12"), ("resume", "true")],
            None,
            vec![],
            Shows {
                status: Failed,
                message: "Invalid talos-target: \"1.12\" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0. No node was touched.",
                condition: Some(ConditionReason::Failed),
                notes: &[Reason::InvalidTarget],
                consumed: &[annotations::RESUME],
                revisit: Revisit::Idle,
            },
            Some("1.12"),
        ),
        (
            "the same refused value again: decided once, not announced again",
            vec![("talos-target", "1.12")],
            Some(Run::refused(
                "1.12",
                "Invalid talos-target: recorded.",
                earlier(3),
            )),
            vec![],
            Shows {
                status: Failed,
                message: "Invalid talos-target: recorded.",
                condition: Some(ConditionReason::Failed),
                notes: &[],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            Some("1.12"),
        ),
        (
            "a bad option: not started, told once",
            vec![("talos-target", "1.12.0"), ("upgrade-order", "sideways")],
            None,
            vec![],
            Shows {
                status: Failed,
                message: "Talos upgrade not started: Annotation upgrade.vitistack.io/upgrade-order has the invalid value \"sideways\": use workers-first (the default) or control-planes-first",
                condition: Some(ConditionReason::Failed),
                notes: &[Reason::InvalidOption],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            None,
        ),
        (
            "a refusal stands with its own sentence",
            vec![("talos-target", "1.12.0")],
            Some(talos_run_with(failed("Talos upgrade refused: no."), false)),
            vec![Asked::Versions],
            Shows {
                status: Failed,
                message: "Talos upgrade refused: no.",
                condition: Some(ConditionReason::Failed),
                notes: &[],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            Some("1.12.0"),
        ),
        (
            "resume on a refusal decides it again: a downgrade is refused anew and told again",
            vec![("talos-target", "1.11.0"), ("resume", "true")],
            Some(Run::refused(
                "1.11.0",
                "Talos upgrade refused: old.",
                earlier(3),
            )),
            vec![Asked::Cluster],
            Shows {
                status: Failed,
                message: "Talos upgrade refused: Downgrade from 1.11.6 to 1.11.0 is not supported: choose a target of 1.11.6 or newer. No node was touched.",
                condition: Some(ConditionReason::Failed),
                notes: &[Reason::InvalidTarget],
                consumed: &[annotations::RESUME],
                revisit: Revisit::Idle,
            },
            Some("1.11.0"),
        ),
        (
            "a target more than one step away: refused before any node is touched",
            vec![("talos-target", "1.14.0")],
            None,
            vec![Asked::Cluster],
            Shows {
                status: Failed,
                message: "",
                condition: Some(ConditionReason::Failed),
                notes: &[Reason::InvalidTarget],
                consumed: &[],
                revisit: Revisit::Idle,
            },
            Some("1.14.0"),
        ),
    ];
    for (what, pairs, record, expected_asks, shows, recorded) in cases {
        let (asked, conclusion) = drive::<Talos>(
            &annotations(&pairs),
            record,
            Gates::default(),
            talos_answers("1.11.6"),
        );
        assert_eq!(asked, expected_asks, "{what}: asked");
        let report = &conclusion.report;
        assert_eq!(report.status, shows.status, "{what}: status");
        if !shows.message.is_empty() {
            assert_eq!(report.message, shows.message, "{what}: message");
        } else {
            assert!(
                report.message.starts_with("Talos upgrade refused: ")
                    && report.message.ends_with(". No node was touched."),
                "{what}: {}",
                report.message
            );
        }
        assert_eq!(
            report.condition_reason, shows.condition,
            "{what}: condition"
        );
        assert_eq!(reasons(&conclusion.notes), shows.notes, "{what}: notes");
        assert_eq!(report.consumed, shows.consumed, "{what}: consumed");
        assert_eq!(conclusion.revisit, shows.revisit, "{what}: revisit");
        assert_eq!(
            conclusion.record.as_ref().map(|run| run.requested.as_str()),
            recorded,
            "{what}: record"
        );
        // No case here makes a call.
        assert!(!asked.iter().any(|a| matches!(a, Asked::Act(_))), "{what}");
    }
}

#[test]
fn a_new_talos_run_starts_announced_and_records_its_call_before_making_it() {
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0")]),
        None,
        Gates::default(),
        talos_answers("1.11.6"),
    );
    assert_eq!(asked[0], Asked::Cluster);
    let Asked::Act(pulls) = &asked[1] else {
        panic!("the pre-pull follows the look: {asked:?}");
    };
    assert!(
        pulls.len() == 2 && pulls.iter().all(|call| call.starts_with("PrePull")),
        "{pulls:?}"
    );
    let Asked::Act(calls) = &asked[2] else {
        panic!("a call follows the pre-pull: {asked:?}");
    };
    assert!(calls[0].contains("worker-1"), "workers first: {calls:?}");
    let run = conclusion.record.expect("a run recorded");
    assert!(matches!(
        run.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Issued {
            unanswered: false,
            ..
        })
    ));
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(conclusion.report.message, "Upgrading node worker-1 (1/2)");
    assert_eq!(conclusion.report.current.as_deref(), Some("1.11.6"));
    assert_eq!(conclusion.report.progress, Some((0, 2)));
    // Announced with the calls, not again with the report.
    assert_eq!(
        conclusion.announced,
        [
            Reason::UpgradeStarted,
            Reason::InstallerPulled,
            Reason::NodeUpgradeStarted
        ]
    );
    assert!(conclusion.notes.is_empty());
    // The call was answered: the node only has its reboot left, which its followers report (the
    // decision was made before the answer, and foresaw it).
    assert_eq!(conclusion.revisit, Revisit::AwaitingReboots);
}

/// A pre-pull refused on one node fails the run naming it, with no node started; the pulls made at
/// the same time that were answered are recorded, so `resume` does not make them again.
#[test]
fn a_refused_pre_pull_fails_the_run_and_keeps_the_pulls_answered_beside_it() {
    let mut answers = talos_answers("1.11.6");
    answers.calls = vec![vec![
        Called::Refused("Talos endpoint 10.0.0.2:50000: not found: error pulling image".into()),
        Called::Done,
    ]];
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0")]),
        None,
        Gates::default(),
        answers,
    );
    assert_eq!(asked.len(), 2, "the look, the pre-pull: {asked:?}");
    assert_eq!(conclusion.report.status, UpgradeStatus::Failed);
    assert!(
        conclusion.report.message.starts_with(
            "Talos upgrade failed: node worker-1 could not pull its installer \
             ghcr.io/siderolabs/installer:v1.12.0: Talos endpoint 10.0.0.2:50000: not found"
        ),
        "{}",
        conclusion.report.message
    );
    let run = conclusion.record.expect("the run recorded");
    assert!(run.in_flight().is_empty());
    assert!(matches!(
        run.gates.prepull.node("cp-1").map(|n| &n.state),
        Some(crate::prepull::PullState::Pulled { .. })
    ));
    assert!(matches!(
        run.gates.prepull.node("worker-1").map(|n| &n.state),
        Some(crate::prepull::PullState::Pulling { .. })
    ));
}

#[test]
fn the_act_carries_the_run_to_save_and_the_report_to_write_beside_the_calls() {
    let annotations = annotations(&[("talos-target", "1.12.0")]);
    let intent = UpgradeIntent::from_annotations(&annotations);
    let catalog = Catalog::builtin();
    let mut lifecycle = Lifecycle::<Talos>::new(inputs(
        &intent,
        &annotations,
        None,
        Gates::default(),
        &catalog,
    ));
    assert!(matches!(lifecycle.start(), Step::Look(Look::Cluster(_))));
    let Step::Act(act) = lifecycle.looked_at_cluster(Ok(talos_cluster("1.11.6"))) else {
        panic!("the pre-pull starts");
    };
    // First the pre-pull on both nodes, recorded before it is made and reported beside it; no node
    // is started yet.
    let pulling = |name: &str| {
        matches!(
            act.run.gates.prepull.node(name).map(|n| &n.state),
            Some(crate::prepull::PullState::Pulling { failed: None })
        )
    };
    assert!(
        pulling("worker-1") && pulling("cp-1"),
        "{:?}",
        act.run.gates
    );
    assert!(act.run.in_flight().is_empty());
    assert_eq!(act.actions.len(), 2);
    assert_eq!(reasons(&act.notes), [Reason::UpgradeStarted]);
    let report = act.report.expect("a pre-pull is reported before its calls");
    assert_eq!(
        report.message,
        "Pulling ghcr.io/siderolabs/installer:v1.12.0 on 2 nodes before upgrading any (0/2 pulled)"
    );
    let Step::Act(act) = lifecycle.called(vec![Called::Done, Called::Done]) else {
        panic!("the first node starts once both pulled");
    };
    // The run to save already records the call as issued and unanswered: a controller that dies
    // between the save and the call never sends a second one blindly.
    assert!(matches!(
        act.run.node("worker-1").map(|n| &n.step),
        Some(NodeStep::Issued {
            unanswered: true,
            ..
        })
    ));
    assert!(act.run.gates.prepull.is_done());
    assert_eq!(
        reasons(&act.notes),
        [Reason::InstallerPulled, Reason::NodeUpgradeStarted]
    );
    let report = act.report.expect("an upgrade is reported before its call");
    assert_eq!(report.message, "Upgrading node worker-1 (1/2)");
}

#[test]
fn talos_calls_and_what_their_answers_mean() {
    struct Case {
        what: &'static str,
        record: Run,
        cluster: Observation,
        calls: Vec<Vec<Called>>,
        asked: Vec<&'static str>,
        status: UpgradeStatus,
        message: &'static str,
        notes: Vec<Reason>,
        revisit: Revisit,
    }
    let workers_done = || {
        let mut run = talos_run_in_flight();
        run.nodes[0].step = NodeStep::Done {
            at: earlier(1),
            started_at: Some(earlier(3)),
        };
        run
    };
    let mut back = talos_cluster("1.11.6");
    back.nodes[1] = rebooted("worker-1", NodeRole::Worker, "1.12.0");
    let mut leader_elsewhere = talos_cluster("1.11.6");
    leader_elsewhere.etcd.leader = Some("cp-2".into());
    let cases = [
        Case {
            what: "the control plane leads etcd: leadership moves, etcd is looked at again, and \
                   while the leader stays the pass ends and looks again at once",
            record: workers_done(),
            cluster: talos_cluster("1.11.6"),
            calls: vec![],
            asked: vec!["cluster", "act ForfeitEtcdLeadership", "further Etcd"],
            status: UpgradeStatus::InProgress,
            message: "Waiting: moving etcd leadership off cp-1 before upgrading it (1/2 done)",
            notes: vec![],
            revisit: Revisit::Now,
        },
        Case {
            what: "another leader: the control plane is upgraded at once, and once the call is \
                   answered the pass waits for its reboot (followed), not a poll",
            record: workers_done(),
            cluster: leader_elsewhere.clone(),
            calls: vec![],
            asked: vec!["cluster", "act Upgrade"],
            status: UpgradeStatus::InProgress,
            message: "Upgrading node cp-1 (2/2)",
            notes: vec![Reason::NodeUpgradeStarted],
            revisit: Revisit::AwaitingReboots,
        },
        Case {
            what: "an upgrade call without an answer: looked at again a poll later",
            record: workers_done(),
            cluster: leader_elsewhere,
            calls: vec![vec![Called::Unanswered("timed out".into())]],
            asked: vec!["cluster", "act Upgrade"],
            status: UpgradeStatus::InProgress,
            message: "Upgrading node cp-1 (2/2)",
            notes: vec![Reason::NodeUpgradeStarted],
            revisit: Revisit::Poll,
        },
        Case {
            what: "a refused upgrade call fails the run, naming the node",
            record: workers_done(),
            cluster: {
                let mut c = talos_cluster("1.11.6");
                c.etcd.leader = Some("cp-2".into());
                c
            },
            calls: vec![vec![Called::Refused("refused the upgrade: no".into())]],
            asked: vec!["cluster", "act Upgrade"],
            status: UpgradeStatus::Failed,
            message: "Talos upgrade failed: node cp-1 refused the upgrade: no",
            notes: vec![Reason::UpgradeFailed, Reason::NodeUpgradeStarted],
            revisit: Revisit::Idle,
        },
        Case {
            what: "the worker back on the target: done, and the control plane is next",
            record: talos_run_in_flight(),
            cluster: back,
            calls: vec![],
            asked: vec!["cluster", "act ForfeitEtcdLeadership", "further Etcd"],
            status: UpgradeStatus::InProgress,
            message: "Waiting: moving etcd leadership off cp-1 before upgrading it (1/2 done)",
            notes: vec![Reason::NodeUpgraded],
            revisit: Revisit::Now,
        },
    ];
    for case in cases {
        let mut answers = talos_answers("1.11.6");
        answers.cluster = Ok(case.cluster);
        answers.calls = case.calls;
        let (asked, conclusion) = drive::<Talos>(
            &annotations(&[("talos-target", "1.12.0")]),
            Some(case.record),
            Gates::default(),
            answers,
        );
        let asked: Vec<String> = asked
            .iter()
            .map(|a| match a {
                Asked::Versions => "versions".to_string(),
                Asked::Cluster => "cluster".to_string(),
                Asked::Further(f) => format!("further {f}"),
                Asked::Act(calls) => format!(
                    "act {}",
                    calls
                        .iter()
                        .map(|c| c.split([' ', '{']).next().unwrap_or_default())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            })
            .collect();
        assert_eq!(asked, case.asked, "{}: asked", case.what);
        assert_eq!(conclusion.report.status, case.status, "{}", case.what);
        assert_eq!(conclusion.report.message, case.message, "{}", case.what);
        let mut all = reasons(&conclusion.notes);
        all.extend(conclusion.announced.iter().copied());
        assert_eq!(all, case.notes, "{}: events", case.what);
        assert_eq!(conclusion.revisit, case.revisit, "{}: revisit", case.what);
    }
}

#[test]
fn a_refused_reboot_leaves_the_installed_node_cordoned_and_says_so() {
    let mut run = talos_run_in_flight();
    run.nodes[0].step = NodeStep::Issued {
        at: earlier(1),
        boot_id: "worker-1-boot-1".into(),
        from_version: "1.13.0".into(),
        installer_image: "ghcr.io/siderolabs/installer:v1.13.1".into(),
        lifecycle: Some(LifecycleStage::Draining {
            since: earlier(1),
            uncordon: true,
        }),
        unanswered: false,
        install_unconfirmed: false,
    };
    run.target = "1.13.1".into();
    run.requested = "1.13.1".into();
    let mut answers = talos_answers("1.13.0");
    answers.calls = vec![vec![Called::Refused("refused the reboot: no".into())]];
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.13.1")]),
        Some(run),
        Gates::default(),
        answers,
    );
    // Drained at once (the canned drain leaves nothing), rebooted, refused; the new system is
    // installed, so the node is left cordoned rather than uncordoned, and the failure says so.
    assert!(
        matches!(&asked[1], Asked::Further(f) if f.contains("Drain")),
        "{asked:?}"
    );
    assert!(
        matches!(&asked[2], Asked::Act(calls) if calls[0].starts_with("Reboot")),
        "{asked:?}"
    );
    assert_eq!(asked.len(), 3, "no clean-up call: {asked:?}");
    assert_eq!(conclusion.report.status, UpgradeStatus::Failed);
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade failed: node worker-1 refused the reboot: no; it was not rebooted: it runs \
         Talos 1.13.0, and Talos 1.13.1 is installed and boots at its next reboot. It is left \
         cordoned: set resume to drain and reboot it, or uncordon it to keep it on 1.13.0 until it \
         reboots"
    );
    assert_eq!(conclusion.report.failed_nodes, ["worker-1"]);
}

#[test]
fn a_removed_target_finishes_the_nodes_in_flight_then_forgets_the_run() {
    // Still rebooting: the run is kept and shown as stopping.
    let answers = worker_1_rebooting();
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked, [Asked::Cluster]);
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        conclusion.report.message,
        "Talos target removed: finishing worker-1 before stopping"
    );
    assert_eq!(conclusion.revisit, Revisit::Poll);
    assert!(conclusion.record.is_some(), "kept until the node is back");

    // Back on the target: done, and the run is forgotten with its last look's versions.
    let mut back = talos_cluster("1.11.6");
    back.nodes[1] = rebooted("worker-1", NodeRole::Worker, "1.12.0");
    let mut answers = talos_answers("1.11.6");
    answers.cluster = Ok(back);
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked, [Asked::Cluster], "no second look");
    assert_eq!(conclusion.report.status, UpgradeStatus::Idle);
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade stopped: the target was removed"
    );
    assert_eq!(
        conclusion.report.condition_reason,
        Some(ConditionReason::Reset)
    );
    assert!(conclusion.record.is_none());
    assert_eq!(reasons(&conclusion.notes), [Reason::NodeUpgraded]);

    // The nodes cannot be looked at: the run is held, not dropped.
    let mut answers = talos_answers("1.11.6");
    answers.cluster = Err("credentials Secret ns/c not found".into());
    let (_, conclusion) = drive::<Talos>(
        &annotations(&[]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        conclusion.report.message,
        "Talos target removed: finishing the node(s) in flight before stopping (credentials Secret ns/c not found)"
    );
    assert_eq!(conclusion.report.progress, Some((0, 2)));
    assert_eq!(conclusion.report.in_flight, ["worker-1"]);
    assert!(conclusion.record.is_some());
}

#[test]
fn a_cluster_that_cannot_be_looked_at_holds_a_run_and_fails_a_start() {
    let problem = "credentials Secret ns/c not found";
    let cases = [
        (
            Some(talos_run_in_flight()),
            UpgradeStatus::InProgress,
            ConditionReason::InProgress,
            Some((0, 2)),
        ),
        (None, UpgradeStatus::Failed, ConditionReason::Failed, None),
    ];
    for (record, status, condition, progress) in cases {
        let mut answers = talos_answers("1.11.6");
        answers.cluster = Err(problem.into());
        let (_, conclusion) = drive::<Talos>(
            &annotations(&[("talos-target", "1.12.0")]),
            record,
            Gates::default(),
            answers,
        );
        let report = &conclusion.report;
        assert_eq!(
            report.message,
            format!("Talos upgrade cannot proceed: {problem}")
        );
        assert_eq!(report.status, status);
        assert_eq!(report.condition_reason, Some(condition));
        assert_eq!(report.progress, progress);
        assert_eq!(conclusion.notes[0].type_, NoteType::Warning);
        assert_eq!(reasons(&conclusion.notes), [Reason::UpgradeBlocked]);
        assert_eq!(conclusion.revisit, Revisit::AfterProblem);
        // Told once: the same message shown already is not announced again.
        let mut answers = talos_answers("1.11.6");
        answers.cluster = Err(problem.into());
        let (_, again) = drive::<Talos>(
            &annotations(&[
                ("talos-target", "1.12.0"),
                ("talos-message", &report.message),
            ]),
            None,
            Gates::default(),
            answers,
        );
        assert!(again.notes.is_empty());
    }
}

#[test]
fn holds_between_the_kinds() {
    // Talos waits for a Kubernetes run under way.
    let gates = Gates {
        talos_upgrading: false,
        kubernetes_running: Some("1.35.0".into()),
    };
    let (asked, talos) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0")]),
        None,
        gates,
        talos_answers("1.11.6"),
    );
    assert_eq!(asked, [Asked::Cluster]);
    assert_eq!(talos.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        talos.report.message,
        "Waiting: the Kubernetes upgrade to 1.35.0 is running; the Talos upgrade starts when it is done"
    );
    assert_eq!(reasons(&talos.notes), [Reason::UpgradeWaiting]);
    assert!(talos.record.is_none(), "nothing started");

    // Kubernetes is blocked while Talos upgrades, then by a node's Talos that does not support it.
    let upgrading = Gates {
        talos_upgrading: true,
        kubernetes_running: None,
    };
    let cases = [
        (
            upgrading,
            "1.12.0",
            kubernetes::WAITING_FOR_TALOS.to_string(),
        ),
        (
            Gates::default(),
            "1.11.6",
            "Talos 1.11.6 does not support K8s 1.35.0. Upgrade Talos first.".to_string(),
        ),
    ];
    for (gates, talos, message) in cases {
        let (_, kube) = drive::<Kubernetes>(
            &annotations(&[("kubernetes-target", "1.35.0")]),
            None,
            gates,
            kube_answers(talos, "1.34.1"),
        );
        assert_eq!(kube.report.status, UpgradeStatus::Blocked);
        assert_eq!(kube.report.message, message);
        assert_eq!(kube.report.condition_reason, Some(ConditionReason::Blocked));
        assert_eq!(reasons(&kube.notes), [Reason::UpgradeBlocked]);
        assert_eq!(kube.revisit, Revisit::Blocked);
        assert_eq!(kube.report.current.as_deref(), Some("1.34.1"));
    }

    // While Talos upgrades, the idle Kubernetes report stays as written, without a look.
    let shown = annotations(&[
        ("kubernetes-status", "idle"),
        (
            "kubernetes-message",
            "Kubernetes 1.34.1 is running; no upgrade requested",
        ),
    ]);
    let (asked, idle) = drive::<Kubernetes>(
        &shown,
        None,
        upgrading_gates(),
        kube_answers("1.12.0", "1.34.1"),
    );
    assert!(asked.is_empty());
    assert_eq!(
        idle.report.message,
        "Kubernetes 1.34.1 is running; no upgrade requested"
    );
    assert_eq!(idle.report.current, None, "the annotation is left as it is");
}

fn upgrading_gates() -> Gates {
    Gates {
        talos_upgrading: true,
        kubernetes_running: None,
    }
}

#[test]
fn kubernetes_steps_whose_call_is_their_whole_effect_go_on_in_the_same_pass() {
    let (asked, conclusion) = drive::<Kubernetes>(
        &annotations(&[("kubernetes-target", "1.35.0")]),
        None,
        Gates::default(),
        kube_answers("1.12.0", "1.34.1"),
    );
    assert_eq!(asked[0], Asked::Cluster);
    // Both pre-pulls answered, then the first patch: three calls in one pass, one decision each.
    let acts: Vec<&str> = asked
        .iter()
        .filter_map(|a| match a {
            Asked::Act(calls) => calls
                .first()
                .map(|c| c.split(' ').next().unwrap_or_default()),
            _ => None,
        })
        .collect();
    assert_eq!(acts, ["PullImages", "PullImages", "PatchImage"]);
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(conclusion.revisit, Revisit::Poll);
    assert!(conclusion.announced.contains(&Reason::UpgradeStarted));

    // A refused pull fails the run at its step.
    let mut answers = kube_answers("1.12.0", "1.34.1");
    answers.calls = vec![vec![Called::Refused("image not found".into())]];
    let (_, failed) = drive::<Kubernetes>(
        &annotations(&[("kubernetes-target", "1.35.0")]),
        None,
        Gates::default(),
        answers,
    );
    assert_eq!(failed.report.status, UpgradeStatus::Failed);
    assert!(
        failed.report.message.starts_with(
            "Kubernetes upgrade failed: pre-pulling images on node cp-1 failed: image not found"
        ),
        "{}",
        failed.report.message
    );
    assert_eq!(reasons(&failed.notes), [Reason::UpgradeFailed]);
    assert_eq!(failed.revisit, Revisit::Idle);
}

#[test]
fn resuming_a_failed_run_continues_from_the_failed_node() {
    let mut run = talos_run_in_flight();
    run.nodes[0].step = NodeStep::Failed {
        at: earlier(1),
        reason: "did not come back online within 15m".into(),
        installed: None,
    };
    run.outcome = Some(Outcome::Failed {
        at: earlier(1),
        node: Some("worker-1".into()),
        reason: "node worker-1 did not come back online within 15m".into(),
    });
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0"), ("resume", "true")]),
        Some(run),
        Gates::default(),
        talos_answers("1.11.6"),
    );
    assert_eq!(asked[0], Asked::Cluster);
    assert!(matches!(&asked[1], Asked::Act(calls) if calls[0].contains("worker-1")));
    assert_eq!(conclusion.report.consumed, [annotations::RESUME]);
    assert_eq!(
        conclusion.announced,
        [Reason::UpgradeResumed, Reason::NodeUpgradeStarted]
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
}

#[test]
fn a_hold_is_announced_once_and_counted_when_a_check_fails() {
    let mut unhealthy = talos_cluster("1.11.6");
    unhealthy.nodes[0].kubernetes_ready = false;
    let message = "Waiting: node cp-1 is not ready; holding before upgrading worker-1 (0/2 done)";
    for (shown, notes, counted) in [
        // The pre-pull is made first (nothing it does disrupts a node), announced with its calls.
        (
            None,
            vec![Reason::UpgradeWaiting, Reason::InstallerPulled],
            true,
        ),
        (Some(message), vec![Reason::InstallerPulled], false),
    ] {
        let mut pairs = vec![("talos-target", "1.12.0")];
        if let Some(shown) = shown {
            pairs.push(("talos-message", shown));
        }
        let mut answers = talos_answers("1.11.6");
        answers.cluster = Ok(unhealthy.clone());
        let (_, conclusion) = drive::<Talos>(&annotations(&pairs), None, Gates::default(), answers);
        assert_eq!(conclusion.report.message, message);
        assert_eq!(reasons(&conclusion.notes), notes);
        assert_eq!(conclusion.preflight_failure.is_some(), counted, "{shown:?}");
        assert_eq!(conclusion.revisit, Revisit::Poll);
    }
}

#[test]
fn invalid_flags_are_told_with_their_safe_reading() {
    let intent =
        UpgradeIntent::from_annotations(&annotations(&[("paused", "yes"), ("resume", "maybe")]));
    let notes = invalid_flag_notes(&intent);
    assert_eq!(notes.len(), 2);
    assert!(
        notes
            .iter()
            .all(|n| n.reason == Reason::InvalidFlag && n.type_ == NoteType::Warning)
    );
    assert!(
        notes
            .iter()
            .any(|n| n.message.ends_with("ignored until it is fixed"))
    );
    assert!(
        notes
            .iter()
            .any(|n| n.message.ends_with("treated as paused until it is fixed"))
    );
}

#[test]
fn kubernetes_stands_refuses_and_waits_like_talos() {
    // A finished Kubernetes run stands, with fresh versions.
    let run = KubeRun {
        requested: "1.35.0".into(),
        target: "1.35.0".into(),
        from: "1.34.1".into(),
        started_at: earlier(9),
        outcome: completed(),
        steps: vec![kubernetes::StepProgress {
            step: kubernetes::Step::Manifests,
            state: kubernetes::StepState::Done {
                at: earlier(8),
                started_at: None,
            },
        }],
        etcd_snapshot: None,
    };
    let (asked, stands) = drive::<Kubernetes>(
        &annotations(&[("kubernetes-target", "1.35.0")]),
        Some(run),
        Gates::default(),
        kube_answers("1.12.0", "1.35.0"),
    );
    assert_eq!(asked, [Asked::Versions]);
    assert_eq!(stands.report.status, UpgradeStatus::Completed);
    assert_eq!(stands.report.current.as_deref(), Some("1.35.0"));
    assert!(stands.run_started_at.is_some());

    // A minor skipped: refused.
    let (_, refused) = drive::<Kubernetes>(
        &annotations(&[("kubernetes-target", "1.36.0")]),
        None,
        Gates::default(),
        kube_answers("1.12.0", "1.34.1"),
    );
    assert_eq!(refused.report.status, UpgradeStatus::Failed);
    assert!(
        refused
            .report
            .message
            .starts_with("Kubernetes upgrade refused: ")
            && refused.report.message.ends_with(". No node was touched."),
        "{}",
        refused.report.message
    );
    assert_eq!(reasons(&refused.notes), [Reason::InvalidTarget]);

    // No version known yet: waiting.
    let mut answers = kube_answers("1.12.0", "1.34.1");
    answers.cluster = Ok(kubernetes::Observation::default());
    let (_, waiting) = drive::<Kubernetes>(
        &annotations(&[("kubernetes-target", "1.35.0")]),
        None,
        Gates::default(),
        answers,
    );
    assert_eq!(
        waiting.report.message,
        "Waiting: no node reports its Kubernetes version yet"
    );
    assert_eq!(waiting.revisit, Revisit::Poll);
}

#[test]
fn a_removed_target_still_finishes_a_drain_and_its_reboot() {
    // Talos ≥ 1.13, the worker installed and being drained when the target goes: the drain pass goes
    // on and the drained node is rebooted into what it installed, rather than left cordoned with a
    // staged system.
    let mut run = talos_run_in_flight();
    run.requested = "1.13.1".into();
    run.target = "1.13.1".into();
    run.nodes[0].step = NodeStep::Issued {
        at: earlier(1),
        boot_id: "worker-1-boot-1".into(),
        from_version: "1.13.0".into(),
        installer_image: "ghcr.io/siderolabs/installer:v1.13.1".into(),
        lifecycle: Some(LifecycleStage::Draining {
            since: earlier(1),
            uncordon: true,
        }),
        unanswered: false,
        install_unconfirmed: false,
    };
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[]),
        Some(run),
        Gates::default(),
        talos_answers("1.13.0"),
    );
    assert_eq!(asked[0], Asked::Cluster);
    assert!(
        matches!(&asked[1], Asked::Further(f) if f.contains("Drain")),
        "{asked:?}"
    );
    assert!(
        matches!(&asked[2], Asked::Act(calls) if calls[0].starts_with("Reboot")),
        "{asked:?}"
    );
    assert_eq!(
        conclusion.report.message,
        "Talos target removed: finishing worker-1 before stopping"
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(conclusion.revisit, Revisit::Poll);
    assert!(matches!(
        conclusion
            .record
            .as_ref()
            .and_then(|run| run.node("worker-1"))
            .map(|n| &n.step),
        Some(NodeStep::Issued {
            lifecycle: Some(LifecycleStage::Rebooting { .. }),
            ..
        })
    ));
}

#[test]
fn a_removed_kubernetes_target_finishes_the_step_in_flight_then_stops() {
    // A run whose first pre-pull is issued; the cluster is as it was.
    let observation = kube_cluster("1.12.0", "1.34.1");
    let mut run = kubernetes::start_run(
        "1.35.0",
        &KubernetesVersion::new(1, 35, 0),
        &KubernetesVersion::new(1, 34, 1),
        &observation,
        earlier(3),
    );
    run.steps[1].state = kubernetes::StepState::Issued {
        at: earlier(1),
        image: None,
    };
    run.steps[0].state = kubernetes::StepState::Done {
        at: earlier(2),
        started_at: Some(earlier(3)),
    };
    let (asked, conclusion) = drive::<Kubernetes>(
        &annotations(&[]),
        Some(run),
        Gates::default(),
        kube_answers("1.12.0", "1.34.1"),
    );
    // The pull is made again (its effect cannot be seen) and, answered, completes the step; nothing
    // new starts, so the run is forgotten with the versions its look saw.
    assert_eq!(asked[0], Asked::Cluster);
    assert!(
        matches!(&asked[1], Asked::Act(calls) if calls[0].starts_with("PullImages")),
        "{asked:?}"
    );
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert_eq!(conclusion.report.status, UpgradeStatus::Idle);
    assert_eq!(
        conclusion.report.message,
        "Kubernetes upgrade stopped: the target was removed"
    );
    assert_eq!(
        conclusion.report.condition_reason,
        Some(ConditionReason::Reset)
    );
    assert!(conclusion.record.is_none());
}

/// A run to 1.12.0 completed on both nodes of [`talos_cluster`].
fn talos_run_completed() -> Run {
    let mut run = talos_run_in_flight();
    for node in &mut run.nodes {
        node.step = NodeStep::Done {
            at: earlier(3),
            started_at: Some(earlier(4)),
        };
    }
    run.outcome = completed();
    run
}

#[test]
fn a_completed_run_stands_shows_what_changed_since_and_takes_in_nodes_that_joined() {
    let target = [("talos-target", "1.12.0")];
    // Every node on the target: the completion stands on the versions alone.
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0"), ("resume", "true")]),
        Some(talos_run_completed()),
        Gates::default(),
        talos_answers("1.12.0"),
    );
    assert_eq!(asked, [Asked::Versions]);
    assert_eq!(conclusion.report.status, UpgradeStatus::Completed);
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade completed: now running 1.12.0"
    );
    assert_eq!(conclusion.report.current.as_deref(), Some("1.12.0"));
    assert_eq!(conclusion.report.consumed, [annotations::RESUME]);

    // A node of the run rolled back by hand: shown, not upgraded again unasked.
    let mut rolled_back = talos_cluster("1.12.0");
    rolled_back.nodes[1] = talos_node("worker-1", NodeRole::Worker, "1.11.6");
    let mut answers = talos_answers("1.12.0");
    answers.versions = Ok(Talos::versions_of(&rolled_back));
    answers.cluster = Ok(rolled_back.clone());
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&target),
        Some(talos_run_completed()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked, [Asked::Versions, Asked::Cluster]);
    assert_eq!(conclusion.report.status, UpgradeStatus::Completed);
    assert_eq!(conclusion.report.current.as_deref(), Some("1.11.6"));
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade to 1.12.0 completed, but a node runs Talos 1.11.6 since (changed outside \
         this controller; set resume to upgrade it again)"
    );
    assert_eq!(conclusion.record, Some(talos_run_completed()));

    // The same with resume: the user asks, so it is upgraded again.
    let mut answers = talos_answers("1.12.0");
    answers.versions = Ok(Talos::versions_of(&rolled_back));
    answers.cluster = Ok(rolled_back);
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0"), ("resume", "true")]),
        Some(talos_run_completed()),
        Gates::default(),
        answers,
    );
    assert!(
        matches!(asked.last(), Some(Asked::Act(calls)) if calls[0].contains("worker-1")),
        "{asked:?}"
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert!(told(&conclusion).contains(&Reason::UpgradeResumed));

    // A node that joined since: taken into the run and upgraded, once.
    let mut joined = talos_cluster("1.12.0");
    joined
        .nodes
        .push(talos_node("worker-2", NodeRole::Worker, "1.11.6"));
    let mut answers = talos_answers("1.12.0");
    answers.versions = Ok(Talos::versions_of(&joined));
    answers.cluster = Ok(joined);
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&target),
        Some(talos_run_completed()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked[..2], [Asked::Versions, Asked::Cluster]);
    assert!(
        matches!(asked.last(), Some(Asked::Act(calls)) if calls.len() == 1 && calls[0].contains("worker-2")),
        "{asked:?}"
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(conclusion.report.progress, Some((2, 3)));
    assert!(told(&conclusion).contains(&Reason::NodeJoined));
}

#[test]
fn an_option_made_invalid_mid_run_holds_it_and_follows_the_nodes_in_flight() {
    let pairs = [("talos-target", "1.12.0"), ("upgrade-order", "sideways")];
    // worker-1 rebooting: followed, nothing new starts.
    let answers = worker_1_rebooting();
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&pairs),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked, [Asked::Cluster]);
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade held: Annotation upgrade.vitistack.io/upgrade-order has the invalid value \
         \"sideways\": use workers-first (the default) or control-planes-first; finishing worker-1 \
         before holding (0/2 done)"
    );
    assert_eq!(reasons(&conclusion.notes), [Reason::InvalidOption]);
    assert_eq!(conclusion.revisit, Revisit::Poll);

    // worker-1 back on the target: done, and cp-1 is not started.
    let mut back = talos_cluster("1.11.6");
    back.nodes[1] = rebooted("worker-1", NodeRole::Worker, "1.12.0");
    let mut answers = talos_answers("1.11.6");
    answers.cluster = Ok(back);
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&pairs),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(
        asked,
        [Asked::Cluster],
        "no call while the option is invalid"
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert!(
        conclusion
            .report
            .message
            .ends_with("no new node starts until it is fixed (1/2 done)"),
        "{}",
        conclusion.report.message
    );
    assert_eq!(conclusion.report.progress, Some((1, 2)));

    // Without a run under way, the target is not started (as before).
    let (_, conclusion) = drive::<Talos>(
        &annotations(&pairs),
        None,
        Gates::default(),
        talos_answers("1.11.6"),
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::Failed);
    assert!(
        conclusion
            .report
            .message
            .starts_with("Talos upgrade not started: "),
        "{}",
        conclusion.report.message
    );
}

#[test]
fn a_reset_mid_drain_says_which_node_it_leaves_cordoned() {
    let mut run = talos_run_in_flight();
    run.target = "1.13.1".into();
    run.requested = "1.13.1".into();
    run.nodes[0].step = NodeStep::Issued {
        at: earlier(1),
        boot_id: "worker-1-boot-1".into(),
        from_version: "1.13.0".into(),
        installer_image: "ghcr.io/siderolabs/installer:v1.13.1".into(),
        lifecycle: Some(LifecycleStage::Draining {
            since: earlier(1),
            uncordon: true,
        }),
        unanswered: false,
        install_unconfirmed: false,
    };
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[
            ("talos-target", "1.13.1"),
            ("talos-reset-upgrade-state", "true"),
        ]),
        Some(run),
        Gates::default(),
        talos_answers("1.13.0"),
    );
    assert_eq!(asked, [], "a reset touches no node");
    assert_eq!(conclusion.report.status, UpgradeStatus::Idle);
    assert_eq!(
        conclusion.report.message,
        "Talos upgrade state was reset; no node was touched. Node worker-1 is left cordoned, with \
         Talos 1.13.1 installed for its next reboot: reboot it to finish its upgrade, or uncordon it"
    );
    // What outlives the reset: worker-1 may boot 1.13.1 at its next reboot. A new run would install
    // over it (explorer seed 3738), so it waits until the node has rebooted.
    let kept = conclusion
        .record
        .expect("the pending install is remembered");
    assert_eq!(kept.requested, "", "matches no target");
    let (asked, waiting) = drive::<Talos>(
        &annotations(&[("talos-target", "1.13.1")]),
        Some(kept.clone()),
        Gates::default(),
        talos_answers("1.13.0"),
    );
    assert_eq!(asked, [Asked::Cluster], "no call");
    assert_eq!(waiting.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        waiting.report.message,
        "Waiting: node worker-1 may have Talos 1.13.1 installed for its next reboot, left by a run \
         that was reset or stopped; a new run would install over it: reboot the node first (it \
         boots what is installed)"
    );
    assert_eq!(waiting.record, Some(kept.clone()));
    // Rebooted since: nothing is pending, and the run starts.
    let mut rebooted_cluster = talos_cluster("1.13.0");
    rebooted_cluster.nodes[1] = rebooted("worker-1", NodeRole::Worker, "1.13.1");
    let mut answers = talos_answers("1.13.0");
    answers.cluster = Ok(rebooted_cluster);
    let (_, started) = drive::<Talos>(
        &annotations(&[("talos-target", "1.13.1")]),
        Some(kept),
        Gates::default(),
        answers,
    );
    assert!(
        told(&started).contains(&Reason::UpgradeStarted),
        "{started:?}"
    );
}

/// Every Event reason of a pass: published with the calls, and still to publish.
fn told<K: Kind>(conclusion: &Conclusion<K>) -> Vec<Reason> {
    let mut all = conclusion.announced.clone();
    all.extend(reasons(&conclusion.notes));
    all
}

#[test]
fn a_target_changed_mid_run_finishes_the_nodes_in_flight_before_deciding_the_new_one() {
    // Explorer seed 13: the old run's node in flight was dropped (left cordoned, installed over).
    let answers = worker_1_rebooting();
    let (asked, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.1")]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(asked, [Asked::Cluster], "no call for the new target");
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert_eq!(
        conclusion.report.message,
        "Talos target changed to 1.12.1: finishing worker-1 before stopping"
    );
    assert_eq!(conclusion.record, Some(talos_run_in_flight()));

    // worker-1 back: the old run is forgotten and the new value decided at once.
    let mut back = talos_cluster("1.11.6");
    back.nodes[1] = rebooted("worker-1", NodeRole::Worker, "1.12.0");
    let mut answers = talos_answers("1.11.6");
    answers.cluster = Ok(back);
    let (_, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.1")]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(
        conclusion.report.message,
        "Talos target changed to 1.12.1: the node(s) in flight are done; deciding 1.12.1"
    );
    assert_eq!(conclusion.record, None);
    assert_eq!(conclusion.revisit, Revisit::Now);
}

#[test]
fn a_resume_set_while_nothing_failed_is_consumed() {
    // Explorer seed 797: left in place, it resumed a later failure the user never saw.
    let answers = worker_1_rebooting();
    let (_, conclusion) = drive::<Talos>(
        &annotations(&[("talos-target", "1.12.0"), ("resume", "true")]),
        Some(talos_run_in_flight()),
        Gates::default(),
        answers,
    );
    assert_eq!(conclusion.report.status, UpgradeStatus::InProgress);
    assert!(
        conclusion.report.consumed.contains(&annotations::RESUME),
        "{:?}",
        conclusion.report.consumed
    );
}

/// [`talos_answers`] on 1.11.6 with worker-1 down (rebooting).
fn worker_1_rebooting() -> Answers<Talos> {
    let mut rebooting = talos_cluster("1.11.6");
    rebooting.nodes[1].talos = TalosState::Unreachable {
        reason: "connection refused".into(),
    };
    let mut answers = talos_answers("1.11.6");
    answers.cluster = Ok(rebooting);
    answers
}

#[test]
fn a_release_newer_than_every_known_one_is_refused_unless_allowed() {
    // Talos 1.13.0 is newer than the guide's releases (1.11.6, 1.12.0).
    let pairs = [("talos-target", "1.13.0")];
    let (asked, refused) = drive_with::<Talos>(
        strict_guide_catalog(),
        &annotations(&pairs),
        None,
        Gates::default(),
        talos_answers("1.12.0"),
    );
    assert_eq!(asked, [Asked::Cluster], "no call");
    assert_eq!(refused.report.status, UpgradeStatus::Failed);
    assert_eq!(
        refused.report.message,
        "Talos upgrade refused: Talos 1.13.0 is an unknown release; the newest known is 1.12.0. Set \
         a known release, add it to the release catalog (--release-catalog, or live sources), or \
         start the controller with --allow-unknown-releases. No node was touched."
    );
    assert_eq!(reasons(&refused.notes), [Reason::InvalidTarget]);
    let (_, started) = drive_with::<Talos>(
        strict_guide_catalog().allowing_unknown(true),
        &annotations(&pairs),
        None,
        Gates::default(),
        talos_answers("1.12.0"),
    );
    assert!(
        told(&started).contains(&Reason::UpgradeStarted),
        "{started:?}"
    );
    // The same for Kubernetes: 1.36.0 is newer than the guide's 1.35.0.
    let (_, refused) = drive_with::<Kubernetes>(
        strict_guide_catalog(),
        &annotations(&[("kubernetes-target", "1.36.0")]),
        None,
        Gates::default(),
        kube_answers("1.13.0", "1.35.0"),
    );
    assert!(
        refused
            .report
            .message
            .contains("Kubernetes 1.36.0 is an unknown release; the newest known is 1.35.0"),
        "{}",
        refused.report.message
    );
}
