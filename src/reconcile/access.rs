//! Reaching one cluster: its credentials Secret, its Talos nodes (a fleet of connections) and its
//! workload Kubernetes API, and the node inventory. Shared by the Talos and the Kubernetes upgrade.

use std::sync::Arc;

use semver::Version;
use tokio::sync::OnceCell;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use super::{ClusterLink, Context};
use crate::credentials::{self, ClusterCredentials};
use crate::inventory::{self, InventoryNode, WorkloadNodeInfo};
use crate::talos_fleet::{TalosFleet, control_planes};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::intent::{InvalidOption, UpgradeIntent};

/// Why a cluster cannot be reached: its credentials or its node inventory. `Display` is one sentence
/// for the user, naming the Secret or what could not be read, never a credential.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    /// The `credentials-secret` annotation names no valid Secret.
    #[error("{0}")]
    SecretName(InvalidOption),
    #[error("reading credentials Secret {namespace}/{name}: {reason}")]
    ReadSecret {
        namespace: String,
        name: String,
        reason: String,
    },
    #[error("credentials Secret {namespace}/{name} not found")]
    NoSecret { namespace: String, name: String },
    /// The Secret's talosconfig or kubeconfig cannot be used (the credentials module's sentence).
    #[error("{0}")]
    Credentials(String),
    #[error(
        "credentials Secret {namespace}/{name} has no {key:?} key (needed to check Node readiness)"
    )]
    NoKubeconfig {
        namespace: String,
        name: String,
        key: &'static str,
    },
    /// The workload cluster's client cannot be built from the kubeconfig.
    #[error("{0}")]
    WorkloadClient(String),
    /// The Machines or the workload Nodes cannot be listed.
    #[error("{0}")]
    Inventory(String),
}

/// Everything needed to look at and act on one cluster's nodes.
pub struct Access {
    pub fleet: Arc<TalosFleet>,
    /// The nodes to upgrade, from Machines or else the workload Nodes.
    pub inventory: Vec<InventoryNode>,
    /// The workload cluster's Nodes (readiness, kubelet versions, cordons).
    pub workload_nodes: Vec<WorkloadNodeInfo>,
    pub workload: kube::Client,
    pub namespace: String,
    pub secret_name: String,
    /// Each inventory node's Talos version (or why it could not be read), asked at most once.
    talos_versions: OnceCell<Vec<Result<Version, String>>>,
}

impl Access {
    /// Each inventory node's running Talos version, in inventory order: one `Version` call per node,
    /// made once however many parts of the reconcile ask. This is all an idle cluster needs (its
    /// current and available versions); a run in flight observes much more.
    pub async fn talos_versions(&self) -> &[Result<Version, String>] {
        self.talos_versions
            .get_or_init(|| async {
                futures::future::join_all(self.inventory.iter().map(|node| async {
                    let answer = self
                        .fleet
                        .ask(node.address, |client| async move { client.version().await })
                        .await
                        .map_err(|e| e.to_string())?;
                    crate::talos_fleet::parse_talos_tag(&answer.tag)
                }))
                .await
            })
            .await
    }
}

impl Access {
    /// Records the Talos versions a fuller observation already read, so that no later part of the
    /// reconcile asks the nodes again. Versions already known are kept.
    pub fn note_talos_versions(&self, versions: Vec<Result<Version, String>>) {
        let _ = self.talos_versions.set(versions);
    }
}

/// The cluster's access, made at most once per reconcile (on first use) and shared by the Talos and
/// the Kubernetes upgrade, so a reconcile reads the Secret and lists the Machines and Nodes once.
pub struct SharedAccess<'a> {
    cluster: &'a KubernetesCluster,
    ctx: &'a Context,
    access: OnceCell<Result<Access, AccessError>>,
}

impl<'a> SharedAccess<'a> {
    pub fn new(cluster: &'a KubernetesCluster, ctx: &'a Context) -> Self {
        SharedAccess {
            cluster,
            ctx,
            access: OnceCell::new(),
        }
    }

    /// The access as made earlier in this reconcile, if it was.
    pub fn peek(&self) -> Option<Result<&Access, &AccessError>> {
        self.access.get().map(Result::as_ref)
    }

