//! The user guide's Talos upgrade, verbatim, against a real API server, the real kubectl, the controller
//! and a simulated five-node cluster: annotate, watch, `kubectl wait`, then check what the user sees and
//! what the nodes received.

use crate::world::{World, WorldSpec};
use talos_sim::{Role, max_concurrently_down};

/// etcd leadership was moved off each control plane before its upgrade call: cp-1 leads when the
/// cluster starts, so at least one move was made, and no control plane led when its call arrived.
fn assert_etcd_leadership_moved_first(world: &World) {
    let record = world.sim.record();
    let is_control_plane_upgrade =
        |c: &&talos_sim::CallRecord| c.method.ends_with("/Upgrade") && c.node.contains("-cp-");
    let upgrades: Vec<_> = record.iter().filter(is_control_plane_upgrade).collect();
    assert_eq!(upgrades.len(), 3, "{upgrades:?}");
    for call in &upgrades {
        assert_eq!(call.params["etcd_leader"], false, "{call:?}");
    }
    let first_move = record
        .iter()
        .position(|c| c.method.ends_with("/EtcdForfeitLeadership"));
    let first_cp_upgrade = record.iter().position(|c| is_control_plane_upgrade(&c));
    assert!(
        first_move.is_some() && first_move < first_cp_upgrade,
        "leadership moved before the first control plane's upgrade: {record:?}"
    );
}

