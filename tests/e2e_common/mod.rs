//! A complete test world for end-to-end tests: the shared real API server, vitistack's Machine CRD and
//! the project's KubernetesCluster CRD, a simulated Talos cluster whose nodes are Machines and workload
//! Nodes, its credentials Secret, a `KubernetesCluster`, and the controller itself (watching only the
//! test's namespace, so tests in one binary do not share a controller).

#![allow(dead_code)]

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use talos_upgrade_controller::admin::HealthState;
use talos_upgrade_controller::controller::{self, Settings};
use talos_upgrade_controller::metrics::Metrics;
use talos_upgrade_controller::sim::workload::WorkloadMirror;
use talos_upgrade_controller::sim::{ClientRole, NodeConfig, SimConfig, Simulator, Timings};
use talos_upgrade_controller::talos::ConnectOptions;
use testenv::{ControlPlane, TestNamespace};
use tokio_util::sync::CancellationToken;

pub const PROJECT_CRD: &str = include_str!("../../deploy/crd.yaml");
pub const MACHINE_CRD: &str = include_str!("../fixtures/vitistack-crds/vitistack.io_machines.yaml");

pub struct World {
    pub ns: TestNamespace,
    pub sim: Simulator,
    pub cluster: String,
    pub metrics: Metrics,
    stop: CancellationToken,
}

