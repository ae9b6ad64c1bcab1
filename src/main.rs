//! The talos-upgrade-controller binary: `run` (the controller), `crd` (print the KubernetesCluster
//! CRD) and `plan` (print the upgrade plan the controller would run for a cluster). The Talos node
//! simulator is a binary of its own (`talos-sim`, crates/sim) and is not in this one.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the controller: upgrade Talos clusters as their annotations ask.
    Run(Box<RunArgs>),
    /// Print the KubernetesCluster CustomResourceDefinition (YAML)
    Crd,
    /// Print the upgrade plan the controller would run for a cluster (hops, node order, gates, what
    /// would hold it now), for a pull request or a change ticket. Reads only.
    Plan(PlanArgs),
}

#[derive(Debug, clap::Args)]
struct PlanArgs {
    /// The kubeconfig of the management cluster (default: the usual one: KUBECONFIG, ~/.kube/config,
    /// in-cluster).
    #[arg(long)]
    kubeconfig: Option<std::path::PathBuf>,
    /// The cluster's namespace.
    #[arg(long, short = 'n', default_value = "default")]
    namespace: String,
    /// The release catalog file the controller runs with (--release-catalog of `run`).
    #[arg(long, env = "TUC_RELEASE_CATALOG")]
    release_catalog: Option<std::path::PathBuf>,
    /// As `run --allow-unknown-releases`.
    #[arg(long, env = "TUC_ALLOW_UNKNOWN_RELEASES", default_value_t = false)]
    allow_unknown_releases: bool,
    /// The KubernetesCluster's name.
    cluster: String,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "TUC_ADMIN_LISTEN", default_value = "0.0.0.0:8080")]
    admin_listen: SocketAddr,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "TUC_NAMESPACE")]
    namespace: Option<String>,
    /// Act only on the KubernetesClusters whose labels match this selector (e.g.
    /// `upgrade.vitistack.io/shard=a`, or `!upgrade.vitistack.io/shard` for the unlabelled ones): one
    /// shard of a fleet split across several controllers, each with a Lease of its own
    /// (--leader-election-lease). Default: every cluster. See docs/shards.md.
    #[arg(long, env = "TUC_WATCH_LABEL_SELECTOR")]
    watch_label_selector: Option<String>,
    /// How long one node may take from its upgrade call to being done, e.g. 15m, 900s, 1h.
    #[arg(long, env = "TUC_NODE_DEADLINE", default_value = "15m", value_parser = parse_duration)]
    node_deadline: std::time::Duration,
    /// How long draining a node may take before its reboot (Talos >= 1.13, where the controller cordons
    /// and evicts; PodDisruptionBudgets are respected), e.g. 5m.
    #[arg(long, env = "TUC_DRAIN_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    drain_timeout: std::time::Duration,
    /// How long after a pull or install that failed for a reason that may pass (Talos >= 1.13: a
    /// registry error, an installer exit code worth retrying) it is made again, within the node deadline.
    #[arg(long, env = "TUC_RETRY_AFTER", default_value = "30s", value_parser = parse_duration)]
    retry_after: std::time::Duration,
    /// How long one step of a Kubernetes upgrade (one component on one node, one kubelet) may take.
    #[arg(long, env = "TUC_STEP_DEADLINE", default_value = "10m", value_parser = parse_duration)]
    step_deadline: std::time::Duration,
    /// A YAML file of releases that extends (or, with `replace: true`, replaces) the built-in release
    /// catalog behind talos-available and kubernetes-available. See docs/releases.md.
    #[arg(long, env = "TUC_RELEASE_CATALOG")]
    release_catalog: Option<std::path::PathBuf>,
    /// Accept targets newer than every release the catalog knows (built in, --release-catalog, live
    /// sources). Their rules are then the pattern of the known lines, not facts; off by default, so an
    /// unknown release is refused ("unknown release; the newest known is X").
    #[arg(long, env = "TUC_ALLOW_UNKNOWN_RELEASES", default_value_t = false)]
    allow_unknown_releases: bool,
    /// Also learn releases from the Talos Image Factory and the Kubernetes image registry (off by
    /// default: the controller needs no outbound access).
    #[arg(long, env = "TUC_LIVE_RELEASES", default_value_t = false)]
    live_releases: bool,
    /// Base URL of the Talos Image Factory for --live-releases.
    #[arg(
        long,
        env = "TUC_TALOS_FACTORY_URL",
        default_value = "https://factory.talos.dev"
    )]
    talos_factory_url: String,
    /// OCI tag list URL of an image tagged with Kubernetes versions, for --live-releases.
    #[arg(
        long,
        env = "TUC_KUBERNETES_TAGS_URL",
        default_value = "https://registry.k8s.io/v2/kube-apiserver/tags/list"
    )]
    kubernetes_tags_url: String,
    /// Act only while holding a Lease, so that several replicas can run and one acts at a time.
    #[arg(long, env = "TUC_LEADER_ELECT", default_value_t = false)]
    leader_elect: bool,
    /// Namespace of the leader election Lease (default: the pod's namespace from POD_NAMESPACE, else
    /// talos-upgrade-controller).
    #[arg(long, env = "TUC_LEADER_ELECTION_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// Name of the leader election Lease.
    #[arg(
        long,
        env = "TUC_LEADER_ELECTION_LEASE",
        default_value = "talos-upgrade-controller"
    )]
    leader_election_lease: String,
    /// How long the Lease stays held without renewal: a standby takes over after this, e.g. 15s.
    #[arg(long, env = "TUC_LEASE_DURATION", default_value = "15s", value_parser = parse_duration)]
    lease_duration: std::time::Duration,
    /// How long before the Lease expires its holder renews it, e.g. 5s.
    #[arg(long, env = "TUC_LEASE_GRACE", default_value = "5s", value_parser = parse_duration)]
    lease_grace: std::time::Duration,
    /// How often a cluster with an upgrade in flight is looked at again, e.g. 2s or 250ms.
    #[arg(long, env = "TUC_POLL_INTERVAL", default_value = "2s", value_parser = parse_duration)]
    poll_interval: std::time::Duration,
    /// How often a cluster with nothing in flight is refreshed (its current and available versions)
    /// when nothing about it changes, e.g. 10m. A refresh costs one Talos Version call per node and a
    /// handful of Kubernetes reads.
    #[arg(long, env = "TUC_IDLE_INTERVAL", default_value = "10m", value_parser = parse_duration)]
    idle_interval: std::time::Duration,
    /// The maintenance windows of every cluster without the upgrade.vitistack.io/maintenance-window
    /// annotation (which has the same syntax; `always` on a cluster opts out): Talos runs start, and
    /// start nodes, only inside them, e.g. "Mon-Fri 22:00 4h Europe/Oslo; Sat,Sun 02:00 8h UTC".
    /// Unset: any time.
    #[arg(long, env = "TUC_MAINTENANCE_WINDOW", value_parser = parse_maintenance_window)]
    maintenance_window: Option<talos_upgrade_core::holds::MaintenanceWindows>,
    /// The alert gate: the Prometheus asked, before each node and before a run starts, whether
    /// alerts that should stop an upgrade are firing (e.g. https://prometheus.monitoring.svc:9090).
    /// Unset: no alert gate. See docs/upgrades.md, "The alert gate".
    #[arg(long, env = "TUC_PROMETHEUS_URL")]
    prometheus_url: Option<String>,
    /// `<namespace>/<name>` of a Secret with the optional keys `token` (a bearer token, sent only over
    /// https or to a loopback host) and `ca.crt` (the CA that signs Prometheus's certificate; without
    /// it the platform's roots). Read with the controller's own credentials, never logged.
    #[arg(long, env = "TUC_PROMETHEUS_AUTH_SECRET")]
    prometheus_auth_secret: Option<String>,
    /// The alerts that hold an upgrade, as a PromQL label selector over the alerts' labels;
    /// {namespace}, {cluster} and {clusterId} are replaced by each cluster's, e.g.
    /// {severity="critical",cluster="{clusterId}"}. A cluster's upgrade.vitistack.io/alert-gate
    /// annotation narrows or replaces it.
    #[arg(
        long,
        env = "TUC_ALERT_SELECTOR",
        default_value = r#"{severity="critical"}"#
    )]
    alert_selector: String,
    /// The Alertmanager (API v2) in which Talos runs keep silences for the nodes they upgrade (e.g.
    /// https://alertmanager.monitoring.svc:9093): one per node in flight by default, or one for all
    /// the run's nodes, as each cluster's upgrade.vitistack.io/alert-silences annotation says. Unset:
    /// no silences. See docs/upgrades.md, "Alertmanager silences".
    #[arg(long, env = "TUC_ALERTMANAGER_URL")]
    alertmanager_url: Option<String>,
    /// `<namespace>/<name>` of a Secret with the optional keys `token` (a bearer token, sent only over
    /// https or to a loopback host) and `ca.crt` (the CA that signs Alertmanager's certificate).
    #[arg(long, env = "TUC_ALERTMANAGER_AUTH_SECRET")]
    alertmanager_auth_secret: Option<String>,
    /// The alert label that names a node in the silences' matchers.
    #[arg(long, env = "TUC_SILENCE_NODE_LABEL", default_value = "node")]
    silence_node_label: String,
    /// Matchers added to every silence, e.g. cluster="{clusterId}" ({namespace}, {cluster} and
    /// {clusterId} are replaced by each cluster's), so that a silence covers only that cluster's
    /// alerts when one Alertmanager serves several clusters.
    #[arg(long, env = "TUC_SILENCE_MATCHERS", default_value = "")]
    silence_matchers: String,
    /// Name of a cluster's credentials Secret; {clusterId} and {name} are replaced.
    #[arg(long, env = "TUC_SECRET_NAME_TEMPLATE", default_value = "{clusterId}")]
    secret_name_template: String,
    /// A directory (a mounted volume) for the etcd snapshot taken before the first control plane of
    /// every Talos run, as <dir>/<namespace>/<cluster>/<UTC time>-talos-<target>.snapshot. See
    /// docs/upgrades.md, "etcd snapshot before the control planes".
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_DIR")]
    etcd_snapshot_dir: Option<std::path::PathBuf>,
    /// An S3-compatible bucket for the etcd snapshots instead of a directory.
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_S3_BUCKET")]
    etcd_snapshot_s3_bucket: Option<String>,
    /// The bucket's endpoint, https (http only for a loopback host), e.g. https://s3.eu-north-1.amazonaws.com.
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_S3_ENDPOINT")]
    etcd_snapshot_s3_endpoint: Option<String>,
    /// The bucket's region (what the request signatures name).
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_S3_REGION", default_value = "us-east-1")]
    etcd_snapshot_s3_region: String,
    /// A key prefix in the bucket (the snapshots go under <prefix>/<namespace>/<cluster>/).
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_S3_PREFIX", default_value = "")]
    etcd_snapshot_s3_prefix: String,
    /// <namespace>/<name> of a Secret with the keys access-key-id and secret-access-key, read at
    /// start.
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_S3_CREDENTIALS_SECRET")]
    etcd_snapshot_s3_credentials_secret: Option<String>,
    /// How many snapshots of a cluster are kept (older ones of that cluster are deleted).
    #[arg(long, env = "TUC_ETCD_SNAPSHOT_KEEP", default_value_t = 5)]
    etcd_snapshot_keep: usize,
    /// How many clusters are reconciled at once; the others wait their turn (0: no bound).
    #[arg(long, env = "TUC_MAX_CONCURRENT_RECONCILES", default_value_t = 0)]
    max_concurrent_reconciles: u16,
    /// How many threads run the controller's tasks. One by default: its work is waiting on the
    /// network, and with a second thread each burst of work (a node back, a reconcile woken) also
    /// wakes the other thread to share it, which costs more CPU than the work gains
    /// (docs/performance.md, CPU).
    #[arg(long, env = "TUC_WORKER_THREADS", default_value = "1")]
    worker_threads: std::num::NonZeroUsize,
}