    pub async fn get(&self) -> Result<&Access, AccessError> {
        self.access
            .get_or_init(|| connect(self.cluster, self.ctx))
            .await
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// With Machines, the workload Nodes only say which nodes are Ready; without, they are the inventory and
/// each needs an address.
fn address_need(machines: &Option<Vec<InventoryNode>>) -> inventory::AddressNeed {
    match machines {
        Some(_) => inventory::AddressNeed::Optional,
        None => inventory::AddressNeed::Required,
    }
}

/// Reads the credentials and the inventory.
async fn connect(cluster: &KubernetesCluster, ctx: &Context) -> Result<Access, AccessError> {
    let namespace = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let cluster_id = cluster
        .cluster_id()
        .map(str::to_string)
        .unwrap_or_else(|| name.clone());
    // The per-cluster override, validated as a Secret name (a typo is reported, not looked up).
    let secret_name =
        match UpgradeIntent::from_annotations(cluster.annotations()).credentials_secret {
            Ok(Some(name)) => name,
            Ok(None) => ctx
                .settings
                .secret_name_template
                .replace("{clusterId}", &cluster_id)
                .replace("{name}", &name),
            Err(invalid) => return Err(AccessError::SecretName(invalid)),
        };
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let key = (namespace.clone(), name.clone());
    // The Secret, the Machines and the workload Nodes in one round trip: the Nodes are listed with the
    // connections built from the Secret as last read, and that list is used only if the Secret turns
    // out unchanged (nearly always). A problem with the Secret is reported first.
    let known_link = ctx.known_link(&key);
    let (secret, (machines, listed_early)) = tokio::join!(secrets.get_opt(&secret_name), async {
        let machines = ctx
            .machines
            .get(ctx.client.clone(), &namespace, &cluster_id)
            .await;
        let listed = match (&known_link, &machines) {
            (Some((version, link)), Ok(machines)) => Some((
                version.clone(),
                inventory::from_workload_nodes(link.workload.clone(), address_need(machines)).await,
            )),
            _ => None,
        };
        (machines, listed)
    },);
    let secret = secret
        .map_err(|e| AccessError::ReadSecret {
            namespace: namespace.clone(),
            name: secret_name.clone(),
            reason: e.to_string(),
        })?
        .ok_or_else(|| AccessError::NoSecret {
            namespace: namespace.clone(),
            name: secret_name.clone(),
        })?;
    let secret_version = secret.resource_version().unwrap_or_default();
    let ClusterLink { fleet, workload } = match known_link
        .as_ref()
        .filter(|(version, _)| *version == secret_version)
    {
        Some((_, link)) => link.clone(),
        None => {
            let ClusterCredentials {
                talos, workload, ..
            } = credentials::parse(&secret, &namespace, &secret_name)
                .map_err(|e| AccessError::Credentials(e.to_string()))?;
            let workload = workload.ok_or_else(|| AccessError::NoKubeconfig {
                namespace: namespace.clone(),
                name: secret_name.clone(),
                key: credentials::KUBECONFIG_KEY,
            })?;
            let link = ClusterLink {
                fleet: Arc::new(TalosFleet::new(talos, ctx.settings.talos.clone())),
                workload: credentials::workload_client(workload)
                    .await
                    .map_err(AccessError::WorkloadClient)?,
            };
            ctx.keep_link(key, &secret_version, link.clone());
            link
        }
    };
    let workload_client = workload;

    let machines = machines.map_err(|e| AccessError::Inventory(e.to_string()))?;
    // With Machines, the workload Nodes only say which nodes are Ready; without, they are the inventory.
    let workload_nodes = match listed_early.filter(|(version, _)| *version == secret_version) {
        Some((_, listed)) => listed,
        None => {
            inventory::from_workload_nodes(workload_client.clone(), address_need(&machines)).await
        }
    }
    .map_err(|e| AccessError::Inventory(e.to_string()))?;
    let inventory = match machines {
        Some(machines) => machines,
        None => workload_nodes.iter().map(|n| n.node.clone()).collect(),
    };
    fleet.relay_through(control_planes(&inventory).iter().map(|node| node.address));
    Ok(Access {
        fleet,
        inventory,
        workload_nodes,
        workload: workload_client,
        namespace,
        secret_name,
        talos_versions: OnceCell::new(),
    })
}
