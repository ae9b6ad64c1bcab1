//! Client TLS for apid: the Talos OS CA as the only trust root, the talosconfig client certificate as
//! identity, ALPN h2, and server-name verification against the dialled IP (IP SAN) or host name, unless
//! overridden.
//!
//! The TLS handshake is made here, by [`TlsConnector`], rather than by tonic: tonic builds a rustls
//! configuration (trust roots, certificate chain, key, and a session cache of 32 servers) for every
//! endpoint, which is about 15 KB per node and adds up over a fleet. [`TalosTls`] is built once per set
//! of credentials and shared by every node's connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::config::TalosCredentials;
use super::error::{Result, TalosError};

/// How many servers' TLS sessions a [`TalosTls`] remembers for resumption.
const SESSION_CACHE_SERVERS: usize = 8;

/// A client TLS configuration for one set of Talos credentials, shareable by every connection made with
/// them. It holds the private key: it is never printed (no `Debug`).
#[derive(Clone)]
pub struct TalosTls(Arc<rustls::ClientConfig>);

impl TalosTls {
    /// Loads the credentials into a rustls configuration. Fails with [`TalosError::Tls`] (naming
    /// `endpoint`, never the key) on what would otherwise be an opaque failure at the first call: a
    /// key type rustls cannot sign with, a key that does not match the certificate, a CA file without
    /// a usable certificate.
    pub fn new(credentials: &TalosCredentials, endpoint: &str) -> Result<TalosTls> {
        let tls_err = |reason: String| TalosError::Tls {
            endpoint: endpoint.to_owned(),
            reason,
        };

        let mut roots = rustls::RootCertStore::empty();
        let ca_certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(credentials.ca_pem().as_bytes())
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| tls_err("the Talos CA PEM is malformed".into()))?;
        let (added, _ignored) = roots.add_parsable_certificates(ca_certs);
        if added == 0 {
            return Err(tls_err("the Talos CA holds no usable certificate".into()));
        }

        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(credentials.crt_pem().as_bytes())
                .collect::<std::result::Result<_, _>>()
                .map_err(|_| tls_err("the client certificate PEM is malformed".into()))?;
        // The parser's error text is dropped: it could quote part of the key.
        let key = PrivateKeyDer::from_pem_slice(credentials.key_pem().as_bytes())
            .map_err(|_| tls_err("the client key PEM is malformed".into()))?;

        // ring everywhere: Ed25519, ECDSA and RSA client keys all work with it.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_err(format!("TLS protocol setup: {e}")))?
            .with_root_certificates(roots)
            // rustls errors name the problem (unsupported key, key/certificate mismatch), not the key.
            .with_client_auth_cert(chain, key)
            .map_err(|e| tls_err(format!("client certificate/key rejected: {e}")))?;
        // gRPC is HTTP/2 only; apid offers it through ALPN.
        config.alpn_protocols = vec![b"h2".to_vec()];
        // One cluster's credentials reach at most its own nodes, and mostly one of them (the control
        // plane relaying the others' calls): rustls's default cache of 256 servers is 14 KB per
        // cluster, allocated up front.
        config.resumption = rustls::client::Resumption::in_memory_sessions(SESSION_CACHE_SERVERS);
        Ok(TalosTls(Arc::new(config)))
    }
}

/// Opens one apid connection: TCP to `authority`, then the TLS handshake verified for `server_name`,
/// each within its own timeout. Used as tonic's connector, so tonic's channel reconnects through it.
#[derive(Clone)]
pub(crate) struct TlsConnector {
    pub tls: TalosTls,
    /// `host:port` to dial.
    pub authority: Arc<str>,
    pub server_name: ServerName<'static>,
    pub connect_timeout: Duration,
    pub dead_peer: DeadPeerDetection,
}

