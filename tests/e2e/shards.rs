//! Shards: a fleet split across controller processes (the real binary), each taking the clusters its
//! `--watch-label-selector` matches and electing its own leader through a Lease of its own, as the Helm
//! chart deploys them (docs/shards.md).
//!
//! - Two shards upgrade disjoint halves of a fleet at the same time; each acts only on its own (its
//!   Events, its metrics), each node is upgraded exactly once.
//! - A cluster relabelled to the other shard mid-run is finished by that shard from the saved progress
//!   record, every node upgraded exactly once.
//! - Two controllers that both take one cluster (overlapping selectors, a misconfiguration with no Lease
//!   between them): the write-ahead of every upgrade call is a conditional write of the progress record,
//!   so of two controllers about to call the same node one loses the write and never calls. The run
//!   completes with each node called exactly once and never two control planes down.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::replica::{self, Replica, free_admin_address, identity, scrape};
use crate::world::{World, WorldSpec};
use talos_sim::{Role, max_concurrently_down};

/// The label that places a cluster in a shard (any label works; this is the one docs/shards.md uses).
const SHARD_LABEL: &str = "upgrade.vitistack.io/shard";
const UPGRADE: &str = "/machine.MachineService/Upgrade";

/// A cluster of one control plane and one worker, with no in-process controller: the shards drive it.
async fn small_world(prefix: &str) -> World {
    World::start(
        prefix,
        WorldSpec {
            control_planes: 1,
            workers: 1,
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await
}

/// `kubectl label --overwrite kubernetescluster <cluster> upgrade.vitistack.io/shard=<shard>`.
async fn place(world: &World, shard: &str) {
    world
        .ns
        .kubectl_ok(&[
            "label",
            "--overwrite",
            "kubernetescluster",
            &world.cluster,
            &format!("{SHARD_LABEL}={shard}"),
        ])
        .await;
}

/// Which controller processes published Events on the world's cluster.
async fn reporting_instances(world: &World) -> BTreeSet<String> {
    world.reporting_instances(None).await.into_iter().collect()
}

/// The `talos_upgrade_runs_total` lines of `metrics` that name the world's cluster.
fn runs_of(metrics: &str, world: &World) -> Vec<String> {
    let cluster = format!(
        "namespace=\"{}\",cluster=\"{}\"",
        world.ns.name, world.cluster
    );
    metrics
        .lines()
        .filter(|line| line.starts_with("talos_upgrade_runs_total") && line.contains(&cluster))
        .map(str::to_string)
        .collect()
}

/// One shard: a controller process watching every namespace, taking only the clusters its selector
/// matches, holding the Lease `talos-upgrade-controller-<name>` in the namespace of `home` (whose
/// kubeconfig it uses).
struct Shard {
    /// Its Lease identity and Events' reporting instance.
    id: String,
    /// Where it serves /metrics.
    admin: String,
    /// The process, killed when the test ends.
    _process: tokio::process::Child,
}

impl Shard {
    fn start(home: &World, name: &str, selector: &str) -> Shard {
        let admin = free_admin_address();
        let host = format!("shard-{name}");
        let lease = format!("talos-upgrade-controller-{name}");
        let process = shard_replica(&host, selector, (&home.ns.name, &lease), &admin)
            .start(home.ns.kubeconfig());
        Shard {
            id: identity(&host, &process),
            admin,
            _process: process,
        }
    }

    /// `upgrade.vitistack.io/shard=<value>`, the selector of a shard placed by that label value.
    fn selector(value: &str) -> String {
        format!("{SHARD_LABEL}={value}")
    }
}

/// A shard's replica: every namespace, only the clusters `selector` matches, its own Lease.
fn shard_replica<'a>(
    host: &'a str,
    selector: &'a str,
    lease: (&'a str, &'a str),
    admin: &str,
) -> Replica<'a> {
    Replica {
        host,
        namespace: None,
        lease: Some(lease),
        selector: Some(selector),
        admin_listen: admin.to_string(),
    }
}

