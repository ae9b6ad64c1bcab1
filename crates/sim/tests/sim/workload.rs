//! The simulator's workload cluster, written into a real kube-apiserver: Nodes, readiness across a reboot,
//! Talos's own cordon, static pods replaced on a config change, and evictions finished as kubelet would.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, EvictParams, Patch, PatchParams, PostParams};
use talos_sim::workload::{StaticPod, WorkloadMirror, WorkloadNode};
use testenv::ControlPlane;

fn control_plane_node(name: &str) -> WorkloadNode {
    WorkloadNode {
        name: name.to_string(),
        address: Ipv4Addr::new(127, 0, 9, 1),
        control_plane: true,
        talos_version: "1.11.6".into(),
        kubelet_version: "1.34.1".into(),
        boot_id: "boot-1".into(),
        kubelet_posting: true,
        ready: true,
        talos_cordoned: false,
        static_pods: vec![StaticPod {
            component: "kube-apiserver".into(),
            image: "registry.k8s.io/kube-apiserver:v1.34.1".into(),
            config_version: "1".into(),
            ready: true,
        }],
    }
}

fn ready_status(node: &Node) -> String {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone())
        .unwrap_or_default()
}

/// Polls `check` until it holds; the bound only stops a broken test from hanging.
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    for _ in 0..600 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn nodes_follow_the_simulated_machine_through_a_reboot() {
    let ns = ControlPlane::shared().test_namespace("workload-node").await;
    let mirror = WorkloadMirror::new(ns.client.clone());
    let nodes: Api<Node> = Api::all(ns.client.clone());
    let name = format!("{}-cp-1", ns.name);
    let mut node = control_plane_node(&name);

    mirror.sync(&node).await.expect("sync");
    let stored = nodes.get(&name).await.expect("Node registered");
    assert!(
        stored
            .labels()
            .contains_key("node-role.kubernetes.io/control-plane")
    );
    assert_eq!(ready_status(&stored), "True");
    let info = stored
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .expect("nodeInfo");
    assert_eq!(info.kubelet_version, "v1.34.1");
    assert_eq!(info.os_image, "Talos (v1.11.6)");
    let internal_ip = stored
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP"))
        .map(|a| a.address.clone());
    assert_eq!(internal_ip.as_deref(), Some("127.0.9.1"));

    // Upgrading: Talos cordons the node itself.
    node.talos_cordoned = true;
    mirror.sync(&node).await.expect("sync");
    let cordoned = nodes.get(&name).await.expect("get");
    assert_eq!(
        cordoned.spec.as_ref().and_then(|s| s.unschedulable),
        Some(true)
    );
    assert_eq!(
        cordoned
            .annotations()
            .get("talos.dev/cordoned")
            .map(String::as_str),
        Some("true")
    );

    // Rebooting: kubelet stops posting, the node goes Unknown.
    node.kubelet_posting = false;
    node.ready = false;
    mirror.sync(&node).await.expect("sync");
    assert_eq!(
        ready_status(&nodes.get(&name).await.expect("get")),
        "Unknown"
    );

    // Back on the new version: Ready, new kubelet, and Talos lifts its own cordon.
    node.kubelet_posting = true;
    node.ready = true;
    node.talos_cordoned = false;
    node.talos_version = "1.12.0".into();
    node.boot_id = "boot-2".into();
    mirror.sync(&node).await.expect("sync");
    let back = nodes.get(&name).await.expect("get");
    assert_eq!(ready_status(&back), "True");
    assert_ne!(back.spec.as_ref().and_then(|s| s.unschedulable), Some(true));
    assert!(!back.annotations().contains_key("talos.dev/cordoned"));
    let info = back
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .expect("nodeInfo");
    assert_eq!(
        (info.os_image.as_str(), info.boot_id.as_str()),
        ("Talos (v1.12.0)", "boot-2")
    );
}

#[tokio::test]
async fn a_cordon_by_someone_else_survives_the_simulator() {
    let ns = ControlPlane::shared()
        .test_namespace("workload-cordon")
        .await;
    let mirror = WorkloadMirror::new(ns.client.clone());
    let nodes: Api<Node> = Api::all(ns.client.clone());
    let name = format!("{}-w-1", ns.name);
    let mut node = control_plane_node(&name);
    node.control_plane = false;
    node.static_pods.clear();
    mirror.sync(&node).await.expect("sync");

    ns.kubectl_ok(&["cordon", &name]).await;
    mirror.sync(&node).await.expect("sync");
    let stored = nodes.get(&name).await.expect("get");
    assert_eq!(
        stored.spec.as_ref().and_then(|s| s.unschedulable),
        Some(true)
    );
    assert!(
        !stored
            .labels()
            .contains_key("node-role.kubernetes.io/control-plane")
    );
}

