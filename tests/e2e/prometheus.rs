//! The shipped monitoring (deploy/monitoring.yaml, deploy/grafana/) against the real Prometheus tools
//! (Debian's `prometheus` package: `bash scripts/install-prometheus.sh`):
//!
//! - `promtool check rules` accepts the PrometheusRule's rule groups;
//! - `promtool test rules` shows each alert firing when it should and not before (synthetic series);
//! - a real Prometheus scrapes two in-process controllers during end-to-end Talos upgrades, one good
//!   and one failing: every metric the rules and the dashboard use is in what it scraped, the
//!   failed-upgrade alert fires for the failing cluster and is never even pending for the good one.
//!
//! A missing `prometheus` or `promtool` fails these tests with the install hint; they never skip.
//!
//! Test-only change to the rules: in the live Prometheus, `KubernetesClusterUpgradeFailed` has
//! `for: 0s` instead of `1m` and rules are evaluated every second, so the alert fires as soon as the
//! status is scraped; the `for` durations themselves are checked by the promtool unit tests, which run
//! on a simulated clock.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::world::{World, WorldSpec};
use http_body_util::BodyExt;
use serde::Deserialize;
use serde_json::Value;
use serde_yaml::Value as Yaml;
use talos_sim::Fault;
use talos_upgrade_controller::admin::{self, HealthState};
use tokio_util::sync::CancellationToken;

const MONITORING: &str = include_str!("../../deploy/monitoring.yaml");
const DASHBOARD: &str = include_str!("../../deploy/grafana/talos-upgrade-controller.json");
/// The scrape job's name: what the ServiceMonitor gives it (the Service's name), which the
/// controller-absent alert selects on.
const JOB: &str = "talos-upgrade-controller";
const PATIENCE: Duration = Duration::from_secs(180);

