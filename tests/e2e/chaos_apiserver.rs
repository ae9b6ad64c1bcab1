//! The API server goes away and comes back (restarted on the same port, etcd kept) in the middle of a
//! Talos upgrade and of a Kubernetes upgrade: the controller's watches and requests fail for a while, then
//! it carries on from what it persisted. On a control plane of its own, because the restart would
//! disturb every test that shares the API server.

use std::time::Duration;

use crate::world::{World, WorldSpec};

const TALOS_UPGRADE: &str = "/machine.MachineService/Upgrade";
const APPLY: &str = "/machine.MachineService/ApplyConfiguration";

async fn wait_for_calls(world: &World, method: &str, count: usize) {
    world
        .poll(
            Duration::from_secs(180),
            &format!("{count} answered {method} calls"),
            || {
                let answered = world
                    .sim
                    .record()
                    .iter()
                    .filter(|c| c.method == method && c.result != "pending")
                    .count()
                    >= count;
                async move { answered }
            },
        )
        .await;
}

async fn restart_apiserver(world: &World) {
    world
        .ns
        .control_plane()
        .restart_apiserver()
        .await
        .expect("the API server comes back");
}

#[tokio::test]
async fn upgrades_finish_across_api_server_restarts() {
    let world = World::start(
        "chaos-apiserver",
        WorldSpec {
            own_control_plane: true,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    world.annotate("talos-target", "1.12.0").await;
    wait_for_calls(&world, TALOS_UPGRADE, 1).await;
    restart_apiserver(&world).await;
    wait_for_calls(&world, TALOS_UPGRADE, 3).await;
    restart_apiserver(&world).await;
    world
        .wait_for_annotation("talos-status", "completed", "300s")
        .await;
    world.assert_talos_run_kept_its_promises("1.12.0").await;

    world.annotate("kubernetes-target", "1.35.0").await;
    wait_for_calls(&world, APPLY, 4).await;
    restart_apiserver(&world).await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "300s")
        .await;
    assert_eq!(world.annotation("kubernetes-current").await, "1.35.0");
    // Every control-plane component on every control plane, kube-proxy on them, and every kubelet:
    // each changed once.
    let applies = world
        .sim
        .record()
        .iter()
        .filter(|c| c.method == APPLY)
        .count();
    assert_eq!(applies, 3 * 4 + 5);
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
}
