//! Alertmanager silences during Talos runs (issue #23 item 2) against a real Alertmanager: Debian's
//! `prometheus-alertmanager` (`bash scripts/install-prometheus.sh`), started by each test on a free
//! loopback port with a temporary storage directory (never the package's service). What is asserted
//! is what Alertmanager holds (through its API v2: matchers, createdBy, state, ids), the cluster's
//! Events and the controller's metrics.
//!
//! Covered: node mode (the default) silences each node in flight and expires it after; run mode keeps
//! one silence for the run's nodes, extended in place when the (test) clock moves on, and expired when
//! the run completes, fails, loses its target or its cluster; a restarted controller reuses its
//! silence and expires the one of a run reset while it was down; an unreachable Alertmanager never
//! stops a run and is reported without the token; over https (Alertmanager's own TLS) a CA the
//! controller does not trust is reported, the auth Secret's `ca.crt` is trusted; an invalid mode is
//! refused.
//!
//! A missing `prometheus-alertmanager` fails these tests with the install hint; they never skip.

use std::process::Stdio;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use serde_json::{Value, json};
use talos_sim::{Fault, Timings};
use talos_upgrade_controller::silences::AlertmanagerConfig;
use talos_upgrade_core::silences::SilenceConfig;

use crate::prometheus::{TempDir, http_get, tool};
use crate::world::{World, WorldSpec};

const PATIENCE: Duration = Duration::from_secs(180);
const BINARY: &str = "prometheus-alertmanager";

/// An Alertmanager process on a free loopback port, killed when dropped.
struct Alertmanager {
    base: String,
    child: tokio::process::Child,
    dir: TempDir,
}

impl Alertmanager {
    async fn start() -> Alertmanager {
        Alertmanager::start_with(None).await
    }

