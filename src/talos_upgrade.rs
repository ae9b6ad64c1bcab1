//! The IO of the Talos OS upgrade: looking at a cluster's nodes and etcd through their Talos APIs and
//! its workload Nodes, the drain pass, and the calls (`MachineService.Upgrade` before Talos 1.13;
//! `ImageService.Pull` + `LifecycleService.Upgrade`, then `Reboot`, from 1.13). What to do is decided
//! in the core ([`talos_upgrade_core::talos`]); this module only looks and calls.

use std::time::Instant;

use talos_api::{ContainerdNamespace, LegacyUpgradeOptions, RebootMode, TalosError};
use talos_upgrade_core::acknowledgement::LastLook;
use talos_upgrade_core::lifecycle::{Act, Called, Looked};
use talos_upgrade_core::talos::installer::installer_exit;
use talos_upgrade_core::talos::{
    Action, Further, FurtherLooked, NodeObservation, Observation, Scope, StartingNodes, Talos,
    TalosState, TalosVersions, UpgradeApi,
};
use talos_upgrade_core::versions::KubernetesVersion;

use crate::cluster_access::{Access, AccessError, SharedAccess};
use crate::credentials;
use crate::drain;
use crate::followers::{FollowedNode, Waker};
use crate::holds::{self, GateContext};
use crate::inventory::{AddressNeed, InventoryNode, WorkloadNodeInfo};
use crate::kind_io::KindIo;
use crate::progress_store::Saved;
use crate::talos_fleet::{TalosFleet, control_planes};

/// Why a cluster's Talos nodes could not be looked at.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookError {
    #[error(transparent)]
    Access(#[from] AccessError),
    /// No node answers, because the nodes refuse the Secret's credentials (a client certificate from
    /// another cluster's CA, a server certificate the Secret's CA does not sign, a role without
    /// access) rather than because they are down. Waiting cannot fix that.
    #[error(
        "the Talos API of node {node} refused the credentials in Secret {namespace}/{secret} \
         ({why}); put this cluster's talosconfig (os:admin) in the Secret's {key:?} key"
    )]
    CredentialsRefused {
        node: String,
        namespace: String,
        secret: String,
        why: String,
        key: &'static str,
    },
}

/// The Talos upgrade's IO for one cluster in one reconcile.
pub struct TalosIo<'a> {
    access: &'a SharedAccess<'a>,
    /// Where what this reconcile saw of the versions is kept, for the acknowledgement of a new target.
    note_look: &'a (dyn Fn(Option<LastLook>) + Sync),
    now: jiff::Timestamp,
    /// What the last look saw of each node's workload Node (Ready, cordoned), and when it asked the
    /// nodes: a follower started later replays what changed since.
    seen: Vec<(String, bool, bool)>,
    observed_at: Option<Instant>,
    /// What a look at the nodes in flight alone asked of them in this reconcile: the look at
    /// everything that follows it at once when one is back (the core's `Further::Refresh`) does not
    /// ask them again.
    in_flight_asked: Vec<(String, TalosState)>,
    /// Wakes this cluster's reconcile when a call ends that the next pass follows at once.
    wake: Waker,
    /// What the gates before each node are observed with (see [`holds`]).
    gates: GateContext<'a>,
    /// The cluster's Alertmanager silences, synced before the calls (see [`crate::silences`]).
    silences: Option<&'a crate::silences::RunSilences<'a>>,
    /// Where the etcd snapshot before the control planes goes (see [`crate::etcd_snapshot`]).
    snapshots: Option<crate::etcd_snapshot::SnapshotContext<'a>>,
}

impl<'a> TalosIo<'a> {
    pub fn new(
        access: &'a SharedAccess<'a>,
        note_look: &'a (dyn Fn(Option<LastLook>) + Sync),
        now: jiff::Timestamp,
        wake: Waker,
        gates: GateContext<'a>,
    ) -> Self {
        TalosIo {
            access,
            note_look,
            now,
            seen: Vec::new(),
            observed_at: None,
            in_flight_asked: Vec::new(),
            wake,
            gates,
            silences: None,
            snapshots: None,
        }
    }

    /// Takes the etcd snapshots this cluster's runs ask for into `snapshots`' destination.
    pub fn with_snapshots(
        mut self,
        snapshots: Option<crate::etcd_snapshot::SnapshotContext<'a>>,
    ) -> Self {
        self.snapshots = snapshots;
        self
    }