/// The full path of `name` on PATH; panics with the install hint when it is not there.
pub(crate) fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` is not on PATH. The metrics tests need Prometheus and promtool: run \
                 `bash scripts/install-prometheus.sh` (installs Debian's `prometheus` package)."
            )
        })
}

/// A fresh directory under the system temp dir, removed when dropped.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new(prefix: &str) -> TempDir {
        use std::sync::atomic::{AtomicU32, Ordering};
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tuc-{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    pub(crate) fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("writing a temp file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `spec` of the PrometheusRule in deploy/monitoring.yaml: `{groups: [...]}`, which is exactly
/// a Prometheus rule file.
fn shipped_rule_spec() -> Yaml {
    serde_yaml::Deserializer::from_str(MONITORING)
        .map(|doc| Yaml::deserialize(doc).expect("deploy/monitoring.yaml is YAML"))
        .find(|doc| doc["kind"] == "PrometheusRule")
        .expect("a PrometheusRule in deploy/monitoring.yaml")["spec"]
        .clone()
}

fn rules(spec: &Yaml) -> Vec<Yaml> {
    spec["groups"]
        .as_sequence()
        .expect("groups")
        .iter()
        .flat_map(|group| group["rules"].as_sequence().expect("rules").clone())
        .collect()
}

/// The rule file with every alert's `for` replaced as `for_of` says (`None`: keep), and without
/// annotations when `annotations` is false.
fn rule_file(for_of: impl Fn(&str) -> Option<&'static str>, annotations: bool) -> String {
    let mut spec = shipped_rule_spec();
    for group in spec["groups"].as_sequence_mut().expect("groups") {
        for rule in group["rules"].as_sequence_mut().expect("rules") {
            let name = rule["alert"].as_str().unwrap_or_default().to_string();
            let map = rule.as_mapping_mut().expect("a rule is a mapping");
            if let Some(duration) = for_of(&name) {
                map.insert(Yaml::from("for"), Yaml::from(duration));
            }
            if !annotations {
                map.remove("annotations");
            }
        }
    }
    serde_yaml::to_string(&spec).expect("rules serialize")
}

/// Metric names used by a PromQL expression: every `talos_upgrade_…` name, and `up` when it is
/// selected (`up{`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let is_name_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    for (start, _) in expr.match_indices("talos_upgrade_") {
        if expr[..start].chars().next_back().is_some_and(is_name_char) {
            continue;
        }
        let name: String = expr[start..]
            .chars()
            .take_while(|&c| is_name_char(c))
            .collect();
        names.insert(name);
    }
    for (start, _) in expr.match_indices("up{") {
        if !expr[..start].chars().next_back().is_some_and(is_name_char) {
            names.insert("up".to_string());
        }
    }
    names
}

/// The PromQL of the dashboard's panels.
fn dashboard_panel_exprs() -> Vec<String> {
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            exprs.push(
                target["expr"]
                    .as_str()
                    .expect("a target has an expr")
                    .to_string(),
            );
        }
    }
    exprs
}

/// Every query of the dashboard: the panels' PromQL and the template variables' `label_values(...)`
/// (Grafana syntax around a PromQL selector).
fn dashboard_exprs() -> Vec<String> {
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let mut exprs = dashboard_panel_exprs();
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            exprs.push(query.to_string());
        }
    }
    exprs
}

/// A panel's PromQL as Grafana sends it: its variables replaced ("all" for the namespace and cluster
/// selectors).
fn as_grafana_sends_it(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__range", "1h")
        .replace("$namespace", ".*")
        .replace("$cluster", ".*")
}

#[test]
fn promtool_accepts_the_shipped_rules() {
    let promtool = tool("promtool");
    let dir = TempDir::new("promtool-check");
    let file = dir.write("rules.yaml", &rule_file(|_| None, true));
    let output = std::process::Command::new(&promtool)
        .args(["check", "rules"])
        .arg(&file)
        .output()
        .expect("running promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool check rules failed:\n{text}"
    );
    assert!(text.contains("SUCCESS: 4 rules found"), "{text}");
}

/// Synthetic series on promtool's simulated clock (minutes from 0): each alert stays quiet while its
/// condition is too young or false, then fires with the labels a receiver routes on. Series carry an
/// `instance` label per controller replica, as a real scrape does.
const RULE_TESTS: &str = r#"
evaluation_interval: 1m
tests:
  # A failed upgrade; a second replica exports the same series; another cluster completed.
  - interval: 1m
    input_series:
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="broken",kind="talos",status="in-progress",instance="a"}'
        values: '1 1 _x20'
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="broken",kind="talos",status="failed",instance="a"}'
        values: '_ _ 1x20'
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="broken",kind="talos",status="failed",instance="b"}'
        values: '_ _ 1x20'
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="fine",kind="talos",status="completed",instance="a"}'
        values: '1x22'
    alert_rule_test:
      - eval_time: 2m
        alertname: KubernetesClusterUpgradeFailed
        exp_alerts: []
      - eval_time: 3m
        alertname: KubernetesClusterUpgradeFailed
        exp_alerts:
          - exp_labels: {severity: critical, namespace: team-a, cluster: broken, kind: talos}

  # Five nodes: stuck after 5 x 15m + 30m = 105m in progress, then 5m `for`. A cluster whose last
  # run started as long ago but completed does not count.
  - interval: 1m
    input_series:
      - series: 'talos_upgrade_cluster_run_started_timestamp_seconds{namespace="team-a",cluster="slow",kind="talos",instance="a"}'
        values: '0x130'
      - series: 'talos_upgrade_cluster_nodes{namespace="team-a",cluster="slow",kind="talos",instance="a"}'
        values: '5x130'
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="slow",kind="talos",status="in-progress",instance="a"}'
        values: '1x130'
      - series: 'talos_upgrade_cluster_run_started_timestamp_seconds{namespace="team-a",cluster="done",kind="talos",instance="a"}'
        values: '0x130'
      - series: 'talos_upgrade_cluster_nodes{namespace="team-a",cluster="done",kind="talos",instance="a"}'
        values: '5x130'
      - series: 'talos_upgrade_cluster_status{namespace="team-a",cluster="done",kind="talos",status="completed",instance="a"}'
        values: '1x130'
    alert_rule_test:
      - eval_time: 105m
        alertname: KubernetesClusterUpgradeStuck
        exp_alerts: []
      - eval_time: 110m
        alertname: KubernetesClusterUpgradeStuck
        exp_alerts: []
      - eval_time: 112m
        alertname: KubernetesClusterUpgradeStuck
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team-a, cluster: slow, kind: talos}

  # worker-1 upgrades for 15 minutes, worker-2 for 5.
  - interval: 1m
    input_series:
      - series: 'talos_upgrade_cluster_upgrading_node{namespace="team-a",cluster="c",kind="talos",node="worker-1",instance="a"}'
        values: '1x15'
      - series: 'talos_upgrade_cluster_upgrading_node{namespace="team-a",cluster="c",kind="talos",node="worker-2",instance="a"}'
        values: '_x16 1x5'
    alert_rule_test:
      - eval_time: 9m
        alertname: KubernetesClusterNodeUpgradeSlow
        exp_alerts: []
      - eval_time: 11m
        alertname: KubernetesClusterNodeUpgradeSlow
        exp_alerts:
          - exp_labels: {severity: warning, namespace: team-a, cluster: c, kind: talos, node: worker-1}
      - eval_time: 21m
        alertname: KubernetesClusterNodeUpgradeSlow
        exp_alerts: []

  # Both replicas scraped until 10m, then every scrape fails.
  - interval: 1m
    input_series:
      - series: 'up{job="talos-upgrade-controller",instance="a"}'
        values: '1x10 0x20'
      - series: 'up{job="talos-upgrade-controller",instance="b"}'
        values: '1x10 0x20'
    alert_rule_test:
      - eval_time: 10m
        alertname: TalosUpgradeControllerAbsent
        exp_alerts: []
      - eval_time: 15m
        alertname: TalosUpgradeControllerAbsent
        exp_alerts: []
      - eval_time: 17m
        alertname: TalosUpgradeControllerAbsent
        exp_alerts:
          - exp_labels: {severity: warning}
"#;

#[test]
fn promtool_unit_tests_show_each_alert_firing_when_it_should_and_not_before() {
    let promtool = tool("promtool");
    let dir = TempDir::new("promtool-test");
    // Annotations are left out: promtool compares them verbatim, and `check rules` validates them.
    dir.write("rules.yaml", &rule_file(|_| None, false));
    let tests = dir.write(
        "tests.yaml",
        &format!("rule_files: [rules.yaml]\n{RULE_TESTS}"),
    );
    let output = std::process::Command::new(&promtool)
        .args(["test", "rules"])
        .arg(&tests)
        .current_dir(&dir.0)
        .output()
        .expect("running promtool");
    assert!(
        output.status.success(),
        "promtool test rules failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // Every alert of the shipped rules is covered by a test above.
    for rule in rules(&shipped_rule_spec()) {
        let alert = rule["alert"].as_str().expect("every rule is an alert");
        assert!(
            RULE_TESTS.contains(&format!("alertname: {alert}")),
            "no promtool test for {alert}"
        );
    }
}

// ----- a real Prometheus -----

/// GET `url` (plain HTTP on loopback); the status and body.
pub(crate) async fn http_get(url: &str) -> Result<(u16, String), String> {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<hyper::body::Bytes>>();
    let uri: hyper::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let response = tokio::time::timeout(Duration::from_secs(10), client.get(uri))
        .await
        .map_err(|_| format!("GET {url} timed out"))?
        .map_err(|e| format!("GET {url}: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("reading {url}: {e}"))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Percent-encoding of a query parameter value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus server process on a free loopback port, killed when dropped.
pub(crate) struct Prometheus {
    pub(crate) base: String,
    child: tokio::process::Child,
    dir: TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` every second as job [`JOB`], evaluating `rules` every
    /// second, and waits until it is ready.
    pub(crate) async fn start(targets: &[String], rules: &str) -> Prometheus {
        let binary = tool("prometheus");
        let dir = TempDir::new("prometheus");
        dir.write("rules.yaml", rules);
        let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
        let config = dir.write(
            "prometheus.yml",
            &format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files: [rules.yaml]\n\
                 scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ),
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = std::fs::File::create(dir.0.join("prometheus.log")).expect("log file");
        let child = tokio::process::Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.0.join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .current_dir(&dir.0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("starting prometheus");
        let prometheus = Prometheus {
            base: format!("http://127.0.0.1:{port}"),
            child,
            dir,
        };
        prometheus
            .wait_for("Prometheus to be ready", || async {
                matches!(
                    http_get(&format!("{}/-/ready", prometheus.base)).await,
                    Ok((200, _))
                )
            })
            .await;
        prometheus
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/<path>`; the `data` of a successful answer.
    pub(crate) async fn api(&self, path: &str) -> Value {
        let url = format!("{}/api/v1/{path}", self.base);
        let (status, body) = http_get(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}\nprometheus log:\n{}", self.log()));
        let answer: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"));
        assert!(
            status == 200 && answer["status"] == "success",
            "{url}: {status} {body}"
        );
        answer["data"].clone()
    }

    /// The instant vector of `query`.
    pub(crate) async fn query(&self, query: &str) -> Vec<Value> {
        let data = self.api(&format!("query?query={}", encode(query))).await;
        data["result"].as_array().cloned().unwrap_or_default()
    }

    pub(crate) async fn wait_for<F, Fut>(&self, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + PATIENCE;
        while !check().await {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\nprometheus log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Waits until the rule group has been evaluated after this call, so what it says reflects
    /// every sample scraped before.
    async fn wait_for_rule_evaluation(&self) {
        let since = jiff::Timestamp::now();
        self.wait_for("a rule evaluation", || async {
            let data = self.api("rules").await;
            data["groups"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|group| {
                    group["lastEvaluation"]
                        .as_str()
                        .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                        .is_some_and(|t| t > since)
                })
        })
        .await;
    }

    /// The alerts Prometheus holds now (pending and firing).
    pub(crate) async fn alerts(&self) -> Vec<Value> {
        self.api("alerts").await["alerts"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

impl Prometheus {
    /// Kills the server and waits until it is gone (a Prometheus that stops answering).
    pub(crate) async fn stop(&mut self) {
        let _ = self.child.kill().await;
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// Serves a world's metrics as the controller's admin server does; the address.
async fn serve_admin(world: &World, stop: &CancellationToken) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let health = HealthState::default();
    health.set_ready();
    tokio::spawn(admin::serve_on(
        listener,
        admin::router(world.metrics.clone(), health),
        stop.clone().cancelled_owned(),
    ));
    addr.to_string()
}

struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

fn has_label(series: &Value, name: &str, value: &str) -> bool {
    series["labels"][name] == value || series["metric"][name] == value
}

#[tokio::test]
async fn a_real_prometheus_scrapes_upgrades_sees_every_metric_used_and_alerts_only_on_the_failed_one()
 {
    // Fail before building anything when Prometheus is missing.
    tool("prometheus");
    let (good, bad) = tokio::join!(
        World::start("prom-good", WorldSpec::default()),
        World::start("prom-bad", WorldSpec::default()),
    );
    let stop = CancellationToken::new();
    let _stop = StopOnDrop(stop.clone());
    let targets = [
        serve_admin(&good, &stop).await,
        serve_admin(&bad, &stop).await,
    ];
    let prometheus = Prometheus::start(
        &targets,
        &rule_file(
            |alert| (alert == "KubernetesClusterUpgradeFailed").then_some("0s"),
            true,
        ),
    )
    .await;
    prometheus
        .wait_for("both controllers to be scraped", || async {
            prometheus
                .query(&format!("up{{job=\"{JOB}\"}} == 1"))
                .await
                .len()
                == 2
        })
        .await;
    for world in [&good, &bad] {
        world
            .wait_for_annotation("talos-current", "1.11.6", "60s")
            .await;
    }

    // A reconcile error, as a user who breaks the progress ConfigMap causes one: the controller
    // reports it (talos_upgrade_reconcile_errors_total) and goes on once the ConfigMap is gone. The
    // record carries the controller's labels, as every record it writes does: its watch sees only
    // those (managed-by), and one made by hand without them is read when a run first saves or
    // within the hour (`progress_store::ProgressStore::remember`).
    bad.ns
        .kubectl_ok(&[
            "create",
            "configmap",
            "talos-upgrade-my-cluster",
            "--from-literal=talos.json={not json",
        ])
        .await;
    bad.ns
        .kubectl_ok(&[
            "label",
            "configmap",
            "talos-upgrade-my-cluster",
            "app.kubernetes.io/managed-by=talos-upgrade-controller",
            &format!(
                "{}=my-cluster",
                talos_upgrade_controller::progress_store::CLUSTER_LABEL
            ),
        ])
        .await;
    bad.poke_and_wait(1).await;
    prometheus
        .wait_for("a scraped reconcile error", || async {
            !prometheus
                .query("talos_upgrade_reconcile_errors_total")
                .await
                .is_empty()
        })
        .await;
    bad.ns
        .kubectl_ok(&["delete", "configmap", "talos-upgrade-my-cluster"])
        .await;

    // The failing cluster: its first node refuses the installer image.
    bad.sim
        .inject_fault(&bad.node("worker-1"), Fault::InstallerPullFails)
        .expect("fault");
    bad.annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;

    // The good cluster: etcd is unhealthy for a while, so a preflight check fails and the controller
    // holds before the control planes, then goes on by itself once etcd recovers.
    let cp2 = good.node("cp-2");
    good.sim
        .inject_fault(&cp2, Fault::EtcdUnhealthy)
        .expect("fault");
    good.annotate_raw("upgrade.vitistack.io/upgrade-order=control-planes-first")
        .await;
    // And it soaks a moment after the control planes, so the gates' hold metrics are scraped too.
    good.annotate_raw("upgrade.vitistack.io/soak-after-control-planes=1s")
        .await;
    good.annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    good.wait_for_annotation_matching("talos-message", PATIENCE, "about etcd", |m| {
        m.contains("etcd")
    })
    .await;
    good.wait_for_reconciles(3, PATIENCE).await;
    good.sim.clear_faults(&cp2).expect("clear");

    good.wait_for_annotation("talos-status", "completed", "180s")
        .await;
    bad.wait_for_annotation("talos-status", "failed", "180s")
        .await;

    // Prometheus has scraped both outcomes and evaluated the rules on them.
    for (world, status) in [(&good, "completed"), (&bad, "failed")] {
        let query = format!(
            "talos_upgrade_cluster_status{{namespace=\"{}\",status=\"{status}\"}} == 1",
            world.ns.name
        );
        prometheus
            .wait_for(&format!("{status} to be scraped"), || async {
                !prometheus.query(&query).await.is_empty()
            })
            .await;
    }
    prometheus.wait_for_rule_evaluation().await;

    // The failed upgrade fires, with the labels an Alertmanager routes on.
    let alerts = prometheus.alerts().await;
    let failed: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["labels"]["alertname"] == "KubernetesClusterUpgradeFailed")
        .collect();
    assert_eq!(failed.len(), 1, "{alerts:#?}");
    let alert = failed[0];
    assert_eq!(alert["state"], "firing", "{alert:#?}");
    assert!(has_label(alert, "namespace", &bad.ns.name), "{alert:#?}");
    assert!(has_label(alert, "cluster", "my-cluster"), "{alert:#?}");
    assert!(has_label(alert, "kind", "talos"), "{alert:#?}");
    assert!(has_label(alert, "severity", "critical"), "{alert:#?}");
    let summary = alert["annotations"]["summary"].as_str().unwrap_or_default();
    assert_eq!(
        summary,
        format!("talos upgrade of {}/my-cluster failed", bad.ns.name)
    );

    // The good run: the failed-upgrade alert was never pending or firing for it, at any evaluation
    // (ALERTS keeps a series for every pending or firing alert), and no alert fires for it now.
    let ever = prometheus
        .query(&format!(
            "max_over_time(ALERTS{{alertname=\"KubernetesClusterUpgradeFailed\",namespace=\"{}\"}}[1h])",
            good.ns.name
        ))
        .await;
    assert!(ever.is_empty(), "{ever:#?}");
    let firing_for_good: Vec<&Value> = alerts
        .iter()
        .filter(|a| a["state"] == "firing" && has_label(a, "namespace", &good.ns.name))
        .collect();
    assert!(firing_for_good.is_empty(), "{firing_for_good:#?}");
    // Both controllers are up: the absent alert is quiet.
    assert!(
        alerts
            .iter()
            .all(|a| a["labels"]["alertname"] != "TalosUpgradeControllerAbsent"),
        "{alerts:#?}"
    );

    // Every metric the rules and the dashboard use was scraped at some point of these runs.
    let scraped: BTreeSet<String> = prometheus
        .api("label/__name__/values")
        .await
        .as_array()
        .expect("names")
        .iter()
        .filter_map(|n| n.as_str().map(str::to_string))
        .collect();
    let mut used = BTreeSet::new();
    for rule in rules(&shipped_rule_spec()) {
        used.extend(metric_names(rule["expr"].as_str().expect("expr")));
    }
    for expr in dashboard_exprs() {
        used.extend(metric_names(&expr));
    }
    // Every panel's query is valid PromQL to this Prometheus (it answers 400 otherwise), and the
    // per-cluster panels show both clusters.
    for expr in dashboard_panel_exprs() {
        let series = prometheus.query(&as_grafana_sends_it(&expr)).await;
        if expr
            .starts_with("max by (namespace, cluster, kind, status) (talos_upgrade_cluster_status")
        {
            for world in [&good, &bad] {
                assert!(
                    series
                        .iter()
                        .any(|s| has_label(s, "namespace", &world.ns.name)),
                    "{expr}: {series:#?}"
                );
            }
        }
    }
    // The soak held the good run once, by its gate and reason, and holds it no more.
    let soaks = prometheus
        .query(&format!(
            "talos_upgrade_holds_total{{namespace=\"{}\",gate=\"soak\",reason=\"after-control-planes\"}}",
            good.ns.name
        ))
        .await;
    assert_eq!(soaks.len(), 1, "{soaks:#?}");
    assert_eq!(soaks[0]["value"][1], "1", "{soaks:#?}");
    let held_now = prometheus
        .query(&format!(
            "talos_upgrade_hold{{namespace=\"{}\"}} == 1",
            good.ns.name
        ))
        .await;
    assert!(held_now.is_empty(), "{held_now:#?}");
    // The extraction found what it should (a guard against a parser that finds nothing).
    for name in [
        "talos_upgrade_cluster_status",
        "talos_upgrade_cluster_run_started_timestamp_seconds",
        "talos_upgrade_node_upgrade_duration_seconds_bucket",
        "talos_upgrade_runs_total",
        "up",
    ] {
        assert!(used.contains(name), "{name} not found in {used:?}");
    }
    let missing: Vec<&String> = used.difference(&scraped).collect();
    assert!(
        missing.is_empty(),
        "used by the rules or the dashboard but never scraped: {missing:?}\nscraped: {scraped:?}"
    );
}

#[test]
fn metric_names_are_found_in_promql() {
    let names = metric_names(
        r#"histogram_quantile(0.95, sum by (le) (rate(talos_upgrade_node_upgrade_duration_seconds_bucket{namespace=~"$namespace"}[5m]))) / absent(up{job="x"} == 1) and my_up{a="b"}"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["talos_upgrade_node_upgrade_duration_seconds_bucket", "up"]
    );
}
