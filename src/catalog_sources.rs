//! Where the release catalog comes from beyond the built-in lists: the operator's catalog file
//! ([`builtin_with_file`], read once at start) and the live release sources.
//!
//! Live release sources: a background task that periodically fetches the Talos Image Factory's version
//! list and a container registry's Kubernetes tag list, and merges the stable releases into the
//! catalog.
//!
//! Offline-first: the sources are off unless [`LiveConfig::enabled`], and the catalog a reconcile reads
//! ([`CatalogHandle::snapshot`]) is always complete without them: it starts as the base catalog and
//! only ever grows by the last good answer of each source. A reconcile never waits for the network:
//! the snapshot is a clone of an `Arc` held in a `tokio::sync::watch` channel.
//!
//! Every fetch is bounded: one deadline for the whole source (redirects and pages included), a size cap
//! per response, at most [`MAX_REDIRECTS`] redirects and [`MAX_PAGES`] pages. A failed fetch keeps the
//! source's last good list and is logged as a warning; URLs are logged without their query string
//! (a registry's redirect can carry a signed token there) and URLs with credentials are refused.
//!
//! TLS is verified with rustls (ring provider) against the platform's root certificates. Plain
//! `http` is accepted only for loopback hosts, which is what the tests use.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, CONTENT_LENGTH, LINK, LOCATION, USER_AGENT};
use hyper::{Request, StatusCode, Uri};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::sync::watch;

use talos_upgrade_core::catalog::{Catalog, CatalogFileError, CatalogOverride};
use talos_upgrade_core::versions::{KubernetesVersion, TalosVersion};

/// The built-in catalog, extended (or, with `replace: true`, replaced) by the operator's catalog file
/// when one is given. A file that cannot be read or parsed is an error: the controller does not start
/// with a catalog other than the one the operator asked for.
pub fn builtin_with_file(file: Option<&std::path::Path>) -> Result<Catalog, CatalogFileError> {
    let catalog = Catalog::builtin();
    match file {
        Some(path) => Ok(catalog.with_override(&load_file(path)?)),
        None => Ok(catalog),
    }
}

/// Reads and validates a catalog file.
pub fn load_file(path: &std::path::Path) -> Result<CatalogOverride, CatalogFileError> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| CatalogFileError::Read {
        origin: origin.clone(),
        source,
    })?;
    CatalogOverride::parse(&text, &origin)
}

/// The Talos Image Factory, which lists every Talos version it builds images for at `/versions`.
pub const DEFAULT_TALOS_FACTORY_URL: &str = "https://factory.talos.dev";
/// The upstream registry's tag list of the API server image, tagged with every Kubernetes release.
pub const DEFAULT_KUBERNETES_TAGS_URL: &str = "https://registry.k8s.io/v2/kube-apiserver/tags/list";
/// registry.k8s.io answers with a redirect to a regional mirror; a few hops are normal, a loop is not.
pub const MAX_REDIRECTS: usize = 5;
/// OCI registries may paginate tag lists (`Link: <…>; rel="next"`); the cap bounds a misbehaving one.
pub const MAX_PAGES: usize = 20;

/// Settings of the live sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveConfig {
    /// Fetch at all. Off by default: the controller must work with no outbound access.
    pub enabled: bool,
    /// Base URL of a Talos Image Factory; `GET <base>/versions` returns `["v1.12.0", …]`. `None`
    /// disables this source.
    pub talos_factory_url: Option<String>,
    /// Full URL of an OCI tag list (`GET /v2/<repository>/tags/list` → `{"tags": […]}`) of an image
    /// tagged with Kubernetes versions. `None` disables this source.
    pub kubernetes_tags_url: Option<String>,
    /// Time between the end of one refresh and the start of the next; the first runs at start.
    pub interval: Duration,
    /// Time before the next refresh when a source failed (capped at `interval`): a controller that
    /// starts before its network is up should not wait a whole `interval` for its first list.
    pub retry_interval: Duration,
    /// Deadline for one source's whole fetch (redirects and pages included).
    pub timeout: Duration,
    /// Largest response body accepted, per response.
    pub max_response_bytes: usize,
}

