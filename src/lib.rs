//! talos-upgrade-controller: upgrades Talos Linux clusters described by vitistack `KubernetesCluster`
//! objects, driven by `upgrade.vitistack.io/*` annotations.
//!
//! This crate is the shell around the pure core (`talos_upgrade_core`): it reads and writes Kubernetes,
//! talks to Talos (`talos_api`), and runs the reconcile loop.
//!
//! * the reconcile: [`reconcile`] (the acknowledgement, the flow both upgrade kinds share, report
//!   writing);
//! * the IO of each upgrade kind, behind [`kind_io`]: [`talos_upgrade`] and [`kubernetes_upgrade`];
//! * the edges: [`cluster_access`] (credentials, inventory, connections per cluster),
//!   [`api_client`], [`progress_store`], [`read_cache`], [`inventory`], [`credentials`], [`drain`],
//!   [`talos_fleet`], [`followers`] (the nodes of a running cluster) and [`followed_statuses`] (what
//!   their watches report), [`catalog_sources`];
//! * the operator's gates before each node: [`holds`] (what they need of the cluster);
//! * operations: [`metrics`], [`admin`], [`leader`].

pub mod admin;
pub mod api_client;
pub mod catalog_sources;
pub mod cluster_access;
pub mod credentials;
pub mod drain;
pub mod etcd_snapshot;
pub mod event_recorder;
pub mod followed_statuses;
pub mod followers;
pub mod holds;
pub mod http_auth;
pub mod inventory;
pub mod kept_looks;
pub mod kind_io;
pub mod kubernetes_upgrade;
pub mod leader;
pub mod metrics;
pub mod plan_preview;
pub mod progress_store;
pub mod read_cache;
pub mod reconcile;
pub mod silences;
pub mod talos_fleet;
pub mod talos_upgrade;

/// The environment the container image (the repository's `Dockerfile`) sets for the controller beyond
/// its CA bundle: one glibc malloc arena for every thread, which lowers the peak RSS without costing
/// CPU (docs/performance.md, Memory). The benchmark starts the controller with it, so that it
/// measures the controller as it ships, and the image test checks that the running container has it.
pub const IMAGE_ENV: &[(&str, &str)] = &[("MALLOC_ARENA_MAX", "1")];
