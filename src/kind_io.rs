//! How one kind of upgrade looks at a cluster and makes its calls: the IO the shared flow
//! (`reconcile::flow`) carries out for the core's lifecycle. Implemented by [`crate::talos_upgrade`]
//! and [`crate::kubernetes_upgrade`].

use std::future::Future;

use talos_upgrade_core::lifecycle::{Act, Called, Looked};

use crate::followers::FollowedNode;
use crate::progress_store::{Saved, Stored};

/// How one kind of upgrade looks at a cluster and makes its calls.
pub trait KindIo<K: Stored> {
    /// The versions only (`*-current`, `*-available`); `Err` is why they could not be read.
    fn look_at_versions(&mut self) -> impl Future<Output = Looked<K::Versions>> + Send;
    /// Everything a decision needs; `Err` is why the cluster could not be looked at, as a sentence.
    fn look_at_cluster(
        &mut self,
        request: &K::Request,
    ) -> impl Future<Output = Looked<K::Observation>> + Send;
    /// The work the core asks for within a pass, in order.
    fn further(
        &mut self,
        work: &[K::Further],
    ) -> impl Future<Output = Vec<K::FurtherLooked>> + Send;
    /// Makes the saved calls in order, stopping at the first one refused.
    fn act(&mut self, act: &Saved<Act<K>>) -> impl Future<Output = Vec<Called>> + Send;
    /// The nodes in flight to follow until they are back (their followers wake the reconcile).
    fn follow(&self, in_flight: &[String]) -> Vec<FollowedNode>;
}
