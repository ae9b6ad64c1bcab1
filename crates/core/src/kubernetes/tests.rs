use std::collections::BTreeMap;
use std::time::Duration;

use jiff::{Timestamp, ToSpan};

use super::*;
use crate::run::{NoteType, Reason};

const DEADLINE: Duration = Duration::from_secs(5 * 60);

fn t0() -> Timestamp {
    "2026-11-25T10:00:00Z".parse().expect("timestamp")
}

fn k(text: &str) -> KubernetesVersion {
    KubernetesVersion::parse(text).expect("version")
}

fn settings() -> Settings {
    Settings {
        paused: false,
        step_deadline: DEADLINE,
        etcd_snapshot: false,
    }
}

/// [`settings`] of a cluster whose `etcd-snapshot` is `talos-and-kubernetes`.
fn snapshotting() -> Settings {
    Settings {
        etcd_snapshot: true,
        ..settings()
    }
}

fn image(field: ImageField, version: &str) -> String {
    format!("{}:v{version}", field.default_repository())
}

fn node(name: &str, role: NodeRole, version: &str) -> NodeObservation {
    let control_plane = role == NodeRole::ControlPlane;
    let cp_image = |field| control_plane.then(|| image(field, version));
    NodeObservation {
        name: name.into(),
        role,
        talos: TalosApi::Up {
            version: TalosVersion::parse("1.12.0").expect("version"),
            ready: true,
        },
        images: ConfiguredImages {
            api_server: cp_image(ImageField::ApiServer),
            controller_manager: cp_image(ImageField::ControllerManager),
            scheduler: cp_image(ImageField::Scheduler),
            proxy: cp_image(ImageField::Proxy),
            kubelet: Some(image(ImageField::Kubelet, version)),
        },
        config_versions: if control_plane {
            ConfigVersions {
                api_server: Some("1".into()),
                controller_manager: Some("1".into()),
                scheduler: Some("1".into()),
            }
        } else {
            ConfigVersions::default()
        },
        static_pods: if control_plane {
            Component::ALL
                .iter()
                .map(|&component| StaticPod {
                    component,
                    image: image(component.image_field(), version),
                    config_version: Some("1".into()),
                    ready: true,
                })
                .collect()
        } else {
            Vec::new()
        },
        kubelet_version: Some(k(version)),
        kubernetes_ready: true,
    }
}

/// Three control planes and two workers, all healthy on Kubernetes `version`.
fn cluster(version: &str) -> Observation {
    Observation {
        nodes: vec![
            node("cp-1", NodeRole::ControlPlane, version),
            node("cp-2", NodeRole::ControlPlane, version),
            node("cp-3", NodeRole::ControlPlane, version),
            node("w-1", NodeRole::Worker, version),
            node("w-2", NodeRole::Worker, version),
        ],
        // Healthy, led by the first control plane (the snapshot is taken from a follower).
        etcd: crate::talos::EtcdObservation {
            problem: None,
            leader: Some("cp-1".into()),
        },
    }
}

fn set(obs: &mut Observation, name: &str, change: impl FnOnce(&mut NodeObservation)) {
    change(
        obs.nodes
            .iter_mut()
            .find(|n| n.name == name)
            .expect("node in observation"),
    );
}

fn pod(node: &mut NodeObservation, component: Component) -> &mut StaticPod {
    node.static_pods
        .iter_mut()
        .find(|p| p.component == component)
        .expect("static pod")
}

fn start(obs: &Observation) -> KubeRun {
    start_run("v1.35.0", &k("1.35.0"), &k("1.34.1"), obs, t0())
}

/// A compact name for a step: `prepull cp-1`, `kube-apiserver cp-1`, `manifests`.
fn label(step: &Step) -> String {
    match step {
        Step::PrePull { node } => format!("prepull {node}"),
        Step::ControlPlane { component, node } => format!("{component} {node}"),
        Step::KubeProxy { node } => format!("kube-proxy {node}"),
        Step::Kubelet { node } => format!("kubelet {node}"),
        Step::Manifests => "manifests".into(),
    }
}

/// A compact name for an action: `pull cp-1`, `patch kube-apiserver cp-1`, `sync cp-1`.
fn action_label(action: &Action) -> String {
    match action {
        Action::PullImages { node, .. } => format!("pull {node}"),
        Action::PatchImage { node, field, .. } => format!("patch {field} {node}"),
        Action::SyncManifests { node } => format!("sync {node}"),
        Action::EtcdSnapshot { node } => format!("snapshot {node}"),
    }
}

fn labels(actions: &[Action]) -> Vec<String> {
    actions.iter().map(action_label).collect()
}

fn index_of(run: &KubeRun, wanted: &str) -> usize {
    run.steps
        .iter()
        .position(|s| label(&s.step) == wanted)
        .expect("step in run")
}

/// `run` with every step before `wanted` done (started in this run), `wanted` issued at `at` with the
/// image it would patch, and the rest pending.
fn issued_at(obs: &Observation, wanted: &str, at: Timestamp) -> KubeRun {
    let mut run = start(obs);
    let index = index_of(&run, wanted);
    for step in &mut run.steps[..index] {
        step.state = StepState::Done {
            at,
            started_at: Some(at),
        };
    }
    let image = field_of(&run.steps[index].step).map(|field| image(field, "1.35.0"));
    run.steps[index].state = StepState::Issued { at, image };
    run
}

/// `run` with every step before `wanted` done and the rest pending.
fn pending_at(obs: &Observation, wanted: &str) -> KubeRun {
    let mut run = start(obs);
    let index = index_of(&run, wanted);
    for step in &mut run.steps[..index] {
        step.state = StepState::Done {
            at: t0(),
            started_at: Some(t0()),
        };
    }
    run
}

fn reasons(notes: &[Note]) -> Vec<&str> {
    notes.iter().map(|n| n.reason.as_str()).collect()
}

// ----------------------------------------------------------------------------------------------
// Starting a run
// ----------------------------------------------------------------------------------------------

#[test]
fn the_steps_follow_talosctl_upgrade_k8s() {
    let obs = Observation {
        // Out of order on purpose: the run sorts by role, then name.
        nodes: vec![
            node("w-1", NodeRole::Worker, "1.34.1"),
            node("cp-2", NodeRole::ControlPlane, "1.34.1"),
            node("cp-1", NodeRole::ControlPlane, "1.34.1"),
        ],
        etcd: Default::default(),
    };
    let run = start(&obs);
    let steps: Vec<String> = run.steps.iter().map(|s| label(&s.step)).collect();
    assert_eq!(
        steps,
        vec![
            "prepull cp-1",
            "prepull cp-2",
            "prepull w-1",
            "kube-apiserver cp-1",
            "kube-apiserver cp-2",
            "kube-controller-manager cp-1",
            "kube-controller-manager cp-2",
            "kube-scheduler cp-1",
            "kube-scheduler cp-2",
            "kube-proxy cp-1",
            "kube-proxy cp-2",
            "kubelet cp-1",
            "kubelet cp-2",
            "kubelet w-1",
            "manifests",
        ]
    );
    assert!(run.steps.iter().all(|s| s.state == StepState::Pending));
    assert_eq!(run.requested, "v1.35.0");
    assert_eq!(run.target, "1.35.0");
    assert_eq!(run.from, "1.34.1");
    assert_eq!(run.counts(), (0, 3));
}

#[test]
fn a_cluster_already_on_the_target_completes_at_once() {
    let obs = cluster("1.35.0");
    let run = start(&obs);
    assert!(run.steps.iter().all(|s| s.state
        == StepState::Done {
            at: t0(),
            started_at: None
        }));
    let decision = advance(&run, &settings(), &obs, t0());
    assert_eq!(decision.report.state, RunState::Completed);
    assert_eq!(
        decision.report.message,
        "Kubernetes upgrade completed: now running 1.35.0"
    );
    assert_eq!((decision.report.done, decision.report.total), (5, 5));
    assert!(decision.actions.is_empty());
    // Nothing was upgraded, so no node is announced; the completion is, once.
    assert_eq!(reasons(&decision.report.notes), vec!["UpgradeCompleted"]);
}

