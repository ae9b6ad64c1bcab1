//! The Talos API as the controller speaks it: the protobuf types generated from `proto/` (the subset of
//! Talos's API an upgrade needs), the gRPC codec, and the client (talosconfig parsing, mutual TLS, the
//! calls, typed errors). The generated servers are compiled only with the `server` feature, which the
//! Talos node simulator turns on; the controller never contains them.
//!
//! # Overview
//!
//! ```no_run
//! # async fn demo(yaml: &str) -> Result<(), talos_api::TalosError> {
//! use talos_api::{ConnectOptions, Talosconfig, TalosClient, Target};
//!
//! let config = Talosconfig::from_yaml(yaml)?;
//! let credentials = config.current_context()?.credentials()?;
//! let node = "10.0.0.5".parse().expect("an IP");
//! let client = TalosClient::connect(&credentials, Target::Node(node), &ConnectOptions::default()).await?;
//! let version = client.version().await?;
//! println!("{} runs Talos {}", client.endpoint(), version.tag);
//! # Ok(()) }
//! ```
//!
//! * [`config`]: talosconfig YAML → [`Talosconfig`] → [`Context`] → [`TalosCredentials`] (PEM, with
//!   Talos's `ED25519 PRIVATE KEY` label rewritten so rustls accepts it).
//! * [`client`]: [`TalosClient`] over one tonic channel with mTLS against the Talos OS CA, either to a
//!   node directly ([`Target::Node`], certificate checked for the node IP) or through a control-plane
//!   endpoint that proxies to the node ([`Target::ViaEndpoint`], gRPC header `node`).
//! * [`events`]: the `MachineService.Events` stream decoded into [`TalosEvent`]s.
//! * [`cosi`]: typed COSI resources ([`CosiResource`]), watches, and the resource type constants in
//!   [`cosi::resources`].
//! * [`error`]: [`TalosError`]. [`TalosError::is_unreachable`] is how a caller recognises a node that
//!   is down or rebooting, as opposed to a refused or failed request.
//!
//! Secrets (the client key, machine configs) never appear in `Debug` output, error messages or logs.

pub mod client;
mod codec;
pub mod config;
pub mod cosi;
pub mod error;
pub mod events;
pub mod proto;
mod tls;
pub mod types;

pub use client::{
    CallObserver, ConnectOptions, DEFAULT_PORT, MAX_MESSAGE_SIZE, SnapshotStream, TalosClient,
    Target,
};
pub use config::{Context, TalosCredentials, Talosconfig};
pub use cosi::{CosiEvent, CosiEventType, CosiMetadata, CosiResource, CosiWatchStream, resources};
pub use error::{Result, TalosError, grpc_code_name};
pub use events::{EventPayload, EventStream, EventsOptions, TalosEvent};
pub use tls::{DeadPeerDetection, TalosTls};
pub use types::{
    ApplyMode, ApplyOutcome, ContainerdNamespace, EtcdMember, EtcdMemberStatus,
    LegacyUpgradeOptions, LifecycleUpgradeOutcome, MachineConfigBytes, MachineType, RebootMode,
    ServiceInfo, UpgradeRebootMode, VersionInfo,
};
