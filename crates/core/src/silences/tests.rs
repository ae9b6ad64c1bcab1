use super::*;
use crate::holds::RunGates;
use crate::run::NodeRole;
use crate::talos::NodeProgress;

fn at(text: &str) -> Timestamp {
    text.parse().unwrap()
}

const NOW: &str = "2026-11-28T12:00:00Z";

fn issued() -> NodeStep {
    NodeStep::Issued {
        at: at(NOW),
        boot_id: "b".into(),
        from_version: "1.11.6".into(),
        installer_image: "i".into(),
        lifecycle: None,
        unanswered: false,
        install_unconfirmed: false,
    }
}

fn done() -> NodeStep {
    NodeStep::Done {
        at: at(NOW),
        started_at: Some(at(NOW)),
    }
}

/// A run of w1 (done), w2 (in flight) and cp1 (pending), unless `steps` says otherwise.
fn run(steps: [NodeStep; 3]) -> Run {
    let names = ["w1", "w2", "cp1"];
    Run {
        requested: "v1.12.0".into(),
        target: "1.12.0".into(),
        started_at: at("2026-11-28T11:00:00Z"),
        outcome: None,
        previous: Default::default(),
        rollback: None,
        nodes: names
            .iter()
            .zip(steps)
            .map(|(name, step)| NodeProgress {
                name: name.to_string(),
                role: NodeRole::Worker,
                step,
            })
            .collect(),
        gates: RunGates::default(),
    }
}

fn going() -> Run {
    run([done(), issued(), NodeStep::Pending])
}

const CLUSTER: ClusterIdentity<'static> = ClusterIdentity {
    names: ClusterNames {
        namespace: "tenant",
        cluster: "prod",
        cluster_id: "prod-id",
    },
    uid: "u1",
};

fn key(scope: Scope) -> SilenceKey {
    SilenceKey {
        namespace: "tenant".into(),
        name: "prod".into(),
        uid: "u1".into(),
        run: "1.12.0@2026-11-28T11:00:00Z".into(),
        scope,
    }
}

fn eq(name: &str, value: &str) -> Matcher {
    Matcher {
        name: name.into(),
        value: value.into(),
        is_regex: false,
        is_equal: true,
    }
}

fn re(name: &str, value: &str) -> Matcher {
    Matcher {
        is_regex: true,
        ..eq(name, value)
    }
}

fn view(run: Option<&Run>) -> RunView<'_> {
    RunView {
        run,
        requested: Some("v1.12.0"),
        paused: false,
    }
}

#[test]
fn modes_parse() {
    for (text, mode) in [
        ("off", SilenceMode::Off),
        (" Node ", SilenceMode::Node),
        ("RUN", SilenceMode::Run),
    ] {
        assert_eq!(SilenceMode::parse(text), Ok(mode), "{text}");
    }
    for bad in ["nodes", "true", "on", "run,node"] {
        assert_eq!(SilenceMode::parse(bad), Err(MODES.to_string()), "{bad}");
    }
    assert_eq!(SilenceMode::or_default(None), SilenceMode::Node);
}

