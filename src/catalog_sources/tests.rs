//! The refresher against real HTTP servers on 127.0.0.1. Assertions are about behaviour (what the
//! snapshot holds, which state each source reports), never about how long anything took.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::RawQuery;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::json;
use tokio::sync::mpsc;

use super::*;

const TALOS_PATH: &str = "/versions";
const TAGS_PATH: &str = "/v2/kube-apiserver/tags/list";

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let address = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    format!("http://{address}")
}

fn config(talos: Option<&str>, kubernetes: Option<&str>) -> LiveConfig {
    LiveConfig {
        enabled: true,
        talos_factory_url: talos.map(str::to_string),
        kubernetes_tags_url: kubernetes.map(|base| format!("{base}{TAGS_PATH}")),
        interval: Duration::from_secs(3600),
        retry_interval: Duration::from_secs(3600),
        timeout: Duration::from_secs(3600),
        max_response_bytes: 64 * 1024,
    }
}

/// Wait for a published state that satisfies `done`. The outer deadline only turns a broken
/// refresher into a failed test instead of a hung one.
async fn wait_for(handle: &mut CatalogHandle, done: impl Fn(&LiveState) -> bool) -> Arc<LiveState> {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let state = handle.state();
            if done(&state) {
                return state;
            }
            assert!(handle.changed().await, "refresher stopped early");
        }
    })
    .await
    .expect("the refresher published the expected state")
}

fn builtin_plus(talos: &[TalosVersion], kubernetes: &[KubernetesVersion]) -> Catalog {
    let mut catalog = Catalog::builtin();
    catalog.merge(&Catalog::new(talos.to_vec(), kubernetes.to_vec()));
    catalog
}

#[tokio::test]
async fn good_answers_merge_stable_releases_only() {
    let base = serve(
        Router::new()
            .route(
                TALOS_PATH,
                get(|| async {
                    axum::Json(json!(["v1.12.0", "v1.14.1", "v1.13.0-alpha.1", "latest", "1.14.5"]))
                }),
            )
            .route(
                TAGS_PATH,
                get(|| async {
                    axum::Json(json!({
                        "name": "kube-apiserver",
                        "tags": ["v1.35.7", "v1.36.0-rc.1", "sha256-0a1b.sig", "1.35.9", "v1.37.0", "v1.035.0"]
                    }))
                }),
            ),
    )
    .await;
    let mut handle =
        CatalogHandle::start(Catalog::builtin(), &config(Some(&base), Some(&base))).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;

    assert_eq!(state.talos, SourceState::Ok { releases: 2 });
    assert_eq!(state.kubernetes, SourceState::Ok { releases: 2 });
    let expected = builtin_plus(
        &[TalosVersion::new(1, 14, 1)],
        &[
            KubernetesVersion::new(1, 35, 7),
            KubernetesVersion::new(1, 37, 0),
        ],
    );
    assert_eq!(*handle.snapshot(), expected);
    // The merged catalog drives the advice: 1.14 accepts 1.12 hosts and runs Kubernetes 1.35.
    assert_eq!(
        talos_upgrade_core::catalog::talos_available(
            &handle.snapshot(),
            &TalosVersion::new(1, 12, 11),
            &TalosVersion::new(1, 12, 11),
            &[KubernetesVersion::new(1, 35, 4)],
        ),
        Some(TalosVersion::new(1, 14, 1))
    );
}

#[tokio::test]
async fn erroring_and_malformed_sources_leave_the_base_catalog() {
    let base = serve(
        Router::new()
            .route(
                TALOS_PATH,
                get(|| async { StatusCode::INTERNAL_SERVER_ERROR }),
            )
            .route(TAGS_PATH, get(|| async { "{\"tags\": [\"v1.35.7\"" })),
    )
    .await;
    let mut handle =
        CatalogHandle::start(Catalog::builtin(), &config(Some(&base), Some(&base))).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;

    assert!(
        matches!(&state.talos, SourceState::Failed { error, kept: 0 } if error.contains("500")),
        "{:?}",
        state.talos
    );
    assert!(
        matches!(&state.kubernetes, SourceState::Failed { error, kept: 0 } if error.contains("JSON")),
        "{:?}",
        state.kubernetes
    );
    assert_eq!(*handle.snapshot(), Catalog::builtin());
}

/// Handlers that report their arrival and then never answer.
fn hanging_router(arrived: mpsc::UnboundedSender<&'static str>) -> Router {
    let talos = arrived.clone();
    Router::new()
        .route(
            TALOS_PATH,
            get(move || async move {
                let _ = talos.send("talos");
                std::future::pending::<()>().await;
            }),
        )
        .route(
            TAGS_PATH,
            get(move || async move {
                let _ = arrived.send("kubernetes");
                std::future::pending::<()>().await;
            }),
        )
}

