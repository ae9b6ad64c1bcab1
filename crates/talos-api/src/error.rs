//! [`TalosError`]: every failure of the Talos client, classified so a caller can tell "the node is down"
//! (expected during a reboot) from "the request was refused" and from a real bug.
//!
//! Messages name the endpoint and, for server errors, repeat the server's message. They never contain
//! credentials: the client never formats key material, and transport errors come from tonic, hyper,
//! std::io and rustls, none of which print keys.

use std::error::Error as StdError;
use std::io;

/// Result alias for the Talos client.
pub type Result<T, E = TalosError> = std::result::Result<T, E>;

/// A failed Talos API operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TalosError {
    /// The talosconfig or the credentials in it are unusable. The message names the context and field.
    #[error("{0}")]
    Config(String),

    /// TLS failed: the client certificate or key could not be loaded, the server certificate did not
    /// verify against the Talos OS CA (or not for the dialled IP/name), or the server rejected our
    /// client certificate.
    #[error("TLS with Talos endpoint {endpoint} failed: {reason}")]
    Tls { endpoint: String, reason: String },

    /// The node cannot be reached right now: connection refused or reset, connect timeout, the
    /// connection or stream was closed (EOF, GOAWAY), or apid answered `Unavailable`. This is the
    /// normal state of a node that is rebooting; callers retry it rather than fail.
    #[error("Talos endpoint {endpoint} is unreachable: {reason}")]
    Unreachable { endpoint: String, reason: String },

    /// The client certificate's role does not allow the call (gRPC `PermissionDenied`); COSI also
    /// answers this for resource types or namespaces the node does not know.
    #[error("Talos endpoint {endpoint}: permission denied: {message}")]
    PermissionDenied { endpoint: String, message: String },

    /// gRPC `NotFound` (for example a missing image on pull).
    #[error("Talos endpoint {endpoint}: not found: {message}")]
    NotFound { endpoint: String, message: String },

    /// gRPC `Unimplemented`: the node's Talos version lacks the API, or it is a worker asked for etcd.
    #[error("Talos endpoint {endpoint}: not implemented: {message}")]
    Unimplemented { endpoint: String, message: String },

    /// gRPC `FailedPrecondition` (for example another upgrade is running, or Talos is not installed).
    #[error("Talos endpoint {endpoint}: failed precondition: {message}")]
    FailedPrecondition { endpoint: String, message: String },

    /// gRPC `InvalidArgument` (for example a machine config that does not validate), or an argument
    /// this client rejected before sending.
    #[error("Talos endpoint {endpoint}: invalid argument: {message}")]
    InvalidArgument { endpoint: String, message: String },

    /// The request did not finish in time: our request timeout fired or the server answered
    /// `DeadlineExceeded`.
    #[error("Talos endpoint {endpoint}: timed out: {message}")]
    Timeout { endpoint: String, message: String },

    /// Any other gRPC status.
    #[error("Talos endpoint {endpoint}: gRPC {code:?}: {message}")]
    Status {
        endpoint: String,
        code: tonic::Code,
        message: String,
    },

    /// The reply could not be decoded or did not have the expected shape (no messages, an event payload
    /// that does not decode, a stream that ended early).
    #[error("Talos endpoint {endpoint}: unexpected response: {message}")]
    Decode { endpoint: String, message: String },

    /// A COSI watch reported an `ERRORED` event; the watch is over.
    #[error("Talos endpoint {endpoint}: watch failed: {message}")]
    Watch { endpoint: String, message: String },

    /// `LifecycleService.Upgrade` ran the installer and it exited non-zero. The server reports this as
    /// a normal end of stream, so the client turns it into an error here.
    #[error("Talos endpoint {endpoint}: installer exited with code {exit_code}: {output_tail}")]
    UpgradeFailed {
        endpoint: String,
        exit_code: i32,
        output_tail: String,
    },
}