/// How a connection to apid notices a node that vanished without closing it (power loss, a network
/// cut): in the kernel, with TCP keepalive probes once the connection is idle and a bound on how
/// long sent data may stay unacknowledged, as apid itself does on its connections to the nodes it
/// relays to (talos v1.14.1 `internal/app/apid/pkg/backend/apid.go`: probes after 30 s idle, every
/// 10 s, 3 of them; `TCP_USER_TIMEOUT` 60 s).
///
/// Not HTTP/2 pings. apid's gRPC server keeps grpc-go's default keepalive enforcement
/// (`internal/app/apid/service.go` passes no `KeepaliveEnforcementPolicy`; grpc-go v1.83.2
/// `internal/transport/http2_server.go` `handlePing`: while a stream is open, a ping less than 5
/// minutes after the previous one, with nothing written by the server in between, is a strike, and
/// the third strike closes the connection with GOAWAY `too_many_pings`). A client pinging every few
/// seconds beside a quiet stream (a follower's events while its node drains) would lose the
/// connection and every call on it. Talos's own client (`pkg/machinery/client`) sends no pings
/// either. And the probes cost the controller nothing: pings woke it for each of its hundreds of
/// connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeadPeerDetection {
    /// Idle time before the first probe.
    pub idle: Duration,
    /// Time between unanswered probes.
    pub interval: Duration,
    /// Unanswered probes after which the connection is dropped.
    pub probes: u32,
    /// How long sent data may stay unacknowledged before the connection is dropped.
    pub unacknowledged: Duration,
}

impl DeadPeerDetection {
    /// apid's values for its own connections to the nodes it relays to.
    pub const APID: DeadPeerDetection = DeadPeerDetection {
        idle: Duration::from_secs(30),
        interval: Duration::from_secs(10),
        probes: 3,
        unacknowledged: Duration::from_secs(60),
    };

    /// Sets them on a connected socket.
    pub fn apply(&self, tcp: &TcpStream) -> io::Result<()> {
        let socket = socket2::SockRef::from(tcp);
        socket.set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(self.idle)
                .with_interval(self.interval)
                .with_retries(self.probes),
        )?;
        #[cfg(target_os = "linux")]
        socket.set_tcp_user_timeout(Some(self.unacknowledged))?;
        Ok(())
    }
}

impl TlsConnector {
    /// The name the server certificate must be valid for: `server_name` if given, else the host
    /// dialled (an IP address is matched against the certificate's IP SANs).
    pub fn server_name(host: &str, server_name: Option<&str>) -> Result<ServerName<'static>> {
        let name = server_name.unwrap_or(host);
        let name = name.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(name.to_owned()).map_err(|_| {
            TalosError::Config(format!(
                "{name:?} is neither an IP address nor a valid host name"
            ))
        })
    }

    async fn open(self) -> io::Result<TokioIo<TlsStream<TcpStream>>> {
        let timed_out = |what: &str| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} not done within {:?}", self.connect_timeout),
            )
        };
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect(&*self.authority))
            .await
            .map_err(|_| timed_out("TCP connect"))??;
        tcp.set_nodelay(true)?;
        self.dead_peer.apply(&tcp)?;
        let connector = tokio_rustls::TlsConnector::from(self.tls.0.clone());
        let tls = tokio::time::timeout(
            self.connect_timeout,
            connector.connect(self.server_name.clone(), tcp),
        )
        .await
        .map_err(|_| timed_out("TLS handshake"))??;
        if tls.get_ref().1.alpn_protocol() != Some(b"h2") {
            // Not apid (or a proxy in front of it that does not speak HTTP/2): it will not heal by
            // waiting, so it is reported as a TLS problem.
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "HTTP/2 was not negotiated.",
            ));
        }
        Ok(TokioIo::new(tls))
    }
}

impl tonic::codegen::Service<tonic::codegen::http::Uri> for TlsConnector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: tonic::codegen::http::Uri) -> Self::Future {
        Box::pin(self.clone().open())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{talos_ed25519_label, test_pki};

    #[test]
    fn accepts_matching_ed25519_and_ecdsa_credentials() {
        for alg in [&rcgen::PKCS_ED25519, &rcgen::PKCS_ECDSA_P256_SHA256] {
            let pki = test_pki(alg);
            let key = talos_ed25519_label(&pki.key_pem);
            let key = if std::ptr::eq(alg, &rcgen::PKCS_ED25519) {
                key
            } else {
                pki.key_pem.clone()
            };
            let creds = TalosCredentials::from_pem(&pki.ca_pem, &pki.crt_pem, key).unwrap();
            TalosTls::new(&creds, "127.0.0.1:50000").unwrap();
        }
    }

    #[test]
    fn rejects_key_that_does_not_match_certificate() {
        let a = test_pki(&rcgen::PKCS_ED25519);
        let b = test_pki(&rcgen::PKCS_ED25519);
        let creds = TalosCredentials::from_pem(&a.ca_pem, &a.crt_pem, &b.key_pem).unwrap();
        let err = TalosTls::new(&creds, "127.0.0.1:50000")
            .err()
            .expect("rejected");
        assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("127.0.0.1:50000") && text.contains("rejected"),
            "{text}"
        );
    }
}
