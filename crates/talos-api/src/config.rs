//! talosconfig parsing and the mTLS credentials in it.
//!
//! A talosconfig (`pkg/machinery/client/config` in Talos) looks like:
//!
//! ```yaml
//! context: mycluster
//! contexts:
//!   mycluster:
//!     endpoints: [10.0.0.2, 10.0.0.3]
//!     nodes: [10.0.0.5]
//!     ca: <base64 of PEM CERTIFICATE: the Talos OS CA>
//!     crt: <base64 of PEM client certificate>
//!     key: <base64 of PEM client private key>
//! ```
//!
//! Other fields (`cluster`, `auth`, `proxy-url`, ...) are ignored. Talos writes Ed25519 keys as PKCS#8
//! under the non-standard PEM label `ED25519 PRIVATE KEY`, which rustls refuses; [`TalosCredentials`]
//! relabels them to `PRIVATE KEY` (the body is already PKCS#8).
//!
//! Nothing here ever puts key material into an error, a `Debug` rendering or a log line.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use serde::{Deserialize, Deserializer};

use super::error::{Result, TalosError};

/// A parsed talosconfig.
#[derive(Debug, Clone, Deserialize)]
pub struct Talosconfig {
    /// Name of the current context.
    #[serde(default)]
    context: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    contexts: BTreeMap<String, Context>,
}

/// One talosconfig context: where to connect and with which credentials.
#[derive(Clone, Deserialize)]
pub struct Context {
    /// Filled in from the map key after parsing, so errors can name the context.
    #[serde(skip)]
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    endpoints: Vec<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    nodes: Vec<String>,
    // The credential fields are taken as raw YAML values so that a wrongly typed value never ends up
    // in a serde error message (serde quotes offending scalars).
    #[serde(default)]
    ca: Option<serde_yaml::Value>,
    #[serde(default)]
    crt: Option<serde_yaml::Value>,
    #[serde(default)]
    key: Option<serde_yaml::Value>,
}

/// The PEM credentials of a talosconfig context, ready for TLS: the Talos OS CA, the client
/// certificate and the client key (relabelled to a label rustls accepts).
///
/// `Debug` shows only sizes and redacts the key. Fields are private so the key cannot be printed by
/// accident; use the accessors.
#[derive(Clone)]
pub struct TalosCredentials {
    ca_pem: String,
    crt_pem: String,
    key_pem: String,
}

impl Talosconfig {
    /// Parse a talosconfig from YAML. Unknown fields are ignored. Credentials are decoded lazily by
    /// [`Context::credentials`], so a broken context does not prevent using another one.
    pub fn from_yaml(yaml: &str) -> Result<Talosconfig> {
        let mut config: Talosconfig = serde_yaml::from_str(yaml).map_err(|e| {
            // serde_yaml messages carry a location and a type description; since every secret field
            // is deserialized as an untyped value, they cannot contain key material.
            TalosError::Config(format!("talosconfig is not valid: {e}"))
        })?;
        for (name, context) in &mut config.contexts {
            context.name.clone_from(name);
        }
        Ok(config)
    }

    /// Name of the current context (`context:`), if set.
    pub fn current_context_name(&self) -> Option<&str> {
        self.context.as_deref().filter(|c| !c.is_empty())
    }

    /// The current context.
    pub fn current_context(&self) -> Result<&Context> {
        let name = self.current_context_name().ok_or_else(|| {
            TalosError::Config(
                "talosconfig has no current context (field `context` is empty)".into(),
            )
        })?;
        self.context(name)
    }

    /// The context called `name`.
    pub fn context(&self, name: &str) -> Result<&Context> {
        self.contexts.get(name).ok_or_else(|| {
            let known: Vec<String> = self.contexts.keys().map(|k| format!("{k:?}")).collect();
            TalosError::Config(format!(
                "talosconfig context {name:?} not found (contexts: {})",
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ))
        })
    }

    /// All contexts, by name.
    pub fn contexts(&self) -> impl Iterator<Item = &Context> {
        self.contexts.values()
    }
}

