//! HTTPS on loopback for tests of TLS verification: a CA of the test's own (in no bundle anywhere),
//! a certificate for 127.0.0.1 it signs, and the pieces of a hand-written HTTP/1.1 exchange (one
//! request per connection), so that a test's server is only what it serves.

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A fresh CA and a server configuration presenting a certificate for 127.0.0.1 from it.
pub struct LoopbackTls {
    /// The CA's certificate, PEM: what a client is told to trust.
    pub ca_pem: String,
    /// The same certificate, DER.
    pub ca_der: CertificateDer<'static>,
    /// rustls (ring) presenting the server certificate; for a `tokio_rustls::TlsAcceptor`.
    pub server: Arc<rustls::ServerConfig>,
}

impl LoopbackTls {
    /// Panics on failure: a test cannot go on without it.
    pub fn generate() -> LoopbackTls {
        let ca_key = rcgen::KeyPair::generate().expect("CA key");
        let mut ca_params = rcgen::CertificateParams::default();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);
        let server_key = rcgen::KeyPair::generate().expect("server key");
        let mut server_params = rcgen::CertificateParams::default();
        server_params.subject_alt_names = vec![rcgen::SanType::IpAddress(
            std::net::Ipv4Addr::LOCALHOST.into(),
        )];
        let server_cert = server_params
            .signed_by(&server_key, &issuer)
            .expect("server certificate");
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![server_cert.der().clone()],
            PrivateKeyDer::Pkcs8(server_key.serialize_der().into()),
        )
        .expect("server config");
        LoopbackTls {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().clone(),
            server: Arc::new(server),
        }
    }

    /// The CA as the only root of a client.
    pub fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).expect("CA certificate");
        roots
    }
}

/// A request's head, up to its blank line (lossy UTF-8); `None` when the peer ends or fails first.
pub async fn read_request_head<S: AsyncRead + Unpin>(stream: &mut S) -> Option<String> {
    let mut head = Vec::new();
    let mut buffer = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&buffer[..n]),
        }
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

/// The request target of a head (`/path?query`); `/` when it has none.
pub fn request_target(head: &str) -> &str {
    head.lines()
        .next()
        .and_then(|line| line.split(' ').nth(1))
        .unwrap_or("/")
}

/// Writes `body` as a JSON answer with `status` (`200 OK`) and `connection: close`, then ends the
/// stream. A peer that is gone is no error here: the test's client says what it saw.
pub async fn answer_json<S: AsyncWrite + Unpin>(stream: &mut S, status: &str, body: &str) {
    let answer = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(answer.as_bytes()).await;
    let _ = stream.shutdown().await;
}
