//! The README's first command: a real Kubernetes control plane on loopback, a simulated five-node Talos
//! cluster (3 control planes, 2 workers, Talos 1.11.6, Kubernetes 1.34.1) registered in it, the
//! `KubernetesCluster` `my-cluster` with its credentials Secret, and the controller with its metrics
//! endpoint. It prints how to use them (kubectl, and the real talosctl with a talosconfig it writes)
//! and stays up until Ctrl-C, then cleans up.
//!
//! The cluster is built as the tests build theirs (the `test-world` crate), from the examples the user
//! guide shows: examples/sim-cluster.yaml (fixed addresses, seconds-long steps a person can watch),
//! examples/kubernetescluster.yaml and examples/release-catalog.yaml. No Machines: the controller finds
//! the nodes through the workload cluster's Nodes, as it does for a cluster without vitistack Machines.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use talos_sim::workload::WorkloadMirror;
use talos_sim::{ClientRole, SimConfig, Simulator, control};
use talos_upgrade_controller::admin::{self, HealthState};
use talos_upgrade_controller::metrics::Metrics;
use talos_upgrade_controller::reconcile::{self, Settings};
use talos_upgrade_core::lifecycle::Limits;
use testenv::ControlPlane;
use tokio_util::sync::CancellationToken;

const CLUSTER: &str = "my-cluster";
const NAMESPACE: &str = "default";
/// The demo controller's `--node-deadline`.
const DEMO_NODE_DEADLINE: Duration = Duration::from_secs(120);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_client::client::builder=off".into()),
        )
        .init();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");

    eprintln!("starting etcd and kube-apiserver on 127.0.0.1 ...");
    let control_plane = ControlPlane::start()
        .await
        .context("starting the control plane")?;
    let client = control_plane.client().await?;
    let version = client.apiserver_version().await?;

    test_world::install_crd(&client, test_world::PROJECT_CLUSTER_CRD).await?;

    eprintln!("starting the simulated Talos cluster ...");
    let config = SimConfig::from_file(&repo.join("examples/sim-cluster.yaml"))?;
    let simulator = Arc::new(Simulator::start(config).await.context(
        "starting the simulator (is another demo running? it uses 127.0.0.11-15:50000)",
    )?);
    let stop = CancellationToken::new();
    // The nodes as Kubernetes Nodes with static pods, in the demo's API server (its own workload
    // cluster).
    test_world::mirror_workload(&simulator, &WorkloadMirror::new(client.clone()), &stop)?;

    // The cluster's credentials, named after its clusterId as vitistack names them.
    let kubeconfig = std::fs::read_to_string(control_plane.admin_kubeconfig())?;
    test_world::create_credentials_secret(&client, NAMESPACE, CLUSTER, &simulator, &kubeconfig)
        .await?;
    test_world::create_kubernetes_cluster(
        &client,
        NAMESPACE,
        &std::fs::read_to_string(repo.join("examples/kubernetescluster.yaml"))?,
    )
    .await?;

    // The controller, with its metrics endpoint, and the simulator's control API.
    let metrics = Metrics::new();
    let health = HealthState::default();
    let admin_listener = bind_first(&["127.0.0.1:8080", "127.0.0.1:0"]).await?;
    let metrics_url = format!("http://{}/metrics", admin_listener.local_addr()?);
    tokio::spawn(admin::serve_on(
        admin_listener,
        admin::router(metrics.clone(), health.clone()),
        stop.clone().cancelled_owned(),
    ));
    let control_listener = bind_first(&["127.0.0.1:50001", "127.0.0.1:0"]).await?;
    let control_url = format!("http://{}", control_listener.local_addr()?);
    tokio::spawn({
        let router = control::router(simulator.clone());
        let stop = stop.clone();
        async move {
            let _ = axum_serve(control_listener, router, stop).await;
        }
    });
    // The releases of the user guide's example, so `talos-available` and `kubernetes-available` read
    // like the guide (the built-in catalog knows newer releases). A node deadline of minutes rather
    // than the default 15: a node broken with `never-returns` fails its run while one still watches
    // (the demo's nodes are back within seconds).
    let settings = Settings {
        poll_interval: Duration::from_millis(500),
        catalog: test_world::guide_catalog(),
        limits: Limits {
            node_deadline: DEMO_NODE_DEADLINE,
            ..Limits::default()
        },
        ..Settings::default()
    };
    // The controller's clients as the binary makes them (`api_client`: HTTP/2, the intake connection
    // apart), from the admin kubeconfig.
    let controller_config =
        talos_upgrade_controller::api_client::config_from_file(control_plane.admin_kubeconfig())
            .await?;
    let clients = reconcile::ApiClients::connect(&controller_config)?;
    let controller = tokio::spawn(reconcile::run(
        clients,
        None,
        metrics,
        settings,
        health,
        "demo".into(),
        stop.clone().cancelled_owned(),
    ));

    // A talosconfig for the real talosctl: an `os:admin` client of the cluster's Talos CA, as the
    // credentials Secret holds one, beside the control plane's files (removed with them).
    let talosconfig_path = control_plane.dir().join("talosconfig");
    simulator
        .write_talosconfig(&talosconfig_path, ClientRole::Admin)
        .with_context(|| format!("writing {}", talosconfig_path.display()))?;

    let kubeconfig_path = control_plane.admin_kubeconfig().display().to_string();
    let bin_dir = control_plane.binaries().dir.display().to_string();
    println!();
    println!(
        "Ready: kube-apiserver {} at {}",
        version.git_version,
        control_plane.server()
    );
    println!(
        "       Talos cluster {CLUSTER}: 3 control planes + 2 workers on 127.0.0.11-15:50000, Talos 1.11.6, Kubernetes 1.34.1"
    );
    println!();
    println!("In another terminal:");
    println!("  export KUBECONFIG={kubeconfig_path}");
    println!(
        "  export PATH={bin_dir}:$PATH   # kubectl {}",
        version.git_version
    );
    println!(
        "  kubectl get kubernetescluster my-cluster -o jsonpath='{{.metadata.annotations}}'; echo"
    );
    println!(
        "  kubectl annotate kubernetescluster my-cluster upgrade.vitistack.io/talos-target=\"1.12.0\""
    );
    println!("  kubectl wait kubernetescluster my-cluster \\");
    println!(
        "    --for=jsonpath='{{.metadata.annotations.upgrade\\.vitistack\\.io/talos-status}}'=completed --timeout=30m"
    );
    println!("  kubectl describe kubernetescluster my-cluster");
    println!();
    println!(
        "The nodes with the real talosctl (from the repository; the script builds talosctl v1.14.1 once):"
    );
    println!("  export TALOSCONFIG={}", talosconfig_path.display());
    println!("  talosctl=$(bash scripts/build-talosctl.sh | tail -n 1)");
    println!("  $talosctl -n 127.0.0.11,127.0.0.14 version");
    println!();
    println!("Metrics:        {metrics_url}");
    println!(
        "Break a node:   curl -X POST {control_url}/nodes/cp-2/faults/never-returns   (see docs/simulator.md)"
    );
    println!(
        "                before an upgrade: cp-2 does not come back from its reboot, and the run fails {} min after its upgrade call (the demo's node deadline)",
        DEMO_NODE_DEADLINE.as_secs() / 60
    );
    println!("Logs:           {}", control_plane.dir().display());
    println!("Press Ctrl-C to stop and clean up.");

    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    eprintln!("stopping ...");
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), controller).await;
    simulator.shutdown();
    drop(control_plane);
    Ok(())
}

async fn bind_first(addresses: &[&str]) -> anyhow::Result<tokio::net::TcpListener> {
    for address in addresses {
        if let Ok(listener) = tokio::net::TcpListener::bind(address).await {
            return Ok(listener);
        }
    }
    anyhow::bail!("could not bind any of {addresses:?}")
}

async fn axum_serve(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    stop: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}
