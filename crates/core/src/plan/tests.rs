use super::*;

fn talos(text: &str) -> TalosVersion {
    TalosVersion::parse(text).unwrap()
}

fn kube(text: &str) -> KubernetesVersion {
    KubernetesVersion::parse(text).unwrap()
}

fn hops_text(hops: &[Hop]) -> Vec<String> {
    hops.iter().map(ToString::to_string).collect()
}

/// (start Talos, start Kubernetes, Talos target, Kubernetes target, hops or the error's sentence).
type Row = (
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    Option<&'static str>,
    Result<&'static [&'static str], &'static str>,
);

#[test]
fn plans_from_the_builtin_catalog() {
    let rows: &[Row] = &[
        // The issue's example: Talos 1.14 still runs Kubernetes 1.34, so the matrix demands no
        // Kubernetes hop before the Talos ones; Kubernetes then goes one minor at a time.
        (
            Some("1.11.6"),
            Some("1.34.1"),
            Some("1.14.1"),
            Some("1.37.0"),
            Ok(&[
                "Talos 1.11.6 → 1.13.9",
                "Talos 1.13.9 → 1.14.1",
                "Kubernetes 1.34.1 → 1.35.4",
                "Kubernetes 1.35.4 → 1.36.3",
                "Kubernetes 1.36.3 → 1.37.0",
            ]),
        ),
        // Interleaved where the matrix demands it: Talos 1.13 needs Kubernetes 1.31, 1.14 needs 1.32.
        (
            Some("1.11.0"),
            Some("1.29.0"),
            Some("1.14.1"),
            Some("1.32.0"),
            Ok(&[
                "Kubernetes 1.29.0 → 1.30.5",
                "Kubernetes 1.30.5 → 1.31.4",
                "Talos 1.11.0 → 1.13.9",
                "Kubernetes 1.31.4 → 1.32.0",
                "Talos 1.13.9 → 1.14.1",
            ]),
        ),
        (
            Some("1.12.0"),
            Some("1.30.0"),
            Some("1.14.1"),
            Some("1.33.0"),
            Ok(&[
                "Kubernetes 1.30.0 → 1.31.4",
                "Kubernetes 1.31.4 → 1.32.4",
                "Talos 1.12.0 → 1.14.1",
                "Kubernetes 1.32.4 → 1.33.0",
            ]),
        ),
        // Talos alone: the newest patch of the line the installer needs in between.
        (
            Some("1.11.6"),
            Some("1.34.1"),
            Some("1.14.1"),
            None,
            Ok(&["Talos 1.11.6 → 1.13.9", "Talos 1.13.9 → 1.14.1"]),
        ),
        (
            Some("1.10.0"),
            None,
            Some("1.14.0"),
            None,
            Ok(&["Talos 1.10.0 → 1.12.11", "Talos 1.12.11 → 1.14.0"]),
        ),
        // One step is one hop.
        (
            Some("1.12.0"),
            Some("1.34.1"),
            Some("1.14.1"),
            None,
            Ok(&["Talos 1.12.0 → 1.14.1"]),
        ),
        (
            Some("1.13.0"),
            Some("1.34.1"),
            Some("1.13.0"),
            None,
            Ok(&[]),
        ),
        // Kubernetes alone: one minor at a time, the newest patch of each.
        (
            Some("1.14.1"),
            Some("1.34.0"),
            None,
            Some("1.37.0"),
            Ok(&[
                "Kubernetes 1.34.0 → 1.35.4",
                "Kubernetes 1.35.4 → 1.36.3",
                "Kubernetes 1.36.3 → 1.37.0",
            ]),
        ),
        (
            Some("1.14.1"),
            Some("1.34.0"),
            None,
            Some("1.35.0"),
            Ok(&["Kubernetes 1.34.0 → 1.35.0"]),
        ),
        // Unreachable even by a plan.
        (
            Some("1.13.9"),
            Some("1.34.0"),
            None,
            Some("1.37.0"),
            Err(
                "No upgrade plan reaches Kubernetes 1.37.0: Talos 1.13.9 does not support Kubernetes 1.37.0. Set talos-target to a release that supports it. No node was touched.",
            ),
        ),
        (
            Some("1.11.6"),
            Some("1.29.0"),
            Some("1.14.1"),
            None,
            Err(
                "No upgrade plan reaches Talos 1.14.1: Talos 1.13.9 does not support the running Kubernetes 1.29.0, and the Kubernetes target does not go up to 1.31. Set kubernetes-target to 1.31.0 or newer. No node was touched.",
            ),
        ),
        (
            Some("1.11.6"),
            Some("1.29.0"),
            Some("1.14.1"),
            Some("1.30.0"),
            Err(
                "No upgrade plan reaches Talos 1.14.1: Talos 1.13.9 does not support the running Kubernetes 1.29.0, and the Kubernetes target does not go up to 1.31. Set kubernetes-target to 1.31.0 or newer. No node was touched.",
            ),
        ),
        // What no path fixes: the one-step rules' own sentences.
        (
            Some("1.13.0"),
            None,
            Some("1.12.0"),
            None,
            Err(
                "Downgrade from 1.13.0 to 1.12.0 is not supported: choose a target of 1.13.0 or newer",
            ),
        ),
        (
            Some("1.14.1"),
            Some("1.35.0"),
            None,
            Some("1.34.0"),
            Err(
                "Downgrade from 1.35.0 to 1.34.0 is not supported: choose a target of 1.35.0 or newer",
            ),
        ),
        (
            Some("1.13.0"),
            None,
            Some("1.15.0"),
            None,
            Err(
                "Talos upgrade refused: Talos 1.15.0 is an unknown release; the newest known is 1.14.1. Set a known release, add it to the release catalog (--release-catalog, or live sources), or start the controller with --allow-unknown-releases. No node was touched.",
            ),
        ),
        // Versions not known yet.
        (
            None,
            Some("1.34.0"),
            Some("1.14.1"),
            None,
            Err("the Talos version the cluster runs is not known yet"),
        ),
        (
            Some("1.14.1"),
            None,
            None,
            Some("1.37.0"),
            Err("the Kubernetes version the cluster runs is not known yet"),
        ),
    ];
    let catalog = Catalog::builtin();
    for (start_talos, start_kube, target_talos, target_kube, expected) in rows {
        let start = Start {
            talos: start_talos.map(talos),
            kubernetes: start_kube.map(kube),
        };
        let targets = Targets {
            talos: target_talos.map(talos),
            kubernetes: target_kube.map(kube),
        };
        let got = compute(&start, &targets, &catalog);
        let row = format!("{start_talos:?}/{start_kube:?} → {target_talos:?}/{target_kube:?}");
        match expected {
            Ok(hops) => assert_eq!(
                hops_text(&got.unwrap_or_else(|e| panic!("{row}: {e}"))),
                hops.to_vec(),
                "{row}"
            ),
            Err(message) => assert_eq!(got.unwrap_err().to_string(), *message, "{row}"),
        }
    }
}

