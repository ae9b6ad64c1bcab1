//! An HTTP client whose bearer token and CA come from a Secret, cached for a TTL: what the alert
//! gate's Prometheus client ([`crate::holds::alerts`]) and the Alertmanager client
//! ([`crate::silences`]) share. Each says its own problems in its own words ([`AuthError`] is the
//! problem, not the sentence).
//!
//! Without a Secret: one client, verifying `https` against the platform's roots. With one: its
//! `token` (optional) becomes the `Authorization: Bearer` header, marked sensitive, and its `ca.crt`
//! (optional) the only roots of the client; both are read again once the TTL has passed, so a
//! rotated token or CA is picked up without a restart. A token is never sent over plain `http`
//! except to a loopback host, and it never appears in an error or in `Debug`.

use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Limited};
use hyper::body::{Body, Bytes};
use hyper::header::{ACCEPT, AUTHORIZATION, HeaderValue, USER_AGENT};
use hyper::{Method, Request, StatusCode};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;

use crate::holds::alerts::{self, CA_KEY, TOKEN_KEY};

/// A client for request bodies of type `B`.
pub type HttpClient<B> = Client<HttpsConnector<HttpConnector>, B>;

/// Why no client could be had from the auth Secret. The caller names the Secret and the flag.
#[derive(Debug)]
pub enum AuthError {
    /// The Secret could not be read.
    Unreadable(kube::Error),
    /// It does not exist.
    Missing,
    /// It holds a token, and the URL is plain `http` to a host that is not loopback.
    TokenOverPlainHttp,
    /// Its token cannot be an HTTP header value.
    BadToken,
    /// Its `ca.crt` cannot be used; the problem, as the end of a sentence.
    BadCa(String),
    /// The client for its CA could not be built.
    Client(String),
}

/// The client and the Authorization header to send with it: one shared instance per URL.
pub struct SecretAuth<B> {
    https: bool,
    loopback: bool,
    secret: Option<(String, String)>,
    /// The controller's own client, which reads the Secret.
    secrets: kube::Client,
    ttl: Duration,
    /// Without a Secret: the one client.
    plain: Option<HttpClient<B>>,
    /// With one: what it held when last read, and the client built for its CA.
    cache: tokio::sync::Mutex<Option<Cached<B>>>,
}

struct Cached<B> {
    read_at: Instant,
    /// The Authorization header, marked sensitive.
    bearer: Option<HeaderValue>,
    client: HttpClient<B>,
}

impl<B> SecretAuth<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
{
    /// `https` and `loopback` are the URL's (see [`alerts::check_url`]). Without a Secret, the
    /// plain client is built here: a failure to load the platform's roots stops the caller at start.
    pub fn new(
        https: bool,
        loopback: bool,
        secret: Option<(String, String)>,
        secrets: kube::Client,
        ttl: Duration,
    ) -> Result<SecretAuth<B>, alerts::ConfigError> {
        let plain = match secret {
            Some(_) => None,
            None => Some(http_client(None, https)?),
        };
        Ok(SecretAuth {
            https,
            loopback,
            secret,
            secrets,
            ttl,
            plain,
            cache: tokio::sync::Mutex::new(None),
        })
    }

    /// The Secret, `(namespace, name)`, if there is one.
    pub fn secret(&self) -> Option<&(String, String)> {
        self.secret.as_ref()
    }

    /// The client and Authorization header to use: from the Secret (read again once the TTL has
    /// passed), or the plain client without one.
    pub async fn connection(&self) -> Result<(HttpClient<B>, Option<HeaderValue>), AuthError> {
        let Some((namespace, name)) = &self.secret else {
            let plain = self.plain.clone().expect("built without an auth Secret");
            return Ok((plain, None));
        };
        let mut cache = self.cache.lock().await;
        if let Some(cached) = cache
            .as_ref()
            .filter(|cached| cached.read_at.elapsed() < self.ttl)
        {
            return Ok((cached.client.clone(), cached.bearer.clone()));
        }
        let secret = Api::<Secret>::namespaced(self.secrets.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(AuthError::Unreadable)?
            .ok_or(AuthError::Missing)?;
        let data = secret.data.unwrap_or_default();
        let token = data
            .get(TOKEN_KEY)
            .map(|bytes| String::from_utf8_lossy(&bytes.0).trim().to_string())
            .filter(|token| !token.is_empty());
        let bearer = match token {
            None => None,
            Some(_) if !self.https && !self.loopback => return Err(AuthError::TokenOverPlainHttp),
            Some(token) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| AuthError::BadToken)?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        let roots = match data.get(CA_KEY) {
            None => None,
            Some(pem) => Some(alerts::ca_roots(&pem.0).map_err(AuthError::BadCa)?),
        };
        let client =
            http_client(roots, self.https).map_err(|error| AuthError::Client(error.to_string()))?;
        *cache = Some(Cached {
            read_at: Instant::now(),
            bearer: bearer.clone(),
            client: client.clone(),
        });
        Ok((client, bearer))
    }
}

/// A client verifying `https` against `roots` (`None`: the platform's roots), never unverified.
fn http_client<B>(
    roots: Option<rustls::RootCertStore>,
    https: bool,
) -> Result<HttpClient<B>, alerts::ConfigError>
where
    B: Body + Send,
    B::Data: Send,
{
    Ok(Client::builder(TokioExecutor::new()).build(alerts::connector(roots, https)?))
}

/// A request asking for JSON, with the controller's User-Agent and `bearer` when there is one.
pub fn request(
    method: Method,
    uri: String,
    bearer: Option<HeaderValue>,
) -> hyper::http::request::Builder {
    let mut request = Request::builder()
        .method(method)
        .uri(uri)
        .header(ACCEPT, "application/json")
        .header(
            USER_AGENT,
            concat!("talos-upgrade-controller/", env!("CARGO_PKG_VERSION")),
        );
    if let Some(bearer) = bearer {
        request = request.header(AUTHORIZATION, bearer);
    }
    request
}

/// Why an exchange brought no answer.
#[derive(Debug)]
pub enum ExchangeError {
    /// No answer came: the error and its causes ([`with_causes`]).
    Unreachable(String),
    /// The answer's body could not be read, or is longer than allowed.
    Reading(String),
}

/// Sends `request` and reads at most `max_bytes` of the answer: its status and body.
pub async fn exchange<B>(
    http: &HttpClient<B>,
    request: Request<B>,
    max_bytes: usize,
) -> Result<(StatusCode, Bytes), ExchangeError>
where
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let response = http
        .request(request)
        .await
        .map_err(|error| ExchangeError::Unreachable(with_causes(&error)))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|error| ExchangeError::Reading(error.to_string()))?
        .to_bytes();
    Ok((status, body))
}

/// An error and its causes, `outer: inner: innermost` (hyper's own message alone does not say
/// whether the connection or the certificate failed).
pub fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}