#[test]
fn operator_matchers_parse() {
    assert_eq!(
        SilenceConfig::parse_matchers(r#"{cluster="{clusterId}", env!="dev",team=~"a|b"}"#),
        Ok(vec![
            eq("cluster", "{clusterId}"),
            Matcher {
                is_equal: false,
                ..eq("env", "dev")
            },
            re("team", "a|b"),
        ])
    );
    assert_eq!(
        SilenceConfig::parse_matchers(r#"x="a\"b""#),
        Ok(vec![eq("x", r#"a"b"#)])
    );
    assert_eq!(SilenceConfig::parse_matchers(""), Ok(vec![]));
    for (bad, words) in [
        ("cluster=prod", "double-quoted"),
        (r#"{cluster="prod""#, "does not close"),
        (r#"1x="a""#, "label name"),
        (r#"x=="a""#, "double-quoted"),
        (r#"x="a" y="b""#, "expected ','"),
    ] {
        let error = SilenceConfig::parse_matchers(bad).expect_err(bad);
        assert!(error.contains(words), "{bad}: {error}");
    }
    assert_eq!(
        SilenceConfig::parse_node_label(" kubernetes_node "),
        Ok("kubernetes_node".into())
    );
    assert!(SilenceConfig::parse_node_label("node-name").is_err());
}

#[test]
fn keys_round_trip_through_the_comment_and_only_ours_are_found() {
    for scope in [Scope::Run, Scope::Node("w2".into())] {
        let key = key(scope);
        let comment = key.comment();
        assert_eq!(
            SilenceKey::parse(CREATED_BY, &comment),
            Some(key),
            "{comment}"
        );
        assert_eq!(SilenceKey::parse("alice", &comment), None, "someone else's");
    }
    assert_eq!(SilenceKey::parse(CREATED_BY, "maintenance"), None);
    assert!(key(Scope::Node("w2".into())).comment().starts_with(
        "Talos upgrade of node w2 of cluster tenant/prod by talos-upgrade-controller"
    ));
}

#[test]
fn what_each_mode_wants() {
    let with_extra = SilenceConfig {
        node_label: "node".into(),
        extra: vec![eq("cluster", "{clusterId}"), re("ns", "{namespace}|x.y")],
    };
    let plain = SilenceConfig::default();
    let going_run = going();
    let two_in_flight = run([done(), issued(), issued()]);
    let finished = Run {
        outcome: Some(Outcome::Completed { at: at(NOW) }),
        ..going()
    };
    let failed = Run {
        outcome: Some(Outcome::Failed {
            at: at(NOW),
            node: Some("w2".into()),
            reason: "x".into(),
        }),
        ..going()
    };
    let canary = Run {
        gates: RunGates {
            canary: Some(Canary::Holding {
                since: at(NOW),
                paused_seen: false,
            }),
            ..RunGates::default()
        },
        ..run([done(), done(), NodeStep::Pending])
    };
    let between_nodes = run([done(), NodeStep::Pending, NodeStep::Pending]);
    let node = |name: &str, matchers| Wanted {
        key: key(Scope::Node(name.into())),
        matchers,
    };
    let whole_run = |matchers| Wanted {
        key: key(Scope::Run),
        matchers,
    };
    let paused = |run| RunView {
        paused: true,
        ..view(run)
    };
    let untargeted = |run| RunView {
        requested: None,
        ..view(run)
    };
    let rows: Vec<(&str, SilenceMode, &SilenceConfig, RunView<'_>, Vec<Wanted>)> = vec![
        ("no run", SilenceMode::Node, &plain, view(None), vec![]),
        (
            "off",
            SilenceMode::Off,
            &plain,
            view(Some(&two_in_flight)),
            vec![],
        ),
        (
            "node: the node in flight",
            SilenceMode::Node,
            &plain,
            view(Some(&two_in_flight)),
            vec![
                node("cp1", vec![eq("node", "cp1")]),
                node("w2", vec![eq("node", "w2")]),
            ],
        ),
        (
            "node: the operator's matchers, placeholders filled (escaped in a regex)",
            SilenceMode::Node,
            &with_extra,
            view(Some(&going_run)),
            vec![node(
                "w2",
                vec![
                    eq("node", "w2"),
                    eq("cluster", "prod-id"),
                    re("ns", "tenant|x.y"),
                ],
            )],
        ),
        (
            "node: none between nodes",
            SilenceMode::Node,
            &plain,
            view(Some(&between_nodes)),
            vec![],
        ),
        (
            "node: a paused run's node in flight",
            SilenceMode::Node,
            &plain,
            paused(Some(&going_run)),
            vec![node("w2", vec![eq("node", "w2")])],
        ),
        (
            "node: completed",
            SilenceMode::Node,
            &plain,
            view(Some(&finished)),
            vec![],
        ),
        (
            "node: failed",
            SilenceMode::Node,
            &plain,
            view(Some(&failed)),
            vec![],
        ),
        (
            "run: every node of the run",
            SilenceMode::Run,
            &plain,
            view(Some(&going_run)),
            vec![whole_run(vec![re("node", "cp1|w1|w2")])],
        ),
        (
            "run: between nodes too (a soak, a window)",
            SilenceMode::Run,
            &plain,
            view(Some(&between_nodes)),
            vec![whole_run(vec![re("node", "cp1|w1|w2")])],
        ),
        (
            "run: completed",
            SilenceMode::Run,
            &plain,
            view(Some(&finished)),
            vec![],
        ),
        (
            "run: failed",
            SilenceMode::Run,
            &plain,
            view(Some(&failed)),
            vec![],
        ),
        (
            "run: target removed, a node still in flight",
            SilenceMode::Run,
            &plain,
            untargeted(Some(&going_run)),
            vec![node("w2", vec![eq("node", "w2")])],
        ),
        (
            "run: target removed, nothing in flight",
            SilenceMode::Run,
            &plain,
            untargeted(Some(&between_nodes)),
            vec![],
        ),
        (
            "run: paused with nothing in flight waits for a person",
            SilenceMode::Run,
            &plain,
            paused(Some(&between_nodes)),
            vec![],
        ),
        (
            "run: the canary holding waits for a person",
            SilenceMode::Run,
            &plain,
            view(Some(&canary)),
            vec![],
        ),
    ];
    for (name, mode, config, view, expected) in rows {
        assert_eq!(wanted(mode, config, &CLUSTER, &view), expected, "{name}");
    }
}

#[test]
fn node_names_are_escaped_in_the_run_regex() {
    let mut dotted = going();
    dotted.nodes[0].name = "w1.example.com".into();
    let wanted = wanted(
        SilenceMode::Run,
        &SilenceConfig::default(),
        &CLUSTER,
        &view(Some(&dotted)),
    );
    assert_eq!(
        wanted[0].matchers,
        vec![re("node", r"cp1|w1\.example\.com|w2")]
    );
    assert_eq!(
        show(&wanted[0].matchers),
        r#"{node=~"cp1|w1\\.example\\.com|w2"}"#
    );
}

#[test]
fn plans() {
    let now = at(NOW);
    let until = at("2026-11-28T12:15:00Z");
    let w2 = Wanted {
        key: key(Scope::Node("w2".into())),
        matchers: vec![eq("node", "w2")],
    };
    let cp1 = Wanted {
        key: key(Scope::Node("cp1".into())),
        matchers: vec![eq("node", "cp1")],
    };
    let existing = |id: &str, wanted: &Wanted, ends_at: &str| Existing {
        id: id.into(),
        key: wanted.key.clone(),
        matchers: wanted.matchers.clone(),
        starts_at: at("2026-11-28T11:50:00Z"),
        ends_at: at(ends_at),
    };
    let fresh = existing("a", &w2, "2026-11-28T12:10:00Z");
    let ending = existing("a", &w2, "2026-11-28T12:04:00Z");
    let duplicate = existing("b", &w2, "2026-11-28T12:05:00Z");
    let other_uid = Existing {
        key: SilenceKey {
            uid: "u0".into(),
            ..w2.key.clone()
        },
        ..existing("c", &w2, "2026-11-28T12:10:00Z")
    };
    let changed_matchers = Existing {
        matchers: vec![eq("node", "w2"), eq("cluster", "prod")],
        ..existing("d", &w2, "2026-11-28T12:10:00Z")
    };
    let create = |wanted: &Wanted| Change::Create {
        wanted: wanted.clone(),
        starts_at: now,
        ends_at: until,
    };
    let expire = |existing: &Existing| Change::Expire {
        existing: existing.clone(),
    };
    // (case, the silences wanted, the ones Alertmanager has, the changes planned)
    type Row = (&'static str, Vec<Wanted>, Vec<Existing>, Vec<Change>);
    let rows: Vec<Row> = vec![
        ("nothing", vec![], vec![], vec![]),
        ("created", vec![w2.clone()], vec![], vec![create(&w2)]),
        (
            "kept while 5 min or more are left",
            vec![w2.clone()],
            vec![fresh.clone()],
            vec![],
        ),
        (
            "extended under its id and startsAt once less is left",
            vec![w2.clone()],
            vec![ending.clone()],
            vec![Change::Extend {
                id: "a".into(),
                wanted: w2.clone(),
                starts_at: ending.starts_at,
                ends_at: until,
            }],
        ),
        (
            "expired once not wanted",
            vec![],
            vec![fresh.clone()],
            vec![expire(&fresh)],
        ),
        (
            "a duplicate is expired, the longest-lasting kept",
            vec![w2.clone()],
            vec![duplicate.clone(), fresh.clone()],
            vec![expire(&duplicate)],
        ),
        (
            "an earlier cluster's of the same name is expired, ours created",
            vec![w2.clone()],
            vec![other_uid.clone()],
            vec![expire(&other_uid), create(&w2)],
        ),
        (
            "other matchers (the operator's changed): expired, made again",
            vec![w2.clone()],
            vec![changed_matchers.clone()],
            vec![expire(&changed_matchers), create(&w2)],
        ),
        (
            "the next node: the last one's expired first, then the new one's created",
            vec![cp1.clone()],
            vec![fresh.clone()],
            vec![expire(&fresh), create(&cp1)],
        ),
    ];
    for (name, wanted, existing, expected) in rows {
        assert_eq!(plan(&wanted, &existing, now), expected, "{name}");
    }
}

#[test]
fn why_a_silence_is_expired() {
    let node = key(Scope::Node("w1".into()));
    let whole = key(Scope::Run);
    let going_run = going();
    let finished = Run {
        outcome: Some(Outcome::Completed { at: at(NOW) }),
        ..going()
    };
    let rows: Vec<(&SilenceKey, SilenceMode, &str, RunView<'_>, &str)> = vec![
        (
            &node,
            SilenceMode::Node,
            "u0",
            view(None),
            "an earlier cluster",
        ),
        (&node, SilenceMode::Node, "u1", view(None), "its run ended"),
        (
            &whole,
            SilenceMode::Run,
            "u1",
            view(Some(&finished)),
            "the run completed",
        ),
        (
            &node,
            SilenceMode::Node,
            "u1",
            view(Some(&going_run)),
            "node w1 is upgraded",
        ),
        (
            &node,
            SilenceMode::Off,
            "u1",
            view(Some(&going_run)),
            "annotation is off",
        ),
        (
            &whole,
            SilenceMode::Run,
            "u1",
            RunView {
                requested: None,
                ..view(Some(&going_run))
            },
            "target was removed",
        ),
    ];
    for (key, mode, uid, view, words) in rows {
        let why = why_expired(key, mode, uid, &view);
        assert!(why.contains(words), "{words}: {why}");
    }
}