impl Context {
    /// The context's name (its key under `contexts`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// apid endpoints (control-plane nodes), as written: IPs, `host[:port]` or URLs.
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Default target nodes, as written.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Decode `ca`, `crt` and `key` (base64 of PEM) into credentials. Errors name the context and the
    /// field but never include the field's value.
    pub fn credentials(&self) -> Result<TalosCredentials> {
        let what = format!("talosconfig context {:?}", self.name);
        let ca = decode_field(&what, "ca", self.ca.as_ref())?;
        let crt = decode_field(&what, "crt", self.crt.as_ref())?;
        let key = decode_field(&what, "key", self.key.as_ref())?;
        TalosCredentials::build(&what, ca, crt, key)
    }
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .field("endpoints", &self.endpoints)
            .field("nodes", &self.nodes)
            .field("ca", &self.ca.as_ref().map(|_| "<set>"))
            .field("crt", &self.crt.as_ref().map(|_| "<set>"))
            .field("key", &self.key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl TalosCredentials {
    /// Build credentials from PEM text (for example certificates generated in a test or read from a
    /// Secret). Accepts the key labels `PRIVATE KEY`, `ED25519 PRIVATE KEY` (relabelled),
    /// `RSA PRIVATE KEY` and `EC PRIVATE KEY`.
    pub fn from_pem(
        ca_pem: impl Into<String>,
        crt_pem: impl Into<String>,
        key_pem: impl Into<String>,
    ) -> Result<TalosCredentials> {
        Self::build(
            "Talos credentials",
            ca_pem.into(),
            crt_pem.into(),
            key_pem.into(),
        )
    }

    fn build(what: &str, ca: String, crt: String, key: String) -> Result<TalosCredentials> {
        check_certificates(what, "ca", &ca)?;
        check_certificates(what, "crt", &crt)?;
        let key = normalize_key(what, &key)?;
        Ok(TalosCredentials {
            ca_pem: ca,
            crt_pem: crt,
            key_pem: key,
        })
    }

    /// PEM of the Talos OS CA (one or more `CERTIFICATE` blocks).
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// PEM of the client certificate (chain).
    pub fn crt_pem(&self) -> &str {
        &self.crt_pem
    }

    /// PEM of the client private key, with a label rustls accepts. Secret: never log it.
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }
}

impl fmt::Debug for TalosCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TalosCredentials")
            .field("ca_pem", &format_args!("<{} bytes>", self.ca_pem.len()))
            .field("crt_pem", &format_args!("<{} bytes>", self.crt_pem.len()))
            .field("key_pem", &format_args!("<redacted>"))
            .finish()
    }
}