/// `--etcd-snapshot-*`: where the etcd snapshots go, if anywhere.
async fn snapshot_config(
    args: &RunArgs,
    client: &kube::Client,
) -> anyhow::Result<Option<talos_upgrade_controller::etcd_snapshot::SnapshotConfig>> {
    use talos_upgrade_controller::etcd_snapshot::{
        self as snapshot, ConfigError, Destination, S3Destination, S3Options, SnapshotConfig,
    };
    let bucket = args
        .etcd_snapshot_s3_bucket
        .as_deref()
        .map(str::trim)
        .filter(|b| !b.is_empty());
    let destination = match (&args.etcd_snapshot_dir, bucket) {
        (Some(_), Some(_)) => return Err(ConfigError::Both.into()),
        (None, None) => return Ok(None),
        (Some(dir), None) => Destination::Dir(dir.clone()),
        (None, Some(bucket)) => {
            let endpoint = args
                .etcd_snapshot_s3_endpoint
                .clone()
                .context("--etcd-snapshot-s3-bucket needs --etcd-snapshot-s3-endpoint")?;
            let secret = args
                .etcd_snapshot_s3_credentials_secret
                .as_deref()
                .context("--etcd-snapshot-s3-bucket needs --etcd-snapshot-s3-credentials-secret")?;
            let (namespace, name) = talos_upgrade_controller::silences::parse_secret_ref(secret)?;
            let (access_key_id, secret_access_key) =
                snapshot::s3_credentials(client, &namespace, &name).await?;
            Destination::S3(S3Destination::new(S3Options {
                endpoint,
                bucket: bucket.to_string(),
                region: args.etcd_snapshot_s3_region.clone(),
                prefix: args.etcd_snapshot_s3_prefix.clone(),
                access_key_id,
                secret_access_key,
            })?)
        }
    };
    Ok(Some(SnapshotConfig::new(
        destination,
        args.etcd_snapshot_keep,
    )?))
}

