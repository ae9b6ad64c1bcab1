//! The Talos node simulator: N simulated Talos nodes speaking the real Talos gRPC API over mutual TLS.

// Mirrors simulated nodes into a workload Kubernetes cluster (written separately; keep this line).
pub mod workload;
