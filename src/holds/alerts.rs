//! The alert gate's IO (issue #23): asks Prometheus, over its HTTP API, which alerts are firing for a
//! cluster, and hands the answer to the pure decision ([`talos_upgrade_core::alert_gate`]).
//!
//! Two instant queries (`GET /api/v1/query`) per look, made at once: `ALERTS{alertstate="firing",...}`
//! decides what holds, `ALERTS_FOR_STATE{...}` (whose values are the alerts' `activeAt`) says since
//! when. Queries rather than `/api/v1/alerts`: the operator's selector is PromQL that Prometheus
//! itself evaluates (no second implementation of label matching and regular expressions here), and
//! `ALERTS` also holds the alerts of other rule evaluators when the URL is a Thanos or Mimir query
//! front end, which `/api/v1/alerts` of one server would not show.
//!
//! Whatever keeps Prometheus from answering (no connection, a timeout, an HTTP error, an error in
//! the answer, an answer that is not an instant vector) is [`ExternalCheck::Unknown`]: it holds and
//! says why, and never counts as "no alerts".
//!
//! Transport: `https` is verified with rustls (ring) against the CA in the auth Secret's `ca.crt`
//! when there is one, else against the platform's roots; never unverified. Plain `http` is accepted
//! (an in-cluster Prometheus usually serves it) but a bearer token is only ever sent over `https` or
//! to a loopback host. Redirects are not followed: one could carry the token elsewhere.
//!
//! Secrets: the token is read from the Secret by the controller's client, kept only in the request
//! header (marked sensitive), and never appears in logs, events, metrics or errors.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::Method;
use hyper::Uri;
use hyper::body::Bytes;
use hyper::header::HeaderValue;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use jiff::Timestamp;
use kube::ResourceExt;
use serde::Deserialize;

use talos_upgrade_core::alert_gate::{
    self, AlertGate, Answer, ClusterNames, Query, Selector, Series,
};
use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::holds::ExternalCheck;
use talos_upgrade_core::intent::InvalidOption;
use talos_upgrade_core::talos::Run;

use crate::http_auth::{self, AuthError, ExchangeError, SecretAuth};

/// The Secret key of the bearer token (optional).
pub const TOKEN_KEY: &str = "token";
/// The Secret key of the CA certificate(s), PEM, that sign Prometheus's certificate (optional).
pub const CA_KEY: &str = "ca.crt";
/// How long one look may take, both queries included: a reconcile waits for it.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// How long the auth Secret is reused before it is read again: a rotated token or CA is picked up
/// within this, and a fleet's reconciles do not each read the Secret.
pub const SECRET_TTL: Duration = Duration::from_secs(60);
/// Largest answer accepted: a selector matching thousands of alerts is a misconfiguration, and its
/// answer must not take the controller's memory.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// The operator-wide alert gate settings (flags `--prometheus-url`, `--prometheus-auth-secret`,
/// `--alert-selector`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AlertGateConfig {
    pub url: String,
    /// `(namespace, name)` of the Secret with `token` and/or `ca.crt`.
    pub auth_secret: Option<(String, String)>,
    pub selector: Selector,
    /// How long one look may take ([`TIMEOUT`] from the flags).
    pub timeout: Duration,
    /// How long the auth Secret is reused ([`SECRET_TTL`] from the flags; tests shorten it).
    pub secret_ttl: Duration,
}

/// Why the alert gate cannot be configured; the controller does not start with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--prometheus-url {url:?} is not an absolute http(s) URL")]
    InvalidUrl { url: String },
    #[error(
        "--prometheus-url must not carry credentials (they would end up in logs): use --prometheus-auth-secret"
    )]
    CredentialsInUrl,
    #[error("--prometheus-url {url:?} must not have a query or fragment")]
    QueryInUrl { url: String },
    #[error("--prometheus-auth-secret {value:?} is not <namespace>/<name>")]
    InvalidSecret { value: String },
    #[error("--alert-selector {value:?} is not a label selector: {reason}")]
    InvalidSelector { value: String, reason: String },
    #[error("cannot load the platform's root certificates to verify Prometheus: {0}")]
    RootCertificates(String),
}

