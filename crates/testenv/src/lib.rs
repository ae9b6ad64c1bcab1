//! A real Kubernetes control plane (etcd + kube-apiserver) on loopback, for the project's tests and demo.
//!
//! The binaries are built from the Go module proxy by `scripts/build-k8s-bins.sh` (no Docker, no downloads);
//! this crate starts them in a temporary directory with generated certificates, RBAC authorization and an
//! admin token, and hands out `kube::Client`s and a kubeconfig the real `kubectl` accepts.
//!
//! Tests share one control plane per test binary ([`ControlPlane::shared`]) and isolate themselves in a
//! fresh namespace ([`ControlPlane::test_namespace`]). When a test panics, the namespace guard prints the
//! tail of the apiserver and etcd logs so the failure explains itself.

mod binaries;
mod control_plane;
mod kubeconfig;
pub mod loopback_tls;
mod pki;
mod process;
pub mod script;
pub mod seaweedfs;
mod workload;

pub use binaries::Binaries;
pub use control_plane::{ControlPlane, ProcessIds, TestNamespace, crd_established};
pub use workload::{AnonymousAccess, node_ready};

/// Everything that can go wrong while starting or talking to the test control plane.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("test control plane binaries not found: {0}")]
    Binaries(String),
    #[error("generating test certificates: {0}")]
    Pki(#[from] rcgen::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{component} did not start: {reason}\n{logs}")]
    Start {
        component: &'static str,
        reason: String,
        logs: String,
    },
    #[error("building a Kubernetes client: {0}")]
    Client(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

impl Error {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
