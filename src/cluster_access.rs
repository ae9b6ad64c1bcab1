//! Reaching one cluster: its credentials Secret, its Talos nodes (a fleet of connections) and its
//! workload Kubernetes API, and the node inventory. Shared by the Talos and the Kubernetes upgrade:
//! [`Connections`] keeps what lasts across reconciles (per cluster, until its Secret changes), and
//! [`SharedAccess`] reads a cluster's access at most once per reconcile.
//!
//! The credentials Secret is not read again by every reconcile. The controller may not list or watch
//! Secrets (its role only `get`s the one it names, see deploy/rbac.yaml), so nothing tells it when one
//! changes; instead the Secret as last read is reused while the cluster's own inputs are unchanged and
//! the connections built from it work, and read again when:
//! - the user changed the cluster (an annotation, a label, the spec: a new target, a pause, a resume,
//!   another `credentials-secret`): every run starts from the Secret as it is;
//! - the connections gave reason to doubt them: the workload Nodes could not be listed, or no node's
//!   Talos API answered ([`Access::note_talos_versions`]);
//! - the last read failed (a missing or broken Secret is read again at every look until it is fixed);
//! - it was last read [`CREDENTIALS_REREAD`] ago, so credentials replaced while the old ones still work
//!   are taken up all the same.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use semver::Version;
use tokio::sync::OnceCell;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use kube::Client;
use talos_api::ConnectOptions;

use crate::credentials::{self, ClusterCredentials};
use crate::inventory::{
    self, AddressNeed, InventoryError, InventoryNode, MachineInventories, WatchedNodes,
    WorkloadNodeInfo,
};
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
    /// The workload Nodes as the followers' watch sees them while a node is in flight.
    pub nodes: Arc<WatchedNodes>,
}

/// How long the credentials Secret as last read is reused at most while nothing else says to read it
/// again (see the module documentation).
pub const CREDENTIALS_REREAD: Duration = Duration::from_secs(60 * 60);

/// The last read of a cluster's credentials Secret.
#[derive(Clone, Debug)]
struct SecretRead {
    secret_name: String,
    /// resourceVersion of the Secret as read.
    version: String,
    /// The cluster's user inputs ([`KubernetesCluster::user_inputs`]) when the Secret was read.
    inputs: u64,
    read_at: Instant,
    /// Set when the Secret must be read again before the connections built from it are used: its
    /// last read failed, or those connections gave reason to doubt them.
    doubted: Arc<AtomicBool>,
}

impl SecretRead {
    /// Whether a reconcile at `now` of a cluster whose user inputs are `inputs`, naming `secret_name`,
    /// may use the connections built from this read without reading the Secret again.
    fn reusable(&self, secret_name: &str, inputs: u64, now: Instant) -> bool {
        self.secret_name == secret_name
            && self.inputs == inputs
            && !self.doubted.load(Ordering::Relaxed)
            && now.saturating_duration_since(self.read_at) < CREDENTIALS_REREAD
    }
}

/// One cluster's connections and the read of the credentials Secret they were built from.
#[derive(Clone)]
struct KeptLink {
    read: SecretRead,
    link: ClusterLink,
}

/// (namespace, cluster name) → the cluster's connections and the Secret read they come from.
type LinkCache = HashMap<(String, String), KeptLink>;

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

    /// The connections last built for a cluster, with the read of the Secret they were built from.
    fn known_link(&self, key: &(String, String)) -> Option<KeptLink> {
        let links = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        links.get(key).cloned()
    }

    /// Keeps `link` as the cluster's connections, the Secret `secret_name` read now at `version` with
    /// the cluster's user inputs at `inputs`. Returns the flag that puts this read in doubt.
    fn keep_link(
        &self,
        key: (String, String),
        secret_name: &str,
        version: &str,
        inputs: u64,
        link: ClusterLink,
    ) -> Arc<AtomicBool> {
        let doubted = Arc::new(AtomicBool::new(false));
        let mut links = self
            .links
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        links.insert(
            key,
            KeptLink {
                read: SecretRead {
                    secret_name: secret_name.to_string(),
                    version: version.to_string(),
                    inputs,
                    read_at: Instant::now(),
                    doubted: doubted.clone(),
                },
                link,
            },
        );
        doubted
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
    /// See [`ClusterLink::nodes`].
    pub watched_nodes: Arc<WatchedNodes>,
    pub namespace: String,
    pub secret_name: String,
    /// Each inventory node's Talos version (or why it could not be read), asked at most once.
    talos_versions: OnceCell<Vec<Result<Version, String>>>,
    /// Set to have the next reconcile read the credentials Secret again (see the module documentation).
    doubted: Arc<AtomicBool>,
}

