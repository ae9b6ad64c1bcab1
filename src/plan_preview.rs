//! The plan preview from outside the controller: what the binary's `plan` subcommand prints for a
//! cluster (issue #24 item 2), for a pull request or a change ticket. It reads what the controller
//! would read (the `KubernetesCluster`, its progress record, its Machines) and renders it with the
//! same renderer as the `plan-preview` annotation's Event ([`talos_upgrade_core::plan::preview`]).
//! It only reads: no node, no Secret, no write.

use kube::ResourceExt;
use kube::api::Api;

use crate::inventory::{self, InventoryNode};
use crate::progress_store::ProgressStore;
use talos_upgrade_core::catalog::Catalog;
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::intent::UpgradeIntent;
use talos_upgrade_core::plan::preview::{self, Preview, PreviewInputs, PreviewNode};

#[derive(Debug, thiserror::Error)]
pub enum PreviewError {
    #[error("reading KubernetesCluster {namespace}/{name}: {source}")]
    Cluster {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Progress(#[from] crate::progress_store::StoreError),
}

/// The inventory's nodes as the preview lists them.
pub fn preview_nodes(inventory: &[InventoryNode]) -> Vec<PreviewNode> {
    inventory
        .iter()
        .map(|node| PreviewNode {
            name: node.name.clone(),
            role: node.role,
            held: node.held,
        })
        .collect()
}

/// The preview of cluster `namespace/name`, its nodes from its Machines.
pub async fn preview_cluster(
    client: kube::Client,
    namespace: &str,
    name: &str,
    catalog: &Catalog,
    now: jiff::Timestamp,
) -> Result<Preview, PreviewError> {
    let api: Api<KubernetesCluster> = Api::namespaced(client.clone(), namespace);
    let cluster = api
        .get(name)
        .await
        .map_err(|source| PreviewError::Cluster {
            namespace: namespace.to_string(),
            name: name.to_string(),
            source,
        })?;
    let progress = ProgressStore::new(client.clone(), namespace)
        .load(name)
        .await?
        .of_owner(cluster.metadata.uid.as_deref());
    let nodes = match cluster.cluster_id() {
        None => Err("the cluster has no cluster id to find its Machines by".to_string()),
        Some(id) => match inventory::from_machines(client, namespace, id).await {
            Ok(Some(nodes)) => Ok(preview_nodes(&nodes)),
            Ok(None) => Err(
                "the cluster has no Machines (the controller's own preview lists the workload Nodes)"
                    .to_string(),
            ),
            Err(error) => Err(error.to_string()),
        },
    };
    let intent = UpgradeIntent::from_annotations(cluster.annotations());
    Ok(preview::preview(&PreviewInputs {
        annotations: cluster.annotations(),
        intent: &intent,
        stored: progress.plan(),
        catalog,
        nodes: nodes.as_deref().map_err(Clone::clone),
        now,
    }))
}