    /// Takes the etcd snapshot from `node` and stores it, verified: `Stored` with where it went, or
    /// `Refused` with what failed (the run then stops before any control plane).
    async fn snapshot(&self, access: &Access, node: &str, target: &str) -> Called {
        let Some(context) = &self.snapshots else {
            return Called::Refused(crate::etcd_snapshot::NO_DESTINATION.to_string());
        };
        match context.take(access, node, "talos", target, self.now).await {
            Ok(stored) => Called::Stored(stored),
            Err(crate::etcd_snapshot::TakeError::NotReached(reason)) => Called::NotReached(reason),
            Err(crate::etcd_snapshot::TakeError::Failed(reason)) => Called::Refused(reason),
        }
    }

    /// Syncs `silences` with the saved run before each batch of calls that may disrupt a node, so a
    /// node starting is silenced before it is disrupted.
    pub fn with_silences(mut self, silences: Option<&'a crate::silences::RunSilences<'a>>) -> Self {
        self.silences = silences;
        self
    }

    fn note(&self, versions: Option<&TalosVersions>) {
        (self.note_look)(
            versions
                .filter(|versions| versions.range.is_some())
                .map(|versions| LastLook {
                    versions: versions.clone(),
                    at: self.now,
                }),
        );
    }

    async fn observe(&mut self, starting: &StartingNodes) -> Result<Observation, LookError> {
        let access = self.access.get().await?;
        let Access {
            fleet,
            inventory,
            workload_nodes,
            namespace,
            secret_name,
            ..
        } = access;
        let control_planes = control_planes(inventory);
        let named: Vec<(&str, _)> = inventory
            .iter()
            .map(|node| (node.name.as_str(), node.role))
            .collect();
        let reading_images = &starting.names(&named);
        // A pass that can start no node asks only the nodes in flight; the others are as the last
        // look saw them (see `kept_looks`). A node never asked yet is asked all the same. A node
        // that a look at the nodes in flight found up and ready within the last second is not
        // asked again (`KeptLooks::just_asked_ready`).
        let kept = fleet.kept_looks();
        // What each kubelet reports of the system it runs: a node found on that boot is not asked
        // `Version` (`KeptLooks::kubelet_reports`).
        for info in workload_nodes.iter() {
            if let (Some(boot_id), Some(version)) = (&info.boot_id, &info.os_talos_version) {
                kept.kubelet_reports(&info.node.name, boot_id, version);
            }
        }
        let just_asked = std::mem::take(&mut self.in_flight_asked);
        let just_asked_state = |name: &str| {
            just_asked
                .iter()
                .find(|(asked, _)| asked == name)
                .map(|(_, state)| state.clone())
        };
        let mut kept_states: Vec<Option<TalosState>> = match starting {
            StartingNodes::InFlight { nodes } => inventory
                .iter()
                .map(|node| {
                    if nodes.contains(&node.name) {
                        kept.just_asked_ready(&node.name)
                    } else {
                        kept.node(&node.name)
                    }
                })
                .collect(),
            // The nodes just asked in this pass (or ready, by a look at the nodes in flight, within
            // the last second); those whose installer is read now too, unless their platform for
            // that boot is not known (`with_machine_config` below).
            StartingNodes::Named(_) | StartingNodes::Every => inventory
                .iter()
                .map(|node| {
                    just_asked_state(&node.name).or_else(|| kept.just_asked_ready(&node.name))
                })
                .collect(),
        };
        let in_flight_only = matches!(starting, StartingNodes::InFlight { .. });
        let scope_in_flight = in_flight_only && kept_states.iter().any(Option::is_some);
        // Through a relay that fans calls out, the boot ids of the nodes not in flight cost nothing
        // beside those of the nodes in flight (one call for all), and a followed node's status comes
        // from its watch: a look at the nodes in flight asks them too, by the way, so that the look
        // at everything that follows it once one is back (`Further::Refresh`) takes them from it
        // rather than asking again. Only when a node in flight is asked (a call is made anyway),
        // and not while the relay itself is in flight unless its own watch is open (down, it would
        // fail the call, and each node would then be asked on its own).
        let asks_in_flight = inventory
            .iter()
            .zip(&kept_states)
            .any(|(node, kept)| {
                kept.is_none()
                    && matches!(starting, StartingNodes::InFlight { nodes } if nodes.contains(&node.name))
            });
        let by_the_way: Vec<bool> = match (starting, fleet.fanning_relay_address()) {
            (StartingNodes::InFlight { nodes }, Some(relay)) if asks_in_flight => {
                let relay_may_be_down = inventory
                    .iter()
                    .any(|node| node.address == relay && nodes.contains(&node.name))
                    && !fleet.followed_statuses().follows(relay);
                inventory
                    .iter()
                    .zip(&kept_states)
                    .map(|(node, kept)| {
                        !relay_may_be_down
                            && !nodes.contains(&node.name)
                            && matches!(kept, Some(TalosState::Up { .. }))
                            && fleet.followed_statuses().follows(node.address)
                    })
                    .collect()
            }
            _ => vec![false; inventory.len()],
        };
        for (kept, by_the_way) in kept_states.iter_mut().zip(&by_the_way) {
            if *by_the_way {
                *kept = None;
            }
        }
        // The nodes just asked whose installer is read now: their machine config only, where the
        // platform of their boot is known; otherwise they are asked in full.
        let mut config_only = vec![false; inventory.len()];
        if !in_flight_only {
            for ((node, kept_state), config_only) in
                inventory.iter().zip(&mut kept_states).zip(&mut config_only)
            {
                if !reading_images.contains(&node.name) {
                    continue;
                }
                match kept_state {
                    Some(TalosState::Up { boot_id, .. })
                        if kept.running(&node.name, boot_id, true).is_some() =>
                    {
                        *config_only = true;
                    }
                    _ => *kept_state = None,
                }
            }
        }
        // etcd only where a control plane may start (the core looks at it before deciding where
        // it needs it otherwise: `Scope::WithoutEtcd`, a round trip later): the nodes this pass
        // may start are control planes only. A run about to start, or in its pre-pull (which reads
        // every node's machine config), on a cluster with workers starts them first unless told
        // otherwise (`order`, which only the core knows): etcd waits for the first control plane.
        let is_worker = |name: &String| {
            inventory.iter().any(|node| {
                node.name == *name && node.role == talos_upgrade_core::run::NodeRole::Worker
            })
        };
        let asks_etcd = match starting {
            StartingNodes::Every => !inventory
                .iter()
                .any(|node| node.role == talos_upgrade_core::run::NodeRole::Worker),
            StartingNodes::Named(_) => {
                !reading_images.is_empty() && !reading_images.iter().any(is_worker)
            }
            StartingNodes::InFlight { .. } => false,
        };
        let scope = if scope_in_flight {
            Scope::InFlight
        } else if !asks_etcd {
            Scope::WithoutEtcd
        } else {
            Scope::Everything
        };
        // Every node and etcd at once: one round trip to the nodes, however many there are. The
        // machine configs (installer images) of the nodes this pass may start are read in it too.
        let observed_at = Instant::now();
        // The gates are asked beside the nodes (an alert query, health checks), not after them.
        // The nodes asked (those not taken from a kept look) are asked together: through the relay,
        // one boot id call for all of them, and one `Version` call for those booted since the last
        // look asked them (`TalosFleet::observe_nodes`).
        let to_ask: Vec<(&InventoryNode, bool)> = inventory
            .iter()
            .zip(&kept_states)
            .filter(|(_, kept)| kept.is_none())
            .map(|(node, _)| (node, reading_images.contains(&node.name)))
            .collect();
        let configs = inventory
            .iter()
            .zip(&kept_states)
            .zip(&config_only)
            .filter(|(_, config_only)| **config_only)
            .filter_map(|((node, kept), _)| kept.as_ref().map(|kept| (node, kept)))
            .map(|(node, kept)| fleet.with_machine_config(node, kept));
        let (asked_states, configs, etcd, gates) = tokio::join!(
            fleet.observe_nodes(&to_ask),
            futures::future::join_all(configs),
            async {
                if asks_etcd {
                    fleet.observe_etcd(&control_planes).await
                } else {
                    // Never taken for healthy: a decision that needs etcd holds on this, should
                    // it ever be made without looking.
                    talos_upgrade_core::talos::EtcdObservation {
                        problem: Some("etcd was not looked at in this pass".to_string()),
                        leader: None,
                    }
                }
            },
            holds::observe(&self.gates, access, starting),
        );
        let mut asked_states = asked_states.into_iter();
        let mut configs = configs.into_iter();
        let states: Vec<TalosState> = kept_states
            .iter()
            .zip(&config_only)
            .map(|(kept, config_only)| match kept {
                // `with_machine_config` answers for each node it is given, in order.
                Some(_) if *config_only => {
                    configs
                        .next()
                        .flatten()
                        .unwrap_or_else(|| TalosState::Unreachable {
                            reason: "its machine config was not read".to_string(),
                        })
                }
                Some(kept) => kept.clone(),
                // `observe_nodes` answers each node it is given, in order.
                None => asked_states
                    .next()
                    .unwrap_or_else(|| TalosState::Unreachable {
                        reason: "was not asked".to_string(),
                    }),
            })
            .collect();
        // The nodes this look asked (not taken from a kept look).
        let asked: Vec<(&InventoryNode, &TalosState)> = inventory
            .iter()
            .zip(&states)
            .zip(&kept_states)
            .filter(|(_, kept)| kept.is_none())
            .map(|((node, state), _)| (node, state))
            .collect();
        if in_flight_only {
            kept.keep_in_flight_nodes(asked.iter().copied());
        } else {
            kept.keep_nodes(asked.iter().copied());
        }
        if in_flight_only {
            self.in_flight_asked = asked
                .iter()
                .map(|(node, state)| (node.name.clone(), (*state).clone()))
                .collect();
        }
        access.note_talos_versions(
            states
                .iter()
                .map(|state| match state {
                    TalosState::Up { version, .. } => Ok(version.clone()),
                    TalosState::Unreachable { reason } => Err(reason.clone()),
                })
                .collect(),
        );
        // The Nodes were listed before the nodes were asked. A node that Talos reports running and
        // ready while its Node is not Ready may have turned Ready in between (the kubelet reports right
        // after Talos is ready), so the Nodes are read once more (from the followers' watch of them
        // while it runs, at no request), rather than leaving it to a whole further reconcile to notice.
        let ready_in = |nodes: &[WorkloadNodeInfo], name: &str| {
            nodes.iter().any(|n| n.node.name == name && n.ready)
        };
        let behind = inventory.iter().zip(&states).any(|(node, state)| {
            matches!(state, TalosState::Up { ready: true, .. })
                && !ready_in(workload_nodes, &node.name)
        });
        let reread = if behind {
            access
                .workload_nodes_now(AddressNeed::Optional)
                .await
                .inspect_err(|error| tracing::debug!(%error, "reading the workload Nodes again"))
                .ok()
        } else {
            None
        };
        let workload_nodes: &[WorkloadNodeInfo] = reread.as_deref().unwrap_or(workload_nodes);
        let workload_node = |name: &str| workload_nodes.iter().find(|n| n.node.name == name);
        let nodes: Vec<NodeObservation> = inventory
            .iter()
            .zip(states)
            .map(|(node, talos)| NodeObservation {
                name: node.name.clone(),
                role: node.role,
                kubernetes_ready: ready_in(workload_nodes, &node.name),
                cordoned: workload_node(&node.name).is_some_and(|n| n.unschedulable),
                drain: None,
                kubelet_version: workload_node(&node.name)
                    .and_then(|n| n.kubelet_version.as_deref())
                    .and_then(|v| KubernetesVersion::parse(v).ok()),
                talos,
            })
            .collect();
        if nodes
            .iter()
            .all(|n| matches!(n.talos, TalosState::Unreachable { .. }))
            && let Some(refused) =
                credentials_refused(fleet, inventory, namespace, secret_name).await
        {
            return Err(refused);
        }
        self.seen = nodes
            .iter()
            .map(|n| (n.name.clone(), n.kubernetes_ready, n.cordoned))
            .collect();
        self.observed_at = Some(observed_at);
        Ok(Observation {
            nodes,
            etcd,
            gates,
            scope,
        })
    }

