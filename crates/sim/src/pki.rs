//! The simulated cluster's PKI: a Talos OS CA, apid server certificates per node, client certificates
//! carrying a Talos role, and talosconfig files exactly as talosctl writes them (talos-api.md §6).
//!
//! Everything is Ed25519, like siderolabs/crypto generates it, so clients exercise the same
//! "`ED25519 PRIVATE KEY` label" path they meet on a real cluster.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Certificate generation failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("certificate generation failed: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("invalid certificate name {name:?}: {source}")]
    Name {
        name: String,
        #[source]
        source: rcgen::Error,
    },
}

/// A Talos API role, carried in the client certificate's Organization.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientRole {
    /// `os:admin`: everything.
    Admin,
    /// `os:operator`: reads plus reboot and image pulls.
    Operator,
    /// `os:reader`: reads only, no sensitive resources.
    Reader,
    /// Any other Organization string, e.g. `os:etcd:backup` or a bogus role.
    Custom(String),
}

impl ClientRole {
    /// The Organization value Talos expects.
    pub fn organization(&self) -> &str {
        match self {
            ClientRole::Admin => "os:admin",
            ClientRole::Operator => "os:operator",
            ClientRole::Reader => "os:reader",
            ClientRole::Custom(org) => org,
        }
    }
}

impl From<&str> for ClientRole {
    /// `"os:admin"` → Admin, `"os:operator"` → Operator, `"os:reader"` → Reader, anything else Custom.
    fn from(org: &str) -> Self {
        match org {
            "os:admin" => ClientRole::Admin,
            "os:operator" => ClientRole::Operator,
            "os:reader" => ClientRole::Reader,
            other => ClientRole::Custom(other.to_string()),
        }
    }
}

/// A certificate's validity window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

/// Backdating absorbs small clock differences between whoever mints a certificate and whoever checks it.
const BACKDATE: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

impl Validity {
    /// What talosctl mints for an admin: one year from now.
    pub fn one_year() -> Self {
        Self::lasting(365 * DAY)
    }

    /// Valid from an hour ago for `duration`.
    pub fn lasting(duration: Duration) -> Self {
        let now = SystemTime::now();
        Validity {
            not_before: now - BACKDATE,
            not_after: now + duration,
        }
    }

    /// Expired yesterday, so TLS verification must refuse it.
    pub fn expired() -> Self {
        let now = SystemTime::now();
        Validity {
            not_before: now - 2 * DAY,
            not_after: now - DAY,
        }
    }
}

/// A PEM certificate and its private key. `key_pem` uses the standard `PRIVATE KEY` label that rustls
/// and tonic accept; [`ClientIdentity::talos_key_pem`] gives Talos's `ED25519 PRIVATE KEY` form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert_pem: String,
    pub key_pem: String,
}

impl ClientIdentity {
    /// The key as siderolabs/crypto encodes it: PKCS#8 under an `ED25519 PRIVATE KEY` label.
    pub fn talos_key_pem(&self) -> String {
        self.key_pem
            .replace(
                "-----BEGIN PRIVATE KEY-----",
                "-----BEGIN ED25519 PRIVATE KEY-----",
            )
            .replace(
                "-----END PRIVATE KEY-----",
                "-----END ED25519 PRIVATE KEY-----",
            )
    }
}

/// A node's apid serving certificate.
#[derive(Debug)]
pub(crate) struct ServerIdentity {
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

/// The Talos OS CA: self-signed Ed25519, O=talos, ten years.
pub struct CertAuthority {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for CertAuthority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.debug_struct("CertAuthority").finish_non_exhaustive()
    }
}

fn ed25519_key() -> Result<KeyPair, PkiError> {
    Ok(KeyPair::generate_for(&rcgen::PKCS_ED25519)?)
}

fn dn(pairs: &[(DnType, &str)]) -> DistinguishedName {
    let mut name = DistinguishedName::new();
    for (ty, value) in pairs {
        name.push(ty.clone(), *value);
    }
    name
}

