//! End-to-end: simulated Talos clusters upgraded by the controller, against a real kube-apiserver + etcd
//! (`world`), plus the deploy/ manifests and a real Prometheus scraping the controller. One test binary,
//! so the suites link once.
//!
//! The upgrade suites also run under vitistack's own KubernetesCluster CRD (`TUC_E2E_CRD=vitistack`, see
//! `world` and scripts/test.sh); `deploy` and `prometheus` install the project's CRD.

// Each suite uses a part of the world's helpers.
#![allow(dead_code)]

mod replica;
mod world;

mod alert_gate;
mod chaos;
mod chaos_apiserver;
mod cluster_lifecycle;
mod cluster_shapes;
mod coexistence;
mod deploy;
mod etcd_snapshot;
mod gates;
mod health_checks;
mod helm;
mod image;
mod kubernetes_upgrade;
mod leader_election;
mod plans;
mod prepull;
mod prometheus;
mod rollback;
mod shards;
mod silences;
mod talos_1_14;
mod talos_bad_input;
mod talos_drain;
mod talos_failures;
mod talos_ordering;
mod talos_refresh;
mod talos_starts;
mod talos_stops;
mod talos_upgrade;
mod upgrade_k8s_comparison;
