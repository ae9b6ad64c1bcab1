//! The Kubernetes upgrade's IO edge against the simulator and a real API server: what `observe` sees of
//! a cluster, and what `execute` does for each action (machine-config patches applied without reboot,
//! pre-pulls into the right containerd namespace, refusals, and the bootstrap manifest sync in both
//! modes).

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use serde_json::json;
use talos_api::{ConnectOptions, RebootMode, Talosconfig};
use talos_sim::workload::WorkloadMirror;
use talos_sim::{ClientRole, Fault, NodeConfig, SimConfig, Simulator, Timings};
use talos_upgrade_controller::inventory::InventoryNode;
use talos_upgrade_controller::kubernetes_upgrade::{
    self, ExecuteError, ManifestMode, manifests::apply_objects,
};
use talos_upgrade_controller::talos_fleet::TalosFleet;
use talos_upgrade_core::kubernetes::{
    Action, Component, ImageField, ImagePull, NodeObservation, Observation, TalosApi,
};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::versions::{KubernetesVersion, TalosVersion};
use testenv::{ControlPlane, TestNamespace};
use tokio::task::JoinHandle;

const PATIENCE: Duration = Duration::from_secs(30);
const APPLY: &str = "/machine.MachineService/ApplyConfiguration";
const IMAGE_PULL: &str = "/machine.MachineService/ImagePull";
/// `common.ContainerdNamespace`: NS_SYSTEM = 1, NS_CRI = 2.
const NS_SYSTEM: i64 = 1;
const NS_CRI: i64 = 2;

/// One simulated cluster whose nodes are mirrored into the shared API server.
struct Cluster {
    ns: TestNamespace,
    sim: Simulator,
    fleet: TalosFleet,
    inventory: Vec<InventoryNode>,
    mirrors: Vec<JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for mirror in &self.mirrors {
            mirror.abort();
        }
    }
}

impl Cluster {
    /// 3 control planes and 2 workers on Talos 1.12.0 and Kubernetes 1.34.1. Node names carry the
    /// namespace, because Nodes are cluster-wide in the shared API server.
    async fn start(prefix: &str) -> Cluster {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ns = ControlPlane::shared().test_namespace(prefix).await;
        let mut config = SimConfig::new(&ns.name).with_timings(Timings::fast());
        for i in 1..=3 {
            config = config.with_node(NodeConfig::control_plane(
                &format!("{}-cp-{i}", ns.name),
                "1.12.0",
                "1.34.1",
            ));
        }
        for i in 1..=2 {
            config = config.with_node(NodeConfig::worker(
                &format!("{}-worker-{i}", ns.name),
                "1.12.0",
                "1.34.1",
            ));
        }
        let sim = Simulator::start(config).await.expect("simulator");
        let mirror = WorkloadMirror::new(ns.client.clone());
        let mirrors = sim
            .nodes()
            .into_iter()
            .map(|node| {
                let snapshots = sim.subscribe(&node.name).expect("subscribe");
                let mirror = mirror.clone();
                tokio::spawn(async move { mirror.follow(snapshots).await })
            })
            .collect();
        let credentials = Talosconfig::from_yaml(&sim.talosconfig(ClientRole::Admin))
            .and_then(|c| c.current_context()?.credentials())
            .expect("talosconfig");
        let options = ConnectOptions {
            port: sim.config().port,
            ..ConnectOptions::default()
        };
        let inventory = sim
            .nodes()
            .into_iter()
            .map(|n| InventoryNode {
                name: n.name.clone(),
                role: if n.role.is_control_plane() {
                    NodeRole::ControlPlane
                } else {
                    NodeRole::Worker
                },
                address: IpAddr::V4(n.address),
                held: false,
            })
            .collect();
        Cluster {
            fleet: TalosFleet::new(credentials, options),
            ns,
            sim,
            inventory,
            mirrors,
        }
    }

    fn name(&self, short: &str) -> String {
        format!("{}-{short}", self.ns.name)
    }

    fn node(&self, short: &str) -> &InventoryNode {
        let name = self.name(short);
        self.inventory
            .iter()
            .find(|n| n.name == name)
            .expect("inventory node")
    }

