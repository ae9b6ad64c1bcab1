//! Waking a cluster's reconcile the moment a node in flight changes, instead of at the next poll, and
//! watching every node of a running cluster so that its looks need not ask what the watches tell.
//!
//! While a node is being upgraded, the controller has nothing to do until the node is back: running its
//! new version, Talos-ready and Kubernetes-Ready. Polling finds that out up to a poll interval late, on
//! every node, which adds up over a rolling upgrade. So for every node in flight the controller follows
//! two streams and wakes the cluster's reconcile when one of them says something changed:
//!
//! - the node's machine status (a COSI watch of `runtime/MachineStatuses/machine`, the resource a look
//!   reads): it is running and ready;
//! - the node's Kubernetes `Node` in the workload cluster: it became `Ready`, or was uncordoned while
//!   Ready. One watch of all the cluster's Nodes serves every node in flight, and while it runs the
//!   reconciles take the Nodes from it ([`WatchedNodes`]) instead of listing them each time.
//!
//! The other nodes of a cluster with a node in flight are watched the same way, without waking
//! anything: before each node starts, a look checks that every other node is ready, and the watches
//! tell it ([`crate::followed_statuses`]) instead of one `MachineStatus` read per node and look.
//!
//! Only changes that can move the upgrade on wake it, and only those after the reconcile that started
//! the follower looked at the node; a node's return wakes it once, when the second of the two streams
//! says so ([`NodeSignals::talos_ready`]): every wake-up costs a reconcile, and a reconcile that finds
//! nothing to do still reads the cluster's state from the API server. A wake-up that comes while the
//! cluster's reconcile runs waits for its end, and goes out only if that reconcile still follows the
//! node ([`FollowerWakes`]): one that saw the node done needs no second look.
//!
//! The end of a Talos >= 1.13 install (`LifecycleService.Upgrade`, a call that lasts the whole install)
//! wakes it the same way ([`Waker`], from `talos_upgrade`): the node's drain and reboot come next, and
//! nothing else would tell the controller before the poll.
//!
//! A wake-up only asks for a reconcile; the reconcile still observes everything itself and decides as
//! usual. The poll stays as the safety net (relaxed while every node in flight is rebooting and
//! followed: `Revisit::AwaitingReboots` in the core), so a lost stream costs time, never correctness.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio::sync::{Notify, mpsc};
use tokio::task::AbortHandle;

use crate::inventory::{NodeChange, SeenNode, WatchedNodes};
use crate::talos_fleet::TalosFleet;
use talos_api::proto::talos::resource::definitions::runtime::MachineStatusSpec;
use talos_api::{CosiEventType, resources};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::talos::TalosState;

/// Pause before reconnecting to a node's event stream that broke: a stream also breaks when the
/// control plane relaying it reboots while the node itself is up, and then it is back at once.
const RECONNECT_MIN: Duration = Duration::from_millis(200);
/// Pause after an attempt that failed: the node is away (rebooting; it takes a minute or more to
/// come back), and every attempt meanwhile is a Talos call that fails. The node's Node tells when
/// it is back (its kubelet writes it, with the new boot id, as soon as it runs again, before Talos
/// reports the node ready), and that cuts the pause short ([`NodeSignals::poke`]); the pause is
/// only the safety net, half the reconcile's own while every node in flight is followed
/// (`FOLLOWED_POLL_INTERVAL`, which relies on it). A reconnection replays every event since the
/// node booted, so a node that became ready meanwhile is not missed.
const RECONNECT_AWAY: Duration = Duration::from_secs(60);
/// A follower gives up after this long even if no reconcile told it to stop (the controller lost its
/// leadership; a deleted cluster's followers are stopped when the controller forgets it): the poll
/// carries on without it.
const FOLLOW_AT_MOST: Duration = Duration::from_secs(60 * 60);

/// One node to follow, with the connections to reach it.
#[derive(Clone)]
pub struct FollowedNode {
    pub name: String,
    /// The cluster's Talos connections and the node's address: each (re)connection of the node's
    /// event stream goes the way the fleet routes calls then. A client kept from the start would keep
    /// the connection to the control plane that relayed when the follower started, and reopen it
    /// after that control plane's reboot, beside the relay the fleet moved on to.
    pub talos: Arc<TalosFleet>,
    pub address: IpAddr,
    /// Whether the node is in flight: only then does its follower wake the reconcile (and its Node
    /// count for the Node watch's wake-ups). The others are followed for their machine status.
    pub in_flight: bool,
    pub workload: kube::Client,
    /// When the reconcile that lists the node asked it: a node put in flight that came back since
    /// (a fast node, back before that reconcile ended) wakes the cluster at once.
    pub observed_at: Instant,
    /// Where the watch of the cluster's Nodes puts what it sees (the connections' own, see
    /// [`crate::cluster_access::ClusterLink`]).
    pub nodes: Arc<WatchedNodes>,
    /// The workload Node's (Ready, cordoned) as that reconcile saw it; `None` if it saw no Node.
    pub seen: Option<(bool, bool)>,
}

/// Aborts its task when dropped, so forgetting a follower stops it.
struct Follower(AbortHandle);

/// One node's Talos follower, and whether the node is in flight (changed by the reconciles as the
/// run moves on, without opening the watch again).
struct TalosFollower {
    _task: Follower,
    flight: Arc<Flight>,
}

impl TalosFollower {
    fn in_flight(&self) -> bool {
        self.flight.in_flight.load(Ordering::SeqCst)
    }
}

/// What a node's follower and the reconciles share: whether the node is in flight, and when its
/// watch last told that it came back (running and ready after it was not, or first thing after the
/// watch broke). The node may come back before the reconcile that sent its upgrade ends and marks it
/// in flight; that reconcile looked at it before, so a return after its look wakes it then.
#[derive(Default)]
struct Flight {
    in_flight: AtomicBool,
    back_at: Mutex<Option<Instant>>,
}

impl Flight {
    /// The node came back: wakes the cluster if the node is in flight. (Recorded first, then the flag
    /// read; [`Flight::put_in_flight`] sets the flag first, then reads the record: one of the two
    /// sees the other, so the wake-up is never lost.)
    fn came_back(&self, wake: impl FnOnce()) {
        *lock(&self.back_at) = Some(Instant::now());
        if self.in_flight.load(Ordering::SeqCst) {
            wake();
        }
    }

