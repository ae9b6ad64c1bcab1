//! The pure core of talos-upgrade-controller: everything it decides, with no IO and no clock.
//!
//! The controller's shell observes a cluster (Kubernetes, Talos), hands what it saw to this crate
//! together with the user's annotations, the persisted run record and the time, and carries out what
//! comes back. Nothing here waits, reads a socket or looks at the wall clock, so every rule is tested
//! table by table without a runtime.
//!
//! * the contract: [`annotations`] (keys, statuses, the progress format) and [`crd`] (the
//!   `KubernetesCluster` type, its conditions and the status patch);
//! * the user's intent, parsed once: [`intent`];
//! * the version rules and the release catalog: [`versions`], [`catalog`];
//! * the rollouts: [`talos`] and [`kubernetes`] (each a run record, a pure `advance`, and what makes it
//!   a [`lifecycle::Kind`]), with the vocabulary they share in [`run`];
//! * the one [`lifecycle`] both kinds share (a state machine the shell drives), the [`gates`] between
//!   them, the operator's [`holds`] before each node (the [`alert_gate`] and the [`health_checks`]
//!   among them), the early [`acknowledgement`] of a new Talos target, and the [`report`] a reconcile
//!   writes.

pub mod acknowledgement;
pub mod alert_gate;
pub mod annotations;
pub mod catalog;
pub mod coexistence;
pub mod crd;
pub mod etcd_snapshot;
pub mod gates;
pub mod health_checks;
pub mod holds;
pub mod intent;
pub mod kubernetes;
pub mod lifecycle;
pub mod plan;
pub mod prepull;
pub mod report;
pub mod run;
pub mod silences;
pub mod talos;
pub mod versions;