    async fn observe(&self) -> Observation {
        self.observe_with_etcd(false).await
    }

    /// As a pass whose run has its etcd snapshot due (`etcd`) looks.
    async fn observe_with_etcd(&self, etcd: bool) -> Observation {
        kubernetes_upgrade::observe(&self.fleet, &self.inventory, &self.ns.client, etcd, None).await
    }

    async fn execute(&self, action: &Action, mode: ManifestMode) -> Result<(), ExecuteError> {
        kubernetes_upgrade::execute(&self.fleet, &self.inventory, &self.ns.client, action, mode)
            .await
    }

    /// Observes until `check` holds for node `short`; the bound only stops a broken test from hanging.
    async fn observe_until(
        &self,
        short: &str,
        what: &str,
        check: impl Fn(&NodeObservation) -> bool,
    ) -> NodeObservation {
        let name = self.name(short);
        let mut last = None;
        for _ in 0..300 {
            let observation = self.observe().await;
            if let Some(node) = observation.node(&name) {
                if check(node) {
                    return node.clone();
                }
                last = Some(node.clone());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("timed out waiting for {what} on {name}; last seen: {last:#?}");
    }

    /// Every node mirrored: Nodes Ready with a kubelet version, and the control planes' three static
    /// pods Ready and rendered from the current config.
    async fn settled(&self) -> Observation {
        for _ in 0..300 {
            let observation = self.observe().await;
            if observation.nodes.iter().all(settled) {
                return observation;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("the cluster did not settle: {:#?}", self.observe().await);
    }

    fn calls(&self, node: &str, method: &str) -> Vec<serde_json::Value> {
        let name = self.name(node);
        self.sim
            .record()
            .into_iter()
            .filter(|c| c.node == name && c.method == method)
            .map(|c| c.params)
            .collect()
    }
}

fn settled(node: &NodeObservation) -> bool {
    let pods_current = Component::ALL.iter().all(|&component| {
        node.static_pods.iter().any(|pod| {
            pod.component == component
                && pod.ready
                && pod.config_version.is_some()
                && pod.config_version.as_deref() == node.config_versions.get(component)
        })
    });
    matches!(node.talos, TalosApi::Up { ready: true, .. })
        && node.kubernetes_ready
        && node.kubelet_version.is_some()
        && (node.role == NodeRole::Worker || pods_current)
}

fn k8s(version: &str) -> KubernetesVersion {
    KubernetesVersion::parse(version).expect("version")
}

#[tokio::test]
async fn a_fresh_cluster_is_observed_as_it_is_and_an_unreachable_node_alone() {
    let cluster = Cluster::start("k8sio-observe").await;
    let observation = cluster.settled().await;
    assert_eq!(observation.nodes.len(), 5);

    for node in &observation.nodes {
        assert_eq!(
            node.talos,
            TalosApi::Up {
                version: TalosVersion::parse("1.12.0").expect("version"),
                ready: true
            },
            "{}",
            node.name
        );
        assert!(node.kubernetes_ready, "{}", node.name);
        assert_eq!(node.kubelet_version, Some(k8s("1.34.1")), "{}", node.name);
        assert_eq!(
            node.images.kubelet.as_deref(),
            Some("ghcr.io/siderolabs/kubelet:v1.34.1")
        );
        match node.role {
            NodeRole::ControlPlane => {
                let images = &node.images;
                assert_eq!(
                    (
                        images.api_server.as_deref(),
                        images.controller_manager.as_deref(),
                        images.scheduler.as_deref(),
                        images.proxy.as_deref()
                    ),
                    (
                        Some("registry.k8s.io/kube-apiserver:v1.34.1"),
                        Some("registry.k8s.io/kube-controller-manager:v1.34.1"),
                        Some("registry.k8s.io/kube-scheduler:v1.34.1"),
                        Some("registry.k8s.io/kube-proxy:v1.34.1"),
                    ),
                    "{}",
                    node.name
                );
                assert_eq!(node.static_pods.len(), 3, "{}", node.name);
                for pod in &node.static_pods {
                    assert_eq!(
                        pod.image,
                        format!("registry.k8s.io/{}:v1.34.1", pod.component),
                        "{}",
                        node.name
                    );
                    assert!(pod.ready);
                    // The pod was rendered from the config resource version Talos reports.
                    assert_eq!(
                        pod.config_version.as_deref(),
                        node.config_versions.get(pod.component)
                    );
                }
            }
            NodeRole::Worker => {
                assert_eq!(node.images.api_server, None);
                assert_eq!(node.images.proxy, None);
                assert_eq!(node.config_versions.api_server, None);
                assert!(node.static_pods.is_empty());
            }
        }
    }

    // etcd is asked only while a run's snapshot is due (not by the looks so far, which show no
    // leader); asked, it is healthy and led by a control plane.
    assert_eq!(observation.etcd, Default::default());
    let with_etcd = cluster.observe_with_etcd(true).await;
    assert_eq!(with_etcd.etcd.problem, None);
    let leader = with_etcd.etcd.leader.clone().expect("a leader");
    assert!(leader.starts_with(&cluster.name("cp-")), "{leader}");

    // A worker that goes down and stays down: unreachable with a reason, the others still observed.
    let worker = cluster.name("worker-2");
    cluster
        .sim
        .inject_fault(&worker, Fault::NeverReturns)
        .expect("fault");
    cluster
        .fleet
        .client(cluster.node("worker-2").address)
        .expect("client")
        .reboot(RebootMode::Default)
        .await
        .expect("reboot");
    cluster
        .sim
        .wait_for(&worker, PATIENCE, |s| s.down)
        .await
        .expect("down");
    let observation = cluster.observe().await;
    let down = observation.node(&worker).expect("worker-2 observed");
    match &down.talos {
        TalosApi::Unreachable { reason } => assert!(!reason.is_empty()),
        other => panic!("worker-2 should be unreachable: {other:?}"),
    }
    assert_eq!(down.images, Default::default());
    for node in observation.nodes.iter().filter(|n| n.name != worker) {
        assert!(
            matches!(node.talos, TalosApi::Up { ready: true, .. }),
            "{}: {:?}",
            node.name,
            node.talos
        );
        assert!(node.images.kubelet.is_some(), "{}", node.name);
    }
}

/// The Nodes the reconcile's access listed a moment ago stand in for a list when they hold every
/// inventory node; otherwise the observation lists them itself.
#[tokio::test]
async fn the_nodes_the_access_listed_stand_in_for_a_list_when_they_hold_every_node() {
    use talos_upgrade_controller::inventory::{self, AddressNeed};
    let cluster = Cluster::start("k8sio-listed").await;
    cluster.settled().await;
    // The API server is shared: only this cluster's Nodes (by the inventory's names).
    let mut listed: Vec<_> =
        inventory::from_workload_nodes(cluster.ns.client.clone(), AddressNeed::Optional)
            .await
            .expect("the Nodes")
            .into_iter()
            .filter(|n| {
                cluster
                    .inventory
                    .iter()
                    .any(|node| node.name == n.node.name)
            })
            .collect();
    assert_eq!(listed.len(), 5);
    // Marked, to tell the access's list from a new one.
    listed[0].kubelet_version = Some("1.33.9".to_string());
    let marked = listed[0].node.name.clone();
    let kubelet_of = |observation: &Observation| {
        observation
            .nodes
            .iter()
            .find(|node| node.name == marked)
            .and_then(|node| node.kubelet_version.clone())
    };
    let observe = |listed| {
        kubernetes_upgrade::observe(
            &cluster.fleet,
            &cluster.inventory,
            &cluster.ns.client,
            false,
            listed,
        )
    };
    assert_eq!(
        kubelet_of(&observe(Some(&listed)).await),
        Some(k8s("1.33.9"))
    );
    // One inventory node missing from them: listed again.
    assert_eq!(
        kubelet_of(&observe(Some(&listed[..4])).await),
        Some(k8s("1.34.1"))
    );
    assert_eq!(kubelet_of(&observe(None).await), Some(k8s("1.34.1")));
}

#[tokio::test]
async fn the_api_server_image_is_patched_without_reboot_once() {
    let cluster = Cluster::start("k8sio-patch").await;
    let before = cluster.settled().await;
    let cp1 = cluster.name("cp-1");
    let old_version = before
        .node(&cp1)
        .and_then(|n| n.config_versions.api_server.clone())
        .expect("config version");
    let image = "registry.k8s.io/kube-apiserver:v1.35.0";
    let action = Action::PatchImage {
        node: cp1.clone(),
        field: ImageField::ApiServer,
        image: image.to_string(),
    };
    cluster
        .execute(&action, ManifestMode::Legacy)
        .await
        .expect("patch");

    // The config took the image at once, and its resource version moved.
    let after = cluster.observe().await;
    let node = after.node(&cp1).expect("cp-1");
    assert_eq!(node.images.api_server.as_deref(), Some(image));
    let new_version = node
        .config_versions
        .api_server
        .clone()
        .expect("config version");
    assert_ne!(new_version, old_version);
    // Nothing else in the config changed.
    assert_eq!(
        node.images.scheduler.as_deref(),
        Some("registry.k8s.io/kube-scheduler:v1.34.1")
    );

    // The static pod is re-rendered once the simulator applied the change.
    cluster
        .observe_until("cp-1", "the new kube-apiserver pod", |n| {
            n.static_pods.iter().any(|p| {
                p.component == Component::KubeApiserver
                    && p.image == image
                    && p.config_version.as_deref() == Some(new_version.as_str())
                    && p.ready
            })
        })
        .await;

    let applies = cluster.calls("cp-1", APPLY);
    assert_eq!(applies.len(), 1, "{applies:#?}");
    assert_eq!(applies[0]["mode"], json!("NO_REBOOT"));
    assert_eq!(applies[0]["dry_run"], json!(false));
    assert_eq!(applies[0]["images"]["apiserver"], json!(image));
    // The config's other document survived the patch.
    let config = cluster
        .fleet
        .client(cluster.node("cp-1").address)
        .expect("client")
        .machine_config()
        .await
        .expect("config");
    let text = String::from_utf8(config.into_bytes()).expect("utf-8");
    assert!(
        text.contains("kind: TimeSyncConfig"),
        "other documents kept"
    );
    // No other node was touched, and nothing rebooted.
    assert_eq!(
        cluster
            .sim
            .record()
            .iter()
            .filter(|c| c.method == APPLY)
            .count(),
        1
    );
    assert!(cluster.sim.power_events().is_empty());

    // Once more: the field already has the image, so no call.
    cluster
        .execute(&action, ManifestMode::Legacy)
        .await
        .expect("patch again");
    assert_eq!(cluster.calls("cp-1", APPLY).len(), 1);
}

#[tokio::test]
async fn kubelet_patches_pulls_and_refusals() {
    let cluster = Cluster::start("k8sio-kubelet").await;
    cluster.settled().await;

    // The kubelet on a worker: the Node reports the new version once the kubelet restarted.
    let worker1 = cluster.name("worker-1");
    cluster
        .execute(
            &Action::PatchImage {
                node: worker1.clone(),
                field: ImageField::Kubelet,
                image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
            },
            ManifestMode::Legacy,
        )
        .await
        .expect("patch kubelet");
    let node = cluster
        .observe_until("worker-1", "kubelet v1.35.0", |n| {
            n.kubelet_version == Some(k8s("1.35.0")) && n.kubernetes_ready
        })
        .await;
    assert_eq!(
        node.images.kubelet.as_deref(),
        Some("ghcr.io/siderolabs/kubelet:v1.35.0")
    );
    let applies = cluster.calls("worker-1", APPLY);
    assert_eq!(applies.len(), 1);
    assert_eq!(applies[0]["mode"], json!("NO_REBOOT"));

    // Pre-pulls: the static pod images into the CRI namespace, the kubelet into the system one.
    let cp1 = cluster.name("cp-1");
    let pulls = vec![
        ImagePull {
            field: ImageField::ApiServer,
            image: "registry.k8s.io/kube-apiserver:v1.35.0".into(),
        },
        ImagePull {
            field: ImageField::Kubelet,
            image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
        },
    ];
    cluster
        .execute(
            &Action::PullImages {
                node: cp1.clone(),
                images: pulls,
            },
            ManifestMode::Legacy,
        )
        .await
        .expect("pull");
    let recorded: Vec<(String, i64)> = cluster
        .calls("cp-1", IMAGE_PULL)
        .iter()
        .map(|p| {
            (
                p["reference"].as_str().unwrap_or_default().to_string(),
                p["namespace"].as_i64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        recorded,
        vec![
            ("registry.k8s.io/kube-apiserver:v1.35.0".to_string(), NS_CRI),
            ("ghcr.io/siderolabs/kubelet:v1.35.0".to_string(), NS_SYSTEM),
        ]
    );
    assert!(
        cluster.calls("cp-1", APPLY).is_empty(),
        "a pull applies nothing"
    );

    // An image the node cannot find fails the pull for good. The simulator only fails installer pulls,
    // so an installer reference stands in for a missing Kubernetes image here.
    cluster
        .sim
        .inject_fault(&cp1, Fault::InstallerPullFails)
        .expect("fault");
    let missing = "ghcr.io/siderolabs/installer:v1.12.0";
    let error = cluster
        .execute(
            &Action::PullImages {
                node: cp1.clone(),
                images: vec![ImagePull {
                    field: ImageField::Kubelet,
                    image: missing.into(),
                }],
            },
            ManifestMode::Legacy,
        )
        .await
        .expect_err("not found");
    assert!(
        matches!(&error, ExecuteError::Refused(m)
            if m.contains(&format!("image {missing} not found on node {cp1}"))),
        "{error:?}"
    );

    // A node that refuses the config: the step fails, naming the node and what Talos said.
    let worker2 = cluster.name("worker-2");
    cluster
        .sim
        .inject_fault(&worker2, Fault::ApplyConfigRejected)
        .expect("fault");
    let error = cluster
        .execute(
            &Action::PatchImage {
                node: worker2.clone(),
                field: ImageField::Kubelet,
                image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
            },
            ManifestMode::Legacy,
        )
        .await
        .expect_err("refused");
    match &error {
        ExecuteError::Refused(message) => {
            assert!(message.contains(&worker2), "{message}");
            assert!(message.contains("rejected by injected fault"), "{message}");
            assert!(!message.contains("token"), "no config content: {message}");
        }
        other => panic!("should be refused: {other:?}"),
    }

    // A node that does not answer: try again later.
    cluster
        .sim
        .inject_fault(&worker2, Fault::FailNextCalls(10))
        .expect("fault");
    let error = cluster
        .execute(
            &Action::PatchImage {
                node: worker2.clone(),
                field: ImageField::Kubelet,
                image: "ghcr.io/siderolabs/kubelet:v1.35.0".into(),
            },
            ManifestMode::Legacy,
        )
        .await
        .expect_err("unavailable");
    assert!(
        matches!(&error, ExecuteError::Transient(m) if m.contains(&worker2)),
        "{error:?}"
    );
}

async fn daemonset_image(client: &kube::Client) -> Option<String> {
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    let ds = daemonsets.get_opt("kube-proxy").await.expect("get")?;
    ds.spec?.template.spec?.containers.first()?.image.clone()
}

fn managers(meta: &kube::api::ObjectMeta) -> Vec<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect()
}

#[tokio::test]
async fn the_kube_proxy_daemonset_follows_the_proxy_image_in_both_modes() {
    let cluster = Cluster::start("k8sio-manifests").await;
    cluster.settled().await;
    let proxy = "registry.k8s.io/kube-proxy:v1.35.0";
    for cp in ["cp-1", "cp-2", "cp-3"] {
        cluster
            .execute(
                &Action::PatchImage {
                    node: cluster.name(cp),
                    field: ImageField::Proxy,
                    image: proxy.into(),
                },
                ManifestMode::Legacy,
            )
            .await
            .expect("patch proxy");
    }
    let sync = Action::SyncManifests {
        node: cluster.name("cp-1"),
    };
    let client = &cluster.ns.client;

    // Legacy: created or updated to the rendered image. Other tests' clusters may sync the same
    // objects into the shared kube-system, so only the value this test set is asserted.
    cluster
        .execute(&sync, ManifestMode::Legacy)
        .await
        .expect("legacy sync");
    assert_eq!(daemonset_image(client).await.as_deref(), Some(proxy));
    // Again: the server-defaulted objects compare equal to what a dry-run update makes of the
    // manifests, so nothing is written.
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    let written = daemonsets
        .get("kube-proxy")
        .await
        .expect("kube-proxy")
        .metadata
        .resource_version;
    cluster
        .execute(&sync, ManifestMode::Legacy)
        .await
        .expect("legacy sync again");
    let again = daemonsets
        .get("kube-proxy")
        .await
        .expect("kube-proxy")
        .metadata
        .resource_version;
    assert_eq!(again, written, "an unchanged DaemonSet is not updated");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "kube-system");
    let coredns = deployments.get("coredns").await.expect("coredns");
    assert_eq!(coredns.spec.and_then(|s| s.replicas), Some(2));

    // Server-side apply: the same image, now owned by the field manager Talos uses.
    cluster
        .execute(&sync, ManifestMode::ServerSideApply)
        .await
        .expect("server-side sync");
    assert_eq!(daemonset_image(client).await.as_deref(), Some(proxy));
    let ds = daemonsets.get("kube-proxy").await.expect("kube-proxy");
    assert!(
        managers(&ds.metadata).iter().any(|m| m == "talos"),
        "{:?}",
        managers(&ds.metadata)
    );
}

#[tokio::test]
async fn legacy_sync_creates_updates_only_what_differs_and_server_side_apply_owns_it() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let ns = ControlPlane::shared().test_namespace("k8sio-apply").await;
    let config_map = |value: &str| {
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "bootstrap", "namespace": ns.name},
            "data": {"key": value},
        })
    };
    let config_maps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    let version = || async {
        config_maps
            .get("bootstrap")
            .await
            .expect("get")
            .metadata
            .resource_version
            .expect("resourceVersion")
    };

