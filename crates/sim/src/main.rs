//! `talos-sim`: simulated Talos nodes that speak the real Talos API over mutual TLS, for the demo, the
//! tests and a person with `talosctl` (see docs/simulator.md).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use talos_sim::workload::WorkloadMirror;
use talos_sim::{ClientRole, SimConfig, Simulator, control};

/// Run simulated Talos nodes that speak the real Talos API over mutual TLS (see docs/simulator.md).
#[derive(Debug, Parser)]
#[command(version, about)]
struct TalosSimArgs {
    /// Simulator configuration (YAML): nodes, versions, timings.
    #[arg(long, env = "TALOS_SIM_CONFIG")]
    config: PathBuf,
    /// Directory to write the generated talosconfig into.
    #[arg(long, env = "TALOS_SIM_STATE_DIR")]
    state_dir: PathBuf,
    /// kubeconfig of the workload cluster: nodes register there as Nodes with static pods.
    #[arg(long, env = "TALOS_SIM_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Address of the control API (node states, call record, fault injection).
    #[arg(long, default_value = "127.0.0.1:50001")]
    control_listen: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    run_simulator(TalosSimArgs::parse()).await
}

async fn run_simulator(args: TalosSimArgs) -> anyhow::Result<()> {
    let config = SimConfig::from_file(&args.config)
        .with_context(|| format!("loading {}", args.config.display()))?;
    let simulator = Arc::new(Simulator::start(config).await?);

    std::fs::create_dir_all(&args.state_dir)
        .with_context(|| format!("creating {}", args.state_dir.display()))?;
    let talosconfig = args.state_dir.join("talosconfig");
    simulator
        .write_talosconfig(&talosconfig, ClientRole::Admin)
        .with_context(|| format!("writing {}", talosconfig.display()))?;

    if let Some(kubeconfig) = &args.kubeconfig {
        let client = workload_client(kubeconfig).await?;
        let mirror = WorkloadMirror::new(client);
        let mut names = std::collections::BTreeSet::new();
        for node in simulator.nodes() {
            names.insert(node.name.clone());
            let snapshots = simulator.subscribe(&node.name)?;
            let mirror = mirror.clone();
            tokio::spawn(async move { mirror.follow(snapshots).await });
        }
        tokio::spawn(async move {
            if let Err(error) = mirror.run_kubelet(names).await {
                tracing::error!(%error, "kubelet emulation stopped");
            }
        });
    }

    let listener = tokio::net::TcpListener::bind(args.control_listen)
        .await
        .with_context(|| format!("binding the control API to {}", args.control_listen))?;
    let control_url = format!("http://{}", listener.local_addr()?);

    println!(
        "Talos simulator for cluster {:?}:",
        simulator.cluster_name()
    );
    for node in simulator.nodes() {
        println!(
            "  {:<12} {:<13} {}",
            node.name,
            node.role.as_str(),
            node.endpoint()
        );
    }
    println!("talosconfig:  {}", talosconfig.display());
    println!("control API:  {control_url}/nodes  (faults: see docs/simulator.md)");
    if args.kubeconfig.is_some() {
        println!("workload cluster: nodes registered as Kubernetes Nodes");
    }

    let server =
        axum::serve(listener, control::router(simulator.clone())).with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        });
    server.await.context("control API")?;
    simulator.shutdown();
    Ok(())
}

async fn workload_client(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("loading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .with_context(|| format!("loading {}", path.display()))?;
    Ok(kube::Client::try_from(config)?)
}