#[tokio::test]
async fn a_hanging_source_never_holds_up_the_snapshot() {
    let (arrived, mut arrivals) = mpsc::unbounded_channel();
    let base = serve(hanging_router(arrived)).await;
    // A deadline far beyond the test: both fetches are certainly outstanding below.
    let handle =
        CatalogHandle::start(Catalog::builtin(), &config(Some(&base), Some(&base))).expect("start");
    let mut seen = vec![
        arrivals.recv().await.expect("a request"),
        arrivals.recv().await.expect("a request"),
    ];
    seen.sort();
    assert_eq!(seen, vec!["kubernetes", "talos"]);

    // Both requests are in flight, and the snapshot answers with the built-in data.
    assert_eq!(*handle.snapshot(), Catalog::builtin());
    let state = handle.state();
    assert_eq!(state.rounds, 0);
    assert_eq!(state.talos, SourceState::Pending);
    assert_eq!(state.kubernetes, SourceState::Pending);
}

#[tokio::test]
async fn a_hanging_source_fails_at_its_deadline() {
    let (arrived, _arrivals) = mpsc::unbounded_channel();
    let base = serve(hanging_router(arrived)).await;
    let mut settings = config(Some(&base), Some(&base));
    settings.timeout = Duration::from_millis(200);
    let mut handle = CatalogHandle::start(Catalog::builtin(), &settings).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;
    for source in [&state.talos, &state.kubernetes] {
        assert!(
            matches!(source, SourceState::Failed { error, kept: 0 } if error.contains("no complete answer")),
            "{source:?}"
        );
    }
    assert_eq!(*handle.snapshot(), Catalog::builtin());
}

#[tokio::test]
async fn a_failure_keeps_the_last_good_list() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let base = serve(Router::new().route(
        TALOS_PATH,
        get(move || {
            let counter = counter.clone();
            async move {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    axum::Json(json!(["v1.14.1"])).into_response()
                } else {
                    StatusCode::SERVICE_UNAVAILABLE.into_response()
                }
            }
        }),
    ))
    .await;
    let mut settings = config(Some(&base), None);
    settings.interval = Duration::from_millis(10);
    settings.retry_interval = Duration::from_millis(10);
    let mut handle = CatalogHandle::start(Catalog::builtin(), &settings).expect("start");
    let state = wait_for(&mut handle, |s| {
        matches!(s.talos, SourceState::Failed { .. })
    })
    .await;

    assert!(state.rounds >= 2);
    assert!(
        matches!(&state.talos, SourceState::Failed { error, kept: 1 } if error.contains("503")),
        "{:?}",
        state.talos
    );
    assert_eq!(state.kubernetes, SourceState::Disabled);
    assert_eq!(
        *state.catalog,
        builtin_plus(&[TalosVersion::new(1, 14, 1)], &[])
    );
}

#[tokio::test]
async fn follows_redirects_and_tag_list_pages() {
    let base = serve(
        Router::new()
            .route(
                TAGS_PATH,
                get(|| async {
                    (
                        StatusCode::TEMPORARY_REDIRECT,
                        [(header::LOCATION, "/mirror/tags")],
                    )
                }),
            )
            .route(
                "/mirror/tags",
                get(|RawQuery(query): RawQuery| async move {
                    match query {
                        None => (
                            [(
                                header::LINK,
                                "</mirror/tags?last=v1.38.0&n=1>; rel=\"next\"",
                            )],
                            axum::Json(json!({"tags": ["v1.38.0"]})),
                        )
                            .into_response(),
                        Some(_) => axum::Json(json!({"tags": ["v1.38.1"]})).into_response(),
                    }
                }),
            ),
    )
    .await;
    let mut handle =
        CatalogHandle::start(Catalog::builtin(), &config(None, Some(&base))).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;
    assert_eq!(state.talos, SourceState::Disabled);
    assert_eq!(state.kubernetes, SourceState::Ok { releases: 2 });
    assert_eq!(
        *state.catalog,
        builtin_plus(
            &[],
            &[
                KubernetesVersion::new(1, 38, 0),
                KubernetesVersion::new(1, 38, 1)
            ]
        )
    );
}

