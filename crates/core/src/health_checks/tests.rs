use serde_json::json;

use super::*;

fn parse(text: &str) -> HealthChecks {
    HealthChecks::parse(text)
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .expect("checks")
}

fn one(text: &str) -> HealthCheck {
    parse(text).checks.remove(0)
}

const CEPH: &str = r#"
- check: ceph
  apiVersion: ceph.rook.io/v1
  kind: CephCluster
  namespace: rook-ceph
  name: rook-ceph
  condition:
    cel: object.status.ceph.health == 'HEALTH_OK'
"#;

#[test]
fn the_forms_of_a_check() {
    let ceph = one(CEPH);
    assert_eq!(ceph.name, "ceph");
    assert_eq!(
        (ceph.group.as_str(), ceph.version.as_str()),
        ("ceph.rook.io", "v1")
    );
    assert_eq!(ceph.kind, "CephCluster");
    assert_eq!(ceph.namespace.as_deref(), Some("rook-ceph"));
    assert_eq!(ceph.objects, Objects::Named("rook-ceph".into()));
    let Condition::Cel(expression) = &ceph.condition else {
        panic!("{:?}", ceph.condition)
    };
    assert_eq!(
        expression.source(),
        "object.status.ceph.health == 'HEALTH_OK'"
    );

    // JSON, the string form of cel:, a selector, a default name, the core group.
    let checks = parse(
        r#"[{"apiVersion": "apps/v1", "kind": "Deployment", "namespace": "shop",
             "selector": "app=web,tier in (front, back),!legacy", "condition": "available"},
            {"apiVersion": "v1", "kind": "Node", "name": "worker-1", "condition": "Ready"},
            {"apiVersion": "v1", "kind": "ConfigMap", "namespace": "a", "name": "b",
             "condition": "CEL: object.data.state == 'ok'"}]"#,
    );
    let [web, node, config] = &checks.checks[..] else {
        panic!("{checks:?}")
    };
    assert_eq!(web.name, "Deployment app=web,tier in (front, back),!legacy");
    assert_eq!(web.condition, Condition::Status(ConditionType::Available));
    assert_eq!(node.name, "Node/worker-1");
    assert_eq!((node.group.as_str(), node.version.as_str()), ("", "v1"));
    assert_eq!(node.namespace, None);
    assert!(
        matches!(&config.condition, Condition::Cel(e) if e.source() == "object.data.state == 'ok'")
    );

    // An empty list is no checks.
    assert_eq!(HealthChecks::parse("[]"), Ok(None));
}

/// Each mistake is refused, naming the check and the problem.
#[test]
fn invalid_checks_are_refused_naming_the_check() {
    let base = "apiVersion: v1, kind: ConfigMap, namespace: a, name: b";
    let cases: Vec<(String, &str)> = vec![
        ("check: [".into(), "it is not YAML or JSON"),
        ("check: ceph".into(), "it is not a list"),
        ("- just a string".into(), "health check #1 is not a mapping"),
        (
            format!("[{{check: x, {base}, condition: Ready, namepsace: c}}]"),
            "health check \"x\": unknown key \"namepsace\"",
        ),
        (
            "[{check: x, kind: ConfigMap, name: b, condition: Ready}]".into(),
            "health check \"x\": apiVersion is missing",
        ),
        (
            "[{apiVersion: v1, name: b, condition: Ready}]".into(),
            "health check #1: kind is missing",
        ),
        (
            "[{apiVersion: apps/v1/x, kind: D, name: b, condition: Ready}]".into(),
            "is not <group>/<version>",
        ),
        (
            "[{apiVersion: v1, kind: Config-Map, name: b, condition: Ready}]".into(),
            "is not a kind",
        ),
        (
            format!("[{{check: x, {base}, selector: app=web, condition: Ready}}]"),
            "health check \"x\": both name and selector are given",
        ),
        (
            "[{apiVersion: v1, kind: ConfigMap, condition: Ready}]".into(),
            "neither name nor selector is given",
        ),
        (
            "[{apiVersion: v1, kind: Pod, selector: 'app in (a', condition: Ready}]".into(),
            "a '(' is not closed",
        ),
        (
            "[{apiVersion: v1, kind: Pod, selector: 'app=web,,x', condition: Ready}]".into(),
            "an empty requirement",
        ),
        (
            "[{apiVersion: v1, kind: Pod, selector: 'app=-web', condition: Ready}]".into(),
            "\"-web\" is not a label value",
        ),
        (
            "[{apiVersion: v1, kind: Pod, selector: 'app within (a)', condition: Ready}]".into(),
            "is not key, !key",
        ),
        (
            format!("[{{{base}}}]"),
            "health check #1: condition is missing",
        ),
        (
            format!("[{{{base}, condition: Healthy}}]"),
            "condition \"Healthy\" is not Ready, Available or cel:",
        ),
        (
            format!("[{{check: x, {base}, condition: 'cel: object.status.'}}]"),
            "health check \"x\": the CEL expression does not compile: 1:",
        ),
        (
            format!("[{{check: x, {base}, condition: 'cel: obj.status.ready'}}]"),
            "the CEL expression never reads object",
        ),
        (
            format!("[{{{base}, condition: {{cel: '   '}}}}]"),
            "cel: has no expression",
        ),
        (
            format!("[{{{base}, condition: {{expr: 'object.a'}}}}]"),
            "condition is a mapping other than {cel: <expression>}",
        ),
        (
            format!(
                "[{{{base}, condition: 'cel: {}'}}]",
                vec!["object.a"; 200].join(" && ")
            ),
            "more than 1024",
        ),
        (
            format!(
                "[{{{base}, condition: 'cel: {}object.a{}'}}]",
                "(".repeat(40),
                ")".repeat(40)
            ),
            "Recursion limit",
        ),
        (
            "[{apiVersion: v1, kind: Secret, namespace: a, name: b, condition: 'cel: has(object.data)'}]"
                .into(),
            "health checks do not read Secrets",
        ),
        (
            format!("[{{check: x, {base}, condition: Ready}}, {{check: x, {base}, condition: Ready}}]"),
            "two health checks are named \"x\"",
        ),
        (
            format!("[{}]", vec![format!("{{{base}, condition: Ready}}"); 17].join(",")),
            "17 checks, at most 16",
        ),
        (
            format!("[{{check: x, {base}, namespace: Shop, condition: Ready}}]").replace("namespace: a, ", ""),
            "namespace \"Shop\" is not a namespace name",
        ),
    ];
    for (text, expected) in cases {
        let error = HealthChecks::parse(&text).expect_err(&text);
        assert!(
            error.contains(expected),
            "{text}\n  gave: {error}\n  want: {expected}"
        );
    }
}

