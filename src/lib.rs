//! talos-upgrade-controller: upgrades Talos Linux clusters described by vitistack `KubernetesCluster`
//! objects, driven by `upgrade.vitistack.io/*` annotations.

pub mod admin;
pub mod annotations;
pub mod api_client;
pub mod catalog;
pub mod controller;
pub mod crd;
pub mod credentials;
pub mod drain;
pub mod grpc_codec;
pub mod intent;
pub mod inventory;
pub mod k8s_upgrade;
pub mod leader;
pub mod metrics;
pub mod observe;
pub mod proto;
pub mod read_cache;
pub mod rollout;
pub mod sim;
pub mod store;
pub mod talos;
pub mod versions;
