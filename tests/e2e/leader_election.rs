//! Two controller processes (the real binary) against one API server, with leader election: only the
//! Lease holder acts; killed mid-upgrade (SIGKILL, no chance to release the Lease), the other takes over
//! once the Lease expires and finishes the upgrade, every node upgraded exactly once.

use std::time::Duration;

use crate::replica::{self, Replica, identity};
use crate::world::{World, WorldSpec};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use talos_sim::{Role, max_concurrently_down};
use tokio::process::Child;

const LEASE: &str = "talos-upgrade-controller";
const UPGRADE: &str = "/machine.MachineService/Upgrade";

/// Starts `talos-upgrade-controller run` as its own process, watching only the test's namespace and
/// electing a leader through a Lease there. `HOSTNAME` makes its Lease identity `<host>-<pid>`.
fn start_replica(world: &World, host: &str) -> Child {
    Replica {
        host,
        namespace: Some(&world.ns.name),
        lease: Some((&world.ns.name, LEASE)),
        selector: None,
        admin_listen: "127.0.0.1:0".to_string(),
    }
    .start(world.ns.kubeconfig())
}

async fn holder(world: &World) -> Option<String> {
    replica::holder(&world.ns.client, &world.ns.name, LEASE).await
}

/// The field managers that own the Lease's `holderIdentity`. A free Lease is taken with a server-side
/// apply without force, so only per-replica managers make the API server refuse the second of two
/// replicas racing for it.
async fn holder_identity_managers(world: &World) -> Vec<String> {
    let leases: Api<Lease> = Api::namespaced(world.ns.client.clone(), &world.ns.name);
    let lease = leases.get(LEASE).await.expect("get lease");
    lease
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter(|entry| {
            entry
                .fields_v1
                .as_ref()
                .is_some_and(|fields| fields.0.to_string().contains("f:holderIdentity"))
        })
        .filter_map(|entry| entry.manager)
        .collect()
}

#[tokio::test]
async fn only_the_leader_acts_and_a_standby_finishes_after_the_leader_is_killed() {
    let world = World::start(
        "leader",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    let mut a = start_replica(&world, "replica-a");
    let mut b = start_replica(&world, "replica-b");
    let (id_a, id_b) = (identity("replica-a", &a), identity("replica-b", &b));

    // One of them takes the Lease and reports on the cluster.
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    let leader = holder(&world).await.expect("a Lease holder");
    assert!(leader == id_a || leader == id_b, "{leader}");
    assert_eq!(
        holder_identity_managers(&world).await,
        [format!("talos-upgrade-controller-{leader}")],
        "the holder is written under the leader's own field manager"
    );
    let standby = if leader == id_a {
        id_b.clone()
    } else {
        id_a.clone()
    };

    world.annotate("talos-target", "1.12.0").await;
    // The first upgrade call went out: kill the leader there, without letting it release the Lease.
    world
        .poll(
            Duration::from_secs(120),
            "the first upgrade call to be answered",
            || {
                let answered = world
                    .sim
                    .record()
                    .iter()
                    .any(|c| c.method == UPGRADE && c.result != "pending");
                async move { answered }
            },
        )
        .await;
    let before_kill = world.reporting_instances(None).await;
    assert!(!before_kill.is_empty());
    assert!(
        before_kill.iter().all(|instance| *instance == leader),
        "only the leader ({leader}) acted: {before_kill:?}"
    );
    let killed = if leader == id_a { &mut a } else { &mut b };
    killed.kill().await.expect("kill the leader");

    // The standby takes over once the Lease expires, and finishes.
    world
        .wait_for_annotation("talos-status", "completed", "240s")
        .await;
    assert_eq!(holder(&world).await.as_deref(), Some(standby.as_str()));
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    let calls = world.upgrade_calls();
    let mut unique = calls.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(
        (calls.len(), unique.len()),
        (5, 5),
        "each node upgraded exactly once: {calls:?}"
    );
    assert_eq!(
        max_concurrently_down(&world.sim.power_events(), Some(Role::ControlPlane)),
        1
    );
    let after = world.reporting_instances(None).await;
    assert!(
        after.contains(&standby),
        "the standby reported after taking over: {after:?}"
    );
    assert!(
        after
            .iter()
            .all(|instance| *instance == leader || *instance == standby),
        "{after:?}"
    );
}