impl Access {
    /// Each inventory node's running Talos version, in inventory order, worked out once however many
    /// parts of the reconcile ask. This is all an idle cluster needs (its current and available
    /// versions); a run in flight observes much more. A Ready workload Node tells its node's version
    /// in its `osImage` (the kubelet reports the os-release Talos writes, see
    /// [`inventory::talos_version_of_os_image`]), so only the nodes whose Node does not are asked
    /// (`Version`), and, when every Node tells, one node in turn ([`nodes_to_ask`]): each look still
    /// checks that a node's Talos API answers these credentials, at one call instead of one per node.
    pub async fn talos_versions(&self) -> &[Result<Version, String>] {
        self.talos_versions
            .get_or_init(|| async {
                let told: Vec<Option<Version>> = self
                    .inventory
                    .iter()
                    .map(|node| {
                        self.workload_nodes
                            .iter()
                            .find(|n| n.node.name == node.name && n.ready)
                            .and_then(|n| n.os_talos_version.clone())
                    })
                    .collect();
                let asked = nodes_to_ask(&told, || {
                    self.fleet.kept_looks().next_turn(self.inventory.len())
                });
                let answers = futures::future::join_all(asked.iter().map(|&index| async move {
                    let node = &self.inventory[index];
                    let answer = self
                        .fleet
                        .ask(node.address, |client| async move { client.version().await })
                        .await
                        .map_err(|e| e.to_string())?;
                    crate::talos_fleet::parse_talos_tag(&answer.tag)
                }))
                .await;
                // No node's Talos API answered: the credentials may have been replaced.
                self.doubt_unless_answered(&answers);
                let mut versions: Vec<Result<Version, String>> = told
                    .into_iter()
                    .map(|told| told.ok_or_else(|| "not asked".to_string()))
                    .collect();
                for (index, answer) in asked.into_iter().zip(answers) {
                    // A node whose Talos API does not answer while its Node tells its version is
                    // shown with that version.
                    if answer.is_ok() || versions[index].is_err() {
                        versions[index] = answer;
                    }
                }
                let looks = self.fleet.kept_looks();
                for (node, version) in self.inventory.iter().zip(&versions) {
                    if let Ok(version) = version {
                        looks.learn_version_at(node.address, version);
                    }
                }
                versions
            })
            .await
    }
}

/// Which nodes (indexes into `told`, each node's Talos version as its workload Node tells it) the
/// idle look asks `Version`: those whose Node does not tell, or, when every Node tells, the one
/// `turn` names (each look a different one), so that the nodes' Talos APIs are still asked.
fn nodes_to_ask(told: &[Option<Version>], turn: impl FnOnce() -> usize) -> Vec<usize> {
    let untold: Vec<usize> = (0..told.len()).filter(|&i| told[i].is_none()).collect();
    if !untold.is_empty() || told.is_empty() {
        return untold;
    }
    vec![turn() % told.len()]
}

impl Access {
    /// The workload Nodes as they are now: from the followers' watch while it runs, listed otherwise.
    /// (`workload_nodes` is what they were when the reconcile began.)
    pub async fn workload_nodes_now(
        &self,
        addresses: AddressNeed,
    ) -> Result<Vec<WorkloadNodeInfo>, InventoryError> {
        workload_nodes(&self.workload, &self.watched_nodes, addresses).await
    }

    /// Records the Talos versions a fuller observation already read, so that no later part of the
    /// reconcile asks the nodes again. Versions already known are kept.
    pub fn note_talos_versions(&self, versions: Vec<Result<Version, String>>) {
        self.doubt_unless_answered(&versions);
        let _ = self.talos_versions.set(versions);
    }

