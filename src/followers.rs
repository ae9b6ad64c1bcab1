//! Waking a cluster's reconcile the moment a node in flight changes, instead of at the next poll.
//!
//! While a node is being upgraded, the controller has nothing to do until the node is back: running its
//! new version, Talos-ready and Kubernetes-Ready. Polling finds that out up to a poll interval late, on
//! every node, which adds up over a rolling upgrade. So for every node in flight the controller follows
//! two streams and wakes the cluster's reconcile when one of them says something changed:
//!
//! - the node's Talos runtime events (`MachineService.Events`): a `MachineStatusEvent` saying it is
//!   running and ready;
//! - the node's Kubernetes `Node` in the workload cluster: it became `Ready`, or was uncordoned while
//!   Ready. One watch of all the cluster's Nodes serves every node in flight, and while it runs the
//!   reconciles take the Nodes from it ([`WatchedNodes`]) instead of listing them each time.
//!
//! Only changes that can move the upgrade on wake it, and only those after the reconcile that started
//! the follower looked at the node: every wake-up costs a reconcile, and a reconcile that finds
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
use talos_api::EventsOptions;
use talos_upgrade_core::crd::KubernetesCluster;

/// Pause before reconnecting to a node's event stream that broke: a stream also breaks when the
/// control plane relaying it reboots while the node itself is up, and then it is back at once.
const RECONNECT_MIN: Duration = Duration::from_millis(200);
/// Pause after an attempt that failed: the node is away (rebooting; it takes a minute or more to
/// come back), and every attempt meanwhile is a Talos call that fails. The node's Node tells when
/// it is back (its kubelet writes it, with the new boot id, as soon as it runs again, before Talos
/// reports the node ready), and that cuts the pause short ([`NodePokes`]); the pause is only the
/// safety net, half the reconcile's own while every node in flight is followed
/// (`FOLLOWED_POLL_INTERVAL`, which relies on it). A reconnection replays every event since the node
/// booted, so a node that became ready meanwhile is not missed.
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
    pub workload: kube::Client,
    /// Where the watch of the cluster's Nodes puts what it sees (the connections' own, see
    /// [`crate::cluster_access::ClusterLink`]).
    pub nodes: Arc<WatchedNodes>,
    /// When the reconcile that starts the follower asked the node: what the node did before is known
    /// to it, so only what happened since wakes it again.
    pub observed_at: Instant,
    /// The workload Node's (Ready, cordoned) as that reconcile saw it; `None` if it saw no Node.
    pub seen: Option<(bool, bool)>,
}

/// Aborts its task when dropped, so forgetting a follower stops it.
struct Follower(AbortHandle);