/// `250ms`, `30s`, `15m`, `1h`.
/// `--maintenance-window`: the annotation's syntax.
fn parse_maintenance_window(
    value: &str,
) -> Result<talos_upgrade_core::holds::MaintenanceWindows, String> {
    talos_upgrade_core::holds::MaintenanceWindows::parse(value)
}

fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} needs a unit: ms, s, m or h"))?;
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a whole number"))?;
    let millis = match unit {
        "ms" => number,
        "s" => number * 1000,
        "m" => number * 60_000,
        "h" => number * 3_600_000,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}: use ms, s, m or h"
            ));
        }
    };
    Ok(std::time::Duration::from_millis(millis))
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The runtime is sized by `run`'s flag; the one-shot commands need no more than one thread.
    let worker_threads = match &cli.command {
        Command::Run(args) => args.worker_threads,
        Command::Crd | Command::Plan(_) => std::num::NonZeroUsize::MIN,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads.get())
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(async {
            // Spawned: the future `block_on` drives runs on the main thread, which does not drive
            // the I/O driver, so every socket event of the work in it would be handed from a
            // worker thread to the main one and back (two context switches each); a spawned task
            // runs on the worker that polled the socket. A panic goes on as if it were not spawned.
            match tokio::spawn(run_command(cli)).await {
                Ok(result) => result,
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                Err(error) => Err(error).context("the command's task"),
            }
        })
}

