use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;

use super::{LastLook, acknowledgement};
use crate::annotations::UpgradeStatus;
use crate::intent::UpgradeIntent;
use crate::kubernetes::{KubeRun, Step, StepProgress, StepState};
use crate::run::Outcome;
use crate::talos::{Run, TalosVersions};
use crate::versions::{KubernetesVersion, TalosVersion};

const MAX_AGE: Duration = Duration::from_secs(20 * 60);

fn now() -> Timestamp {
    "2026-11-27T06:00:00Z".parse().expect("timestamp")
}

fn look(lowest: &str, highest: &str, kubernetes: Option<&str>, minutes_ago: i64) -> LastLook {
    LastLook {
        versions: TalosVersions {
            range: Some((
                TalosVersion::parse(lowest).expect("lowest"),
                TalosVersion::parse(highest).expect("highest"),
            )),
            kubernetes: kubernetes.map(|v| KubernetesVersion::parse(v).expect("kubelet")),
        },
        at: now() - jiff::SignedDuration::from_mins(minutes_ago),
    }
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(key, value)| (format!("upgrade.vitistack.io/{key}"), value.to_string()))
        .collect()
}

fn talos_run(requested: &str, finished: bool) -> Run {
    Run {
        requested: requested.to_string(),
        target: requested.trim_start_matches('v').to_string(),
        started_at: now(),
        outcome: finished.then(|| Outcome::Completed { at: now() }),
        gates: Default::default(),
        previous: Default::default(),
        rollback: None,
        nodes: Vec::new(),
    }
}

fn kubernetes_run_under_way() -> KubeRun {
    KubeRun {
        requested: "1.35.0".into(),
        target: "1.35.0".into(),
        from: "1.34.1".into(),
        started_at: now(),
        outcome: None,
        steps: vec![StepProgress {
            step: Step::Manifests,
            state: StepState::Pending,
        }],
        etcd_snapshot: None,
    }
}

struct Case {
    what: &'static str,
    annotations: BTreeMap<String, String>,
    talos: Option<Run>,
    kubernetes: Option<KubeRun>,
    last: Option<LastLook>,
    /// The acknowledgement's message, or `None` for no acknowledgement.
    expected: Option<&'static str>,
}

fn case(what: &'static str, pairs: &[(&str, &str)], last: Option<LastLook>) -> Case {
    Case {
        what,
        annotations: annotations(pairs),
        talos: None,
        kubernetes: None,
        last,
        expected: None,
    }
}