#[test]
fn a_line_the_catalog_does_not_know_cannot_be_passed_through() {
    let catalog = Catalog::new(
        [talos("1.11.6"), talos("1.12.11"), talos("1.14.1")],
        [kube("1.34.1"), kube("1.36.0")],
    );
    let start = Start {
        talos: Some(talos("1.11.6")),
        kubernetes: Some(kube("1.34.1")),
    };
    let targets = Targets {
        talos: Some(talos("1.14.1")),
        kubernetes: None,
    };
    assert_eq!(
        compute(&start, &targets, &catalog).unwrap_err().to_string(),
        "No upgrade plan reaches Talos 1.14.1: the release catalog knows no Talos 1.13 release to upgrade through. Add one to the catalog (--release-catalog or live sources). No node was touched."
    );
    let kubernetes_only = Targets {
        talos: None,
        kubernetes: Some(kube("1.36.0")),
    };
    assert!(matches!(
        compute(&start, &kubernetes_only, &catalog),
        Err(PlanError::NoRelease {
            kind: UpgradeKind::Kubernetes,
            ..
        })
    ));
}

#[test]
fn which_hops_need_a_plan() {
    let t = |from: &str, to: &str| Hop::talos(&talos(from), &talos(to));
    let k = |from: &str, to: &str| Hop::kubernetes(&kube(from), &kube(to));
    let rows: [(Vec<Hop>, bool); 6] = [
        (vec![], false),
        (vec![t("1.12.0", "1.13.0")], false),
        (vec![t("1.12.0", "1.13.0"), k("1.33.0", "1.34.0")], false),
        (vec![k("1.33.0", "1.34.0"), t("1.12.0", "1.13.0")], true),
        (vec![t("1.11.0", "1.13.0"), t("1.13.0", "1.14.0")], true),
        (vec![k("1.33.0", "1.34.0"), k("1.34.0", "1.35.0")], true),
    ];
    for (hops, expected) in rows {
        assert_eq!(needs_plan(&hops), expected, "{:?}", hops_text(&hops));
    }
}

