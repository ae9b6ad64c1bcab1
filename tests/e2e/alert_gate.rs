//! The alert gate (issue #23) against a real Prometheus (Debian's package, as in
//! tests/e2e/prometheus.rs: `bash scripts/install-prometheus.sh`) and simulated Talos clusters.
//!
//! Alerts fire on demand: the test serves a scrape target whose gauges it flips
//! (`e2e_alert_switch{alert="critical"} 1`), Prometheus scrapes it and evaluates the rules below
//! every second, each with `for: 0s`, so an alert fires at the first evaluation that sees its switch
//! on. The tests wait for what Prometheus says (an alert firing or gone), never for a duration.
//!
//! What is asserted is what a user sees: the `talos-message` and `talos-status` annotations, the
//! cluster's Events, and the upgrade calls the simulated nodes received.
//!
//! Bearer token and TLS: Prometheus's own web config checks basic auth, not bearer tokens, so the
//! TLS + bearer case puts a small TLS reverse proxy of the test's in front of a plain Prometheus: it
//! serves a certificate from a CA the test makes (rcgen) and answers 401 to any request without the
//! right token, as an authenticating proxy in front of Prometheus (kube-rbac-proxy, an ingress) would.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::prometheus::{Prometheus, http_get, tool};
use crate::world::{World, WorldSpec};
use talos_sim::Fault;
use talos_upgrade_controller::holds::alerts::{AlertGateConfig, parse_selector};
use tokio_util::sync::CancellationToken;

const PATIENCE: Duration = Duration::from_secs(120);

/// The rules: each alert fires while its switch is on. Labels of the switch's series (`namespace`,
/// `node`) become the alert's.
const RULES: &str = r#"
groups:
  - name: e2e-alert-gate
    rules:
      - alert: E2ECritical
        expr: e2e_alert_switch{alert="critical"} > 0
        labels: {severity: critical}
      - alert: E2EWarning
        expr: e2e_alert_switch{alert="warning"} > 0
        labels: {severity: warning}
      - alert: E2ENodeTrouble
        expr: e2e_node_switch > 0
        labels: {severity: critical}
"#;

/// A scrape target serving the gauges the test sets, all of them every time (0 when off).
struct Switches {
    values: Arc<Mutex<BTreeMap<String, f64>>>,
    address: String,
}

impl Switches {
    async fn start(stop: &CancellationToken) -> Switches {
        let values: Arc<Mutex<BTreeMap<String, f64>>> = Arc::default();
        let served = values.clone();
        let router = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let served = served.clone();
                async move {
                    let values = served.lock().unwrap_or_else(|p| p.into_inner()).clone();
                    values
                        .iter()
                        .map(|(series, value)| format!("{series} {value}\n"))
                        .collect::<String>()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(stop.cancelled_owned())
                .await;
        });
        Switches { values, address }
    }

    fn set(&self, series: &str, on: bool) {
        self.values
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(series.to_string(), if on { 1.0 } else { 0.0 });
    }
}

fn critical(namespace: &str) -> String {
    format!("e2e_alert_switch{{alert=\"critical\",namespace=\"{namespace}\"}}")
}

const WARNING: &str = "e2e_alert_switch{alert=\"warning\"}";

fn node_switch(node: &str) -> String {
    format!("e2e_node_switch{{node=\"{node}\"}}")
}

/// Waits until Prometheus says `alert` is firing (`true`) or not (`false`).
async fn wait_for_alert(prometheus: &Prometheus, alert: &str, firing: bool) {
    let query = format!("ALERTS{{alertname=\"{alert}\",alertstate=\"firing\"}}");
    let what = format!("{alert} {}", if firing { "firing" } else { "resolved" });
    prometheus
        .wait_for(&what, || async {
            prometheus.query(&query).await.is_empty() != firing
        })
        .await;
}

/// The gate the controller gets: this Prometheus, `selector` as `--alert-selector`.
fn gate(url: &str, selector: &str) -> AlertGateConfig {
    AlertGateConfig {
        url: url.to_string(),
        auth_secret: None,
        selector: parse_selector(selector).expect("selector"),
        timeout: Duration::from_secs(5),
        // Short, so a test that fixes the Secret sees the fix soon.
        secret_ttl: Duration::from_millis(500),
    }
}

