//! The controller's container image, as users build it (`just image` → scripts/build-image.sh → the
//! Dockerfile), built and run here with Debian's podman (runc, host network, scripts/containers.conf):
//!
//! - what is in it: one static binary and the CA roots, no shell; it runs as uid/gid 65532 and
//!   `--help` answers;
//! - the image is the controller: run with a read-only root filesystem, every capability dropped, on
//!   the host network against the test API server and a simulated cluster, it upgrades the cluster,
//!   serves `/metrics`, holds its Lease, and on SIGTERM (`podman stop`) stops cleanly, releasing the
//!   Lease; its logs hold none of the credentials it used;
//! - its CA roots are the ones the live release sources (`--live-releases`) trust: a loopback HTTPS
//!   source with a certificate from the test's own CA is refused with the image's bundle (TLS is
//!   verified) and trusted once that CA is mounted over /etc/ssl/certs/ca-certificates.crt (the
//!   image reads its roots from that file).
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

/// Runs the image detached as the controller of `world`'s namespace, as deploy/ runs it: read-only
/// root, every capability dropped, no new privileges, host network, the kubeconfig and the guide's
/// release catalog mounted read-only, leader election on. `volumes` are further `--volume`s, `args`
/// further flags of `run`. The container is removed when the returned guard drops.
fn run_controller(
    world: &World,
    kubeconfig: &Path,
    name: &str,
    admin: &str,
    volumes: &[String],
    args: &[&str],
) -> Container {
    let container = Container(name.to_string());
    let mount = |from: &Path, to: &str| format!("{}:{to}:ro", from.display());
    let mut command: Vec<String> = [
        "run",
        "--detach",
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
    ]
    .map(String::from)
    .to_vec();
    let mounts = [
        mount(kubeconfig, "/etc/tuc/kubeconfig"),
        mount(Path::new(replica::CATALOG), "/etc/tuc/catalog.yaml"),
    ];
    for volume in mounts.iter().chain(volumes) {
        command.extend(["--volume".to_string(), volume.clone()]);
    }
    command.extend(
        [
            "--env",
            "KUBECONFIG=/etc/tuc/kubeconfig",
            "--env",
            &format!("POD_NAME=controller-{}", world.ns.name),
            "--env",
            &format!("POD_NAMESPACE={}", world.ns.name),
            "--env",
            "TUC_LEADER_ELECT=true",
            image(),
            "run",
            "--namespace",
            &world.ns.name,
            "--admin-listen",
            admin,
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
        ]
        .map(String::from),
    );
    command.extend(args.iter().map(|arg| arg.to_string()));
    podman_ok(&command.iter().map(String::as_str).collect::<Vec<_>>());
    container
}

/// What a container has logged so far (stdout and stderr).
fn logs(name: &str) -> String {
    let output = podman(&["logs", name]);
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Waits (two minutes at most) until the container has logged a line containing `needle`; returns
/// that line.
async fn wait_for_log(name: &str, needle: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let logged = logs(name);
        if let Some(line) = logged.lines().find(|line| line.contains(needle)) {
            return line.to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} never logged {needle:?}; it logged:\n{logged}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

#[tokio::test]
async fn the_image_runs_as_the_controller_upgrades_a_cluster_and_stops_cleanly_on_sigterm() {
    // Built before the cluster starts, so the build's minutes are not spent with a cluster waiting.
    image();
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
    let _container = run_controller(&world, &kubeconfig, &name, &admin, &[], &[]);

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
    // The running controller has the image's allocator setting (the one the benchmark measures).
    let pid = podman_ok(&["inspect", "--format", "{{.State.Pid}}", &name]);
    let environ = std::fs::read(format!("/proc/{}/environ", pid.trim()))
        .expect("the container process's environment");
    let environ: Vec<String> = environ
        .split(|byte| *byte == 0)
        .map(|entry| String::from_utf8_lossy(entry).into_owned())
        .collect();
    for (variable, value) in talos_upgrade_controller::IMAGE_ENV {
        let entry = format!("{variable}={value}");
        // Only the names on failure: values are the test's settings, never worth printing.
        let names: Vec<&str> = environ
            .iter()
            .filter_map(|entry| entry.split_once('=').map(|(name, _)| name))
            .collect();
        assert!(
            environ.contains(&entry),
            "{entry} not in the container's environment (it has {names:?})"
        );
    }

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
    let logged = logs(&name);
    assert!(logged.contains("shutting down"), "{logged}");
    assert!(!logged.contains(&token_of(&kubeconfig)), "the API token");
    assert!(!logged.contains("PRIVATE KEY"), "a key");
    // Plain text for `kubectl logs` and log shippers: no terminal, no colour codes.
    assert!(
        !logged.contains('\u{1b}'),
        "ANSI escape codes in:\n{logged}"
    );
}

/// A loopback HTTPS server answering as the Image Factory (`GET /versions`) and a registry's tag list
/// (`GET /v2/kube-apiserver/tags/list`) do, with a certificate for 127.0.0.1 from a CA made here (in
/// no CA bundle anywhere). Returns its base URL and the CA's PEM. A hand-written HTTP/1.1 answer, one
/// request per connection: what is under test is which roots the client trusts.
async fn serve_releases_over_https(talos: &[&str], kubernetes: &[&str]) -> (String, String) {
    let versions = serde_json::json!(talos).to_string();
    let tags = serde_json::json!({"name": "kube-apiserver", "tags": kubernetes}).to_string();
    let pki = testenv::loopback_tls::LoopbackTls::generate();
    let acceptor = tokio_rustls::TlsAcceptor::from(pki.server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let address = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let (versions, tags) = (versions.clone(), tags.clone());
            tokio::spawn(async move {
                // A client that does not trust the certificate ends the handshake here.
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Some(head) = testenv::loopback_tls::read_request_head(&mut tls).await else {
                    return;
                };
                let target = testenv::loopback_tls::request_target(&head);
                let path = target.split('?').next().unwrap_or(target);
                let (status, body) = match path {
                    "/versions" => ("200 OK", versions),
                    "/v2/kube-apiserver/tags/list" => ("200 OK", tags),
                    _ => ("404 Not Found", "{}".to_string()),
                };
                testenv::loopback_tls::answer_json(&mut tls, status, &body).await;
            });
        }
    });
    (format!("https://{address}"), pki.ca_pem)
}