fn interleaved() -> Plan {
    Plan {
        talos_target: Some("1.14.1".into()),
        kubernetes_target: Some("1.32.0".into()),
        hops: compute(
            &Start {
                talos: Some(talos("1.11.0")),
                kubernetes: Some(kube("1.29.0")),
            },
            &Targets {
                talos: Some(talos("1.14.1")),
                kubernetes: Some(kube("1.32.0")),
            },
            &Catalog::builtin(),
        )
        .unwrap(),
        done: 0,
        refused: None,
    }
}

#[test]
fn each_kind_is_given_its_hop_or_its_last_finished_one() {
    let mut plan = interleaved();
    // (hops done, Talos target given, Kubernetes target given)
    let rows = [
        (0, None, Some("1.30.5")),
        (1, None, Some("1.31.4")),
        (2, Some("1.13.9"), Some("1.31.4")),
        (3, Some("1.13.9"), Some("1.32.0")),
        (4, Some("1.14.1"), Some("1.32.0")),
        (5, Some("1.14.1"), Some("1.32.0")),
    ];
    for (done, talos_given, kubernetes_given) in rows {
        plan.done = done;
        assert_eq!(
            plan.effective_target(UpgradeKind::Talos, Some("1.14.1")),
            talos_given,
            "{done}"
        );
        assert_eq!(
            plan.effective_target(UpgradeKind::Kubernetes, Some("1.32.0")),
            kubernetes_given,
            "{done}"
        );
    }
    // A kind the plan has no hop of keeps the user's value.
    let talos_only = Plan {
        hops: vec![
            Hop::talos(&talos("1.11.6"), &talos("1.13.9")),
            Hop::talos(&talos("1.13.9"), &talos("1.14.1")),
        ],
        ..interleaved()
    };
    assert_eq!(
        talos_only.effective_target(UpgradeKind::Kubernetes, Some("1.34.1")),
        Some("1.34.1")
    );
}

#[test]
fn a_hop_moves_on_only_when_its_own_run_completed() {
    let mut plan = interleaved();
    // Another kind's run, another target, or a run not completed: nothing moves.
    assert!(plan.advance(UpgradeKind::Talos, "1.30.5", true).is_empty());
    assert!(
        plan.advance(UpgradeKind::Kubernetes, "1.31.4", true)
            .is_empty()
    );
    assert!(
        plan.advance(UpgradeKind::Kubernetes, "1.30.5", false)
            .is_empty()
    );
    assert_eq!(plan.done, 0);
    let notes = plan.advance(UpgradeKind::Kubernetes, "1.30.5", true);
    assert_eq!(plan.done, 1);
    assert_eq!(
        notes
            .iter()
            .map(|note| (note.reason, note.message.as_str()))
            .collect::<Vec<_>>(),
        vec![
            (
                Reason::PlanHopFinished,
                "Finished hop 1/5: Kubernetes 1.29.0 → 1.30.5 of the upgrade plan"
            ),
            (
                Reason::PlanHopStarted,
                "Starting hop 2/5: Kubernetes 1.30.5 → 1.31.4 of the upgrade plan"
            ),
        ]
    );
    plan.done = 4;
    let notes = plan.advance(UpgradeKind::Talos, "1.14.1", true);
    assert_eq!(notes[1].reason, Reason::PlanFinished);
    assert_eq!(
        notes[1].message,
        "The upgrade plan is finished: Talos 1.14.1 and Kubernetes 1.32.0 in 5 hops"
    );
    assert!(plan.is_finished());
    assert!(plan.advance(UpgradeKind::Talos, "1.14.1", true).is_empty());
}

