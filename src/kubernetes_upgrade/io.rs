//! The Kubernetes upgrade's part of a reconcile: its looks and calls for the shared flow
//! ([`crate::reconcile::flow`]).

use talos_upgrade_core::kubernetes::{
    Action, Kubernetes, KubernetesVersions, Observation, Request,
};
use talos_upgrade_core::lifecycle::{Act, Called, Looked, NoFurther};

use super::{ExecuteError, ManifestMode};
use crate::cluster_access::SharedAccess;
use crate::followers::FollowedNode;
use crate::kind_io::KindIo;
use crate::progress_store::Saved;

/// The Kubernetes upgrade's IO for one cluster in one reconcile.
pub struct KubernetesIo<'a> {
    access: &'a SharedAccess<'a>,
    /// How the bootstrap manifests are written, by the lowest Talos the last look saw.
    manifests: ManifestMode,
    /// Where the etcd snapshot before the first control plane goes (`etcd-snapshot:
    /// talos-and-kubernetes`, see [`crate::etcd_snapshot`]), and the reconcile's time (its name).
    snapshots: Option<crate::etcd_snapshot::SnapshotContext<'a>>,
    now: jiff::Timestamp,
    /// The cluster was looked at in this reconcile already: a later look (after a step) lists the
    /// Nodes again instead of taking them from the access, listed when the reconcile began.
    looked: bool,
}

impl<'a> KubernetesIo<'a> {
    pub fn new(access: &'a SharedAccess<'a>, now: jiff::Timestamp) -> Self {
        KubernetesIo {
            access,
            manifests: ManifestMode::Legacy,
            snapshots: None,
            now,
            looked: false,
        }
    }

    /// Takes the etcd snapshots this cluster's Kubernetes runs ask for into `snapshots`' destination.
    pub fn with_snapshots(
        mut self,
        snapshots: Option<crate::etcd_snapshot::SnapshotContext<'a>>,
    ) -> Self {
        self.snapshots = snapshots;
        self
    }

    /// Takes the etcd snapshot from `node` and stores it, verified: `Stored` with where it went, or
    /// `Refused` with what failed (the run then stops before any control plane).
    async fn snapshot(
        &self,
        access: &crate::cluster_access::Access,
        node: &str,
        target: &str,
    ) -> Called {
        let Some(context) = &self.snapshots else {
            return Called::Refused(crate::etcd_snapshot::NO_DESTINATION.to_string());
        };
        match context
            .take(access, node, "kubernetes", target, self.now)
            .await
        {
            Ok(stored) => Called::Stored(stored),
            Err(crate::etcd_snapshot::TakeError::NotReached(reason)) => Called::NotReached(reason),
            Err(crate::etcd_snapshot::TakeError::Failed(reason)) => Called::Refused(reason),
        }
    }
}

impl KindIo<Kubernetes> for KubernetesIo<'_> {
    /// The versions of a cluster with no Kubernetes upgrade in flight, from the nodes' Talos versions
    /// (asked once per reconcile, whichever kind asks first), the Nodes and the control-plane pods.
    async fn look_at_versions(&mut self) -> Looked<KubernetesVersions> {
        let access = self.access.get().await.map_err(|e| e.to_string())?;
        let talos_versions = access.talos_versions().await;
        let observation = super::observe_versions(
            &access.inventory,
            talos_versions,
            &access.workload,
            &access.workload_nodes,
        )
        .await;
        Ok(KubernetesVersions::of(&observation))
    }

    async fn look_at_cluster(&mut self, request: &Request) -> Looked<Observation> {
        let access = self.access.get().await.map_err(|e| e.to_string())?;
        // The first look takes the Nodes the access listed as the reconcile began (a Kubernetes run
        // listed them twice per reconcile before); a later one, after a step, lists them again.
        let listed = (!self.looked).then_some(access.workload_nodes.as_slice());
        self.looked = true;
        let observation = super::observe(
            &access.fleet,
            &access.inventory,
            &access.workload,
            request.etcd,
            listed,
        )
        .await;
        // By the lowest Talos among the nodes that answered (none: the legacy mode).
        let lowest_talos = observation.talos_versions().map(|v| v.semver()).min();
        self.manifests = lowest_talos
            .map(ManifestMode::for_lowest_talos)
            .unwrap_or(ManifestMode::Legacy);
        Ok(observation)
    }

    async fn further(&mut self, work: &[NoFurther]) -> Vec<NoFurther> {
        match work.first() {
            None => Vec::new(),
            Some(nothing) => match *nothing {},
        }
    }

    async fn act(&mut self, act: &Saved<Act<Kubernetes>>) -> Vec<Called> {
        let access = match self.access.get().await {
            Ok(access) => access,
            Err(error) => return vec![Called::NotReached(error.to_string())],
        };
        let mut called = Vec::new();
        for action in &act.get().actions {
            if let Action::EtcdSnapshot { node } = action {
                let result = self.snapshot(access, node, &act.get().run.target).await;
                let refused = matches!(result, Called::Refused(_));
                called.push(result);
                if refused {
                    break;
                }
                continue;
            }
            let result = super::execute(
                &access.fleet,
                &access.inventory,
                &access.workload,
                action,
                self.manifests,
            )
            .await;
            match result {
                Ok(()) => called.push(Called::Done),
                Err(ExecuteError::Refused(reason)) => {
                    called.push(Called::Refused(reason));
                    break;
                }
                // Left as issued: the next pass makes the call again, until the step's deadline.
                Err(ExecuteError::Transient(reason)) => {
                    tracing::warn!(%reason, "Kubernetes upgrade call");
                    called.push(Called::NotReached(reason));
                }
            }
        }
        called
    }

    /// The Kubernetes upgrade is not followed: its steps are looked at every poll.
    fn follow(&self, _: &[String]) -> Vec<FollowedNode> {
        Vec::new()
    }
}