/// The base URL without a trailing `/`, whether it is https, and whether its host is a loopback one.
pub(crate) fn check_url(url: &str) -> Result<(&str, bool, bool), ConfigError> {
    let invalid = || ConfigError::InvalidUrl {
        url: url.to_string(),
    };
    let base = url.trim().trim_end_matches('/');
    let uri: Uri = base.parse().map_err(|_| invalid())?;
    let https = match uri.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err(invalid()),
    };
    let authority = uri.authority().ok_or_else(invalid)?;
    if authority.as_str().contains('@') {
        return Err(ConfigError::CredentialsInUrl);
    }
    if uri.query().is_some() || base.contains('#') {
        return Err(ConfigError::QueryInUrl {
            url: url.to_string(),
        });
    }
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    Ok((base, https, loopback))
}

/// `<namespace>/<name>`.
pub fn parse_secret_ref(value: &str) -> Result<(String, String), ConfigError> {
    match value.trim().split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_string(), name.to_string()))
        }
        _ => Err(ConfigError::InvalidSecret {
            value: value.to_string(),
        }),
    }
}

/// `--alert-selector`.
pub fn parse_selector(value: &str) -> Result<Selector, ConfigError> {
    Selector::parse(value).map_err(|reason| ConfigError::InvalidSelector {
        value: value.to_string(),
        reason,
    })
}

type HttpClient = http_auth::HttpClient<Empty<Bytes>>;

/// The alert gate's Prometheus: cheap to clone, shared by every reconcile.
#[derive(Clone)]
pub struct Prometheus {
    inner: Arc<Inner>,
}

struct Inner {
    /// The base URL, without a trailing `/`.
    base: String,
    /// The base URL as it appears in messages (no user info: refused anyway).
    shown: String,
    selector: Selector,
    timeout: Duration,
    /// The client, with the bearer token and CA of the auth Secret when there is one.
    auth: SecretAuth<Empty<Bytes>>,
}

/// Never prints the token (it does not hold it outside the cache, and the cache is not printed).
impl std::fmt::Debug for Prometheus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prometheus")
            .field("url", &self.inner.shown)
            .field("auth_secret", &self.inner.auth.secret())
            .field("selector", &self.inner.selector.to_string())
            .finish_non_exhaustive()
    }
}

impl Prometheus {
    /// Checks the configuration (a bad one stops the controller at start); no request is made.
    /// `client` is the controller's own, which reads the auth Secret.
    pub fn new(config: AlertGateConfig, client: kube::Client) -> Result<Prometheus, ConfigError> {
        let (url, https, loopback) = check_url(&config.url)?;
        let auth = SecretAuth::new(
            https,
            loopback,
            config.auth_secret,
            client,
            config.secret_ttl,
        )?;
        Ok(Prometheus {
            inner: Arc::new(Inner {
                base: url.to_string(),
                shown: url.to_string(),
                selector: config.selector,
                timeout: config.timeout,
                auth,
            }),
        })
    }