#[test]
fn lines_the_user_reads() {
    let mut plan = interleaved();
    assert_eq!(
        plan.computed().message,
        "Upgrade plan to Talos 1.14.1 and Kubernetes 1.32.0 in 5 hops: 1. Kubernetes 1.29.0 → 1.30.5, 2. Kubernetes 1.30.5 → 1.31.4, 3. Talos 1.11.0 → 1.13.9, 4. Kubernetes 1.31.4 → 1.32.0, 5. Talos 1.13.9 → 1.14.1"
    );
    plan.done = 2;
    assert_eq!(
        plan.progress_line(false),
        "hop 3/5: Talos 1.11.0 → 1.13.9; done: Kubernetes 1.29.0 → 1.30.5, Kubernetes 1.30.5 → 1.31.4; left: Kubernetes 1.31.4 → 1.32.0, Talos 1.13.9 → 1.14.1"
    );
    plan.done = 4;
    assert_eq!(
        plan.progress_line(true),
        "hop 5/5: Talos 1.13.9 → 1.14.1 failed; the plan stops here until resume; done: Kubernetes 1.29.0 → 1.30.5, Kubernetes 1.30.5 → 1.31.4, Talos 1.11.0 → 1.13.9, Kubernetes 1.31.4 → 1.32.0; nothing left after it"
    );
    plan.done = 5;
    assert!(
        plan.progress_line(false)
            .starts_with("finished: 1. Kubernetes")
    );
}

#[test]
fn a_kind_is_not_completed_before_its_last_hop() {
    let mut plan = interleaved();
    plan.done = 2;
    let completed = |kind| {
        let mut report = KindReport::new(kind, UpgradeStatus::Completed, "done".into());
        report.condition_reason = Some(ConditionReason::Completed);
        report
    };
    // Kubernetes finished two hops and has one left; Talos starts its first.
    let mut kubernetes = completed(UpgradeKind::Kubernetes);
    plan.shape(&mut kubernetes);
    assert_eq!(kubernetes.status, UpgradeStatus::InProgress);
    assert_eq!(
        kubernetes.condition_reason,
        Some(ConditionReason::InProgress)
    );
    assert_eq!(
        kubernetes.message,
        "Upgrade plan hop 3/5: Talos 1.11.0 → 1.13.9 in progress; next for Kubernetes: hop 4/5: Kubernetes 1.31.4 → 1.32.0"
    );
    let mut talos_idle = KindReport::new(UpgradeKind::Talos, UpgradeStatus::Idle, String::new());
    plan.shape(&mut talos_idle);
    assert_eq!(talos_idle.status, UpgradeStatus::InProgress);
    assert_eq!(
        talos_idle.message,
        "Upgrade plan hop 3/5: Talos 1.11.0 → 1.13.9: starting"
    );
    // A run in progress or failed speaks for itself.
    let mut failed = KindReport::new(UpgradeKind::Talos, UpgradeStatus::Failed, "x".into());
    plan.shape(&mut failed);
    assert_eq!(
        (failed.status, failed.message.as_str()),
        (UpgradeStatus::Failed, "x")
    );
    // Kubernetes's last hop done: completed is completed.
    plan.done = 4;
    let mut kubernetes = completed(UpgradeKind::Kubernetes);
    plan.shape(&mut kubernetes);
    assert_eq!(kubernetes.status, UpgradeStatus::Completed);
}

fn inputs<'a>(catalog: &'a Catalog, stored: Option<Plan>) -> Inputs<'a> {
    Inputs {
        mode: PlanMode::MultiHop,
        talos_target: Some("1.14.1"),
        kubernetes_target: Some("1.32.0"),
        talos_current: Some("1.11.0"),
        kubernetes_current: Some("1.29.0"),
        stored,
        resume: false,
        reset: false,
        catalog,
    }
}