impl TalosError {
    /// The gRPC code name of the failure, as the Talos API calls metric labels it (`TLS`, `Config` and
    /// `Decode` for failures that never got a status).
    pub fn code(&self) -> &'static str {
        match self {
            TalosError::Config(_) => "Config",
            TalosError::Tls { .. } => "TLS",
            TalosError::Unreachable { .. } => "Unavailable",
            TalosError::PermissionDenied { .. } => "PermissionDenied",
            TalosError::NotFound { .. } => "NotFound",
            TalosError::Unimplemented { .. } => "Unimplemented",
            TalosError::FailedPrecondition { .. } => "FailedPrecondition",
            TalosError::InvalidArgument { .. } => "InvalidArgument",
            TalosError::Timeout { .. } => "DeadlineExceeded",
            TalosError::Status { code, .. } => grpc_code_name(*code),
            TalosError::Decode { .. } | TalosError::Watch { .. } => "Decode",
            TalosError::UpgradeFailed { .. } => "InstallerFailed",
        }
    }

    /// True if the node could not be reached (down, rebooting, connection dropped). A caller waiting for
    /// a node to come back treats this as "still down" and retries.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, TalosError::Unreachable { .. })
    }

    /// True for failures that may succeed on retry without changing anything: unreachable or timed out.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            TalosError::Unreachable { .. } | TalosError::Timeout { .. }
        )
    }

    /// The endpoint the error is about, if it concerns one (everything but [`TalosError::Config`]).
    pub fn endpoint(&self) -> Option<&str> {
        match self {
            TalosError::Config(_) => None,
            TalosError::Tls { endpoint, .. }
            | TalosError::Unreachable { endpoint, .. }
            | TalosError::PermissionDenied { endpoint, .. }
            | TalosError::NotFound { endpoint, .. }
            | TalosError::Unimplemented { endpoint, .. }
            | TalosError::FailedPrecondition { endpoint, .. }
            | TalosError::InvalidArgument { endpoint, .. }
            | TalosError::Timeout { endpoint, .. }
            | TalosError::Status { endpoint, .. }
            | TalosError::Decode { endpoint, .. }
            | TalosError::Watch { endpoint, .. }
            | TalosError::UpgradeFailed { endpoint, .. } => Some(endpoint),
        }
    }

    /// Classify a gRPC status returned by a call to `endpoint`.
    ///
    /// A status the server sent is mapped by its code. A status tonic made up locally from a transport
    /// failure carries that failure as its `source()`; those are classified by walking the error chain
    /// (TLS failure, timeout, or the node being unreachable), because tonic reports most of them with
    /// codes like `Unknown` or `Cancelled` that say nothing about the cause.
    pub fn from_status(endpoint: &str, status: &tonic::Status) -> TalosError {
        if let Some(source) = status.source() {
            if let Some(err) = classify_chain(endpoint, source) {
                return err;
            }
            // A local failure we could not pin down. With these codes it came from the connection
            // (hyper reports "connection closed" as Cancelled, broken bodies as Unknown).
            if matches!(
                status.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
                    | tonic::Code::Internal
            ) {
                return TalosError::Unreachable {
                    endpoint: endpoint.to_owned(),
                    reason: chain_text(source),
                };
            }
        }
        Self::from_code(endpoint, status.code(), status.message())
    }

    /// Like [`TalosError::from_status`], for errors that end a long-lived stream (events, watches):
    /// Talos cancels its streams when the node shuts down, so a server-sent `Cancelled` there means
    /// the node is going away, as talosctl's event tracker treats it.
    pub fn from_stream_status(endpoint: &str, status: &tonic::Status) -> TalosError {
        if status.code() == tonic::Code::Cancelled && status.source().is_none() {
            return TalosError::Unreachable {
                endpoint: endpoint.to_owned(),
                reason: format!("stream cancelled by the node: {}", status.message()),
            };
        }
        Self::from_status(endpoint, status)
    }

    /// Classify a failure to establish a channel (`Endpoint::connect`).
    pub fn from_transport(endpoint: &str, err: &tonic::transport::Error) -> TalosError {
        classify_chain(endpoint, err).unwrap_or_else(|| TalosError::Unreachable {
            endpoint: endpoint.to_owned(),
            reason: chain_text(err),
        })
    }

    /// Map a gRPC code and message (from the server, or from `common.Metadata.status` in a reply).
    pub fn from_code(endpoint: &str, code: tonic::Code, message: &str) -> TalosError {
        let endpoint = endpoint.to_owned();
        let message = message.to_owned();
        match code {
            tonic::Code::Unavailable => TalosError::Unreachable {
                endpoint,
                reason: message,
            },
            tonic::Code::PermissionDenied => TalosError::PermissionDenied { endpoint, message },
            tonic::Code::NotFound => TalosError::NotFound { endpoint, message },
            tonic::Code::Unimplemented => TalosError::Unimplemented { endpoint, message },
            tonic::Code::FailedPrecondition => TalosError::FailedPrecondition { endpoint, message },
            tonic::Code::InvalidArgument => TalosError::InvalidArgument { endpoint, message },
            tonic::Code::DeadlineExceeded => TalosError::Timeout { endpoint, message },
            // tonic's decoder says this when the body ends in the middle of a message: the
            // connection went away mid-stream.
            tonic::Code::Internal if message == "Unexpected EOF decoding stream." => {
                TalosError::Unreachable {
                    endpoint,
                    reason: message,
                }
            }
            // The generated client reports a channel that cannot become ready this way, without a
            // source; it means the connection machinery is gone.
            tonic::Code::Unknown if message.starts_with("Service was not ready") => {
                TalosError::Unreachable {
                    endpoint,
                    reason: message,
                }
            }
            code => TalosError::Status {
                endpoint,
                code,
                message,
            },
        }
    }
}