#[test]
fn steps_an_earlier_run_finished_count_as_done() {
    // A previous run moved cp-1's API server before it failed.
    let mut obs = cluster("1.34.1");
    set(&mut obs, "cp-1", |n| {
        n.images.api_server = Some(image(ImageField::ApiServer, "1.35.0"));
        n.config_versions.api_server = Some("2".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = image(ImageField::ApiServer, "1.35.0");
        p.config_version = Some("2".into());
    });
    let run = start(&obs);
    let done: Vec<String> = run
        .steps
        .iter()
        .filter(|s| s.state.is_done())
        .map(|s| label(&s.step))
        .collect();
    assert_eq!(done, vec!["kube-apiserver cp-1"]);
    // Its node still has other steps: not counted as done.
    assert_eq!(run.counts(), (0, 5));
}

// ----------------------------------------------------------------------------------------------
// One step at a time, verified
// ----------------------------------------------------------------------------------------------

#[test]
fn the_first_decision_pre_pulls_on_the_first_control_plane() {
    let obs = cluster("1.34.1");
    let decision = advance(&start(&obs), &settings(), &obs, t0());
    let expected = vec![Action::PullImages {
        node: "cp-1".into(),
        images: vec![
            ImagePull {
                field: ImageField::ApiServer,
                image: "registry.k8s.io/kube-apiserver:v1.35.0".into(),
            },
            ImagePull {
                field: ImageField::ControllerManager,
                image: "registry.k8s.io/kube-controller-manager:v1.35.0".into(),
            },
            ImagePull {
                field: ImageField::Scheduler,
                image: "registry.k8s.io/kube-scheduler:v1.35.0".into(),
            },
            ImagePull {
                field: ImageField::Kubelet,
                image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
            },
        ],
    }];
    assert_eq!(decision.actions, expected);
    assert_eq!(decision.run.step_in_flight(), Some(0));
    assert!(matches!(
        decision.run.steps[0].state,
        StepState::Issued { .. }
    ));
    assert_eq!(
        decision.report.message,
        "Pre-pulling the Kubernetes 1.35.0 images on node cp-1 (step 1/23)"
    );
    assert_eq!(decision.report.in_flight, vec!["cp-1"]);
    assert_eq!(
        reasons(&decision.report.notes),
        vec!["NodeUpgradeStarted", "StepStarted"]
    );
    assert_eq!(
        decision.report.notes[0].message,
        "Upgrading Kubernetes on node cp-1 from 1.34.1 to 1.35.0"
    );

    // A worker pulls only the kubelet.
    let run = pending_at(&obs, "prepull w-1");
    let decision = advance(&run, &settings(), &obs, t0());
    assert_eq!(
        decision.actions,
        vec![Action::PullImages {
            node: "w-1".into(),
            images: vec![ImagePull {
                field: ImageField::Kubelet,
                image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
            }],
        }]
    );
}

#[test]
fn calls_with_nothing_to_observe_wait_for_the_executor_and_are_repeated_if_lost() {
    let obs = cluster("1.34.1");
    let first = advance(&start(&obs), &settings(), &obs, t0());
    // The controller stopped after persisting, before recording the call's result: the call is made again
    // (pulls are idempotent), without announcing the step twice.
    let again = advance(&first.run, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(labels(&again.actions), vec!["pull cp-1"]);
    assert!(again.report.notes.is_empty());
    assert_eq!(again.run.step_in_flight(), Some(0));

    // Recorded as done: the next node's pull starts.
    let mut run = first.run.clone();
    assert!(complete_step(&mut run, 0, t0() + 1.minutes()));
    assert!(!complete_step(&mut run, 0, t0() + 1.minutes()), "only once");
    assert!(!complete_step(&mut run, 99, t0()), "no such step");
    // A patch is verified by what it changes, never by the call's success.
    let mut patching = issued_at(&obs, "kube-apiserver cp-1", t0());
    let patch = index_of(&patching, "kube-apiserver cp-1");
    assert!(!complete_step(&mut patching, patch, t0()));
    assert!(matches!(
        patching.steps[patch].state,
        StepState::Issued { .. }
    ));
    let next = advance(&run, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(labels(&next.actions), vec!["pull cp-2"]);
    assert_eq!(
        run.steps[0].state,
        StepState::Done {
            at: t0() + 1.minutes(),
            started_at: Some(t0())
        }
    );
}

#[test]
fn a_control_plane_component_is_done_only_when_its_pod_is_rerendered_on_the_new_image_and_ready() {
    let obs = cluster("1.34.1");
    let run = issued_at(&obs, "kube-apiserver cp-1", t0());
    let new = image(ImageField::ApiServer, "1.35.0");
    let later = t0() + 1.minutes();

    let configured = |obs: &mut Observation| {
        set(obs, "cp-1", |n| {
            n.images.api_server = Some(new.clone());
            n.config_versions.api_server = Some("2".into());
        })
    };
    let not_applied = obs.clone();
    // Talos took the patch, but the pod was not re-rendered yet.
    let mut applied = obs.clone();
    configured(&mut applied);
    // The pod runs the image but from an older config revision.
    let mut stale_revision = applied.clone();
    set(&mut stale_revision, "cp-1", |n| {
        pod(n, Component::KubeApiserver).image = new.clone();
    });
    let mut not_ready = applied.clone();
    set(&mut not_ready, "cp-1", |n| {
        let p = pod(n, Component::KubeApiserver);
        p.image = new.clone();
        p.config_version = Some("2".into());
        p.ready = false;
    });
    let mut no_pod = applied.clone();
    set(&mut no_pod, "cp-1", |n| {
        n.static_pods
            .retain(|p| p.component != Component::KubeApiserver)
    });
    let mut verified = not_ready.clone();
    set(&mut verified, "cp-1", |n| {
        pod(n, Component::KubeApiserver).ready = true
    });
    // Rendered from a later revision than the one last read (another change came after): it counts,
    // as talosctl 1.14.1 compares config versions with `>=`.
    let mut rendered_later = verified.clone();
    set(&mut rendered_later, "cp-1", |n| {
        pod(n, Component::KubeApiserver).config_version = Some("10".into())
    });
    // Another node's NotReady does not hold a step already in flight.
    let mut verified_while_worker_down = verified.clone();
    set(&mut verified_while_worker_down, "w-2", |n| {
        n.kubernetes_ready = false
    });

    // (what, observation, done, actions)
    let cases = [
        (
            "patch not applied",
            not_applied,
            false,
            vec!["patch kube-apiserver cp-1"],
        ),
        ("applied, old pod", applied, false, vec![]),
        ("pod from an older revision", stale_revision, false, vec![]),
        ("pod not ready", not_ready, false, vec![]),
        ("pod missing", no_pod, false, vec![]),
        // No time lost: the next step starts in the same decision.
        (
            "verified",
            verified,
            true,
            vec!["patch kube-apiserver cp-2"],
        ),
        (
            "rendered from a later revision",
            rendered_later,
            true,
            vec!["patch kube-apiserver cp-2"],
        ),
        (
            "verified, worker down",
            verified_while_worker_down,
            true,
            vec![],
        ),
    ];
    for (what, observation, done, actions) in cases {
        let decision = advance(&run, &settings(), &observation, later);
        let index = index_of(&run, "kube-apiserver cp-1");
        assert_eq!(decision.run.steps[index].state.is_done(), done, "{what}");
        assert_eq!(labels(&decision.actions), actions, "{what}");
        assert_eq!(decision.report.state, RunState::InProgress, "{what}");
    }
}

#[test]
fn a_resent_patch_carries_the_image_recorded_when_the_step_started() {
    let obs = cluster("1.34.1");
    let mut run = issued_at(&obs, "kube-apiserver cp-1", t0());
    let index = index_of(&run, "kube-apiserver cp-1");
    run.steps[index].state = StepState::Issued {
        at: t0(),
        image: Some("mirror.local:5000/kube-apiserver:v1.35.0".into()),
    };
    let decision = advance(&run, &settings(), &obs, t0() + 1.minutes());
    assert_eq!(
        decision.actions,
        vec![Action::PatchImage {
            node: "cp-1".into(),
            field: ImageField::ApiServer,
            image: "mirror.local:5000/kube-apiserver:v1.35.0".into(),
        }]
    );
    assert_eq!(decision.run.step_in_flight(), Some(index));
}

#[test]
fn kube_proxy_is_done_once_configured_and_kubelets_once_the_node_reports_the_version() {
    let obs = cluster("1.34.1");
    let later = t0() + 1.minutes();

    let proxy = issued_at(&obs, "kube-proxy cp-1", t0());
    let mut proxy_set = obs.clone();
    set(&mut proxy_set, "cp-1", |n| {
        n.images.proxy = Some(image(ImageField::Proxy, "1.35.0"))
    });
    let kubelet = issued_at(&obs, "kubelet w-1", t0());
    let configured = |obs: &mut Observation| {
        set(obs, "w-1", |n| {
            n.images.kubelet = Some(image(ImageField::Kubelet, "1.35.0"))
        })
    };
    let mut kubelet_configured = obs.clone();
    configured(&mut kubelet_configured);
    let mut kubelet_restarting = kubelet_configured.clone();
    set(&mut kubelet_restarting, "w-1", |n| {
        n.kubelet_version = Some(k("1.35.0"));
        n.kubernetes_ready = false;
    });
    let mut kubelet_back = kubelet_restarting.clone();
    set(&mut kubelet_back, "w-1", |n| n.kubernetes_ready = true);

    // (what, run, observation, step, done, actions)
    let cases = [
        (
            "proxy not set",
            &proxy,
            obs.clone(),
            "kube-proxy cp-1",
            false,
            vec!["patch kube-proxy cp-1"],
        ),
        (
            "proxy set",
            &proxy,
            proxy_set,
            "kube-proxy cp-1",
            true,
            vec!["patch kube-proxy cp-2"],
        ),
        (
            "kubelet not set",
            &kubelet,
            obs.clone(),
            "kubelet w-1",
            false,
            vec!["patch kubelet w-1"],
        ),
        (
            "kubelet set, old version",
            &kubelet,
            kubelet_configured,
            "kubelet w-1",
            false,
            vec![],
        ),
        (
            "kubelet restarting",
            &kubelet,
            kubelet_restarting,
            "kubelet w-1",
            false,
            vec![],
        ),
        (
            "kubelet back",
            &kubelet,
            kubelet_back,
            "kubelet w-1",
            true,
            vec!["patch kubelet w-2"],
        ),
    ];
    for (what, run, observation, step, done, actions) in cases {
        let decision = advance(run, &settings(), &observation, later);
        assert_eq!(
            decision.run.steps[index_of(run, step)].state.is_done(),
            done,
            "{what}"
        );
        assert_eq!(labels(&decision.actions), actions, "{what}");
    }
}

#[test]
fn a_pending_step_already_satisfied_is_done_without_a_call() {
    // Someone moved cp-2's API server meanwhile (talosctl by hand, say).
    let mut obs = cluster("1.34.1");
    let new = image(ImageField::ApiServer, "1.35.0");
    set(&mut obs, "cp-1", |n| {
        n.images.api_server = Some(new.clone());
        n.config_versions.api_server = Some("2".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = new.clone();
        p.config_version = Some("2".into());
    });
    set(&mut obs, "cp-2", |n| {
        n.images.api_server = Some(new.clone());
        n.config_versions.api_server = Some("7".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = new.clone();
        p.config_version = Some("7".into());
    });
    // The run started before that.
    let run = issued_at(&cluster("1.34.1"), "kube-apiserver cp-1", t0());
    let decision = advance(&run, &settings(), &obs, t0() + 1.minutes());
    let cp2 = index_of(&run, "kube-apiserver cp-2");
    assert_eq!(
        decision.run.steps[cp2].state,
        StepState::Done {
            at: t0() + 1.minutes(),
            started_at: None
        }
    );
    assert_eq!(labels(&decision.actions), vec!["patch kube-apiserver cp-3"]);
    assert_eq!(decision.run.step_in_flight(), Some(cp2 + 1));
}

#[test]
fn an_image_already_configured_is_never_patched_again() {
    // The config took the image (the controller stopped after the call) but the pod is not Ready yet.
    let mut obs = cluster("1.34.1");
    let new = image(ImageField::ApiServer, "1.35.0");
    set(&mut obs, "cp-1", |n| {
        n.images.api_server = Some(new.clone());
        n.config_versions.api_server = Some("2".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = new.clone();
        p.config_version = Some("2".into());
        p.ready = false;
    });
    // As a pending step: it starts, but only waits.
    let pending = pending_at(&obs, "kube-apiserver cp-1");
    let started = advance(&pending, &settings(), &obs, t0());
    assert!(started.actions.is_empty(), "{:?}", started.actions);
    assert_eq!(
        started.report.message,
        "Upgrading kube-apiserver on node cp-1 (step 6/23)"
    );
    let step_started = started
        .report
        .notes
        .iter()
        .find(|n| n.reason == Reason::StepStarted)
        .expect("StepStarted");
    assert_eq!(
        step_started.message,
        "Upgrading kube-apiserver on node cp-1 to 1.35.0 (registry.k8s.io/kube-apiserver:v1.35.0), already configured"
    );
    // As an issued step: no re-sent patch either.
    let again = advance(&started.run, &settings(), &obs, t0() + 1.minutes());
    assert!(again.actions.is_empty());
    assert!(again.report.notes.is_empty());
}

#[test]
fn steps_that_restart_something_wait_for_a_healthy_cluster() {
    let mut w1_not_ready = cluster("1.34.1");
    set(&mut w1_not_ready, "w-1", |n| n.kubernetes_ready = false);
    let mut w2_unreachable = cluster("1.34.1");
    set(&mut w2_unreachable, "w-2", |n| {
        n.talos = TalosApi::Unreachable {
            reason: "connection refused".into(),
        }
    });
    let mut cp3_talos_not_ready = cluster("1.34.1");
    set(&mut cp3_talos_not_ready, "cp-3", |n| {
        n.talos = TalosApi::Up {
            version: TalosVersion::parse("1.12.0").expect("version"),
            ready: false,
        }
    });
    let mut cp1_unreachable = cluster("1.34.1");
    set(&mut cp1_unreachable, "cp-1", |n| {
        n.talos = TalosApi::Unreachable {
            reason: "i/o timeout".into(),
        }
    });
    let mut cp1_missing = cluster("1.34.1");
    cp1_missing.nodes.retain(|n| n.name != "cp-1");

    // (step, observation, message)
    let cases = [
        (
            "kube-apiserver cp-1",
            w1_not_ready.clone(),
            "Waiting: node w-1 is not Ready; holding before upgrading kube-apiserver on cp-1 (step 6/23)",
        ),
        (
            "kubelet cp-2",
            w2_unreachable.clone(),
            "Waiting: node w-2's Talos API is unreachable (connection refused); holding before upgrading kubelet on cp-2 (step 19/23)",
        ),
        (
            "kube-scheduler cp-2",
            cp3_talos_not_ready,
            "Waiting: node cp-3's Talos is not ready; holding before upgrading kube-scheduler on cp-2 (step 13/23)",
        ),
        (
            "kube-apiserver cp-1",
            cp1_unreachable.clone(),
            "Waiting: node cp-1's Talos API is unreachable: i/o timeout (step 6/23)",
        ),
        (
            "prepull cp-1",
            cp1_unreachable,
            "Waiting: node cp-1's Talos API is unreachable: i/o timeout (step 1/23)",
        ),
    ];
    for (step, obs, message) in cases {
        let run = pending_at(&cluster("1.34.1"), step);
        let decision = advance(&run, &settings(), &obs, t0());
        assert!(
            decision.actions.is_empty(),
            "{step}: {:?}",
            decision.actions
        );
        assert!(decision.report.notes.is_empty(), "{step}");
        assert_eq!(decision.report.state, RunState::InProgress);
        assert_eq!(decision.report.message, message);
        assert_eq!(decision.run, run, "{step}: holding changes nothing");
    }

    // A node gone from the node list is not waited for: its steps not started are dropped, said once.
    let run = pending_at(&cluster("1.34.1"), "kube-apiserver cp-1");
    let decision = advance(&run, &settings(), &cp1_missing, t0());
    assert!(
        decision
            .run
            .steps
            .iter()
            .all(|s| s.step.node() != Some("cp-1") || s.state.is_done()),
        "{:?}",
        decision.run.steps
    );
    assert_eq!(
        decision
            .report
            .notes
            .iter()
            .map(|n| n.message.as_str())
            .collect::<Vec<_>>(),
        [
            "Node cp-1 is no longer in the cluster's node list; the run goes on without it",
            "Upgrading kube-apiserver on node cp-2 to 1.35.0 (registry.k8s.io/kube-apiserver:v1.35.0)"
        ]
    );

    // Steps that restart nothing only need their own node.
    for (step, expected) in [
        ("prepull cp-1", "pull cp-1"),
        ("kube-proxy cp-1", "patch kube-proxy cp-1"),
        ("manifests", "sync cp-1"),
    ] {
        let run = pending_at(&cluster("1.34.1"), step);
        let decision = advance(&run, &settings(), &w1_not_ready, t0());
        assert_eq!(labels(&decision.actions), vec![expected], "{step}");
    }
}

#[test]
fn the_manifests_are_synced_from_the_first_control_plane_that_answers() {
    let unreachable = |obs: &mut Observation, name: &str| {
        set(obs, name, |n| {
            n.talos = TalosApi::Unreachable {
                reason: "connection refused".into(),
            }
        })
    };
    let mut cp1_down = cluster("1.35.0");
    unreachable(&mut cp1_down, "cp-1");
    let mut all_down = cp1_down.clone();
    unreachable(&mut all_down, "cp-2");
    unreachable(&mut all_down, "cp-3");
    let run = pending_at(&cluster("1.34.1"), "manifests");

    let decision = advance(&run, &settings(), &cp1_down, t0());
    assert_eq!(labels(&decision.actions), vec!["sync cp-2"]);
    assert_eq!(
        decision.report.notes[0].message,
        "Syncing the bootstrap manifests for Kubernetes 1.35.0 from node cp-2"
    );
    assert_eq!(
        decision.report.message,
        "Syncing the bootstrap manifests (step 23/23)"
    );
    assert!(decision.report.in_flight.is_empty());

    let held = advance(&run, &settings(), &all_down, t0());
    assert!(held.actions.is_empty());
    assert_eq!(
        held.report.message,
        "Waiting: no control plane's Talos API answers to sync the bootstrap manifests from (step 23/23)"
    );

    // The sync is the last step: recording it completes the run, announced once.
    let mut run = decision.run;
    assert!(complete_step(&mut run, 22, t0() + 1.minutes()));
    let done = advance(&run, &settings(), &cluster("1.35.0"), t0() + 1.minutes());
    assert_eq!(done.report.state, RunState::Completed);
    assert_eq!(reasons(&done.report.notes), vec!["UpgradeCompleted"]);
    assert_eq!(
        done.report.notes[0].message,
        "Kubernetes upgrade completed: all 5 nodes run 1.35.0"
    );
}

// ----------------------------------------------------------------------------------------------
// Failures
// ----------------------------------------------------------------------------------------------

#[test]
fn a_step_past_its_deadline_fails_the_run_saying_what_was_not_seen() {
    let obs = cluster("1.34.1");
    let late = t0() + 6.minutes();
    let new_api = image(ImageField::ApiServer, "1.35.0");
    let mut pod_not_ready = obs.clone();
    set(&mut pod_not_ready, "cp-1", |n| {
        n.images.api_server = Some(new_api.clone());
        n.config_versions.api_server = Some("2".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = new_api.clone();
        p.config_version = Some("2".into());
        p.ready = false;
    });
    let mut pod_old = obs.clone();
    set(&mut pod_old, "cp-1", |n| {
        n.images.api_server = Some(new_api.clone());
    });
    let mut kubelet_old = obs.clone();
    set(&mut kubelet_old, "w-1", |n| {
        n.images.kubelet = Some(image(ImageField::Kubelet, "1.35.0"))
    });
    let mut kubelet_not_ready = kubelet_old.clone();
    set(&mut kubelet_not_ready, "w-1", |n| {
        n.kubelet_version = Some(k("1.35.0"));
        n.kubernetes_ready = false;
    });
    let mut cp1_down = obs.clone();
    set(&mut cp1_down, "cp-1", |n| {
        n.talos = TalosApi::Unreachable {
            reason: "connection refused".into(),
        }
    });

    // (step, observation, failed node, message)
    let cases = [
        (
            "kube-apiserver cp-1",
            pod_not_ready,
            Some("cp-1"),
            "Kubernetes upgrade failed: kube-apiserver on node cp-1 did not become Ready on v1.35.0 within 5m",
        ),
        (
            "kube-apiserver cp-1",
            pod_old,
            Some("cp-1"),
            "Kubernetes upgrade failed: kube-apiserver on node cp-1 was not restarted on v1.35.0 within 5m",
        ),
        (
            "kube-apiserver cp-1",
            obs.clone(),
            Some("cp-1"),
            "Kubernetes upgrade failed: node cp-1's machine config did not take kube-apiserver image registry.k8s.io/kube-apiserver:v1.35.0 within 5m",
        ),
        (
            "kube-apiserver cp-1",
            cp1_down,
            Some("cp-1"),
            "Kubernetes upgrade failed: node cp-1's Talos API did not answer within 5m",
        ),
        (
            "kubelet w-1",
            kubelet_old,
            Some("w-1"),
            "Kubernetes upgrade failed: the kubelet on node w-1 did not report v1.35.0 within 5m",
        ),
        (
            "kubelet w-1",
            kubelet_not_ready,
            Some("w-1"),
            "Kubernetes upgrade failed: node w-1 did not become Ready with kubelet v1.35.0 within 5m",
        ),
        (
            "prepull w-2",
            obs.clone(),
            Some("w-2"),
            "Kubernetes upgrade failed: pre-pulling images on node w-2 did not finish within 5m",
        ),
        (
            "manifests",
            obs.clone(),
            None,
            "Kubernetes upgrade failed: syncing the bootstrap manifests did not finish within 5m",
        ),
    ];
    for (step, observation, failed, message) in cases {
        let run = issued_at(&obs, step, t0());
        // Within the deadline it keeps waiting.
        let waiting = advance(&run, &settings(), &observation, t0() + 4.minutes());
        assert_eq!(waiting.report.state, RunState::InProgress, "{step}");

        let decision = advance(&run, &settings(), &observation, late);
        assert_eq!(decision.report.state, RunState::Failed, "{step}");
        assert_eq!(decision.report.message, message, "{step}");
        assert!(decision.actions.is_empty(), "{step}: no further calls");
        assert_eq!(decision.run.step_in_flight(), None);
        assert_eq!(
            decision.report.failed_nodes,
            failed.into_iter().map(String::from).collect::<Vec<_>>(),
            "{step}"
        );
        let warnings: Vec<&Note> = decision.report.notes.iter().collect();
        assert_eq!(warnings.len(), 1, "{step}");
        assert_eq!(warnings[0].reason, Reason::UpgradeFailed);
        assert_eq!(warnings[0].type_, NoteType::Warning);
        assert_eq!(warnings[0].message, message);
        assert!(matches!(
            decision.run.outcome,
            Some(Outcome::Failed { ref node, .. }) if node.as_deref() == failed
        ));

        // Decided once: deciding again, even on a healthy cluster, changes and announces nothing.
        let again = advance(
            &decision.run,
            &settings(),
            &cluster("1.35.0"),
            late + 1.hours(),
        );
        assert_eq!(again.report.state, RunState::Failed);
        assert_eq!(again.report.message, message);
        assert!(again.actions.is_empty() && again.report.notes.is_empty());
        assert_eq!(again.run, decision.run);
    }
}

#[test]
fn a_failed_call_fails_the_run_once_naming_the_step() {
    let obs = cluster("1.34.1");
    let first = advance(&start(&obs), &settings(), &obs, t0());
    let index = first.run.step_in_flight().expect("a step in flight");
    let mut run = first.run;
    assert!(fail_step(
        &mut run,
        index,
        "image registry.k8s.io/kube-apiserver:v1.35.0 not found",
        t0()
    ));
    assert!(!fail_step(&mut run, index, "again", t0()), "decided once");
    let decision = advance(&run, &settings(), &obs, t0());
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        "Kubernetes upgrade failed: pre-pulling images on node cp-1 failed: image registry.k8s.io/kube-apiserver:v1.35.0 not found"
    );
    assert_eq!(decision.report.failed_nodes, vec!["cp-1"]);
    // `fail_step` ended the run, so the reconciler announces it from its own result; a decision on the
    // already finished run adds nothing.
    assert!(decision.report.notes.is_empty());
    assert!(decision.actions.is_empty());
}

#[test]
fn an_image_the_target_cannot_be_derived_from_fails_before_any_call() {
    let mut obs = cluster("1.34.1");
    set(&mut obs, "cp-2", |n| {
        n.images.scheduler = Some("registry.k8s.io/kube-scheduler:".into())
    });
    let run = pending_at(&obs, "prepull cp-2");
    let decision = advance(&run, &settings(), &obs, t0());
    assert!(decision.actions.is_empty());
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        "Kubernetes upgrade failed: node cp-2 cannot be upgraded: the kube-scheduler image \
         \"registry.k8s.io/kube-scheduler:\" is not a valid image reference (its tag is malformed), \
         so the new image cannot be derived from it: correct cluster.scheduler.image (or the \
         image of the KubeSchedulerConfig document, where the node's config has one)"
    );
    assert_eq!(decision.report.failed_nodes, vec!["cp-2"]);
    assert_eq!(reasons(&decision.report.notes), vec!["UpgradeFailed"]);
}

#[test]
fn a_resumed_run_continues_from_the_failed_step() {
    let obs = cluster("1.34.1");
    let run = issued_at(&obs, "kube-apiserver cp-2", t0());
    let failed = advance(&run, &settings(), &obs, t0() + 6.minutes()).run;
    let mut resumed = failed.clone();
    assert!(resume(&mut resumed));
    assert!(!resume(&mut resumed), "only a failed run resumes");
    assert!(resumed.outcome.is_none());
    assert!(resumed.failed_nodes().is_empty());
    let decision = advance(&resumed, &settings(), &obs, t0() + 7.minutes());
    assert_eq!(labels(&decision.actions), vec!["patch kube-apiserver cp-2"]);
    // cp-2 had started before: it is not announced as starting again.
    assert_eq!(reasons(&decision.report.notes), vec!["StepStarted"]);
}

#[test]
fn a_corrupted_target_fails_rather_than_guessing() {
    let obs = cluster("1.34.1");
    let mut run = start(&obs);
    run.target = "banana".into();
    let decision = advance(&run, &settings(), &obs, t0());
    assert_eq!(decision.report.state, RunState::Failed);
    assert_eq!(
        decision.report.message,
        "Kubernetes upgrade failed: the recorded target \"banana\" is not a version"
    );
    assert!(decision.actions.is_empty());
}

// ----------------------------------------------------------------------------------------------
// Pausing
// ----------------------------------------------------------------------------------------------

#[test]
fn a_paused_run_finishes_the_step_in_flight_and_starts_none() {
    let obs = cluster("1.34.1");
    let paused = Settings {
        paused: true,
        ..settings()
    };
    let run = issued_at(&obs, "kube-apiserver cp-1", t0());

    let finishing = advance(&run, &paused, &obs, t0() + 1.minutes());
    assert_eq!(finishing.report.state, RunState::Paused);
    assert_eq!(
        finishing.report.message,
        "Pausing: finishing the kube-apiserver upgrade on node cp-1 before holding (step 6/23)"
    );
    // The in-flight step's lost call is still made again: finishing it is part of pausing.
    assert_eq!(
        labels(&finishing.actions),
        vec!["patch kube-apiserver cp-1"]
    );

    let mut verified = obs.clone();
    let new = image(ImageField::ApiServer, "1.35.0");
    set(&mut verified, "cp-1", |n| {
        n.images.api_server = Some(new.clone());
        n.config_versions.api_server = Some("2".into());
        let p = pod(n, Component::KubeApiserver);
        p.image = new.clone();
        p.config_version = Some("2".into());
    });
    let held = advance(&run, &paused, &verified, t0() + 2.minutes());
    assert!(held.actions.is_empty());
    assert_eq!(held.report.state, RunState::Paused);
    assert_eq!(
        held.report.message,
        "Paused after 6/23 steps; remove the paused annotation to continue"
    );
    let again = advance(&held.run, &paused, &verified, t0() + 30.minutes());
    assert!(
        again.actions.is_empty(),
        "no deadline runs while nothing is in flight"
    );
    assert_eq!(again.report.state, RunState::Paused);

    let resumed = advance(&held.run, &settings(), &verified, t0() + 31.minutes());
    assert_eq!(labels(&resumed.actions), vec!["patch kube-apiserver cp-2"]);
}

// ----------------------------------------------------------------------------------------------
// The current version
// ----------------------------------------------------------------------------------------------

#[test]
fn the_current_version_is_the_lowest_component() {
    let mut obs = cluster("1.35.0");
    assert_eq!(kubernetes_current(&obs), Some(k("1.35.0")));

    // A lagging kubelet.
    set(&mut obs, "w-2", |n| n.kubelet_version = Some(k("1.34.1")));
    assert_eq!(kubernetes_current(&obs), Some(k("1.34.1")));

    // A lagging scheduler behind a registry with a port, and an unparsable tag that is left out.
    set(&mut obs, "cp-3", |n| {
        pod(n, Component::KubeScheduler).image =
            "registry.local:5000/kube-scheduler:v1.34.0".into();
        pod(n, Component::KubeApiserver).image = "registry.local:5000/kube-apiserver:latest".into();
    });
    assert_eq!(kubernetes_current(&obs), Some(k("1.34.0")));
    assert_eq!(kubernetes_range(&obs), Some((k("1.34.0"), k("1.35.0"))));

    assert_eq!(kubernetes_current(&Observation::default()), None);
}

// ----------------------------------------------------------------------------------------------
// Whole runs
// ----------------------------------------------------------------------------------------------

/// A fake cluster: what Talos and the kubelet do after a patch, one tick later.
struct FakeCluster {
    obs: Observation,
    /// Ticks a re-rendered pod stays not Ready before it is.
    pod_warmup: u32,
    warming: BTreeMap<(String, Component), u32>,
}

impl FakeCluster {
    fn new(pod_warmup: u32) -> Self {
        Self::of(cluster("1.34.1"), pod_warmup)
    }

    fn of(obs: Observation, pod_warmup: u32) -> Self {
        FakeCluster {
            obs,
            pod_warmup,
            warming: BTreeMap::new(),
        }
    }

    fn apply(&mut self, action: &Action) {
        if let Action::PatchImage { node, field, image } = action {
            set(&mut self.obs, node, |n| {
                let slot = match field {
                    ImageField::ApiServer => &mut n.images.api_server,
                    ImageField::ControllerManager => &mut n.images.controller_manager,
                    ImageField::Scheduler => &mut n.images.scheduler,
                    ImageField::Proxy => &mut n.images.proxy,
                    ImageField::Kubelet => &mut n.images.kubelet,
                };
                *slot = Some(image.clone());
                // Talos bumps the component's config resource on every change of its config.
                let version = match field {
                    ImageField::ApiServer => Some(&mut n.config_versions.api_server),
                    ImageField::ControllerManager => {
                        Some(&mut n.config_versions.controller_manager)
                    }
                    ImageField::Scheduler => Some(&mut n.config_versions.scheduler),
                    ImageField::Proxy | ImageField::Kubelet => None,
                };
                if let Some(version) = version {
                    let next = version
                        .as_deref()
                        .and_then(|v| v.parse::<u32>().ok())
                        .unwrap_or(0)
                        + 1;
                    *version = Some(next.to_string());
                }
            });
        }
    }

    /// Time passes: pods are re-rendered from the config and warm up; kubelets restart on their image.
    fn tick(&mut self) {
        for node in &mut self.obs.nodes {
            for component in Component::ALL {
                let configured = node.images.get(component.image_field()).map(String::from);
                let version = node.config_versions.get(component).map(String::from);
                let Some(pod) = node
                    .static_pods
                    .iter_mut()
                    .find(|p| p.component == component)
                else {
                    continue;
                };
                let key = (node.name.clone(), component);
                if pod.config_version != version {
                    pod.image = configured.unwrap_or_default();
                    pod.config_version = version;
                    pod.ready = self.pod_warmup == 0;
                    self.warming.insert(key, self.pod_warmup);
                } else if let Some(left) = self.warming.get_mut(&key) {
                    *left = left.saturating_sub(1);
                    pod.ready = *left == 0;
                }
            }
            let running = node
                .images
                .kubelet
                .as_deref()
                .and_then(image_tag)
                // `v1.35.0-fat` runs kubelet v1.35.0.
                .and_then(|tag| semver::Version::parse(tag.trim_start_matches('v')).ok())
                .map(|v| KubernetesVersion::new(v.major, v.minor, v.patch));
            if running != node.kubelet_version {
                node.kubelet_version = running;
            }
        }
    }
}

/// Drives a whole run: every action executed (unless `lose` says the controller stopped before making
/// it), the results of pulls and syncs recorded, the cluster ticking between decisions. Returns the
/// calls made, in order, and the notes.
fn drive(
    cluster: &mut FakeCluster,
    lose: impl Fn(usize) -> bool,
) -> (KubeRun, Vec<String>, Vec<Note>) {
    let run = start(&cluster.obs);
    drive_from(cluster, run, &settings(), lose)
}

fn drive_from(
    cluster: &mut FakeCluster,
    mut run: KubeRun,
    settings: &Settings,
    lose: impl Fn(usize) -> bool,
) -> (KubeRun, Vec<String>, Vec<Note>) {
    let mut now = t0();
    let mut calls = Vec::new();
    let mut notes = Vec::new();
    let mut last_done = 0;
    for round in 0..200 {
        let decision = advance(&run, settings, &cluster.obs, now);
        notes.extend(decision.report.notes.clone());
        assert!(
            decision.report.done >= last_done,
            "progress never goes back"
        );
        last_done = decision.report.done;
        run = decision.run;
        if decision.report.state == RunState::Completed {
            break;
        }
        assert_eq!(
            decision.report.state,
            RunState::InProgress,
            "{}",
            decision.report.message
        );
        assert!(decision.actions.len() <= 1, "one call at a time");
        if !lose(round) {
            for action in &decision.actions {
                calls.push(action_label(action));
                cluster.apply(action);
                match action {
                    Action::PullImages { .. } | Action::SyncManifests { .. } => {
                        let index = run.step_in_flight().expect("the step the call belongs to");
                        assert!(complete_step(&mut run, index, now));
                    }
                    Action::PatchImage { .. } => {}
                    Action::EtcdSnapshot { node } => {
                        snapshot_stored(&mut run, node, &stored(), now);
                    }
                }
            }
        }
        now += 30.seconds();
        cluster.tick();
    }
    (run, calls, notes)
}

fn expected_calls() -> Vec<String> {
    let mut calls = Vec::new();
    for node in ["cp-1", "cp-2", "cp-3", "w-1", "w-2"] {
        calls.push(format!("pull {node}"));
    }
    for component in Component::ALL {
        for node in ["cp-1", "cp-2", "cp-3"] {
            calls.push(format!("patch {component} {node}"));
        }
    }
    for node in ["cp-1", "cp-2", "cp-3"] {
        calls.push(format!("patch kube-proxy {node}"));
    }
    for node in ["cp-1", "cp-2", "cp-3", "w-1", "w-2"] {
        calls.push(format!("patch kubelet {node}"));
    }
    calls.push("sync cp-1".into());
    calls
}

#[test]
fn a_whole_run_patches_everything_once_in_order() {
    for warmup in [0, 2] {
        let mut cluster = FakeCluster::new(warmup);
        let (run, calls, notes) = drive(&mut cluster, |_| false);
        assert_eq!(run.counts(), (5, 5), "warmup {warmup}");
        assert!(matches!(run.outcome, Some(Outcome::Completed { .. })));
        assert_eq!(calls, expected_calls(), "warmup {warmup}");
        assert_eq!(kubernetes_current(&cluster.obs), Some(k("1.35.0")));

        let count = |reason: Reason| notes.iter().filter(|n| n.reason == reason).count();
        assert_eq!(count(Reason::NodeUpgradeStarted), 5);
        assert_eq!(count(Reason::NodeUpgraded), 5);
        assert_eq!(count(Reason::StepStarted), 23);
        assert_eq!(count(Reason::UpgradeCompleted), 1);
        assert_eq!(count(Reason::UpgradeFailed), 0);
        // A node is announced done after its kubelet, the last of its steps.
        let order: Vec<String> = notes
            .iter()
            .filter(|n| n.reason == Reason::NodeUpgraded)
            .map(|n| n.message.clone())
            .collect();
        assert_eq!(
            order,
            ["cp-1", "cp-2", "cp-3", "w-1", "w-2"]
                .iter()
                .map(|n| format!("Node {n} runs Kubernetes 1.35.0"))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            notes.last().map(|n| n.reason),
            Some(Reason::UpgradeCompleted),
            "completion comes last"
        );
    }
}

#[test]
fn a_whole_run_survives_calls_lost_between_write_ahead_and_execution() {
    // The controller stops after persisting every third decision, before making the call.
    let mut cluster = FakeCluster::new(1);
    let (run, calls, notes) = drive(&mut cluster, |round| round % 3 == 0);
    assert!(matches!(run.outcome, Some(Outcome::Completed { .. })));
    // Every lost call was made again; none was made twice after it took effect.
    assert_eq!(calls, expected_calls());
    assert_eq!(
        notes
            .iter()
            .filter(|n| n.reason == Reason::StepStarted)
            .count(),
        23,
        "each step announced once"
    );
}

#[test]
fn a_whole_run_tells_the_user_each_step_once() {
    // One control plane behind a mirror with a port, one worker with a `-fat` kubelet.
    let mut cp = node("cp-1", NodeRole::ControlPlane, "1.34.1");
    cp.images.api_server = Some("registry.local:5000/kube-apiserver:v1.34.1".into());
    pod(&mut cp, Component::KubeApiserver).image =
        "registry.local:5000/kube-apiserver:v1.34.1".into();
    let mut worker = node("w-1", NodeRole::Worker, "1.34.1");
    worker.images.kubelet = Some("ghcr.io/siderolabs/kubelet:v1.34.1-fat".into());
    let mut cluster = FakeCluster::of(
        Observation {
            nodes: vec![cp, worker],
            etcd: Default::default(),
        },
        1,
    );
    let (run, calls, notes) = drive(&mut cluster, |_| false);
    assert!(matches!(run.outcome, Some(Outcome::Completed { .. })));
    assert_eq!(
        calls,
        vec![
            "pull cp-1",
            "pull w-1",
            "patch kube-apiserver cp-1",
            "patch kube-controller-manager cp-1",
            "patch kube-scheduler cp-1",
            "patch kube-proxy cp-1",
            "patch kubelet cp-1",
            "patch kubelet w-1",
            "sync cp-1",
        ]
    );
    let told: Vec<String> = notes
        .iter()
        .map(|n| format!("{}: {}", n.reason, n.message))
        .collect();
    assert_eq!(
        told,
        vec![
            "NodeUpgradeStarted: Upgrading Kubernetes on node cp-1 from 1.34.1 to 1.35.0",
            "StepStarted: Pre-pulling the Kubernetes 1.35.0 images on node cp-1",
            "NodeUpgradeStarted: Upgrading Kubernetes on node w-1 from 1.34.1 to 1.35.0",
            "StepStarted: Pre-pulling the Kubernetes 1.35.0 images on node w-1",
            "StepStarted: Upgrading kube-apiserver on node cp-1 to 1.35.0 (registry.local:5000/kube-apiserver:v1.35.0)",
            "StepStarted: Upgrading kube-controller-manager on node cp-1 to 1.35.0 (registry.k8s.io/kube-controller-manager:v1.35.0)",
            "StepStarted: Upgrading kube-scheduler on node cp-1 to 1.35.0 (registry.k8s.io/kube-scheduler:v1.35.0)",
            "StepStarted: Upgrading kube-proxy on node cp-1 to 1.35.0 (registry.k8s.io/kube-proxy:v1.35.0)",
            "StepStarted: Upgrading kubelet on node cp-1 to 1.35.0 (ghcr.io/siderolabs/kubelet:v1.35.0)",
            "NodeUpgraded: Node cp-1 runs Kubernetes 1.35.0",
            "StepStarted: Upgrading kubelet on node w-1 to 1.35.0 (ghcr.io/siderolabs/kubelet:v1.35.0-fat)",
            "NodeUpgraded: Node w-1 runs Kubernetes 1.35.0",
            "StepStarted: Syncing the bootstrap manifests for Kubernetes 1.35.0 from node cp-1",
            "UpgradeCompleted: Kubernetes upgrade completed: all 2 nodes run 1.35.0",
        ]
    );
    assert_eq!(
        cluster
            .obs
            .node("w-1")
            .and_then(|n| n.images.kubelet.as_deref()),
        Some("ghcr.io/siderolabs/kubelet:v1.35.0-fat")
    );
}

#[test]
fn a_run_restarted_from_its_record_at_any_point_makes_the_same_calls() {
    // The controller restarts after every decision: the run it continues from is the persisted JSON.
    // With the snapshot too: taken once, however often the run is read back after it.
    let mut with_snapshot = expected_calls();
    with_snapshot.insert(5, "snapshot cp-2".into());
    for (settings, expected) in [
        (settings(), expected_calls()),
        (snapshotting(), with_snapshot),
    ] {
        let mut cluster = FakeCluster::new(1);
        let mut run = start(&cluster.obs);
        let mut now = t0();
        let mut calls = Vec::new();
        for _ in 0..200 {
            let json = serde_json::to_string(&run).expect("serialize");
            run = serde_json::from_str(&json).expect("deserialize");
            let decision = advance(&run, &settings, &cluster.obs, now);
            run = decision.run;
            if run.is_finished() {
                break;
            }
            for action in &decision.actions {
                calls.push(action_label(action));
                cluster.apply(action);
                match action {
                    Action::PullImages { .. } | Action::SyncManifests { .. } => {
                        let index = run.step_in_flight().expect("step");
                        assert!(complete_step(&mut run, index, now));
                    }
                    Action::EtcdSnapshot { node } => {
                        snapshot_stored(&mut run, node, &stored(), now);
                    }
                    Action::PatchImage { .. } => {}
                }
            }
            now += 30.seconds();
            cluster.tick();
        }
        assert!(matches!(run.outcome, Some(Outcome::Completed { .. })));
        assert_eq!(calls, expected);
    }
}

// ----------------------------------------------------------------------------------------------
// The etcd snapshot before the first control plane (`etcd-snapshot: talos-and-kubernetes`)
// ----------------------------------------------------------------------------------------------

fn stored() -> crate::etcd_snapshot::Stored {
    crate::etcd_snapshot::Stored {
        location: "file:///snapshots/ns/c/20261125T100000Z-kubernetes-1.35.0.snapshot".into(),
        size: 42,
        sha256: "ab".into(),
    }
}

/// The pass that asks for the snapshot: the run is about to restart kube-apiserver on cp-1, the
/// first control plane, with snapshots on.
fn snapshot_asked(obs: &Observation) -> Decision {
    advance(
        &pending_at(obs, "kube-apiserver cp-1"),
        &snapshotting(),
        obs,
        t0(),
    )
}

fn taken() -> crate::etcd_snapshot::Snapshot {
    crate::etcd_snapshot::Snapshot::Taken {
        node: "cp-2".into(),
        at: t0(),
        stored: stored(),
        announced: true,
    }
}

/// What one pass decides before a step, with and without the snapshot: the calls, the message and
/// the preflight hold, and what the run records of its snapshot.
#[test]
fn the_snapshot_comes_before_the_first_step_that_restarts_something_on_a_control_plane() {
    use crate::etcd_snapshot::Snapshot;
    use crate::run::PreflightCheck;
    let taking = Snapshot::Taking {
        node: "cp-2".into(),
        at: t0(),
    };
    let unhealthy_etcd = |obs: &mut Observation| {
        obs.etcd.problem = Some("member cp-3 reports NOSPACE".into());
    };
    let w1_not_ready = |obs: &mut Observation| set(obs, "w-1", |n| n.kubernetes_ready = false);
    let same = |_: &mut Observation| {};
    type Change = dyn Fn(&mut Observation);
    struct Case<'a> {
        what: &'a str,
        settings: Settings,
        at: &'a str,
        recorded: Option<Snapshot>,
        change: &'a Change,
        calls: &'a [&'a str],
        message: &'a str,
        hold: Option<PreflightCheck>,
        /// The state of the snapshot the run records afterwards.
        records: Option<&'a str>,
    }
    let taking_message = "Taking an etcd snapshot from cp-2 before upgrading control plane cp-1 \
                          (step 6/23)";
    let cases = [
        Case {
            what: "off: the step goes at once",
            settings: settings(),
            at: "kube-apiserver cp-1",
            recorded: None,
            change: &same,
            calls: &["patch kube-apiserver cp-1"],
            message: "Upgrading kube-apiserver on node cp-1 (step 6/23)",
            hold: None,
            records: None,
        },
        Case {
            what: "a pre-pull restarts nothing: no snapshot yet",
            settings: snapshotting(),
            at: "prepull cp-1",
            recorded: None,
            change: &same,
            calls: &["pull cp-1"],
            message: "Pre-pulling the Kubernetes 1.35.0 images on node cp-1 (step 1/23)",
            hold: None,
            records: None,
        },
        Case {
            what: "the first kube-apiserver: taken from a follower first",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: None,
            change: &same,
            calls: &["snapshot cp-2"],
            message: taking_message,
            hold: None,
            records: Some("taking"),
        },
        Case {
            what: "a call found unanswered (the controller stopped): made again",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: Some(taking.clone()),
            change: &same,
            calls: &["snapshot cp-2"],
            message: taking_message,
            hold: None,
            records: Some("taking"),
        },
        Case {
            what: "taken: the step goes",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: Some(taken()),
            change: &same,
            calls: &["patch kube-apiserver cp-1"],
            message: "Upgrading kube-apiserver on node cp-1 (step 6/23)",
            hold: None,
            records: Some("taken"),
        },
        Case {
            what: "the first step left that restarts a control plane is a kubelet",
            settings: snapshotting(),
            at: "kubelet cp-1",
            recorded: None,
            change: &same,
            calls: &["snapshot cp-2"],
            message: "Taking an etcd snapshot from cp-2 before upgrading control plane cp-1 \
                      (step 18/23)",
            hold: None,
            records: Some("taking"),
        },
        Case {
            what: "a worker's kubelet touches no control plane",
            settings: snapshotting(),
            at: "kubelet w-1",
            recorded: None,
            change: &same,
            calls: &["patch kubelet w-1"],
            message: "Upgrading kubelet on node w-1 (step 21/23)",
            hold: None,
            records: None,
        },
        Case {
            what: "etcd not healthy: held, nothing taken",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: None,
            change: &unhealthy_etcd,
            calls: &[],
            message: "Waiting: etcd is not healthy (member cp-3 reports NOSPACE); holding the etcd \
                      snapshot before control plane cp-1 (step 6/23)",
            hold: Some(PreflightCheck::EtcdHealth),
            records: None,
        },
        Case {
            what: "a node not Ready holds the step before the snapshot is asked for",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: None,
            change: &w1_not_ready,
            calls: &[],
            message: "Waiting: node w-1 is not Ready; holding before upgrading kube-apiserver on \
                      cp-1 (step 6/23)",
            hold: Some(PreflightCheck::NodesReady),
            records: None,
        },
        Case {
            what: "etcd's health does not matter once taken",
            settings: snapshotting(),
            at: "kube-apiserver cp-1",
            recorded: Some(taken()),
            change: &unhealthy_etcd,
            calls: &["patch kube-apiserver cp-1"],
            message: "Upgrading kube-apiserver on node cp-1 (step 6/23)",
            hold: None,
            records: Some("taken"),
        },
        Case {
            what: "the first control plane left is a later one: named in the message",
            settings: snapshotting(),
            at: "kube-apiserver cp-3",
            recorded: None,
            change: &same,
            calls: &["snapshot cp-2"],
            message: "Taking an etcd snapshot from cp-2 before upgrading control plane cp-3 \
                      (step 8/23)",
            hold: None,
            records: Some("taking"),
        },
    ];
    for case in cases {
        let mut obs = cluster("1.34.1");
        (case.change)(&mut obs);
        let mut run = pending_at(&obs, case.at);
        run.etcd_snapshot = case.recorded.clone();
        let decision = advance(&run, &case.settings, &obs, t0() + 1.minutes());
        assert_eq!(labels(&decision.actions), case.calls, "{}", case.what);
        assert_eq!(decision.report.message, case.message, "{}", case.what);
        assert_eq!(decision.report.hold, case.hold, "{}", case.what);
        let records = decision.run.etcd_snapshot.as_ref().map(|s| {
            serde_json::to_value(s).expect("json")["state"]
                .as_str()
                .expect("state")
                .to_string()
        });
        assert_eq!(records.as_deref(), case.records, "{}", case.what);
        assert!(decision.run.outcome.is_none(), "{}", case.what);
    }
}

/// A whole run: the pulls, one snapshot from a follower, then every patch as without it; the
/// `EtcdSnapshotTaken` Event once, right after it is stored, before the first control-plane step.
/// Calls lost between the write-ahead and the call are made again, the snapshot too, once.
#[test]
fn a_whole_run_takes_one_snapshot_before_the_control_planes() {
    let mut expected = expected_calls();
    expected.insert(5, "snapshot cp-2".into());
    for lose_every in [0, 3] {
        let mut cluster = FakeCluster::new(1);
        let run = start(&cluster.obs);
        let (run, calls, notes) = drive_from(&mut cluster, run, &snapshotting(), |round| {
            lose_every != 0 && round % lose_every == 0
        });
        assert!(matches!(run.outcome, Some(Outcome::Completed { .. })));
        assert_eq!(calls, expected, "losing every {lose_every}");
        let told: Vec<String> = notes
            .iter()
            .filter(|n| n.reason != Reason::NodeUpgraded)
            .map(|n| format!("{}: {}", n.reason, n.message))
            .collect();
        let taken_at = told
            .iter()
            .position(|n| n.starts_with("EtcdSnapshotTaken: "))
            .expect("announced");
        assert_eq!(
            told[taken_at],
            "EtcdSnapshotTaken: etcd snapshot from cp-2 stored at \
             file:///snapshots/ns/c/20261125T100000Z-kubernetes-1.35.0.snapshot (42 bytes, sha256 \
             ab); upgrading the control planes"
        );
        assert_eq!(
            told[taken_at + 1],
            "StepStarted: Upgrading kube-apiserver on node cp-1 to 1.35.0 \
             (registry.k8s.io/kube-apiserver:v1.35.0)"
        );
        assert_eq!(
            notes
                .iter()
                .filter(|n| n.reason == Reason::EtcdSnapshotTaken)
                .count(),
            1
        );
        assert!(matches!(
            run.etcd_snapshot,
            Some(crate::etcd_snapshot::Snapshot::Taken {
                announced: true,
                ..
            })
        ));
    }
}

/// A snapshot that failed or could not be verified fails the run, naming the node and why, before
/// any step that restarts a control plane (no step failed, no node failed); nothing more is called.
/// `resume` takes it again; a resume after a snapshot taken does not take a second one.
#[test]
fn a_failed_snapshot_fails_the_run_before_any_control_plane_and_resume_takes_it_again() {
    use crate::lifecycle::Kind as _;
    let obs = cluster("1.34.1");
    let asked = snapshot_asked(&obs);
    assert_eq!(labels(&asked.actions), ["snapshot cp-2"]);
    let mut run = asked.run;
    let cleanup = Kubernetes::refused(
        &mut run,
        &asked.actions[0],
        "the node refused it: failed reading etcd snapshot",
        t0() + 1.seconds(),
    );
    assert!(cleanup.is_empty());
    let failed = advance(&run, &snapshotting(), &obs, t0() + 2.seconds());
    let message = "Kubernetes upgrade failed: the etcd snapshot from control plane cp-2 failed: the \
                   node refused it: failed reading etcd snapshot; the run stopped before upgrading \
                   any control plane (none was touched): fix the node or the snapshot destination, \
                   then set resume to take it again";
    assert_eq!(failed.report.state, RunState::Failed);
    assert_eq!(failed.report.message, message);
    assert!(failed.actions.is_empty());
    assert!(failed.report.failed_nodes.is_empty());
    assert!(
        failed
            .run
            .steps
            .iter()
            .all(|s| !matches!(s.state, StepState::Failed { .. } | StepState::Issued { .. })),
        "no step started or failed"
    );
    assert_eq!(
        failed.run.etcd_snapshot,
        Some(crate::etcd_snapshot::Snapshot::Failed {
            node: "cp-2".into(),
            at: t0() + 1.seconds(),
            reason: "the node refused it: failed reading etcd snapshot".into(),
        })
    );
    // The failure is announced by the pass that recorded it (the lifecycle publishes it); a
    // decision on the finished run calls nothing more.
    assert!(reasons(&failed.report.notes).is_empty());

    let mut resumed = failed.run.clone();
    assert!(resume(&mut resumed));
    assert_eq!(resumed.etcd_snapshot, None);
    let again = advance(&resumed, &snapshotting(), &obs, t0() + 1.minutes());
    assert_eq!(labels(&again.actions), ["snapshot cp-2"]);

    // Taken, then a later step fails: resume goes on from that step, with no second snapshot.
    let mut run = pending_at(&obs, "kube-scheduler cp-2");
    run.etcd_snapshot = Some(taken());
    let index = index_of(&run, "kube-scheduler cp-2");
    assert!(fail_step(&mut run, index, "refused", t0()));
    assert!(resume(&mut run));
    assert_eq!(run.etcd_snapshot, Some(taken()));
    let decision = advance(&run, &snapshotting(), &obs, t0() + 1.minutes());
    assert_eq!(labels(&decision.actions), ["patch kube-scheduler cp-2"]);
}

/// The snapshot stored is told once, by the pass that recorded it.
#[test]
fn a_stored_snapshot_is_announced_once_and_the_held_step_goes_in_the_same_pass() {
    use crate::lifecycle::{Answered, Kind as _};
    let obs = cluster("1.34.1");
    let asked = snapshot_asked(&obs);
    let mut run = asked.run;
    let answered = Kubernetes::stored(&mut run, &asked.actions[0], &stored(), &obs, t0());
    assert_eq!(answered, Answered::DecideAgain);
    let next = advance(&run, &snapshotting(), &obs, t0());
    assert_eq!(labels(&next.actions), ["patch kube-apiserver cp-1"]);
    assert_eq!(
        reasons(&next.report.notes),
        ["EtcdSnapshotTaken", "StepStarted"]
    );
    let after = advance(&next.run, &snapshotting(), &obs, t0() + 1.seconds());
    assert!(!reasons(&after.report.notes).contains(&"EtcdSnapshotTaken"));
}

/// etcd is looked at only while a snapshot is due: the mode on, not paused, and a control plane
/// still to restart before the snapshot is taken.
#[test]
fn etcd_is_looked_at_only_while_the_snapshot_is_due() {
    use crate::lifecycle::Kind as _;
    let obs = cluster("1.34.1");
    let at = |step: &str, snapshot: Option<crate::etcd_snapshot::Snapshot>| {
        let mut run = pending_at(&obs, step);
        run.etcd_snapshot = snapshot;
        run
    };
    let paused = Settings {
        paused: true,
        ..snapshotting()
    };
    let cases: [(&str, Settings, Option<KubeRun>, bool); 7] = [
        ("off, no run", settings(), None, false),
        ("on, a run about to start", snapshotting(), None, true),
        ("on, paused", paused, None, false),
        (
            "on, before the control planes",
            snapshotting(),
            Some(at("prepull cp-1", None)),
            true,
        ),
        (
            "on, taken",
            snapshotting(),
            Some(at("kube-apiserver cp-1", Some(taken()))),
            false,
        ),
        (
            "on, only workers' kubelets left",
            snapshotting(),
            Some(at("kubelet w-1", None)),
            false,
        ),
        (
            "off, before the control planes",
            settings(),
            Some(at("prepull cp-1", None)),
            false,
        ),
    ];
    for (what, settings, run, etcd) in cases {
        assert_eq!(
            Kubernetes::request(run.as_ref(), &settings),
            Request { etcd },
            "{what}"
        );
    }
}

/// The mode as the annotation says it, against whether the controller has a destination: only
/// `talos-and-kubernetes` makes a Kubernetes run take one; asked for with nowhere to put it, or a
/// value it cannot read, the run does not start.
#[test]
fn the_settings_take_the_snapshot_mode_of_the_annotation() {
    use crate::intent::UpgradeIntent;
    use crate::lifecycle::{Kind as _, Limits};
    let cases: [(Option<&str>, bool, Result<bool, &str>); 6] = [
        (None, true, Ok(false)),
        (Some("talos"), true, Ok(false)),
        (Some("talos"), false, Ok(false)),
        (Some("talos-and-kubernetes"), true, Ok(true)),
        (
            Some("talos-and-kubernetes"),
            false,
            Err(
                "has the invalid value \"talos-and-kubernetes\": the controller has no etcd \
                 snapshot destination",
            ),
        ),
        (
            Some("sometimes"),
            true,
            Err("has the invalid value \"sometimes\": use off, talos"),
        ),
    ];
    for (mode, destination, want) in cases {
        let annotations: BTreeMap<String, String> = mode
            .map(|m| (crate::annotations::ETCD_SNAPSHOT.to_string(), m.to_string()))
            .into_iter()
            .collect();
        let intent = UpgradeIntent::from_annotations(&annotations);
        let limits = Limits {
            etcd_snapshot: destination,
            ..Limits::default()
        };
        match (Kubernetes::settings(&intent, &limits), want) {
            (Ok(got), Ok(want)) => assert_eq!(got.etcd_snapshot, want, "{mode:?}"),
            (Err(got), Err(want)) => {
                assert!(got.to_string().contains(want), "{mode:?}: {got}")
            }
            (got, want) => panic!("{mode:?} {destination}: {got:?}, wanted {want:?}"),
        }
    }
}