    /// Marks the node in flight or not; true if it is newly in flight and came back after `looked_at`.
    fn put_in_flight(&self, in_flight: bool, looked_at: Instant) -> bool {
        let was = self.in_flight.swap(in_flight, Ordering::SeqCst);
        in_flight && !was && lock(&self.back_at).is_some_and(|back| back > looked_at)
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The nodes in flight of one cluster whose Node is followed: name → (Ready, cordoned) as last seen
/// (`None`: no Node seen yet).
type FollowedNodes = Arc<Mutex<HashMap<String, Option<(bool, bool)>>>>;

/// What a followed node's two followers (its Talos follower and the cluster's Node watch) tell
/// each other.
struct NodeSignals {
    /// From the Node watch to the Talos follower: the node's Node says it may be back
    /// ([`may_be_back`]). While the node is away, its follower does not ask Talos again until then
    /// (or [`RECONNECT_AWAY`]). A poke that comes while the follower is not waiting is kept for its
    /// next wait (`Notify::notify_one`), unless it came while the stream was open and the stream
    /// then ended with the node going down (it was not news of the node's return): at worst one
    /// attempt too early, never one that matters missed.
    poke: Arc<Notify>,
    /// From the Talos follower to the Node watch: what the node's `MachineStatus` watch last said
    /// while it is open, running and ready or not (`None`: the watch is not open, so nothing current
    /// is known).
    ///
    /// A node in flight is done only when Talos says it is running and ready and its Node is
    /// `Ready` (`talos_upgrade_core::talos`, `check_in_flight`), and the two say so moments apart,
    /// in either order (Talos's own readiness can wait on the Node's, or the kubelet can report
    /// `Ready` before Talos's other conditions are met). Each follower therefore wakes the cluster
    /// only when the other does not say "not yet": the reconcile woken by the first of the two would
    /// find the node still waiting, and a second one would follow moments later. Each side records
    /// what it saw before it reads the other's (the Talos follower here, the Node watch into
    /// [`WatchedNodes`]), under locks, so when both come at once at least one of them sees the
    /// other's and wakes the cluster. A side that knows nothing (this watch not open, the Node watch
    /// not synced) never holds the other back.
    talos_ready: Option<bool>,
}

/// The [`NodeSignals`] of one cluster's followed nodes, by node name. A node's entry is made when
/// it is first followed and dropped with its follower ([`Wakeups::follow`]), so a follower that
/// was let go and has not stopped yet writes into nothing.
#[derive(Clone, Default)]
struct SignalBoard(Arc<Mutex<HashMap<String, NodeSignals>>>);

impl SignalBoard {
    /// Starts signalling for `name`: the poke its Talos follower waits on.
    fn add(&self, name: &str) -> Arc<Notify> {
        let poke = Arc::new(Notify::new());
        let signals = NodeSignals {
            poke: poke.clone(),
            talos_ready: None,
        };
        lock(&self.0).insert(name.to_string(), signals);
        poke
    }

    /// Keeps only the nodes `followed` says.
    fn retain(&self, followed: impl Fn(&str) -> bool) {
        lock(&self.0).retain(|name, _| followed(name));
    }

    /// The Node watch: `name`'s Node says it may be back.
    fn poke(&self, name: &str) {
        if let Some(signals) = lock(&self.0).get(name) {
            signals.poke.notify_one();
        }
    }

    /// `name` answers Talos again after it was away: every other node's follower may try again
    /// (see `follow_node`).
    fn poke_all_but(&self, name: &str) {
        for (other, signals) in lock(&self.0).iter() {
            if other != name {
                signals.poke.notify_one();
            }
        }
    }

    /// `name`'s Talos follower: what its open watch says now (`None`: it is not open).
    fn talos_says(&self, name: &str, ready: Option<bool>) {
        if let Some(signals) = lock(&self.0).get_mut(name) {
            signals.talos_ready = ready;
        }
    }

    /// What `name`'s open Talos watch last said.
    fn talos_said(&self, name: &str) -> Option<bool> {
        lock(&self.0)
            .get(name)
            .and_then(|signals| signals.talos_ready)
    }
}

/// The watch of one cluster's workload Nodes.
struct NodeWatch {
    nodes: Arc<WatchedNodes>,
    followed: FollowedNodes,
    task: Follower,
}

/// What follows one cluster: a Talos event follower per node in flight, and one Node watch.
#[derive(Default)]
struct ClusterFollowers {
    talos: HashMap<String, TalosFollower>,
    signals: SignalBoard,
    nodes: Option<NodeWatch>,
}

/// The followers of every cluster, and the channel their wake-ups go out on.
pub struct Wakeups {
    sender: mpsc::UnboundedSender<ObjectRef<KubernetesCluster>>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<ObjectRef<KubernetesCluster>>>>,
    followed: Mutex<HashMap<ObjectRef<KubernetesCluster>, ClusterFollowers>>,
    /// Where the followers' wake-ups go: held while their cluster's reconcile runs.
    wakes: Arc<FollowerWakes>,
}

impl Default for Wakeups {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Wakeups {
            sender: sender.clone(),
            receiver: Mutex::new(Some(receiver)),
            followed: Mutex::new(HashMap::new()),
            wakes: Arc::new(FollowerWakes {
                sender,
                running: Mutex::new(HashMap::new()),
            }),
        }
    }
}

/// The followers' wake-ups. One that comes while its cluster's reconcile runs is held until that
/// reconcile ends, and sent then only if the node it is about is still followed: both followers of a
/// node (its Talos events and its Node) wake the cluster when it is back, usually within
/// milliseconds of each other, so the second wake-up comes while the reconcile woken by the first
/// runs. When that reconcile saw the node done it no longer follows it, and another reconcile would
/// find nothing new (at the end of a run it is the whole idle look again: the Nodes and the mirror
/// Pods listed, the nodes asked their version). A node still in flight is still followed: its
/// wake-up goes out, and the next reconcile looks again, as before.
struct FollowerWakes {
    sender: mpsc::UnboundedSender<ObjectRef<KubernetesCluster>>,
    /// The clusters whose reconcile runs → the nodes whose followers woke them meanwhile.
    running: Mutex<HashMap<ObjectRef<KubernetesCluster>, BTreeSet<String>>>,
}

impl FollowerWakes {
    fn running(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<ObjectRef<KubernetesCluster>, BTreeSet<String>>> {
        self.running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The follower of `node` has news for `cluster`'s reconcile.
    fn wake(&self, cluster: &ObjectRef<KubernetesCluster>, node: &str) {
        if let Some(held) = self.running().get_mut(cluster) {
            held.insert(node.to_string());
            return;
        }
        // The receiver is gone only when the controller stops; nothing is left to wake then.
        let _ = self.sender.send(cluster.clone());
    }
}

/// A reconcile of one cluster running: the followers' wake-ups meanwhile are held (see
/// [`FollowerWakes`]) and, as it ends (however it ends), sent on if a node they are about is still
/// followed.
pub struct Reconciling<'a> {
    wakeups: &'a Wakeups,
    cluster: ObjectRef<KubernetesCluster>,
}

impl Drop for Reconciling<'_> {
    fn drop(&mut self) {
        let Some(held) = self.wakeups.wakes.running().remove(&self.cluster) else {
            return;
        };
        let still_followed = {
            let followed = self
                .wakeups
                .followed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            followed.get(&self.cluster).is_some_and(|current| {
                held.iter().any(|node| {
                    current
                        .talos
                        .get(node)
                        .is_some_and(TalosFollower::in_flight)
                })
            })
        };
        if still_followed {
            let _ = self.wakeups.sender.send(self.cluster.clone());
        } else if !held.is_empty() {
            tracing::debug!(
                nodes = ?held,
                "wake-ups during the reconcile about nodes it no longer follows: not reconciling again"
            );
        }
    }
}

impl Wakeups {
    /// The clusters to reconcile because a followed node changed. Taken once, by the controller.
    pub fn triggers(&self) -> impl Stream<Item = ObjectRef<KubernetesCluster>> + Send + 'static {
        let receiver = self
            .receiver
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
        futures::stream::unfold(receiver, |receiver| async move {
            let mut receiver = receiver?;
            let next = receiver.recv().await?;
            Some((next, Some(receiver)))
        })
    }