#[tokio::test]
async fn static_pods_are_replaced_when_their_config_changes() {
    let ns = ControlPlane::shared().test_namespace("workload-pods").await;
    let mirror = WorkloadMirror::new(ns.client.clone());
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), "kube-system");
    let name = format!("{}-cp-2", ns.name);
    let mut node = control_plane_node(&name);
    mirror.sync(&node).await.expect("sync");

    let pod_name = format!("kube-apiserver-{name}");
    let first = pods.get(&pod_name).await.expect("mirror pod");
    assert_eq!(
        first
            .annotations()
            .get("talos.dev/config-version")
            .map(String::as_str),
        Some("1")
    );
    assert_eq!(
        first.labels().get("k8s-app").map(String::as_str),
        Some("kube-apiserver")
    );
    let status = first.status.as_ref().expect("status");
    assert_eq!(status.host_ip.as_deref(), Some("127.0.9.1"));

    // An unchanged sync keeps the same pod.
    mirror.sync(&node).await.expect("sync");
    assert_eq!(pods.get(&pod_name).await.expect("get").uid(), first.uid());

    node.static_pods[0].image = "registry.k8s.io/kube-apiserver:v1.35.0".into();
    node.static_pods[0].config_version = "2".into();
    mirror.sync(&node).await.expect("sync");
    let second = pods.get(&pod_name).await.expect("get");
    assert_ne!(
        second.uid(),
        first.uid(),
        "kubelet recreates a changed static pod"
    );
    assert_eq!(
        second
            .annotations()
            .get("talos.dev/config-version")
            .map(String::as_str),
        Some("2")
    );
    let image = second
        .spec
        .as_ref()
        .and_then(|s| s.containers[0].image.clone());
    assert_eq!(
        image.as_deref(),
        Some("registry.k8s.io/kube-apiserver:v1.35.0")
    );
    let ready = second
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    assert_eq!(ready.as_deref(), Some("True"));
}

#[tokio::test]
async fn evicted_pods_on_simulated_nodes_are_finished_like_kubelet_does() {
    let ns = ControlPlane::shared()
        .test_namespace("workload-evict")
        .await;
    let mirror = WorkloadMirror::new(ns.client.clone());
    let name = format!("{}-w-2", ns.name);
    let mut node = control_plane_node(&name);
    node.control_plane = false;
    node.static_pods.clear();
    mirror.sync(&node).await.expect("sync");
    let kubelet = tokio::spawn({
        let mirror = mirror.clone();
        let names = BTreeSet::from([name.clone()]);
        async move { mirror.run_kubelet(names).await }
    });

    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), &ns.name);
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "app"},
        "spec": {"nodeName": name, "containers": [{"name": "app", "image": "busybox"}]},
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    eventually("the pod to run", || async {
        pods.get("app")
            .await
            .ok()
            .and_then(|p| p.status.and_then(|s| s.phase))
            .as_deref()
            == Some("Running")
    })
    .await;

    pods.evict("app", &EvictParams::default())
        .await
        .expect("evict");
    eventually("the evicted pod to be gone", || async {
        matches!(pods.get_opt("app").await, Ok(None))
    })
    .await;
    kubelet.abort();

    // The simulator's status writes are its own: a label from the user stays.
    let nodes: Api<Node> = Api::all(ns.client.clone());
    nodes
        .patch(
            &name,
            &PatchParams::apply("user"),
            &Patch::Apply(serde_json::json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"team": "blue"}},
            })),
        )
        .await
        .expect("label");
    mirror.sync(&node).await.expect("sync");
    let stored = nodes.get(&name).await.expect("get");
    assert_eq!(
        stored.labels().get("team").map(String::as_str),
        Some("blue")
    );
}