    /// Cordons and evicts on every node the run is draining, and says what is left on each.
    async fn drain_pass(&self, nodes: &[String]) -> FurtherLooked {
        let Ok(access) = self.access.get().await else {
            return FurtherLooked::Drained(nodes.iter().map(|n| (n.clone(), None)).collect());
        };
        let mut drained = Vec::new();
        for node in nodes {
            let status = match drain::drain_pass(&access.workload, node).await {
                Ok(status) => Some(status),
                Err(error) => {
                    tracing::warn!(%node, %error, "draining");
                    None
                }
            };
            drained.push((node.clone(), status));
        }
        FurtherLooked::Drained(drained)
    }

    /// Reads the installer image of the named nodes, all at once.
    async fn installer_images(&self, names: &[String]) -> FurtherLooked {
        let Ok(access) = self.access.get().await else {
            return FurtherLooked::InstallerImages(Vec::new());
        };
        let reads = access
            .inventory
            .iter()
            .filter(|node| names.contains(&node.name))
            .map(|node| async move {
                let read = access.fleet.read_installer_image(node).await;
                (node.name.clone(), read.map_err(|e| e.to_string()))
            });
        FurtherLooked::InstallerImages(futures::future::join_all(reads).await)
    }
}

impl KindIo<Talos> for TalosIo<'_> {
    /// `talos-current` and `talos-available` of a cluster with nothing in flight, from one `Version`
    /// call per node and the workload Nodes (no etcd, no machine configs): what an idle refresh costs.
    async fn look_at_versions(&mut self) -> Looked<TalosVersions> {
        let access = match self.access.get().await {
            Ok(access) => access,
            Err(error) => {
                self.note(None);
                return Err(error.to_string());
            }
        };
        let talos = access.talos_versions().await;
        let kubelets = kubelets(access);
        let versions = TalosVersions::of(talos.iter().filter_map(|v| v.as_ref().ok()), &kubelets);
        self.note(Some(&versions));
        Ok(versions)
    }

    async fn look_at_cluster(&mut self, starting: &StartingNodes) -> Looked<Observation> {
        let observed = self.observe(starting).await;
        let versions = observed
            .as_ref()
            .ok()
            .map(<Talos as talos_upgrade_core::lifecycle::Kind>::versions_of);
        self.note(versions.as_ref());
        observed.map_err(|error| error.to_string())
    }

    async fn further(&mut self, work: &[Further]) -> Vec<FurtherLooked> {
        let mut looked = Vec::new();
        for further in work {
            looked.push(match further {
                Further::Drain(nodes) => self.drain_pass(nodes).await,
                Further::InstallerImages(names) => self.installer_images(names).await,
                Further::Refresh(starting) => FurtherLooked::Refreshed(
                    self.observe(starting)
                        .await
                        .map_err(|error| error.to_string()),
                ),
                Further::Etcd => match self.access.get().await {
                    Ok(access) => FurtherLooked::Etcd(
                        access
                            .fleet
                            .observe_etcd(&control_planes(&access.inventory))
                            .await,
                    ),
                    Err(error) => FurtherLooked::Etcd(talos_upgrade_core::talos::EtcdObservation {
                        problem: Some(error.to_string()),
                        leader: None,
                    }),
                },
            });
        }
        looked
    }

    async fn act(&mut self, act: &Saved<Act<Talos>>) -> Vec<Called> {
        let access = match self.access.get().await {
            Ok(access) => access,
            Err(error) => {
                return vec![Called::NotReached(error.to_string())];
            }
        };
        let actions = &act.get().actions;
        // The pre-pull's pulls go to every node at once (bounded): they change nothing a node boots,
        // and the run waits for all of them before the first node starts. The answers come back in
        // the order of the actions, as the lifecycle reads them.
        if !actions.is_empty()
            && actions
                .iter()
                .all(|action| matches!(action, Action::PrePull { .. }))
        {
            let mut called = Vec::with_capacity(actions.len());
            for batch in actions.chunks(PRE_PULLS_AT_ONCE) {
                let pulls: Vec<_> = batch.iter().map(|action| call(access, action)).collect();
                called.extend(futures::future::join_all(pulls).await);
            }
            return called;
        }
        if let Some(silences) = self.silences {
            silences.sync(Some(&act.get().run)).await;
        }
        let mut called = Vec::new();
        for action in actions {
            access.fleet.kept_looks().calling(action.node());
            let result = match action {
                Action::EtcdSnapshot { node } => {
                    self.snapshot(access, node, &act.get().run.target).await
                }
                _ => call(access, action).await,
            };
            if next_pass_follows(action, &result) {
                tracing::debug!(node = %action.node(), "the install ended: waking its cluster");
                self.wake.wake();
            }
            let refused = matches!(result, Called::Refused(_));
            called.push(result);
            if refused {
                break;
            }
        }
        called
    }

    fn follow(&self, in_flight: &[String]) -> Vec<FollowedNode> {
        // Only after a look: the followers start from what it saw.
        let (Some(observed_at), Some(Ok(access))) = (self.observed_at, self.access.peek()) else {
            return Vec::new();
        };
        // Every node of a cluster with a node in flight: the others for their machine status, which
        // the looks before each node starts take from the watches (see `crate::followed_statuses`).
        if in_flight.is_empty() {
            return Vec::new();
        }
        access
            .inventory
            .iter()
            .filter_map(|node| {
                let seen = self
                    .seen
                    .iter()
                    .find(|(name, ..)| *name == node.name)
                    .map(|(_, ready, cordoned)| (*ready, *cordoned));
                // A node the fleet can make no client for (credentials it cannot use) is not
                // followed.
                access.fleet.client(node.address).ok()?;
                Some(FollowedNode {
                    name: node.name.clone(),
                    talos: access.fleet.clone(),
                    address: node.address,
                    in_flight: in_flight.contains(&node.name),
                    workload: access.workload.clone(),
                    observed_at,
                    nodes: access.watched_nodes.clone(),
                    seen,
                })
            })
            .collect()
    }
}