    /// A way to wake `cluster`'s reconcile from the shell, on the followers' channel. Sent while a
    /// reconcile of the cluster runs, the wake-up is held until it ends, and the next one starts then.
    pub fn waker(&self, cluster: &ObjectRef<KubernetesCluster>) -> Waker {
        Waker {
            sender: self.sender.clone(),
            cluster: cluster.clone(),
        }
    }

    /// A reconcile of `cluster` starts; it ends when the returned guard is dropped (see
    /// [`Reconciling`]). The controller never runs two reconciles of one cluster at once.
    pub fn reconciling(&self, cluster: &ObjectRef<KubernetesCluster>) -> Reconciling<'_> {
        self.wakes
            .running()
            .insert(cluster.clone(), BTreeSet::new());
        Reconciling {
            wakeups: self,
            cluster: cluster.clone(),
        }
    }

    /// Follow exactly `nodes` of `cluster` from now on: new ones are followed, ones no longer listed are
    /// let go, and the ones still listed only change whether they are in flight. An empty list stops
    /// following the cluster.
    pub fn follow(&self, cluster: &ObjectRef<KubernetesCluster>, nodes: Vec<FollowedNode>) {
        let mut followed = self
            .followed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if nodes.is_empty() {
            followed.remove(cluster);
            return;
        }
        let current = followed.entry(cluster.clone()).or_default();
        current
            .talos
            .retain(|name, _| nodes.iter().any(|node| &node.name == name));
        current
            .signals
            .retain(|name| nodes.iter().any(|node| node.name == name));
        // Nodes whose Talos said they were back before this reconcile marked them in flight (see
        // [`Flight`]): they wake the cluster once the Node watch has them, below.
        let mut back_early = Vec::new();
        for node in &nodes {
            if let Some(follower) = current.talos.get(&node.name) {
                if follower
                    .flight
                    .put_in_flight(node.in_flight, node.observed_at)
                {
                    back_early.push(node);
                }
                continue;
            }
            let poke = current.signals.add(&node.name);
            let flight = Arc::new(Flight::default());
            flight.put_in_flight(node.in_flight, node.observed_at);
            let task = tokio::spawn(follow_node(
                cluster.clone(),
                node.clone(),
                flight.clone(),
                poke,
                current.signals.clone(),
                self.wakes.clone(),
            ));
            current.talos.insert(
                node.name.clone(),
                TalosFollower {
                    _task: Follower(task.abort_handle()),
                    flight,
                },
            );
        }
        // The Node watch wakes the reconcile for the nodes in flight only.
        let in_flight: Vec<&FollowedNode> = nodes.iter().filter(|node| node.in_flight).collect();
        // One watch of the Nodes, made with the connections of this reconcile (new ones, after the
        // credentials changed, start a new watch).
        let first = &nodes[0];
        let watch = match current.nodes.take() {
            // One that ran out of time ([`FOLLOW_AT_MOST`]) during a long run starts again.
            Some(watch)
                if Arc::ptr_eq(&watch.nodes, &first.nodes) && !watch.task.0.is_finished() =>
            {
                watch
            }
            _ => {
                // Filled before the watch starts, so that its first list is compared with what the
                // reconcile saw.
                let followed = FollowedNodes::new(Mutex::new(
                    in_flight
                        .iter()
                        .map(|node| (node.name.clone(), node.seen))
                        .collect(),
                ));
                // Its first list is on its way from now on: a reconcile that comes before it is in
                // waits for it rather than list the Nodes too.
                first.nodes.record(NodeChange::Relist);
                let task = tokio::spawn(watch_workload_nodes(
                    first.workload.clone(),
                    first.nodes.clone(),
                    followed.clone(),
                    current.signals.clone(),
                    cluster.clone(),
                    self.wakes.clone(),
                ));
                NodeWatch {
                    nodes: first.nodes.clone(),
                    followed,
                    task: Follower(task.abort_handle()),
                }
            }
        };
        {
            let mut followed = watch
                .followed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            followed.retain(|name, _| in_flight.iter().any(|node| &node.name == name));
            for node in &in_flight {
                if followed.contains_key(&node.name) {
                    continue;
                }
                // A Node that changed since the reconcile looked wakes it at once (the watch, already
                // running, will only say what changes from now on).
                let now = watch.nodes.node(&node.name);
                let state = now.as_ref().map(|seen| (seen.ready, seen.cordoned));
                if let Some(state) = state
                    && worth_a_look(node.seen, state)
                {
                    self.wakes.wake(cluster, &node.name);
                }
                followed.insert(node.name.clone(), state.or(node.seen));
            }
            // As the Talos follower decides (see `NodeSignals::talos_ready`): not while its Node
            // says "not yet". The node is in `followed` now, and this is read under its lock, so
            // a Node turning Ready after this read finds it there and wakes the cluster.
            for node in back_early {
                if node_says_not_yet(&watch.nodes, &node.name) {
                    tracing::debug!(node = %node.address, "node back before it was marked in flight, its Node not Ready yet: its Node will wake the cluster");
                } else {
                    tracing::debug!(node = %node.address, "node back before it was marked in flight: waking its cluster");
                    self.wakes.wake(cluster, &node.name);
                }
            }
        }
        current.nodes = Some(watch);
    }
}

/// Whether the cluster's Node watch says `name`'s Node is not Ready yet: then the Node's turning
/// Ready wakes the cluster, and a wake-up for Talos's readiness alone would find the node still
/// waiting (see [`NodeSignals::talos_ready`]). A watch that knows nothing says nothing.
fn node_says_not_yet(nodes: &WatchedNodes, name: &str) -> bool {
    nodes.node(name).is_some_and(|seen| !seen.ready)
}

/// Wakes one cluster's reconcile (see [`Wakeups::waker`]).
#[derive(Clone)]
pub struct Waker {
    sender: mpsc::UnboundedSender<ObjectRef<KubernetesCluster>>,
    cluster: ObjectRef<KubernetesCluster>,
}

impl Waker {
    pub fn wake(&self) {
        // The receiver is gone only when the controller stops; nothing is left to wake then.
        let _ = self.sender.send(self.cluster.clone());
    }
}

/// Follows one node's machine status until aborted (or [`FOLLOW_AT_MOST`]), sending `cluster` when
/// it is in flight and comes back.
async fn follow_node(
    cluster: ObjectRef<KubernetesCluster>,
    node: FollowedNode,
    flight: Arc<Flight>,
    poke: Arc<Notify>,
    signals: SignalBoard,
    wakes: Arc<FollowerWakes>,
) {
    let wake_up = || {
        flight.came_back(|| {
            // Its Node says "not yet": the Node's watch wakes the cluster when it is Ready (see
            // `NodeSignals::talos_ready`).
            if node_says_not_yet(&node.nodes, &node.name) {
                tracing::debug!(node = %node.address, "node running and ready, its Node not Ready yet: its Node will wake the cluster");
                return;
            }
            tracing::debug!(node = %node.address, "node running and ready: waking its cluster");
            wakes.wake(&cluster, &node.name)
        })
    };
    // What the watch says while it is open, recorded before the Node is read (see
    // `NodeSignals::talos_ready`).
    let says = |ready: Option<bool>| signals.talos_says(&node.name, ready);
    // This node answers again after it was away: when it is the control plane that relays, the
    // other nodes' watches, which broke with it and could not be opened through it meanwhile, can be
    // now, and their own Nodes will not say so.
    let answers_again = || signals.poke_all_but(&node.name);
    let _ = tokio::time::timeout(
        FOLLOW_AT_MOST,
        follow_machine_status(
            &node,
            flight.in_flight.load(Ordering::SeqCst),
            &poke,
            (&wake_up, &says),
            &answers_again,
        ),
    )
    .await;
    // Ended (given up): it speaks for the node no longer.
    says(None);
}