/// The whole loop: a simulated cluster followed into the API server while a node is upgraded through the
/// Talos API and a control-plane component through its machine config.
#[tokio::test]
async fn a_simulated_upgrade_shows_in_the_workload_cluster() {
    use talos_api::{
        ApplyMode, ConnectOptions, LegacyUpgradeOptions, TalosClient, Talosconfig, Target,
    };
    use talos_sim::{ClientRole, NodeConfig, SimConfig, Simulator, Timings};

    let _ = rustls::crypto::ring::default_provider().install_default();
    let ns = ControlPlane::shared().test_namespace("workload-sim").await;
    let cp_name = format!("{}-cp", ns.name);
    let worker_name = format!("{}-worker", ns.name);
    let sim = Simulator::start(
        SimConfig::new("workload-sim")
            .with_node(NodeConfig::control_plane(&cp_name, "1.11.6", "1.34.1"))
            .with_node(NodeConfig::worker(&worker_name, "1.11.6", "1.34.1"))
            .with_timings(Timings::fast()),
    )
    .await
    .expect("simulator");
    let mirror = WorkloadMirror::new(ns.client.clone());
    for node in sim.nodes() {
        let snapshots = sim.subscribe(&node.name).expect("subscribe");
        let mirror = mirror.clone();
        tokio::spawn(async move { mirror.follow(snapshots).await });
    }
    let nodes: Api<Node> = Api::all(ns.client.clone());
    let ready_on = |name: String, status: &'static str| {
        let nodes = nodes.clone();
        move || {
            let nodes = nodes.clone();
            let name = name.clone();
            async move {
                nodes
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|n| ready_status(&n) == status)
            }
        }
    };
    eventually("both nodes Ready", ready_on(cp_name.clone(), "True")).await;
    eventually("both nodes Ready", ready_on(worker_name.clone(), "True")).await;

    let credentials = Talosconfig::from_yaml(&sim.talosconfig(ClientRole::Admin))
        .and_then(|c| c.current_context()?.credentials())
        .expect("talosconfig");
    let address = |name: &str| {
        let node = sim
            .nodes()
            .into_iter()
            .find(|n| n.name == name)
            .expect("node");
        std::net::IpAddr::V4(node.address)
    };
    let options = ConnectOptions {
        port: sim.config().port,
        ..ConnectOptions::default()
    };
    let worker = TalosClient::connect(&credentials, Target::Node(address(&worker_name)), &options)
        .await
        .expect("connect worker");

    // Held down after its reboot, the node is cordoned by Talos and its status goes Unknown.
    sim.inject_fault(&worker_name, talos_sim::Fault::NeverReturns)
        .expect("fault");
    worker
        .upgrade_legacy(
            "ghcr.io/siderolabs/installer:v1.12.0",
            &LegacyUpgradeOptions {
                preserve: true,
                ..LegacyUpgradeOptions::default()
            },
        )
        .await
        .expect("upgrade");
    eventually(
        "the rebooting node to go Unknown",
        ready_on(worker_name.clone(), "Unknown"),
    )
    .await;
    let down = nodes.get(&worker_name).await.expect("get");
    assert_eq!(down.spec.as_ref().and_then(|s| s.unschedulable), Some(true));

    sim.clear_faults(&worker_name).expect("clear");
    eventually("the node back Ready on 1.12.0 and uncordoned", || {
        let nodes = nodes.clone();
        let name = worker_name.clone();
        async move {
            let Ok(node) = nodes.get(&name).await else {
                return false;
            };
            let os = node
                .status
                .as_ref()
                .and_then(|s| s.node_info.as_ref())
                .map(|i| i.os_image.clone());
            ready_status(&node) == "True"
                && os.as_deref() == Some("Talos (v1.12.0)")
                && node.spec.as_ref().and_then(|s| s.unschedulable) != Some(true)
        }
    })
    .await;

    // A new kube-apiserver image in the control plane's machine config replaces its mirror pod.
    let cp = TalosClient::connect(&credentials, Target::Node(address(&cp_name)), &options)
        .await
        .expect("connect control plane");
    let config = cp.machine_config().await.expect("config");
    let patched = String::from_utf8_lossy(config.as_bytes()).replace(
        "registry.k8s.io/kube-apiserver:v1.34.1",
        "registry.k8s.io/kube-apiserver:v1.34.2",
    );
    cp.apply_configuration(patched.into_bytes(), ApplyMode::NoReboot, false)
        .await
        .expect("apply");
    let pods: Api<Pod> = Api::namespaced(ns.client.clone(), "kube-system");
    let pod_name = format!("kube-apiserver-{cp_name}");
    eventually("the mirror pod on the new image and config version", || {
        let pods = pods.clone();
        let pod_name = pod_name.clone();
        async move {
            let Ok(pod) = pods.get(&pod_name).await else {
                return false;
            };
            let image = pod
                .spec
                .as_ref()
                .and_then(|s| s.containers[0].image.clone());
            image.as_deref() == Some("registry.k8s.io/kube-apiserver:v1.34.2")
                && pod
                    .annotations()
                    .get("talos.dev/config-version")
                    .map(String::as_str)
                    == Some("2")
        }
    })
    .await;
}