impl Drop for Follower {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The nodes in flight of one cluster whose Node is followed: name → (Ready, cordoned) as last seen
/// (`None`: no Node seen yet).
type FollowedNodes = Arc<Mutex<HashMap<String, Option<(bool, bool)>>>>;

/// Each followed node's Talos follower, told by the cluster's Node watch that the node's Node says it
/// may be back ([`may_be_back`]): while the node is away, its follower does not ask Talos again until
/// then (or [`RECONNECT_AWAY`]). A poke that comes while the follower is not waiting is kept for its
/// next wait (`Notify::notify_one`), unless it came while the stream was open and the stream then
/// ended with the node going down (it was not news of the node's return): at worst one attempt too
/// early, never one that matters missed.
type NodePokes = Arc<Mutex<HashMap<String, Arc<Notify>>>>;

/// The watch of one cluster's workload Nodes.
struct NodeWatch {
    nodes: Arc<WatchedNodes>,
    followed: FollowedNodes,
    task: Follower,
}

/// What follows one cluster: a Talos event follower per node in flight, and one Node watch.
#[derive(Default)]
struct ClusterFollowers {
    talos: HashMap<String, Follower>,
    pokes: NodePokes,
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
            followed
                .get(&self.cluster)
                .is_some_and(|current| held.iter().any(|node| current.talos.contains_key(node)))
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
    /// let go. An empty list stops following the cluster.
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
        lock(&current.pokes).retain(|name, _| nodes.iter().any(|node| &node.name == name));
        for node in &nodes {
            if current.talos.contains_key(&node.name) {
                continue;
            }
            let poke = Arc::new(Notify::new());
            lock(&current.pokes).insert(node.name.clone(), poke.clone());
            let task = tokio::spawn(follow_node(
                cluster.clone(),
                node.name.clone(),
                node.talos.clone(),
                node.address,
                node.observed_at,
                poke,
                self.wakes.clone(),
            ));
            current
                .talos
                .insert(node.name.clone(), Follower(task.abort_handle()));
        }
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
                    nodes
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
                    current.pokes.clone(),
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
            followed.retain(|name, _| nodes.iter().any(|node| &node.name == name));
            for node in &nodes {
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
        }
        current.nodes = Some(watch);
    }
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

/// Follows one node's Talos events until aborted (or [`FOLLOW_AT_MOST`]), sending `cluster` on every
/// change.
async fn follow_node(
    cluster: ObjectRef<KubernetesCluster>,
    name: String,
    talos: Arc<TalosFleet>,
    address: IpAddr,
    observed_at: Instant,
    poke: Arc<Notify>,
    wakes: Arc<FollowerWakes>,
) {
    let wake_up = || wakes.wake(&cluster, &name);
    let _ = tokio::time::timeout(
        FOLLOW_AT_MOST,
        follow_talos_events(&talos, address, observed_at, &poke, &wake_up),
    )
    .await;
}

/// Wakes when the node reports itself running and ready.
///
/// The first connection replays the events since the reconcile asked the node (rounded up to whole
/// seconds, the protocol's unit), not the whole boot: the node was running and ready when it booted,
/// long before its upgrade, and replaying that would wake a reconcile that finds nothing new, for
/// every node. Every reconnection (the stream breaks when the node reboots) replays everything the
/// node buffered since it booted, so a node that became ready while the stream was down is not missed.
///
/// A stream that breaks is reconnected after [`RECONNECT_MIN`] (the relay rebooted under a node that
/// is up); while that fails (the node is away) the next attempt waits until the node's Node says it
/// may be back ([`NodePokes`]), at most [`RECONNECT_AWAY`]. A stream whose last machine status took
/// the node down (upgrading, rebooting, shutting down, resetting) broke because the node went away:
/// it waits for the Node at once, without the quick attempt that would only fail.
async fn follow_talos_events(
    fleet: &TalosFleet,
    address: IpAddr,
    observed_at: Instant,
    poke: &Notify,
    wake_up: &impl Fn(),
) {
    let since_observed = EventsOptions {
        tail_seconds: Some(
            u32::try_from(observed_at.elapsed().as_secs())
                .unwrap_or(u32::MAX)
                .saturating_add(1),
        ),
        ..EventsOptions::default()
    };
    let since_boot = EventsOptions {
        tail_events: -1,
        ..EventsOptions::default()
    };
    let mut options = since_observed;
    loop {
        let opened = match fleet.client(address) {
            Ok(client) => client.events(options.clone()).await,
            Err(error) => Err(error),
        };
        options = since_boot.clone();
        let pause = match opened {
            Ok(mut events) => {
                let mut going_down = false;
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) => {
                            if event.payload.is_running_and_ready() {
                                tracing::debug!(node = %address, "node running and ready: waking its cluster");
                                wake_up()
                            }
                            going_down = event.payload.going_down().unwrap_or(going_down);
                        }
                        // The stream breaks when the node reboots; connect again.
                        Err(_) => break,
                    }
                }
                if going_down {
                    // A poke that came while the stream was open (the Node watch's first list, a
                    // cordon) is not news of the node's return: it went down just now.
                    let _ = futures::FutureExt::now_or_never(poke.notified());
                    tracing::trace!(node = %address, "node event stream ended as the node went down: waiting for its Node");
                    RECONNECT_AWAY
                } else {
                    RECONNECT_MIN
                }
            }
            Err(error) => {
                tracing::trace!(node = %address, %error, "node event stream: waiting for its Node to change");
                RECONNECT_AWAY
            }
        };
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

