//! One simulated cluster: its shape, and the objects vitistack would have written for it in the
//! management cluster.

use std::net::IpAddr;

use anyhow::Context;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use talos_sim::{ClientRole, NodeConfig, SimConfig, Simulator, Timings};
use talos_upgrade_core::crd::KubernetesCluster;

/// What a simulated cluster is made of: `control_planes` control-plane nodes and `workers` workers, all
/// on one Talos and one Kubernetes version.
#[derive(Debug, Clone)]
pub struct ClusterShape {
    pub control_planes: usize,
    pub workers: usize,
    /// Talos version without a leading `v`, e.g. `1.11.6`.
    pub talos: String,
    /// Kubernetes version without a leading `v`, e.g. `1.34.1`.
    pub kubernetes: String,
    /// How long the simulated nodes' steps take.
    pub timings: Timings,
    /// A registry mirror the nodes take their Kubernetes images from (`None`: the upstream ones).
    pub image_registry: Option<String>,
    /// The installer image repository the nodes were installed from: their `machine.install.image` is
    /// `<repository>:v<talos>`, e.g. an Image Factory one carrying a schematic
    /// (`factory.talos.dev/installer/<schematic id>`). `None`: `ghcr.io/siderolabs/installer`.
    pub installer_repository: Option<String>,
    /// The nodes' configs carry the install image in an `UnattendedInstallConfig` document, as configs
    /// created on Talos 1.14 do, instead of `machine.install.image`.
    pub unattended_install: bool,
}

/// The Talos 1.14 knobs of every node of a shape, beside [`ClusterShape`]: the e2e world and the
/// benchmark build `ClusterShape` with struct literals, so a new field there would break them; these
/// go through [`ClusterShape::sim_config_with`] instead. The defaults are the nodes `sim_config` makes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeKnobs {
    /// The platform the nodes booted on, as Talos names it (`aws`, `hcloud`, …); `None`: `metal`.
    pub platform: Option<String>,
    /// The nodes' configs carry their Kubernetes component images in the Kube* documents
    /// (`KubeletConfig`, `KubeAPIServerConfig`, …), as configs created on Talos 1.14 do, instead of the
    /// v1alpha1 fields. Talos 1.14 or later.
    pub kubernetes_documents: bool,
}

impl ClusterShape {
    /// The simulator's config for this shape: cluster `name`, nodes `<name>-cp-<i>` and
    /// `<name>-worker-<i>` (numbered from 1) on auto-assigned loopback addresses.
    ///
    /// Node names carry the cluster's name because Nodes are cluster-wide in the API server: the
    /// clusters of one API server (a test namespace each, or the benchmark's fleet) must not collide.
    pub fn sim_config(&self, name: &str) -> SimConfig {
        self.sim_config_with(name, &NodeKnobs::default())
    }

    /// [`ClusterShape::sim_config`] with the Talos 1.14 knobs of [`NodeKnobs`] set on every node.
    pub fn sim_config_with(&self, name: &str, knobs: &NodeKnobs) -> SimConfig {
        let mirrored = |node: NodeConfig| {
            let node = match &self.image_registry {
                Some(registry) => node.with_image_registry(registry),
                None => node,
            };
            let node = NodeConfig {
                unattended_install: self.unattended_install,
                platform: knobs.platform.clone(),
                kubernetes_documents: knobs.kubernetes_documents,
                ..node
            };
            match &self.installer_repository {
                Some(repository) => NodeConfig {
                    installer_image: Some(format!(
                        "{repository}:v{}",
                        self.talos.trim_start_matches('v')
                    )),
                    ..node
                },
                None => node,
            }
        };
        let mut config = SimConfig::new(name).with_timings(self.timings);
        for i in 1..=self.control_planes {
            config = config.with_node(mirrored(NodeConfig::control_plane(
                &format!("{name}-cp-{i}"),
                &self.talos,
                &self.kubernetes,
            )));
        }
        for i in 1..=self.workers {
            config = config.with_node(mirrored(NodeConfig::worker(
                &format!("{name}-worker-{i}"),
                &self.talos,
                &self.kubernetes,
            )));
        }
        config
    }

    /// The `KubernetesCluster` of this shape, as vitistack's operator writes it (every field its schema
    /// requires, so the object is valid under either CRD), with no status: the controller writes the
    /// first one. One worker pool, `wp`.
    pub fn kubernetes_cluster_yaml(
        &self,
        namespace: &str,
        name: &str,
        cluster_id: &str,
        data: &SpecData,
    ) -> String {
        let SpecData {
            cluster_uid,
            environment,
            datacenter,
            region,
            zone,
            project,
            workspace,
            workorder,
        } = data;
        let kubernetes = &self.kubernetes;
        let cps = self.control_planes;
        let workers = self.workers;
        format!(
            r#"
apiVersion: vitistack.io/v1alpha1
kind: KubernetesCluster
metadata:
  name: {name}
  namespace: {namespace}
spec:
  data: {{clusterUid: "{cluster_uid}", clusterId: {cluster_id}, provider: talos,
         environment: {environment}, datacenter: {datacenter}, region: {region}, zone: {zone}, project: {project},
         workspace: {workspace}, workorder: {workorder}, networkNamespaceName: {namespace}}}
  topology:
    version: "{kubernetes}"
    controlplane: {{replicas: {cps}, version: "{kubernetes}", provider: kubevirt, machineClass: small,
                   architecture: amd64, storage: [], metadata: {{labels: {{}}, annotations: {{}}}}}}
    workers:
      nodePools:
        - {{name: wp, replicas: {workers}, version: "{kubernetes}", provider: kubevirt, machineClass: medium,
           taint: [], architecture: amd64,
           autoscaling: {{enabled: false, minReplicas: 1, maxReplicas: 5, scalingRules: [cpu]}},
           metadata: {{labels: {{}}, annotations: {{}}}}, storage: []}}
"#
        )
    }
}

