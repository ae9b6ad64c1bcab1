//! The one way to build a simulated Talos cluster in a test API server.
//!
//! The controller reads a cluster the way vitistack leaves it in the management cluster: a
//! `KubernetesCluster` object, the credentials Secret named after its `spec.data.clusterId` (keys
//! `talosconfig` and `kube.config`), vitistack `Machine`s labelled with the cluster id (the node
//! inventory) and, in the workload cluster, the Kubernetes `Node`s and static pods kubelet registers.
//! The end-to-end tests (`tests/e2e/world.rs`), the benchmark (`crates/bench`) and the quick-start demo
//! (`crates/demo`) all need that picture around a [`talos_sim::Simulator`], against a real
//! kube-apiserver (`testenv`); this crate is where it is built, so the three cannot drift apart:
//!
//! * [`crds`]: the `KubernetesCluster` CRD (the project's, or vitistack's own) and vitistack's `Machine`
//!   CRD, and [`install_crd`] to put one into an API server.
//! * [`ClusterShape`]: how many control planes and workers, on which Talos and Kubernetes versions, with
//!   which simulated timings, image registry and installer image; it makes the simulator's config
//!   ([`ClusterShape::sim_config`]) and the `KubernetesCluster` manifest
//!   ([`ClusterShape::kubernetes_cluster_yaml`]) of that shape.
//! * [`register_cluster`]: what vitistack's operator would have written for one cluster (Machines,
//!   credentials Secret, `KubernetesCluster`), or each piece alone: [`register_machines`],
//!   [`create_credentials_secret`], [`create_kubernetes_cluster`].
//! * [`mirror_workload`] / [`mirror_nodes`]: the simulator's kubelet mirror, which writes each simulated
//!   node's `Node` and static pods into the workload cluster (here: the same test API server) and plays
//!   kubelet for ordinary pods, so drains and readiness look as they do on a real cluster.
//! * [`catalog`]: the release catalog of the user guide's example, which the tests and the demo run
//!   against so the `*-available` annotations read like the guide.
//!
//! Starting the API server, the controller and whatever is measured or asserted stays with each user: the
//! tests run the controller in-process per test namespace, the benchmark runs the binary behind a
//! counting proxy, the demo prints how to use what it started.

pub mod catalog;
mod cluster;
pub mod crds;
mod workload;

pub use catalog::{guide_catalog, guide_catalog_allowing_unknown, guide_releases};
pub use cluster::{
    ClusterShape, NodeKnobs, Registration, SpecData, create_credentials_secret,
    create_kubernetes_cluster, register_cluster, register_machines,
};
pub use crds::{
    CLUSTER_CRD_NAME, MACHINE_CRD, MACHINE_CRD_NAME, PROJECT_CLUSTER_CRD, VITISTACK_CLUSTER_CRD,
    install_crd,
};
pub use workload::{mirror_nodes, mirror_workload};
