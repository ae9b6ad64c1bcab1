//! The README's first command: starts a real Kubernetes control plane (etcd + kube-apiserver) on loopback,
//! prints how to reach it, and stays up until interrupted, cleaning up on Ctrl-C.
//!
//! The Talos simulator, a `KubernetesCluster` and the controller join it as they are built.

use anyhow::Context;
use testenv::ControlPlane;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    eprintln!("starting etcd and kube-apiserver on 127.0.0.1 ...");
    let control_plane = ControlPlane::start()
        .await
        .context("starting the control plane")?;
    let client = control_plane.client().await?;
    let version = client.apiserver_version().await?;

    println!();
    println!(
        "kube-apiserver {} is ready at {}",
        version.git_version,
        control_plane.server()
    );
    println!();
    println!("In another terminal:");
    println!(
        "  export KUBECONFIG={}",
        control_plane.admin_kubeconfig().display()
    );
    println!(
        "  export PATH={}:$PATH   # kubectl {} built with the control plane",
        control_plane.binaries().dir.display(),
        version.git_version
    );
    println!("  kubectl get namespaces");
    println!();
    println!("Logs: {}", control_plane.dir().display());
    println!("Press Ctrl-C to stop and clean up.");

    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    eprintln!("stopping kube-apiserver and etcd ...");
    drop(control_plane);
    Ok(())
}
