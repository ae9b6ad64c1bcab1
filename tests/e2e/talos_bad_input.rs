//! Talos OS upgrades refused because of what the user gave the controller: a target that is not a
//! version, a downgrade, a path Talos cannot take in one step, a target that does not support the
//! running Kubernetes, and missing or unusable credentials. End to end against a real API server, the
//! real kubectl, the controller in-process and a simulated five-node cluster.
//!
//! Each refusal must be visible (`talos-status: failed`, a message that says why and what to do, phase
//! `UpgradeFailed`, the `TalosUpgrade` condition, a Warning Event) and must touch no node: the simulator's
//! call record, which holds every mutating Talos call, stays empty. Fixing the input lets the upgrade
//! proceed. No timing assertions: every wait is `kubectl wait` or polling with generous bounds.

use std::time::{Duration, Instant};

use crate::world::{World, WorldSpec};
use talos_sim::{ClientRole, Fault};

const PATIENCE: Duration = Duration::from_secs(120);

/// Polls `talos-message` until `check` accepts it; returns it.
async fn wait_for_message(world: &World, what: &str, check: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let message = world.annotation("talos-message").await;
        if check(&message) {
            return message;
        }
        assert!(
            Instant::now() < deadline,
            "talos-message never became {what}; last: {message:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls until the controller has removed the user's one-shot annotation `key`.
async fn wait_until_consumed(world: &World, key: &str) {
    let deadline = Instant::now() + PATIENCE;
    while !world.annotation(key).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the controller did not remove {key} within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The refusal as the user sees it: status, message, phase, condition, and a Warning Event saying the
/// same; and no mutating call reached any node.
async fn assert_refused(world: &World, message: &str, event_reason: &str) {
    assert_refused_state(world, message).await;
    let event = world.wait_for_event(event_reason, Some(message)).await;
    assert_eq!(event.type_, "Warning");
}

/// A second refusal with the same event reason: announced once more. Only the count is checked: the
/// event recorder (`event_recorder`, which folds as kube-runtime's `Recorder` does) folds an event with
/// the same type, reason, action and object into the earlier one's series within six minutes, keeping
/// the earlier message.
async fn assert_refused_again(world: &World, message: &str, event_reason: &str, times: u64) {
    assert_refused_state(world, message).await;
    let deadline = Instant::now() + PATIENCE;
    while world.event_count(event_reason).await < times {
        assert!(
            Instant::now() < deadline,
            "{event_reason} was not announced {times} times: {:#?}",
            world.cluster_events().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn assert_refused_state(world: &World, message: &str) {
    assert_refused_status(world, message).await;
    let record = world.sim.record();
    assert!(record.is_empty(), "no node may be touched: {record:#?}");
}

/// The refusal in the annotations, the phase and the condition.
async fn assert_refused_status(world: &World, message: &str) {
    assert_eq!(world.annotation("talos-status").await, "failed");
    assert_eq!(world.annotation("talos-message").await, message);
    assert_eq!(world.annotation("failed-nodes").await, "");
    assert_eq!(world.jsonpath("{.status.phase}").await, "UpgradeFailed");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Failed"
    );
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].message}")
            .await,
        message
    );
}

async fn fix_target_and_complete(world: &World) {
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    let mut calls = world.upgrade_calls();
    calls.sort();
    calls.dedup();
    assert_eq!(calls.len(), 5, "each node upgraded once: {calls:?}");
    assert_eq!(world.upgrade_calls().len(), 5);
}

fn secret_name(world: &World) -> String {
    format!("{}-id", world.ns.name)
}

/// Writes `talosconfig` into the credentials Secret (a merge patch through `stringData`).
async fn set_talosconfig(world: &World, talosconfig: &str) {
    let patch = serde_json::json!({"stringData": {"talosconfig": talosconfig}}).to_string();
    world
        .ns
        .kubectl_ok(&[
            "patch",
            "secret",
            &secret_name(world),
            "--type=merge",
            "-p",
            &patch,
        ])
        .await;
}

#[tokio::test]
async fn an_unparsable_target_is_refused_once_per_value_and_a_valid_one_then_proceeds() {
    let world = World::start("tb-unparsable", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Invalid talos-target: \"1.12\" is not a version: use MAJOR.MINOR.PATCH, e.g. \
                   1.12.0. No node was touched.";
    assert_refused(&world, message, "InvalidTarget").await;

    // Decided once: one failed run for that value, remembered in the progress ConfigMap ...
    let run = world.persisted_talos_run().await;
    assert_eq!(run["requested"], "1.12", "{run}");
    assert_eq!(run["outcome"]["result"], "failed", "{run}");
    assert_eq!(run["nodes"], serde_json::json!([]), "{run}");
    // ... so looking again (another annotation changes) neither repeats the event nor touches a node.
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    assert_eq!(world.event_count("InvalidTarget").await, 1);
    assert_eq!(world.annotation("talos-message").await, message);
    assert_eq!(world.persisted_talos_run().await, run);
    assert!(world.sim.record().is_empty());

    // A new value is a new decision: refused again, with its own message and one more event.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=latest")
        .await;
    let latest = wait_for_message(&world, "about \"latest\"", |m| {
        m.starts_with("Invalid talos-target: \"latest\"")
    })
    .await;
    assert!(
        latest.starts_with(
            "Invalid talos-target: \"latest\" is not a version: use MAJOR.MINOR.PATCH, e.g. 1."
        ) && latest.ends_with(". No node was touched."),
        "{latest}"
    );
    assert_refused_again(&world, &latest, "InvalidTarget", 2).await;
    world.poke_and_wait(3).await;
    assert_eq!(world.event_count("InvalidTarget").await, 2);

    // `resume` cannot make "latest" a version: the key is consumed and nothing else happens.
    world.annotate_raw("upgrade.vitistack.io/resume=true").await;
    wait_until_consumed(&world, "resume").await;
    assert_refused_state(&world, &latest).await;
    assert_eq!(world.event_count("InvalidTarget").await, 2);
    assert_eq!(world.persisted_talos_run().await["requested"], "latest");

    // Fixing the value: the upgrade runs.
    fix_target_and_complete(&world).await;
}

#[tokio::test]
async fn a_downgrade_and_a_path_talos_cannot_take_in_one_step_are_refused() {
    let world = World::start("tb-path", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.10.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    assert_refused(
        &world,
        "Talos upgrade refused: Downgrade from 1.11.6 to 1.10.0 is not supported: choose a target \
         of 1.11.6 or newer. No node was touched.",
        "InvalidTarget",
    )
    .await;

    // 1.14's installer accepts hosts from 1.12 on: the message names the release to go through.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.14.0")
        .await;
    let message = "Talos upgrade refused: Talos 1.11.6 cannot upgrade to 1.14.0 in one step: \
                   upgrade to 1.13 first. No node was touched.";
    wait_for_message(&world, "the one-step refusal", |m| m == message).await;
    assert_refused_again(&world, message, "InvalidTarget", 2).await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("InvalidTarget").await, 2);
    assert!(world.sim.record().is_empty());
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.11.6", "{}", node.name);
    }
}

#[tokio::test]
async fn a_release_newer_than_every_known_one_is_refused() {
    // The built-in catalog, as the controller runs by default, knows Talos up to 1.14.1: 1.15.0 has
    // no known rules, so it is refused before any node is touched (issue 22, item 5).
    let world = World::start(
        "tb-unknown",
        WorldSpec {
            talos: "1.13.0",
            catalog: Some(
                talos_upgrade_controller::catalog_sources::CatalogHandle::fixed(
                    talos_upgrade_core::catalog::Catalog::builtin(),
                ),
            ),
            ..Default::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.13.0", "60s")
        .await;
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.15.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    assert_refused(
        &world,
        "Talos upgrade refused: Talos 1.15.0 is an unknown release; the newest known is 1.14.1. Set \
         a known release, add it to the release catalog (--release-catalog, or live sources), or \
         start the controller with --allow-unknown-releases. No node was touched.",
        "InvalidTarget",
    )
    .await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("InvalidTarget").await, 1);
    assert!(world.sim.record().is_empty());
}

#[tokio::test]
async fn a_target_that_does_not_support_the_running_kubernetes_is_refused() {
    // Talos 1.11 runs Kubernetes 1.29 to 1.34; Talos 1.12 needs 1.30 or newer.
    let world = World::start(
        "tb-k8s",
        WorldSpec {
            kubernetes: "1.29.10",
            ..Default::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Talos upgrade refused: Talos 1.12.0 does not support the running Kubernetes \
                   1.29.10. Upgrade Kubernetes to 1.30 first. No node was touched.";
    assert_refused(&world, message, "InvalidTarget").await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("InvalidTarget").await, 1);
    assert!(world.sim.record().is_empty());

    // `resume` decides the target again (after upgrading Kubernetes it would now start); Kubernetes
    // is unchanged here, so it is refused again, announced again since the user asked, and the key
    // is consumed.
    world.annotate_raw("upgrade.vitistack.io/resume=true").await;
    wait_until_consumed(&world, "resume").await;
    assert_refused_again(&world, message, "InvalidTarget", 2).await;
    world.poke_and_wait(2).await;
    assert_eq!(world.event_count("InvalidTarget").await, 2);
    assert!(world.sim.record().is_empty());
}

#[tokio::test]
async fn a_missing_credentials_secret_is_reported_and_restoring_it_lets_the_upgrade_run() {
    let world = World::start("tb-nosecret", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let secret = secret_name(&world);
    world.ns.kubectl_ok(&["delete", "secret", &secret]).await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = format!(
        "Talos upgrade cannot proceed: credentials Secret {}/{secret} not found",
        world.ns.name
    );
    assert_refused(&world, &message, "UpgradeBlocked").await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("UpgradeBlocked").await, 1);
    assert!(world.sim.record().is_empty());

    // Restoring the Secret: the controller, which keeps looking, starts the upgrade by itself.
    let kubeconfig = std::fs::read_to_string(world.ns.kubeconfig()).expect("kubeconfig");
    world
        .ns
        .kubectl_ok(&[
            "create",
            "secret",
            "generic",
            &secret,
            &format!(
                "--from-literal=talosconfig={}",
                world.sim.talosconfig(ClientRole::Admin)
            ),
            &format!("--from-literal=kube.config={kubeconfig}"),
        ])
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

#[tokio::test]
async fn an_invalid_credentials_secret_name_is_reported_not_looked_up() {
    let world = World::start("tb-secretname", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .annotate_raw("upgrade.vitistack.io/credentials-secret=Not_A_Secret!")
        .await;
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Talos upgrade cannot proceed: Annotation upgrade.vitistack.io/credentials-secret has \
                   the invalid value \"Not_A_Secret!\": use a Secret name: at most 253 lowercase letters, \
                   digits, '-' and '.', starting and ending with a letter or digit";
    assert_refused(&world, message, "UpgradeBlocked").await;
    assert!(world.sim.record().is_empty());

    // Removing the bad override goes back to the Secret named after the cluster id.
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/credentials-secret-",
        ])
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

#[tokio::test]
async fn a_malformed_talosconfig_is_reported_naming_the_secret() {
    let world = World::start("tb-garbage", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let secret = secret_name(&world);
    set_talosconfig(&world, "this is: [not a talosconfig").await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = world.annotation("talos-message").await;
    let prefix = format!(
        "Talos upgrade cannot proceed: the talosconfig in Secret {}/{secret} is not usable: ",
        world.ns.name
    );
    assert!(message.starts_with(&prefix), "{message}");
    assert!(
        !message.contains("not a talosconfig"),
        "the Secret's contents are never quoted: {message}"
    );
    assert_refused(&world, &message, "UpgradeBlocked").await;

    set_talosconfig(&world, &world.sim.talosconfig(ClientRole::Admin)).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

#[tokio::test]
async fn a_talosconfig_from_another_ca_is_reported_as_refused_credentials() {
    let world = World::start("tb-otherca", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let secret = secret_name(&world);
    set_talosconfig(&world, &world.sim.talosconfig_from_other_ca()).await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = world.annotation("talos-message").await;
    let first = world.node("cp-1");
    let prefix = format!(
        "Talos upgrade cannot proceed: the Talos API of node {first} refused the credentials in \
         Secret {}/{secret} (TLS handshake failed: ",
        world.ns.name
    );
    assert!(message.starts_with(&prefix), "{message}");
    assert!(
        message.ends_with(
            "put this cluster's talosconfig (os:admin) in the Secret's \"talosconfig\" key"
        ),
        "{message}"
    );
    assert_refused(&world, &message, "UpgradeBlocked").await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("UpgradeBlocked").await, 1);
    assert!(world.sim.record().is_empty());

    set_talosconfig(&world, &world.sim.talosconfig(ClientRole::Admin)).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

/// The controller keeps a cluster's connections between reconciles, and a reconcile lists the workload
/// Nodes with those of the Secret as last read, alongside its read of the Secret. Credentials replaced
/// in between must win: whatever the old connections answered is dropped and the nodes are asked with
/// the new ones. Here the old ones would still work and show the next node ready to go; the new ones
/// are refused, so the run holds, says why, and starts no node until the credentials are fixed.
#[tokio::test]
async fn credentials_replaced_mid_run_are_the_ones_used_and_their_refusal_holds_the_run() {
    let world = World::start(
        "tb-midrun",
        WorldSpec {
            node_deadline: Duration::from_secs(600),
            // Few looks while paused, so that the resume is nearly always the first to see the new
            // Secret (the run itself moves on the nodes' own wake-ups).
            poll_interval: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    // The first worker upgraded stays down until released, so the run can be paused behind it.
    let workers = [world.node("worker-1"), world.node("worker-2")];
    for worker in &workers {
        world
            .sim
            .inject_fault(worker, Fault::NeverReturns)
            .expect("fault");
    }
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    let deadline = Instant::now() + PATIENCE;
    while world.upgrade_calls().is_empty() {
        assert!(Instant::now() < deadline, "no upgrade call was made");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = world.upgrade_calls()[0].clone();
    world.annotate_raw("upgrade.vitistack.io/paused=true").await;
    for worker in &workers {
        world.sim.clear_faults(worker).expect("clear");
    }
    wait_for_message(&world, "paused after the first node", |message| {
        message.starts_with("Paused after 1/5 nodes")
    })
    .await;

    // New credentials the nodes refuse, then the run is resumed: the reconcile that resumes it is the
    // first to read the new Secret, while the connections it kept still work.
    set_talosconfig(&world, &world.sim.talosconfig_from_other_ca()).await;
    world.annotate_raw("upgrade.vitistack.io/paused-").await;
    let message = wait_for_message(&world, "a refusal of the new credentials", |message| {
        message.starts_with("Talos upgrade cannot proceed: the Talos API of node ")
    })
    .await;
    assert!(
        message.contains(&format!(
            "refused the credentials in Secret {}/{}",
            world.ns.name,
            secret_name(&world)
        )),
        "{message}"
    );
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    assert_eq!(world.annotation("talos-progress").await, "1/5");
    let blocked = world.wait_for_event("UpgradeBlocked", Some(&message)).await;
    assert_eq!(blocked.type_, "Warning");
    world.poke_and_wait(1).await;
    // No node was started on what the old credentials showed.
    assert_eq!(world.upgrade_calls(), vec![first.clone()]);
    let started = world.event_messages("NodeUpgradeStarted").await;
    assert_eq!(started.len(), 1, "{started:#?}");
    assert!(
        started[0].starts_with(&format!("Upgrading node {first} ")),
        "{started:#?}"
    );

    set_talosconfig(&world, &world.sim.talosconfig(ClientRole::Admin)).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    let mut calls = world.upgrade_calls();
    assert_eq!(calls.len(), 5, "{calls:?}");
    assert_eq!(calls[0], first);
    calls.sort();
    calls.dedup();
    assert_eq!(calls.len(), 5, "each node upgraded once: {calls:?}");
}

#[tokio::test]
async fn an_invalid_option_stops_the_run_from_starting_until_it_is_fixed() {
    let world = World::start("tb-option", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world
        .annotate_raw("upgrade.vitistack.io/max-parallel-workers=0")
        .await;
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Talos upgrade not started: Annotation upgrade.vitistack.io/max-parallel-workers \
                   has the invalid value \"0\": use a whole number of 1 or more (the default is 1)";
    assert_refused(&world, message, "InvalidOption").await;
    world.poke_and_wait(1).await;
    assert_eq!(world.event_count("InvalidOption").await, 1);
    assert!(world.sim.record().is_empty());

    // Removing the bad value is enough: the upgrade starts with the default batch size.
    world
        .annotate_raw("upgrade.vitistack.io/max-parallel-workers-")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

#[tokio::test]
async fn a_target_equal_to_the_running_version_completes_at_once_without_touching_a_node() {
    let world = World::start("tb-same", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    // Not bad input: the protocol says it completes at once. `v` prefixes are accepted.
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=v1.11.6")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Talos upgrade completed: now running 1.11.6"
    );
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Completed"
    );
    // The phase never left what it was (the world has no provisioning operator to set one).
    assert_ne!(world.jsonpath("{.status.phase}").await, "UpgradingTalos");
    world.poke_and_wait(1).await;
    let record = world.sim.record();
    assert!(record.is_empty(), "no node may be touched: {record:#?}");
    assert!(world.sim.power_events().is_empty());
}

/// `paused: "yes"` is not a flag value. The controller takes the safe reading (holding is reversible,
/// upgrading is not): the run holds before its first node, and a Warning Event says which annotation is
/// wrong, what to write, and that it is treated as paused. Writing `false` lets the run go on.
#[tokio::test]
async fn an_unrecognised_paused_value_holds_the_run_and_says_so() {
    let world = World::start("tb-flag", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate_raw("upgrade.vitistack.io/paused=yes").await;
    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;

    let message = "Annotation upgrade.vitistack.io/paused has the invalid value \"yes\": use \
                   \"true\" or \"false\"; treated as paused until it is fixed";
    let event = world.wait_for_event("InvalidFlag", Some(message)).await;
    assert_eq!(event.type_, "Warning");
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "paused", |m| {
            m.starts_with("Paused after 0/5 nodes")
        })
        .await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    world.poke_and_wait(1).await;
    assert!(world.sim.record().is_empty(), "no node touched while held");

    world
        .annotate_raw("upgrade.vitistack.io/paused=false")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.upgrade_calls().len(), 5);
}

/// A new target is acknowledged (`in-progress`) on the versions the controller last saw, before it
/// looks at the nodes again; the run is decided on the fresh look. A node upgraded by hand since the
/// last look makes the target a downgrade for it: acknowledged, then refused, and no node is touched
/// by the controller.
#[tokio::test]
async fn a_target_acknowledged_on_the_last_look_is_refused_when_a_node_was_upgraded_by_hand_since()
{
    use talos_api::{ConnectOptions, LegacyUpgradeOptions, TalosClient, Talosconfig, Target};

    let world = World::start("tb-hand", WorldSpec::default()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    // An operator upgrades one worker with talosctl, behind the controller's back.
    let by_hand = world.node("worker-2");
    let address = world
        .sim
        .nodes()
        .into_iter()
        .find(|node| node.name == by_hand)
        .map(|node| std::net::IpAddr::V4(node.address))
        .expect("worker-2 in the simulator");
    let credentials = Talosconfig::from_yaml(&world.sim.talosconfig(ClientRole::Admin))
        .and_then(|config| config.current_context()?.credentials())
        .expect("the simulator's talosconfig");
    let client = TalosClient::connect(
        &credentials,
        Target::Node(address),
        &ConnectOptions {
            port: world.sim.config().port,
            ..ConnectOptions::default()
        },
    )
    .await
    .expect("connecting to worker-2");
    client
        .upgrade_legacy(
            "ghcr.io/siderolabs/installer:v1.12.1",
            &LegacyUpgradeOptions {
                preserve: true,
                ..LegacyUpgradeOptions::default()
            },
        )
        .await
        .expect("the upgrade by hand is accepted");
    let deadline = Instant::now() + PATIENCE;
    loop {
        let node = world.sim.node_snapshot(&by_hand).expect("worker-2");
        if node.talos_version == "1.12.1" && node.ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "worker-2 did not come back on 1.12.1: {node:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = world.record_annotations().await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "failed", "60s")
        .await;
    let message = "Talos upgrade refused: Downgrade from 1.12.1 to 1.12.0 is not supported: \
                   choose a target of 1.12.1 or newer. No node was touched.";
    assert_refused_status(&world, message).await;
    let event = world.wait_for_event("InvalidTarget", Some(message)).await;
    assert_eq!(event.type_, "Warning");

    // What a user watching the object saw: the acknowledgement on the last look, then the refusal.
    let deadline = Instant::now() + PATIENCE;
    while log.values("talos-status").last().map(String::as_str) != Some("failed") {
        assert!(Instant::now() < deadline, "the watch never saw the refusal");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        log.values("talos-status"),
        ["idle", "in-progress", "failed"],
        "messages: {:#?}",
        log.values("talos-message")
    );
    assert!(
        log.values("talos-message").contains(
            &"Starting the Talos upgrade from 1.11.6 to 1.12.0: checking the nodes".to_string()
        ),
        "{:#?}",
        log.values("talos-message")
    );

    // The only call any node received is the one made by hand.
    world.poke_and_wait(1).await;
    let record = world.sim.record();
    assert_eq!(record.len(), 1, "{record:#?}");
    assert_eq!(record[0].node, by_hand);
    assert_eq!(record[0].method, "/machine.MachineService/Upgrade");
    assert_eq!(world.event_count("InvalidTarget").await, 1);
}