impl Default for LiveConfig {
    fn default() -> LiveConfig {
        LiveConfig {
            enabled: false,
            talos_factory_url: Some(DEFAULT_TALOS_FACTORY_URL.to_string()),
            kubernetes_tags_url: Some(DEFAULT_KUBERNETES_TAGS_URL.to_string()),
            // Releases come out every few weeks; a few fetches a day are plenty and polite.
            interval: Duration::from_secs(6 * 60 * 60),
            retry_interval: Duration::from_secs(5 * 60),
            timeout: Duration::from_secs(5),
            // registry.k8s.io's kube-apiserver list (every tag since 1.x began) is a few hundred KB.
            max_response_bytes: 4 * 1024 * 1024,
        }
    }
}

/// Why the live sources cannot start. Reported at startup so a typo fails loudly, not every 6 hours.
#[derive(Debug, thiserror::Error)]
pub enum LiveConfigError {
    #[error("release source URL {url:?} is not a valid absolute http(s) URL")]
    InvalidUrl { url: String },

    #[error(
        "release source URL {url} uses plain http, which is only allowed for loopback hosts: use https"
    )]
    InsecureUrl { url: String },

    #[error(
        "release source URL for {host} contains credentials, which are not supported (they would end up in logs)"
    )]
    CredentialsInUrl { host: String },

    #[error("the live release sources need a positive interval, retry interval and timeout")]
    ZeroDuration,

    #[error("cannot load the platform's root certificates to verify https release sources: {0}")]
    RootCertificates(std::io::Error),
}

/// How one live source is doing, for status pages, metrics and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceState {
    /// Not configured, or live sources are off.
    Disabled,
    /// The first fetch has not finished yet.
    Pending,
    /// The last fetch succeeded with this many stable releases.
    Ok { releases: usize },
    /// The last fetch failed; `kept` releases from an earlier good fetch still count.
    Failed { error: String, kept: usize },
}

/// What the refresher last published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveState {
    /// The base catalog merged with each source's last good list.
    pub catalog: Arc<Catalog>,
    pub talos: SourceState,
    pub kubernetes: SourceState,
    /// Finished refresh rounds (0 until the first one ends).
    pub rounds: u64,
}

/// A cheap, cloneable reader of the current catalog. Hand one to each reconciler.
#[derive(Debug, Clone)]
pub struct CatalogHandle {
    state: watch::Receiver<Arc<LiveState>>,
}

impl CatalogHandle {
    /// A handle that always serves `catalog` (no live sources).
    pub fn fixed(catalog: Catalog) -> CatalogHandle {
        let (_sender, state) = watch::channel(Arc::new(LiveState {
            catalog: Arc::new(catalog),
            talos: SourceState::Disabled,
            kubernetes: SourceState::Disabled,
            rounds: 0,
        }));
        CatalogHandle { state }
    }

    /// Serve `base`, and when `config.enabled`, start the refresher on the current tokio runtime
    /// (so call it from within one). The refresher stops once every handle is dropped. Errors only
    /// for a configuration that could never work; network trouble is never an error here.
    pub fn start(base: Catalog, config: &LiveConfig) -> Result<CatalogHandle, LiveConfigError> {
        if !config.enabled {
            return Ok(CatalogHandle::fixed(base));
        }
        let sources = Sources::new(config)?;
        if sources.talos.is_none() && sources.kubernetes.is_none() {
            // Enabled with every source turned off: nothing to refresh.
            return Ok(CatalogHandle::fixed(base));
        }
        Ok(CatalogHandle::spawn(base, sources, config))
    }

    fn spawn(base: Catalog, sources: Sources, config: &LiveConfig) -> CatalogHandle {
        let (sender, state) = watch::channel(Arc::new(LiveState {
            catalog: Arc::new(base.clone()),
            talos: sources
                .talos
                .as_ref()
                .map_or(SourceState::Disabled, |_| SourceState::Pending),
            kubernetes: sources
                .kubernetes
                .as_ref()
                .map_or(SourceState::Disabled, |_| SourceState::Pending),
            rounds: 0,
        }));
        tokio::spawn(refresh_loop(base, sources, config.clone(), sender));
        CatalogHandle { state }
    }

