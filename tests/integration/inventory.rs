//! Finding a cluster's nodes in a real API server: from the workload cluster's Nodes, and from vitistack
//! Machines (with vitistack's own Machine CRD) once they exist; nodes without an address are reported.

use std::net::Ipv4Addr;

use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use talos_sim::workload::{WorkloadMirror, WorkloadNode};
use talos_upgrade_controller::inventory::{
    AddressNeed, InventoryError, from_machines, from_workload_nodes,
};
use talos_upgrade_core::run::NodeRole;
use testenv::ControlPlane;

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
    ns.install_crd(test_world::MACHINE_CRD, test_world::MACHINE_CRD_NAME)
        .await;
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

#[tokio::test]
async fn a_kept_machine_inventory_is_reused_until_a_machine_changes() {
    use talos_upgrade_controller::inventory::MachineInventories;
    use talos_upgrade_controller::read_cache::Fingerprint;

    let ns = ControlPlane::shared()
        .test_namespace("inventory-cache")
        .await;
    ns.install_crd(test_world::MACHINE_CRD, test_world::MACHINE_CRD_NAME)
        .await;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("vitistack.io", "v1alpha1", "Machine"),
        "machines",
    );
    let machines: Api<DynamicObject> = Api::namespaced_with(ns.client.clone(), &ns.name, &resource);
    create_machine(
        &machines,
        "kept-ctp0",
        "kept",
        "control-plane",
        &["127.0.7.1"],
    )
    .await;
    create_machine(&machines, "kept-wrk0", "kept", "worker", &["127.0.7.2"]).await;

    let inventories = std::sync::Arc::new(MachineInventories::default());
    let watch = {
        let (inventories, client, namespace) =
            (inventories.clone(), ns.client.clone(), ns.name.clone());
        tokio::spawn(async move { inventories.follow(client, Some(&namespace)).await })
    };
    let key = (ns.name.clone(), "kept".to_string());
    let addresses = |nodes: Option<Vec<talos_upgrade_controller::inventory::InventoryNode>>| {
        nodes
            .expect("machines")
            .into_iter()
            .map(|n| (n.name, n.address.to_string()))
            .collect::<Vec<_>>()
    };
    // What the watch shows of the cluster's Machines right now.
    let seen_now = || async {
        let listed = machines
            .list(&kube::api::ListParams::default().labels("vitistack.io/clusterid=kept"))
            .await
            .expect("list");
        let versions: Vec<(String, String)> = listed
            .items
            .iter()
            .map(|m| {
                (
                    m.metadata.name.clone().unwrap(),
                    m.metadata.resource_version.clone().unwrap(),
                )
            })
            .collect();
        Fingerprint::of(versions.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    };
    let wait_for_watch = |expected: Fingerprint| {
        let inventories = inventories.clone();
        let key = key.clone();
        async move {
            for _ in 0..400 {
                if inventories.reads.seen.fingerprint(&key) == Some(expected) {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(25)).await;
            }
            panic!("the Machine watch did not catch up within 10 s");
        }
    };

    // The inventory as the next reconcile gets it, once the watch has seen the Machines as they are.
    let next_inventory = async || {
        wait_for_watch(seen_now().await).await;
        let nodes = inventories
            .get(ns.client.clone(), &ns.name, "kept")
            .await
            .expect("list");
        addresses(nodes)
    };

    assert_eq!(
        next_inventory().await,
        vec![
            ("kept-ctp0".to_string(), "127.0.7.1".to_string()),
            ("kept-wrk0".to_string(), "127.0.7.2".to_string())
        ]
    );

    // The provisioning operator readdresses a node: the next reconcile sees the new address.
    machines
        .patch_status(
            "kept-wrk0",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"publicIPAddresses": ["127.0.7.3"]}})),
        )
        .await
        .expect("machine status");
    assert_eq!(
        next_inventory().await,
        vec![
            ("kept-ctp0".to_string(), "127.0.7.1".to_string()),
            ("kept-wrk0".to_string(), "127.0.7.3".to_string())
        ]
    );

    // A Machine of another cluster does not matter; one added to this cluster does.
    create_machine(&machines, "other-wrk0", "other", "worker", &["127.0.7.9"]).await;
    create_machine(&machines, "kept-wrk1", "kept", "worker", &["127.0.7.4"]).await;
    assert_eq!(
        next_inventory()
            .await
            .into_iter()
            .map(|(name, _)| name)
            .collect::<Vec<_>>(),
        vec!["kept-ctp0", "kept-wrk0", "kept-wrk1"]
    );
    watch.abort();
}
