//! Client TLS for apid: the Talos OS CA as the only trust root, the talosconfig client certificate as
//! identity, ALPN h2 (tonic adds it), and server-name verification against the dialled IP (IP SAN) or
//! host name, unless overridden.

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use super::config::TalosCredentials;
use super::error::{Result, TalosError};

/// Build tonic's TLS config for `endpoint` (used in error messages only).
///
/// The credentials are first loaded into a throwaway rustls `ClientConfig`, which catches what tonic
/// would otherwise report as an opaque "transport error": a key type rustls cannot sign with, a key
/// that does not match the certificate, a CA file without a usable certificate.
///
/// The returned config holds the private key; it must never be `Debug`-printed (tonic's derived
/// `Debug` for `Identity` would print the key bytes), so it is handed straight to the endpoint.
pub(crate) fn client_tls_config(
    credentials: &TalosCredentials,
    server_name: Option<&str>,
    handshake_timeout: Duration,
    endpoint: &str,
) -> Result<ClientTlsConfig> {
    validate_with_rustls(credentials, endpoint)?;
    let mut config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(credentials.ca_pem()))
        .identity(Identity::from_pem(
            credentials.crt_pem(),
            credentials.key_pem(),
        ))
        .timeout(handshake_timeout);
    if let Some(name) = server_name {
        // For endpoints reached through NAT, a VIP or a load balancer whose address is not among the
        // certificate's SANs: verify against a name (or IP) that is.
        config = config.domain_name(name);
    }
    Ok(config)
}

fn validate_with_rustls(credentials: &TalosCredentials, endpoint: &str) -> Result<()> {
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

    // ring, like tonic's tls-ring: Ed25519, ECDSA and RSA client keys all work with it.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err(format!("TLS protocol setup: {e}")))?
        .with_root_certificates(roots)
        // rustls errors name the problem (unsupported key, key/certificate mismatch), not the key.
        .with_client_auth_cert(chain, key)
        .map_err(|e| tls_err(format!("client certificate/key rejected: {e}")))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::talos::config::tests::{talos_ed25519_label, test_pki};

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
            client_tls_config(&creds, None, Duration::from_secs(1), "127.0.0.1:50000").unwrap();
        }
    }

    #[test]
    fn rejects_key_that_does_not_match_certificate() {
        let a = test_pki(&rcgen::PKCS_ED25519);
        let b = test_pki(&rcgen::PKCS_ED25519);
        let creds = TalosCredentials::from_pem(&a.ca_pem, &a.crt_pem, &b.key_pem).unwrap();
        let err =
            client_tls_config(&creds, None, Duration::from_secs(1), "127.0.0.1:50000").unwrap_err();
        assert!(matches!(err, TalosError::Tls { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("127.0.0.1:50000") && text.contains("rejected"),
            "{text}"
        );
    }
}
