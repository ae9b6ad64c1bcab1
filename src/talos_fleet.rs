//! Observing a Talos cluster through its nodes' Talos APIs: what the rollout decision needs to know
//! about each node (version, boot id, readiness, installer image) and about etcd.
//!
//! Everything here is IO at the edge; it turns answers and errors into [`talos_upgrade_core::talos`] observations
//! and never decides anything. A node that does not answer is an observation ("unreachable"), not an
//! error: during an upgrade that is the expected state of the node being rebooted.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use futures::future::join_all;
use semver::Version;
use serde::Deserialize as _;

use crate::followed_statuses::FollowedStatuses;
use crate::inventory::InventoryNode;
use crate::kept_looks::{KeptLooks, Running};
use talos_api::proto::talos::resource::definitions::runtime::MachineStatusSpec;
use talos_api::{
    ConnectOptions, EtcdMember, EtcdMemberStatus, TalosClient, TalosCredentials, TalosError,
    TalosTls, Target, resources,
};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::talos::{EtcdObservation, InstallSource, TalosState, with_installer_image};
// tokio's clock, so that tests can let time pass; the same as std's outside a paused test runtime.
use tokio::time::Instant;

/// The inventory's control planes: the nodes whose etcd members are observed and that relay calls.
pub fn control_planes(inventory: &[InventoryNode]) -> Vec<InventoryNode> {
    inventory
        .iter()
        .filter(|n| n.role == NodeRole::ControlPlane)
        .cloned()
        .collect()
}

/// Talos API access to every node of one cluster, all sharing one TLS configuration.
///
/// Calls go the way talosctl sends them: over one connection to a control plane (the *relay*), whose
/// apid forwards each call to the node named in the `node` header. A cluster then costs one connection,
/// not one per node: at 1,000 nodes that is the largest part of the controller's memory. A node is
/// dialled directly only when the relay is the node itself, when there is no relay (no control plane
/// known, or every one failing), and to check an answer the relay gave for a read that failed (see
/// [`TalosFleet::ask`]). Direct connections are dropped once unused for [`DIRECT_KEPT_IDLE`], the
/// relay's once unused for [`RELAY_KEPT_IDLE`].
pub struct TalosFleet {
    credentials: TalosCredentials,
    options: ConnectOptions,
    /// Built from the credentials on first use; until it builds, each client asks again (and fails
    /// naming its node).
    tls: OnceLock<TalosTls>,
    /// Shared with the task that closes unused connections ([`close_unused`]), which holds it weakly
    /// and so ends with the fleet.
    connections: Arc<Mutex<Connections>>,
    /// What the last looks asked of each node, for the passes that ask only the nodes in flight.
    looks: KeptLooks,
    /// The machine statuses the followers' watches report, which stand in for a look's own reads.
    followed: FollowedStatuses,
}

/// How long a direct connection to a node is kept after its last use.
pub const DIRECT_KEPT_IDLE: Duration = Duration::from_secs(30);

/// How long the relay's connection is kept after its last use. A cluster with a run in flight is
/// looked at every 120 s at the longest (the safety-net poll while every node in flight is rebooting
/// and followed), so its connection stays; an idle cluster is looked at every 10 minutes (the idle
/// refresh), and keeping a TLS connection with its HTTP/2 and TLS buffers open for each of them in
/// between is the larger part of an idle controller's memory at many clusters. The next call opens
/// it again.
pub const RELAY_KEPT_IDLE: Duration = Duration::from_secs(150);

/// How long connections are kept unused: the constants above, shorter in tests.
#[derive(Clone, Copy)]
struct KeptIdle {
    direct: Duration,
    relay: Duration,
}

impl KeptIdle {
    /// How long the connection to `address` is kept unused while `relay` relays.
    fn of(self, address: IpAddr, relay: Option<IpAddr>) -> Duration {
        if Some(address) == relay {
            self.relay
        } else {
            self.direct
        }
    }
}

impl Default for KeptIdle {
    fn default() -> Self {
        KeptIdle {
            direct: DIRECT_KEPT_IDLE,
            relay: RELAY_KEPT_IDLE,
        }
    }
}

/// How long a control plane that failed to relay is passed over when choosing the next relay.
pub const RELAY_COOL_DOWN: Duration = Duration::from_secs(30);

#[derive(Default)]
struct Connections {
    /// Direct connections by node address, the relay's included, with when each was last handed out.
    direct: HashMap<IpAddr, (TalosClient, Instant)>,
    /// The cluster's control planes in inventory order: the machines that may relay.
    control_planes: Vec<IpAddr>,
    /// The control plane relaying now.
    relay: Option<IpAddr>,
    /// Control planes that failed to relay, and when.
    failed_relays: HashMap<IpAddr, Instant>,
    /// When a relay last refused to fan a call out to several nodes (see [`TalosFleet::fan_out`]).
    fan_out_refused: Option<Instant>,
    /// Whether the task closing unused connections runs.
    closing_unused: bool,
    kept_idle: KeptIdle,
}

impl Connections {
    /// Lets go of the connections unused for their time (keeping `keep`, about to be used): the
    /// fleet's clone of each is dropped, and the connection closes once no call, stream or follower
    /// still holds a clone of its client (a run in flight keeps what it uses).
    fn drop_unused(&mut self, keep: Option<IpAddr>, now: Instant) {
        let relay = self.relay;
        let kept_idle = self.kept_idle;
        self.direct.retain(|kept, (_, used)| {
            Some(*kept) == keep || now.duration_since(*used) < kept_idle.of(*kept, relay)
        });
    }

    /// When the first of the kept connections will have been unused for its time, if any is kept.
    fn first_unused_at(&self) -> Option<Instant> {
        self.direct
            .iter()
            .map(|(kept, (_, used))| *used + self.kept_idle.of(*kept, self.relay))
            .min()
    }

    /// The first control plane, starting after `after` (inventory order, wrapping around), that has
    /// not failed to relay within the cool-down.
    fn choose_relay(&self, after: Option<IpAddr>, now: Instant) -> Option<IpAddr> {
        let start = after
            .and_then(|after| self.control_planes.iter().position(|cp| *cp == after))
            .map_or(0, |index| index + 1);
        let count = self.control_planes.len();
        (0..count)
            .map(|offset| self.control_planes[(start + offset) % count])
            .find(|cp| {
                self.failed_relays
                    .get(cp)
                    .is_none_or(|failed| now.duration_since(*failed) >= RELAY_COOL_DOWN)
            })
    }
}

/// How long the fleet asks node by node after a relay refused to fan a call out (a Talos that no
/// longer has one-to-many proxying, deprecated in 1.14 for removal in 2.0), before trying again.
pub const FAN_OUT_REFUSED_FOR: Duration = Duration::from_secs(600);

/// The first Talos whose apid logs every call fanned out through it as deprecated: talos v1.14.1
/// `internal/app/apid/pkg/director/director.go` (`Router.Director`) logs "request for method … using
/// deprecated nodes proxying" for each call with the `nodes` metadata, and still fans it out
/// (`common.Metadata`, which carries each node's answer, is marked for removal in v2.0;
/// talos-1.14.md §6: "Use per-node connections"). Only the relay's apid routes on `nodes`: the
/// calls it forwards carry `proxyfrom` instead (`backend/apid.go`), so the nodes it reaches log
/// nothing.
const FAN_OUT_DEPRECATED_IN: Version = Version::new(1, 14, 0);

/// Whether a relay running this Talos is asked to fan calls out: only before 1.14, where apid's
/// one-to-many proxying is not deprecated; a 1.14 pre-release (1.14.0-beta.1, which semver orders
/// before 1.14.0) has the 1.14 apid and counts as 1.14. Talos 1.14 fleets are asked node by node,
/// as talosctl 1.14 asks them, rather than have their relay log a deprecation at every look.
pub(crate) fn fans_out(relay: &Version) -> bool {
    Version::new(relay.major, relay.minor, relay.patch) < FAN_OUT_DEPRECATED_IN
}

