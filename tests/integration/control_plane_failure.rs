//! When etcd goes away, the harness makes the failure visible: the apiserver reports it, and the failure
//! report a failing test prints carries the apiserver's own log.
//!
//! This binary starts its own control plane (one per test binary) because it breaks it.

use std::time::{Duration, Instant};

use testenv::ControlPlane;

#[tokio::test]
async fn losing_etcd_is_reported_with_the_apiserver_log() {
    let control_plane = ControlPlane::start()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let client = control_plane.client().await.expect("admin client");
    assert_eq!(
        control_plane.readyz(&client).await.expect("readyz").trim(),
        "ok"
    );

    control_plane.stop_etcd();

    // The apiserver's etcd readiness check notices within its health-check timeout.
    let deadline = Instant::now() + Duration::from_secs(120);
    let verbose = loop {
        let request = http::Request::get("/readyz?verbose")
            .body(Vec::new())
            .expect("request");
        match client.request_text(request).await {
            Ok(body) if body.contains("[-]etcd") => break body,
            Err(kube::Error::Api(status)) if status.message.contains("[-]etcd") => {
                break status.message;
            }
            other => {
                assert!(
                    Instant::now() < deadline,
                    "apiserver still ready without etcd: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert!(verbose.contains("[-]etcd"), "{verbose}");

    let report = control_plane.failure_report();
    assert!(report.contains("===== kube-apiserver log"), "{report}");
    assert!(report.contains("===== etcd log"), "{report}");
    // The apiserver's own complaint about etcd is in what a failing test would print.
    assert!(
        report.contains("127.0.0.1") && report.to_lowercase().contains("etcd"),
        "{report}"
    );
}