/// The image's CA roots are what the live release sources trust. A source of the test's own, over
/// HTTPS with a certificate from a CA no bundle holds, publishes releases nothing else knows (Talos
/// 1.12.1, Kubernetes 1.34.2, beside the guide catalog's 1.12.0 and 1.35.0):
///
/// - with the image's own bundle (the build machine's roots), the source is refused: the log names
///   the certificate problem and the cluster is offered only what the catalog knows;
/// - with the test's CA mounted read-only over /etc/ssl/certs/ca-certificates.crt (the file the
///   image's `SSL_CERT_FILE` names), the same source is trusted and its releases are offered.
///
/// Both halves run the image on one cluster, one after the other; the multi-threaded runtime keeps
/// the source answering while the test waits on podman.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_release_sources_trust_the_images_ca_roots_and_a_mounted_bundle_replaces_them() {
    image();
    let (base, ca) = serve_releases_over_https(
        &["v1.11.6", "v1.12.0", "v1.12.1"],
        &["v1.34.1", "v1.34.2", "v1.35.0"],
    )
    .await;
    let world = World::start(
        "image-ca",
        WorldSpec {
            start_controller: false,
            ..WorldSpec::default()
        },
    )
    .await;
    let files = TempDir::new("image-ca");
    let kubeconfig = files.write(
        "kubeconfig",
        &std::fs::read_to_string(world.ns.kubeconfig()).expect("the kubeconfig"),
    );
    let bundle = files.write("ca-certificates.crt", &ca);
    let tags_url = format!("{base}/v2/kube-apiserver/tags/list");
    let live = [
        "--live-releases",
        "--talos-factory-url",
        &base,
        "--kubernetes-tags-url",
        &tags_url,
    ];

    // The image's own bundle: it does not hold the test's CA, so the source is refused.
    let own = format!("tuc-{}-own-roots", world.ns.name);
    let container = run_controller(&world, &kubeconfig, &own, &free_admin_address(), &[], &live);
    let refused = wait_for_log(&own, "release source failed").await;
    eprintln!("with the image's own roots: {refused}");
    assert!(
        refused.contains("invalid peer certificate: UnknownIssuer"),
        "the log names the certificate problem: {refused}"
    );
    world
        .wait_for_annotation("talos-available", "1.12.0", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Upgrade available: 1.11.6 → 1.12.0"
    );
    assert_ne!(world.annotation("kubernetes-available").await, "1.34.2");
    let logged = logs(&own);
    assert!(!logged.contains("release source answered"), "{logged}");
    podman_ok(&["stop", "--time", "30", &own]);
    drop(container);

    // The test's CA mounted over the image's bundle: the same source is trusted.
    let mounted = format!("tuc-{}-mounted-roots", world.ns.name);
    let _container = run_controller(
        &world,
        &kubeconfig,
        &mounted,
        &free_admin_address(),
        &[format!(
            "{}:/etc/ssl/certs/ca-certificates.crt:ro",
            bundle.display()
        )],
        &live,
    );
    world
        .wait_for_annotation("talos-available", "1.12.1", "120s")
        .await;
    world
        .wait_for_annotation("kubernetes-available", "1.34.2", "60s")
        .await;
    assert_eq!(
        world.annotation("talos-message").await,
        "Upgrade available: 1.11.6 → 1.12.1"
    );
    let logged = logs(&mounted);
    assert!(
        logged.contains("release source answered") && !logged.contains("release source failed"),
        "{logged}"
    );
    // Offering a release touches no node.
    assert!(world.sim.record().is_empty(), "{}", world.sim.record_json());
}