/// How a call reaches a node: the client to use, and the relay it goes through (if any).
struct Route {
    client: TalosClient,
    relay: Option<IpAddr>,
}

impl TalosFleet {
    pub fn new(credentials: TalosCredentials, options: ConnectOptions) -> Self {
        TalosFleet {
            credentials,
            options,
            tls: OnceLock::new(),
            connections: Arc::default(),
            looks: KeptLooks::default(),
            followed: FollowedStatuses::default(),
        }
    }

    /// What this cluster's last looks asked of its nodes (see [`crate::kept_looks`]).
    pub fn kept_looks(&self) -> &KeptLooks {
        &self.looks
    }

    /// The machine statuses this cluster's followers watch (see [`crate::followed_statuses`]).
    pub fn followed_statuses(&self) -> &FollowedStatuses {
        &self.followed
    }

    #[cfg(test)]
    fn with_kept_idle(self, kept_idle: KeptIdle) -> Self {
        self.lock().kept_idle = kept_idle;
        self
    }

    /// How many connections the fleet holds open (or ready to open on their first call): nodes
    /// dialled directly, the relay included.
    #[cfg(test)]
    fn connections_held(&self) -> usize {
        self.lock().direct.len()
    }

    /// Tell the fleet the cluster's control planes (from this reconcile's inventory), the machines
    /// whose apid may relay calls to the others. Until told, every node is dialled directly. A relay
    /// that is no longer a control plane stops relaying.
    pub fn relay_through(&self, control_planes: impl IntoIterator<Item = IpAddr>) {
        let mut connections = self.lock();
        connections.control_planes = control_planes.into_iter().collect();
        if let Some(relay) = connections.relay
            && !connections.control_planes.contains(&relay)
        {
            connections.relay = None;
        }
    }