#[tokio::test]
async fn refuses_a_redirect_to_plain_http_elsewhere_and_oversized_answers() {
    let base = serve(
        Router::new()
            .route(
                TAGS_PATH,
                get(|| async {
                    (
                        StatusCode::FOUND,
                        [(
                            header::LOCATION,
                            "http://mirror.example/v2/tags?token=secret",
                        )],
                    )
                }),
            )
            .route(
                TALOS_PATH,
                get(|| async { axum::Json(vec!["v1.12.0"; 1000]) }),
            ),
    )
    .await;
    let mut settings = config(Some(&base), Some(&base));
    settings.max_response_bytes = 1024;
    let mut handle = CatalogHandle::start(Catalog::builtin(), &settings).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;
    assert!(
        matches!(&state.talos, SourceState::Failed { error, .. } if error.contains("larger than 1024 bytes")),
        "{:?}",
        state.talos
    );
    let SourceState::Failed { error, .. } = &state.kubernetes else {
        panic!("{:?}", state.kubernetes);
    };
    assert!(error.contains("plain http"), "{error}");
    // The signed query of a redirect target never reaches messages or logs.
    assert!(!error.contains("secret"), "{error}");
    assert_eq!(*handle.snapshot(), Catalog::builtin());
}

#[tokio::test]
async fn disabled_serves_the_base_catalog_without_a_task() {
    let mut handle =
        CatalogHandle::start(Catalog::builtin(), &LiveConfig::default()).expect("start");
    assert_eq!(*handle.snapshot(), Catalog::builtin());
    assert_eq!(handle.state().talos, SourceState::Disabled);
    // Nothing will ever publish.
    assert!(!handle.changed().await);

    // Enabled, but with both sources turned off: the same.
    let none = LiveConfig {
        enabled: true,
        talos_factory_url: None,
        kubernetes_tags_url: None,
        ..LiveConfig::default()
    };
    let mut handle = CatalogHandle::start(Catalog::builtin(), &none).expect("start");
    assert_eq!(handle.state().kubernetes, SourceState::Disabled);
    assert!(!handle.changed().await);
}

#[test]
fn configuration_errors() {
    let with = |talos: &str| LiveConfig {
        enabled: true,
        talos_factory_url: Some(talos.to_string()),
        kubernetes_tags_url: None,
        ..LiveConfig::default()
    };
    let cases = [
        ("http://factory.example", "plain http"),
        ("https://user:hunter2@factory.example", "credentials"),
        ("factory.example", "not a valid"),
        ("ftp://factory.example", "not a valid"),
    ];
    for (url, needle) in cases {
        let error = Sources::new(&with(url)).err().expect(url).to_string();
        assert!(error.contains(needle), "{url}: {error}");
        assert!(!error.contains("hunter2"), "{error}");
    }
    let mut zero = with("http://127.0.0.1:1");
    zero.timeout = Duration::ZERO;
    assert!(matches!(
        Sources::new(&zero),
        Err(LiveConfigError::ZeroDuration)
    ));
    // Loopback http is fine (tests), in every spelling.
    for url in [
        "http://127.0.0.1:8080",
        "http://localhost",
        "http://[::1]:80/",
    ] {
        assert!(Sources::new(&with(url)).is_ok(), "{url}");
    }
}

#[test]
fn stable_release_tags() {
    for (tag, expected) in [
        ("v1.12.0", Some((1, 12, 0))),
        ("v1.35.10", Some((1, 35, 10))),
        ("v0.0.0", Some((0, 0, 0))),
        ("1.12.0", None),
        ("v1.13.0-alpha.1", None),
        ("v1.12.0+build", None),
        ("v1.12", None),
        ("v1.12.0.1", None),
        ("v1.012.0", None),
        ("latest", None),
        ("sha256-abc.sig", None),
        ("v", None),
        ("v1..0", None),
        ("v99999999999999999999999.0.0", None),
    ] {
        assert_eq!(stable_release(tag), expected, "{tag}");
    }
}

#[test]
fn link_and_location_handling() {
    assert_eq!(
        next_link("</v2/x/tags/list?last=a&n=2>; rel=\"next\""),
        Some("/v2/x/tags/list?last=a&n=2".to_string())
    );
    assert_eq!(
        next_link("<https://a/prev>; rel=\"prev\", <https://a/next>; rel=next"),
        Some("https://a/next".to_string())
    );
    assert_eq!(next_link("<https://a/prev>; rel=\"prev\""), None);

    let base: Uri = "https://registry.example:8443/v2/x/tags/list?n=1"
        .parse()
        .expect("uri");
    assert_eq!(
        resolve(&base, "/v2/y?last=b").map(|u| u.to_string()),
        Some("https://registry.example:8443/v2/y?last=b".to_string())
    );
    assert_eq!(
        resolve(&base, "https://mirror.example/v2/z").map(|u| u.to_string()),
        Some("https://mirror.example/v2/z".to_string())
    );
    assert_eq!(resolve(&base, "relative/path"), None);
    assert_eq!(resolve(&base, "//other.example/x"), None);

    let signed: Uri = "https://mirror.example/v2/tags?X-Goog-Signature=abc"
        .parse()
        .expect("uri");
    assert_eq!(redacted(&signed), "https://mirror.example/v2/tags");
}