/// The kubelet versions of this cluster's Talos nodes. A workload Node that is not in the inventory
/// (not a Talos node of this cluster) does not count.
fn kubelets(access: &Access) -> Vec<KubernetesVersion> {
    access
        .workload_nodes
        .iter()
        .filter(|n| access.inventory.iter().any(|node| node.name == n.node.name))
        .filter_map(|n| {
            n.kubelet_version
                .as_deref()
                .and_then(|v| KubernetesVersion::parse(v).ok())
        })
        .collect()
}

/// How many nodes pull at once during the pre-pull.
const PRE_PULLS_AT_ONCE: usize = 8;

/// Makes one call.
async fn call(access: &Access, action: &Action) -> Called {
    let node_name = action.node().to_string();
    if let Action::Uncordon { .. } = action {
        // Best effort: while the node is in flight the next pass uncordons it again if this failed.
        if let Err(error) = drain::uncordon(&access.workload, &node_name).await {
            tracing::warn!(node = %node_name, %error, "uncordoning");
        }
        return Called::Done;
    }
    let Some(node) = access.inventory.iter().find(|n| n.name == node_name) else {
        return Called::Refused("is no longer in the node inventory".to_string());
    };
    let client = match access.fleet.client(node.address) {
        Ok(client) => client,
        Err(error) => return Called::Refused(format!("cannot be reached: {error}")),
    };
    let (result, what) = match action {
        Action::Uncordon { .. } => return Called::Done,
        // Made by `TalosIo::snapshot`, which has the destination.
        Action::EtcdSnapshot { .. } => {
            return Called::Refused("the etcd snapshot has no destination here".to_string());
        }
        Action::ForfeitEtcdLeadership { .. } => {
            // Best effort: if it fails, the next look sees the same leader and tries again.
            if let Err(error) = client.etcd_forfeit_leadership().await {
                tracing::warn!(node = %node_name, %error, "moving etcd leadership");
            }
            return Called::Done;
        }
        Action::Upgrade {
            installer_image,
            api: UpgradeApi::Legacy,
            ..
        } => (
            client
                .upgrade_legacy(
                    installer_image,
                    &LegacyUpgradeOptions {
                        preserve: true,
                        ..LegacyUpgradeOptions::default()
                    },
                )
                .await
                .map(|_| ()),
            "the upgrade",
        ),
        Action::PrePull {
            installer_image,
            api,
            ..
        } => return pre_pull(&client, &node_name, installer_image, *api).await,
        Action::Pull {
            installer_image, ..
        } => match client.image_pull(installer_image).await {
            Ok(_) => return Called::Done,
            // A pull changes nothing the node boots: the next pass pulls again.
            Err(error) if error.is_unreachable() => {
                tracing::warn!(node = %node_name, %error, "pulling the installer");
                return Called::NotReached(error.to_string());
            }
            // Talos 1.14 pulls once and hands every registry hiccup to the caller (talos v1.14.1
            // `internal/pkg/containers/image/pull.go`): what may pass is pulled again later. A
            // missing image, a refused reference or credentials stay so: the node fails, untouched.
            Err(error) if pull_may_pass(&error) => {
                tracing::warn!(node = %node_name, %error, "pulling the installer; trying again later");
                return Called::Retry(format!("pulling {installer_image}: {error}"));
            }
            Err(error) => {
                return Called::Refused(format!(
                    "refused the installation: pulling {installer_image}: {error}"
                ));
            }
        },
        Action::Upgrade {
            installer_image,
            api: UpgradeApi::Lifecycle,
            ..
        } => {
            match client.lifecycle_upgrade(installer_image).await {
                Ok(_) => return Called::Done,
                // The install was asked for and its answer lost: it may have happened, so it is
                // never asked for again before a reboot (the core drains and reboots the node).
                Err(error) if error.is_unreachable() => {
                    tracing::warn!(node = %node_name, %error, "the installation got no answer");
                    return Called::Unanswered(error.to_string());
                }
                // The installer ran and failed: its exit code says whether trying again may help.
                Err(TalosError::UpgradeFailed {
                    exit_code,
                    output_tail,
                    ..
                }) => {
                    let (retry, reason) = installer_exit(exit_code, &output_tail);
                    tracing::warn!(node = %node_name, exit_code, retry, "the installer failed");
                    return if retry {
                        Called::Retry(reason)
                    } else {
                        Called::Refused(format!("refused the installation: {reason}"))
                    };
                }
                Err(error) => (Err(error), "the installation"),
            }
        }
        Action::Reboot { .. } => (
            client.reboot(RebootMode::Default).await.map(|_| ()),
            "the reboot",
        ),
        // Answers before the node goes down, as the reboot does: the same rules for a lost answer.
        Action::Rollback { .. } => (client.rollback().await, "the rollback"),
    };
    match result {
        Ok(()) => Called::Done,
        // Both the legacy upgrade call and the reboot answer before the node goes down, so no answer
        // means the node may never have got the call (apid answering `Unavailable` is one way): the
        // run keeps it as unanswered, and makes it again only if the node is seen still running its
        // old boot, ready, after a grace period (see `Settings::unanswered_grace`).
        Err(error) if error.is_unreachable() => {
            tracing::warn!(node = %node_name, %error, "{what} got no answer");
            Called::Unanswered(error.to_string())
        }
        Err(error) => Called::Refused(format!("refused {what}: {error}")),
    }
}