#[test]
fn a_new_target_the_last_look_accepts_is_acknowledged_and_nothing_else_is() {
    let fresh = || Some(look("1.11.6", "1.11.6", Some("1.34.1"), 3));
    let starting = "Starting the Talos upgrade from 1.11.6 to 1.12.0: checking the nodes";
    let cases = [
        case("a new valid target", &[("talos-target", "1.12.0")], fresh()).expecting(starting),
        case(
            "written with a v and spaces",
            &[("talos-target", " v1.12.0 ")],
            fresh(),
        )
        .expecting(starting),
        case(
            "a new target after an earlier run completed",
            &[("talos-target", "1.12.0"), ("talos-status", "completed")],
            fresh(),
        )
        .with_talos_run(talos_run("1.11.6", true))
        .expecting(starting),
        case("no target", &[], fresh()),
        case("not a version", &[("talos-target", "1.12")], fresh()),
        case(
            "already shown in progress",
            &[("talos-target", "1.12.0"), ("talos-status", "in-progress")],
            fresh(),
        ),
        case(
            "this value completed already",
            &[("talos-target", "1.12.0"), ("talos-status", "completed")],
            fresh(),
        )
        .with_talos_run(talos_run("1.12.0", true)),
        case(
            "this value was refused already",
            &[("talos-target", "1.12.0"), ("talos-status", "failed")],
            fresh(),
        )
        .with_talos_run(talos_run("1.12.0", true)),
        case(
            "a run shown completed but recorded still going (its last report was not written)",
            &[("talos-target", "1.12.0"), ("talos-status", "completed")],
            fresh(),
        )
        .with_talos_run(talos_run("1.11.7", false)),
        case(
            "a Kubernetes upgrade recorded under way",
            &[("talos-target", "1.12.0"), ("talos-status", "completed")],
            fresh(),
        )
        .with_talos_run(talos_run("1.11.6", true))
        .with_kubernetes_run(kubernetes_run_under_way()),
        // `idle` is written only when no run is recorded (no target, the target removed, a reset):
        // the record is not read then, and a run decided since would show itself.
        case(
            "idle shown: the record is not asked",
            &[("talos-target", "1.12.0"), ("talos-status", "idle")],
            fresh(),
        )
        .with_talos_run(talos_run("1.12.0", true))
        .expecting(starting),
        case(
            "a Kubernetes upgrade shown in progress",
            &[
                ("talos-target", "1.12.0"),
                ("kubernetes-status", "in-progress"),
            ],
            fresh(),
        ),
        case(
            "a Kubernetes upgrade blocked on Talos",
            &[("talos-target", "1.12.0"), ("kubernetes-status", "blocked")],
            fresh(),
        )
        .expecting(starting),
        case("no last look", &[("talos-target", "1.12.0")], None),
        case(
            "a last look older than allowed",
            &[("talos-target", "1.12.0")],
            Some(look("1.11.6", "1.11.6", Some("1.34.1"), 21)),
        ),
        case(
            "a last look from the future",
            &[("talos-target", "1.12.0")],
            Some(look("1.11.6", "1.11.6", Some("1.34.1"), -1)),
        ),
        case(
            "every node already on the target",
            &[("talos-target", "1.12.0")],
            Some(look("1.12.0", "1.12.0", Some("1.34.1"), 3)),
        ),
        case(
            "a downgrade of the highest node",
            &[("talos-target", "1.12.0")],
            Some(look("1.11.6", "1.12.1", Some("1.34.1"), 3)),
        ),
        case("more than one step", &[("talos-target", "1.14.0")], fresh()),
        case(
            "the running Kubernetes is too old for the target",
            &[("talos-target", "1.12.0")],
            Some(look("1.11.6", "1.11.6", Some("1.29.10"), 3)),
        ),
        case(
            "the running Kubernetes not known",
            &[("talos-target", "1.12.0")],
            Some(look("1.11.6", "1.11.6", None, 3)),
        )
        .expecting(starting),
        case(
            "paused",
            &[("talos-target", "1.12.0"), ("paused", "true")],
            fresh(),
        ),
        case(
            "paused by an unrecognised value",
            &[("talos-target", "1.12.0"), ("paused", "yes")],
            fresh(),
        ),
        case(
            "a reset asked",
            &[
                ("talos-target", "1.12.0"),
                ("talos-reset-upgrade-state", "true"),
            ],
            fresh(),
        ),
        case(
            "a bad upgrade order",
            &[("talos-target", "1.12.0"), ("upgrade-order", "sideways")],
            fresh(),
        ),
        case(
            "a bad batch size",
            &[("talos-target", "1.12.0"), ("max-parallel-workers", "0")],
            fresh(),
        ),
    ];
    for case in cases {
        let intent = UpgradeIntent::from_annotations(&case.annotations);
        // As the reconcile does: the record is asked only when the annotations show a run.
        let report = acknowledgement(
            &case.annotations,
            &intent,
            case.last.as_ref(),
            now(),
            MAX_AGE,
        )
        .filter(|acknowledgement| {
            !acknowledgement.needs_progress()
                || acknowledgement.still_undecided(case.talos.as_ref(), case.kubernetes.as_ref())
        })
        .map(|acknowledgement| acknowledgement.report);
        assert_eq!(
            report.as_ref().map(|r| r.message.as_str()),
            case.expected,
            "{}",
            case.what
        );
        if let Some(report) = report {
            assert_eq!(report.status, UpgradeStatus::InProgress, "{}", case.what);
            // Annotations only: no condition, no phase, no versions rewritten.
            assert_eq!(report.condition_reason, None, "{}", case.what);
            assert_eq!(report.current, None, "{}", case.what);
            assert_eq!(report.available, None, "{}", case.what);
            assert!(report.consumed.is_empty(), "{}", case.what);
        }
    }
}

impl Case {
    fn with_talos_run(mut self, run: Run) -> Case {
        self.talos = Some(run);
        self
    }

    fn with_kubernetes_run(mut self, run: KubeRun) -> Case {
        self.kubernetes = Some(run);
        self
    }

    fn expecting(mut self, message: &'static str) -> Case {
        self.expected = Some(message);
        self
    }
}