    /// No node answered: the credentials may have been replaced (or refused), so the next reconcile
    /// reads the Secret again rather than reuse the connections built from it.
    fn doubt_unless_answered(&self, versions: &[Result<Version, String>]) {
        if !versions.is_empty() && versions.iter().all(Result::is_err) {
            self.doubted.store(true, Ordering::Relaxed);
        }
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

/// The workload Nodes: from the followers' watch of them while it runs (a Talos node in flight; a
/// watch just started is given a moment for its first list), or listed.
async fn workload_nodes(
    workload: &Client,
    watched: &WatchedNodes,
    addresses: AddressNeed,
) -> Result<Vec<WorkloadNodeInfo>, InventoryError> {
    match watched
        .current_soon(addresses, inventory::FIRST_LIST_WAIT)
        .await
    {
        Some(current) => current,
        None => inventory::from_workload_nodes(workload.clone(), addresses).await,
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
    let key = (namespace.clone(), name.clone());
    let inputs = cluster.user_inputs();
    let known_link = ctx.known_link(&key);
    // The connections as last built, without reading the Secret, when nothing says to read it again
    // (see the module documentation). Their Nodes list is the check that they still work.
    if let Some(kept) = known_link
        .as_ref()
        .filter(|kept| kept.read.reusable(&secret_name, inputs, Instant::now()))
    {
        let machines = ctx
            .machines
            .get(ctx.client.clone(), &namespace, &cluster_id)
            .await
            .map_err(|e| AccessError::Inventory(e.to_string()))?;
        match workload_nodes(
            &kept.link.workload,
            &kept.link.nodes,
            address_need(&machines),
        )
        .await
        {
            Ok(workload_nodes) => {
                return Ok(access(
                    kept.link.clone(),
                    machines,
                    workload_nodes,
                    namespace,
                    secret_name,
                    kept.read.doubted.clone(),
                ));
            }
            Err(error) => {
                tracing::debug!(%error, "listing the workload Nodes with the kept connections; reading the credentials Secret again");
                kept.read.doubted.store(true, Ordering::Relaxed);
            }
        }
    }
    let read = read_and_connect(
        ctx,
        &namespace,
        &secret_name,
        &cluster_id,
        key,
        inputs,
        known_link.as_ref(),
    )
    .await;
    // A failed read is read again by the next reconcile, not reused (one that got as far as new
    // connections left them doubted).
    if read.is_err()
        && let Some(kept) = &known_link
    {
        kept.read.doubted.store(true, Ordering::Relaxed);
    }
    let (link, machines, workload_nodes, doubted) = read?;
    Ok(access(
        link,
        machines,
        workload_nodes,
        namespace,
        secret_name,
        doubted,
    ))
}

/// What [`read_and_connect`] gives: the connections, the Machines (if any), the workload Nodes and the
/// flag that puts the Secret read in doubt.
type Connected = (
    ClusterLink,
    Option<Vec<InventoryNode>>,
    Vec<WorkloadNodeInfo>,
    Arc<AtomicBool>,
);

/// Reads the credentials Secret and the inventory, and keeps the connections built from the Secret.
async fn read_and_connect(
    ctx: &Connections,
    namespace: &str,
    secret_name: &str,
    cluster_id: &str,
    key: (String, String),
    inputs: u64,
    known_link: Option<&KeptLink>,
) -> Result<Connected, AccessError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    // The Secret, the Machines and the workload Nodes in one round trip: the Nodes are listed with the
    // connections built from the Secret as last read, and that list is used only if the Secret turns
    // out unchanged (nearly always). A problem with the Secret is reported first.
    let (secret, (machines, listed_early)) = tokio::join!(secrets.get_opt(secret_name), async {
        let machines = ctx
            .machines
            .get(ctx.client.clone(), namespace, cluster_id)
            .await;
        let listed = match (known_link, &machines) {
            (Some(kept), Ok(machines)) => Some((
                kept.read.version.clone(),
                workload_nodes(
                    &kept.link.workload,
                    &kept.link.nodes,
                    address_need(machines),
                )
                .await,
            )),
            _ => None,
        };
        (machines, listed)
    },);
    let secret = secret
        .map_err(|e| AccessError::ReadSecret {
            namespace: namespace.to_string(),
            name: secret_name.to_string(),
            reason: e.to_string(),
        })?
        .ok_or_else(|| AccessError::NoSecret {
            namespace: namespace.to_string(),
            name: secret_name.to_string(),
        })?;
    let secret_version = secret.resource_version().unwrap_or_default();
    let link = match known_link.filter(|kept| kept.read.version == secret_version) {
        Some(kept) => kept.link.clone(),
        None => {
            let ClusterCredentials {
                talos, workload, ..
            } = credentials::parse(&secret, namespace, secret_name)
                .map_err(|e| AccessError::Credentials(e.to_string()))?;
            let workload = workload.ok_or_else(|| AccessError::NoKubeconfig {
                namespace: namespace.to_string(),
                name: secret_name.to_string(),
                key: credentials::KUBECONFIG_KEY,
            })?;
            ClusterLink {
                fleet: Arc::new(TalosFleet::new(talos, ctx.talos.clone())),
                workload: credentials::workload_client(workload)
                    .await
                    .map_err(AccessError::WorkloadClient)?,
                nodes: Arc::default(),
            }
        }
    };

    let doubted = ctx.keep_link(key, secret_name, &secret_version, inputs, link.clone());
    // Until the Nodes are listed with them, the connections are not trusted without a read.
    doubted.store(true, Ordering::Relaxed);
    let machines = machines.map_err(|e| AccessError::Inventory(e.to_string()))?;
    // With Machines, the workload Nodes only say which nodes are Ready; without, they are the inventory.
    let workload_nodes = match listed_early.filter(|(version, _)| *version == secret_version) {
        Some((_, listed)) => listed,
        None => workload_nodes(&link.workload, &link.nodes, address_need(&machines)).await,
    }
    .map_err(|e| AccessError::Inventory(e.to_string()))?;
    doubted.store(false, Ordering::Relaxed);
    Ok((link, machines, workload_nodes, doubted))
}

/// The access made of `link` and the inventory read with it.
fn access(
    link: ClusterLink,
    machines: Option<Vec<InventoryNode>>,
    workload_nodes: Vec<WorkloadNodeInfo>,
    namespace: String,
    secret_name: String,
    doubted: Arc<AtomicBool>,
) -> Access {
    let ClusterLink {
        fleet,
        workload,
        nodes,
    } = link;
    let inventory = match machines {
        Some(machines) => machines,
        None => workload_nodes.iter().map(|n| n.node.clone()).collect(),
    };
    fleet.relay_through(control_planes(&inventory).iter().map(|node| node.address));
    Access {
        fleet,
        inventory,
        workload_nodes,
        workload,
        watched_nodes: nodes,
        namespace,
        secret_name,
        talos_versions: OnceCell::new(),
        doubted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idle_look_asks_the_nodes_whose_node_does_not_tell_else_one_in_turn() {
        let v = |minor| Some(Version::new(1, minor, 0));
        // (told by the Nodes, turn, asked)
        type Told<'a> = &'a [Option<Version>];
        let cases: [(Told, usize, &[usize]); 5] = [
            (&[v(11), v(11), v(11)], 0, &[0]),
            (&[v(11), v(11), v(11)], 4, &[1]),
            (&[v(11), None, v(12), None], 0, &[1, 3]),
            (&[None, None], 7, &[0, 1]),
            (&[], 3, &[]),
        ];
        for (told, turn, asked) in cases {
            assert_eq!(nodes_to_ask(told, || turn), asked, "{told:?} {turn}");
        }
    }

    #[test]
    fn the_secret_as_last_read_is_reused_only_while_nothing_says_to_read_it_again() {
        let at = Instant::now();
        let read = || SecretRead {
            secret_name: "c1".to_string(),
            version: "7".to_string(),
            inputs: 42,
            read_at: at,
            doubted: Arc::new(AtomicBool::new(false)),
        };
        let doubted = read();
        doubted.doubted.store(true, Ordering::Relaxed);
        // (case, read, secret named now, user inputs now, now, reusable?)
        let cases = [
            ("nothing changed", read(), "c1", 42, at, true),
            (
                "a reconcile just before the re-read",
                read(),
                "c1",
                42,
                at + CREDENTIALS_REREAD - Duration::from_secs(1),
                true,
            ),
            ("the user changed the cluster", read(), "c1", 43, at, false),
            ("another Secret is named", read(), "c2", 42, at, false),
            (
                "the connections were doubted, or the read failed",
                doubted,
                "c1",
                42,
                at,
                false,
            ),
            (
                "read too long ago",
                read(),
                "c1",
                42,
                at + CREDENTIALS_REREAD,
                false,
            ),
        ];
        for (case, read, secret_name, inputs, now, reusable) in cases {
            assert_eq!(read.reusable(secret_name, inputs, now), reusable, "{case}");
        }
    }
}
