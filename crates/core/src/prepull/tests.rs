use std::time::Duration;

use jiff::Timestamp;

use super::*;

const IMAGE: &str = "ghcr.io/siderolabs/installer:v1.13.2";
const RETRY: Duration = Duration::from_secs(30);

fn at(text: &str) -> Timestamp {
    text.parse().expect("timestamp")
}

fn up(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        seen: Seen::Up {
            image: Some(IMAGE.into()),
        },
    }
}

fn unread(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        seen: Seen::Up { image: None },
    }
}

fn down(name: &str) -> Candidate {
    Candidate {
        name: name.into(),
        seen: Seen::Unreachable {
            reason: "connection refused".into(),
        },
    }
}

fn recorded(name: &str, state: PullState) -> PrePullNode {
    PrePullNode {
        name: name.into(),
        installer_image: IMAGE.into(),
        state,
    }
}

fn pulling() -> PullState {
    PullState::Pulling { failed: None }
}

fn failed_at(time: &str, failures: u32) -> PullState {
    PullState::Pulling {
        failed: Some(PullFailure {
            at: at(time),
            reason: "rpc error: code = Unavailable".into(),
            failures,
        }),
    }
}

fn pulled() -> PullState {
    PullState::Pulled {
        at: at("2026-11-28T10:00:00Z"),
    }
}

/// Which nodes pull now, whether the pre-pull finishes, and what the message says, from the record
/// and what the pass sees.
#[test]
fn which_nodes_pull_now_and_when_the_pre_pull_is_done() {
    let now = at("2026-11-28T10:01:00Z");
    struct Case {
        name: &'static str,
        record: Vec<PrePullNode>,
        candidates: Vec<Candidate>,
        pulls: &'static [&'static str],
        finished: bool,
        message: Option<&'static str>,
    }
    let cases = [
        Case {
            name: "a new run pulls on every node at once",
            record: vec![],
            candidates: vec![up("w-1"), up("w-2"), up("cp-1")],
            pulls: &["w-1", "w-2", "cp-1"],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 3 nodes before upgrading any (0/3 pulled)",
            ),
        },
        Case {
            name: "nothing to upgrade: done at once, nothing announced",
            record: vec![],
            candidates: vec![],
            pulls: &[],
            finished: false,
            message: None,
        },
        Case {
            name: "pulls recorded done are never made again",
            record: vec![recorded("w-1", pulled()), recorded("w-2", pulling())],
            candidates: vec![up("w-1"), up("w-2")],
            pulls: &["w-2"],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 2 nodes before upgrading any (1/2 pulled)",
            ),
        },
        Case {
            name: "every pull done: the pre-pull is over",
            record: vec![recorded("w-1", pulled()), recorded("w-2", pulled())],
            candidates: vec![up("w-1"), up("w-2")],
            pulls: &[],
            finished: true,
            message: None,
        },
        Case {
            name: "a node no longer a candidate (held, gone, upgraded) does not count",
            record: vec![recorded("w-1", pulled()), recorded("w-2", pulling())],
            candidates: vec![up("w-1")],
            pulls: &[],
            finished: true,
            message: None,
        },
        Case {
            name: "a failed pull waits its retry interval",
            record: vec![recorded("w-1", failed_at("2026-11-28T10:00:50Z", 1))],
            candidates: vec![up("w-1")],
            pulls: &[],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 1 node before upgrading any (0/1 pulled): \
                 w-1's pull failed (rpc error: code = Unavailable), tried 1 of 3 times; trying again at 10:01:20 UTC",
            ),
        },
        Case {
            name: "and is made again after it",
            record: vec![recorded("w-1", failed_at("2026-11-28T10:00:00Z", 2))],
            candidates: vec![up("w-1")],
            pulls: &["w-1"],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 1 node before upgrading any (0/1 pulled): \
                 w-1's pull failed (rpc error: code = Unavailable), tried 2 of 3 times; trying again at 10:00:30 UTC",
            ),
        },
        Case {
            name: "an unreachable node holds the pre-pull; the others pull",
            record: vec![],
            candidates: vec![down("w-1"), up("w-2")],
            pulls: &["w-2"],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 2 nodes before upgrading any (0/2 pulled): \
                 node w-1's Talos API is unreachable (connection refused); holding before pulling on it",
            ),
        },
        Case {
            name: "a node missing from the look holds the pre-pull, never counts as pulled",
            record: vec![recorded("w-2", pulled())],
            candidates: vec![
                Candidate {
                    name: "w-1".into(),
                    seen: Seen::Missing,
                },
                up("w-2"),
            ],
            pulls: &[],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 2 nodes before upgrading any (1/2 pulled): \
                 node w-1 is not in the cluster's node list; holding before pulling on it",
            ),
        },
        Case {
            name: "a node whose machine config was not read waits for it",
            record: vec![],
            candidates: vec![unread("w-1")],
            pulls: &[],
            finished: false,
            message: Some(
                "Pulling the installer images on 1 node before upgrading any (0/1 pulled): \
                 reading node w-1's machine config for its installer image",
            ),
        },
        Case {
            name: "a node recorded pulling needs no fresh read of its config",
            record: vec![recorded("w-1", pulling())],
            candidates: vec![unread("w-1")],
            pulls: &["w-1"],
            finished: false,
            message: Some(
                "Pulling ghcr.io/siderolabs/installer:v1.13.2 on 1 node before upgrading any (0/1 pulled)",
            ),
        },
    ];
    for case in cases {
        let mut prepull = PrePull {
            nodes: case.record,
            done_at: None,
        };
        let plan = decide(&mut prepull, &case.candidates, RETRY, now);
        let pulls: Vec<&str> = plan.pulls.iter().map(|p| p.node.as_str()).collect();
        assert_eq!(pulls, case.pulls, "{}", case.name);
        assert_eq!(plan.finished.is_some(), case.finished, "{}", case.name);
        assert_eq!(plan.message.as_deref(), case.message, "{}", case.name);
        // Write-ahead: every pull made is in the record, not done, before it is made.
        for pull in &plan.pulls {
            assert!(
                matches!(
                    prepull.node(&pull.node).map(|n| &n.state),
                    Some(PullState::Pulling { .. })
                ),
                "{}",
                case.name
            );
        }
        assert_eq!(
            prepull.is_done(),
            case.message.is_none(),
            "{}: done exactly when there is no message",
            case.name
        );
    }
}

