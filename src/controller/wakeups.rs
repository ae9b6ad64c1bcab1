//! Waking a cluster's reconcile the moment a node in flight changes, instead of at the next poll.
//!
//! While a node is being upgraded, the controller has nothing to do until the node is back: running its
//! new version, Talos-ready and Kubernetes-Ready. Polling finds that out up to a poll interval late, on
//! every node, which adds up over a rolling upgrade. So for every node in flight the controller follows
//! two streams and wakes the cluster's reconcile when one of them says something changed:
//!
//! - the node's Talos runtime events (`MachineService.Events`): a `MachineStatusEvent` saying it is
//!   running and ready;
//! - the node's Kubernetes `Node` in the workload cluster (a watch on that one object): its `Ready`
//!   condition or its cordon changed.
//!
//! A wake-up only asks for a reconcile; the reconcile still observes everything itself and decides as
//! usual. The poll stays as the safety net, so a lost stream costs time, never correctness.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::crd::KubernetesCluster;
use crate::talos::{EventsOptions, TalosClient};

/// First pause before reconnecting to a node's event stream; doubled up to [`RECONNECT_MAX`].
const RECONNECT_MIN: Duration = Duration::from_millis(200);
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// A follower gives up after this long even if no reconcile told it to stop (the cluster was deleted,
/// or the controller lost its leadership): the poll carries on without it.
const FOLLOW_AT_MOST: Duration = Duration::from_secs(60 * 60);

/// One node to follow, with the connections to reach it.
#[derive(Clone)]
pub struct FollowedNode {
    pub name: String,
    pub talos: TalosClient,
    pub workload: kube::Client,
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
    let talos = follow_talos_events(&node.talos, &wake_up);
    let kubernetes = follow_workload_node(&node.workload, &node.name, &wake_up);
    let _ = tokio::time::timeout(FOLLOW_AT_MOST, futures::future::join(talos, kubernetes)).await;
}

/// Wakes when the node reports itself running and ready. Every (re)connection replays what the node
/// buffered since it booted, so a node that became ready while the stream was down is not missed (and one
/// that was ready before its reboot wakes a reconcile that finds nothing new: harmless).
async fn follow_talos_events(client: &TalosClient, wake_up: &impl Fn()) {
    let since_boot = EventsOptions {
        tail_events: -1,
        ..EventsOptions::default()
    };
    let mut pause = RECONNECT_MIN;
    loop {
        match client.events(since_boot.clone()).await {
            Ok(mut events) => {
                pause = RECONNECT_MIN;
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) if event.payload.is_running_and_ready() => wake_up(),
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

/// Wakes when the workload Node's readiness or cordon changes (and once when the watch starts).
async fn follow_workload_node(workload: &kube::Client, name: &str, wake_up: &impl Fn()) {
    let nodes: Api<Node> = Api::all(workload.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut last: Option<(bool, bool)> = None;
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
        if last != Some(seen) {
            last = Some(seen);
            wake_up();
        }
    }
}

fn is_cordoned(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|spec| spec.unschedulable)
        .unwrap_or(false)
}