    /// The current catalog. Never blocks and never touches the network.
    pub fn snapshot(&self) -> Arc<Catalog> {
        self.state.borrow().catalog.clone()
    }

    /// The current catalog with each source's state.
    pub fn state(&self) -> Arc<LiveState> {
        self.state.borrow().clone()
    }

    /// Wait until the refresher publishes again; false once it has stopped (or never ran).
    pub async fn changed(&mut self) -> bool {
        self.state.changed().await.is_ok()
    }

    /// Yields each time the catalog's releases change (not on every refresh round): what makes the
    /// controller look at every cluster again, so a newly published release is offered in
    /// `*-available` without waiting for the idle refresh. Ends when the refresher stops.
    pub fn release_changes(&self) -> impl futures::Stream<Item = ()> + Send + Sync + 'static {
        let state = self.state.clone();
        let last = self.snapshot();
        futures::stream::unfold((state, last), |(mut state, last)| async move {
            loop {
                state.changed().await.ok()?;
                let now = state.borrow_and_update().catalog.clone();
                if now != last {
                    return Some(((), (state, now)));
                }
            }
        })
    }
}

/// The validated source URLs and the client that fetches them.
struct Sources {
    client: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    talos: Option<Uri>,
    kubernetes: Option<Uri>,
}

impl Sources {
    fn new(config: &LiveConfig) -> Result<Sources, LiveConfigError> {
        Sources::build(config, None)
    }

    /// `roots`: `None` trusts the platform's root certificates (loaded only when a source uses
    /// https); `Some` trusts exactly the given ones (tests with their own CA).
    fn build(
        config: &LiveConfig,
        roots: Option<rustls::RootCertStore>,
    ) -> Result<Sources, LiveConfigError> {
        if config.interval.is_zero() || config.retry_interval.is_zero() || config.timeout.is_zero()
        {
            return Err(LiveConfigError::ZeroDuration);
        }
        let talos = config
            .talos_factory_url
            .as_deref()
            .map(|base| validate_url(&format!("{}/versions", base.trim_end_matches('/'))))
            .transpose()?;
        let kubernetes = config
            .kubernetes_tags_url
            .as_deref()
            .map(validate_url)
            .transpose()?;
        let any_https = [&talos, &kubernetes]
            .into_iter()
            .flatten()
            .any(|uri| uri.scheme_str() == Some("https"));
        let builder = hyper_rustls::HttpsConnectorBuilder::new();
        // The ring provider explicitly: the process may have none installed as default, and the
        // project uses ring everywhere. Loopback-only http setups (tests) need no root certificates,
        // and a machine without any must still be able to run them.
        let builder = match roots {
            None if any_https => builder
                .with_provider_and_native_roots(rustls::crypto::ring::default_provider())
                .map_err(LiveConfigError::RootCertificates)?,
            roots => builder.with_tls_config(
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| LiveConfigError::RootCertificates(std::io::Error::other(e)))?
                .with_root_certificates(roots.unwrap_or_else(rustls::RootCertStore::empty))
                .with_no_client_auth(),
            ),
        };
        let connector = builder.https_or_http().enable_http1().build();
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Sources {
            client,
            talos,
            kubernetes,
        })
    }
}

/// Parse a source URL and apply the transport policy: https, or http to a loopback host; never
/// credentials in the URL.
fn validate_url(url: &str) -> Result<Uri, LiveConfigError> {
    let uri: Uri = url.parse().map_err(|_| LiveConfigError::InvalidUrl {
        url: url.to_string(),
    })?;
    check_uri(&uri)?;
    Ok(uri)
}

fn check_uri(uri: &Uri) -> Result<(), LiveConfigError> {
    let Some(authority) = uri.authority() else {
        return Err(LiveConfigError::InvalidUrl { url: redacted(uri) });
    };
    if authority.as_str().contains('@') {
        return Err(LiveConfigError::CredentialsInUrl {
            host: authority.host().to_string(),
        });
    }
    match uri.scheme_str() {
        Some("https") => Ok(()),
        Some("http") if is_loopback(authority.host()) => Ok(()),
        Some("http") => Err(LiveConfigError::InsecureUrl { url: redacted(uri) }),
        _ => Err(LiveConfigError::InvalidUrl { url: redacted(uri) }),
    }
}

fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A URL fit for logs: scheme, host, port and path; never the query (signed redirect tokens) and
/// never user info (refused anyway).
fn redacted(uri: &Uri) -> String {
    let scheme = uri.scheme_str().unwrap_or("?");
    let host = uri.host().unwrap_or("?");
    let port = uri.port_u16().map(|p| format!(":{p}")).unwrap_or_default();
    format!("{scheme}://{host}{port}{}", uri.path())
}

/// Why one fetch failed. Internal: the refresher logs it and keeps the last good data.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error("no complete answer from {url} within {after:?}")]
    Timeout { url: String, after: Duration },
    /// `reason` is the error with its causes: hyper's own message ("client error (Connect)") alone
    /// does not say whether DNS, the connection or certificate verification failed.
    #[error("request to {url} failed: {reason}")]
    Request { url: String, reason: String },
    #[error("cannot build a request for {url}")]
    InvalidRequest { url: String },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: StatusCode },
    #[error("{url} redirected without a usable Location")]
    BadRedirect { url: String },
    #[error("{url} redirected to a refused location: {reason}")]
    RefusedRedirect {
        url: String,
        reason: LiveConfigError,
    },
    #[error("more than {MAX_REDIRECTS} redirects starting at {url}")]
    TooManyRedirects { url: String },
    #[error("more than {MAX_PAGES} pages from {url}")]
    TooManyPages { url: String },
    #[error("the answer of {url} is larger than {limit} bytes")]
    TooLarge { url: String, limit: usize },
    #[error("reading the answer of {url} failed: {reason}")]
    Body { url: String, reason: String },
    #[error("the answer of {url} is not the expected JSON: {source}")]
    Json {
        url: String,
        source: serde_json::Error,
    },
    #[error("the answer of {url} lists no stable release")]
    NoReleases { url: String },
}

/// One response, body read: the status was 2xx.
struct Page {
    /// The URL that answered (after redirects), to resolve a relative `Link` against.
    uri: Uri,
    next: Option<String>,
    body: Bytes,
}

async fn get(sources: &Sources, start: &Uri, limit: usize) -> Result<Page, FetchError> {
    let mut uri = start.clone();
    for _ in 0..=MAX_REDIRECTS {
        let request = Request::get(uri.clone())
            .header(ACCEPT, "application/json")
            .header(
                USER_AGENT,
                concat!("talos-upgrade-controller/", env!("CARGO_PKG_VERSION")),
            )
            .body(Empty::<Bytes>::new())
            .map_err(|_| FetchError::InvalidRequest {
                url: redacted(&uri),
            })?;
        let response =
            sources
                .client
                .request(request)
                .await
                .map_err(|error| FetchError::Request {
                    url: redacted(&uri),
                    reason: crate::http_auth::with_causes(&error),
                })?;
        let status = response.status();
        if status.is_redirection() {
            let next = response
                .headers()
                .get(LOCATION)
                .and_then(|value| value.to_str().ok())
                .and_then(|location| resolve(&uri, location))
                .ok_or_else(|| FetchError::BadRedirect {
                    url: redacted(&uri),
                })?;
            // The same policy as configured URLs: a redirect must not downgrade to plain http.
            check_uri(&next).map_err(|reason| FetchError::RefusedRedirect {
                url: redacted(&uri),
                reason,
            })?;
            uri = next;
            continue;
        }
        if !status.is_success() {
            return Err(FetchError::Status {
                url: redacted(&uri),
                status,
            });
        }
        let too_large = || FetchError::TooLarge {
            url: redacted(&uri),
            limit,
        };
        // Refuse a declared oversize body before reading any of it.
        let declared = response
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse::<u64>().ok());
        if declared.is_some_and(|length| length > limit as u64) {
            return Err(too_large());
        }
        let next = response
            .headers()
            .get_all(LINK)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .find_map(next_link);
        let body = Limited::new(response.into_body(), limit)
            .collect()
            .await
            .map_err(|error| {
                if error.is::<http_body_util::LengthLimitError>() {
                    too_large()
                } else {
                    FetchError::Body {
                        url: redacted(&uri),
                        reason: error.to_string(),
                    }
                }
            })?
            .to_bytes();
        return Ok(Page { uri, next, body });
    }
    Err(FetchError::TooManyRedirects {
        url: redacted(start),
    })
}