#[test]
fn a_done_pre_pull_decides_nothing_more() {
    let mut prepull = PrePull {
        nodes: vec![],
        done_at: Some(at("2026-11-28T10:00:00Z")),
    };
    // A node that joined after it pulls before its own upgrade, not here.
    let plan = decide(
        &mut prepull,
        &[up("w-9")],
        RETRY,
        at("2026-11-28T11:00:00Z"),
    );
    assert_eq!(plan, Plan::default());
    assert!(prepull.nodes.is_empty());
}

/// A failure that may pass gets [`ATTEMPTS`] attempts, then the run fails on it; `resume` gives every
/// pull not done its attempts afresh and keeps the pulls done.
#[test]
fn failed_attempts_are_counted_and_resume_starts_them_afresh() {
    let now = at("2026-11-28T10:00:00Z");
    let mut prepull = PrePull {
        nodes: vec![recorded("w-1", pulling()), recorded("w-2", pulled())],
        done_at: None,
    };
    let answers: Vec<bool> = (0..ATTEMPTS)
        .map(|_| prepull.failed("w-1", "Unavailable", now))
        .collect();
    assert_eq!(answers, [true, true, false]);
    assert!(!prepull.failed("w-9", "not in the record", now));
    prepull.resume();
    assert_eq!(prepull.node("w-1").map(|n| &n.state), Some(&pulling()));
    assert_eq!(prepull.node("w-2").map(|n| &n.state), Some(&pulled()));
    assert!(!prepull.all_pulled());
    prepull.pulled("w-1", now);
    assert!(prepull.all_pulled());
}

#[test]
fn the_record_round_trips_and_stays_out_of_runs_without_it() {
    assert_eq!(
        serde_json::to_value(PrePull::default()).expect("json"),
        serde_json::json!({})
    );
    let prepull = PrePull {
        nodes: vec![
            recorded("w-1", failed_at("2026-11-28T10:00:00Z", 1)),
            recorded("w-2", pulled()),
        ],
        done_at: None,
    };
    let json = serde_json::to_value(&prepull).expect("json");
    assert_eq!(json["nodes"][0]["pull"], "pulling");
    assert_eq!(json["nodes"][0]["failed"]["failures"], 1);
    assert_eq!(json["nodes"][1]["pull"], "pulled");
    assert_eq!(json["nodes"][1]["installerImage"], IMAGE);
    assert_eq!(
        serde_json::from_value::<PrePull>(json).expect("back"),
        prepull
    );
}

#[test]
fn the_failure_names_the_image_the_answer_and_what_to_do() {
    assert_eq!(
        failure(IMAGE, "NotFound: not found", 1),
        "could not pull its installer ghcr.io/siderolabs/installer:v1.13.2: NotFound: not found; \
         the run stopped before upgrading any node (none was cordoned or rebooted): fix the image or \
         the registry, then set resume to pull again"
    );
    assert!(failure(IMAGE, "Unavailable", 3).contains("(tried 3 times): Unavailable"));
}

/// A node's install skips its own pull only for the image it pulled, and only while Talos surely
/// keeps it.
#[test]
fn a_pull_is_fresh_for_its_image_for_a_while() {
    let pulled_at = at("2026-11-28T10:00:00Z");
    let prepull = PrePull {
        nodes: vec![
            recorded("w-1", PullState::Pulled { at: pulled_at }),
            recorded("w-2", pulling()),
        ],
        done_at: Some(pulled_at),
    };
    let cases = [
        ("w-1", IMAGE, "2026-11-28T10:10:00Z", true),
        ("w-1", IMAGE, "2026-11-28T10:29:59Z", true),
        ("w-1", IMAGE, "2026-11-28T10:30:00Z", false),
        (
            "w-1",
            "mirror.local/installer:v1.13.2",
            "2026-11-28T10:10:00Z",
            false,
        ),
        ("w-2", IMAGE, "2026-11-28T10:10:00Z", false),
        ("w-3", IMAGE, "2026-11-28T10:10:00Z", false),
    ];
    for (node, image, now, fresh) in cases {
        assert_eq!(
            prepull.fresh(node, image, at(now)),
            fresh,
            "{node} {image} {now}"
        );
    }
}