#[tokio::test]
async fn the_user_guide_talos_upgrade_rolls_every_node_once_workers_first() {
    let world = World::start("talos-e2e", WorldSpec::default()).await;

    // Step 1 of the guide: the controller shows the running version before anything is asked.
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    assert_eq!(world.annotation("talos-status").await, "idle");

    // Step 2: trigger.
    world
        .ns
        .kubectl_ok(&[
            "annotate",
            "kubernetescluster",
            &world.cluster,
            "upgrade.vitistack.io/talos-target=1.12.0",
        ])
        .await;

    // Step 3/4: wait for completion as the guide does.
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(
        world.annotation("talos-message").await,
        "Talos upgrade completed: now running 1.12.0"
    );
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Completed"
    );

    // What the nodes received: each node exactly once, every worker before any control plane, never two
    // control planes down at once.
    let calls = world.upgrade_calls();
    assert_eq!(calls.len(), 5, "{calls:?}");
    let unique: std::collections::BTreeSet<_> = calls.iter().collect();
    assert_eq!(
        unique.len(),
        5,
        "each node upgraded exactly once: {calls:?}"
    );
    let first_cp = calls.iter().position(|n| n.contains("-cp-")).expect("cp");
    let last_worker = calls
        .iter()
        .rposition(|n| n.contains("-worker-"))
        .expect("worker");
    assert!(last_worker < first_cp, "workers first: {calls:?}");
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
    assert_etcd_leadership_moved_first(&world);
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.12.0", "{}", node.name);
    }

    // The same story in /metrics.
    let metrics = world.metrics.encode();
    let sample = |name: &str, labels: &[&str]| {
        metrics
            .lines()
            .find(|l| l.starts_with(name) && labels.iter().all(|label| l.contains(label)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in:\n{metrics}"))
            .rsplit(' ')
            .next()
            .expect("value")
            .to_string()
    };
    let cluster_labels = [r#"cluster="my-cluster""#, r#"kind="talos""#];
    assert_eq!(
        sample(
            "talos_upgrade_runs_total",
            &[
                cluster_labels[0],
                cluster_labels[1],
                r#"result="completed""#
            ]
        ),
        "1"
    );
    assert_eq!(
        sample("talos_upgrade_cluster_nodes_completed", &cluster_labels),
        "5"
    );
    // Every node's upgrade time went into the histogram: 2 workers and 3 control planes.
    for (role, nodes) in [("worker", "2"), ("control-plane", "3")] {
        assert_eq!(
            sample(
                "talos_upgrade_node_upgrade_duration_seconds_count",
                &[cluster_labels[0], &format!(r#"role="{role}""#)]
            ),
            nodes
        );
    }
    assert_ne!(
        sample(
            "talos_upgrade_cluster_run_started_timestamp_seconds",
            &cluster_labels
        ),
        "0"
    );
    assert_eq!(
        sample(
            "talos_upgrade_cluster_status",
            &[cluster_labels[0], r#"status="completed""#]
        ),
        "1"
    );
    assert_eq!(
        sample(
            "talos_upgrade_cluster_phase",
            &[cluster_labels[0], r#"phase="Ready""#]
        ),
        "1"
    );
    // Every Talos API call is counted by operation and code: one accepted upgrade call per node.
    assert_eq!(
        sample(
            "talos_upgrade_talos_api_calls_total",
            &[r#"method="Upgrade""#, r#"code="OK""#]
        ),
        "5"
    );
    assert!(
        !metrics.contains(r#"method="Upgrade",code="Unavailable""#),
        "no upgrade call went unanswered:\n{metrics}"
    );
    // While a node is in flight every node of the cluster is followed by a watch of its machine
    // status, and a look that reads the boot ids (one call the relay fans out) takes each followed
    // node's readiness from its watch. What is left of `COSI Get` is the run's first look (five
    // statuses and five machine configs) and the machine config of the next node, read again
    // before it starts (worker-2, then each control plane: 4 here), with a little room for a
    // status read while a watch opens again. Reading every status at every look made it 37;
    // reading every control plane's config before each control plane, 17.
    let ok = |method: &str| -> usize {
        sample(
            "talos_upgrade_talos_api_calls_total",
            &[&format!(r#"method="{method}""#), r#"code="OK""#],
        )
        .parse()
        .expect("a count")
    };
    assert!(ok("COSI Watch") >= 5, "every node followed:\n{metrics}");
    assert!(
        ok("COSI Get") <= 2 * 5 + 4 + 2,
        "machine statuses read where the watches tell:\n{metrics}"
    );
    // A node's version is asked at most once per boot (a system changes only with a reboot): at
    // most ten boots here, each node's old system and its new one, where asking at every look made
    // it one `Version` call per look (16 in this test before). The run's first look asks the five
    // old ones (with their platform, for the installer); a new system's version is usually told by
    // its kubelet (the Node's `osImage` written from the boot Talos reports), and asked where the
    // Node has not told it yet when the look reads the boot id. The idle looks before and after the
    // run ask one node in turn besides (`Access::talos_versions`, not kept per boot).
    assert!(
        ok("Version") <= 2 * 5 + 2,
        "Version asked more than once per boot:\n{metrics}"
    );

    // The story in Events, as `kubectl describe` shows it: one for the run, one per node started and
    // done, each naming its node.
    let events = world
        .ns
        .kubectl_ok(&[
            "get",
            "events",
            "-o",
            "jsonpath={range .items[*]}{.reason}|{.message}{\"\\n\"}{end}",
        ])
        .await;
    let lines: Vec<(&str, &str)> = events.lines().filter_map(|l| l.split_once('|')).collect();
    for reason in ["UpgradeStarted", "UpgradeCompleted"] {
        assert!(
            lines.iter().any(|(r, _)| *r == reason),
            "no {reason} event in:\n{events}"
        );
    }
    for node in world.sim.nodes() {
        for reason in ["NodeUpgradeStarted", "NodeUpgraded"] {
            assert!(
                lines
                    .iter()
                    .any(|(r, m)| *r == reason && m.contains(&format!("{} ", node.name))),
                "no {reason} event for {} in:\n{events}",
                node.name
            );
        }
    }
}

/// The controller does not wait for its poll between nodes: it follows each node in flight (the node's
/// Talos event stream and its Kubernetes Node) and looks again as soon as the node is back. With the
/// poll set to an hour, only those wake-ups can carry the run from one node to the next, so a run that
/// completes shows that every node's return woke the controller.
#[tokio::test]
async fn a_node_coming_back_wakes_the_controller_without_waiting_for_the_poll() {
    let world = World::start(
        "talos-wake",
        WorldSpec {
            poll_interval: std::time::Duration::from_secs(3600),
            ..WorldSpec::default()
        },
    )
    .await;
    world.upgrade_talos("1.11.6", "1.12.0").await;

    world.assert_each_node_upgraded_once(5);
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
    assert_etcd_leadership_moved_first(&world);
    for node in world.sim.snapshots() {
        assert_eq!(node.talos_version, "1.12.0", "{}", node.name);
    }
}