    /// The control plane relaying calls now, if any.
    pub fn relay(&self) -> Option<IpAddr> {
        self.lock().relay
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Connections> {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// A client for the node at `address`: through the relay when there is one, else direct.
    /// Connections are lazy and survive reboots.
    pub fn client(&self, address: IpAddr) -> Result<TalosClient, TalosError> {
        Ok(self.route(address)?.client)
    }

    /// A client dialling the node at `address` itself, never through a relay: for questions about the
    /// node's own TLS and credentials, and for checking a read the relay failed. The fleet's kept
    /// connection to the node when it has one (the relay's own; every node's while there is no
    /// relay); else a connection of the client's own, closed when the caller drops it. Kept, those
    /// would stay open beside the relay for no further use: when the relaying control plane reboots,
    /// every other node's reads fail through it and are asked directly at once, which left up to one
    /// connection per node open for [`DIRECT_KEPT_IDLE`] after the relay moved on.
    pub fn direct_client(&self, address: IpAddr) -> Result<TalosClient, TalosError> {
        let now = Instant::now();
        let mut connections = self.lock();
        if let Some((client, used)) = connections.direct.get_mut(&address) {
            *used = now;
            return Ok(client.clone());
        }
        drop(connections);
        TalosClient::lazy_with(&self.tls(address)?, Target::Node(address), &self.options)
    }

    /// The cluster's TLS configuration, built on first use (`address`: the node to name if the
    /// credentials cannot be used).
    fn tls(&self, address: IpAddr) -> Result<TalosTls, TalosError> {
        match self.tls.get() {
            Some(tls) => Ok(tls.clone()),
            None => {
                let label = std::net::SocketAddr::new(address, self.options.port).to_string();
                let tls = TalosTls::new(&self.credentials, &label)?;
                Ok(self.tls.get_or_init(|| tls).clone())
            }
        }
    }

    fn route(&self, address: IpAddr) -> Result<Route, TalosError> {
        let now = Instant::now();
        let mut connections = self.lock();
        if connections.relay.is_none() {
            connections.relay = connections.choose_relay(None, now);
        }
        match connections.relay {
            Some(relay) if relay != address => {
                let client = self
                    .direct_locked(&mut connections, relay, now)?
                    .relayed_to(address)?;
                Ok(Route {
                    client,
                    relay: Some(relay),
                })
            }
            _ => Ok(Route {
                client: self.direct_locked(&mut connections, address, now)?,
                relay: None,
            }),
        }
    }

    /// The kept direct client for `address` (made on first use), after letting go of the clients
    /// unused for their time ([`Connections::drop_unused`]). Dropping the fleet's clone closes the
    /// connection once no call or follower holds another. While the fleet holds any connection, a task
    /// lets go of unused ones between calls too, so an idle cluster keeps none open.
    fn direct_locked(
        &self,
        connections: &mut Connections,
        address: IpAddr,
        now: Instant,
    ) -> Result<TalosClient, TalosError> {
        connections.drop_unused(Some(address), now);
        if let Some((client, used)) = connections.direct.get_mut(&address) {
            *used = now;
            return Ok(client.clone());
        }
        let client =
            TalosClient::lazy_with(&self.tls(address)?, Target::Node(address), &self.options)?;
        connections.direct.insert(address, (client.clone(), now));
        // Outside a runtime (never the case in the controller) unused connections are still let go
        // of at the next call.
        if !connections.closing_unused
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            connections.closing_unused = true;
            runtime.spawn(close_unused(Arc::downgrade(&self.connections)));
        }
        Ok(client)
    }

    /// Stop relaying through `relay` after it failed where the node itself answered; the next call
    /// chooses the next control plane.
    fn relay_failed(&self, relay: IpAddr) {
        let now = Instant::now();
        let mut connections = self.lock();
        connections.failed_relays.insert(relay, now);
        if connections.relay == Some(relay) {
            connections.relay = connections.choose_relay(Some(relay), now);
            tracing::debug!(
                failed = %relay,
                next = ?connections.relay,
                "a Talos relay failed where the node answered directly; relaying through the next control plane"
            );
        }
    }

    /// Ask the node at `address` a question that changes nothing (a read), through the relay. When the
    /// relayed read fails, the node is asked directly, and that answer counts: a relay that is down or
    /// cannot reach the node never makes a node look unreachable. If the node answers directly, the
    /// relay is passed over for the next control plane.
    pub async fn ask<T, F, Fut>(&self, address: IpAddr, read: F) -> Result<T, TalosError>
    where
        F: Fn(TalosClient) -> Fut,
        Fut: std::future::Future<Output = Result<T, TalosError>>,
    {
        let Route { client, relay } = self.route(address)?;
        let relayed = read(client).await;
        let Some(relay) = relay else {
            return relayed;
        };
        let Err(relayed_error) = relayed else {
            return relayed;
        };
        let direct = read(self.direct_client(address)?).await;
        if direct.is_ok() {
            tracing::debug!(%relay, node = %address, error = %relayed_error, "relayed read failed, direct read answered");
            self.relay_failed(relay);
        }
        direct
    }

    /// The relay and its own client, to fan a call out through: `None` without a relay, when the
    /// relay runs Talos 1.14 or later or its version is not known (no look kept it: [`fans_out`],
    /// [`KeptLooks::version_at`]), or for a while after a relay refused to fan a call out.
    fn fanning_relay(&self) -> Option<(IpAddr, TalosClient)> {
        let now = Instant::now();
        let mut connections = self.lock();
        if connections
            .fan_out_refused
            .is_some_and(|refused| now.duration_since(refused) < FAN_OUT_REFUSED_FOR)
        {
            return None;
        }
        if connections.relay.is_none() {
            connections.relay = connections.choose_relay(None, now);
        }
        let relay = connections.relay?;
        if !self
            .looks
            .version_at(relay)
            .is_some_and(|version| fans_out(&version))
        {
            return None;
        }
        let client = self.direct_locked(&mut connections, relay, now).ok()?;
        Some((relay, client))
    }

    /// The relay a call would be fanned out through now ([`TalosFleet::fanning_relay`]), if one
    /// would, without connecting to it: a look that asks one node through it may ask more nodes in
    /// the same call.
    pub fn fanning_relay_address(&self) -> Option<IpAddr> {
        let connections = self.lock();
        if connections
            .fan_out_refused
            .is_some_and(|refused| Instant::now().duration_since(refused) < FAN_OUT_REFUSED_FOR)
        {
            return None;
        }
        let relay = connections.relay?;
        self.looks
            .version_at(relay)
            .is_some_and(|version| fans_out(&version))
            .then_some(relay)
    }

    /// One call the relay's apid fans out to every node in `addresses` (the `nodes` metadata, as
    /// `talosctl -n a,b,c` sends it before 1.14): each node's answer in `addresses`' order; `None`
    /// when the relay refused to fan it out (rather than did not answer), after which it is not asked
    /// to for [`FAN_OUT_REFUSED_FOR`]. A call that got no answer as a whole (the relay down, or the
    /// request timeout spent waiting on a node that vanished without closing its connection, which
    /// holds up apid's whole reply) leaves every node without an answer, each then asked directly.
    async fn fan_out<T, Fut>(
        &self,
        client: TalosClient,
        addresses: &[IpAddr],
        call: impl FnOnce(TalosClient, Vec<IpAddr>) -> Fut,
    ) -> Option<Vec<Result<T, TalosError>>>
    where
        Fut: std::future::Future<Output = Result<Vec<(IpAddr, Result<T, TalosError>)>, TalosError>>,
    {
        match call(client, addresses.to_vec()).await {
            Ok(answers) => Some(answers.into_iter().map(|(_, answer)| answer).collect()),
            Err(error) if error.is_transient() => Some(
                addresses
                    .iter()
                    .map(|_| {
                        Err(TalosError::Unreachable {
                            endpoint: error.endpoint().unwrap_or_default().to_string(),
                            reason: error.to_string(),
                        })
                    })
                    .collect(),
            ),
            Err(error) => {
                tracing::debug!(%error, "a Talos relay did not fan a call out; asking node by node");
                self.lock().fan_out_refused = Some(Instant::now());
                None
            }
        }
    }

    /// A node the relay's fan-out (or its relayed read) got no answer from is asked directly, and
    /// that answer counts, as [`TalosFleet::ask`] does for a relayed read that failed: a relay that
    /// cannot reach a node never makes the node look unreachable, and one that failed where the node
    /// answered is passed over for the next control plane.
    async fn ask_directly_after<T, F, Fut>(
        &self,
        relay: IpAddr,
        address: IpAddr,
        read: F,
    ) -> Result<T, TalosError>
    where
        F: FnOnce(TalosClient) -> Fut,
        Fut: std::future::Future<Output = Result<T, TalosError>>,
    {
        let direct = read(self.direct_client(address)?).await;
        if direct.is_ok() && relay != address {
            tracing::debug!(%relay, node = %address, "a fanned-out read failed, the direct read answered");
            self.relay_failed(relay);
        }
        direct
    }

    /// What each node's Talos API says now, in `nodes`' order (with `true`: how it was installed too,
    /// for the nodes a pass may start; see [`TalosFleet::observe_node_installed`]).
    ///
    /// Through a relay on a Talos before 1.14 ([`TalosFleet::fanning_relay`]), the boot id of every
    /// node is asked in one call, which the relay's apid fans out (one call per look instead of one
    /// per node), and so is `Version` of the nodes whose
    /// version is not known for that boot ([`KeptLooks::running`]); the machine status (and the
    /// machine config) is COSI, which apid does not fan out, so it is asked node by node through the
    /// relay. A node whose answers are not all there (the fan-out or its relayed read reports an
    /// error, or the fanned-out call got no answer at all) is asked all of them directly, and that
    /// answer counts, as for any relayed read that failed ([`TalosFleet::ask`]). Without a relay,
    /// through one on 1.14 or later (or not known yet), with one node, or when the relay refuses to
    /// fan calls out, each node is asked on its own ([`TalosFleet::observe_node`]).
    pub async fn observe_nodes(&self, nodes: &[(&InventoryNode, bool)]) -> Vec<TalosState> {
        let one_by_one = || {
            join_all(
                nodes
                    .iter()
                    .map(|(node, installed)| self.observe_one(node, *installed)),
            )
        };
        let relay = (nodes.len() > 1).then(|| self.fanning_relay()).flatten();
        let Some((relay, client)) = relay else {
            return one_by_one().await;
        };
        let addresses: Vec<IpAddr> = nodes.iter().map(|(node, _)| node.address).collect();
        let statuses = join_all(nodes.iter().map(|(node, installed)| async move {
            let client = self.client(node.address)?;
            futures::try_join!(self.status_unless_followed(&client, node.address), async {
                if *installed {
                    client.machine_config().await.map(Some)
                } else {
                    Ok(None)
                }
            })
        }));
        let (boot_ids, statuses) = tokio::join!(
            self.fan_out(client.clone(), &addresses, |client, nodes| async move {
                client.boot_ids_of(&nodes).await
            }),
            statuses,
        );
        let Some(boot_ids) = boot_ids else {
            return one_by_one().await;
        };
        // The version of a boot is known from the last look that asked it: only the nodes booted
        // since (or never asked) are asked `Version`, a round trip later.
        let mut known: Vec<Option<Running>> = nodes
            .iter()
            .zip(&boot_ids)
            .map(|((node, installed), boot_id)| {
                let boot_id = boot_id.as_ref().ok()?;
                self.looks.running(&node.name, boot_id, *installed)
            })
            .collect();
        let unknown: Vec<usize> = (0..nodes.len())
            .filter(|&index| known[index].is_none() && boot_ids[index].is_ok())
            .collect();
        let mut asked: Vec<Option<Result<Running, TalosError>>> =
            nodes.iter().map(|_| None).collect();
        match unknown.as_slice() {
            [] => {}
            [one] => {
                let node = nodes[*one].0;
                let version = match self.client(node.address) {
                    Ok(client) => client.version().await,
                    Err(error) => Err(error),
                };
                asked[*one] = Some(version.and_then(|version| self.running(node, version)));
            }
            several => {
                let unknown_addresses: Vec<IpAddr> =
                    several.iter().map(|&index| addresses[index]).collect();
                let versions = self
                    .fan_out(client, &unknown_addresses, |client, nodes| async move {
                        client.versions_of(&nodes).await
                    })
                    .await;
                for (position, &index) in several.iter().enumerate() {
                    asked[index] = Some(match &versions {
                        Some(versions) => match &versions[position] {
                            Ok(version) => self.running(nodes[index].0, version.clone()),
                            Err(error) => Err(error.clone()),
                        },
                        // Refused: asked directly below, with the node's other questions.
                        None => Err(TalosError::Decode {
                            endpoint: unknown_addresses[position].to_string(),
                            message: "Version was not fanned out".to_string(),
                        }),
                    });
                }
            }
        }
        join_all(
            nodes
                .iter()
                .zip(boot_ids.into_iter().zip(statuses))
                .zip(known.iter_mut().zip(asked))
                .map(|(((node, installed), (boot_id, status)), (known, asked))| {
                    let running = known.take().map(Ok).or(asked);
                    async move {
                        let answered = async {
                            let running = running.ok_or_else(|| TalosError::Decode {
                                endpoint: node.address.to_string(),
                                message: "no version".to_string(),
                            })??;
                            let (status, config) = status?;
                            let boot_id = boot_id?;
                            let status = match status {
                                Some(asked) => asked,
                                None => {
                                    let client = self.client(node.address)?;
                                    self.status_of_boot(&client, node.address, &boot_id, None)
                                        .await?
                                }
                            };
                            Ok::<_, TalosError>((running, boot_id, status, config))
                        }
                        .await;
                        let answered = match answered {
                            Ok(answered) => Ok(answered),
                            Err(_) => {
                                self.ask_directly_after(relay, node.address, |client| {
                                    self.read_node(client, node, *installed)
                                })
                                .await
                            }
                        };
                        node_state(answered)
                    }
                }),
        )
        .await
    }

    /// The node's machine status, asked unless a live watch follows the node or its follower waits
    /// for it (`None`: take it from the watch once the boot id is read,
    /// [`TalosFleet::status_of_boot`]).
    async fn status_unless_followed(
        &self,
        client: &TalosClient,
        address: IpAddr,
    ) -> Result<Option<MachineStatusSpec>, TalosError> {
        if self.followed.follows(address) || self.followed.awaited(address) {
            return Ok(None);
        }
        client.machine_status().await.map(Some)
    }

    /// The node's machine status in boot `boot_id`: `asked` if it was
    /// ([`TalosFleet::status_unless_followed`]), else from its live watch if the watch speaks for
    /// that boot; else, when the node's follower is waiting for it (the node is back before its
    /// watch is), from the watch its follower opens on being told
    /// ([`FollowedStatuses::await_watch`]); else asked now (the watch ended meanwhile, or may be
    /// older than the boot).
    async fn status_of_boot(
        &self,
        client: &TalosClient,
        address: IpAddr,
        boot_id: &str,
        asked: Option<MachineStatusSpec>,
    ) -> Result<MachineStatusSpec, TalosError> {
        if let Some(asked) = asked {
            return Ok(asked);
        }
        if let Some(status) = self.followed.status(address, boot_id) {
            return Ok(status);
        }
        if self.followed.awaited(address)
            && let Some(status) = self
                .followed
                .await_watch(address, boot_id, crate::followed_statuses::AWAIT_WATCH)
                .await
        {
            return Ok(status);
        }
        client.machine_status().await
    }

    /// `Version`'s answer as the node's running version and platform.
    fn running(
        &self,
        node: &InventoryNode,
        version: talos_api::VersionInfo,
    ) -> Result<Running, TalosError> {
        let tag = parse_talos_tag(&version.tag).map_err(|reason| TalosError::Decode {
            endpoint: std::net::SocketAddr::new(node.address, self.options.port).to_string(),
            message: reason,
        })?;
        Ok(Running {
            version: tag,
            platform: version.platform,
        })
    }

    /// One node's answers through `client`: its boot id, machine status (and machine config with
    /// `installed`), then `Version` unless the version of that boot is known.
    async fn read_node(
        &self,
        client: TalosClient,
        node: &InventoryNode,
        installed: bool,
    ) -> Result<Answered, TalosError> {
        let (boot_id, status, config) = futures::try_join!(
            client.boot_id(),
            self.status_unless_followed(&client, node.address),
            async {
                if installed {
                    client.machine_config().await.map(Some)
                } else {
                    Ok(None)
                }
            }
        )?;
        let status = self
            .status_of_boot(&client, node.address, &boot_id, status)
            .await?;
        let running = match self.looks.running(&node.name, &boot_id, installed) {
            Some(running) => running,
            None => self.running(node, client.version().await?)?,
        };
        Ok((running, boot_id, status, config))
    }

    /// One node on its own (through the relay, else directly; see [`TalosFleet::ask`]).
    async fn observe_one(&self, node: &InventoryNode, installed: bool) -> TalosState {
        node_state(
            self.ask(node.address, |client| {
                self.read_node(client, node, installed)
            })
            .await,
        )
    }

    /// What the node's Talos API says now. Any failure to ask makes the node unreachable, with the reason.
    pub async fn observe_node(&self, node: &InventoryNode) -> TalosState {
        self.observe_one(node, false).await
    }

    /// What the node's Talos API says now, with how it was installed: [`TalosFleet::observe_node`]
    /// and [`TalosFleet::read_installer_image`] in one round trip, which asks `Version` once (its
    /// `platform` is the install source's). A node up whose config cannot be read cannot be upgraded:
    /// it counts as unreachable, with the reason (as `with_installer_image` has it).
    pub async fn observe_node_installed(&self, node: &InventoryNode) -> TalosState {
        self.observe_one(node, true).await
    }

    /// How the node was installed: the install image of its running config (empty when the config has
    /// none, which the version rules then refuse with their own message) and the platform it reports
    /// (`MachineService.Version` `platform.name`, the same name talosctl and Omni put in Image Factory
    /// installer names).
    pub async fn read_installer_image(
        &self,
        node: &InventoryNode,
    ) -> Result<InstallSource, TalosError> {
        let (config, version) = self
            .ask(node.address, |client| async move {
                futures::try_join!(client.machine_config(), client.version())
            })
            .await?;
        Ok(install_source(config.as_bytes(), version.platform))
    }

    /// `state`, just asked in this reconcile, with how the node was installed: its machine config
    /// read now (one call) and the platform `Version` reported in that boot (kept from the look
    /// that asked it, [`KeptLooks::running`]). `None` when that boot's platform is not known: the
    /// node is then looked at in full. A node up whose config cannot be read counts as unreachable,
    /// as in a full look.
    pub async fn with_machine_config(
        &self,
        node: &InventoryNode,
        state: &TalosState,
    ) -> Option<TalosState> {
        let TalosState::Up { boot_id, .. } = state else {
            return None;
        };
        let running = self.looks.running(&node.name, boot_id, true)?;
        let config = self
            .ask(node.address, |client| async move {
                client.machine_config().await
            })
            .await;
        Some(with_installer_image(
            state.clone(),
            config
                .map(|config| install_source(config.as_bytes(), running.platform))
                .map_err(|error| error.to_string()),
        ))
    }

    /// etcd's health as the control planes report it: every member answers without errors, the control
    /// planes agree on the member list, and quorum survives one more member going down.
    ///
    /// Through a relay on a Talos before 1.14, every control plane's member list and status are
    /// asked in one call each, which the relay's apid fans out; a control plane the fan-out reports
    /// an error for is asked both directly, and that answer counts ([`TalosFleet::ask`]). Without a
    /// relay, through one on 1.14 or later (or not known yet), with one control plane, or when the
    /// relay refuses to fan calls out, each is asked on its own.
    pub async fn observe_etcd(&self, control_planes: &[InventoryNode]) -> EtcdObservation {
        let answers = self.ask_etcd(control_planes).await;

        let mut problems = Vec::new();
        let mut member_lists: Vec<BTreeSet<u64>> = Vec::new();
        let mut leader = None;
        let mut healthy = 0usize;
        let mut members_total = 0usize;
        for (node, answer) in control_planes.iter().zip(answers) {
            match answer {
                Err(error) => problems.push(format!(
                    "control plane {} does not answer for etcd: {error}",
                    node.name
                )),
                Ok((members, status)) => {
                    members_total = members_total.max(members.len());
                    member_lists.push(members.iter().map(|m| m.id).collect());
                    if status.errors.is_empty() {
                        healthy += 1;
                    } else {
                        problems.push(format!(
                            "member {} reports {}",
                            node.name,
                            status.errors.join("; ")
                        ));
                    }
                    if status.leader != 0 && status.leader == status.member_id {
                        leader = Some(node.name.clone());
                    }
                }
            }
        }
        if member_lists.windows(2).any(|pair| pair[0] != pair[1]) {
            problems.push("the control planes disagree on the etcd member list".to_string());
        }
        if let Some(problem) = quorum_problem(members_total, healthy) {
            problems.push(problem);
        }
        EtcdObservation {
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            // A single member leads by necessity and has no one to hand leadership to (Talos refuses:
            // "cannot forfeit leadership, only one member"), so there is no leader to move.
            leader: leader.filter(|_| members_total > 1),
        }
    }
}

impl TalosFleet {
    /// Each control plane's etcd member list and status, in `control_planes`' order.
    async fn ask_etcd(
        &self,
        control_planes: &[InventoryNode],
    ) -> Vec<Result<(Vec<EtcdMember>, EtcdMemberStatus), TalosError>> {
        let one_by_one = || {
            join_all(control_planes.iter().map(|node| async move {
                self.ask(node.address, |client| async move {
                    futures::try_join!(client.etcd_member_list(), client.etcd_status())
                })
                .await
            }))
        };
        let relay = (control_planes.len() > 1)
            .then(|| self.fanning_relay())
            .flatten();
        let Some((relay, client)) = relay else {
            return one_by_one().await;
        };
        let addresses: Vec<IpAddr> = control_planes.iter().map(|node| node.address).collect();
        let (members, statuses) = tokio::join!(
            self.fan_out(client.clone(), &addresses, |client, nodes| async move {
                client.etcd_member_lists_of(&nodes).await
            }),
            self.fan_out(client, &addresses, |client, nodes| async move {
                client.etcd_statuses_of(&nodes).await
            }),
        );
        let (Some(members), Some(statuses)) = (members, statuses) else {
            return one_by_one().await;
        };
        join_all(
            control_planes
                .iter()
                .zip(members.into_iter().zip(statuses))
                .map(|(node, (members, status))| async move {
                    match (members, status) {
                        (Ok(members), Ok(status)) => Ok((members, status)),
                        _ => {
                            self.ask_directly_after(relay, node.address, |client| async move {
                                futures::try_join!(client.etcd_member_list(), client.etcd_status())
                            })
                            .await
                        }
                    }
                }),
        )
        .await
    }
}

/// A node's answers: its running version, boot id, machine status, and machine config where read.
type Answered = (
    Running,
    String,
    MachineStatusSpec,
    Option<talos_api::MachineConfigBytes>,
);

/// A node's state from its answers, or unreachable with the reason.
fn node_state(answered: Result<Answered, TalosError>) -> TalosState {
    match answered {
        Ok((running, boot_id, status, config)) => TalosState::Up {
            version: running.version,
            boot_id,
            ready: resources::machine_status::is_running_and_ready(&status),
            install: config.map(|config| install_source(config.as_bytes(), running.platform)),
        },
        Err(error) => TalosState::Unreachable {
            reason: error.to_string(),
        },
    }
}

/// Lets go of a fleet's unused connections while it holds any; ends when it holds none (the next
/// connection made starts it again) or the fleet is dropped.
///
/// It sleeps until the first kept connection will have been unused for its time, not on a fixed
/// period: a wake-up costs the process far more CPU than the look itself after a long sleep (see
/// docs/performance.md, "CPU"), and a cluster in flight uses its relay throughout, so a period of a
/// few seconds would wake 200 fleets some 13 times a second for nothing. A connection used meanwhile
/// only moves the next look later. One made meanwhile, or a relay moved, is not waited for: every
/// call lets go of the unused connections first, and with no call the planned look comes at most
/// [`RELAY_KEPT_IDLE`] after the one before.
async fn close_unused(connections: Weak<Mutex<Connections>>) {
    let mut first_unused_at = None;
    loop {
        if let Some(at) = first_unused_at {
            tokio::time::sleep_until(at).await;
        }
        let Some(connections) = connections.upgrade() else {
            return;
        };
        let mut connections = connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        connections.drop_unused(None, Instant::now());
        match connections.first_unused_at() {
            Some(at) => first_unused_at = Some(at),
            None => {
                connections.closing_unused = false;
                return;
            }
        }
    }
}

/// How a node was installed, from its running config and the platform its `Version` reports.
fn install_source(config: &[u8], platform: String) -> InstallSource {
    InstallSource {
        image: installer_image_from_config(config).unwrap_or_default(),
        platform: Some(platform).filter(|platform| !platform.is_empty()),
    }
}

/// Why taking one more member down would lose quorum, if it would.
///
/// A single member cannot keep quorum through its own reboot whatever we do, and Talos upgrades it
/// (with its data preserved), so one member is allowed. Two members never survive one going down, and
/// Talos itself refuses that upgrade.
pub fn quorum_problem(members: usize, healthy: usize) -> Option<String> {
    if members <= 1 {
        return None;
    }
    let quorum = members / 2 + 1;
    if healthy.saturating_sub(1) < quorum {
        Some(format!(
            "{healthy} of {members} etcd members are healthy; taking one down would lose quorum \
             (needs {quorum})"
        ))
    } else {
        None
    }
}

/// `v1.11.6` → 1.11.6.
pub fn parse_talos_tag(tag: &str) -> Result<Version, String> {
    Version::parse(tag.trim().trim_start_matches('v'))
        .map_err(|e| format!("Talos reported version {tag:?}, which is not a version: {e}"))
}

/// `machine.install.image` from a (multi-document) machine config.
pub fn installer_image_from_config(config: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(config).ok()?;
    let documents: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(text)
        .filter_map(|document| serde_yaml::Value::deserialize(document).ok())
        .collect();
    let image = |value: Option<&serde_yaml::Value>| {
        value
            .and_then(serde_yaml::Value::as_str)
            .map(str::trim)
            .filter(|image| !image.is_empty())
            .map(str::to_string)
    };
    // Talos 1.14 takes the install image from an `UnattendedInstallConfig` document where the config
    // has one (machinery v1.14.1 `config/types/runtime/unattended_install.go`, `installer.image`);
    // configs from before keep `machine.install.image`, still supported.
    let unattended = documents.iter().find_map(|document| {
        (document.get("kind")?.as_str()? == "UnattendedInstallConfig")
            .then(|| image(document.get("installer")?.get("image")))
            .flatten()
    });
    unattended.or_else(|| {
        documents
            .iter()
            .find_map(|document| image(document.get("machine")?.get("install")?.get("image")))
    })
}

/// For tests: a fleet for a simulator's nodes (its admin credentials and port) that counts every
/// call it makes as `(method, code)`, as `talos_upgrade_talos_api_calls_total` does (the controller
/// hands its fleets the same kind of observer).
#[cfg(test)]
pub(crate) mod counted {
    use std::sync::{Arc, Mutex};