    /// The gate's answer for `cluster`: [`ExternalCheck::NotConfigured`] when its annotation says
    /// `off`. `run` is the cluster's Talos run record, if one is under way: the alerts of its nodes in
    /// flight and just done are the upgrade's own and do not hold.
    pub async fn check(
        &self,
        cluster: &KubernetesCluster,
        gate: &Result<Option<AlertGate>, InvalidOption>,
        run: Option<&Run>,
        now: Timestamp,
    ) -> ExternalCheck {
        // A run never starts with an invalid gate; should one be asked anyway, it holds.
        let gate = match gate {
            Ok(gate) => gate.as_ref(),
            Err(invalid) => {
                return ExternalCheck::Unknown {
                    reason: invalid.to_string(),
                };
            }
        };
        let namespace = cluster.namespace().unwrap_or_default();
        let name = cluster.name_any();
        // vitistack names a cluster's things after its id; a cluster without one goes by its name.
        let cluster_id = cluster.cluster_id().unwrap_or(&name);
        let names = ClusterNames {
            namespace: &namespace,
            cluster: &name,
            cluster_id,
        };
        let Some(query) = alert_gate::query(gate, &self.inner.selector, &names) else {
            return ExternalCheck::NotConfigured;
        };
        let answer = match tokio::time::timeout(self.inner.timeout, self.ask(query)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(reason)) => return ExternalCheck::Unknown { reason },
            Err(_) => {
                return ExternalCheck::Unknown {
                    reason: format!(
                        "Prometheus at {} did not answer within {:?}: the alert gate holds until it \
                         answers",
                        self.inner.shown, self.inner.timeout
                    ),
                };
            }
        };
        match alert_gate::verdict(&answer, &alert_gate::upgrade_nodes(run, now)) {
            Some(message) => ExternalCheck::Holding { message },
            None => ExternalCheck::Clear,
        }
    }

    async fn ask(&self, query: Query) -> Result<Answer, String> {
        let (http, bearer) = self.connection().await?;
        match query {
            Query::Alerts { firing, since } => {
                let (firing, since) = tokio::join!(
                    self.query(&http, bearer.as_ref(), &firing),
                    self.query(&http, bearer.as_ref(), &since),
                );
                Ok(Answer::Alerts {
                    firing: firing?,
                    since: since?,
                })
            }
            Query::Promql(expression) => {
                let series = self.query(&http, bearer.as_ref(), &expression).await?;
                Ok(Answer::Promql { expression, series })
            }
        }
    }

    /// The client and Authorization header to use: from the auth Secret (read again once
    /// [`SECRET_TTL`] has passed), or the plain client without one.
    async fn connection(&self) -> Result<(HttpClient, Option<HeaderValue>), String> {
        self.inner.auth.connection().await.map_err(|problem| {
            let (namespace, name) = self.inner.auth.secret().expect("only a Secret fails");
            let shown = format!("Secret {namespace}/{name} (--prometheus-auth-secret)");
            match problem {
                AuthError::Unreadable(error) => format!(
                    "cannot read the Prometheus auth {shown}: {error}; the alert gate holds"
                ),
                AuthError::Missing => {
                    format!("the Prometheus auth {shown} does not exist; the alert gate holds")
                }
                AuthError::TokenOverPlainHttp => format!(
                    "refusing to send the bearer token of the Prometheus auth {shown} over plain http \
                     to {}: use an https URL; the alert gate holds",
                    self.inner.shown
                ),
                AuthError::BadToken => format!(
                    "the {TOKEN_KEY:?} key of the Prometheus auth {shown} is not a usable bearer \
                     token; the alert gate holds"
                ),
                AuthError::BadCa(problem) => format!(
                    "the {CA_KEY:?} key of the Prometheus auth {shown} {problem}; the alert gate \
                     holds"
                ),
                AuthError::Client(error) => error,
            }
        })
    }

    /// One instant query; the series of its vector, or why there are none to be had.
    async fn query(
        &self,
        http: &HttpClient,
        bearer: Option<&HeaderValue>,
        query: &str,
    ) -> Result<Vec<Series>, String> {
        let shown = &self.inner.shown;
        let uri = format!("{}/api/v1/query?query={}", self.inner.base, encode(query));
        let request = http_auth::request(Method::GET, uri, bearer.cloned())
            .body(Empty::<Bytes>::new())
            .map_err(|_| format!("cannot build a query for Prometheus at {shown}"))?;
        let (status, body) = http_auth::exchange(http, request, MAX_ANSWER_BYTES)
            .await
            .map_err(|error| match error {
                ExchangeError::Unreachable(causes) => format!(
                    "Prometheus at {shown} is unreachable: {causes}; the alert gate holds until it \
                     answers"
                ),
                ExchangeError::Reading(error) => format!(
                    "reading the answer of Prometheus at {shown} failed: {error}; the alert gate holds"
                ),
            })?;
        let answer: ApiAnswer = match serde_json::from_slice(&body) {
            Ok(answer) => answer,
            Err(_) if !status.is_success() => {
                let hint = if matches!(status.as_u16(), 401 | 403) {
                    " (check the token of --prometheus-auth-secret)"
                } else {
                    ""
                };
                return Err(format!(
                    "Prometheus at {shown} answered HTTP {status}{hint}; the alert gate holds"
                ));
            }
            Err(error) => {
                return Err(format!(
                    "the answer of Prometheus at {shown} is not its API's JSON: {error}; the alert \
                     gate holds"
                ));
            }
        };
        if answer.status != "success" || !status.is_success() {
            return Err(format!(
                "Prometheus at {shown} refused the query {query:?} (HTTP {status}): {}: {}; the alert \
                 gate holds",
                answer.error_type.as_deref().unwrap_or("error"),
                answer.error.as_deref().unwrap_or("no reason given"),
            ));
        }
        let data = answer.data.ok_or_else(|| {
            format!("the answer of Prometheus at {shown} has no data; the alert gate holds")
        })?;
        if data.result_type != "vector" {
            return Err(format!(
                "the query {query:?} returns a {}, not an instant vector: the alert gate cannot tell \
                 whether it returns nothing, and holds",
                data.result_type
            ));
        }
        let samples: Vec<Sample> = serde_json::from_value(data.result).map_err(|error| {
            format!("the answer of Prometheus at {shown} is not an instant vector: {error}; the alert gate holds")
        })?;
        Ok(samples
            .into_iter()
            .map(|sample| Series {
                labels: sample.metric,
                // Prometheus writes values as strings ("1", "1764306062", "NaN").
                value: sample.value.1.parse().unwrap_or(f64::NAN),
            })
            .collect())
    }
}