async fn run_command(cli: Cli) -> anyhow::Result<()> {
    // kube and tonic both use rustls with ring; one process-wide provider keeps every TLS config alike.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // Colours only for a person at a terminal: in a container, `kubectl logs` and log shippers would
    // show the escape codes as text.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stdout());
    tracing_subscriber::fmt()
        .with_ansi(colours)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    match cli.command {
        Command::Crd => {
            print!("{}", talos_upgrade_core::crd::crd_yaml());
            Ok(())
        }
        Command::Run(args) => run_controller(*args).await,
        Command::Plan(args) => print_plan(args).await,
    }
}

/// `plan`: the same preview the `plan-preview` annotation shows, printed one line each.
async fn print_plan(args: PlanArgs) -> anyhow::Result<()> {
    use talos_upgrade_controller::{api_client, catalog_sources, plan_preview};
    let config = match &args.kubeconfig {
        Some(path) => api_client::config_from_file(path)
            .await
            .with_context(|| format!("reading the kubeconfig {}", path.display()))?,
        None => kube::Config::infer()
            .await
            .context("connecting to the Kubernetes API")?,
    };
    let client = kube::Client::try_from(config).context("connecting to the Kubernetes API")?;
    // The live release sources are not asked: the preview shows what the built-in and the file say.
    let catalog = catalog_sources::builtin_with_file(args.release_catalog.as_deref())
        .context("reading the release catalog")?
        .allowing_unknown(args.allow_unknown_releases);
    let preview = plan_preview::preview_cluster(
        client,
        &args.namespace,
        &args.cluster,
        &catalog,
        jiff::Timestamp::now(),
    )
    .await?;
    print!("{}", preview.text());
    Ok(())
}

