//! Leader election: several replicas of the controller run, and only the one holding a
//! `coordination.k8s.io` Lease acts. The others stand by and take over when the holder stops renewing
//! the Lease (it died, or lost the API server), within the Lease's duration.
//!
//! Leadership is a safety net on top of the progress ConfigMap's optimistic concurrency, not the only
//! guard: a replica that lost the Lease finishes the reconcile it is in, and if it then tries to record
//! an upgrade call the new leader has already recorded, its write conflicts and it makes no call.

use std::future::Future;
use std::time::Duration;

use kube_lease_manager::LeaseManagerBuilder;
use tokio_util::sync::CancellationToken;

/// Prefix of the field manager of a replica's writes to the Lease; the replica's identity follows.
const FIELD_MANAGER_PREFIX: &str = "talos-upgrade-controller";

/// Kubernetes refuses a longer `fieldManager`.
const FIELD_MANAGER_MAX_LEN: usize = 128;

/// The field manager a replica writes the Lease with: its own, never shared with another replica.
///
/// A free Lease is taken with a server-side apply of `holderIdentity` without force, and it is the
/// API server's field ownership that refuses the second of two replicas racing for it. Two replicas
/// writing under one manager would both succeed, and both would lead.
///
/// An identity too long for the limit keeps its end, where pod names differ (the replica set's hash
/// and the pod's own suffix).
pub fn field_manager(identity: &str) -> String {
    let room = FIELD_MANAGER_MAX_LEN - FIELD_MANAGER_PREFIX.len() - 1;
    let mut start = identity.len().saturating_sub(room);
    while !identity.is_char_boundary(start) {
        start += 1;
    }
    format!("{FIELD_MANAGER_PREFIX}-{}", &identity[start..])
}

/// Where and how long the Lease is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Election {
    /// Name of the Lease.
    pub lease: String,
    /// Namespace of the Lease (the controller's own).
    pub namespace: String,
    /// This replica's name, written as the Lease's holder (the pod name).
    pub identity: String,
    /// How long the Lease stays held without renewal; a standby takes over after this.
    pub duration: Duration,
    /// How long before expiry the holder renews.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("leader election on Lease {namespace}/{lease}: {source}")]
    Lease {
        namespace: String,
        lease: String,
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
    #[error("leader election on Lease {namespace}/{lease} stopped unexpectedly")]
    Stopped { namespace: String, lease: String },
}

/// Runs `work` whenever this replica holds the Lease, with a token cancelled when it loses the Lease
/// or `shutdown` fires; `work` should then stop acting and return. Calls `on_standby` once the replica
/// takes part in the election. Returns after `shutdown`, having released the Lease.
pub async fn lead<F, Fut>(
    client: kube::Client,
    election: Election,
    shutdown: CancellationToken,
    on_standby: impl FnOnce(),
    mut work: F,
) -> Result<(), LeaderError>
where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let error = |source| LeaderError::Lease {
        namespace: election.namespace.clone(),
        lease: election.lease.clone(),
        source,
    };
    let manager = LeaseManagerBuilder::new(client, &election.lease)
        .with_namespace(&election.namespace)
        .with_identity(&election.identity)
        .with_duration(election.duration.as_secs().max(1))
        .with_grace(election.grace.as_secs().max(1))
        .with_field_manager(field_manager(&election.identity))
        .build()
        .await
        .map_err(error)?;
    let (mut leading, elector) = manager.watch().await;
    on_standby();
    tracing::info!(identity = %election.identity, lease = %election.lease, "standing by for leadership");
    let stopped = || LeaderError::Stopped {
        namespace: election.namespace.clone(),
        lease: election.lease.clone(),
    };
    loop {
        // Standing by.
        while !*leading.borrow_and_update() {
            tokio::select! {
                changed = leading.changed() => changed.map_err(|_| stopped())?,
                () = shutdown.cancelled() => {
                    // Dropping the receiver makes the elector release the Lease and end.
                    drop(leading);
                    let _ = elector.await;
                    return Ok(());
                }
            }
        }
        tracing::info!(identity = %election.identity, "leading");
        let term = shutdown.child_token();
        let worker = tokio::spawn(work(term.clone()));
        let lost = loop {
            tokio::select! {
                changed = leading.changed() => {
                    if changed.is_err() || !*leading.borrow_and_update() {
                        break true;
                    }
                }
                () = shutdown.cancelled() => break false,
            }
        };
        term.cancel();
        let _ = worker.await;
        if !lost {
            drop(leading);
            let _ = elector.await;
            return Ok(());
        }
        tracing::warn!(identity = %election.identity, "lost leadership; standing by");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_replica_writes_the_lease_under_its_own_bounded_field_manager() {
        assert_eq!(
            field_manager("controller-7d9f-abcde"),
            "talos-upgrade-controller-controller-7d9f-abcde"
        );
        assert_ne!(field_manager("replica-a"), field_manager("replica-b"));
        // Pods of one Deployment share a long prefix and differ at the end, which is what is kept.
        let stem = "a-very-long-deployment-name".repeat(5);
        let (one, two) = (
            field_manager(&format!("{stem}-7d9f8c6b5-abcde")),
            field_manager(&format!("{stem}-7d9f8c6b5-fghij")),
        );
        assert!(one.len() <= FIELD_MANAGER_MAX_LEN, "{}", one.len());
        assert!(one.starts_with("talos-upgrade-controller-"), "{one}");
        assert!(one.ends_with("-7d9f8c6b5-abcde"), "{one}");
        assert_ne!(one, two);
        let wide = field_manager(&"é".repeat(100));
        assert!(wide.len() <= FIELD_MANAGER_MAX_LEN, "{}", wide.len());
        assert!(wide.ends_with('é'));
    }
}