/// `{"status": "success", "data": {...}}` or `{"status": "error", "errorType": ..., "error": ...}`.
#[derive(Deserialize)]
struct ApiAnswer {
    status: String,
    data: Option<ApiData>,
    #[serde(rename = "errorType")]
    error_type: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct ApiData {
    #[serde(rename = "resultType")]
    result_type: String,
    result: serde_json::Value,
}

#[derive(Deserialize)]
struct Sample {
    #[serde(default)]
    metric: BTreeMap<String, String>,
    /// `[<unix seconds>, "<value>"]`.
    value: (f64, String),
}

/// The connector of [`crate::http_auth`]'s clients, for any request body: `https` verified against `roots` (`None`: the platform's
/// roots), never unverified.
pub(crate) fn connector(
    roots: Option<rustls::RootCertStore>,
    https: bool,
) -> Result<HttpsConnector<HttpConnector>, ConfigError> {
    let builder = hyper_rustls::HttpsConnectorBuilder::new();
    // ring explicitly, as everywhere in the project; no roots are needed (or loaded) for plain http.
    let builder = match roots {
        None if https => builder
            .with_provider_and_native_roots(rustls::crypto::ring::default_provider())
            .map_err(|error| ConfigError::RootCertificates(error.to_string()))?,
        roots => builder.with_tls_config(
            rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|error| ConfigError::RootCertificates(error.to_string()))?
            .with_root_certificates(roots.unwrap_or_else(rustls::RootCertStore::empty))
            .with_no_client_auth(),
        ),
    };
    Ok(builder.https_or_http().enable_http1().build())
}

/// The certificates of a PEM bundle as the only roots; why not, as the end of a sentence.
pub(crate) fn ca_roots(pem: &[u8]) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let mut roots = rustls::RootCertStore::empty();
    for certificate in CertificateDer::pem_slice_iter(pem) {
        let certificate = certificate.map_err(|error| format!("is not PEM: {error}"))?;
        roots
            .add(certificate)
            .map_err(|error| format!("holds a certificate rustls refuses: {error}"))?;
    }
    if roots.is_empty() {
        return Err("holds no PEM certificate".to_string());
    }
    Ok(roots)
}

/// Percent-encoding of a query parameter value.
fn encode(value: &str) -> String {
    let mut encoded = String::with_capacity(value.len() * 3);
    for byte in value.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                encoded.push(byte as char)
            }
            _ => encoded.push_str(&format!("%{byte:02X}")),
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        for (url, expected) in [
            (
                "http://127.0.0.1:9090",
                ("http://127.0.0.1:9090", false, true),
            ),
            ("http://[::1]:9090/", ("http://[::1]:9090", false, true)),
            (
                "https://prometheus.monitoring.svc:9090/",
                ("https://prometheus.monitoring.svc:9090", true, false),
            ),
            (
                "http://prometheus-operated.monitoring:9090/prometheus",
                (
                    "http://prometheus-operated.monitoring:9090/prometheus",
                    false,
                    false,
                ),
            ),
        ] {
            assert_eq!(check_url(url).expect(url), expected, "{url}");
        }
        for (url, words) in [
            ("prometheus:9090", "not an absolute"),
            ("ftp://x", "not an absolute"),
            ("https://user:pw@prom", "must not carry credentials"),
            ("https://prom/?x=1", "query or fragment"),
        ] {
            let error = check_url(url).expect_err(url).to_string();
            assert!(error.contains(words), "{url}: {error}");
            assert!(!error.contains("pw"), "{error}");
        }
    }

    #[test]
    fn flags() {
        assert_eq!(
            parse_secret_ref("monitoring/prom-auth").unwrap(),
            ("monitoring".into(), "prom-auth".into())
        );
        for bad in ["prom-auth", "/x", "x/", "a/b/c"] {
            assert!(parse_secret_ref(bad).is_err(), "{bad}");
        }
        assert!(parse_selector(r#"{severity="critical",cluster="{clusterId}"}"#).is_ok());
        let error = parse_selector("severity=critical").unwrap_err().to_string();
        assert!(error.contains("--alert-selector"), "{error}");
    }

    #[test]
    fn percent_encoding() {
        assert_eq!(
            encode(r#"ALERTS{a=~"x|y"}"#),
            "ALERTS%7Ba%3D~%22x%7Cy%22%7D"
        );
    }
}