/// Watches every workload Node of a cluster until aborted (or [`FOLLOW_AT_MOST`]): keeps `nodes`
/// current for the reconciles, and wakes the cluster when a followed node becomes Ready, or is
/// uncordoned while Ready, compared with what was last seen of it (starting from what the reconcile
/// saw: a Node that became Ready before the watch started wakes it at once).
async fn watch_workload_nodes(
    workload: kube::Client,
    nodes: Arc<WatchedNodes>,
    followed: FollowedNodes,
    pokes: NodePokes,
    cluster: ObjectRef<KubernetesCluster>,
    wakes: Arc<FollowerWakes>,
) {
    let _stops = StopsWatching(nodes.clone());
    let api: Api<Node> = Api::all(workload);
    let changes = kube::runtime::WatchStreamExt::default_backoff(watcher::watcher(
        api,
        // A renewal is a request to the workload API server; see the constant for why longer.
        watcher::Config::default().timeout(crate::read_cache::WATCH_TIMEOUT_SECS),
    ));
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
            // follower asks again now.
            if may_be_back(nodes.node(&name).as_ref(), &seen)
                && let Some(poke) = lock(&pokes).get(&name)
            {
                poke.notify_one();
            }
            nodes.record(NodeChange::Present {
                name: name.clone(),
                seen,
            });
            let mut followed = followed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(last) = followed.get_mut(&name) {
                if worth_a_look(*last, state) {
                    tracing::debug!(
                        node = name,
                        ?last,
                        ?state,
                        "workload node ready: waking its cluster"
                    );
                    wakes.wake(&cluster, &name);
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

    /// The next wake-up already sent, if any.
    fn sent(
        triggers: &mut (impl Stream<Item = ObjectRef<KubernetesCluster>> + Unpin),
    ) -> Option<ObjectRef<KubernetesCluster>> {
        futures::FutureExt::now_or_never(triggers.next()).flatten()
    }

    /// Marks `nodes` of `cluster` followed (by followers that do nothing).
    fn followed(wakeups: &Wakeups, cluster: &ObjectRef<KubernetesCluster>, nodes: &[&str]) {
        let mut followed = wakeups.followed.lock().expect("followed");
        let current = followed.entry(cluster.clone()).or_default();
        current.talos = nodes
            .iter()
            .map(|node| {
                let task = tokio::spawn(std::future::pending::<()>());
                (node.to_string(), Follower(task.abort_handle()))
            })
            .collect();
    }

    #[tokio::test]
    async fn a_wake_up_during_a_reconcile_goes_out_after_it_only_for_a_node_still_followed() {
        let wakeups = Wakeups::default();
        let mut triggers = Box::pin(wakeups.triggers());
        let cluster = ObjectRef::new("c1").within("ns");
        let other = ObjectRef::new("c2").within("ns");
        followed(&wakeups, &cluster, &["w1", "w2"]);

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
        followed(&wakeups, &cluster, &["w2"]);
        drop(reconciling);
        assert_eq!(sent(&mut triggers), None, "w1 no longer followed");

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

    async fn eventually(what: &str, condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !condition() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A follower whose stream saw its node go down (the reboot's machine status) asks Talos nothing
    /// while the node is away, not even the quick retry a relay's reboot calls for, until the node's
    /// Node says it is back: a reboot costs no failing call, however long it lasts. Poked, it
    /// reconnects, and the events since the boot wake the cluster.
    #[tokio::test]
    async fn a_follower_whose_node_goes_down_asks_nothing_until_its_node_says_it_is_back() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use talos_sim::config::{NodeConfig, SimConfig, Timings};

        // Down long enough for a quick retry (0.2 s), or the retries before `db39ebc` (0.2 s,
        // doubling), to fail while it is away.
        let timings = Timings {
            reboot_ms: 1500,
            ..Timings::fast()
        };
        let sim = talos_sim::Simulator::start(
            SimConfig::new("follower-pokes")
                .with_timings(timings)
                .with_node(NodeConfig::control_plane("cp-1", "1.11.6", "1.34.1"))
                .with_node(NodeConfig::worker("w-1", "1.11.6", "1.34.1")),
        )
        .await
        .expect("simulator");
        let (fleet, calls) = crate::talos_fleet::counted::fleet_for(&sim);
        let fleet = Arc::new(fleet);
        let worker = sim.nodes().into_iter().find(|node| node.name == "w-1");
        let address = IpAddr::V4(worker.expect("w-1").address);
        let events = |ok: bool| {
            calls
                .lock()
                .unwrap()
                .iter()
                .filter(|(method, code)| *method == "Events" && (*code == "OK") == ok)
                .count()
        };
        let poke = Arc::new(Notify::new());
        let woken = Arc::new(AtomicUsize::new(0));
        let follower = {
            let (fleet, poke, woken) = (fleet.clone(), poke.clone(), woken.clone());
            tokio::spawn(async move {
                let wake_up = || {
                    woken.fetch_add(1, Ordering::SeqCst);
                };
                follow_talos_events(&fleet, address, Instant::now(), &poke, &wake_up).await;
            })
        };
        eventually("the stream opened", || events(true) == 1).await;
        // The cluster's Node watch starts after the follower and pokes on its first list: not news
        // of a return the follower should act on once its node goes down.
        poke.notify_one();

        fleet
            .client(address)
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
        assert_eq!(
            (events(true), events(false)),
            (1, 0),
            "the stream said the node was rebooting: no attempt while it was away, none after it \
             until its Node says it is back"
        );
        // (The first stream may have woken it already: it replays the last second, and the
        // simulator had just booted the node.)
        let woken_before = woken.load(Ordering::SeqCst);

        // Its Node says it is back (the cluster's Node watch pokes the follower): it reconnects, and
        // the events since the boot say the node is running and ready.
        poke.notify_one();
        eventually("reconnected", || events(true) == 2).await;
        eventually("the cluster woken", || {
            woken.load(Ordering::SeqCst) > woken_before
        })
        .await;
        assert_eq!(events(false), 0);
        follower.abort();
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
}
