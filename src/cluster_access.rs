//! Reaching one cluster: its credentials Secret, its Talos nodes (a fleet of connections) and its
//! workload Kubernetes API, and the node inventory. Shared by the Talos and the Kubernetes upgrade:
//! [`Connections`] keeps what lasts across reconciles (per cluster, until its Secret changes), and
//! [`SharedAccess`] reads a cluster's access at most once per reconcile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use semver::Version;
use tokio::sync::OnceCell;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use kube::Client;
use talos_api::ConnectOptions;

use crate::credentials::{self, ClusterCredentials};
use crate::inventory::{self, InventoryNode, MachineInventories, WorkloadNodeInfo};
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
    #[error(transparent)]
    WorkloadClient(#[from] credentials::WorkloadClientError),
    /// The Machines or the workload Nodes cannot be listed.
    #[error("{0}")]
    Inventory(String),
}

/// One cluster's connections, built from its credentials Secret: the Talos fleet and the workload API
/// client. Kept across reconciles (connections and TLS sessions are reused) until the Secret changes.
#[derive(Clone)]
pub struct ClusterLink {
    pub fleet: Arc<TalosFleet>,
    pub workload: Client,
}

/// (namespace, cluster name) → (resourceVersion of the credentials Secret, its connections).
type LinkCache = HashMap<(String, String), (String, ClusterLink)>;

/// What every cluster's access is made with, and what is kept of it across reconciles.
pub struct Connections {
    /// The management cluster: Secrets and Machines are read here.
    client: Client,
    /// Credentials Secret name; `{clusterId}` and `{name}` are replaced by the cluster's values.
    secret_name_template: String,
    talos: ConnectOptions,
    /// Machine inventories reused between reconciles while unchanged (kept current by a metadata
    /// watch the controller starts; without it every reconcile reads).
    pub machines: MachineInventories,
    /// Connections per cluster, rebuilt when the credentials Secret changes.
    links: Mutex<LinkCache>,
}

impl Connections {
    pub fn new(client: Client, secret_name_template: String, talos: ConnectOptions) -> Self {
        Connections {
            client,
            secret_name_template,
            talos,
            machines: MachineInventories::default(),
            links: Mutex::new(HashMap::new()),
        }
    }

    /// The connections last built for a cluster, with the resourceVersion of the Secret they were built
    /// from (usable once the Secret is read at that version).
    fn known_link(&self, key: &(String, String)) -> Option<(String, ClusterLink)> {
        let links = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        links.get(key).cloned()
    }

    /// Keeps `link` as the cluster's connections for the Secret at `version`.
    fn keep_link(&self, key: (String, String), version: &str, link: ClusterLink) {
        let mut links = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        links.insert(key, (version.to_string(), link));
    }

    /// Drops what is kept of the cluster `key` (namespace, name), deleted: its connections and
    /// credentials, and the Machine inventory of its cluster id, if known.
    pub fn forget(&self, key: &(String, String), cluster_id: Option<&str>) {
        self.links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(key);
        if let Some(cluster_id) = cluster_id {
            self.machines
                .reads
                .forget(&(key.0.clone(), cluster_id.to_string()));
        }
    }
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
    connections: &'a Connections,
    access: OnceCell<Result<Access, AccessError>>,
}

impl<'a> SharedAccess<'a> {
    pub fn new(cluster: &'a KubernetesCluster, connections: &'a Connections) -> Self {
        SharedAccess {
            cluster,
            connections,
            access: OnceCell::new(),
        }
    }

    /// The access as made earlier in this reconcile, if it was.
    pub fn peek(&self) -> Option<Result<&Access, &AccessError>> {
        self.access.get().map(Result::as_ref)
    }

    pub async fn get(&self) -> Result<&Access, AccessError> {
        self.access
            .get_or_init(|| connect(self.cluster, self.connections))
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
async fn connect(cluster: &KubernetesCluster, ctx: &Connections) -> Result<Access, AccessError> {
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
                fleet: Arc::new(TalosFleet::new(talos, ctx.talos.clone())),
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
