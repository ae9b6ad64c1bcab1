//! The controller's container image, as users build it (`just image` → scripts/build-image.sh → the
//! Dockerfile), built and run here with Debian's podman (runc, host network, scripts/containers.conf):
//!
//! - what is in it: one static binary and the CA roots, no shell; it runs as uid/gid 65532 and
//!   `--help` answers;
//! - the image is the controller: run with a read-only root filesystem, every capability dropped, on
//!   the host network against the test API server and a simulated cluster, it upgrades the cluster,
//!   serves `/metrics`, holds its Lease, and on SIGTERM (`podman stop`) stops cleanly, releasing the
//!   Lease; its logs hold none of the credentials it used.
//!
//! podman missing is a failure (scripts/install-podman.sh installs it), never a skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use crate::prometheus::TempDir;
use crate::replica::{self, free_admin_address, scrape};
use crate::world::{World, WorldSpec};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// The image, built once for this test binary by scripts/build-image.sh (cached: an unchanged binary
/// and Dockerfile give the same tag, found already built).
fn image() -> &'static str {
    static IMAGE: OnceLock<String> = OnceLock::new();
    IMAGE.get_or_init(|| {
        testenv::script::last_line(
            &testenv::script::path("build-image.sh"),
            &[],
            &[("CONTAINER_TOOL", "podman")],
        )
    })
}

/// `podman <args>` with the project's containers.conf (runc, low ulimits, host network).
fn podman(args: &[&str]) -> Output {
    Command::new("podman")
        .args(args)
        .env(
            "CONTAINERS_CONF",
            Path::new(REPO).join("scripts/containers.conf"),
        )
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("running podman {args:?}: {e} (install it: bash scripts/install-podman.sh)")
        })
}

/// `podman <args>`, which must succeed; returns its stdout.
fn podman_ok(args: &[&str]) -> String {
    let output = podman(args);
    assert!(
        output.status.success(),
        "podman {args:?} failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A container removed (forcibly, if still running) when the test ends, however it ends.
struct Container(String);

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "--force", "--ignore", &self.0]);
    }
}

#[test]
fn the_image_holds_one_static_binary_and_the_ca_roots_and_runs_as_non_root() {
    let image = image();
    let config = podman_ok(&[
        "image",
        "inspect",
        "--format",
        "{{.Config.User}}|{{json .Config.Entrypoint}}|{{json .Config.Cmd}}|{{.Size}}",
        image,
    ]);
    let fields: Vec<&str> = config.trim().split('|').collect();
    assert_eq!(
        fields[..3],
        [
            "65532:65532",
            r#"["/talos-upgrade-controller"]"#,
            r#"["run"]"#
        ],
        "user, entrypoint and default command of {image}"
    );
    eprintln!("image {image}: {} bytes", fields[3]);

    // Every file in the image: the binary and the CA bundle, nothing else (no shell, no libc).
    let container = Container(podman_ok(&["create", image]).trim().to_string());
    let listing = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "podman export {} | tar -t",
            container
                .0
                .replace(|c: char| !c.is_ascii_alphanumeric(), "")
        ))
        .env(
            "CONTAINERS_CONF",
            Path::new(REPO).join("scripts/containers.conf"),
        )
        .output()
        .expect("podman export | tar -t");
    assert!(listing.status.success(), "{listing:?}");
    let mut files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .filter(|entry| !entry.ends_with('/'))
        // podman adds the mount points of every container (resolv.conf, hosts, ...) as empty files.
        .filter(|entry| {
            !matches!(
                *entry,
                "etc/hostname" | "etc/hosts" | "etc/resolv.conf" | "run/.containerenv"
            )
        })
        .map(str::to_string)
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "etc/ssl/certs/ca-certificates.crt",
            "talos-upgrade-controller"
        ],
        "the files of {image}"
    );

    // The binary runs in it as it is (static: no interpreter, no libraries to find).
    let help = podman_ok(&["run", "--rm", image, "--help"]);
    assert!(
        help.contains("Run the controller: upgrade Talos clusters as their annotations ask"),
        "{help}"
    );
    let run_help = podman_ok(&["run", "--rm", image, "run", "--help"]);
    assert!(run_help.contains("--watch-label-selector"), "{run_help}");
}