#[test]
fn the_course_of_a_reconcile() {
    let catalog = Catalog::builtin();
    // A new plan is announced with its first hop.
    let Course::Follow { plan, notes } = course(&inputs(&catalog, None)) else {
        panic!("a plan");
    };
    assert_eq!(plan, interleaved());
    assert_eq!(
        notes.iter().map(|n| n.reason).collect::<Vec<_>>(),
        vec![Reason::PlanComputed, Reason::PlanHopStarted]
    );
    // The stored plan is followed as it is, whatever the catalog or the versions now say.
    let mut stored = interleaved();
    stored.done = 3;
    let other_catalog = Catalog::new([talos("1.14.1")], [kube("1.32.0")]);
    let mut moved = inputs(&other_catalog, Some(stored.clone()));
    moved.talos_current = Some("1.13.9");
    assert_eq!(
        course(&moved),
        Course::Follow {
            plan: stored.clone(),
            notes: vec![]
        }
    );
    // A changed target computes a new plan from the versions shown now.
    let mut changed = inputs(&catalog, Some(stored.clone()));
    changed.kubernetes_target = Some("1.33.0");
    changed.talos_current = Some("1.13.9");
    changed.kubernetes_current = Some("1.31.4");
    let Course::Follow { plan, notes } = course(&changed) else {
        panic!("a new plan");
    };
    assert_eq!(
        hops_text(&plan.hops),
        vec![
            "Kubernetes 1.31.4 → 1.32.4",
            "Talos 1.13.9 → 1.14.1",
            "Kubernetes 1.32.4 → 1.33.0"
        ]
    );
    assert_eq!(notes.len(), 2);
    // Without the opt-in, or with a reset, no plan (a stored one is dropped).
    let mut single = inputs(&catalog, Some(stored.clone()));
    single.mode = PlanMode::SingleStep;
    assert_eq!(course(&single), Course::OneStep { forget: true });
    let mut reset = inputs(&catalog, None);
    reset.reset = true;
    assert_eq!(course(&reset), Course::OneStep { forget: false });
    // One step is enough: the one-step rules run it.
    let mut near = inputs(&catalog, None);
    near.talos_current = Some("1.13.0");
    near.kubernetes_current = Some("1.32.0");
    assert_eq!(course(&near), Course::OneStep { forget: false });
    // Not a version, or a downgrade: the one-step rules say it.
    let mut invalid = inputs(&catalog, None);
    invalid.talos_target = Some("1.14");
    assert_eq!(course(&invalid), Course::OneStep { forget: false });
    // The versions are not shown yet.
    let mut unknown = inputs(&catalog, None);
    unknown.talos_current = None;
    assert_eq!(course(&unknown), Course::Waiting(UpgradeKind::Talos));
    // Unreachable: refused once, recomputed on resume.
    let mut far = inputs(&catalog, None);
    far.kubernetes_target = None;
    let Course::Follow { plan, notes } = course(&far) else {
        panic!("a refused plan");
    };
    assert!(plan.hops.is_empty());
    let refused = plan.refused.clone().unwrap();
    assert!(
        refused.starts_with("No upgrade plan reaches Talos 1.14.1"),
        "{refused}"
    );
    assert_eq!(notes[0].reason, Reason::PlanRefused);
    let mut again = far.clone();
    again.stored = Some(plan.clone());
    assert_eq!(
        course(&again),
        Course::Follow {
            plan: plan.clone(),
            notes: vec![]
        }
    );
    again.resume = true;
    assert!(matches!(course(&again), Course::Follow { notes, .. } if notes.len() == 1));
}