    use talos_api::ConnectOptions;

    use super::TalosFleet;

    /// Every call the fleet made, in order.
    pub(crate) type Calls = Arc<Mutex<Vec<(&'static str, &'static str)>>>;

    pub(crate) fn fleet_for(sim: &talos_sim::Simulator) -> (TalosFleet, Calls) {
        let credentials =
            talos_api::Talosconfig::from_yaml(&sim.talosconfig(talos_sim::pki::ClientRole::Admin))
                .and_then(|config| config.current_context()?.credentials())
                .expect("credentials");
        let calls: Calls = Arc::default();
        let observed = calls.clone();
        let options = ConnectOptions {
            port: sim.nodes()[0].port,
            observer: Some(talos_api::CallObserver::new(move |method, code| {
                observed.lock().unwrap().push((method, code));
            })),
            ..ConnectOptions::default()
        };
        (TalosFleet::new(credentials, options), calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_install_image_comes_from_unattended_install_config_where_a_config_has_one() {
        let legacy = b"version: v1alpha1\nmachine:\n  type: worker\n  install:\n    image: ghcr.io/siderolabs/installer:v1.13.0\n";
        assert_eq!(
            installer_image_from_config(legacy).as_deref(),
            Some("ghcr.io/siderolabs/installer:v1.13.0")
        );
        // Created on 1.14: no machine.install, the image in its own document.
        let documents = b"version: v1alpha1\nmachine:\n  type: worker\n---\napiVersion: v1alpha1\nkind: TimeSyncConfig\n---\napiVersion: v1alpha1\nkind: UnattendedInstallConfig\ninstaller:\n  image: factory.talos.dev/metal-installer/abc:v1.14.0\n";
        assert_eq!(
            installer_image_from_config(documents).as_deref(),
            Some("factory.talos.dev/metal-installer/abc:v1.14.0")
        );
        // Both: the document wins, as it does in Talos.
        let both = b"version: v1alpha1\nmachine:\n  type: worker\n  install:\n    image: ghcr.io/siderolabs/installer:v1.13.0\n---\napiVersion: v1alpha1\nkind: UnattendedInstallConfig\ninstaller:\n  image: factory.talos.dev/metal-installer/abc:v1.14.0\n";
        assert_eq!(
            installer_image_from_config(both).as_deref(),
            Some("factory.talos.dev/metal-installer/abc:v1.14.0")
        );
        // A document with no image leaves machine.install.image.
        let empty = b"version: v1alpha1\nmachine:\n  type: worker\n  install:\n    image: ghcr.io/siderolabs/installer:v1.13.0\n---\napiVersion: v1alpha1\nkind: UnattendedInstallConfig\ninstaller: {}\n";
        assert_eq!(
            installer_image_from_config(empty).as_deref(),
            Some("ghcr.io/siderolabs/installer:v1.13.0")
        );
    }

    #[test]
    fn quorum_with_one_more_member_down() {
        // (members, healthy, problem?)
        let cases = [
            (1, 1, false),
            (2, 2, true),
            (3, 3, false),
            (3, 2, true),
            (5, 5, false),
            (5, 4, false),
            (5, 3, true),
        ];
        for (members, healthy, problem) in cases {
            assert_eq!(
                quorum_problem(members, healthy).is_some(),
                problem,
                "{healthy}/{members}"
            );
        }
    }

    #[test]
    fn the_installer_image_is_read_from_the_machine_document() {
        let config = b"version: v1alpha1\nmachine:\n  type: worker\n  install:\n    disk: /dev/sda\n    image: factory.talos.dev/installer/abc:v1.11.6\n---\napiVersion: v1alpha1\nkind: HostnameConfig\nhostname: w1\n";
        assert_eq!(
            installer_image_from_config(config).as_deref(),
            Some("factory.talos.dev/installer/abc:v1.11.6")
        );
        assert_eq!(installer_image_from_config(b"kind: Other\n"), None);
        assert_eq!(installer_image_from_config(&[0xff, 0xfe]), None);
    }

    #[test]
    fn only_a_relay_before_talos_1_14_fans_calls_out() {
        for (relay, fans) in [
            ("1.11.6", true),
            ("1.12.0", true),
            ("1.13.0-beta.1", true),
            ("1.13.9", true),
            // Pre-releases of 1.14 have its apid, which logs each fanned-out call as deprecated.
            ("1.14.0-alpha.0", false),
            ("1.14.0-beta.1", false),
            ("1.14.0", false),
            ("1.14.1", false),
            ("1.15.0", false),
            ("2.0.0", false),
        ] {
            assert_eq!(fans_out(&Version::parse(relay).unwrap()), fans, "{relay}");
        }
    }

    #[test]
    fn talos_tags_parse_with_or_without_v() {
        assert_eq!(parse_talos_tag("v1.11.6"), Ok(Version::new(1, 11, 6)));
        assert_eq!(parse_talos_tag("1.12.0"), Ok(Version::new(1, 12, 0)));
        assert!(parse_talos_tag("latest").is_err());
    }

    /// The TCP connections this machine has established to `node`'s apid, as the kernel lists them
    /// (the simulator answers relayed calls in-process, so these are the fleet's own).
    fn established_to(node: std::net::Ipv4Addr, port: u16) -> usize {
        // /proc/net/tcp prints an IPv4 address as its four bytes read as a little-endian number.
        let remote = format!("{:08X}:{port:04X}", u32::from_le_bytes(node.octets()));
        std::fs::read_to_string("/proc/self/net/tcp")
            .expect("the kernel's TCP socket list")
            .lines()
            .skip(1)
            .filter(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                // Field 3 is the remote address, field 4 the state (01: established).
                fields.get(2) == Some(&remote.as_str()) && fields.get(3) == Some(&"01")
            })
            .count()
    }

    async fn eventually(what: &str, condition: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !condition() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    use super::counted::Calls;

    /// Every node of the inventory, none of them starting (what a look asks of a cluster at rest).
    fn ask_every_node(inventory: &[InventoryNode]) -> Vec<(&InventoryNode, bool)> {
        inventory.iter().map(|node| (node, false)).collect()
    }

    fn all_up(states: &[TalosState]) -> bool {
        states
            .iter()
            .all(|state| matches!(state, TalosState::Up { .. }))
    }

    fn count(calls: &Calls, method: &str, code: &str) -> usize {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(m, c)| *m == method && *c == code)
            .count()
    }

    /// A simulated cluster of three control planes and two workers on Talos 1.11.6, and a fleet
    /// for it relaying through its control planes, counting its calls.
    async fn five_nodes(
        name: &str,
    ) -> (talos_sim::Simulator, TalosFleet, Vec<InventoryNode>, Calls) {
        five_nodes_on(name, "1.11.6", "1.34.1").await
    }

    /// [`five_nodes`] on Talos `talos` and Kubernetes `kubernetes`.
    async fn five_nodes_on(
        name: &str,
        talos: &str,
        kubernetes: &str,
    ) -> (talos_sim::Simulator, TalosFleet, Vec<InventoryNode>, Calls) {
        use talos_sim::config::{NodeConfig, SimConfig, Timings};
        let mut config = SimConfig::new(name).with_timings(Timings::fast());
        for cp in ["cp-1", "cp-2", "cp-3"] {
            config = config.with_node(NodeConfig::control_plane(cp, talos, kubernetes));
        }
        for worker in ["w-1", "w-2"] {
            config = config.with_node(NodeConfig::worker(worker, talos, kubernetes));
        }
        let sim = talos_sim::Simulator::start(config)
            .await
            .expect("simulator");
        let (fleet, calls) = super::counted::fleet_for(&sim);
        let inventory: Vec<InventoryNode> = sim
            .nodes()
            .into_iter()
            .map(|node| InventoryNode {
                role: if node.name.starts_with("cp-") {
                    NodeRole::ControlPlane
                } else {
                    NodeRole::Worker
                },
                name: node.name,
                address: IpAddr::V4(node.address),
                held: false,
            })
            .collect();
        fleet.relay_through(control_planes(&inventory).iter().map(|node| node.address));
        (sim, fleet, inventory, calls)
    }

    /// Keeps a look's states, as `TalosIo` does after each look.
    fn keep(fleet: &TalosFleet, nodes: &[InventoryNode], states: &[TalosState]) {
        fleet.kept_looks().keep_nodes(nodes.iter().zip(states))
    }

    /// Looks at the relay (the first control plane) alone and keeps what it says, so that its
    /// Talos version is known ([`TalosFleet::fanning_relay`]); forgets the calls it made.
    async fn relay_known(fleet: &TalosFleet, inventory: &[InventoryNode], calls: &Calls) {
        let relay = &control_planes(inventory)[0];
        let state = fleet.observe_node(relay).await;
        assert!(matches!(state, TalosState::Up { .. }), "{state:?}");
        keep(fleet, std::slice::from_ref(relay), &[state]);
        assert_eq!(fleet.relay(), Some(relay.address));
        calls.lock().unwrap().clear();
    }

    /// A look at every node through the relay asks `Version` and the boot id of all of them in one
    /// call each (apid's one-to-many proxying), and the machine status (COSI, which apid does not
    /// fan out) of each; etcd is one `EtcdMemberList` and one `EtcdStatus` for every control plane.
    /// A node the fan-out reports an error for is asked again directly, alone, and is unreachable
    /// naming itself, as when asked node by node.
    #[tokio::test]
    async fn a_look_asks_every_node_in_one_call_per_question_the_relay_fans_out() {
        let (sim, fleet, inventory, calls) = five_nodes("fan-out").await;
        relay_known(&fleet, &inventory, &calls).await;
        let asked: Vec<(&InventoryNode, bool)> = inventory
            .iter()
            .map(|node| (node, node.name == "w-1"))
            .collect();
        let states = fleet.observe_nodes(&asked).await;
        for (node, state) in inventory.iter().zip(&states) {
            let TalosState::Up {
                version,
                boot_id,
                ready,
                install,
            } = state
            else {
                panic!("{} not up: {state:?}", node.name);
            };
            assert_eq!(*version, Version::new(1, 11, 6), "{}", node.name);
            assert_eq!(
                *boot_id,
                sim.node_snapshot(&node.name).unwrap().boot_id,
                "each node's own boot id"
            );
            assert!(*ready, "{}", node.name);
            // The install source only where it was asked for.
            assert_eq!(install.is_some(), node.name == "w-1", "{}", node.name);
        }
        // One call for the versions (of the four nodes besides the relay, whose boot's is kept) and
        // one for the five boot ids; the machine status of each (five) and the machine config of the
        // one that may start.
        assert_eq!(count(&calls, "Version", "OK"), 1);
        assert_eq!(count(&calls, "Read", "OK"), 1);
        assert_eq!(count(&calls, "COSI Get", "OK"), 5 + 1);
        assert_eq!(calls.lock().unwrap().len(), 1 + 1 + 6, "{calls:?}");

        calls.lock().unwrap().clear();
        let etcd = fleet.observe_etcd(&control_planes(&inventory)).await;
        assert_eq!(etcd.problem, None);
        assert!(etcd.leader.is_some(), "{etcd:?}");
        assert_eq!(count(&calls, "EtcdMemberList", "OK"), 1);
        assert_eq!(count(&calls, "EtcdStatus", "OK"), 1);
        assert_eq!(calls.lock().unwrap().len(), 2, "{calls:?}");

        // w-2 answers nothing (every call routed to it fails): the others are as before, and w-2 is
        // unreachable after being asked directly; nothing else is asked twice. (How many of w-2's
        // direct reads are counted depends on which fails first: the others are dropped then.)
        calls.lock().unwrap().clear();
        sim.inject_fault("w-2", talos_sim::Fault::FailNextCalls(1000))
            .unwrap();
        let asked = ask_every_node(&inventory);
        let states = fleet.observe_nodes(&asked).await;
        for (node, state) in inventory.iter().zip(&states) {
            match (node.name.as_str(), state) {
                ("w-2", TalosState::Unreachable { reason }) => {
                    assert!(reason.contains(&node.address.to_string()), "{reason}")
                }
                (_, TalosState::Up { .. }) if node.name != "w-2" => {}
                _ => panic!("{}: {state:?}", node.name),
            }
        }
        assert_eq!(count(&calls, "Version", "OK"), 1);
        assert_eq!(count(&calls, "Read", "OK"), 1);
        assert_eq!(count(&calls, "COSI Get", "OK"), 4);
        // w-2's relayed machine status, then its direct reads.
        let failed = calls.lock().unwrap().len() - (2 + 4);
        assert!((2..=1 + 3).contains(&failed), "{calls:?}");
        sim.clear_faults("w-2").unwrap();

        // cp-3's etcd does not answer: it is asked directly, and named in the problem.
        calls.lock().unwrap().clear();
        sim.inject_fault("cp-3", talos_sim::Fault::FailNextCalls(1000))
            .unwrap();
        let etcd = fleet.observe_etcd(&control_planes(&inventory)).await;
        let problem = etcd.problem.expect("cp-3 does not answer");
        assert!(
            problem.contains("control plane cp-3 does not answer for etcd"),
            "{problem}"
        );
        assert_eq!(count(&calls, "EtcdMemberList", "OK"), 1);
        assert_eq!(count(&calls, "EtcdStatus", "OK"), 1);
        let failed = calls.lock().unwrap().len() - 2;
        assert!((1..=2).contains(&failed), "{calls:?}");
    }

    /// A relay that refuses to fan calls out (a Talos without one-to-many proxying, which Talos
    /// deprecated in 1.14 for removal in 2.0) is not asked to again for a while: the nodes are asked
    /// one by one through it, as before, and every node still answers.
    #[tokio::test]
    async fn a_relay_that_refuses_to_fan_out_leaves_the_nodes_asked_one_by_one() {
        let (sim, fleet, inventory, calls) = five_nodes("no-fan-out").await;
        relay_known(&fleet, &inventory, &calls).await;
        for cp in ["cp-1", "cp-2", "cp-3"] {
            sim.inject_fault(cp, talos_sim::Fault::NoOneToMany).unwrap();
        }
        let asked = ask_every_node(&inventory);
        let states = fleet.observe_nodes(&asked).await;
        assert!(all_up(&states), "{states:?}");
        assert_eq!(count(&calls, "Read", "InvalidArgument"), 1, "{calls:?}");
        // The relay's own version is kept for its boot: the four others are asked theirs.
        assert_eq!(count(&calls, "Version", "OK"), 4, "{calls:?}");
        assert_eq!(count(&calls, "Read", "OK"), 5, "{calls:?}");
        let relay = fleet.relay();
        assert!(relay.is_some());

        // The next look does not try to fan out: each node is asked on its own, through the same
        // relay.
        calls.lock().unwrap().clear();
        let states = fleet.observe_nodes(&asked).await;
        assert!(all_up(&states), "{states:?}");
        assert_eq!(count(&calls, "Version", "OK"), 4, "{calls:?}");
        assert_eq!(count(&calls, "Read", "OK"), 5, "{calls:?}");
        assert_eq!(count(&calls, "COSI Get", "OK"), 5, "{calls:?}");
        assert_eq!(calls.lock().unwrap().len(), 14, "{calls:?}");
        assert_eq!(fleet.relay(), relay);
        let etcd = fleet.observe_etcd(&control_planes(&inventory)).await;
        assert_eq!(etcd.problem, None);
    }

    /// Talos 1.14 deprecates apid's one-to-many proxying, and its apid logs every call fanned out
    /// through it (talos v1.14.1 `internal/app/apid/pkg/director/director.go`): a relay on 1.14 is
    /// asked node by node, as one whose version is not known yet (the first look) is, while one on
    /// 1.12 fans the next look's calls out. The 1.14 relay would fan out (its apid still does, as
    /// 1.14.1's does): asking node by node is the fleet's choice, not a refusal.
    #[tokio::test]
    async fn a_relay_on_talos_1_14_is_asked_node_by_node_and_one_on_1_12_fans_out() {
        for (talos, kubernetes, fans) in [("1.12.5", "1.34.1", true), ("1.14.1", "1.36.2", false)] {
            let (_sim, fleet, inventory, calls) =
                five_nodes_on(&format!("gate-{talos}"), talos, kubernetes).await;
            let asked = ask_every_node(&inventory);
            let cps = control_planes(&inventory);
            let look = || async {
                let states = fleet.observe_nodes(&asked).await;
                for (node, state) in inventory.iter().zip(&states) {
                    assert!(
                        matches!(state, TalosState::Up { version, .. } if version.to_string() == talos),
                        "{talos} {}: {state:?}",
                        node.name
                    );
                }
                assert_eq!(fleet.observe_etcd(&cps).await.problem, None, "{talos}");
                states
            };

            // The relay's version is not known yet: every node on its own, through the relay.
            let first = look().await;
            assert_eq!(count(&calls, "Read", "OK"), 5, "{talos}: {calls:?}");
            assert_eq!(count(&calls, "Version", "OK"), 5, "{talos}: {calls:?}");
            assert_eq!(
                count(&calls, "EtcdMemberList", "OK"),
                3,
                "{talos}: {calls:?}"
            );
            assert_eq!(count(&calls, "EtcdStatus", "OK"), 3, "{talos}: {calls:?}");
            keep(&fleet, &inventory, &first);

            // Known now: on 1.12 one call per question for all the nodes; on 1.14 still one per
            // node, and none refused. Every version is kept for its boot.
            calls.lock().unwrap().clear();
            look().await;
            let per_node = |nodes: usize| if fans { 1 } else { nodes };
            assert_eq!(
                count(&calls, "Read", "OK"),
                per_node(5),
                "{talos}: {calls:?}"
            );
            assert_eq!(count(&calls, "Version", "OK"), 0, "{talos}: {calls:?}");
            assert_eq!(count(&calls, "COSI Get", "OK"), 5, "{talos}: {calls:?}");
            assert_eq!(
                count(&calls, "EtcdMemberList", "OK"),
                per_node(3),
                "{talos}: {calls:?}"
            );
            assert_eq!(
                count(&calls, "EtcdStatus", "OK"),
                per_node(3),
                "{talos}: {calls:?}"
            );
            assert_eq!(
                calls.lock().unwrap().len(),
                per_node(5) + 5 + 2 * per_node(3),
                "{talos}: nothing refused or failed: {calls:?}"
            );

            let relay = fleet.relay().expect("a relay");
            let addresses: Vec<IpAddr> = inventory.iter().map(|node| node.address).collect();
            let fanned = fleet
                .direct_client(relay)
                .unwrap()
                .boot_ids_of(&addresses)
                .await
                .expect("the relay's apid fans out");
            assert_eq!(fanned.len(), 5, "{talos}");
            assert!(
                fanned.iter().all(|(_, boot_id)| boot_id.is_ok()),
                "{talos}: {fanned:?}"
            );
        }
    }

    /// A node's version is asked once per boot: a look that finds every node on the boot the last
    /// look saw asks no `Version` (the boot ids, one call, say the same systems run), and one after
    /// a node rebooted asks that node alone.
    #[tokio::test]
    async fn a_version_is_asked_once_per_boot() {
        let (sim, fleet, inventory, calls) = five_nodes("per-boot").await;
        let asked: Vec<(&InventoryNode, bool)> = inventory
            .iter()
            .map(|node| (node, node.name == "w-1"))
            .collect();
        let first = fleet.observe_nodes(&asked).await;
        // What `TalosIo` keeps after each look. The first look asked node by node (the relay's
        // version was not known yet).
        assert_eq!(count(&calls, "Read", "OK"), 5, "{calls:?}");
        keep(&fleet, &inventory, &first);

        calls.lock().unwrap().clear();
        let second = fleet.observe_nodes(&asked).await;
        assert_eq!(second, first, "the same systems, installed the same way");
        assert_eq!(count(&calls, "Version", "OK"), 0, "{calls:?}");
        assert_eq!(count(&calls, "Read", "OK"), 1, "{calls:?}");
        keep(&fleet, &inventory, &second);

        let w2 = inventory.iter().find(|n| n.name == "w-2").unwrap();
        fleet
            .client(w2.address)
            .unwrap()
            .reboot(talos_api::RebootMode::Default)
            .await
            .expect("reboot");
        sim.wait_for("w-2", Duration::from_secs(20), |s| s.down)
            .await
            .expect("down");
        sim.wait_for("w-2", Duration::from_secs(20), |s| !s.down && s.ready)
            .await
            .expect("back");
        calls.lock().unwrap().clear();
        let third = fleet.observe_nodes(&asked).await;
        let boot = |states: &[TalosState]| match &states[4] {
            TalosState::Up { boot_id, .. } => boot_id.clone(),
            other => panic!("w-2: {other:?}"),
        };
        assert_ne!(boot(&third), boot(&second));
        assert_eq!(&third[..4], &second[..4]);
        assert_eq!(count(&calls, "Version", "OK"), 1, "w-2's alone: {calls:?}");
    }

    /// A relay that does not answer at all leaves every node asked directly, each answering for
    /// itself; the relay is passed over for the next control plane, where the next look fans out.
    #[tokio::test]
    async fn a_relay_that_does_not_answer_leaves_each_node_asked_directly() {
        let (_sim, fleet, inventory, calls) = five_nodes("relay-down").await;
        // Nothing listens there: the relay's connection is refused.
        let gone: IpAddr = "127.0.0.254".parse().unwrap();
        let control_planes: Vec<InventoryNode> = control_planes(&inventory);
        // As an earlier look found them: the gone relay and cp-1 on 1.11, which fan out.
        let earlier = TalosState::Up {
            version: Version::new(1, 11, 6),
            boot_id: "an earlier boot".into(),
            ready: true,
            install: None,
        };
        let gone_node = InventoryNode {
            name: "cp-0".into(),
            address: gone,
            ..control_planes[0].clone()
        };
        fleet
            .kept_looks()
            .keep_nodes([(&gone_node, &earlier), (&control_planes[0], &earlier)]);
        let control_planes: Vec<IpAddr> = control_planes.iter().map(|node| node.address).collect();
        fleet.relay_through(std::iter::once(gone).chain(control_planes.iter().copied()));
        let asked = ask_every_node(&inventory);
        let states = fleet.observe_nodes(&asked).await;
        assert!(all_up(&states), "{states:?}");
        assert_eq!(count(&calls, "Version", "OK"), 5, "{calls:?}");
        assert_eq!(count(&calls, "Read", "OK"), 5, "{calls:?}");
        assert_eq!(fleet.relay(), Some(control_planes[0]));

        calls.lock().unwrap().clear();
        let states = fleet.observe_nodes(&asked).await;
        assert!(all_up(&states), "{states:?}");
        assert_eq!(count(&calls, "Version", "OK"), 1, "{calls:?}");
        assert_eq!(count(&calls, "Read", "OK"), 1, "{calls:?}");
    }

    #[tokio::test]
    async fn unused_connections_close_unless_held_and_open_again_on_the_next_call() {
        use talos_sim::config::{NodeConfig, SimConfig, Timings};
        let sim = talos_sim::Simulator::start(
            SimConfig::new("idle-fleet")
                .with_node(NodeConfig::control_plane("cp-1", "1.11.6", "1.34.1"))
                .with_node(NodeConfig::worker("w-1", "1.11.6", "1.34.1"))
                .with_timings(Timings::fast()),
        )
        .await
        .expect("simulator");
        let nodes = sim.nodes();
        let (cp, worker) = (nodes[0].address, nodes[1].address);
        let port = nodes[0].port;
        let credentials =
            talos_api::Talosconfig::from_yaml(&sim.talosconfig(talos_sim::pki::ClientRole::Admin))
                .and_then(|config| config.current_context()?.credentials())
                .expect("credentials");
        let options = ConnectOptions {
            port,
            ..ConnectOptions::default()
        };
        let fleet = TalosFleet::new(credentials, options).with_kept_idle(KeptIdle {
            direct: Duration::from_millis(200),
            relay: Duration::from_millis(400),
        });
        fleet.relay_through([IpAddr::V4(cp)]);
        let version = |client: TalosClient| async move { client.version().await };

        // A relayed read, and one the node answers directly: a connection to each, the fleet keeping
        // the relay's only; the direct one closes with its client.
        fleet.ask(worker.into(), version).await.expect("relayed");
        let direct = fleet.direct_client(worker.into()).expect("direct client");
        direct.version().await.expect("direct");
        assert_eq!(fleet.relay(), Some(IpAddr::V4(cp)));
        assert_eq!(
            (established_to(cp, port), established_to(worker, port)),
            (1, 1)
        );
        assert_eq!(fleet.connections_held(), 1);
        drop(direct);
        eventually("the direct connection closes with its client", || {
            established_to(worker, port) == 0
        })
        .await;

        // Unused, the relay's is let go of and closed, with no call made.
        eventually("the fleet lets go of the relay", || {
            fleet.connections_held() == 0
        })
        .await;
        eventually("the relay's connection closes", || {
            established_to(cp, port) == 0
        })
        .await;

        // A client someone holds (a run's follower, a call in flight) keeps its connection after the
        // fleet lets go of it.
        let held = fleet.client(worker.into()).expect("client");
        held.version().await.expect("relayed");
        eventually("the fleet lets go of the relay", || {
            fleet.connections_held() == 0
        })
        .await;
        assert_eq!(established_to(cp, port), 1);
        held.version()
            .await
            .expect("the held connection still answers");
        assert_eq!(established_to(cp, port), 1);
        drop(held);
        eventually("the connection closes with its last holder", || {
            established_to(cp, port) == 0
        })
        .await;

        // The next call opens it again.
        fleet.ask(worker.into(), version).await.expect("reopened");
        assert_eq!((fleet.connections_held(), established_to(cp, port)), (1, 1));

        // Without a relay every node is dialled directly, and the fleet keeps those connections
        // until they are unused.
        fleet.relay_through([]);
        fleet.ask(worker.into(), version).await.expect("direct");
        assert_eq!(fleet.relay(), None);
        assert_eq!(established_to(worker, port), 1);
        eventually("the fleet lets go of every connection", || {
            fleet.connections_held() == 0
        })
        .await;
        eventually("every connection closes", || {
            established_to(cp, port) + established_to(worker, port) == 0
        })
        .await;
    }
}