/// The bearer token of a kubeconfig written by testenv (`token: <value>`).
fn token_of(kubeconfig: &Path) -> String {
    let text = std::fs::read_to_string(kubeconfig).expect("the kubeconfig");
    text.lines()
        .find_map(|line| line.trim().strip_prefix("token: "))
        .expect("a token in the kubeconfig")
        .trim_matches('"')
        .to_string()
}

#[tokio::test]
async fn the_image_runs_as_the_controller_upgrades_a_cluster_and_stops_cleanly_on_sigterm() {
    let image = image();
    let world = World::start(
        "image",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    // The kubeconfig, readable by the image's user (testenv writes it for root only).
    let files = TempDir::new("image");
    let kubeconfig: PathBuf = files.write(
        "kubeconfig",
        &std::fs::read_to_string(world.ns.kubeconfig()).expect("the kubeconfig"),
    );
    let admin = free_admin_address();
    let pod = format!("controller-{}", world.ns.name);
    let name = format!("tuc-{}", world.ns.name);
    let mount = |from: &Path, to: &str| format!("{}:{to}:ro", from.display());
    let _container = Container(name.clone());
    podman_ok(&[
        "run",
        "--detach",
        "--name",
        &name,
        "--network",
        "host",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--volume",
        &mount(&kubeconfig, "/etc/tuc/kubeconfig"),
        "--volume",
        &mount(Path::new(replica::CATALOG), "/etc/tuc/catalog.yaml"),
        "--env",
        "KUBECONFIG=/etc/tuc/kubeconfig",
        "--env",
        &format!("POD_NAME={pod}"),
        "--env",
        &format!("POD_NAMESPACE={}", world.ns.name),
        "--env",
        "TUC_LEADER_ELECT=true",
        image,
        "run",
        "--namespace",
        &world.ns.name,
        "--admin-listen",
        &admin,
        "--release-catalog",
        "/etc/tuc/catalog.yaml",
        "--poll-interval",
        "100ms",
        "--node-deadline",
        "60s",
        "--lease-duration",
        "3s",
        "--lease-grace",
        "1s",
    ]);

    world.upgrade_talos("1.11.6", "1.12.0").await;
    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    world.assert_each_node_upgraded_once(5);
    let instances = world.reporting_instances(None).await;
    assert!(
        !instances.is_empty() && instances.iter().all(|instance| *instance == pod),
        "the container's Events name it: {instances:?}"
    );

    // /metrics from the container, on the host network.
    let metrics = scrape(&admin).await;
    let completed = format!(
        "talos_upgrade_runs_total{{namespace=\"{}\",cluster=\"{}\",kind=\"talos\",result=\"completed\"}} 1",
        world.ns.name, world.cluster
    );
    assert!(
        metrics.lines().any(|line| line == completed),
        "{completed} not in:\n{metrics}"
    );
    assert_eq!(
        replica::holder(&world.ns.client, &world.ns.name, "talos-upgrade-controller").await,
        Some(pod.clone()),
        "the container holds the Lease"
    );

    // SIGTERM: a clean stop (exit 0) within the grace, the Lease released for a successor.
    podman_ok(&["stop", "--time", "30", &name]);
    let state = podman_ok(&[
        "inspect",
        "--format",
        "{{.State.ExitCode}}|{{.HostConfig.ReadonlyRootfs}}",
        &name,
    ]);
    assert_eq!(state.trim(), "0|true", "exit code | read-only root");
    assert_eq!(
        replica::holder(&world.ns.client, &world.ns.name, "talos-upgrade-controller").await,
        None,
        "the Lease is released on SIGTERM"
    );

    // What it logged holds none of its credentials.
    let logs = podman(&["logs", &name]);
    let logged = format!(
        "{}{}",
        String::from_utf8_lossy(&logs.stdout),
        String::from_utf8_lossy(&logs.stderr)
    );
    assert!(logged.contains("shutting down"), "{logged}");
    assert!(!logged.contains(&token_of(&kubeconfig)), "the API token");
    assert!(!logged.contains("PRIVATE KEY"), "a key");
}