    /// With `tls`: (certificate PEM, key PEM) served over https (Alertmanager's web config); the
    /// test then reads Alertmanager through the controller's Events only, and readiness is its port
    /// answering.
    async fn start_with(tls: Option<(String, String)>) -> Alertmanager {
        let binary = tool(BINARY);
        let dir = TempDir::new("alertmanager");
        let web = tls.as_ref().map(|(certificate, key)| {
            let certificate = dir.write("server.crt", certificate);
            let key = dir.write("server.key", key);
            dir.write(
                "web.yml",
                &format!(
                    "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
                    certificate.display(),
                    key.display()
                ),
            )
        });
        // No notification goes anywhere: the tests look at the silences only.
        let config = dir.write(
            "alertmanager.yml",
            "route:\n  receiver: nowhere\nreceivers:\n  - name: nowhere\n",
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = std::fs::File::create(dir.0.join("alertmanager.log")).expect("log file");
        let mut command = tokio::process::Command::new(binary);
        if let Some(web) = &web {
            command.arg(format!("--web.config.file={}", web.display()));
        }
        let child = command
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.path={}", dir.0.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            // No gossip: one Alertmanager, and no second port to take.
            .arg("--cluster.listen-address=")
            .current_dir(&dir.0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .expect("starting prometheus-alertmanager");
        let scheme = if web.is_some() { "https" } else { "http" };
        let alertmanager = Alertmanager {
            base: format!("{scheme}://127.0.0.1:{port}"),
            child,
            dir,
        };
        let deadline = Instant::now() + PATIENCE;
        if web.is_some() {
            while tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_err()
            {
                assert!(
                    Instant::now() < deadline,
                    "Alertmanager never listened:\n{}",
                    alertmanager.log()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return alertmanager;
        }
        while !matches!(
            http_get(&format!("{}/-/ready", alertmanager.base)).await,
            Ok((200, _))
        ) {
            assert!(
                Instant::now() < deadline,
                "Alertmanager never became ready:\n{}",
                alertmanager.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        alertmanager
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("alertmanager.log")).unwrap_or_default()
    }

    /// Every silence Alertmanager holds, expired ones included.
    async fn silences(&self) -> Vec<Value> {
        let url = format!("{}/api/v2/silences", self.base);
        let (status, body) = http_get(&url)
            .await
            .unwrap_or_else(|e| panic!("{e}\nalertmanager log:\n{}", self.log()));
        assert_eq!(status, 200, "{url}: {body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{url}: {e}: {body}"))
    }

    /// The controller's silences of `world`'s cluster (by createdBy and the comment's cluster word).
    async fn ours(&self, world: &World) -> Vec<Value> {
        let cluster = format!("cluster={}/{}", world.ns.name, world.cluster);
        self.silences()
            .await
            .into_iter()
            .filter(|s| {
                s["createdBy"] == "talos-upgrade-controller"
                    && s["comment"]
                        .as_str()
                        .is_some_and(|c| c.split_whitespace().any(|w| w == cluster))
            })
            .collect()
    }

    async fn active_ours(&self, world: &World) -> Vec<Value> {
        self.ours(world)
            .await
            .into_iter()
            .filter(|s| s["status"]["state"] == "active")
            .collect()
    }

    /// `POST /api/v2/silences`; the id.
    async fn post(&self, silence: &Value) -> String {
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<http_body_util::Full<hyper::body::Bytes>>();
        let request = hyper::Request::post(format!("{}/api/v2/silences", self.base))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(hyper::body::Bytes::from(
                silence.to_string(),
            )))
            .expect("a request");
        let response = client.request(request).await.expect("POST a silence");
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        assert!(status.is_success(), "{status}: {body:?}");
        let answer: Value = serde_json::from_slice(&body).expect("json");
        answer["silenceID"].as_str().expect("an id").to_string()
    }

    async fn wait_for<F, Fut>(&self, what: &str, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + PATIENCE;
        while !check().await {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}\nalertmanager log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The silences' configuration for `url`: each silence scoped to the cluster by its id too.
fn config(url: &str) -> AlertmanagerConfig {
    AlertmanagerConfig {
        url: url.to_string(),
        auth_secret: None,
        silences: SilenceConfig {
            node_label: "node".to_string(),
            extra: SilenceConfig::parse_matchers(r#"cluster="{clusterId}""#).expect("matchers"),
        },
        timeout: Duration::from_secs(5),
        list_ttl: Duration::from_secs(2),
        secret_ttl: Duration::from_secs(60),
    }
}

/// One control plane and two workers whose reboots take a moment, so that a node stays in flight
/// for a few of the controller's looks; the controller not started yet.
fn spec() -> WorldSpec {
    WorldSpec {
        control_planes: 1,
        workers: 2,
        start_controller: false,
        timings: Timings {
            reboot_ms: 1500,
            boot_ms: 300,
            ready_ms: 300,
            ..Timings::fast()
        },
        ..WorldSpec::default()
    }
}

async fn world(prefix: &str, alertmanager_url: &str) -> World {
    let mut world = World::start(prefix, spec()).await;
    world.set_silences(config(alertmanager_url));
    world
}

/// The nodes the controller's metrics say are being upgraded now.
fn in_flight(world: &World) -> Vec<String> {
    world
        .metrics
        .encode()
        .lines()
        .filter(|l| {
            l.starts_with("talos_upgrade_cluster_upgrading_node{")
                && l.contains(&format!("namespace=\"{}\"", world.ns.name))
        })
        .filter_map(|l| l.split("node=\"").nth(1)?.split('"').next())
        .map(str::to_string)
        .collect()
}

/// The matchers of a silence, as `name op value` strings.
fn matchers(silence: &Value) -> Vec<String> {
    silence["matchers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            let op = match (m["isEqual"].as_bool(), m["isRegex"].as_bool()) {
                (Some(false), Some(true)) => "!~",
                (Some(false), _) => "!=",
                (_, Some(true)) => "=~",
                _ => "=",
            };
            format!(
                "{}{op}{}",
                m["name"].as_str().unwrap_or_default(),
                m["value"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

fn id(silence: &Value) -> String {
    silence["id"].as_str().expect("an id").to_string()
}

fn ends_at(silence: &Value) -> jiff::Timestamp {
    silence["endsAt"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("endsAt")
}

fn cluster_matcher(world: &World) -> String {
    format!("cluster={}-id", world.ns.name)
}

/// Starts the controller on `world` and waits until it has read the cluster's Talos version.
async fn watching(world: &World) {
    world.start_controller();
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
}

/// An Alertmanager, and a world named after `prefix` whose controller silences in it, watching.
async fn watched(prefix: &str) -> (Alertmanager, World) {
    let alertmanager = Alertmanager::start().await;
    let world = world(prefix, &alertmanager.base).await;
    watching(&world).await;
    (alertmanager, world)
}

/// Starts a run in `alert-silences: run` mode to 1.12.0 that holds in its soak after the first
/// node (`soak-after-node: 1h`), and waits for the soak.
async fn run_into_soak(world: &World) {
    world.annotate("alert-silences", "run").await;
    world.annotate("soak-after-node", "1h").await;
    world.annotate("talos-target", "1.12.0").await;
    wait_for_soak(world).await;
}

/// Waits until the run holds in its soak after the first node (`soak-after-node: 1h`).
async fn wait_for_soak(world: &World) {
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the soak", |m| {
            m.starts_with("Waiting: ") && m.contains("soak")
        })
        .await;
}

/// The run's one silence, once it is the only active one of ours.
async fn the_run_silence(alertmanager: &Alertmanager, world: &World) -> Value {
    alertmanager
        .wait_for("the run's silence", || async {
            alertmanager.active_ours(world).await.len() == 1
        })
        .await;
    alertmanager.active_ours(world).await.remove(0)
}

/// Waits for an Event of `reason` whose message contains `words`; its message.
async fn event_saying(world: &World, reason: &str, words: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let messages = world.event_messages(reason).await;
        if let Some(found) = messages.iter().find(|m| m.contains(words)) {
            return found.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no {reason} Event saying {words:?}: {:#?}",
            world.events().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn assert_none_active(alertmanager: &Alertmanager, world: &World) {
    alertmanager
        .wait_for("no active silence of ours", || async {
            alertmanager.active_ours(world).await.is_empty()
        })
        .await;
}

#[tokio::test]
async fn node_mode_silences_each_node_while_it_is_upgraded_and_expires_it_after() {
    node_mode("silence-node", "1.11.6", "1.12.0").await;
}

/// Talos ≥ 1.13, where the controller sequences install, drain and reboot itself.
#[tokio::test]
async fn node_mode_silences_each_node_through_install_drain_and_reboot() {
    node_mode("silence-node-13", "1.13.0", "1.13.1").await;
}

/// A run from `from` to `to` with silences in node mode (the default): each node seen in flight is
/// seen silenced, and each silence expired at the end.
async fn node_mode(prefix: &str, from: &'static str, to: &str) {
    let alertmanager = Alertmanager::start().await;
    let mut world = World::start(
        prefix,
        WorldSpec {
            talos: from,
            ..spec()
        },
    )
    .await;
    world.set_silences(config(&alertmanager.base));
    world.start_controller();
    world
        .wait_for_annotation("talos-current", from, "60s")
        .await;
    // No annotation: node mode is the default with an Alertmanager.
    world.annotate("talos-target", to).await;

    // While the run goes on: which node was seen in flight with an active silence naming it.
    let mut seen_in_flight = std::collections::BTreeSet::new();
    let mut silenced = std::collections::BTreeSet::new();
    let deadline = Instant::now() + PATIENCE;
    while world.annotation("talos-status").await != "completed" {
        assert!(Instant::now() < deadline, "the run did not complete");
        let flying = in_flight(&world);
        let active = alertmanager.active_ours(&world).await;
        for node in flying {
            seen_in_flight.insert(node.clone());
            if active
                .iter()
                .any(|s| matchers(s).contains(&format!("node={node}")))
            {
                silenced.insert(node);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let nodes = world.assert_each_node_upgraded_once(3);
    assert_eq!(
        silenced, seen_in_flight,
        "a node in flight was never seen silenced"
    );
    assert!(!silenced.is_empty(), "no node was seen in flight");

    // At the end nothing of ours is active, and each node had one silence, expired.
    assert_none_active(&alertmanager, &world).await;
    let ours = alertmanager.ours(&world).await;
    for node in &nodes {
        let theirs: Vec<&Value> = ours
            .iter()
            .filter(|s| matchers(s).contains(&format!("node={node}")))
            .collect();
        assert_eq!(theirs.len(), 1, "{node}: {ours:#?}");
        assert_eq!(
            matchers(theirs[0]),
            vec![format!("node={node}"), cluster_matcher(&world)]
        );
        assert_eq!(theirs[0]["status"]["state"], "expired");
        let comment = theirs[0]["comment"].as_str().unwrap_or_default();
        assert!(comment.contains(&format!("scope=node:{node}")), "{comment}");
    }
    assert_eq!(ours.len(), 3, "{ours:#?}");
    // Each told by an Event naming the silence.
    world.wait_for_event("SilenceExpired", None).await;
    let created = world.event_messages("SilenceCreated").await;
    let expired = world.event_messages("SilenceExpired").await;
    for silence in &ours {
        let id = id(silence);
        assert!(
            created.iter().any(|m| m.contains(&id)),
            "{id}: {created:#?}"
        );
        assert!(
            expired.iter().any(|m| m.contains(&id)),
            "{id}: {expired:#?}"
        );
    }
    assert!(
        expired
            .iter()
            .any(|m| m.contains("is upgraded") || m.contains("the run completed")),
        "{expired:#?}"
    );
    assert!(world.event_messages("SilenceFailed").await.is_empty());
}

#[tokio::test]
async fn run_mode_keeps_one_silence_extends_it_and_expires_it_when_the_run_completes() {
    let (alertmanager, world) = watched("silence-run").await;
    run_into_soak(&world).await;

    // One silence for every node of the run, held between nodes too.
    let silence = the_run_silence(&alertmanager, &world).await;
    let nodes = [
        world.node("cp-1"),
        world.node("worker-1"),
        world.node("worker-2"),
    ];
    let node_matcher = matchers(&silence)
        .into_iter()
        .find(|m| m.starts_with("node=~"))
        .expect("a node regex");
    for node in &nodes {
        assert!(node_matcher.contains(node.as_str()), "{node_matcher}");
    }
    assert!(matchers(&silence).contains(&cluster_matcher(&world)));
    assert_eq!(silence["createdBy"], "talos-upgrade-controller");
    let first_end = ends_at(&silence);

    // Eleven minutes on (less than five left): extended in place, same id.
    world.set_clock(jiff::Timestamp::now() + jiff::SignedDuration::from_mins(11));
    world.poke_and_wait(1).await;
    alertmanager
        .wait_for("the silence extended", || async {
            let active = alertmanager.active_ours(&world).await;
            active.len() == 1
                && id(&active[0]) == id(&silence)
                && ends_at(&active[0]) > first_end + jiff::SignedDuration::from_mins(5)
        })
        .await;
    assert_eq!(
        alertmanager.ours(&world).await.len(),
        1,
        "extended, not replaced"
    );

    // The soak lifted: the run completes and its silence is expired.
    world.remove_annotation("soak-after-node").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
    assert_none_active(&alertmanager, &world).await;
    let expired = event_saying(&world, "SilenceExpired", "the run completed").await;
    assert!(expired.contains(&id(&silence)), "{expired}");
    assert_eq!(world.event_messages("SilenceCreated").await.len(), 1);
}

#[tokio::test]
async fn run_mode_expires_the_silence_when_the_run_fails() {
    let (alertmanager, world) = watched("silence-fail").await;
    // Workers go first: the first one falls back to its old version.
    world
        .sim
        .inject_fault(&world.node("worker-1"), Fault::BootsOldVersion)
        .expect("fault");
    world.annotate("alert-silences", "run").await;
    world.annotate("talos-target", "1.12.0").await;
    world.wait_for_event("SilenceCreated", None).await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    assert_none_active(&alertmanager, &world).await;
    event_saying(&world, "SilenceExpired", "the run failed").await;
}

#[tokio::test]
async fn run_mode_expires_the_silence_when_the_target_is_removed_mid_run() {
    let (alertmanager, world) = watched("silence-untarget").await;
    run_into_soak(&world).await;
    let silence = the_run_silence(&alertmanager, &world).await;
    world.remove_annotation("talos-target").await;
    assert_none_active(&alertmanager, &world).await;
    let expired = world.wait_for_event("SilenceExpired", None).await;
    assert!(
        expired.message.contains(&id(&silence)),
        "{}",
        expired.message
    );
}

#[tokio::test]
async fn run_mode_expires_the_silence_when_the_cluster_is_deleted_mid_run() {
    let (alertmanager, world) = watched("silence-delete").await;
    run_into_soak(&world).await;
    the_run_silence(&alertmanager, &world).await;
    // Nothing of the controller's holds the deletion up; the watch sees it go.
    world
        .ns
        .kubectl_ok(&[
            "delete",
            "kubernetescluster",
            &world.cluster,
            "--timeout=60s",
        ])
        .await;
    assert_none_active(&alertmanager, &world).await;
    let metrics = world.metrics.encode();
    assert!(
        metrics.lines().any(|l| l.starts_with(
            r#"talos_upgrade_silence_requests_total{operation="expire",result="ok"}"#
        )),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_restarted_controller_reuses_its_silence_and_expires_the_one_of_a_run_ended_meanwhile() {
    let alertmanager = Alertmanager::start().await;
    let world = world("silence-restart", &alertmanager.base).await;
    let now = jiff::Timestamp::now();
    // Someone else's silence of the same node is never touched.
    let foreign = alertmanager
        .post(&json!({
            "matchers": [{"name": "node", "value": world.node("worker-1"), "isRegex": false, "isEqual": true}],
            "startsAt": now.to_string(),
            "endsAt": (now + jiff::SignedDuration::from_hours(2)).to_string(),
            "createdBy": "alice",
            "comment": format!("cluster={}/{} maintenance", world.ns.name, world.cluster),
        }))
        .await;
    // Nor is one of another object of the same namespace and name (another management cluster's).
    let namesake = alertmanager
        .post(&json!({
            "matchers": [{"name": "node", "value": world.node("cp-1"), "isRegex": false, "isEqual": true}],
            "startsAt": now.to_string(),
            "endsAt": (now + jiff::SignedDuration::from_mins(15)).to_string(),
            "createdBy": "talos-upgrade-controller",
            "comment": format!(
                "cluster={}/{} uid=another-object run=1.12.0@2026-01-01T00:00:00Z scope=run",
                world.ns.name, world.cluster
            ),
        }))
        .await;
    // This cluster's own, without the namesake.
    let own = || async {
        alertmanager
            .ours(&world)
            .await
            .into_iter()
            .filter(|s| id(s) != namesake)
            .collect::<Vec<Value>>()
    };
    watching(&world).await;
    run_into_soak(&world).await;
    alertmanager
        .wait_for("the run's silence", || async { own().await.len() == 1 })
        .await;
    let silence = own().await.remove(0);
    assert_eq!(silence["status"]["state"], "active");

    // A new controller finds it and keeps it: same id, no second one.
    world.restart_controller().await;
    world.poke_and_wait(1).await;
    world.poke_and_wait(2).await;
    let after: Vec<String> = own().await.iter().map(id).collect();
    assert_eq!(after, vec![id(&silence)], "the same silence, no second one");
    assert_eq!(world.event_messages("SilenceCreated").await.len(), 1);

    // The run is reset while no controller runs: the next one expires the silence it left.
    world.stop_controller().await;
    world.annotate("talos-reset-upgrade-state", "true").await;
    world.start_controller();
    let expired = world.wait_for_event("SilenceExpired", None).await;
    assert!(
        expired.message.contains(&id(&silence)),
        "{}",
        expired.message
    );
    alertmanager
        .wait_for("the run's silence expired", || async {
            own()
                .await
                .iter()
                .all(|s| s["status"]["state"] == "expired")
        })
        .await;
    let all = alertmanager.silences().await;
    for (other, whose) in [(&foreign, "someone else's"), (&namesake, "the namesake's")] {
        assert!(
            all.iter()
                .any(|s| id(s) == *other && s["status"]["state"] == "active"),
            "{whose} silence was touched: {all:#?}"
        );
    }
}

#[tokio::test]
async fn an_unreachable_alertmanager_never_stops_the_upgrade_and_is_reported_without_secrets() {
    // A port that refuses: bound, then closed.
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let url = format!("http://{address}");
    let mut world = World::start("silence-down", spec()).await;
    let token = "s3cr3t-silence-token";
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(world.ns.client.clone(), &world.ns.name);
    secrets
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "am-auth"},
                "stringData": {"token": token},
            }))
            .expect("a Secret"),
        )
        .await
        .expect("the auth Secret");
    world.set_silences(AlertmanagerConfig {
        auth_secret: Some((world.ns.name.clone(), "am-auth".to_string())),
        ..config(&url)
    });
    watching(&world).await;
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
    let failed = world.wait_for_event("SilenceFailed", None).await;
    assert_eq!(failed.type_, "Warning");
    assert!(
        failed.message.contains(&format!(
            "Alertmanager at {url} (list silences): unreachable"
        )),
        "{}",
        failed.message
    );
    assert!(
        failed
            .message
            .ends_with("; the upgrade goes on without the silence"),
        "{}",
        failed.message
    );
    for (_, message) in world.events().await {
        assert!(!message.contains(token), "{message}");
    }
    for annotation in ["talos-message", "talos-status"] {
        assert!(!world.annotation(annotation).await.contains(token));
    }
    let metrics = world.metrics.encode();
    assert!(
        metrics.lines().any(|l| l.starts_with(
            r#"talos_upgrade_silence_requests_total{operation="list",result="error"}"#
        )),
        "{metrics}"
    );
    // Once per message, not once per reconcile.
    let said = world.event_messages("SilenceFailed").await;
    let distinct: std::collections::BTreeSet<&String> = said.iter().collect();
    assert_eq!(said.len(), distinct.len(), "{said:#?}");
}

#[tokio::test]
async fn an_invalid_mode_is_refused_and_touches_no_node() {
    let (alertmanager, world) = watched("silence-invalid").await;
    world.annotate("alert-silences", "nodes").await;
    world.annotate("talos-target", "1.12.0").await;
    let message = world
        .wait_for_annotation_matching("talos-message", PATIENCE, "the refusal", |m| {
            m.contains("upgrade.vitistack.io/alert-silences")
        })
        .await;
    assert!(message.contains("use off, node"), "{message}");
    event_saying(&world, "InvalidOption", "alert-silences").await;
    assert_eq!(world.upgrade_calls(), Vec::<String>::new());
    assert!(alertmanager.ours(&world).await.is_empty());
}

/// A CA and a certificate it signs for 127.0.0.1: (CA PEM, certificate PEM, key PEM).
fn certificates() -> (String, String, String) {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::default();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let key = rcgen::KeyPair::generate().expect("server key");
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = vec![rcgen::SanType::IpAddress(
        std::net::Ipv4Addr::LOCALHOST.into(),
    )];
    let certificate = params.signed_by(&key, &issuer).expect("server certificate");
    (ca.pem(), certificate.pem(), key.serialize_pem())
}

/// Creates or replaces the Secret `name` with `data` (string values).
async fn put_secret(world: &World, name: &str, data: Value) {
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(world.ns.client.clone(), &world.ns.name);
    let _ = secrets.delete(name, &Default::default()).await;
    secrets
        .create(
            &Default::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": name},
                "stringData": data,
            }))
            .expect("a Secret"),
        )
        .await
        .expect("the Secret");
}

#[tokio::test]
async fn https_is_verified_against_the_ca_of_the_auth_secret_and_the_token_never_shown() {
    let (ca, certificate, key) = certificates();
    let alertmanager = Alertmanager::start_with(Some((certificate, key))).await;
    let mut world = World::start("silence-tls", spec()).await;
    const TOKEN: &str = "e2e-alertmanager-token-51c9";
    world.set_silences(AlertmanagerConfig {
        auth_secret: Some((world.ns.name.clone(), "am-auth".to_string())),
        secret_ttl: Duration::from_millis(500),
        ..config(&alertmanager.base)
    });
    // The token, but not the CA: the platform's roots do not know Alertmanager's certificate, and
    // the controller says so (its first look lists the silences, run or not).
    put_secret(&world, "am-auth", json!({ "token": TOKEN })).await;
    world.start_controller();
    let refused = event_saying(&world, "SilenceFailed", "certificate").await;
    assert!(
        refused.starts_with(&format!(
            "Alertmanager at {} (list silences): unreachable: ",
            alertmanager.base
        )),
        "{refused}"
    );

    // The CA too: the run's nodes are silenced and the silences expired, over verified https.
    put_secret(&world, "am-auth", json!({ "token": TOKEN, "ca.crt": ca })).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    // An idle cluster is looked at again when something changes: until a list got through (the
    // Secret is read again after its TTL, a failed list asked again after the list's).
    let listed = r#"talos_upgrade_silence_requests_total{operation="list",result="ok"}"#;
    let mut round = 0;
    while !world
        .metrics
        .encode()
        .lines()
        .any(|l| l.starts_with(listed))
    {
        round += 1;
        assert!(round < 120, "{}", world.metrics.encode());
        tokio::time::sleep(Duration::from_millis(500)).await;
        world.poke_and_wait(round).await;
    }
    world.annotate("talos-target", "1.12.0").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
    let created = world.event_messages("SilenceCreated").await;
    assert_eq!(created.len(), 3, "{created:#?}");
    for node in ["cp-1", "worker-1", "worker-2"] {
        let node = world.node(node);
        assert!(
            created
                .iter()
                .any(|m| m.contains(&format!("for node {node} "))),
            "{node}: {created:#?}"
        );
    }
    // Each expired: three Events, as many ids.
    let deadline = Instant::now() + PATIENCE;
    while world.event_messages("SilenceExpired").await.len() < 3 {
        assert!(Instant::now() < deadline, "{:#?}", world.events().await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The token was never shown.
    let annotations = world.jsonpath("{.metadata.annotations}").await;
    assert!(!annotations.contains(TOKEN), "{annotations}");
    for (_, message) in world.events().await {
        assert!(!message.contains(TOKEN), "{message}");
    }
}