/// A small cluster (one control plane, two workers: workers go first), the controller not started
/// yet so that the test gives it its gate first.
fn spec() -> WorldSpec {
    WorldSpec {
        control_planes: 1,
        workers: 2,
        start_controller: false,
        ..WorldSpec::default()
    }
}

/// The value of `name{gate="alerts"}` in the controller's metrics.
fn hold_metric(world: &World, name: &str) -> Option<String> {
    world
        .metrics
        .encode()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("gate=\"alerts\""))
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
}

async fn wait_for_message(world: &World, what: &str, words: &str) -> String {
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, what, |m| m.contains(words))
        .await
}

/// The held run as a user sees it: in progress, the message saying why, an Event saying the same,
/// and not one upgrade call.
async fn assert_held(world: &World, words: &str) -> String {
    let message = wait_for_message(world, &format!("holding on {words:?}"), words).await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    assert!(message.starts_with("Waiting: "), "{message}");
    let events = world.events().await;
    assert!(
        events.iter().any(|(_, m)| m.contains(words)),
        "no Event says {words:?}: {events:#?}"
    );
    assert_eq!(world.upgrade_calls(), Vec::<String>::new(), "{message}");
    message
}

/// The switches, and a real Prometheus scraping them with [`RULES`]; the switches stop with `stop`.
async fn switches_and_prometheus(stop: &CancellationToken) -> (Switches, Prometheus) {
    tool("prometheus");
    let switches = Switches::start(stop).await;
    let prometheus = Prometheus::start(std::slice::from_ref(&switches.address), RULES).await;
    (switches, prometheus)
}

/// The run completes, every node upgraded once.
async fn assert_completed(world: &World) {
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
}

