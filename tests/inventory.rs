//! Finding a cluster's nodes in a real API server: from the workload cluster's Nodes, and from vitistack
//! Machines (with vitistack's own Machine CRD) once they exist; nodes without an address are reported.

use std::net::Ipv4Addr;

use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use talos_upgrade_controller::inventory::{
    AddressNeed, InventoryError, from_machines, from_workload_nodes,
};
use talos_upgrade_controller::rollout::progress::NodeRole;
use talos_upgrade_controller::sim::workload::{WorkloadMirror, WorkloadNode};
use testenv::ControlPlane;

const MACHINE_CRD: &str = include_str!("fixtures/vitistack-crds/vitistack.io_machines.yaml");

fn workload_node(name: &str, last_octet: u8, control_plane: bool, ready: bool) -> WorkloadNode {
    WorkloadNode {
        name: name.into(),
        address: Ipv4Addr::new(127, 0, 8, last_octet),
        control_plane,
        talos_version: "1.11.6".into(),
        kubelet_version: "1.34.1".into(),
        boot_id: "b".into(),
        kubelet_posting: true,
        ready,
        talos_cordoned: false,
        static_pods: Vec::new(),
    }
}

async fn create_machine(
    machines: &Api<DynamicObject>,
    name: &str,
    cluster_id: &str,
    role: &str,
    ips: &[&str],
) {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
        "machines",
    );
    let mut machine = DynamicObject::new(name, &resource);
    machine.metadata.labels = Some(
        [
            ("vitistack.io/clusterid".to_string(), cluster_id.to_string()),
            ("vitistack.io/node-role".to_string(), role.to_string()),
        ]
        .into(),
    );
    machine.data = serde_json::json!({"spec": {"provider": "kubevirt"}});
    machines
        .create(&PostParams::default(), &machine)
        .await
        .expect("create machine");
    machines
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"publicIPAddresses": ips}})),
        )
        .await
        .expect("machine status");
}

#[tokio::test]
async fn nodes_come_from_machines_when_there_are_any_and_from_nodes_otherwise() {
    let ns = ControlPlane::shared().test_namespace("inventory").await;

    // No Machine CRD at all: not a vitistack installation.
    assert!(
        from_machines(ns.client.clone(), &ns.name, "my-cluster")
            .await
            .expect("no CRD is not an error")
            .is_none()
    );

    // The workload cluster's Nodes: role from the control-plane label, address from InternalIP.
    let mirror = WorkloadMirror::new(ns.client.clone());
    mirror
        .sync(&workload_node("inv-cp-1", 1, true, true))
        .await
        .expect("node");
    mirror
        .sync(&workload_node("inv-worker-1", 2, false, false))
        .await
        .expect("node");
    let nodes = from_workload_nodes(ns.client.clone(), AddressNeed::Required)
        .await
        .expect("nodes");
    // Sorted by name.
    let summary: Vec<(String, NodeRole, String, bool, Option<String>)> = nodes
        .into_iter()
        .map(|n| {
            (
                n.node.name,
                n.node.role,
                n.node.address.to_string(),
                n.ready,
                n.kubelet_version,
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "inv-cp-1".into(),
                NodeRole::ControlPlane,
                "127.0.8.1".into(),
                true,
                Some("1.34.1".into())
            ),
            (
                "inv-worker-1".into(),
                NodeRole::Worker,
                "127.0.8.2".into(),
                false,
                Some("1.34.1".into())
            ),
        ]
    );

    // A Node still registering (no address yet): an error when Nodes are the inventory, left out when
    // they only tell readiness.
    let nodes_api: Api<k8s_openapi::api::core::v1::Node> = Api::all(ns.client.clone());
    let bare: k8s_openapi::api::core::v1::Node =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "inv-registering"}}))
            .expect("node");
    nodes_api
        .create(&PostParams::default(), &bare)
        .await
        .expect("create node");
    let error = from_workload_nodes(ns.client.clone(), AddressNeed::Required)
        .await
        .expect_err("a node without an address");
    assert_eq!(
        error.to_string(),
        "Node inv-registering has no IPv4 address (InternalIP)"
    );
    let readiness = from_workload_nodes(ns.client.clone(), AddressNeed::Optional)
        .await
        .expect("nodes");
    assert_eq!(readiness.len(), 2, "{readiness:?}");

    // vitistack's Machine CRD, with Machines labelled for two clusters.
    ns.install_crd(MACHINE_CRD, "machines.vitistack.io").await;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
        "machines",
    );
    let machines: Api<DynamicObject> = Api::namespaced_with(ns.client.clone(), &ns.name, &resource);
    assert!(
        from_machines(ns.client.clone(), &ns.name, "my-cluster")
            .await
            .expect("no machines yet")
            .is_none()
    );
    create_machine(
        &machines,
        "my-cluster-ctp0",
        "my-cluster",
        "control-plane",
        &["fd00::5", "127.0.7.1"],
    )
    .await;
    create_machine(
        &machines,
        "my-cluster-wrk0",
        "my-cluster",
        "worker",
        &["127.0.7.2"],
    )
    .await;
    create_machine(
        &machines,
        "other-ctp0",
        "other",
        "control-plane",
        &["127.0.7.9"],
    )
    .await;

    let found = from_machines(ns.client.clone(), &ns.name, "my-cluster")
        .await
        .expect("list")
        .expect("machines");
    let summary: Vec<(String, NodeRole, String)> = found
        .into_iter()
        .map(|n| (n.name, n.role, n.address.to_string()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (
                "my-cluster-ctp0".into(),
                NodeRole::ControlPlane,
                "127.0.7.1".into()
            ),
            (
                "my-cluster-wrk0".into(),
                NodeRole::Worker,
                "127.0.7.2".into()
            ),
        ]
    );

    // A Machine without an IPv4 address holds the inventory, naming it.
    create_machine(&machines, "my-cluster-wrk1", "my-cluster", "worker", &[]).await;
    let error = from_machines(ns.client.clone(), &ns.name, "my-cluster")
        .await
        .expect_err("machine without address");
    assert!(matches!(error, InventoryError::NoAddress { .. }));
    assert_eq!(
        error.to_string(),
        "Machine my-cluster-wrk1 has no IPv4 address in status.publicIPAddresses"
    );
}