/// Resolve a `Location` or `Link` target: absolute URLs as they are, absolute paths against the
/// current origin. Relative paths are not used by registries and are refused rather than guessed.
fn resolve(base: &Uri, target: &str) -> Option<Uri> {
    let target = target.trim();
    if target.starts_with('/') && !target.starts_with("//") {
        let mut parts = base.clone().into_parts();
        parts.path_and_query = Some(target.parse().ok()?);
        return Uri::from_parts(parts).ok();
    }
    let uri: Uri = target.parse().ok()?;
    uri.scheme().is_some().then_some(uri)
}

/// The target of `<…>; rel="next"` in one `Link` header value (which may hold several links).
fn next_link(header: &str) -> Option<String> {
    header.split(',').find_map(|link| {
        let (target, params) = link.split_once(';')?;
        let is_next = params.split(';').any(|param| {
            param
                .trim()
                .strip_prefix("rel=")
                .is_some_and(|rel| rel.trim_matches('"') == "next")
        });
        let target = target.trim().strip_prefix('<')?.strip_suffix('>')?;
        is_next.then(|| target.to_string())
    })
}

/// A stable release tag: `v` then exactly `MAJOR.MINOR.PATCH` in plain digits. Anything else
/// (pre-releases, `latest`, signature tags like `sha256-….sig`, tags without the `v`) is not a release
/// to advertise.
fn stable_release(tag: &str) -> Option<(u64, u64, u64)> {
    let bare = tag.strip_prefix('v')?;
    let mut parts = bare.split('.');
    let mut number = || {
        let part = parts.next()?;
        // No leading zeros: `v1.012.0` is not how either project tags a release.
        let plain = !part.is_empty()
            && part.bytes().all(|b| b.is_ascii_digit())
            && (part == "0" || !part.starts_with('0'));
        plain.then(|| part.parse::<u64>().ok()).flatten()
    };
    let version = (number()?, number()?, number()?);
    parts.next().is_none().then_some(version)
}

async fn fetch_talos(
    sources: &Sources,
    uri: &Uri,
    limit: usize,
) -> Result<Vec<TalosVersion>, FetchError> {
    let page = get(sources, uri, limit).await?;
    let tags: Vec<String> =
        serde_json::from_slice(&page.body).map_err(|source| FetchError::Json {
            url: redacted(&page.uri),
            source,
        })?;
    let releases: Vec<TalosVersion> = tags
        .iter()
        .filter_map(|tag| stable_release(tag))
        .map(|(major, minor, patch)| TalosVersion::new(major, minor, patch))
        .collect();
    if releases.is_empty() {
        return Err(FetchError::NoReleases {
            url: redacted(&page.uri),
        });
    }
    Ok(releases)
}

/// The OCI distribution spec's tag list; `tags` may be null for an empty repository.
#[derive(Deserialize)]
struct TagList {
    tags: Option<Vec<String>>,
}

async fn fetch_kubernetes(
    sources: &Sources,
    uri: &Uri,
    limit: usize,
) -> Result<Vec<KubernetesVersion>, FetchError> {
    let mut releases = Vec::new();
    let mut next = Some(uri.clone());
    let mut pages = 0;
    while let Some(uri) = next.take() {
        pages += 1;
        if pages > MAX_PAGES {
            return Err(FetchError::TooManyPages {
                url: redacted(&uri),
            });
        }
        let page = get(sources, &uri, limit).await?;
        let list: TagList =
            serde_json::from_slice(&page.body).map_err(|source| FetchError::Json {
                url: redacted(&page.uri),
                source,
            })?;
        releases.extend(
            list.tags
                .unwrap_or_default()
                .iter()
                .filter_map(|tag| stable_release(tag))
                .map(|(major, minor, patch)| KubernetesVersion::new(major, minor, patch)),
        );
        if let Some(link) = page.next {
            let target = resolve(&page.uri, &link).ok_or_else(|| FetchError::BadRedirect {
                url: redacted(&page.uri),
            })?;
            check_uri(&target).map_err(|reason| FetchError::RefusedRedirect {
                url: redacted(&page.uri),
                reason,
            })?;
            next = Some(target);
        }
    }
    if releases.is_empty() {
        return Err(FetchError::NoReleases { url: redacted(uri) });
    }
    Ok(releases)
}

