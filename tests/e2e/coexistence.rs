//! Living beside vitistack's talos-operator, which reads and writes the same annotations: a cluster
//! excluded with `upgrade.vitistack.io/do-not-reconcile` is not touched at all, and a cluster whose
//! controller-written annotations another field manager writes is not acted on (never two controllers
//! on one cluster). A real API server, the real kubectl (`--field-manager` stands for the other
//! controller), the controller in-process and the Talos simulator; "nothing happened" is asserted
//! over counted reconciles.

use std::time::Duration;

use crate::world::{World, WorldSpec};
use talos_upgrade_core::coexistence::EXCLUDED_MESSAGE;

const TARGET: &str = "1.12.0";

/// `do-not-reconcile` set: a Talos target set meanwhile starts nothing (no Talos API call at all over
/// several reconciles), the status stays as it was, both messages say the cluster is excluded and by
/// which annotation, with one Event; removing it resumes, and the upgrade runs.
#[tokio::test]
async fn do_not_reconcile_touches_nothing_until_removed() {
    let world = World::start("coexist-excluded", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-status", "idle", "60s")
        .await;

    world.annotate("do-not-reconcile", "true").await;
    world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(60),
            "the exclusion",
            |m| m == EXCLUDED_MESSAGE,
        )
        .await;
    let calls_before = world.sim.record().len();

    world.annotate("talos-target", TARGET).await;
    for round in 0..4 {
        world.poke_and_wait(round).await;
    }
    assert_eq!(
        world.sim.record().len(),
        calls_before,
        "no Talos API call while excluded: {}",
        world.sim.record_json()
    );
    assert!(world.upgrade_calls().is_empty());
    assert_eq!(world.annotation("talos-status").await, "idle");
    assert_eq!(world.annotation("talos-progress").await, "");
    assert_eq!(world.annotation("talos-message").await, EXCLUDED_MESSAGE);
    assert_eq!(
        world.annotation("kubernetes-message").await,
        EXCLUDED_MESSAGE
    );
    assert!(
        EXCLUDED_MESSAGE.contains("upgrade.vitistack.io/do-not-reconcile"),
        "names the annotation"
    );
    assert_eq!(
        world.event_messages("Excluded").await,
        vec![EXCLUDED_MESSAGE.to_string()]
    );
    assert_eq!(world.event_count("Excluded").await, 1, "said once");
    assert_eq!(world.event_count("UpgradeStarted").await, 0);

    world.remove_annotation("do-not-reconcile").await;
    world
        .wait_for_annotation("talos-status", "completed", "120s")
        .await;
    world.assert_each_node_upgraded_once(5);
    assert_eq!(world.annotation("talos-current").await, TARGET);
}

/// Another field manager ("talos-operator", as vitistack's operator would be) writes
/// `upgrade.vitistack.io/talos-status`: the controller refuses, touches no node, and says so naming
/// the manager and the hand-over, with one Warning Event. Handing over (the other's annotation
/// removed) lets the upgrade run.
#[tokio::test]
async fn another_field_manager_of_the_upgrade_annotations_is_not_fought() {
    let world = World::start(
        "coexist-other",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "--overwrite",
            "--field-manager=talos-operator",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/talos-status=idle",
        ])
        .await;
    let calls_before = world.sim.record().len();
    world.start_controller();
    let message = world
        .wait_for_annotation_matching(
            "talos-message",
            Duration::from_secs(60),
            "the refusal",
            |m| m.starts_with("Not acting"),
        )
        .await;
    world.annotate("talos-target", TARGET).await;
    for round in 0..4 {
        world.poke_and_wait(round).await;
    }
    assert_eq!(
        world.sim.record().len(),
        calls_before,
        "no Talos API call while another controller writes: {}",
        world.sim.record_json()
    );
    assert!(
        message.contains("also written by \"talos-operator\""),
        "{message}"
    );
    assert!(
        message.contains("upgrade.vitistack.io/talos-status"),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "kubectl -n {} annotate kubernetescluster {} upgrade.vitistack.io/talos-status-",
            world.ns.name, world.cluster
        )),
        "says how to hand over: {message}"
    );
    assert_eq!(world.annotation("kubernetes-message").await, message);
    assert_eq!(world.annotation("talos-status").await, "idle", "not ours");
    assert_eq!(
        world.annotation("talos-current").await,
        "",
        "nothing looked at"
    );
    let warnings: Vec<_> = world
        .cluster_events()
        .await
        .into_iter()
        .filter(|e| e.reason == "ControllerConflict")
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert_eq!(
        (warnings[0].type_.as_str(), warnings[0].count),
        ("Warning", 1)
    );
    assert_eq!(warnings[0].message, message);

    // The hand-over: the other controller stopped, its annotation removed.
    world.remove_annotation("talos-status").await;
    world.poke_and_wait(10).await;
    world
        .wait_for_annotation("talos-status", "completed", "120s")
        .await;
    world.assert_each_node_upgraded_once(5);
}