/// Watches the node's `MachineStatus`, keeping what it reports in the fleet's
/// [`crate::followed_statuses::FollowedStatuses`] and waking when the node turns running and ready.
///
/// A watch reports the current status first, then every change. "Ready" wakes the reconcile when it
/// is news: the node was seen not ready before (by this follower, or by the look that started it), or
/// it is the first status after the watch broke (the node may have rebooted and come back while it
/// was down). A follower started for a node already in flight wakes on its first status too if that
/// is ready: the node may have rebooted between the reconcile's look and the watch (a fast node), and
/// the reconcile woken for nothing asks the nodes in flight once.
///
/// A watch that breaks is opened again after [`RECONNECT_MIN`] (the relay rebooted under a node that
/// is up); while that fails (the node, or the relay, is away) the next attempt waits until the node's
/// Node says it may be back ([`NodeSignals::poke`]), or another node of the cluster answers again
/// after it was away (`answers_again`: the relay may be back), at most [`RECONNECT_AWAY`]. A watch
/// whose last status took the node down (upgrading, rebooting, shutting down, resetting) broke
/// because the node went away: it waits at once, without the quick attempt that would only fail.
/// So does one whose relay's watch last said that of the relay.
async fn follow_machine_status(
    node: &FollowedNode,
    started_in_flight: bool,
    poke: &Arc<Notify>,
    (wake_up, says): (&impl Fn(), &impl Fn(Option<bool>)),
    answers_again: &impl Fn(),
) {
    use resources::machine_status;
    let fleet = &node.talos;
    // A look that finds the node back before its watch is tells the follower through the poke.
    let _followed = fleet
        .followed_statuses()
        .followed_by(node.address, poke.clone());
    // What the reconcile that started the follower saw.
    let mut last_ready = match fleet.kept_looks().node(&node.name) {
        Some(TalosState::Up { ready, .. }) => Some(ready),
        _ => None,
    };
    // Whether a first status that says ready is news (see above).
    let mut first_ready_is_news = started_in_flight;
    // Whether the node (or its relay) was away since the watch last opened.
    let mut away = false;
    loop {
        // The boots the node was known to run before the watch opens: the watch speaks for those.
        let mut boots: Vec<String> = Vec::with_capacity(2);
        if let Some(TalosState::Up { boot_id, .. }) = fleet.kept_looks().node(&node.name) {
            boots.push(boot_id);
        }
        if let Some(boot_id) = node.nodes.node(&node.name).and_then(|seen| seen.boot_id)
            && !boots.contains(&boot_id)
        {
            boots.push(boot_id);
        }
        if let Some(boot_id) = fleet
            .followed_statuses()
            .take_boot_read_while_away(node.address)
            && !boots.contains(&boot_id)
        {
            boots.push(boot_id);
        }
        let opened = match fleet.client(node.address) {
            Ok(client) => {
                client
                    .cosi_watch::<MachineStatusSpec>(
                        machine_status::NAMESPACE,
                        machine_status::TYPE,
                        Some(machine_status::ID),
                        false,
                    )
                    .await
            }
            Err(error) => Err(error),
        };
        let pause = match opened {
            Ok(mut watch) => {
                if std::mem::take(&mut away) {
                    answers_again();
                }
                let followed = fleet.followed_statuses().opened(node.address, boots);
                let mut going_down = false;
                let mut first = true;
                while let Some(event) = watch.next().await {
                    let Ok(event) = event else {
                        // The watch breaks when the node reboots; open it again.
                        break;
                    };
                    if event.event_type == CosiEventType::Destroyed {
                        followed.saw(None);
                        continue;
                    }
                    let Some(resource) = event.resource else {
                        continue;
                    };
                    let status = resource.spec;
                    let ready = machine_status::is_running_and_ready(&status);
                    says(Some(ready));
                    if ready && (last_ready != Some(true) || (first && first_ready_is_news)) {
                        wake_up();
                    }
                    last_ready = Some(ready);
                    going_down = machine_status::takes_node_down(&status);
                    followed.saw(Some(status));
                    first = false;
                }
                says(None);
                let relay_going_down = fleet.relay().is_some_and(|relay| {
                    relay != node.address && fleet.followed_statuses().going_down(relay)
                });
                if going_down || relay_going_down {
                    // A poke that came while the watch was open (the Node watch's first list, a
                    // cordon) is not news of the node's return: it went down just now.
                    let _ = futures::FutureExt::now_or_never(poke.notified());
                    tracing::trace!(node = %node.address, relay_going_down, "machine status watch ended as the node or its relay went down: waiting for it");
                    away = true;
                    RECONNECT_AWAY
                } else {
                    RECONNECT_MIN
                }
            }
            Err(error) => {
                tracing::trace!(node = %node.address, %error, "machine status watch: waiting for its Node to change");
                away = true;
                RECONNECT_AWAY
            }
        };
        first_ready_is_news = true;
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = poke.notified() => {}
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Marks the watched Nodes unusable when the watch ends, however it ends (stopped, or given up).
struct StopsWatching(Arc<WatchedNodes>);

impl Drop for StopsWatching {
    fn drop(&mut self) {
        self.0.record(NodeChange::Stopped);
    }
}

/// How the followers watch a cluster's Nodes.
///
/// The watch's list (at its start, and after its version expired) is served from the API server's
/// watch cache (`resourceVersion=0`, `NotOlderThan`), as client-go's informers list. A consistent
/// list (no version) waits up to 3 s for that cache to catch up with etcd and then reads etcd
/// instead (k8s.io/apiserver v0.34 `pkg/storage/cacher`: `delegator.go` `GetList`, `watch_cache.go`
/// `blockTimeout`), where a label selector filters nothing: every Node the API server holds is read
/// and decoded to return this cluster's few. An API server too busy to keep its cache fresh thus
/// got the most expensive lists exactly when it could least afford them (docs/performance.md, "At
/// 5,000 nodes"). The list may be as old as the cache, and the watch's events bring it up to date;
/// a node's readiness for the upgrade is Talos's own (its `nodeReady` condition), asked before any
/// node starts.
fn node_watch_config() -> watcher::Config {
    let mut config = watcher::Config::default()
        // A renewal is a request to the workload API server; see the constant for why longer.
        .timeout(crate::read_cache::WATCH_TIMEOUT_SECS)
        .any_semantic();
    // Unpaged: kube leaves `resourceVersion=0` out of a list that has a limit (kube-core
    // `ListParams::populate_qp`), which would make it a consistent list again. The watch cache
    // ignores a limit at version 0 anyway.
    config.page_size = None;
    config
}

/// Watches every workload Node of a cluster until aborted (or [`FOLLOW_AT_MOST`]): keeps `nodes`
/// current for the reconciles, and wakes the cluster when a followed node becomes Ready, or is
/// uncordoned while Ready, compared with what was last seen of it (starting from what the reconcile
/// saw: a Node that became Ready before the watch started wakes it at once).
async fn watch_workload_nodes(
    workload: kube::Client,
    nodes: Arc<WatchedNodes>,
    followed: FollowedNodes,
    signals: SignalBoard,
    cluster: ObjectRef<KubernetesCluster>,
    wakes: Arc<FollowerWakes>,
) {
    let _stops = StopsWatching(nodes.clone());
    let api: Api<Node> = Api::all(workload);
    let changes =
        kube::runtime::WatchStreamExt::default_backoff(watcher::watcher(api, node_watch_config()));
    let watching = async {
        let mut changes = std::pin::pin!(changes);
        while let Some(event) = changes.next().await {
            let node = match event {
                Ok(watcher::Event::Init) => {
                    nodes.record(NodeChange::Relist);
                    continue;
                }
                Ok(watcher::Event::InitDone) => {
                    nodes.record(NodeChange::Listed);
                    continue;
                }
                Ok(watcher::Event::Delete(node)) => {
                    nodes.record(NodeChange::Deleted {
                        name: node.name_any(),
                    });
                    continue;
                }
                Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => node,
                Err(error) => {
                    tracing::trace!(%error, "workload node watch");
                    nodes.record(NodeChange::Broken);
                    continue;
                }
            };
            let name = node.name_any();
            let seen = SeenNode::of(&node);
            let state = (seen.ready, seen.cordoned);
            // Its kubelet reports a new boot, or it became Ready: the node may be back, its Talos
            // follower asks again now. Poked once the Node is recorded: the follower's watch takes
            // the boot id the kubelet reports for one it speaks for (`crate::followed_statuses`).
            let back = may_be_back(nodes.node(&name).as_ref(), &seen);
            nodes.record(NodeChange::Present {
                name: name.clone(),
                seen,
            });
            if back {
                signals.poke(&name);
            }
            let mut followed = followed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(last) = followed.get_mut(&name) {
                match node_news(*last, state, signals.talos_said(&name)) {
                    NodeNews::Wake => {
                        tracing::debug!(
                            node = name,
                            ?last,
                            ?state,
                            "workload node ready: waking its cluster"
                        );
                        wakes.wake(&cluster, &name);
                    }
                    NodeNews::TalosNotYet => tracing::debug!(
                        node = name,
                        "workload node ready, Talos not yet: its Talos follower will wake the cluster"
                    ),
                    NodeNews::Nothing => {}
                }
                *last = Some(state);
            }
        }
    };
    let _ = tokio::time::timeout(FOLLOW_AT_MOST, watching).await;
}

/// Whether a Node's change says its node may answer Talos again, for a follower waiting for it: its
/// kubelet reports a new boot id (the node booted again, and runs far enough for its kubelet), or
/// it became Ready. Being cordoned, or marked NotReady as it goes down (at once by the simulator,
/// after the node monitor's grace period by Kubernetes), says the node is away, not back: every
/// attempt woken by them would be a Talos call that fails. A Node never seen before (the watch
/// starts or relists) may be news: it pokes, at worst one attempt too early.
fn may_be_back(previous: Option<&SeenNode>, now: &SeenNode) -> bool {
    match previous {
        None => true,
        Some(previous) => {
            (now.ready && !previous.ready)
                || (now.boot_id.is_some() && now.boot_id != previous.boot_id)
        }
    }
}

/// What the Node watch does with a change of a node in flight's Node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeNews {
    /// It may move the upgrade on: wake the cluster.
    Wake,
    /// It would, but the node's Talos watch says Talos is not running and ready yet: the reconcile
    /// would find the node still waiting, and that follower wakes the cluster when it is (see
    /// [`NodeSignals::talos_ready`]).
    TalosNotYet,
    /// It cannot move the upgrade on ([`worth_a_look`]).
    Nothing,
}

/// [`NodeNews`] for a Node going from `last` to `now` (each (Ready, cordoned)), with what the node's
/// open Talos watch last said (`None`: none is open).
fn node_news(last: Option<(bool, bool)>, now: (bool, bool), talos_says: Option<bool>) -> NodeNews {
    match (worth_a_look(last, now), talos_says) {
        (false, _) => NodeNews::Nothing,
        (true, Some(false)) => NodeNews::TalosNotYet,
        (true, Some(true) | None) => NodeNews::Wake,
    }
}

/// Whether a Node going from `last` to `now` (each (Ready, cordoned)) can move the upgrade on: it
/// became Ready, or was uncordoned while Ready. Going down, being cordoned and being uncordoned while
/// still NotReady cannot: the node in flight is only done once it is Ready, and every reconcile woken
/// by them would find nothing to do (under load, each costs the API server a handful of requests).
fn worth_a_look(last: Option<(bool, bool)>, now: (bool, bool)) -> bool {
    let (ready, cordoned) = now;
    match last {
        None => ready,
        Some((was_ready, was_cordoned)) => ready && (!was_ready || (was_cordoned && !cordoned)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn the_node_watch_lists_from_the_api_servers_watch_cache() {
        let config = node_watch_config();
        assert_eq!(config.list_semantic, watcher::ListSemantic::Any);
        assert_eq!(config.page_size, None, "a limit would drop the version");
        // The query kube sends for a list from the cache with the watch's page size, and with
        // kube's default one.
        let query = |limit: Option<u32>| {
            let params = kube::api::ListParams {
                resource_version: Some("0".to_string()),
                version_match: Some(kube::api::VersionMatch::NotOlderThan),
                limit,
                ..Default::default()
            };
            kube::core::Request::new("/api/v1/nodes")
                .list(&params)
                .expect("a list request")
                .uri()
                .to_string()
        };
        // Unpaged, it carries the version, which makes the API server answer from its watch cache
        // instead of etcd.
        let unpaged = query(config.page_size);
        assert!(
            unpaged.contains("resourceVersion=0")
                && unpaged.contains("resourceVersionMatch=NotOlderThan"),
            "{unpaged}"
        );
        let paged = query(Some(500));
        assert!(
            !paged.contains("resourceVersion="),
            "kube drops the version from a paged list, so the page size must stay unset: {paged}"
        );
    }

    /// The next wake-up already sent, if any.
    fn sent(
        triggers: &mut (impl Stream<Item = ObjectRef<KubernetesCluster>> + Unpin),
    ) -> Option<ObjectRef<KubernetesCluster>> {
        futures::FutureExt::now_or_never(triggers.next()).flatten()
    }

    /// Marks `nodes` of `cluster` followed (by followers that do nothing), each in flight or not.
    fn followed(wakeups: &Wakeups, cluster: &ObjectRef<KubernetesCluster>, nodes: &[(&str, bool)]) {
        let mut followed = wakeups.followed.lock().expect("followed");
        let current = followed.entry(cluster.clone()).or_default();
        current.talos = nodes
            .iter()
            .map(|(node, in_flight)| {
                let task = tokio::spawn(std::future::pending::<()>());
                (
                    node.to_string(),
                    TalosFollower {
                        _task: Follower(task.abort_handle()),
                        flight: Arc::new(Flight {
                            in_flight: AtomicBool::new(*in_flight),
                            back_at: Mutex::new(None),
                        }),
                    },
                )
            })
            .collect();
    }

    #[tokio::test]
    async fn a_wake_up_during_a_reconcile_goes_out_after_it_only_for_a_node_still_followed() {
        let wakeups = Wakeups::default();
        let mut triggers = Box::pin(wakeups.triggers());
        let cluster = ObjectRef::new("c1").within("ns");
        let other = ObjectRef::new("c2").within("ns");
        followed(&wakeups, &cluster, &[("w1", true), ("w2", true)]);

        // No reconcile running: at once.
        wakeups.wakes.wake(&cluster, "w1");
        assert_eq!(sent(&mut triggers), Some(cluster.clone()));
        assert_eq!(sent(&mut triggers), None);

        // During a reconcile that goes on following the node: once, after it ends.
        let reconciling = wakeups.reconciling(&cluster);
        wakeups.wakes.wake(&cluster, "w1");
        wakeups.wakes.wake(&cluster, "w2");
        // Another cluster's is not held.
        wakeups.wakes.wake(&other, "x1");
        assert_eq!(sent(&mut triggers), Some(other.clone()));
        assert_eq!(sent(&mut triggers), None, "held during the reconcile");
        drop(reconciling);
        assert_eq!(sent(&mut triggers), Some(cluster.clone()));
        assert_eq!(sent(&mut triggers), None, "one wake-up for both");

        // During a reconcile that saw the node done (it follows the next one, or none): dropped.
        let reconciling = wakeups.reconciling(&cluster);
        wakeups.wakes.wake(&cluster, "w1");
        followed(&wakeups, &cluster, &["w2"].map(|node| (node, true)));
        drop(reconciling);
        assert_eq!(sent(&mut triggers), None, "w1 no longer followed");

        // ... or that saw it done and follows it on for its machine status only: dropped too.
        let reconciling = wakeups.reconciling(&cluster);
        wakeups.wakes.wake(&cluster, "w1");
        followed(&wakeups, &cluster, &[("w1", false), ("w2", true)]);
        drop(reconciling);
        assert_eq!(sent(&mut triggers), None, "w1 no longer in flight");

        let reconciling = wakeups.reconciling(&cluster);
        wakeups.wakes.wake(&cluster, "w2");
        wakeups.follow(&cluster, Vec::new());
        drop(reconciling);
        assert_eq!(sent(&mut triggers), None, "the run ended");

        // A reconcile during which nothing woke it sends nothing; afterwards wake-ups go out at once.
        drop(wakeups.reconciling(&cluster));
        assert_eq!(sent(&mut triggers), None);
        wakeups.wakes.wake(&cluster, "w2");
        assert_eq!(sent(&mut triggers), Some(cluster));
    }

    #[test]
    fn a_node_back_before_it_is_marked_in_flight_wakes_its_cluster_once_it_is() {
        let woken = std::cell::Cell::new(0);
        let wake = || woken.set(woken.get() + 1);

        // Not in flight: a return is recorded, nothing woken.
        let flight = Flight::default();
        let looked_at = Instant::now();
        flight.came_back(wake);
        assert_eq!(woken.get(), 0);
        // The reconcile that looked before that return marks it in flight: news.
        assert!(flight.put_in_flight(true, looked_at));
        // Already in flight: the next reconcile's marking is not news again; returns wake at once.
        assert!(!flight.put_in_flight(true, Instant::now()));
        flight.came_back(wake);
        assert_eq!(woken.get(), 1);

        // A return before the reconcile's look is what that look saw: not news.
        let flight = Flight::default();
        flight.came_back(wake);
        let looked_at = Instant::now();
        assert!(!flight.put_in_flight(true, looked_at));
        // Let go of (done): a later return does not wake.
        assert!(!flight.put_in_flight(false, Instant::now()));
        flight.came_back(wake);
        assert_eq!(woken.get(), 1);
    }

    async fn eventually(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !condition() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A simulated cluster (a control plane and a worker `w-1`), its fleet with counted calls, and
    /// `w-1` as a followed node.
    async fn one_worker(
        name: &str,
        timings: talos_sim::config::Timings,
        in_flight: bool,
    ) -> (
        talos_sim::Simulator,
        FollowedNode,
        crate::talos_fleet::counted::Calls,
    ) {
        use talos_sim::config::{NodeConfig, SimConfig};
        let sim = talos_sim::Simulator::start(
            SimConfig::new(name)
                .with_timings(timings)
                .with_node(NodeConfig::control_plane("cp-1", "1.11.6", "1.34.1"))
                .with_node(NodeConfig::worker("w-1", "1.11.6", "1.34.1")),
        )
        .await
        .expect("simulator");
        let (fleet, calls) = crate::talos_fleet::counted::fleet_for(&sim);
        let worker = sim.nodes().into_iter().find(|node| node.name == "w-1");
        let address = IpAddr::V4(worker.expect("w-1").address);
        // Never asked: the follower's watch makes no request to it.
        let workload = kube::Client::try_from(kube::Config::new(
            "http://127.0.0.1:9".parse().expect("an address"),
        ))
        .expect("a client");
        let node = FollowedNode {
            name: "w-1".to_string(),
            talos: Arc::new(fleet),
            address,
            in_flight,
            workload,
            observed_at: Instant::now(),
            nodes: Arc::new(WatchedNodes::default()),
            seen: None,
        };
        (sim, node, calls)
    }

    /// `w-1` as the inventory has it.
    fn worker(node: &FollowedNode) -> crate::inventory::InventoryNode {
        crate::inventory::InventoryNode {
            role: talos_upgrade_core::run::NodeRole::Worker,
            name: node.name.clone(),
            address: node.address,
            held: false,
        }
    }

    /// The reconcile's look at `w-1` that the follower starts from.
    async fn looked_at(node: &FollowedNode) -> TalosState {
        let worker = worker(node);
        let state = node.talos.observe_node(&worker).await;
        node.talos.kept_looks().keep_nodes([(&worker, &state)]);
        state
    }

    /// Reboots `w-1` and waits until the simulator has it back, running and ready.
    async fn reboot_and_wait_until_back(sim: &talos_sim::Simulator, node: &FollowedNode) {
        node.talos
            .client(node.address)
            .expect("client")
            .reboot(talos_api::RebootMode::Default)
            .await
            .expect("reboot");
        sim.wait_for("w-1", Duration::from_secs(20), |node| node.down)
            .await
            .expect("the node goes down");
        sim.wait_for("w-1", Duration::from_secs(20), |node| {
            !node.down && node.ready
        })
        .await
        .expect("the node is back and ready");
    }

    fn count(calls: &crate::talos_fleet::counted::Calls, method: &str, ok: bool) -> usize {
        calls
            .lock()
            .unwrap()
            .iter()
            .filter(|(called, code)| *called == method && (*code == "OK") == ok)
            .count()
    }

    /// A follower whose watch saw its node go down (the reboot's machine status) asks Talos nothing
    /// while the node is away, not even the quick retry a relay's reboot calls for, until the node's
    /// Node says it is back: a reboot costs no failing call, however long it lasts. Poked, it opens
    /// the watch again, whose first status (running and ready) wakes the cluster.
    #[tokio::test]
    async fn a_follower_whose_node_goes_down_asks_nothing_until_its_node_says_it_is_back() {
        use std::sync::atomic::AtomicUsize;

        // Down long enough for a quick retry (0.2 s), or the retries before `db39ebc` (0.2 s,
        // doubling), to fail while it is away.
        let timings = talos_sim::config::Timings {
            reboot_ms: 1500,
            ..talos_sim::config::Timings::fast()
        };
        let (sim, node, calls) = one_worker("follower-pokes", timings, true).await;
        let watches = |ok: bool| count(&calls, "COSI Watch", ok);
        assert!(matches!(
            looked_at(&node).await,
            TalosState::Up { ready: true, .. }
        ));
        let poke = Arc::new(Notify::new());
        let woken = Arc::new(AtomicUsize::new(0));
        let follower = {
            let (node, poke, woken) = (node.clone(), poke.clone(), woken.clone());
            tokio::spawn(async move {
                let wake_up = || {
                    woken.fetch_add(1, Ordering::SeqCst);
                };
                follow_machine_status(&node, false, &poke, (&wake_up, &|_| {}), &|| {}).await;
            })
        };
        eventually("the watch opened", || {
            node.talos.followed_statuses().follows(node.address)
        })
        .await;
        assert_eq!(woken.load(Ordering::SeqCst), 0, "ready as it was looked at");
        // The cluster's Node watch starts after the follower and pokes on its first list: not news
        // of a return the follower should act on once its node goes down.
        poke.notify_one();

        reboot_and_wait_until_back(&sim, &node).await;
        assert_eq!(
            (watches(true), watches(false)),
            (1, 0),
            "the watch said the node was rebooting: no attempt while it was away, none after it \
             until its Node says it is back"
        );
        assert!(
            !node.talos.followed_statuses().follows(node.address),
            "a watch that ended speaks for nothing"
        );
        assert_eq!(woken.load(Ordering::SeqCst), 0);

        // Its Node says it is back (the cluster's Node watch pokes the follower): it watches again,
        // and the status it reports first says the node is running and ready.
        poke.notify_one();
        eventually("watching again", || watches(true) == 2).await;
        eventually("the cluster woken", || woken.load(Ordering::SeqCst) == 1).await;
        assert_eq!(watches(false), 0);
        follower.abort();
    }

    /// A look that finds a followed node back from its reboot before its follower has watched it
    /// again (its kubelet's Node has not said so yet) tells the follower, which opens the watch at
    /// once, and takes the new boot's status from it: the boot id is read, the `MachineStatus` is
    /// not, and the node is seen as it is (its new boot, running and ready).
    #[tokio::test]
    async fn a_look_at_a_node_back_before_its_watch_takes_the_status_from_the_watch_it_reopens() {
        let (sim, node, calls) =
            one_worker("follower-back", talos_sim::config::Timings::fast(), true).await;
        let worker = worker(&node);
        let TalosState::Up {
            boot_id: before, ..
        } = looked_at(&node).await
        else {
            panic!("the node is up");
        };
        let follower = quiet_follower(&node, true);
        eventually("the watch opened", || {
            node.talos.followed_statuses().follows(node.address)
        })
        .await;
        reboot_and_wait_until_back(&sim, &node).await;
        assert!(
            node.talos.followed_statuses().awaited(node.address),
            "the follower waits for the node's Node to say it is back"
        );
        let gets = count(&calls, "COSI Get", true);

        let look = node.talos.observe_node(&worker).await;
        let TalosState::Up { boot_id, ready, .. } = look else {
            panic!("the node is back: {look:?}");
        };
        assert_ne!(boot_id, before, "a new boot");
        assert!(ready, "running and ready, as its watch reports");
        assert_eq!(
            (
                count(&calls, "COSI Get", true),
                count(&calls, "COSI Watch", true)
            ),
            (gets, 2),
            "the status came from the watch the follower opened again, not from a read"
        );
        follower.abort();
        drop(sim);
    }

    /// A follower of `node` whose wake-ups and readiness go nowhere, started for a node in flight or
    /// not.
    fn quiet_follower(node: &FollowedNode, in_flight: bool) -> tokio::task::JoinHandle<()> {
        let node = node.clone();
        tokio::spawn(async move {
            follow_machine_status(
                &node,
                in_flight,
                &Arc::new(Notify::new()),
                (&|| {}, &|_| {}),
                &|| {},
            )
            .await;
        })
    }

    /// A follower of `node` (not in flight), once its watch has reported the node's status.
    async fn following(node: &FollowedNode) -> tokio::task::JoinHandle<()> {
        let follower = quiet_follower(node, false);
        eventually("the watch reported", || {
            node.talos.followed_statuses().follows(node.address)
        })
        .await;
        follower
    }

    /// A look at a followed node takes its readiness from the watch, for the boot the watch speaks
    /// for: the boot id is still read, the `MachineStatus` is not. A node the watch does not speak
    /// for (it rebooted since the boot the follower knew) is asked, and so is every node once the
    /// follower is gone.
    #[tokio::test]
    async fn a_look_takes_a_followed_nodes_status_from_its_watch_for_the_boot_it_knows() {
        let (sim, node, calls) =
            one_worker("follower-looks", talos_sim::config::Timings::fast(), false).await;
        let worker = worker(&node);
        let fleet = node.talos.clone();
        let look = || async { fleet.observe_node(&worker).await };

        // The reconcile's own look, before anything is followed.
        let state = looked_at(&node).await;
        assert_eq!(count(&calls, "COSI Get", true), 1);

        let follower = following(&node).await;
        let again = look().await;
        assert_eq!(again, state, "the same node, as the watch says");
        assert_eq!(
            (count(&calls, "COSI Get", true), count(&calls, "Read", true)),
            (1, 2),
            "the boot id read again, the status taken from the watch"
        );

        // A boot the watch was not opened in (it knew only the one the look kept): asked.
        fleet.kept_looks().keep_nodes([(
            &worker,
            &TalosState::Up {
                version: semver::Version::new(1, 11, 6),
                boot_id: "another-boot".into(),
                ready: true,
                install: None,
            },
        )]);
        follower.abort();
        eventually("the watch gone", || {
            !fleet.followed_statuses().follows(node.address)
        })
        .await;
        let follower = following(&node).await;
        assert_eq!(look().await, state);
        assert_eq!(
            count(&calls, "COSI Get", true),
            2,
            "asked: the watch knew another boot"
        );

        // No follower: asked.
        follower.abort();
        eventually("the watch gone", || {
            !fleet.followed_statuses().follows(node.address)
        })
        .await;
        assert_eq!(look().await, state);
        assert_eq!(count(&calls, "COSI Get", true), 3);
        drop(sim);
    }

    #[test]
    fn only_a_new_boot_or_a_node_turning_ready_pokes_a_waiting_follower() {
        let node = |ready: bool, cordoned: bool, boot: Option<&str>| SeenNode {
            ready,
            cordoned,
            boot_id: boot.map(str::to_string),
            info: None,
        };
        let up = node(true, false, Some("boot-1"));
        // (previous, now, poke?)
        let cases = [
            // Never seen: may be news.
            (None, node(false, false, Some("boot-1")), true),
            // Going away: cordoned, then NotReady on the same boot.
            (Some(up.clone()), node(true, true, Some("boot-1")), false),
            (
                Some(node(true, true, Some("boot-1"))),
                node(false, true, Some("boot-1")),
                false,
            ),
            // Uncordoned while still away.
            (
                Some(node(false, true, Some("boot-1"))),
                node(false, false, Some("boot-1")),
                false,
            ),
            // Its kubelet is back on a new boot, Ready or not yet.
            (
                Some(node(false, true, Some("boot-1"))),
                node(false, true, Some("boot-2")),
                true,
            ),
            (
                Some(node(false, true, Some("boot-1"))),
                node(true, true, Some("boot-2")),
                true,
            ),
            // Ready again on the boot already seen (a kubelet restart, a network blip).
            (
                Some(node(false, false, Some("boot-2"))),
                node(true, false, Some("boot-2")),
                true,
            ),
            // A kubelet that reports no boot id says nothing by it.
            (
                Some(node(false, false, Some("boot-1"))),
                node(false, false, None),
                false,
            ),
            (Some(up.clone()), up.clone(), false),
        ];
        for (previous, now, poke) in cases {
            assert_eq!(
                may_be_back(previous.as_ref(), &now),
                poke,
                "{previous:?} -> {now:?}"
            );
        }
    }

    #[test]
    fn only_a_node_becoming_ready_or_schedulable_wakes_the_cluster() {
        // (last (Ready, cordoned), now, wake?)
        let cases = [
            (None, (true, false), true),
            (None, (false, false), false),
            (Some((true, false)), (true, false), false),
            // Talos cordons it, it goes down, Talos uncordons it while it boots: nothing to do yet.
            (Some((true, false)), (true, true), false),
            (Some((true, true)), (false, true), false),
            (Some((false, true)), (false, false), false),
            // Back and Ready, cordoned or not.
            (Some((false, false)), (true, false), true),
            (Some((false, true)), (true, true), true),
            // Uncordoned once Ready (the controller's own uncordon after a Talos >= 1.13 reboot).
            (Some((true, true)), (true, false), true),
        ];
        for (last, now, wake) in cases {
            assert_eq!(worth_a_look(last, now), wake, "{last:?} -> {now:?}");
        }
    }

    #[test]
    fn a_node_turning_ready_leaves_the_wake_up_to_talos_only_when_its_open_watch_says_not_yet() {
        // (last (Ready, cordoned), now, what the node's open Talos watch last said, news)
        let cases = [
            // Back and Ready, Talos running and ready too, or no Talos watch open: wake.
            (
                Some((false, false)),
                (true, false),
                Some(true),
                NodeNews::Wake,
            ),
            (Some((false, false)), (true, false), None, NodeNews::Wake),
            // Talos not yet: its follower wakes the cluster when it is.
            (
                Some((false, false)),
                (true, false),
                Some(false),
                NodeNews::TalosNotYet,
            ),
            (
                Some((true, true)),
                (true, false),
                Some(false),
                NodeNews::TalosNotYet,
            ),
            // Nothing to look at, whatever Talos says.
            (
                Some((true, false)),
                (false, false),
                Some(true),
                NodeNews::Nothing,
            ),
            (Some((true, false)), (true, false), None, NodeNews::Nothing),
        ];
        for (last, now, talos_says, news) in cases {
            assert_eq!(
                node_news(last, now, talos_says),
                news,
                "{last:?} -> {now:?}, Talos {talos_says:?}"
            );
        }
    }

    /// Sets what the cluster's Node watch says of `node`'s Node: Ready or NotReady (a synced view
    /// holding it), or nothing (`None`: the watch stopped).
    fn node_watch_says(node: &FollowedNode, ready: Option<bool>) {
        let Some(ready) = ready else {
            node.nodes.record(NodeChange::Stopped);
            return;
        };
        node.nodes.record(NodeChange::Relist);
        node.nodes.record(NodeChange::Present {
            name: node.name.clone(),
            seen: SeenNode {
                ready,
                cordoned: false,
                boot_id: None,
                info: None,
            },
        });
        node.nodes.record(NodeChange::Listed);
    }

    /// The Talos half of "both say it is back": a follower whose node is in flight and running and
    /// ready says so for the Node watch to read, and wakes the cluster only when the node's Node
    /// (as the cluster's Node watch last saw it) is not NotReady: otherwise the Node's turning
    /// Ready wakes it, and a reconcile now would find the node still waiting.
    #[tokio::test]
    async fn a_node_ready_in_talos_wakes_its_cluster_only_when_its_node_is_not_not_ready() {
        let (sim, node, _calls) =
            one_worker("follower-both", talos_sim::config::Timings::fast(), true).await;
        looked_at(&node).await;
        let wakeups = Wakeups::default();
        let mut triggers = Box::pin(wakeups.triggers());
        let cluster = ObjectRef::new("c1").within("ns");
        // Started for a node in flight, its first status (running and ready) is news (see
        // `follow_machine_status`).
        let follow = |signals: &SignalBoard| {
            let flight = Arc::new(Flight::default());
            flight.put_in_flight(true, Instant::now());
            tokio::spawn(follow_node(
                cluster.clone(),
                node.clone(),
                flight,
                signals.add(&node.name),
                signals.clone(),
                wakeups.wakes.clone(),
            ))
        };
        let says = |signals: &SignalBoard| signals.talos_said(&node.name);

        // Its Node is NotReady: said, not woken.
        node_watch_says(&node, Some(false));
        let signals = SignalBoard::default();
        let follower = follow(&signals);
        eventually("the watch said ready", || says(&signals) == Some(true)).await;
        // (The test's runtime has one thread, and the follower says it and decides without a pause
        // between: had it woken the cluster, the wake-up would be sent by now.)
        assert_eq!(sent(&mut triggers), None, "its Node wakes the cluster");
        follower.abort();

        // Its Node is Ready, or the Node watch knows nothing (not synced): woken.
        for ready in [Some(true), None] {
            node_watch_says(&node, ready);
            let signals = SignalBoard::default();
            let follower = follow(&signals);
            eventually("the watch said ready", || says(&signals) == Some(true)).await;
            let woken = tokio::time::timeout(Duration::from_secs(20), triggers.next()).await;
            assert_eq!(
                woken.ok().flatten(),
                Some(cluster.clone()),
                "woken ({ready:?})"
            );
            follower.abort();
        }
        drop(sim);
    }

    /// The same rule for a node whose Talos said it was back before the reconcile that sent its
    /// upgrade marked it in flight (a fast node): that reconcile's marking wakes the cluster, unless
    /// the node's Node (as the cluster's Node watch last saw it) is NotReady; its turning Ready does
    /// then (`node_news`).
    #[tokio::test]
    async fn a_node_back_before_it_is_marked_in_flight_wakes_its_cluster_only_when_its_node_is_not_not_ready()
     {
        let (sim, node, _calls) =
            one_worker("follower-early", talos_sim::config::Timings::fast(), false).await;
        let wakeups = Wakeups::default();
        let mut triggers = Box::pin(wakeups.triggers());
        let cluster = ObjectRef::new("c1").within("ns");
        for (node_ready, woken) in [(Some(false), false), (Some(true), true), (None, true)] {
            // Followed and not in flight; its Talos came back after the reconcile's look.
            followed(&wakeups, &cluster, &[(&node.name, false)]);
            let looked_at = Instant::now()
                .checked_sub(Duration::from_millis(10))
                .expect("an instant");
            let flight = wakeups.followed.lock().expect("followed")[&cluster].talos[&node.name]
                .flight
                .clone();
            flight.came_back(|| panic!("not in flight: nothing to wake"));
            node_watch_says(&node, node_ready);
            // The reconcile that looked before the return marks it in flight (it saw the Node
            // Ready before the reboot).
            wakeups.follow(
                &cluster,
                vec![FollowedNode {
                    in_flight: true,
                    observed_at: looked_at,
                    seen: Some((true, false)),
                    ..node.clone()
                }],
            );
            assert_eq!(
                sent(&mut triggers),
                woken.then(|| cluster.clone()),
                "its Node Ready: {node_ready:?}"
            );
            assert_eq!(sent(&mut triggers), None, "once");
            wakeups.follow(&cluster, Vec::new());
        }
        drop(sim);
    }
}