/// The pre-pull on one node. Talos ≥ 1.13: `ImageService.Pull` into the containerd instance
/// `LifecycleService.Upgrade` then reads the installer from (the system namespace of the CRI
/// containerd, `talos_api`'s `system_containerd`; talos v1.13.0 `internal/app/lifecycle/container.go`
/// only looks the image up, it never pulls). Older Talos: the legacy upgrade pulls into the system
/// containerd itself (talos v1.12.0 `internal/pkg/install/pull.go`), which `MachineService.ImagePull`
/// cannot reach (it always talks to the CRI containerd, `v1alpha1_images.go`); the pull is then a
/// check, through the node's own registry configuration, that the node can pull its installer.
///
/// The registry's answer is what the run's failure shows. What may pass (the node or the registry not
/// answering) is tried again a few times; a missing image or a refused reference fails at once.
async fn pre_pull(
    client: &talos_api::TalosClient,
    node: &str,
    installer_image: &str,
    api: UpgradeApi,
) -> Called {
    let pulled = match api {
        UpgradeApi::Lifecycle => client.image_pull(installer_image).await.map(|_| ()),
        UpgradeApi::Legacy => {
            client
                .image_pull_legacy(installer_image, ContainerdNamespace::NsSystem)
                .await
        }
    };
    match pulled {
        Ok(()) => Called::Done,
        // A node without the legacy pull cannot be checked; its upgrade call pulls, as before.
        Err(error) if api == UpgradeApi::Legacy && error.code() == "Unimplemented" => {
            tracing::warn!(%node, %error, "the node cannot pre-pull; its upgrade pulls");
            Called::Done
        }
        Err(error) if error.is_unreachable() || pull_may_pass(&error) => {
            tracing::warn!(%node, %error, "pre-pulling the installer; trying again later");
            Called::Retry(error.to_string())
        }
        Err(error) => {
            tracing::warn!(%node, %error, "pre-pulling the installer failed");
            Called::Refused(error.to_string())
        }
    }
}