/// Accept `null` where a collection is expected (`endpoints: null`, `contexts:` with nothing under it).
fn null_as_default<'de, D, T>(d: D) -> std::result::Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// base64-decode a credential field into PEM text.
fn decode_field(what: &str, field: &str, value: Option<&serde_yaml::Value>) -> Result<String> {
    let text = match value {
        None | Some(serde_yaml::Value::Null) => {
            return Err(TalosError::Config(format!(
                "{what}: field `{field}` is missing"
            )));
        }
        Some(serde_yaml::Value::String(s)) => s,
        Some(_) => {
            return Err(TalosError::Config(format!(
                "{what}: field `{field}` must be a base64 string"
            )));
        }
    };
    // Go writes one unbroken line, but hand-edited files may wrap; whitespace is never part of base64.
    let compact: String = text.chars().filter(|c| !c.is_ascii_whitespace()).collect();
    if compact.is_empty() {
        return Err(TalosError::Config(format!(
            "{what}: field `{field}` is empty"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(compact.as_bytes())
        .map_err(|_| TalosError::Config(format!("{what}: field `{field}` is not valid base64")))?;
    String::from_utf8(bytes).map_err(|_| {
        TalosError::Config(format!(
            "{what}: field `{field}` does not decode to PEM text"
        ))
    })
}

fn check_certificates(what: &str, field: &str, pem: &str) -> Result<()> {
    let mut count = 0usize;
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        cert.map_err(|_| {
            TalosError::Config(format!(
                "{what}: field `{field}` holds a malformed PEM certificate"
            ))
        })?;
        count += 1;
    }
    if count == 0 {
        return Err(TalosError::Config(format!(
            "{what}: field `{field}` holds no PEM CERTIFICATE"
        )));
    }
    Ok(())
}

/// PEM labels of private keys we accept. Talos uses `ED25519 PRIVATE KEY` for Ed25519 (PKCS#8 body);
/// older clusters may have RSA or ECDSA keys.
const KEY_LABELS: [&str; 4] = [
    "PRIVATE KEY",
    "ED25519 PRIVATE KEY",
    "RSA PRIVATE KEY",
    "EC PRIVATE KEY",
];

/// Check the key's PEM label, relabel Talos's Ed25519 label, and make sure rustls-pki-types parses it.
fn normalize_key(what: &str, pem: &str) -> Result<String> {
    let label = pem
        .lines()
        .map(str::trim)
        .find_map(|l| {
            l.strip_prefix("-----BEGIN ")
                .and_then(|l| l.strip_suffix("-----"))
        })
        .ok_or_else(|| {
            TalosError::Config(format!("{what}: field `key` holds no PEM private key"))
        })?;
    if !KEY_LABELS.contains(&label) {
        // The label is not secret (it is a header such as "CERTIFICATE").
        return Err(TalosError::Config(format!(
            "{what}: field `key` has PEM label {label:?}; expected one of {}",
            KEY_LABELS.map(|l| format!("{l:?}")).join(", ")
        )));
    }
    let key = if label == "ED25519 PRIVATE KEY" {
        pem.replace(
            "-----BEGIN ED25519 PRIVATE KEY-----",
            "-----BEGIN PRIVATE KEY-----",
        )
        .replace(
            "-----END ED25519 PRIVATE KEY-----",
            "-----END PRIVATE KEY-----",
        )
    } else {
        pem.to_owned()
    };
    // Only PEM framing and base64 are checked here; whether rustls can use the key (and whether it
    // matches the certificate) is checked when a client is built. The parser's error is dropped on
    // purpose: its text could quote part of the input.
    PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|_| {
        TalosError::Config(format!(
            "{what}: field `key` is not a parsable PEM private key"
        ))
    })?;
    Ok(key)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use base64::engine::general_purpose::STANDARD as B64;

    /// A CA, and a client certificate with its key, generated by rcgen.
    pub(crate) struct TestPki {
        pub ca_pem: String,
        pub crt_pem: String,
        /// Key as rcgen writes it: PKCS#8 under `PRIVATE KEY`.
        pub key_pem: String,
    }

    pub(crate) fn test_pki(alg: &'static rcgen::SignatureAlgorithm) -> TestPki {
        let ca_key = rcgen::KeyPair::generate_for(alg).expect("ca key");
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "talos");
        let ca_cert = ca_params.self_signed(&ca_key).expect("ca cert");
        let issuer = rcgen::Issuer::new(ca_params, ca_key);

        let key = rcgen::KeyPair::generate_for(alg).expect("client key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "os:admin");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).expect("client cert");
        TestPki {
            ca_pem: ca_cert.pem(),
            crt_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// Relabel a PKCS#8 PEM the way Talos writes Ed25519 keys.
    pub(crate) fn talos_ed25519_label(pkcs8_pem: &str) -> String {
        pkcs8_pem
            .replace("BEGIN PRIVATE KEY", "BEGIN ED25519 PRIVATE KEY")
            .replace("END PRIVATE KEY", "END ED25519 PRIVATE KEY")
    }

    pub(crate) fn talosconfig_yaml(ca: &str, crt: &str, key: &str) -> String {
        format!(
            "context: prod\n\
             contexts:\n  \
               prod:\n    \
                 endpoints:\n      - 10.0.0.2\n      - 10.0.0.3:50001\n    \
                 nodes: [10.0.0.5]\n    \
                 ca: {}\n    crt: {}\n    key: {}\n    \
                 cluster: prod\n    \
                 auth:\n      siderov1:\n        identity: someone@example.com\n  \
               other:\n    endpoints: null\n    ca: x\n\
             preferences: {{}}\n",
            B64.encode(ca),
            B64.encode(crt),
            B64.encode(key)
        )
    }

    /// The base64 body of the key's PEM; no error or Debug output may contain any of it.
    fn key_body(pem: &str) -> String {
        pem.lines()
            .filter(|l| !l.starts_with("-----"))
            .collect::<String>()
    }

    fn assert_no_key_material(text: &str, pem_key: &str) {
        let body = key_body(pem_key);
        // Any 16-character window of the key body would betray part of the key.
        for start in (0..body.len().saturating_sub(16)).step_by(8) {
            let window = &body[start..start + 16];
            assert!(
                !text.contains(window),
                "output contains key material: {text}"
            );
        }
        assert!(
            !text.contains(&B64.encode(pem_key)[..32]),
            "output contains base64 key: {text}"
        );
    }

    #[test]
    fn parses_ed25519_talos_label_and_relabels() {
        let pki = test_pki(&rcgen::PKCS_ED25519);
        let talos_key = talos_ed25519_label(&pki.key_pem);
        assert!(talos_key.contains("BEGIN ED25519 PRIVATE KEY"));
        let cfg = Talosconfig::from_yaml(&talosconfig_yaml(&pki.ca_pem, &pki.crt_pem, &talos_key))
            .unwrap();

        assert_eq!(cfg.current_context_name(), Some("prod"));
        let ctx = cfg.current_context().unwrap();
        assert_eq!(ctx.name(), "prod");
        assert_eq!(ctx.endpoints(), ["10.0.0.2", "10.0.0.3:50001"]);
        assert_eq!(ctx.nodes(), ["10.0.0.5"]);

        let creds = ctx.credentials().unwrap();
        assert_eq!(creds.ca_pem(), pki.ca_pem);
        assert_eq!(creds.crt_pem(), pki.crt_pem);
        assert!(creds.key_pem().starts_with("-----BEGIN PRIVATE KEY-----"));
        assert!(
            creds
                .key_pem()
                .trim_end()
                .ends_with("-----END PRIVATE KEY-----")
        );
        assert_eq!(key_body(creds.key_pem()), key_body(&pki.key_pem));

        let debug = format!("{creds:?} {ctx:?} {cfg:?}");
        assert!(debug.contains("redacted"), "{debug}");
        assert_no_key_material(&debug, &pki.key_pem);
    }

    #[test]
    fn parses_ecdsa_pkcs8_and_sec1() {
        let pki = test_pki(&rcgen::PKCS_ECDSA_P256_SHA256);
        // rcgen writes PKCS#8.
        let creds = TalosCredentials::from_pem(&pki.ca_pem, &pki.crt_pem, &pki.key_pem).unwrap();
        assert!(creds.key_pem().contains("BEGIN PRIVATE KEY"));

        // The same key as SEC1 under `EC PRIVATE KEY`, as older Talos clusters have it.
        let sec1 = pem_encode(
            "EC PRIVATE KEY",
            &pkcs8_inner_key(&pem_decode(&pki.key_pem)),
        );
        let yaml = talosconfig_yaml(&pki.ca_pem, &pki.crt_pem, &sec1);
        let creds = Talosconfig::from_yaml(&yaml)
            .unwrap()
            .current_context()
            .unwrap()
            .credentials();
        let creds = creds.unwrap();
        assert!(
            creds.key_pem().contains("BEGIN EC PRIVATE KEY"),
            "label kept"
        );
        assert!(matches!(
            PrivateKeyDer::from_pem_slice(creds.key_pem().as_bytes()),
            Ok(PrivateKeyDer::Sec1(_))
        ));
    }

    #[test]
    fn accepts_rsa_label() {
        // rcgen with ring cannot generate RSA keys, so only the label handling is checked here: the PEM
        // framing is accepted and passed through unchanged (rustls checks the DER at connect time).
        let pki = test_pki(&rcgen::PKCS_ED25519);
        let rsa_framed = pki.key_pem.replace("PRIVATE KEY", "RSA PRIVATE KEY");
        let creds = TalosCredentials::from_pem(&pki.ca_pem, &pki.crt_pem, &rsa_framed).unwrap();
        assert_eq!(creds.key_pem(), rsa_framed);
    }

    #[test]
    fn missing_and_unknown_context() {
        let pki = test_pki(&rcgen::PKCS_ED25519);
        let yaml = talosconfig_yaml(&pki.ca_pem, &pki.crt_pem, &pki.key_pem);

        let cfg =
            Talosconfig::from_yaml(&yaml.replace("context: prod", "context: staging")).unwrap();
        let err = cfg.current_context().unwrap_err().to_string();
        assert!(err.contains("\"staging\" not found"), "{err}");
        assert!(err.contains("\"prod\""), "lists known contexts: {err}");

        let cfg = Talosconfig::from_yaml(&yaml.replace("context: prod\n", "")).unwrap();
        let err = cfg.current_context().unwrap_err().to_string();
        assert!(err.contains("no current context"), "{err}");

        let cfg = Talosconfig::from_yaml("context: a\n").unwrap();
        let err = cfg.current_context().unwrap_err().to_string();
        assert!(err.contains("contexts: none"), "{err}");
    }

    #[test]
    fn broken_fields_name_context_and_field_without_key_material() {
        let pki = test_pki(&rcgen::PKCS_ED25519);
        let key_b64 = B64.encode(talos_ed25519_label(&pki.key_pem));
        let yaml = talosconfig_yaml(
            &pki.ca_pem,
            &pki.crt_pem,
            &talos_ed25519_label(&pki.key_pem),
        );

        // Bad base64: corrupt the middle of the encoded key.
        let mut broken = key_b64.clone();
        broken.replace_range(40..44, "!!!!");
        let cfg = Talosconfig::from_yaml(&yaml.replace(&key_b64, &broken)).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "talosconfig context \"prod\": field `key` is not valid base64"
        );

        // Valid base64 of something that is not PEM.
        let cfg = Talosconfig::from_yaml(&yaml.replace(&key_b64, &B64.encode("hello"))).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("field `key` holds no PEM private key"),
            "{err}"
        );

        // PEM with a corrupted body.
        let corrupted = talos_ed25519_label(&pki.key_pem).replacen("M", "*", 1);
        let cfg = Talosconfig::from_yaml(&yaml.replace(&key_b64, &B64.encode(&corrupted))).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a parsable PEM private key"), "{err}");
        assert_no_key_material(&err, &pki.key_pem);

        // A certificate where the key belongs.
        let cfg =
            Talosconfig::from_yaml(&yaml.replace(&key_b64, &B64.encode(&pki.crt_pem))).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert!(err.contains("PEM label \"CERTIFICATE\""), "{err}");

        // Wrong type: a number; serde must not quote it.
        let cfg = Talosconfig::from_yaml(&yaml.replace(&key_b64, "12345678901234567")).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("must be a base64 string") && !err.contains("12345"),
            "{err}"
        );

        // Missing CA in another context.
        let cfg = Talosconfig::from_yaml(&yaml).unwrap();
        let err = cfg
            .context("other")
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("context \"other\": field `ca` is not valid base64"),
            "{err}"
        );

        let yaml_no_key = yaml.replace(&format!("key: {key_b64}"), "");
        let cfg = Talosconfig::from_yaml(&yaml_no_key).unwrap();
        let err = cfg
            .current_context()
            .unwrap()
            .credentials()
            .unwrap_err()
            .to_string();
        assert_eq!(err, "talosconfig context \"prod\": field `key` is missing");

        // Broken YAML syntax.
        let err = Talosconfig::from_yaml("contexts: [unclosed").unwrap_err();
        assert!(matches!(err, TalosError::Config(_)));
        assert!(err.to_string().starts_with("talosconfig is not valid"));
    }

    #[test]
    fn ca_must_hold_a_certificate() {
        let pki = test_pki(&rcgen::PKCS_ED25519);
        let err = TalosCredentials::from_pem("junk", &pki.crt_pem, &pki.key_pem).unwrap_err();
        assert!(
            err.to_string()
                .contains("field `ca` holds no PEM CERTIFICATE"),
            "{err}"
        );
    }

    // Minimal DER/PEM helpers to turn rcgen's PKCS#8 EC key into SEC1.

    fn pem_decode(pem: &str) -> Vec<u8> {
        B64.decode(key_body(pem)).unwrap()
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        let b64 = B64.encode(der);
        let lines: Vec<&str> = b64
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }

    /// Read one DER TLV at `pos`; returns (tag, content range, next position).
    fn der_tlv(der: &[u8], pos: usize) -> (u8, std::ops::Range<usize>, usize) {
        let tag = der[pos];
        let first = der[pos + 1] as usize;
        let (len, header) = if first < 0x80 {
            (first, 2)
        } else {
            let n = first & 0x7f;
            let len = der[pos + 2..pos + 2 + n]
                .iter()
                .fold(0usize, |acc, b| (acc << 8) | *b as usize);
            (len, 2 + n)
        };
        let start = pos + header;
        (tag, start..start + len, start + len)
    }

    /// PrivateKeyInfo ::= SEQUENCE { version INTEGER, algorithm SEQUENCE, privateKey OCTET STRING }:
    /// the OCTET STRING holds the SEC1 ECPrivateKey.
    fn pkcs8_inner_key(der: &[u8]) -> Vec<u8> {
        let (tag, body, _) = der_tlv(der, 0);
        assert_eq!(tag, 0x30);
        let (_, _, pos) = der_tlv(der, body.start); // version
        let (_, _, pos) = der_tlv(der, pos); // algorithm
        let (tag, key, _) = der_tlv(der, pos);
        assert_eq!(tag, 0x04);
        der[key].to_vec()
    }
}
