//! Waking a cluster's reconcile the moment a node in flight changes, instead of at the next poll.
//!
//! While a node is being upgraded, the controller has nothing to do until the node is back: running its
//! new version, Talos-ready and Kubernetes-Ready. Polling finds that out up to a poll interval late, on
//! every node, which adds up over a rolling upgrade. So for every node in flight the controller follows
//! two streams and wakes the cluster's reconcile when one of them says something changed:
//!
//! - the node's Talos runtime events (`MachineService.Events`): a `MachineStatusEvent` saying it is
//!   running and ready;
//! - the node's Kubernetes `Node` in the workload cluster (a watch on that one object): it became
//!   `Ready`, or was uncordoned while Ready.
//!
//! Only changes that can move the upgrade on wake it, and only those after the reconcile that started
//! the follower looked at the node: every wake-up costs a reconcile, and a reconcile that finds
//! nothing to do still reads the cluster's state from the API server.
//!
//! The end of a Talos >= 1.13 install (`LifecycleService.Upgrade`, a call that lasts the whole install)
//! wakes it the same way ([`Waker`], from `talos_upgrade`): the node's drain and reboot come next, and
//! nothing else would tell the controller before the poll.
//!
//! A wake-up only asks for a reconcile; the reconcile still observes everything itself and decides as
//! usual. The poll stays as the safety net (relaxed while every node in flight is rebooting and
//! followed: `Revisit::AwaitingReboots` in the core), so a lost stream costs time, never correctness.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use talos_api::{EventsOptions, TalosClient};
use talos_upgrade_core::crd::KubernetesCluster;

/// First pause before reconnecting to a node's event stream; doubled up to [`RECONNECT_MAX`].
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// A follower gives up after this long even if no reconcile told it to stop (the controller lost its
/// leadership; a deleted cluster's followers are stopped when the controller forgets it): the poll
/// carries on without it.
const FOLLOW_AT_MOST: Duration = Duration::from_secs(60 * 60);

/// One node to follow, with the connections to reach it.
#[derive(Clone)]
pub struct FollowedNode {
    pub name: String,
    pub talos: TalosClient,
    pub workload: kube::Client,
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

/// The followers of every cluster, and the channel their wake-ups go out on.
pub struct Wakeups {
    sender: mpsc::UnboundedSender<ObjectRef<KubernetesCluster>>,
    receiver: Mutex<Option<mpsc::UnboundedReceiver<ObjectRef<KubernetesCluster>>>>,
    /// Per cluster: node name → its follower.
    followed: Mutex<HashMap<ObjectRef<KubernetesCluster>, HashMap<String, Follower>>>,
}

impl Default for Wakeups {
    fn default() -> Self {
        let (sender, receiver) = mpsc::unbounded_channel();
        Wakeups {
            sender,
            receiver: Mutex::new(Some(receiver)),
            followed: Mutex::new(HashMap::new()),
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
        current.retain(|name, _| nodes.iter().any(|node| &node.name == name));
        for node in nodes {
            if current.contains_key(&node.name) {
                continue;
            }
            let name = node.name.clone();
            let task = tokio::spawn(follow_node(cluster.clone(), node, self.sender.clone()));
            current.insert(name, Follower(task.abort_handle()));
        }
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

/// Follows one node until aborted (or [`FOLLOW_AT_MOST`]), sending `cluster` on every change.
async fn follow_node(
    cluster: ObjectRef<KubernetesCluster>,
    node: FollowedNode,
    wake: mpsc::UnboundedSender<ObjectRef<KubernetesCluster>>,
) {
    let wake_up = || {
        // The receiver is gone only when the controller stops; nothing is left to wake then.
        let _ = wake.send(cluster.clone());
    };
    let talos = follow_talos_events(&node.talos, node.observed_at, &wake_up);
    let kubernetes = follow_workload_node(&node.workload, &node.name, node.seen, &wake_up);
    let _ = tokio::time::timeout(FOLLOW_AT_MOST, futures::future::join(talos, kubernetes)).await;
}

/// Wakes when the node reports itself running and ready.
///
/// The first connection replays the events since the reconcile asked the node (rounded up to whole
/// seconds, the protocol's unit), not the whole boot: the node was running and ready when it booted,
/// long before its upgrade, and replaying that would wake a reconcile that finds nothing new, for
/// every node. Every reconnection (the stream breaks when the node reboots) replays everything the
/// node buffered since it booted, so a node that became ready while the stream was down is not missed.
async fn follow_talos_events(client: &TalosClient, observed_at: Instant, wake_up: &impl Fn()) {
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
    let mut pause = RECONNECT_MIN;
    loop {
        let opened = client.events(options.clone()).await;
        options = since_boot.clone();
        match opened {
            Ok(mut events) => {
                pause = RECONNECT_MIN;
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) if event.payload.is_running_and_ready() => {
                            tracing::debug!(endpoint = %client.endpoint(), "node running and ready: waking its cluster");
                            wake_up()
                        }
                        Ok(_) => {}
                        // The stream breaks when the node reboots; connect again.
                        Err(_) => break,
                    }
                }
            }
            Err(error) => {
                tracing::trace!(endpoint = %client.endpoint(), %error, "node event stream");
            }
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// Wakes when the workload Node becomes Ready, or is uncordoned while Ready, compared with what was
/// last seen, starting from what the reconcile saw (`seen`): a Node that became Ready before the watch
/// started wakes it at once.
async fn follow_workload_node(
    workload: &kube::Client,
    name: &str,
    seen: Option<(bool, bool)>,
    wake_up: &impl Fn(),
) {
    let nodes: Api<Node> = Api::all(workload.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut last = seen;
    let mut changes = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(
        watcher::watcher(nodes, config)
    ));
    while let Some(event) = changes.next().await {
        let node = match event {
            Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => node,
            Ok(_) => continue,
            Err(error) => {
                tracing::trace!(node = name, %error, "workload node watch");
                continue;
            }
        };
        let seen = (crate::inventory::node_ready(&node), is_cordoned(&node));
        if worth_a_look(last, seen) {
            tracing::debug!(
                node = name,
                ?last,
                ?seen,
                "workload node ready: waking its cluster"
            );
            wake_up();
        }
        last = Some(seen);
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

fn is_cordoned(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|spec| spec.unschedulable)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::worth_a_look;

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