/// What a transport error chain says about the failure, strongest evidence first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum ChainKind {
    Unreachable,
    Timeout,
    Tls,
}

/// Walk `err`'s source chain (looking inside `io::Error`s too, whose `source()` skips the wrapped
/// error) and classify it. `None` if nothing in the chain is recognised.
fn classify_chain(endpoint: &str, err: &(dyn StdError + 'static)) -> Option<TalosError> {
    let mut found: Option<ChainKind> = None;
    let mut note = |kind: ChainKind| found = Some(found.map_or(kind, |f| f.max(kind)));

    for e in chain(err) {
        if e.downcast_ref::<tonic::TimeoutExpired>().is_some() {
            note(ChainKind::Timeout);
        } else if e.downcast_ref::<rustls::Error>().is_some() {
            // Any rustls error: bad server certificate, an alert because the server rejected our
            // certificate, or a key rustls cannot use. None of these heal by retrying.
            note(ChainKind::Tls);
        } else if e.downcast_ref::<tonic::ConnectError>().is_some() {
            note(ChainKind::Unreachable);
        } else if let Some(io) = e.downcast_ref::<io::Error>() {
            if io.kind() == io::ErrorKind::InvalidData {
                // In our stack (TCP, rustls, h2) only the TLS layer fails reads and writes with
                // InvalidData: tokio-rustls wraps every rustls error that way, and our connector
                // refuses a server that does not offer ALPN h2 (not apid) that way too. Once the error has
                // passed through h2 (a TLS alert after the handshake, e.g. the server rejecting our
                // client certificate) only its text survives, so the kind is the evidence.
                note(ChainKind::Tls);
            } else if is_unreachable_io(io.kind()) {
                note(ChainKind::Unreachable);
            }
        }
    }

    let reason = chain_text(err);
    let endpoint = endpoint.to_owned();
    found.map(|kind| match kind {
        ChainKind::Tls => TalosError::Tls { endpoint, reason },
        ChainKind::Timeout => TalosError::Timeout {
            endpoint,
            message: reason,
        },
        ChainKind::Unreachable => TalosError::Unreachable { endpoint, reason },
    })
}

fn is_unreachable_io(kind: io::ErrorKind) -> bool {
    use io::ErrorKind::*;
    matches!(
        kind,
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | BrokenPipe
            | UnexpectedEof
            | TimedOut
            | AddrNotAvailable
            | HostUnreachable
            | NetworkUnreachable
            | NetworkDown
    )
}

/// The errors in `err`'s chain, outermost first. `io::Error::source()` returns the wrapped error's
/// source rather than the wrapped error itself, so the wrapped error is taken from `get_ref()`.
fn chain<'a>(err: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut out = Vec::new();
    let mut next: Option<&'a (dyn StdError + 'static)> = Some(err);
    // Bounded: a (buggy) cyclic chain must not hang the caller.
    while let Some(e) = next {
        if out.len() >= 32 {
            break;
        }
        out.push(e);
        next = match e.downcast_ref::<io::Error>().and_then(|io| io.get_ref()) {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => e.source(),
        };
    }
    out
}