fn object(namespace: &str, name: &str, status: serde_json::Value) -> Json {
    json!({"metadata": {"namespace": namespace, "name": name}, "status": status})
}

fn conditions(kind: &str, status: &str, reason: &str) -> serde_json::Value {
    json!({"conditions": [{"type": kind, "status": status, "reason": reason, "message": "because"}]})
}

/// Which check fails, with which object and why.
#[test]
fn evaluation() {
    let ceph = one(CEPH);
    let web = one(
        "[{check: web, apiVersion: apps/v1, kind: Deployment, namespace: shop, selector: app=web, \
          condition: Available}]",
    );
    let all_web = one(
        "[{check: web, apiVersion: apps/v1, kind: Deployment, selector: app=web, condition: Available}]",
    );
    let healthy_ceph = object(
        "rook-ceph",
        "rook-ceph",
        json!({"ceph": {"health": "HEALTH_OK"}}),
    );
    let warn_ceph = object(
        "rook-ceph",
        "rook-ceph",
        json!({"ceph": {"health": "HEALTH_WARN"}}),
    );
    let fresh_ceph = object("rook-ceph", "rook-ceph", json!({}));
    let available = |name: &str| object("shop", name, conditions("Available", "True", "Ok"));
    let unavailable = |name: &str| {
        object(
            "shop",
            name,
            conditions("Available", "False", "MinimumReplicasUnavailable"),
        )
    };
    let cases: Vec<(&HealthCheck, Read, Outcome)> = vec![
        (&ceph, Read::Objects(vec![healthy_ceph]), Outcome::Healthy),
        (
            &ceph,
            Read::Objects(vec![warn_ceph]),
            Outcome::Failing(
                "CephCluster rook-ceph/rook-ceph: object.status.ceph.health == 'HEALTH_OK' is false"
                    .into(),
            ),
        ),
        (
            &ceph,
            Read::Objects(vec![fresh_ceph]),
            Outcome::Unknown(
                "CephCluster rook-ceph/rook-ceph: object.status.ceph.health == 'HEALTH_OK': no such \
                 key: ceph (has() tells whether a field is there)"
                    .into(),
            ),
        ),
        (
            &ceph,
            Read::NotFound,
            Outcome::Unknown("CephCluster rook-ceph/rook-ceph not found".into()),
        ),
        (
            &ceph,
            Read::Failed("no kind CephCluster in ceph.rook.io/v1".into()),
            Outcome::Unknown("no kind CephCluster in ceph.rook.io/v1".into()),
        ),
        (
            &web,
            Read::Objects(vec![available("web-1"), available("web-2")]),
            Outcome::Healthy,
        ),
        // The first failing object by name, and how many more.
        (
            &web,
            Read::Objects(vec![unavailable("web-3"), available("web-1"), unavailable("web-2")]),
            Outcome::Failing(
                "Deployment shop/web-2: condition Available is False (MinimumReplicasUnavailable: \
                 because); and 1 more of the 3 Deployments fail"
                    .into(),
            ),
        ),
        (
            &web,
            Read::Objects(vec![object("shop", "web-1", json!({}))]),
            Outcome::Failing("Deployment shop/web-1: has no Available condition".into()),
        ),
        // A selector that matches nothing holds: a typo in it must not pass.
        (
            &web,
            Read::Objects(vec![]),
            Outcome::Unknown(
                "no Deployment in namespace shop matches the selector app=web".into(),
            ),
        ),
        (
            &all_web,
            Read::Objects(vec![]),
            Outcome::Unknown("no Deployment matches the selector app=web".into()),
        ),
    ];
    for (i, (check, read, expected)) in cases.into_iter().enumerate() {
        assert_eq!(evaluate(check, &read), expected, "case {i}: {read:?}");
    }
}