/// Run `fetch` under the source's deadline.
async fn bounded<T>(
    timeout: Duration,
    uri: &Uri,
    fetch: impl Future<Output = Result<T, FetchError>>,
) -> Result<T, FetchError> {
    tokio::time::timeout(timeout, fetch)
        .await
        .unwrap_or_else(|_| {
            Err(FetchError::Timeout {
                url: redacted(uri),
                after: timeout,
            })
        })
}

/// One source's last good list and state.
struct SourceSlot<V> {
    uri: Option<Uri>,
    good: BTreeSet<V>,
    state: SourceState,
}

impl<V: Ord> SourceSlot<V> {
    fn new(uri: Option<Uri>) -> SourceSlot<V> {
        let state = if uri.is_some() {
            SourceState::Pending
        } else {
            SourceState::Disabled
        };
        SourceSlot {
            uri,
            good: BTreeSet::new(),
            state,
        }
    }

    fn record(&mut self, name: &str, result: Option<Result<Vec<V>, FetchError>>) {
        match result {
            None => {}
            Some(Ok(releases)) => {
                if !matches!(self.state, SourceState::Ok { .. }) {
                    tracing::info!(
                        source = name,
                        releases = releases.len(),
                        "release source answered"
                    );
                }
                // Replace rather than accumulate: a release the source withdrew should go too.
                self.good = releases.into_iter().collect();
                self.state = SourceState::Ok {
                    releases: self.good.len(),
                };
            }
            Some(Err(error)) => {
                tracing::warn!(
                    source = name,
                    %error,
                    kept = self.good.len(),
                    "release source failed; keeping its last good list"
                );
                self.state = SourceState::Failed {
                    error: error.to_string(),
                    kept: self.good.len(),
                };
            }
        }
    }
}

async fn refresh_loop(
    base: Catalog,
    sources: Sources,
    config: LiveConfig,
    sender: watch::Sender<Arc<LiveState>>,
) {
    let mut talos = SourceSlot::<TalosVersion>::new(sources.talos.clone());
    let mut kubernetes = SourceSlot::<KubernetesVersion>::new(sources.kubernetes.clone());
    let limit = config.max_response_bytes;
    let mut rounds = 0;
    loop {
        // Both sources at once, so a hanging one does not delay the other.
        let round = async {
            tokio::join!(
                async {
                    match &talos.uri {
                        Some(uri) => Some(
                            bounded(config.timeout, uri, fetch_talos(&sources, uri, limit)).await,
                        ),
                        None => None,
                    }
                },
                async {
                    match &kubernetes.uri {
                        Some(uri) => Some(
                            bounded(config.timeout, uri, fetch_kubernetes(&sources, uri, limit))
                                .await,
                        ),
                        None => None,
                    }
                },
            )
        };
        let (talos_result, kubernetes_result) = tokio::select! {
            results = round => results,
            // Every handle is gone: nobody reads the catalog any more.
            () = sender.closed() => return,
        };
        talos.record("talos", talos_result);
        kubernetes.record("kubernetes", kubernetes_result);
        rounds += 1;

        let mut catalog = base.clone();
        catalog.merge(&Catalog::new(
            talos.good.iter().cloned(),
            kubernetes.good.iter().cloned(),
        ));
        sender.send_replace(Arc::new(LiveState {
            catalog: Arc::new(catalog),
            talos: talos.state.clone(),
            kubernetes: kubernetes.state.clone(),
            rounds,
        }));

        let failed = [&talos.state, &kubernetes.state]
            .iter()
            .any(|state| matches!(state, SourceState::Failed { .. }));
        let pause = if failed {
            config.retry_interval.min(config.interval)
        } else {
            config.interval
        };
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = sender.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests;