/// The release catalog: built in, extended by the operator's file, refreshed from live sources if asked.
fn release_catalog(
    args: &RunArgs,
) -> anyhow::Result<talos_upgrade_controller::catalog_sources::CatalogHandle> {
    use talos_upgrade_controller::catalog_sources::{self, CatalogHandle, LiveConfig};
    let base = catalog_sources::builtin_with_file(args.release_catalog.as_deref())
        .context("reading the release catalog")?
        .allowing_unknown(args.allow_unknown_releases);
    let live = LiveConfig {
        enabled: args.live_releases,
        talos_factory_url: Some(args.talos_factory_url.clone()),
        kubernetes_tags_url: Some(args.kubernetes_tags_url.clone()),
        ..LiveConfig::default()
    };
    CatalogHandle::start(base, &live).context("configuring live release sources")
}

async fn run_controller(args: RunArgs) -> anyhow::Result<()> {
    use talos_upgrade_controller::{admin, leader, metrics::Metrics, reconcile};
    // Three connections to the API server (each client its own; see `api_client`): the reconciles', the
    // intake's (`reconcile::ApiClients`) and the Lease's (below).
    let config = kube::Config::infer()
        .await
        .context("connecting to the Kubernetes API")?;
    let clients =
        reconcile::ApiClients::connect(&config).context("connecting to the Kubernetes API")?;
    if let Some(selector) = args.watch_label_selector.as_deref() {
        check_selector(&clients.main, args.namespace.as_deref(), selector).await?;
    }
    let gates = gate_config(&args, &clients.main)?;
    let silences = silence_config(&args, &clients.main)?;
    let etcd_snapshots = snapshot_config(&args, &clients.main).await?;
    let metrics = Metrics::new();
    let health = admin::HealthState::default();
    let settings = reconcile::Settings {
        limits: talos_upgrade_core::lifecycle::Limits {
            node_deadline: args.node_deadline,
            drain_timeout: args.drain_timeout,
            retry_after: args.retry_after,
            step_deadline: args.step_deadline,
            ..Default::default()
        },
        catalog: release_catalog(&args)?,
        poll_interval: args.poll_interval,
        idle_interval: args.idle_interval,
        secret_name_template: args.secret_name_template,
        maintenance_window: args.maintenance_window,
        watch_label_selector: args.watch_label_selector.filter(|s| !s.trim().is_empty()),
        gates,
        silences,
        etcd_snapshots,
        max_concurrent_reconciles: args.max_concurrent_reconciles,
        ..reconcile::Settings::default()
    };
    // The pod name in a cluster; elsewhere the host name and process id, so that two processes on one
    // machine never share a Lease identity.
    let instance = std::env::var("POD_NAME").unwrap_or_else(|_| {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "talos-upgrade-controller".into());
        format!("{host}-{}", std::process::id())
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    let admin_server = admin::serve(
        args.admin_listen,
        admin::router(metrics.clone(), health.clone()),
        shutdown.clone().cancelled_owned(),
    );
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            wait_for_signal().await;
            tracing::info!("shutting down");
            shutdown.cancel();
        }
    });
    let namespace = args.namespace;
    // The Lease gets a connection of its own: over HTTP/2 the reconciles' requests share one, and a
    // renewal must not wait behind hundreds of them (the server bounds the streams per connection).
    let lease_client = talos_upgrade_controller::api_client::client(config)
        .context("connecting to the Kubernetes API")?;
    let controller = async {
        if !args.leader_elect {
            reconcile::run(
                clients,
                namespace,
                metrics,
                settings,
                health,
                instance,
                shutdown.clone().cancelled_owned(),
            )
            .await;
            return Ok(());
        }
        let election = leader::Election {
            lease: args.leader_election_lease.clone(),
            namespace: args
                .leader_election_namespace
                .clone()
                .or_else(|| std::env::var("POD_NAMESPACE").ok())
                .unwrap_or_else(|| "talos-upgrade-controller".to_string()),
            identity: instance.clone(),
            duration: args.lease_duration,
            grace: args.lease_grace,
        };
        // A standby is ready: it serves its probes and is there to take over.
        let standby = health.clone();
        leader::lead(
            lease_client,
            election,
            shutdown.clone(),
            move || standby.set_ready(),
            |term: tokio_util::sync::CancellationToken| {
                reconcile::run(
                    clients.clone(),
                    namespace.clone(),
                    metrics.clone(),
                    settings.clone(),
                    health.clone(),
                    instance.clone(),
                    term.cancelled_owned(),
                )
            },
        )
        .await
    };
    let (served, led) = tokio::join!(admin_server, controller);
    served.context("admin server")?;
    led.context("leader election")?;
    Ok(())
}