#[tokio::test]
async fn an_unreachable_source_reports_why() {
    // A port that was just free: nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let base = format!("http://{}", listener.local_addr().expect("local address"));
    drop(listener);
    let mut handle =
        CatalogHandle::start(Catalog::builtin(), &config(Some(&base), None)).expect("start");
    let state = wait_for(&mut handle, |s| s.rounds >= 1).await;
    let SourceState::Failed { error, kept: 0 } = &state.talos else {
        panic!("{:?}", state.talos);
    };
    // The cause, not just hyper's "client error (Connect)".
    assert!(
        error.contains("/versions") && error.contains("onnect"),
        "{error}"
    );
    assert!(error.len() > "client error (Connect)".len() + 40, "{error}");
    assert_eq!(*handle.snapshot(), Catalog::builtin());
}

/// A one-shot HTTPS server on 127.0.0.1 with a certificate from a fresh CA: it answers every
/// request with `body`. Returns its base URL and the CA to trust. A hand-written HTTP/1.1 answer
/// keeps the test to what is under test: the client's TLS verification.
async fn serve_https(body: &'static str) -> (String, rustls::RootCertStore) {
    let pki = testenv::loopback_tls::LoopbackTls::generate();
    let roots = pki.roots();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let address = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                // A client that rejects the certificate ends the handshake here.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                if testenv::loopback_tls::read_request_head(&mut tls)
                    .await
                    .is_none()
                {
                    return;
                }
                testenv::loopback_tls::answer_json(&mut tls, "200 OK", body).await;
            });
        }
    });
    (format!("https://{address}"), roots)
}

#[tokio::test]
async fn https_is_verified() {
    let (base, ca) = serve_https("[\"v1.14.1\"]").await;
    let settings = config(Some(&base), None);

    // Trusting the server's CA: the answer counts.
    let sources = Sources::build(&settings, Some(ca)).expect("sources");
    let mut trusted = CatalogHandle::spawn(Catalog::builtin(), sources, &settings);
    let state = wait_for(&mut trusted, |s| s.rounds >= 1).await;
    assert_eq!(state.talos, SourceState::Ok { releases: 1 });

    // Not trusting it: refused, and nothing is merged.
    let sources = Sources::build(&settings, Some(rustls::RootCertStore::empty())).expect("sources");
    let mut untrusted = CatalogHandle::spawn(Catalog::builtin(), sources, &settings);
    let state = wait_for(&mut untrusted, |s| s.rounds >= 1).await;
    let SourceState::Failed { error, .. } = &state.talos else {
        panic!("{:?}", state.talos);
    };
    assert!(error.contains("certificate"), "{error}");
    assert_eq!(*untrusted.snapshot(), Catalog::builtin());
}

#[tokio::test]
async fn a_failed_source_is_retried_sooner_than_the_interval() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let base = serve(Router::new().route(
        TALOS_PATH,
        get(move || {
            let counter = counter.clone();
            async move {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    StatusCode::BAD_GATEWAY.into_response()
                } else {
                    axum::Json(json!(["v1.14.1"])).into_response()
                }
            }
        }),
    ))
    .await;
    // The regular interval (an hour) would outlast the test; the retry interval does not.
    let mut settings = config(Some(&base), None);
    settings.retry_interval = Duration::from_millis(10);
    let mut handle = CatalogHandle::start(Catalog::builtin(), &settings).expect("start");
    let state = wait_for(&mut handle, |s| matches!(s.talos, SourceState::Ok { .. })).await;
    assert_eq!(state.rounds, 2);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        *state.catalog,
        builtin_plus(&[TalosVersion::new(1, 14, 1)], &[])
    );
}

// The catalog file, read at start.
#[test]
fn load_reports_a_missing_file() {
    let path = std::path::Path::new("/nonexistent/catalog.yaml");
    let error = load_file(path).expect_err("missing file");
    assert!(matches!(error, CatalogFileError::Read { .. }));
    assert!(error.to_string().contains("/nonexistent/catalog.yaml"));
}

#[test]
fn load_reads_a_file() {
    let dir = std::env::temp_dir().join(format!("catalog-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("catalog.yaml");
    std::fs::write(&path, "talos: [\"1.14.2\"]\n").expect("write");
    let file = load_file(&path).expect("valid");
    assert_eq!(
        file.talos,
        Some(vec![TalosVersion::parse("1.14.2").expect("version")])
    );
    let catalog = builtin_with_file(Some(&path)).expect("valid");
    assert!(catalog.talos().any(|v| v.to_string() == "1.14.2"));
    assert!(catalog.talos().any(|v| v.to_string() == "1.13.9"));
    assert_eq!(
        builtin_with_file(None).expect("no file"),
        Catalog::builtin()
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}