/// What an expression may return and how its failures read: never a value of the object.
#[test]
fn cel_results() {
    let object = json!({
        "metadata": {"name": "s"},
        "status": {"ready": 3, "wanted": 3, "phase": "Running", "secret": "hunter2", "list": [1]},
    });
    let cases = [
        ("object.status.ready == object.status.wanted", Ok(true)),
        ("object.status.ready >= 4", Ok(false)),
        ("object.status.phase.lowerAscii() == 'running'", Ok(true)),
        ("has(object.status.missing)", Ok(false)),
        ("object.status.phase.matches('^Run')", Ok(true)),
        (
            "object.status.list.exists(x, x == 1) && object.status.list.all(x, x > 0)",
            Ok(true),
        ),
        (
            "object.status.ready",
            Err("the expression returned a int, not a bool"),
        ),
        ("object.status.ready - 4 < 0", Ok(true)),
        ("object.status.secret + 1 == 2", Err("does not apply")),
        ("object.status.secret == object.status.list", Ok(false)),
        ("object.status.secret > 1", Err("no matching overload")),
        (
            "object.status.list[3] == 1",
            Err("an index is out of bounds"),
        ),
        ("object.nope.x", Err("no such key: nope")),
        ("object.status.ready == other", Err("other is not defined")),
    ];
    for (source, expected) in cases {
        let expression = Expression::compile(source).expect(source);
        let got = expression.evaluate(&object);
        match (&got, expected) {
            (Ok(value), Ok(want)) => assert_eq!(*value, want, "{source}"),
            (Err(why), Err(want)) => {
                assert!(why.contains(want), "{source}: {why}");
                assert!(!why.contains("hunter2"), "{source}: {why}");
            }
            _ => panic!("{source}: {got:?}, want {expected:?}"),
        }
    }
}

/// Deep expressions neither overflow the stack of a small thread nor abort: the limits refuse what
/// would, and what passes runs on a stack of its own.
#[test]
fn deep_expressions_are_safe_on_a_small_stack() {
    let chain = vec!["1"; 500].join("+");
    let sources = [
        format!("object.a == {chain}"),
        format!("object{}", "['b']".repeat(200)),
        format!("{}object.a{}", "(".repeat(31), ")".repeat(31)),
    ];
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            for source in sources {
                if let Ok(expression) = Expression::compile(&source) {
                    let _ = expression.evaluate(&json!({"a": 500}));
                    drop(expression);
                }
            }
        })
        .expect("thread")
        .join()
        .expect("no panic");
}

#[test]
fn the_verdict_names_the_first_check_that_holds() {
    let checks = parse(
        "[{check: a, apiVersion: v1, kind: ConfigMap, namespace: n, name: a, condition: Ready},
          {check: b, apiVersion: v1, kind: ConfigMap, namespace: n, name: b, condition: Ready},
          {check: c, apiVersion: v1, kind: ConfigMap, namespace: n, name: c, condition: Ready}]",
    );
    let [a, b, c] = &checks.checks[..] else {
        panic!()
    };
    let failing = |why: &str| Outcome::Failing(why.to_string());
    let unknown = |why: &str| Outcome::Unknown(why.to_string());
    let cases = [
        (
            vec![(a, Outcome::Healthy), (b, Outcome::Healthy)],
            ExternalCheck::Clear,
        ),
        (
            vec![
                (a, Outcome::Healthy),
                (b, failing("ConfigMap n/b: x is false")),
            ],
            ExternalCheck::Holding {
                message: "health check \"b\" failing: ConfigMap n/b: x is false".into(),
            },
        ),
        (
            vec![
                (a, unknown("ConfigMap n/a not found")),
                (b, failing("ConfigMap n/b: x is false")),
                (c, unknown("forbidden")),
            ],
            ExternalCheck::Unknown {
                reason: "health check \"a\" cannot be evaluated: ConfigMap n/a not found (also \
                         holding: \"b\", \"c\")"
                    .into(),
            },
        ),
    ];
    for (i, (outcomes, expected)) in cases.into_iter().enumerate() {
        let outcomes: Vec<(&HealthCheck, Outcome)> = outcomes;
        assert_eq!(verdict(&outcomes), expected, "case {i}");
    }
}
