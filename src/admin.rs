//! The admin HTTP server: metrics and probes.
//!
//! | path | answer |
//! |---|---|
//! | `GET /metrics` | 200, [`Metrics::encode`] as `application/openmetrics-text; version=1.0.0; charset=utf-8` |
//! | `GET /healthz` | 200 `ok` while the process serves requests (liveness) |
//! | `GET /readyz` | 503 `not ready: <reason>` until [`HealthState::set_ready`] (called once the initial watch lists completed), then 200 `ok` |

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::Metrics;

/// Content type of `/metrics`.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why a new [`HealthState`] is not ready.
pub const INITIAL_NOT_READY_REASON: &str = "initial watch lists have not completed";

/// Readiness of the process, shared between the controller (which sets it) and `/readyz`.
/// Cheap to clone; all clones share one state. Starts not ready.
#[derive(Clone, Debug)]
pub struct HealthState {
    inner: Arc<HealthInner>,
}

#[derive(Debug)]
struct HealthInner {
    ready: AtomicBool,
    reason: Mutex<String>,
}

impl Default for HealthState {
    fn default() -> Self {
        Self::new()
    }
}

impl HealthState {
    /// Not ready, with reason [`INITIAL_NOT_READY_REASON`].
    pub fn new() -> Self {
        HealthState {
            inner: Arc::new(HealthInner {
                ready: AtomicBool::new(false),
                reason: Mutex::new(INITIAL_NOT_READY_REASON.to_owned()),
            }),
        }
    }

    /// Ready: `/readyz` answers 200.
    pub fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
    }

    /// Not ready (again): `/readyz` answers 503 with `reason`.
    pub fn set_not_ready(&self, reason: impl Into<String>) {
        *self.lock_reason() = reason.into();
        self.inner.ready.store(false, Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::Acquire)
    }

    /// `Ok` when ready, else the reason it is not.
    pub fn readiness(&self) -> Result<(), String> {
        if self.is_ready() {
            Ok(())
        } else {
            Err(self.lock_reason().clone())
        }
    }

    fn lock_reason(&self) -> std::sync::MutexGuard<'_, String> {
        self.inner
            .reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// The admin server failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("cannot listen on admin address {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("admin server failed: {0}")]
    Serve(#[source] std::io::Error),
}

#[derive(Clone)]
struct AdminState {
    metrics: Metrics,
    health: HealthState,
}

/// The admin routes: `/metrics`, `/healthz`, `/readyz`.
pub fn router(metrics: Metrics, health: HealthState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(AdminState { metrics, health })
}

async fn metrics_handler(State(state): State<AdminState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)],
        state.metrics.encode(),
    )
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<AdminState>) -> (StatusCode, String) {
    match state.health.readiness() {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}"),
        ),
    }
}

/// Listen on `addr` and serve `router` until `shutdown` completes, then finish the requests in
/// flight and return.
pub async fn serve(
    addr: SocketAddr,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AdminError> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| AdminError::Bind { addr, source })?;
    serve_on(listener, router, shutdown).await
}

/// [`serve`] on a listener bound by the caller (for example to port 0, reading the port back).
pub async fn serve_on(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), AdminError> {
    match listener.local_addr() {
        Ok(addr) => tracing::info!(%addr, "admin server listening"),
        Err(error) => tracing::warn!(%error, "admin server listening on an unknown address"),
    }
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(AdminError::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{ClusterKey, ClusterUpgradeGauges, UpgradeKind};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    struct Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    }

    impl Reply {
        fn header(&self, name: &str) -> Option<&str> {
            self.headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        }
    }

    /// A plain HTTP/1.1 GET with `Connection: close`; the admin server answers with a
    /// Content-Length body, so reading to EOF yields the whole reply.
    async fn get(addr: SocketAddr, path: &str) -> Reply {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write");
        let mut raw = String::new();
        stream.read_to_string(&mut raw).await.expect("read");
        let (head, body) = raw.split_once("\r\n\r\n").expect("header end");
        let mut lines = head.lines();
        let status_line = lines.next().expect("status line");
        let status = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
            .collect();
        Reply {
            status,
            headers,
            body: body.to_owned(),
        }
    }

    #[tokio::test]
    async fn serves_metrics_and_probes() {
        let metrics = Metrics::new();
        let health = HealthState::new();
        let key = ClusterKey::new("ns", "c1");
        metrics.set_cluster_phase(&key, "Ready");
        metrics.set_cluster_state(&key, UpgradeKind::Talos, &ClusterUpgradeGauges::default());

        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_on(
            listener,
            router(metrics.clone(), health.clone()),
            async move {
                let _ = stopped.await;
            },
        ));

        let live = get(addr, "/healthz").await;
        assert_eq!((live.status, live.body.as_str()), (200, "ok"));

        let ready = get(addr, "/readyz").await;
        assert_eq!(ready.status, 503);
        assert_eq!(ready.body, format!("not ready: {INITIAL_NOT_READY_REASON}"));

        health.set_ready();
        let ready = get(addr, "/readyz").await;
        assert_eq!((ready.status, ready.body.as_str()), (200, "ok"));

        health.set_not_ready("lost the watch");
        let ready = get(addr, "/readyz").await;
        assert_eq!(
            (ready.status, ready.body.as_str()),
            (503, "not ready: lost the watch")
        );
        // Liveness does not depend on readiness.
        assert_eq!(get(addr, "/healthz").await.status, 200);

        let scrape = get(addr, "/metrics").await;
        assert_eq!(scrape.status, 200);
        assert_eq!(
            scrape.header("content-type"),
            Some(OPENMETRICS_CONTENT_TYPE)
        );
        assert!(
            scrape.body.contains(
                r#"talos_upgrade_cluster_phase{namespace="ns",cluster="c1",phase="Ready"} 1"#
            ),
            "{}",
            scrape.body
        );
        assert!(scrape.body.contains(
            r#"talos_upgrade_cluster_status{namespace="ns",cluster="c1",kind="talos",status="idle"} 1"#
        ));
        assert!(scrape.body.ends_with("# EOF\n"));

        assert_eq!(get(addr, "/nope").await.status, 404);

        stop.send(()).expect("server still running");
        server.await.expect("join").expect("clean shutdown");
    }

    #[tokio::test]
    async fn serve_reports_a_bind_failure() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = taken.local_addr().expect("local addr");
        let router = router(Metrics::new(), HealthState::new());
        let err = serve(addr, router, std::future::pending())
            .await
            .expect_err("address in use");
        assert!(
            matches!(err, AdminError::Bind { addr: a, .. } if a == addr),
            "{err}"
        );
    }

    #[test]
    fn health_state_clones_share_readiness() {
        let health = HealthState::default();
        let clone = health.clone();
        assert_eq!(health.readiness(), Err(INITIAL_NOT_READY_REASON.to_owned()));
        clone.set_ready();
        assert!(health.is_ready());
        assert_eq!(health.readiness(), Ok(()));
    }
}