/// The gates' configuration from the flags. A flag that cannot work stops the controller at start
/// (a gate the operator asked for must not silently be missing).
fn gate_config(
    args: &RunArgs,
    client: &kube::Client,
) -> anyhow::Result<talos_upgrade_controller::holds::GateConfig> {
    use talos_upgrade_controller::holds::{GateConfig, alerts};
    let url = args
        .prometheus_url
        .as_deref()
        .filter(|url| !url.trim().is_empty());
    let auth_secret = args
        .prometheus_auth_secret
        .as_deref()
        .filter(|value| !value.trim().is_empty())
        .map(alerts::parse_secret_ref)
        .transpose()?;
    // Checked even without a URL, so a typo is found before the gate is turned on.
    let selector = alerts::parse_selector(&args.alert_selector)?;
    let Some(url) = url else {
        if auth_secret.is_some() {
            anyhow::bail!("--prometheus-auth-secret needs --prometheus-url");
        }
        return Ok(GateConfig::default());
    };
    let config = alerts::AlertGateConfig {
        url: url.to_string(),
        auth_secret,
        selector,
        timeout: alerts::TIMEOUT,
        secret_ttl: alerts::SECRET_TTL,
    };
    Ok(GateConfig {
        alerts: Some(alerts::Prometheus::new(config, client.clone())?),
        ..GateConfig::default()
    })
}

/// The Alertmanager of the silences from the flags; a flag that cannot work stops the controller.
fn silence_config(
    args: &RunArgs,
    client: &kube::Client,
) -> anyhow::Result<Option<talos_upgrade_controller::silences::Alertmanager>> {
    use talos_upgrade_controller::silences::{self, Alertmanager, AlertmanagerConfig};
    let auth_secret = args
        .alertmanager_auth_secret
        .as_deref()
        .filter(|value| !value.trim().is_empty())
        .map(silences::parse_secret_ref)
        .transpose()?;
    // Checked even without a URL, so a typo is found before the silences are turned on.
    let config = silences::parse_silence_config(&args.silence_node_label, &args.silence_matchers)?;
    let Some(url) = args
        .alertmanager_url
        .as_deref()
        .filter(|url| !url.trim().is_empty())
    else {
        if auth_secret.is_some() {
            anyhow::bail!("--alertmanager-auth-secret needs --alertmanager-url");
        }
        return Ok(None);
    };
    let config = AlertmanagerConfig {
        url: url.to_string(),
        auth_secret,
        silences: config,
        timeout: silences::TIMEOUT,
        list_ttl: silences::LIST_TTL,
        secret_ttl: talos_upgrade_controller::holds::alerts::SECRET_TTL,
    };
    Ok(Some(Alertmanager::new(config, client.clone())?))
}

/// Refuses to start with a label selector the API server refuses: a shard that watched nothing, and
/// said so only in a retried watch error, would leave its clusters without a controller. The API
/// server is the judge of the syntax (one list of at most one cluster's metadata); any other error
/// (the API server not reachable yet) is left to the watch, which retries.
async fn check_selector(
    client: &kube::Client,
    namespace: Option<&str>,
    selector: &str,
) -> anyhow::Result<()> {
    use kube::api::{Api, ListParams};
    use talos_upgrade_core::crd::KubernetesCluster;
    let clusters: Api<KubernetesCluster> = match namespace {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    match clusters
        .list_metadata(&ListParams::default().labels(selector).limit(1))
        .await
    {
        Err(kube::Error::Api(status)) if status.code == 400 => Err(anyhow::anyhow!(
            "--watch-label-selector {selector:?} is not a label selector: {}",
            status.message
        )),
        _ => Ok(()),
    }
}

/// SIGTERM (what Kubernetes sends a pod) or Ctrl-C.
async fn wait_for_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            tracing::warn!(%error, "cannot listen for SIGTERM; only Ctrl-C stops the controller");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