/// Whether `action` ending with `result` leaves the next pass something to do at once, which the
/// poll would only do up to a poll interval later: a Talos >= 1.13 install that answered, or whose
/// answer was lost (the node is drained and rebooted next, in either case). Nothing else does: a pull
/// that answered is followed by the install in the same pass; a failure that may pass waits
/// `--retry-after`; a refusal is recorded in the same pass; a call that reached nothing is made
/// again, and waking for it would call an unreachable node in a loop; and every other call's node is
/// followed until it is back ([`crate::followers`]).
fn next_pass_follows(action: &Action, result: &Called) -> bool {
    matches!(
        action,
        Action::Upgrade {
            api: UpgradeApi::Lifecycle,
            ..
        }
    ) && matches!(result, Called::Done | Called::Unanswered(_))
}

/// Whether a failed pull may succeed later: a timeout or a registry that answered with an error of its
/// own (gRPC `Internal`, `Unknown`, `ResourceExhausted`, `Aborted`), not a missing image, a refused
/// reference or credentials, and not a node without the API.
fn pull_may_pass(error: &TalosError) -> bool {
    matches!(
        error.code(),
        "DeadlineExceeded" | "Internal" | "Unknown" | "ResourceExhausted" | "Aborted"
    )
}

/// When no node answers: whether the nodes refuse the Secret's credentials. Asks one node, directly
/// (through a relay, a refusal could be the relay's hop rather than these credentials); `None` when
/// it is merely unreachable.
async fn credentials_refused(
    fleet: &TalosFleet,
    inventory: &[InventoryNode],
    namespace: &str,
    secret_name: &str,
) -> Option<LookError> {
    let node = inventory.first()?;
    let refused = |why: String| LookError::CredentialsRefused {
        node: node.name.clone(),
        namespace: namespace.to_string(),
        secret: secret_name.to_string(),
        why,
        key: credentials::TALOSCONFIG_KEY,
    };
    let client = match fleet.direct_client(node.address) {
        Ok(client) => client,
        Err(error) => return Some(refused(error.to_string())),
    };
    match client.version().await {
        Err(TalosError::Tls { reason, .. }) => {
            Some(refused(format!("TLS handshake failed: {reason}")))
        }
        Err(TalosError::PermissionDenied { message, .. }) => {
            Some(refused(format!("permission denied: {message}")))
        }
        Err(TalosError::Config(reason)) => Some(refused(reason)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_install_that_ended_answered_or_unanswered_wakes_the_next_pass() {
        let node = || "worker-1".to_string();
        let image = || "ghcr.io/siderolabs/installer:v1.13.5".to_string();
        let install = Action::Upgrade {
            node: node(),
            installer_image: image(),
            api: UpgradeApi::Lifecycle,
        };
        let legacy = Action::Upgrade {
            node: node(),
            installer_image: image(),
            api: UpgradeApi::Legacy,
        };
        let pull = Action::Pull {
            node: node(),
            installer_image: image(),
        };
        let prepull = Action::PrePull {
            node: node(),
            installer_image: image(),
            api: UpgradeApi::Lifecycle,
        };
        let why = || "why".to_string();
        // (action, result, wake?)
        let cases = [
            // Drained and rebooted next.
            (&install, Called::Done, true),
            (&install, Called::Unanswered(why()), true),
            // Made again after --retry-after; failed in the same pass; made again (a wake would loop).
            (&install, Called::Retry(why()), false),
            (&install, Called::Refused(why()), false),
            (&install, Called::NotReached(why()), false),
            // The install follows a pull in the same pass.
            (&pull, Called::Done, false),
            (&pull, Called::Retry(why()), false),
            // The first node starts in the same pass as the last pre-pull's answer.
            (&prepull, Called::Done, false),
            (&prepull, Called::Retry(why()), false),
            // The node reboots by itself: its follower wakes the reconcile when it is back.
            (&legacy, Called::Done, false),
            (&Action::Reboot { node: node() }, Called::Done, false),
        ];
        for (action, result, wake) in cases {
            assert_eq!(
                next_pass_follows(action, &result),
                wake,
                "{action:?} {result:?}"
            );
        }
    }
}