#[test]
fn the_stored_plan_reads_back() {
    let mut plan = interleaved();
    plan.done = 2;
    let json = serde_json::to_string(&plan).unwrap();
    assert!(json.contains(r#""kind":"kubernetes""#), "{json}");
    assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
}

#[test]
fn modes() {
    assert_eq!(PlanMode::parse("multi-hop"), Some(PlanMode::MultiHop));
    assert_eq!(PlanMode::parse("Multi-Hop"), Some(PlanMode::MultiHop));
    assert_eq!(PlanMode::parse("single-step"), Some(PlanMode::SingleStep));
    assert_eq!(PlanMode::parse("multihop"), None);
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_layer_gives_the_runs_the_hop_and_moves_on() {
    use crate::annotations::*;
    let catalog = Catalog::builtin();
    let shown = annotations(&[
        (UPGRADE_PLAN, "multi-hop"),
        (TALOS_TARGET, "1.14.1"),
        (TALOS_CURRENT, "1.11.6"),
        (KUBERNETES_CURRENT, "1.34.1"),
    ]);
    let intent = UpgradeIntent::from_annotations(&shown);
    let layer = Layer::new(&intent, &shown, None, &catalog);
    let (run_intent, run_annotations) = layer.effective(&intent, &shown);
    assert_eq!(run_intent.talos_target, Target::Version(talos("1.13.9")));
    assert_eq!(run_annotations[TALOS_TARGET], "1.13.9");
    assert_eq!(run_intent.kubernetes_target, Target::Absent);
    // The first hop's run completed: the plan moves on, Talos is still in progress.
    let mut talos_report =
        KindReport::new(UpgradeKind::Talos, UpgradeStatus::Completed, "c".into());
    let mut kubernetes_report =
        KindReport::new(UpgradeKind::Kubernetes, UpgradeStatus::Idle, "".into());
    let end = RunEnd {
        requested: "1.13.9",
        completed: true,
        failed: false,
    };
    let concluded = layer.conclude(
        [Some(end), None],
        [&mut talos_report, &mut kubernetes_report],
        None,
    );
    let plan = concluded.keep.clone().unwrap();
    assert_eq!(plan.done, 1);
    assert!(concluded.again);
    assert_eq!(
        concluded.notes.iter().map(|n| n.reason).collect::<Vec<_>>(),
        vec![
            Reason::PlanComputed,
            Reason::PlanHopStarted,
            Reason::PlanHopFinished,
            Reason::PlanHopStarted
        ]
    );
    assert_eq!(talos_report.status, UpgradeStatus::InProgress);
    assert_eq!(
        talos_report.message,
        "Upgrade plan hop 2/2: Talos 1.13.9 → 1.14.1: starting"
    );
    // Kubernetes has no hop: its report is its own.
    assert_eq!(kubernetes_report.status, UpgradeStatus::Idle);
    assert_eq!(
        concluded.message.as_deref(),
        Some("hop 2/2: Talos 1.13.9 → 1.14.1; done: Talos 1.11.6 → 1.13.9; nothing left after it")
    );
    // The next reconcile gives Talos the last hop; its failure stops the plan there.
    let layer = Layer::new(&intent, &shown, Some(plan), &catalog);
    let (_, run_annotations) = layer.effective(&intent, &shown);
    assert_eq!(run_annotations[TALOS_TARGET], "1.14.1");
    let mut failed = KindReport::new(UpgradeKind::Talos, UpgradeStatus::Failed, "f".into());
    let mut kubernetes_report =
        KindReport::new(UpgradeKind::Kubernetes, UpgradeStatus::Idle, "".into());
    let concluded = layer.conclude(
        [
            Some(RunEnd {
                requested: "1.14.1",
                completed: false,
                failed: true,
            }),
            None,
        ],
        [&mut failed, &mut kubernetes_report],
        None,
    );
    assert_eq!(failed.status, UpgradeStatus::Failed);
    assert!(concluded.notes.is_empty() && !concluded.again);
    assert!(
        concluded
            .message
            .unwrap()
            .contains("failed; the plan stops here until resume")
    );
}

#[test]
fn without_the_opt_in_the_runs_get_the_annotations_as_written() {
    use crate::annotations::*;
    let catalog = Catalog::builtin();
    for mode in [None, Some("single-step"), Some("sideways")] {
        let mut pairs = vec![(TALOS_TARGET, "1.14.1"), (TALOS_CURRENT, "1.11.6")];
        if let Some(mode) = mode {
            pairs.push((UPGRADE_PLAN, mode));
        }
        let shown = annotations(&pairs);
        let intent = UpgradeIntent::from_annotations(&shown);
        let layer = Layer::new(&intent, &shown, None, &catalog);
        assert!(!layer.is_active());
        assert_eq!(
            layer.effective(&intent, &shown),
            (intent.clone(), shown.clone())
        );
        let mut a = KindReport::new(UpgradeKind::Talos, UpgradeStatus::Failed, "x".into());
        let mut b = KindReport::new(UpgradeKind::Kubernetes, UpgradeStatus::Idle, "".into());
        let concluded = layer.conclude([None, None], [&mut a, &mut b], None);
        assert_eq!(concluded.keep, None);
        match mode {
            Some("sideways") => {
                assert_eq!(concluded.notes[0].reason, Reason::InvalidOption);
                assert_eq!(
                    concluded.message.as_deref(),
                    Some(
                        "Annotation upgrade.vitistack.io/upgrade-plan has the invalid value \"sideways\": use multi-hop or single-step (the default); one-step upgrades until it is fixed"
                    )
                );
            }
            _ => assert_eq!((concluded.notes.len(), concluded.message), (0, None)),
        }
    }
}

#[test]
fn the_phase_shows_the_kind_of_the_hop_in_progress() {
    use crate::crd::Phase;
    use crate::report::combined_phase;
    let mut plan = interleaved();
    plan.done = 2; // hop 3/5: Talos 1.11.0 → 1.13.9; Kubernetes waits for hop 4.
    let layer = Layer {
        plan: Some(plan),
        forget: false,
        waiting: None,
        targets: [Some("1.14.1".into()), Some("1.32.0".into())],
        invalid: None,
        resume: false,
        notes: Vec::new(),
    };
    let mut talos_report = KindReport::new(
        UpgradeKind::Talos,
        UpgradeStatus::InProgress,
        "Upgrading".into(),
    );
    let mut kubernetes_report = KindReport::new(
        UpgradeKind::Kubernetes,
        UpgradeStatus::Completed,
        "c".into(),
    );
    let concluded = layer.conclude(
        [None, None],
        [&mut talos_report, &mut kubernetes_report],
        None,
    );
    assert_eq!(kubernetes_report.status, UpgradeStatus::InProgress);
    assert_eq!(concluded.phase_kind, Some(UpgradeKind::Talos));
    let [talos_phase, kubernetes_phase] =
        concluded.phase_reports([&talos_report, &kubernetes_report]);
    assert_eq!(kubernetes_phase.status, UpgradeStatus::Idle);
    assert_eq!(
        combined_phase(&[&talos_phase, &kubernetes_phase], None),
        Some(Phase::UpgradingTalos)
    );
    // Without the view, the waiting Kubernetes would claim the phase.
    assert_eq!(
        combined_phase(&[&talos_report, &kubernetes_report], None),
        Some(Phase::UpgradingKubernetes)
    );
}

#[test]
fn the_last_hop_is_the_target_as_written() {
    use crate::annotations::*;
    let catalog = Catalog::builtin();
    let shown = annotations(&[
        (UPGRADE_PLAN, "multi-hop"),
        (TALOS_TARGET, " v1.14.1 "),
        (TALOS_CURRENT, "1.11.6"),
    ]);
    let intent = UpgradeIntent::from_annotations(&shown);
    let mut plan = match course(&Inputs {
        mode: PlanMode::MultiHop,
        talos_target: Some("v1.14.1"),
        kubernetes_target: None,
        talos_current: Some("1.11.6"),
        kubernetes_current: None,
        stored: None,
        resume: false,
        reset: false,
        catalog: &catalog,
    }) {
        Course::Follow { plan, .. } => plan,
        other => panic!("{other:?}"),
    };
    assert_eq!(plan.hops[1].to, "1.14.1");
    plan.done = 1;
    let layer = Layer::new(&intent, &shown, Some(plan), &catalog);
    let (_, run_annotations) = layer.effective(&intent, &shown);
    assert_eq!(run_annotations[TALOS_TARGET], "v1.14.1");
    let mut talos_report =
        KindReport::new(UpgradeKind::Talos, UpgradeStatus::Completed, "c".into());
    let mut kubernetes_report =
        KindReport::new(UpgradeKind::Kubernetes, UpgradeStatus::Idle, "".into());
    let concluded = layer.conclude(
        [
            Some(RunEnd {
                requested: "v1.14.1",
                completed: true,
                failed: false,
            }),
            None,
        ],
        [&mut talos_report, &mut kubernetes_report],
        None,
    );
    assert!(concluded.keep.unwrap().is_finished());
    assert_eq!(talos_report.status, UpgradeStatus::Completed);
}

#[test]
fn a_plan_waits_for_the_versions_with_no_target_given() {
    use crate::annotations::*;
    let catalog = Catalog::builtin();
    let shown = annotations(&[(UPGRADE_PLAN, "multi-hop"), (TALOS_TARGET, "1.14.1")]);
    let intent = UpgradeIntent::from_annotations(&shown);
    let layer = Layer::new(&intent, &shown, None, &catalog);
    let (run_intent, run_annotations) = layer.effective(&intent, &shown);
    assert_eq!(run_intent.talos_target, Target::Absent);
    assert!(!run_annotations.contains_key(TALOS_TARGET));
    let mut talos_report = KindReport::new(UpgradeKind::Talos, UpgradeStatus::Idle, "i".into());
    let mut kubernetes_report =
        KindReport::new(UpgradeKind::Kubernetes, UpgradeStatus::Idle, "i".into());
    let concluded = layer.conclude(
        [None, None],
        [&mut talos_report, &mut kubernetes_report],
        None,
    );
    assert!(concluded.waiting && !concluded.again);
    assert_eq!(concluded.keep, None);
    assert_eq!(talos_report.status, UpgradeStatus::InProgress);
    assert_eq!(
        talos_report.message,
        "Waiting: the upgrade plan is computed once the Talos version the cluster runs is known"
    );
    // Kubernetes has no target: its report is its own.
    assert_eq!(kubernetes_report.status, UpgradeStatus::Idle);
}
