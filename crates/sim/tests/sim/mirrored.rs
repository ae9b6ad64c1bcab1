//! A simulated cluster mirrored into an API server of the tests' own, for `talosctl health` (health.rs,
//! and talosctl v1.12.0's in talosctl.rs): its Kubernetes checks read the cluster's Nodes and static pods,
//! which the simulator's kubelet mirror writes there, through the kubeconfig the control planes hand out.
//!
//! Talos hands out kubeconfigs with a client certificate, and talosctl accepts no other kind; this API
//! server has no client CA, so those requests arrive as `system:anonymous`, which may read everything
//! here (and only here: the shared API server's tests count Nodes).

use std::collections::BTreeSet;
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use talos_sim::Simulator;
use talos_sim::workload::WorkloadMirror;
use testenv::{AnonymousAccess, ControlPlane};

use crate::common::PATIENCE;

/// The API server the clusters are mirrored into, started once per test binary.
pub fn api_server() -> &'static ControlPlane {
    static API: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    match API.get_or_init(|| ControlPlane::start_blocking().map_err(|e| e.to_string())) {
        Ok(api) => api,
        Err(e) => panic!("the health tests' API server could not start: {e}"),
    }
}

/// One test at a time on [`api_server`]: each fills it with its own cluster's Nodes.
pub async fn take_turn() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// Mirrors `sim` (cluster `name`) into [`api_server`], whose turn the caller holds: what a previous
/// test left there removed, anonymous reads allowed, the kubelet mirror following every node, and the
/// kubeconfig the control planes hand out (shaped as Talos generates one) pointing there. Returns once
/// every node is a Ready Node with the control planes' static pods.
pub async fn mirror(sim: &Simulator, name: &str) {
    let api = api_server();
    let client = api.client().await.expect("admin client");
    api.allow_anonymous(AnonymousAccess::Read)
        .await
        .expect("granting anonymous reads");
    empty_workload_cluster(&client).await;
    let mirror = WorkloadMirror::new(client.clone());
    for node in sim.nodes() {
        let snapshots = sim.subscribe(&node.name).expect("subscribe");
        let mirror = mirror.clone();
        tokio::spawn(async move { mirror.follow(snapshots).await });
    }
    sim.set_workload_kubeconfig(Some(&api.talos_shaped_kubeconfig(name)))
        .expect("a Talos-shaped kubeconfig is accepted");

    let expected: BTreeSet<String> = sim.nodes().into_iter().map(|n| n.name).collect();
    // kube-apiserver, kube-controller-manager and kube-scheduler on each control plane.
    let expected_pods = 3 * sim
        .nodes()
        .iter()
        .filter(|n| n.role.is_control_plane())
        .count();
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client, "kube-system");
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let ready: BTreeSet<String> = nodes
            .list(&ListParams::default())
            .await
            .expect("nodes")
            .items
            .into_iter()
            .filter(testenv::node_ready)
            .filter_map(|n| n.metadata.name)
            .collect();
        let static_pods = pods
            .list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .len();
        if ready == expected && static_pods == expected_pods {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the workload mirror did not register the cluster: ready {ready:?}, {static_pods} static pods"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Remove every Node and kube-system pod a previous test left.
async fn empty_workload_cluster(client: &kube::Client) {
    let nodes: Api<Node> = Api::all(client.clone());
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    for node in nodes
        .list(&ListParams::default())
        .await
        .expect("nodes")
        .items
    {
        let _ = nodes
            .delete(&node.metadata.name.unwrap_or_default(), &now)
            .await;
    }
    for pod in pods.list(&ListParams::default()).await.expect("pods").items {
        let _ = pods
            .delete(&pod.metadata.name.unwrap_or_default(), &now)
            .await;
    }
}