impl CertAuthority {
    /// Generate a fresh CA.
    pub fn generate() -> Result<Self, PkiError> {
        let key = ed25519_key()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&[(DnType::OrganizationName, "talos")]);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let validity = Validity::lasting(10 * 365 * DAY);
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let cert = params.self_signed(&key)?;
        Ok(CertAuthority {
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub(crate) fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA key as a control plane's machine config carries it (`.machine.ca.key`), under Talos's
    /// `ED25519 PRIVATE KEY` label. Only control-plane configs get it, and they are `os:admin` reads.
    pub(crate) fn talos_key_pem(&self) -> String {
        ClientIdentity {
            cert_pem: String::new(),
            key_pem: self.issuer.key().serialize_pem(),
        }
        .talos_key_pem()
    }

    /// apid's serving certificate for a node: EKU ServerAuth, SANs = node IP, 127.0.0.1 and the
    /// hostname, so clients can verify by IP or by `domain_name(<hostname>)`.
    pub(crate) fn server_identity(
        &self,
        node_name: &str,
        address: Ipv4Addr,
    ) -> Result<ServerIdentity, PkiError> {
        let key = ed25519_key()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&[(DnType::CommonName, node_name)]);
        let dns = node_name.try_into().map_err(|source| PkiError::Name {
            name: node_name.to_string(),
            source,
        })?;
        params.subject_alt_names = vec![
            SanType::IpAddress(IpAddr::V4(address)),
            SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            SanType::DnsName(dns),
        ];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let validity = Validity::one_year();
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(ServerIdentity {
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }

    /// A client certificate: Organization = role, EKU exactly [ClientAuth] (apid rejects other sets).
    pub fn client_identity(
        &self,
        role: &ClientRole,
        validity: Validity,
    ) -> Result<ClientIdentity, PkiError> {
        let key = ed25519_key()?;
        let mut params = CertificateParams::default();
        let org = role.organization();
        let common_name = org.strip_prefix("os:").unwrap_or(org);
        params.distinguished_name = dn(&[
            (DnType::OrganizationName, org),
            (DnType::CommonName, common_name),
        ]);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(ClientIdentity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// A client certificate with arbitrary extended key usages, to test apid's "exactly ClientAuth" rule.
    pub fn client_identity_with_eku(
        &self,
        role: &ClientRole,
        ekus: Vec<ExtendedKeyUsagePurpose>,
    ) -> Result<ClientIdentity, PkiError> {
        let key = ed25519_key()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = dn(&[(DnType::OrganizationName, role.organization())]);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = ekus;
        let validity = Validity::one_year();
        params.not_before = validity.not_before.into();
        params.not_after = validity.not_after.into();
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(ClientIdentity {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// Render a talosconfig as `talosctl` writes it (gopkg.in/yaml.v3, four-space indent, field order of
/// `pkg/machinery/client/config.Context`): one context named after the cluster, ca/crt/key base64 PEM,
/// the key under Talos's `ED25519 PRIVATE KEY` label.
pub fn talosconfig_yaml(
    context: &str,
    endpoints: &[Ipv4Addr],
    nodes: &[Ipv4Addr],
    ca_pem: &str,
    identity: &ClientIdentity,
) -> String {
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text.as_bytes());
    let mut out = String::new();
    out.push_str(&format!("context: {context}\ncontexts:\n    {context}:\n"));
    out.push_str("        endpoints:\n");
    for endpoint in endpoints {
        out.push_str(&format!("            - {endpoint}\n"));
    }
    if !nodes.is_empty() {
        out.push_str("        nodes:\n");
        for node in nodes {
            out.push_str(&format!("            - {node}\n"));
        }
    }
    out.push_str(&format!("        ca: {}\n", b64(ca_pem)));
    out.push_str(&format!("        crt: {}\n", b64(&identity.cert_pem)));
    out.push_str(&format!(
        "        key: {}\n",
        b64(&identity.talos_key_pem())
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_cert_carries_role_and_client_auth_only() {
        let ca = CertAuthority::generate().unwrap();
        let id = ca
            .client_identity(&ClientRole::Reader, Validity::one_year())
            .unwrap();
        let der = rustls_pki_types::pem::PemObject::from_pem_slice(id.cert_pem.as_bytes());
        let der: CertificateDer<'static> = der.unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&der).unwrap();
        let orgs: Vec<_> = cert
            .subject()
            .iter_organization()
            .map(|o| o.as_str().unwrap().to_string())
            .collect();
        assert_eq!(orgs, vec!["os:reader".to_string()]);
        let eku = cert.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.client_auth && !eku.server_auth && eku.other.is_empty());
        assert!(
            id.talos_key_pem()
                .starts_with("-----BEGIN ED25519 PRIVATE KEY-----")
        );
    }

    #[test]
    fn talosconfig_shape() {
        let ca = CertAuthority::generate().unwrap();
        let id = ca
            .client_identity(&ClientRole::Admin, Validity::one_year())
            .unwrap();
        let yaml = talosconfig_yaml(
            "demo",
            &[Ipv4Addr::new(127, 1, 2, 1), Ipv4Addr::new(127, 1, 2, 2)],
            &[Ipv4Addr::new(127, 1, 2, 1)],
            ca.cert_pem(),
            &id,
        );
        let value: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(value["context"].as_str(), Some("demo"));
        let ctx = &value["contexts"]["demo"];
        assert_eq!(ctx["endpoints"][1].as_str(), Some("127.1.2.2"));
        assert_eq!(ctx["nodes"][0].as_str(), Some("127.1.2.1"));
        let key = base64::engine::general_purpose::STANDARD
            .decode(ctx["key"].as_str().unwrap())
            .unwrap();
        assert!(
            String::from_utf8(key)
                .unwrap()
                .contains("ED25519 PRIVATE KEY")
        );
        assert!(yaml.starts_with("context: demo\ncontexts:\n    demo:\n        endpoints:\n"));
    }
}