#[tokio::test]
async fn two_shards_upgrade_disjoint_halves_of_a_fleet_at_once() {
    let (a1, a2, b1, b2) = tokio::join!(
        small_world("shard-a1"),
        small_world("shard-a2"),
        small_world("shard-b1"),
        small_world("shard-b2"),
    );
    // Shard names unique to this test: the replicas watch every namespace of the shared API server.
    let (shard_a, shard_b) = (format!("a-{}", a1.ns.name), format!("b-{}", a1.ns.name));
    for world in [&a1, &a2] {
        place(world, &shard_a).await;
    }
    for world in [&b1, &b2] {
        place(world, &shard_b).await;
    }
    let a = Shard::start(&a1, "a", &Shard::selector(&shard_a));
    let b = Shard::start(&a1, "b", &Shard::selector(&shard_b));
    let (id_a, id_b) = (a.id.clone(), b.id.clone());
    let lease_ns = a1.ns.name.clone();

    let fleet = [(&a1, &id_a), (&a2, &id_a), (&b1, &id_b), (&b2, &id_b)];
    for (world, _) in fleet {
        world.annotate("talos-target", "1.12.0").await;
    }
    for (world, _) in fleet {
        world
            .wait_for_annotation("talos-status", "completed", "180s")
            .await;
    }

    // Each shard's Lease is its own replica's.
    let client = &a1.ns.client;
    assert_eq!(
        replica::holder(client, &lease_ns, "talos-upgrade-controller-a").await,
        Some(id_a.clone())
    );
    assert_eq!(
        replica::holder(client, &lease_ns, "talos-upgrade-controller-b").await,
        Some(id_b.clone())
    );
    // Each cluster was upgraded once per node, and only by its own shard.
    for (world, shard) in fleet {
        world.assert_each_node_upgraded_once(2);
        assert_eq!(world.annotation("talos-current").await, "1.12.0");
        assert_eq!(
            reporting_instances(world).await,
            BTreeSet::from([shard.clone()]),
            "only its shard reported on {}",
            world.cluster
        );
    }
    // Each shard's /metrics has its own clusters' runs and none of the other's.
    let (metrics_a, metrics_b) = (scrape(&a.admin).await, scrape(&b.admin).await);
    for (world, mine, other) in [
        (&a1, &metrics_a, &metrics_b),
        (&a2, &metrics_a, &metrics_b),
        (&b1, &metrics_b, &metrics_a),
        (&b2, &metrics_b, &metrics_a),
    ] {
        assert!(
            runs_of(mine, world)
                .iter()
                .any(|line| line.contains("result=\"completed\"") && line.ends_with(" 1")),
            "its shard counts {}'s completed run: {:?}",
            world.cluster,
            runs_of(mine, world)
        );
        assert_eq!(
            runs_of(other, world),
            Vec::<String>::new(),
            "the other shard has no series of {}",
            world.cluster
        );
    }
}

#[tokio::test]
async fn a_cluster_relabelled_mid_run_is_finished_by_its_new_shard_from_the_saved_record() {
    let world = World::start(
        "shard-move",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    let (shard_a, shard_b) = (
        format!("a-{}", world.ns.name),
        format!("b-{}", world.ns.name),
    );
    place(&world, &shard_a).await;
    let a = Shard::start(&world, "a", &Shard::selector(&shard_a));
    let b = Shard::start(&world, "b", &Shard::selector(&shard_b));
    let (id_a, id_b) = (a.id.clone(), b.id.clone());

    world.annotate("talos-target", "1.12.0").await;
    // Shard a has upgraded the first worker and called the second: move the cluster to shard b there.
    world
        .poll(
            Duration::from_secs(120),
            "shard a's second upgrade call",
            || {
                let calls = world
                    .sim
                    .record()
                    .iter()
                    .filter(|call| call.method == UPGRADE)
                    .count();
                async move { calls >= 2 }
            },
        )
        .await;
    place(&world, &shard_b).await;

    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    world.assert_each_node_upgraded_once(5);
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1,
        "never two control planes down across the hand-over"
    );
    let reported = reporting_instances(&world).await;
    assert_eq!(
        reported,
        BTreeSet::from([id_a.clone(), id_b.clone()]),
        "shard a began, shard b finished"
    );
    // The run finished under shard b: the completion Event is its own.
    let completed = world.reporting_instances(Some("UpgradeCompleted")).await;
    assert_eq!(completed, [id_b], "shard b completed the run");
}

#[tokio::test]
async fn two_controllers_taking_one_cluster_never_call_a_node_twice() {
    let world = World::start(
        "shard-overlap",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    let shard = format!("x-{}", world.ns.name);
    place(&world, &shard).await;
    // Both select the cluster, each behind a Lease of its own: nothing but the progress record's
    // conditional writes stands between them.
    let one = Shard::start(&world, "1", &Shard::selector(&shard));
    let two = Shard::start(&world, "2", &format!("{SHARD_LABEL} in ({shard})"));

    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    world.assert_each_node_upgraded_once(5);
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
    // Both took the cluster in (each exports its series), and still no node got a second call.
    let cluster = format!(
        "namespace=\"{}\",cluster=\"{}\"",
        world.ns.name, world.cluster
    );
    for admin in [&one.admin, &two.admin] {
        let metrics = scrape(admin).await;
        assert!(
            metrics.lines().any(|line| line.contains(&cluster)),
            "the controller at {admin} took the cluster in:\n{metrics}"
        );
    }
}

#[tokio::test]
async fn a_selector_the_api_server_refuses_stops_the_controller_at_start_with_the_reason() {
    let world = small_world("shard-bad").await;
    let selector = "upgrade.vitistack.io/shard in a";
    let child = shard_replica(
        "shard-bad",
        selector,
        (&world.ns.name, "talos-upgrade-controller-bad"),
        &free_admin_address(),
    )
    .start_capturing(world.ns.kubeconfig());
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the controller exits")
        .expect("its output");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!(
            "--watch-label-selector {selector:?} is not a label selector: "
        )),
        "{stderr}"
    );
    // It stopped before acting: nothing reported on the cluster.
    assert_eq!(world.annotation("talos-current").await, "");
}
