//! The IO of the Kubernetes version upgrade: [`observe`] fills the decision core's [`Observation`]
//! (see [`talos_upgrade_core::kubernetes`]) from the nodes' Talos APIs and the workload cluster,
//! [`execute`] performs one of its [`Action`]s, and [`KubernetesIo`] offers both to the shared flow.
//!
//! - [`Action::PullImages`]: legacy `ImagePull` per image, into `system` (kubelet) or `k8s.io` (the
//!   static pods); `Unimplemented` counts as done, as in talosctl.
//! - [`Action::PatchImage`]: read the node's machine config, set the one field where that node keeps
//!   it (the component's `Kube*Config` document where the config has one, as configs created on
//!   Talos 1.14 do, else the `v1alpha1` document; the other documents kept byte for byte, see
//!   [`machine_config`]), `ApplyConfiguration` with mode `NO_REBOOT`; skipped when the field already
//!   has the image.
//! - [`Action::SyncManifests`]: the bootstrap manifests the node's Talos renders, applied to the
//!   workload cluster (see [`manifests`] for the two modes and what is left out).
//! - [`Action::EtcdSnapshot`] (`etcd-snapshot: talos-and-kubernetes`): taken by [`KubernetesIo`]
//!   through [`crate::etcd_snapshot::SnapshotContext::take`], as in a Talos run.
//!
//! Nothing is waited for here: the decision core observes the effect of a patch on the next pass.
//!
//! The machine config holds the cluster's secrets; it is never logged or put in an error.

mod execute;
mod io;
pub mod machine_config;
pub mod manifests;
mod observe;

use crate::inventory::InventoryNode;
use crate::talos_fleet::TalosFleet;
use talos_upgrade_core::kubernetes::{Action, Observation};

pub use self::io::KubernetesIo;
pub use self::manifests::SyncSummary;

/// How the bootstrap manifests are written to the workload cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManifestMode {
    /// GET, create when missing, update when a dry-run update shows a difference (Talos < 1.13).
    Legacy,
    /// Server-side apply with field manager `talos`, forced (Talos ≥ 1.13 applies them so itself).
    ServerSideApply,
}

impl ManifestMode {
    /// The mode for a cluster whose lowest Talos version is `lowest`. A 1.13 pre-release counts as
    /// 1.13: such a node already applies its manifests server-side, and the mode must match its.
    pub fn for_lowest_talos(lowest: &semver::Version) -> Self {
        if (lowest.major, lowest.minor) >= (1, 13) {
            ManifestMode::ServerSideApply
        } else {
            ManifestMode::Legacy
        }
    }
}

/// Why an action did not complete.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExecuteError {
    /// The node or the API refused for good (an invalid config, a missing image, a manifest the API
    /// server rejects): the step fails. The message names the node or object and what was said.
    #[error("{0}")]
    Refused(String),
    /// Could not reach the node or the API, or a passing failure: try again on the next pass.
    #[error("{0}")]
    Transient(String),
}

/// Observes every inventory node for the Kubernetes upgrade, concurrently, and etcd when `etcd` (the
/// run's snapshot is due, see [`talos_upgrade_core::kubernetes::Request`]). Never fails as a whole: a
/// node whose Talos API or machine config cannot be read is [`TalosApi::Unreachable`] with the reason;
/// when the workload cluster cannot be listed, nodes show no kubelet version, not Ready and no static
/// pods (so the decision waits), and a warning is logged.
///
/// [`TalosApi::Unreachable`]: talos_upgrade_core::kubernetes::TalosApi::Unreachable
///
/// `listed`: the workload Nodes as listed a moment ago in this reconcile, if they may stand in for a
/// list (see `observe::observe_kube`).
pub async fn observe(
    fleet: &TalosFleet,
    inventory: &[InventoryNode],
    workload: &kube::Client,
    etcd: bool,
    listed: Option<&[crate::inventory::WorkloadNodeInfo]>,
) -> Observation {
    observe::observe(fleet, inventory, workload, etcd, listed).await
}

/// Observes only the versions of a cluster with no Kubernetes upgrade in flight (for
/// `kubernetes-current` and `kubernetes-available`), from the nodes' Talos versions already asked.
pub async fn observe_versions(
    inventory: &[InventoryNode],
    talos_versions: &[Result<semver::Version, String>],
    workload: &kube::Client,
    workload_nodes: &[crate::inventory::WorkloadNodeInfo],
) -> Observation {
    observe::observe_versions(inventory, talos_versions, workload, workload_nodes).await
}

/// Performs one action on its node. `manifests` is only used by [`Action::SyncManifests`].
pub async fn execute(
    fleet: &TalosFleet,
    inventory: &[InventoryNode],
    workload: &kube::Client,
    action: &Action,
    manifests: ManifestMode,
) -> Result<(), ExecuteError> {
    let node_name = action.node();
    // The reconciler observes and executes with the same inventory, so a missing node is a passing
    // mismatch (the inventory changed in between); the step's deadline bounds it.
    let Some(node) = inventory.iter().find(|n| n.name == node_name) else {
        return Err(ExecuteError::Transient(format!(
            "node {node_name} is not in the cluster's inventory"
        )));
    };
    let client = fleet
        .client(node.address)
        .map_err(|e| execute::classify(e, &format!("connecting to node {node_name}")))?;
    match action {
        Action::PullImages { images, .. } => execute::pull_images(&client, node_name, images).await,
        Action::PatchImage { field, image, .. } => {
            execute::patch_image(&client, node_name, *field, image).await
        }
        Action::SyncManifests { .. } => {
            let objects = manifests::rendered_objects(&client, node_name).await?;
            let summary = manifests::apply_objects(workload, objects, manifests).await?;
            tracing::info!(node = %node_name, mode = ?manifests, ?summary, "synced the bootstrap manifests");
            Ok(())
        }
        // Made by `KubernetesIo`, which has the destination.
        Action::EtcdSnapshot { .. } => Err(ExecuteError::Refused(
            crate::etcd_snapshot::NO_DESTINATION.to_string(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_side_apply_from_talos_1_13() {
        let mode = |v: &str| ManifestMode::for_lowest_talos(&semver::Version::parse(v).expect("v"));
        assert_eq!(mode("1.12.9"), ManifestMode::Legacy);
        assert_eq!(mode("1.13.0-alpha.1"), ManifestMode::ServerSideApply);
        assert_eq!(mode("1.13.0"), ManifestMode::ServerSideApply);
        assert_eq!(mode("2.0.0"), ManifestMode::ServerSideApply);
    }
}
