//! Kubernetes API clients: kube's own middleware over an HTTP client that speaks HTTP/2 when the API
//! server offers it (every kube-apiserver does, by ALPN), as client-go does.
//!
//! kube-client's default stack speaks HTTP/1.1 only. Every request in flight then needs a connection of
//! its own, and its pool keeps every connection it ever opened, because hyper's idle timeout needs a
//! timer that kube-client does not give it. At 200 clusters upgraded at once that was about 1,800
//! connections alive at the controller's peak (about 29 MB of its heap) and as many TLS handshakes on
//! the API servers. Over HTTP/2 every request to one API server shares one connection.
//!
//! The middleware is kube's, through its public parts (`ConfigExt`): the base URI, authentication
//! (including token refresh), impersonation headers and, when the config asks for it, kube's retry of
//! 5xx/429 answers. Left out: kube's per-request tracing spans, and the expiry kube sets on a client
//! whose credentials come from an exec plugin's client certificate (never the case here: the
//! controller's own client uses its service account token, workload clients the static credentials of
//! a Secret).

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{ClientBuilder, ConfigExt};
use tower::ServiceBuilder;
use tower::retry::RetryLayer;

/// client-go's HTTP/2 health check: a PING after 30 s without a frame from the server, and the
/// connection is closed when the answer takes more than 15 s. A watch on a dead connection fails
/// within a minute instead of waiting for TCP to give up.
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(30);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(15);

/// Go's `http.Transport` closes a connection idle for 90 s; the API server closes idle HTTP/2
/// connections after 90 s too.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Idle HTTP/1 connections kept per API server, as client-go's transport keeps (25). Over HTTP/2 the
/// pool holds one connection per API server whatever this says; it matters only against a server that
/// does not offer HTTP/2.
const POOL_MAX_IDLE_PER_HOST: usize = 25;

/// How many servers' TLS sessions a client remembers for resumption. A client reaches one API server,
/// under one name (its kubeconfig's server); rustls's default cache holds 256 and allocates them up
/// front, about 14 KB per client, which is one per workload cluster.
const SESSION_CACHE_SERVERS: usize = 1;

#[derive(Debug, thiserror::Error)]
pub enum ApiClientError {
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error("the tls-server-name {0:?} is not a valid server name")]
    ServerName(String),
}

/// A client for the API server `config` describes.
pub fn client(config: kube::Config) -> Result<kube::Client, ApiClientError> {
    let mut http = HttpConnector::new();
    // The scheme decides TLS: https goes through rustls below, http (tests only) stays plain.
    http.enforce_http(false);
    // HTTP/2 writes a request as several frames (HEADERS, then DATA); with Nagle's algorithm the second
    // write waits for the server's delayed ACK, 40 ms per request on Linux. Go (the API server) and
    // client-go set TCP_NODELAY on every connection too.
    http.set_nodelay(true);

    // kube's configuration as it is (the kubeconfig's CA as the only trust root when it names one, its
    // client identity), with a smaller session cache.
    let mut tls = config.rustls_client_config()?;
    tls.resumption = rustls::client::Resumption::in_memory_sessions(SESSION_CACHE_SERVERS);
    let mut https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let server_name = rustls::pki_types::ServerName::try_from(name.clone())
            .map_err(|_| ApiClientError::ServerName(name.clone()))?;
        https = https
            .with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(server_name));
    }
    // ALPN offers h2 first, then http/1.1; the pool uses whichever the server picks.
    let https = https.enable_all_versions().wrap_connector(http);

    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);

    let http_client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .timer(TokioTimer::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE_TIMEOUT)
        .pool_max_idle_per_host(POOL_MAX_IDLE_PER_HOST)
        .http2_keep_alive_interval(HTTP2_PING_INTERVAL)
        .http2_keep_alive_timeout(HTTP2_PING_TIMEOUT)
        .build(connector);

    // The same layers, in the same order, as kube-client's default stack.
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(http_client);
    Ok(ClientBuilder::new(service, config.default_namespace).build())
}

/// The config of a kubeconfig file's current context.
pub async fn config_from_file(
    path: &std::path::Path,
) -> Result<kube::Config, kube::config::KubeconfigError> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default()).await
}