/// The `spec.data` fields vitistack records about who owns a cluster and where it runs, besides its id
/// (which is the one the controller reads) and `networkNamespaceName` (the namespace). The schema
/// requires them; their values only tell one user's clusters from another's.
#[derive(Debug, Clone, Copy)]
pub struct SpecData {
    pub cluster_uid: &'static str,
    pub environment: &'static str,
    pub datacenter: &'static str,
    pub region: &'static str,
    pub zone: &'static str,
    pub project: &'static str,
    pub workspace: &'static str,
    pub workorder: &'static str,
}

/// Where and under which names [`register_cluster`] writes a simulated cluster.
#[derive(Debug, Clone, Copy)]
pub struct Registration<'a> {
    /// The namespace of the Machines, the Secret and the `KubernetesCluster`.
    pub namespace: &'a str,
    /// The `KubernetesCluster`'s name.
    pub name: &'a str,
    /// `spec.data.clusterId`: the Machines' `vitistack.io/clusterid` label and the Secret's name.
    pub cluster_id: &'a str,
    pub data: &'a SpecData,
    /// The workload cluster's kubeconfig, for the Secret's `kube.config`.
    pub kubeconfig: &'a str,
}

/// Writes what vitistack would have for the simulated cluster `sim` of `shape`: a Machine per node
/// ([`register_machines`]), the credentials Secret ([`create_credentials_secret`], named after the
/// cluster id) and the `KubernetesCluster` ([`ClusterShape::kubernetes_cluster_yaml`]), in that order, so
/// the controller finds everything it needs once the cluster appears.
pub async fn register_cluster(
    client: &kube::Client,
    sim: &Simulator,
    shape: &ClusterShape,
    at: &Registration<'_>,
) -> anyhow::Result<()> {
    register_machines(client, at.namespace, at.cluster_id, sim).await?;
    create_credentials_secret(client, at.namespace, at.cluster_id, sim, at.kubeconfig).await?;
    let manifest = shape.kubernetes_cluster_yaml(at.namespace, at.name, at.cluster_id, at.data);
    create_kubernetes_cluster(client, at.namespace, &manifest).await
}

/// One vitistack `Machine` per simulated node, named after it, labelled with `cluster_id` and its role,
/// with its address as `status.publicIPAddresses`: the inventory the controller finds the nodes in.
pub async fn register_machines(
    client: &kube::Client,
    namespace: &str,
    cluster_id: &str,
    sim: &Simulator,
) -> anyhow::Result<()> {
    let machines: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
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
        }))?;
        machines
            .create(&PostParams::default(), &machine)
            .await
            .with_context(|| format!("creating Machine {namespace}/{}", node.name))?;
        machines
            .patch_status(
                &node.name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {"publicIPAddresses": [IpAddr::V4(node.address).to_string()]}})),
            )
            .await
            .with_context(|| format!("writing the status of Machine {namespace}/{}", node.name))?;
    }
    Ok(())
}

/// The credentials Secret `name` (vitistack names it after the cluster id): `talosconfig`, the
/// simulator's admin talosconfig, and `kube.config`, the workload cluster's `kubeconfig`.
pub async fn create_credentials_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    sim: &Simulator,
    kubeconfig: &str,
) -> anyhow::Result<()> {
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": namespace},
        "stringData": {
            "talosconfig": sim.talosconfig(ClientRole::Admin),
            "kube.config": kubeconfig,
        },
    }))?;
    Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("creating Secret {namespace}/{name}"))?;
    Ok(())
}

/// Creates the `KubernetesCluster` of a YAML manifest in `namespace`, exactly as written (not through
/// the core's type: under vitistack's CRD the API server is what prunes).
pub async fn create_kubernetes_cluster(
    client: &kube::Client,
    namespace: &str,
    yaml: &str,
) -> anyhow::Result<()> {
    let object: DynamicObject =
        serde_yaml::from_str(yaml).context("a KubernetesCluster manifest")?;
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::erase::<KubernetesCluster>(&()),
    );
    api.create(&PostParams::default(), &object)
        .await
        .with_context(|| {
            format!(
                "creating KubernetesCluster {namespace}/{}",
                object.metadata.name.as_deref().unwrap_or_default()
            )
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ClusterShape {
        ClusterShape {
            control_planes: 1,
            workers: 2,
            talos: "1.14.1".into(),
            kubernetes: "1.37.0".into(),
            timings: Timings::fast(),
            image_registry: None,
            installer_repository: None,
            unattended_install: true,
        }
    }

    #[test]
    fn the_talos_1_14_knobs_reach_every_node_and_default_to_none() {
        let plain = shape().sim_config("c");
        assert!(
            plain
                .nodes
                .iter()
                .all(|n| n.platform.is_none() && !n.kubernetes_documents)
        );
        let knobs = NodeKnobs {
            platform: Some("aws".into()),
            kubernetes_documents: true,
        };
        let config = shape().sim_config_with("c", &knobs);
        assert_eq!(config.nodes.len(), 3);
        for node in &config.nodes {
            assert_eq!(node.platform.as_deref(), Some("aws"), "{}", node.name);
            assert!(node.kubernetes_documents && node.unattended_install);
        }
        config.validate().expect("a valid simulator config");
    }
}
