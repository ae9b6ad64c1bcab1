//! The Talos node simulator: N simulated Talos nodes speaking the real Talos gRPC API over mutual TLS.