#[tokio::test]
async fn a_firing_critical_alert_holds_the_run_across_a_restart_until_it_resolves() {
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let (switches, prometheus) = switches_and_prometheus(&stop).await;
    let mut world = World::start("alert-hold", spec()).await;
    // The operator-wide selector scopes alerts to each cluster through a placeholder.
    world.set_alert_gate(gate(
        &prometheus.base,
        r#"{severity="critical",namespace="{namespace}"}"#,
    ));
    // Another namespace's critical alert is not this cluster's.
    switches.set(&critical("someone-else"), true);
    switches.set(&critical(&world.ns.name), true);
    wait_for_alert(&prometheus, "E2ECritical", true).await;
    world.start_controller();
    world.annotate("talos-target", "1.12.0").await;

    let message = assert_held(&world, "alerts firing: E2ECritical (since ").await;
    // One alert name, even with two series, and when it became active (whole seconds, UTC).
    let since = message
        .split("(since ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .expect("since when");
    let since: jiff::Timestamp = since.parse().expect("an RFC 3339 time");
    assert!(since <= jiff::Timestamp::now(), "{message}");
    assert_eq!(message.matches("E2ECritical").count(), 1, "{message}");
    // The hold metrics the other gates share say the alerts gate holds.
    assert_eq!(
        hold_metric(&world, "talos_upgrade_hold").as_deref(),
        Some("1")
    );
    assert!(
        hold_metric(&world, "talos_upgrade_holds_total").is_some_and(|n| n != "0"),
        "{}",
        world.metrics.encode()
    );

    // A new controller asks again and holds again.
    world.restart_controller().await;
    world.wait_for_reconciles(3, PATIENCE).await;
    assert_held(&world, "alerts firing: E2ECritical").await;

    // Resolved: the run goes on, every node once.
    switches.set(&critical(&world.ns.name), false);
    assert_completed(&world).await;
    // Still firing for the other namespace all along.
    wait_for_alert(&prometheus, "E2ECritical", true).await;
}

#[tokio::test]
async fn an_alert_on_the_node_the_upgrade_reboots_does_not_hold_it() {
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let (switches, prometheus) = switches_and_prometheus(&stop).await;
    let mut world = World::start("alert-node", spec()).await;
    world.set_alert_gate(gate(&prometheus.base, r#"{severity="critical"}"#));
    let first = world.node("worker-1");
    // The first node stays down after its reboot until the fault is cleared: in flight for as long
    // as the test needs.
    world
        .sim
        .inject_fault(&first, Fault::NeverReturns)
        .expect("fault");
    let log = world.record_annotations().await;
    world.start_controller();
    world.annotate("talos-target", "1.12.0").await;
    wait_for_message(&world, "upgrading the first node", &format!("node {first}")).await;

    // Its alert fires while it is down, and goes on firing after it is back.
    switches.set(&node_switch(&first), true);
    wait_for_alert(&prometheus, "E2ENodeTrouble", true).await;
    world.wait_for_reconciles(3, PATIENCE).await;
    world.sim.clear_faults(&first).expect("clear");

    assert_completed(&world).await;
    wait_for_alert(&prometheus, "E2ENodeTrouble", true).await;
    // Never held on it, not even for a moment.
    let messages = log.values("talos-message");
    assert!(
        messages.iter().all(|m| !m.contains("E2ENodeTrouble")),
        "{messages:#?}"
    );
}

#[tokio::test]
async fn the_cluster_annotation_narrows_and_widens_the_gate() {
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let (switches, prometheus) = switches_and_prometheus(&stop).await;
    let mut world = World::start("alert-annotation", spec()).await;
    world.set_alert_gate(gate(&prometheus.base, r#"{severity="critical"}"#));
    switches.set(WARNING, true);
    wait_for_alert(&prometheus, "E2EWarning", true).await;
    world.start_controller();

    // A value the controller cannot read: the run does not start, and the message says what to write.
    world.annotate("alert-gate", "E2EWarning").await;
    world.annotate("talos-target", "1.12.0").await;
    let refused = wait_for_message(
        &world,
        "the invalid alert-gate",
        "upgrade.vitistack.io/alert-gate",
    )
    .await;
    assert!(refused.contains("alerts: <AlertName>"), "{refused}");
    assert_eq!(world.upgrade_calls(), Vec::<String>::new());

    // Widened to warnings: the warning holds.
    world
        .annotate("alert-gate", r#"{severity=~"critical|warning"}"#)
        .await;
    assert_held(&world, "alerts firing: E2EWarning (since ").await;

    // An expression that must return nothing: it returns the warning's switch.
    world
        .annotate(
            "alert-gate",
            r#"promql: e2e_alert_switch{alert="warning"} > 0"#,
        )
        .await;
    assert_held(&world, "the alert gate's query").await;
    let message = world.annotation("talos-message").await;
    assert!(message.contains("e2e_alert_switch{"), "{message}");

    // Narrowed to one critical alert that is not firing: the warning no longer holds.
    world.annotate("alert-gate", "alerts: E2ECritical").await;
    assert_completed(&world).await;
}

#[tokio::test]
async fn an_unreachable_prometheus_holds_and_never_counts_as_no_alerts() {
    tool("prometheus");
    let mut prometheus = Prometheus::start(&[], RULES).await;
    let mut world = World::start("alert-down", spec()).await;
    world.set_alert_gate(gate(&prometheus.base, r#"{severity="critical"}"#));
    prometheus.stop().await;
    // Its port is kept by the test, so that no other test's server takes it over meanwhile (one did):
    // every connection is closed before an answer, as by a Prometheus going down.
    let address = prometheus.base.trim_start_matches("http://").to_string();
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .expect("the stopped Prometheus's port");
    let closer = tokio::spawn(async move {
        while let Ok((connection, _)) = listener.accept().await {
            drop(connection);
        }
    });
    world.start_controller();
    world.annotate("talos-target", "1.12.0").await;
    let message = assert_held(&world, "is unreachable").await;
    assert!(
        message.contains(&format!("Prometheus at {} is unreachable", prometheus.base)),
        "{message}"
    );
    world.wait_for_reconciles(3, PATIENCE).await;
    assert_held(&world, "is unreachable").await;
    closer.abort();
}

#[tokio::test]
async fn a_bearer_token_and_a_ca_from_a_secret_reach_prometheus_over_verified_tls() {
    let stop = CancellationToken::new();
    let _stop = stop.clone().drop_guard();
    let (switches, prometheus) = switches_and_prometheus(&stop).await;
    const TOKEN: &str = "e2e-secret-token-7f3a";
    let (proxy, ca_pem) = tls_proxy(&prometheus.base, TOKEN, &stop).await;
    let mut world = World::start("alert-tls", spec()).await;
    let mut config = gate(&proxy, r#"{severity="critical"}"#);
    config.auth_secret = Some((world.ns.name.clone(), "prometheus-auth".to_string()));
    world.set_alert_gate(config);
    switches.set(&critical(&world.ns.name), true);
    wait_for_alert(&prometheus, "E2ECritical", true).await;

    // No Secret yet: held, naming it.
    world.start_controller();
    world.annotate("talos-target", "1.12.0").await;
    assert_held(&world, "Secret").await;

    // The right token but not the CA: the platform's roots do not know the proxy's certificate.
    let secret = |token: &str, ca: Option<&str>| {
        let mut args = vec![
            "create".to_string(),
            "secret".to_string(),
            "generic".to_string(),
            "prometheus-auth".to_string(),
            format!("--from-literal=token={token}"),
        ];
        if let Some(ca) = ca {
            args.push(format!("--from-literal=ca.crt={ca}"));
        }
        args.extend(["--dry-run=client".into(), "-o".into(), "yaml".into()]);
        args
    };
    apply_secret(&world, secret(TOKEN, None)).await;
    assert_held(&world, "certificate").await;

    // The CA, a wrong token: the proxy refuses, and the message says where to look.
    apply_secret(&world, secret("wrong-token", Some(&ca_pem))).await;
    assert_held(&world, "HTTP 401 Unauthorized (check the token").await;

    // Both right: the answer comes through, the firing alert holds, then its end releases the run.
    apply_secret(&world, secret(TOKEN, Some(&ca_pem))).await;
    assert_held(&world, "alerts firing: E2ECritical").await;
    switches.set(&critical(&world.ns.name), false);
    assert_completed(&world).await;

    // The token was never shown.
    let annotations = world.jsonpath("{.metadata.annotations}").await;
    assert!(!annotations.contains(TOKEN), "{annotations}");
    let events = world.events().await;
    assert!(
        events.iter().all(|(_, m)| !m.contains(TOKEN)),
        "{events:#?}"
    );
}

/// `kubectl apply` of the Secret that `create_args` (a `kubectl create secret --dry-run` command)
/// prints: created or replaced.
async fn apply_secret(world: &World, create_args: Vec<String>) {
    let args: Vec<&str> = create_args.iter().map(String::as_str).collect();
    let yaml = world.ns.kubectl_ok(&args).await;
    let dir = crate::prometheus::TempDir::new("alert-secret");
    let file = dir.write("secret.yaml", &yaml);
    world
        .ns
        .kubectl_ok(&["apply", "-f", &file.display().to_string()])
        .await;
}

/// A TLS reverse proxy on 127.0.0.1 in front of `upstream` (plain http): a certificate from a fresh
/// CA, 401 for a request without `Authorization: Bearer <token>`, else the upstream's answer to the
/// same GET. Returns its URL and the CA's PEM. One request per connection (it answers
/// `connection: close`): enough for a client that reconnects.
async fn tls_proxy(
    upstream: &str,
    token: &'static str,
    stop: &CancellationToken,
) -> (String, String) {
    let pki = testenv::loopback_tls::LoopbackTls::generate();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let upstream = upstream.to_string();
    let stop = stop.clone();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(_) => return,
                },
            };
            let acceptor = acceptor.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                // A client that does not trust the certificate ends here.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Some(head) = testenv::loopback_tls::read_request_head(&mut tls).await else {
                    return;
                };
                let path = testenv::loopback_tls::request_target(&head).to_string();
                let authorized = head.lines().any(|line| {
                    line.split_once(':').is_some_and(|(name, value)| {
                        name.eq_ignore_ascii_case("authorization")
                            && value.trim() == format!("Bearer {token}")
                    })
                });
                let (status, body) = if authorized {
                    match http_get(&format!("{upstream}{path}")).await {
                        Ok((status, body)) => (status, body),
                        Err(error) => (502, error),
                    }
                } else {
                    (401, "Unauthorized\n".to_string())
                };
                let reason = match status {
                    200 => "OK",
                    401 => "Unauthorized",
                    _ => "Error",
                };
                let status = format!("{status} {reason}");
                testenv::loopback_tls::answer_json(&mut tls, &status, &body).await;
            });
        }
    });
    (format!("https://{address}"), pki.ca_pem)
}