impl Drop for World {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

pub struct WorldSpec {
    pub control_planes: usize,
    pub workers: usize,
    pub talos: &'static str,
    pub kubernetes: &'static str,
    pub node_deadline: Duration,
}

impl Default for WorldSpec {
    fn default() -> Self {
        WorldSpec {
            control_planes: 3,
            workers: 2,
            talos: "1.11.6",
            kubernetes: "1.34.1",
            node_deadline: Duration::from_secs(60),
        }
    }
}

async fn install_crd(ns: &TestNamespace, yaml: &str, name: &str) {
    ns.install_crd(yaml, name).await;
}

impl World {
    pub async fn start(prefix: &str, spec: WorldSpec) -> World {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ns = ControlPlane::shared().test_namespace(prefix).await;
        install_crd(&ns, PROJECT_CRD, "kubernetesclusters.vitistack.io").await;
        install_crd(&ns, MACHINE_CRD, "machines.vitistack.io").await;

        // Node names are cluster-wide in the API server, so they carry the namespace.
        let mut config = SimConfig::new(&ns.name).with_timings(Timings::fast());
        for i in 1..=spec.control_planes {
            config = config.with_node(NodeConfig::control_plane(
                &format!("{}-cp-{i}", ns.name),
                spec.talos,
                spec.kubernetes,
            ));
        }
        for i in 1..=spec.workers {
            config = config.with_node(NodeConfig::worker(
                &format!("{}-worker-{i}", ns.name),
                spec.talos,
                spec.kubernetes,
            ));
        }
        let sim = Simulator::start(config).await.expect("simulator");
        let stop = CancellationToken::new();

        // The workload cluster is the test API server itself.
        let mirror = WorkloadMirror::new(ns.client.clone());
        let mut names = BTreeSet::new();
        for node in sim.nodes() {
            names.insert(node.name.clone());
            let snapshots = sim.subscribe(&node.name).expect("subscribe");
            let mirror = mirror.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = mirror.follow(snapshots) => {}
                    () = stop.cancelled() => {}
                }
            });
        }
        {
            let mirror = mirror.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = mirror.run_kubelet(names) => {}
                    () = stop.cancelled() => {}
                }
            });
        }

        let cluster = "my-cluster".to_string();
        let cluster_id = format!("{}-id", ns.name);
        // vitistack Machines: the inventory the controller uses.
        let machines: Api<DynamicObject> = Api::namespaced_with(
            ns.client.clone(),
            &ns.name,
            &ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
                "machines",
            ),
        );
        for node in sim.nodes() {
            let role = if node.role.is_control_plane() {
                "control-plane"
            } else {
                "worker"
            };
            let machine: DynamicObject = serde_json::from_value(serde_json::json!({
                "apiVersion": "vitistack.io/v1alpha1",
                "kind": "Machine",
                "metadata": {
                    "name": node.name,
                    "labels": {"vitistack.io/clusterid": cluster_id, "vitistack.io/node-role": role},
                },
                "spec": {"provider": "kubevirt"},
            }))
            .expect("machine");
            machines
                .create(&PostParams::default(), &machine)
                .await
                .expect("create machine");
            machines
                .patch_status(
                    &node.name,
                    &PatchParams::default(),
                    &Patch::Merge(serde_json::json!({"status": {"publicIPAddresses": [IpAddr::V4(node.address).to_string()]}})),
                )
                .await
                .expect("machine status");
        }

        // The credentials Secret, named after the cluster id as vitistack does.
        let kubeconfig = std::fs::read_to_string(ns.kubeconfig()).expect("kubeconfig");
        ns.kubectl_ok(&[
            "create",
            "secret",
            "generic",
            &cluster_id,
            &format!(
                "--from-literal=talosconfig={}",
                sim.talosconfig(ClientRole::Admin)
            ),
            &format!("--from-literal=kube.config={kubeconfig}"),
        ])
        .await;

        ns.kubectl_apply(&format!(
            r#"
apiVersion: vitistack.io/v1alpha1
kind: KubernetesCluster
metadata:
  name: {cluster}
  namespace: {namespace}
spec:
  data: {{clusterId: {cluster_id}, provider: talos, region: south}}
  topology:
    version: "{kubernetes}"
    controlplane: {{replicas: {cps}, version: "{kubernetes}"}}
"#,
            namespace = ns.name,
            kubernetes = spec.kubernetes,
            cps = spec.control_planes,
        ))
        .await;

        let metrics = Metrics::new();
        let settings = Settings {
            node_deadline: spec.node_deadline,
            poll_interval: Duration::from_millis(100),
            talos: ConnectOptions {
                port: sim.config().port,
                connect_timeout: Duration::from_secs(2),
                ..ConnectOptions::default()
            },
            ..Settings::default()
        };
        tokio::spawn(controller::run(
            ns.client.clone(),
            Some(ns.name.clone()),
            metrics.clone(),
            settings,
            HealthState::default(),
            format!("test-{}", ns.name),
            stop.clone().cancelled_owned(),
        ));
        World {
            ns,
            sim,
            cluster,
            metrics,
            stop,
        }
    }

    pub fn node(&self, short: &str) -> String {
        format!("{}-{short}", self.ns.name)
    }

    /// `kubectl get kubernetescluster my-cluster -o jsonpath=...`
    pub async fn jsonpath(&self, path: &str) -> String {
        self.ns
            .kubectl_ok(&[
                "get",
                "kubernetescluster",
                &self.cluster,
                "-o",
                &format!("jsonpath={path}"),
            ])
            .await
    }

    pub async fn annotation(&self, key: &str) -> String {
        self.jsonpath(&format!(
            "{{.metadata.annotations.upgrade\\.vitistack\\.io/{key}}}"
        ))
        .await
    }

    /// `kubectl wait` for an annotation value, as the user guide does.
    pub async fn wait_for_annotation(&self, key: &str, value: &str, timeout: &str) {
        let output = self
            .ns
            .kubectl(&[
                "wait",
                &format!("kubernetescluster/{}", self.cluster),
                &format!("--for=jsonpath={{.metadata.annotations.upgrade\\.vitistack\\.io/{key}}}={value}"),
                &format!("--timeout={timeout}"),
            ])
            .await;
        if !output.success {
            let annotations = self.jsonpath("{.metadata.annotations}").await;
            panic!(
                "kubectl wait for {key}={value} failed: {}\nannotations: {annotations}\nrecord: {}",
                output.stderr,
                self.sim.record_json()
            );
        }
    }

    /// Upgrade calls received, per node, in order.
    pub fn upgrade_calls(&self) -> Vec<String> {
        self.sim
            .record()
            .into_iter()
            .filter(|c| {
                matches!(
                    c.method.as_str(),
                    "/machine.MachineService/Upgrade" | "/machine.LifecycleService/Upgrade"
                )
            })
            .map(|c| c.node)
            .collect()
    }
}