    let summary = apply_objects(&ns.client, vec![config_map("one")], ManifestMode::Legacy)
        .await
        .expect("create");
    assert_eq!(summary.created, 1);
    let created = version().await;

    let summary = apply_objects(&ns.client, vec![config_map("one")], ManifestMode::Legacy)
        .await
        .expect("unchanged");
    assert_eq!(summary.unchanged, 1);
    assert_eq!(
        version().await,
        created,
        "an unchanged object is not written"
    );

    let summary = apply_objects(&ns.client, vec![config_map("two")], ManifestMode::Legacy)
        .await
        .expect("update");
    assert_eq!(summary.updated, 1);
    let stored = config_maps.get("bootstrap").await.expect("get");
    assert_eq!(
        stored.data.and_then(|d| d.get("key").cloned()).as_deref(),
        Some("two")
    );

    let summary = apply_objects(
        &ns.client,
        vec![config_map("three")],
        ManifestMode::ServerSideApply,
    )
    .await
    .expect("apply");
    assert_eq!(summary.applied, 1);
    let stored = config_maps.get("bootstrap").await.expect("get");
    assert!(managers(&stored.metadata).iter().any(|m| m == "talos"));
    assert_eq!(
        stored.data.and_then(|d| d.get("key").cloned()).as_deref(),
        Some("three")
    );

    // An object the API server rejects fails the sync for good, naming it.
    let invalid = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "Not_A_Valid_Name", "namespace": ns.name},
    });
    let error = apply_objects(&ns.client, vec![invalid], ManifestMode::Legacy)
        .await
        .expect_err("invalid");
    assert!(
        matches!(&error, ExecuteError::Refused(m) if m.contains("Not_A_Valid_Name")),
        "{error:?}"
    );
}