/// The chain's messages joined with ": ", skipping a message that repeats the previous one (tonic's
/// ConnectError displays as its inner error).
fn chain_text(err: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    for e in chain(err) {
        let text = e.to_string();
        if text.is_empty() || parts.last().is_some_and(|last| last.ends_with(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

/// The name of a gRPC status code as used in the `code` label of
/// the controller's `talos_upgrade_talos_api_calls_total` (the names grpc-go and Talos print: `OK`, `Unavailable`, ...).
pub fn grpc_code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "OK",
        tonic::Code::Cancelled => "Canceled",
        tonic::Code::Unknown => "Unknown",
        tonic::Code::InvalidArgument => "InvalidArgument",
        tonic::Code::DeadlineExceeded => "DeadlineExceeded",
        tonic::Code::NotFound => "NotFound",
        tonic::Code::AlreadyExists => "AlreadyExists",
        tonic::Code::PermissionDenied => "PermissionDenied",
        tonic::Code::ResourceExhausted => "ResourceExhausted",
        tonic::Code::FailedPrecondition => "FailedPrecondition",
        tonic::Code::Aborted => "Aborted",
        tonic::Code::OutOfRange => "OutOfRange",
        tonic::Code::Unimplemented => "Unimplemented",
        tonic::Code::Internal => "Internal",
        tonic::Code::Unavailable => "Unavailable",
        tonic::Code::DataLoss => "DataLoss",
        tonic::Code::Unauthenticated => "Unauthenticated",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const EP: &str = "10.0.0.5:50000";

    #[test]
    fn server_codes_map_to_variants() {
        type Check = fn(&TalosError) -> bool;
        let cases: Vec<(tonic::Code, Check)> = vec![
            (tonic::Code::Unavailable, |e| {
                matches!(e, TalosError::Unreachable { .. })
            }),
            (tonic::Code::PermissionDenied, |e| {
                matches!(e, TalosError::PermissionDenied { .. })
            }),
            (tonic::Code::NotFound, |e| {
                matches!(e, TalosError::NotFound { .. })
            }),
            (tonic::Code::Unimplemented, |e| {
                matches!(e, TalosError::Unimplemented { .. })
            }),
            (tonic::Code::FailedPrecondition, |e| {
                matches!(e, TalosError::FailedPrecondition { .. })
            }),
            (tonic::Code::InvalidArgument, |e| {
                matches!(e, TalosError::InvalidArgument { .. })
            }),
            (tonic::Code::DeadlineExceeded, |e| {
                matches!(e, TalosError::Timeout { .. })
            }),
            (tonic::Code::Aborted, |e| {
                matches!(
                    e,
                    TalosError::Status {
                        code: tonic::Code::Aborted,
                        ..
                    }
                )
            }),
            (tonic::Code::Internal, |e| {
                matches!(e, TalosError::Status { .. })
            }),
        ];
        for (code, check) in cases {
            let err = TalosError::from_status(EP, &tonic::Status::new(code, "boom"));
            assert!(check(&err), "{code:?} mapped to {err:?}");
            assert_eq!(err.endpoint(), Some(EP));
            assert!(err.to_string().contains(EP), "{err}");
            assert!(err.to_string().contains("boom"), "{err}");
        }
        assert!(TalosError::from_status(EP, &tonic::Status::unavailable("x")).is_unreachable());
        assert!(!TalosError::from_status(EP, &tonic::Status::not_found("x")).is_unreachable());
    }

    #[test]
    fn server_cancelled_is_unreachable_only_on_streams() {
        let st = tonic::Status::cancelled("context canceled");
        assert!(matches!(
            TalosError::from_status(EP, &st),
            TalosError::Status {
                code: tonic::Code::Cancelled,
                ..
            }
        ));
        assert!(TalosError::from_stream_status(EP, &st).is_unreachable());
    }

    #[test]
    fn mid_stream_eof_is_unreachable() {
        let st = tonic::Status::internal("Unexpected EOF decoding stream.");
        assert!(TalosError::from_status(EP, &st).is_unreachable());
    }

    fn local_status(err: Box<dyn StdError + Send + Sync>) -> tonic::Status {
        // The way tonic builds a status from a transport failure: it keeps the failure as source.
        tonic::Status::from_error(err)
    }

    #[test]
    fn transport_io_errors_are_unreachable() {
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::TimedOut,
        ] {
            let io = io::Error::new(kind, "socket trouble");
            let st = local_status(Box::new(tonic::ConnectError(Box::new(io))));
            let err = TalosError::from_status(EP, &st);
            assert!(err.is_unreachable(), "{kind:?}: {err:?}");
            assert!(err.to_string().contains("socket trouble"), "{err}");
        }
    }

    #[test]
    fn bare_io_error_in_chain_is_unreachable() {
        // hyper reports a dropped connection as an io error under its own error type; here the io
        // error is wrapped in a custom error whose source() exposes it.
        #[derive(Debug)]
        struct Wrapper(io::Error);
        impl std::fmt::Display for Wrapper {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("connection error")
            }
        }
        impl StdError for Wrapper {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        let st = local_status(Box::new(Wrapper(io::Error::from(
            io::ErrorKind::ConnectionReset,
        ))));
        assert!(TalosError::from_status(EP, &st).is_unreachable());
    }

    #[test]
    fn unknown_local_failure_with_source_is_unreachable() {
        // e.g. hyper's "connection closed" (GOAWAY from a shutting-down node) arrives as a status
        // with an opaque source; any local failure with a connection-ish code means the node is gone.
        let mut st = tonic::Status::unknown("h2 protocol error: connection closed");
        st.set_source(Arc::new(io::Error::other("GOAWAY")));
        assert!(TalosError::from_status(EP, &st).is_unreachable());
    }

    #[test]
    fn rustls_error_in_chain_is_tls() {
        let rustls_err = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        // tokio-rustls wraps rustls errors into io::Error(InvalidData), whose source() hides them.
        let io = io::Error::new(io::ErrorKind::InvalidData, rustls_err);
        let st = local_status(Box::new(tonic::ConnectError(Box::new(io))));
        let err = TalosError::from_status(EP, &st);
        assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
        assert!(!err.is_unreachable());
        assert!(err.to_string().contains("UnknownIssuer"), "{err}");

        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::UnknownCA);
        let st = local_status(Box::new(io::Error::new(io::ErrorKind::InvalidData, alert)));
        assert!(matches!(
            TalosError::from_status(EP, &st),
            TalosError::Tls { .. }
        ));
    }

    #[test]
    fn tls_alert_text_after_h2_is_tls() {
        // What a client certificate rejected by the server looks like after h2 and hyper: h2 keeps
        // only the io kind and the text of the rustls error.
        let io = io::Error::new(
            io::ErrorKind::InvalidData,
            "received fatal alert: DecryptError",
        );
        let err = TalosError::from_status(EP, &local_status(Box::new(io)));
        assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
        assert!(err.to_string().contains("DecryptError"), "{err}");
    }

    #[test]
    fn timeout_expired_is_timeout() {
        let st = local_status(Box::new(tonic::TimeoutExpired(())));
        let err = TalosError::from_status(EP, &st);
        assert!(matches!(err, TalosError::Timeout { .. }), "{err:?}");
        assert!(err.is_transient());
    }

    #[test]
    fn chain_text_skips_repeats() {
        let io = io::Error::new(io::ErrorKind::ConnectionRefused, "Connection refused");
        let connect = tonic::ConnectError(Box::new(io));
        assert_eq!(chain_text(&connect), "Connection refused");
    }
}
