//! Proves the node simulator speaks the real Talos API: Talos's own Go client library
//! (`github.com/siderolabs/talos/pkg/machinery`, driven by `tests/conformance`, the way talosctl drives it)
//! checks Version, ServiceList, EtcdMemberList, Events, COSI Get/Watch and the legacy Upgrade against a
//! simulated 5-node cluster over mutual TLS (machinery v1.12.0), and the same program built against
//! machinery v1.14.1 checks Talos 1.14's surface on a cluster created on 1.14: platforms, the Image
//! Factory schematic, configs decoded and validated by machinery itself, an ApplyConfiguration the way
//! `talosctl upgrade-k8s` 1.14 patches images, and the pulls of the generic and the factory installer.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use talos_sim::{NodeConfig, SimConfig, Simulator, Timings};

const UPGRADE_METHOD: &str = "/machine.MachineService/Upgrade";
const UPGRADE_IMAGE: &str = "ghcr.io/siderolabs/installer:v1.12.0";
/// Every check the Go program runs for the arguments below; a check that silently disappeared from
/// the output must fail the test too.
const EXPECTED_CHECKS: &[&str] = &[
    "Version",
    "ServiceList",
    "EtcdMemberList",
    "Events",
    "COSIGet",
    "COSIWatch",
    "Upgrade",
];

/// The checker built against each machinery version.
struct Binaries {
    v1_12: PathBuf,
    v1_14: PathBuf,
}

/// The binaries, built once for every test of this binary (the first caller builds, the others wait).
fn conformance_binaries() -> &'static Binaries {
    static BINARIES: OnceLock<Binaries> = OnceLock::new();
    BINARIES.get_or_init(build_conformance)
}

/// Builds the Go program twice (cached by the script; a cold build takes minutes on 2 cores) and returns
/// the binaries' paths, the script's last two lines of stdout (`<machinery version> <path>`).
fn build_conformance() -> Binaries {
    let script = testenv::script::path("build-conformance.sh");
    let stdout = testenv::script::stdout(&script, &[], &[]);
    let binary = |version: &str| {
        let path = stdout
            .lines()
            .filter_map(|line| line.trim().split_once(' '))
            .find(|(v, _)| *v == version)
            .map(|(_, path)| PathBuf::from(path))
            .unwrap_or_else(|| {
                panic!(
                    "{} printed no {version} binary (got {stdout:?})",
                    script.display()
                )
            });
        assert!(path.is_file(), "{} is not a file", path.display());
        path
    };
    Binaries {
        v1_12: binary("v1.12.0"),
        v1_14: binary("v1.14.1"),
    }
}

/// Removes the talosconfig however the test ends.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn talos_go_client_conforms() {
    // Blocking is fine here: nothing else runs on the runtime yet.
    let binary = &conformance_binaries().v1_12;

    let config =
        SimConfig::uniform("conformance", 3, 2, "1.11.6", "1.34.1").with_timings(Timings::fast());
    let sim = Simulator::start(config).await.expect("start the simulator");

    let talosconfig = TempFile(std::env::temp_dir().join(format!(
        "tuc-conformance-{}.talosconfig",
        std::process::id()
    )));
    std::fs::write(&talosconfig.0, sim.talosconfig("os:admin")).expect("write the talosconfig");

    let nodes = sim.nodes();
    let control_plane = nodes
        .iter()
        .find(|n| n.role.is_control_plane())
        .expect("a control-plane node");
    let worker = nodes
        .iter()
        .find(|n| !n.role.is_control_plane())
        .expect("a worker node");
    let (cp_address, worker_address) = (
        control_plane.address.to_string(),
        worker.address.to_string(),
    );

    // The simulator serves this process's runtime, so the child is awaited, never waited on blocking.
    let run = tokio::process::Command::new(binary)
        .arg("--talosconfig")
        .arg(&talosconfig.0)
        .args(["--node", &cp_address, "--worker-node", &worker_address])
        .args(["--upgrade-image", UPGRADE_IMAGE, "--timeout", "60s"])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the conformance program finished within 300 s")
        .expect("run the conformance program");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = format!(
        "{} --node {cp_address} --worker-node {worker_address} exited with {}\n--- stdout\n{stdout}--- stderr\n{}",
        binary.display(),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{report}");

    assert!(output.status.success(), "{report}");
    let lines: Vec<&str> = stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    for line in &lines {
        assert!(
            line.starts_with("PASS "),
            "not a passing check: {line}\n{report}"
        );
    }
    for check in EXPECTED_CHECKS {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("PASS {check}["))),
            "check {check} did not run\n{report}"
        );
    }

    // The Go client's one Upgrade call reached the worker, through the control-plane endpoint, once.
    let upgrades: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|call| call.method == UPGRADE_METHOD)
        .collect();
    let to_worker = |node: &str| node == worker.name || node == worker_address;
    assert_eq!(
        upgrades.iter().filter(|call| to_worker(&call.node)).count(),
        1,
        "expected exactly one {UPGRADE_METHOD} call for {} ({worker_address}); calls: {upgrades:#?}",
        worker.name
    );
    assert_eq!(
        upgrades.len(),
        1,
        "only the worker is upgraded; calls: {upgrades:#?}"
    );
    assert_eq!(
        upgrades[0].params["image"], UPGRADE_IMAGE,
        "the recorded image; call: {:#?}",
        upgrades[0]
    );
}

/// Runs the checker with `args` against the simulator's talosconfig; its stdout lines and a report of
/// the run. Every line must be a passing check.
async fn run_checker(sim: &Simulator, binary: &Path, name: &str, args: &[String]) -> Vec<String> {
    let talosconfig = TempFile(std::env::temp_dir().join(format!(
        "tuc-conformance-{name}-{}.talosconfig",
        std::process::id()
    )));
    std::fs::write(&talosconfig.0, sim.talosconfig("os:admin")).expect("write the talosconfig");
    // The simulator serves this process's runtime, so the child is awaited, never waited on blocking.
    let run = tokio::process::Command::new(binary)
        .arg("--talosconfig")
        .arg(&talosconfig.0)
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .expect("the conformance program finished within 300 s")
        .expect("run the conformance program");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let report = format!(
        "{} {} exited with {}\n--- stdout\n{stdout}--- stderr\n{}",
        binary.display(),
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{report}");
    assert!(output.status.success(), "{report}");
    let lines: Vec<String> = stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    for line in &lines {
        assert!(
            line.starts_with("PASS "),
            "not a passing check: {line}\n{report}"
        );
    }
    lines
}

/// A schematic of our own (not the empty one), as a customized factory image carries.
const CUSTOM_SCHEMATIC: &str = "ce4c980550dd2ab1b17bbf2b08801c7eb59418eafe8f279833297925d67c7515";
const APPLY_METHOD: &str = "/machine.MachineService/ApplyConfiguration";
const PULL_METHOD: &str = "/machine.ImageService/Pull";

/// Talos's Go client of 1.14 (machinery v1.14.1) against a cluster created on Talos 1.14: a control
/// plane and a worker whose configs carry the Kube* documents and `UnattendedInstallConfig`, the worker
/// on AWS and installed from a customized factory image, and a worker upgraded from 1.13 (its config
/// still v1alpha1-shaped, installed from a private mirror). Machinery itself decodes and validates every
/// node's config, bumps the control plane's kube-apiserver the way `talosctl upgrade-k8s` does, and sees
/// a 1.13-era patch of the same image refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn talos_1_14_go_client_conforms() {
    let binary = &conformance_binaries().v1_14;

    let factory_aws = format!("factory.talos.dev/aws-installer/{CUSTOM_SCHEMATIC}:v1.14.1");
    let mut upgraded = NodeConfig::worker("worker-2", "1.14.1", "1.36.2");
    upgraded.installer_image = Some("registry.local:5000/siderolabs/installer:v1.14.1".into());
    let mut aws = NodeConfig::worker("worker-1", "1.14.1", "1.37.0")
        .created_on_1_14()
        .with_platform("aws");
    aws.installer_image = Some(factory_aws.clone());
    let config = SimConfig::new("conformance-114")
        .with_node(NodeConfig::control_plane("cp-1", "1.14.1", "1.37.0").created_on_1_14())
        .with_node(aws)
        .with_node(upgraded)
        .with_timings(Timings::fast());
    let sim = Simulator::start(config).await.expect("start the simulator");
    let ip = |name: &str| {
        sim.nodes()
            .into_iter()
            .find(|n| n.name == name)
            .map(|n| n.address.to_string())
            .expect("a node")
    };
    let (cp, aws, upgraded) = (ip("cp-1"), ip("worker-1"), ip("worker-2"));
    let empty = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";

    let args: Vec<String> = [
        "--node",
        &cp,
        "--worker-node",
        &aws,
        "--timeout",
        "60s",
        "--platform",
        &format!("{cp}=metal"),
        "--platform",
        &format!("{aws}=aws"),
        "--platform",
        &format!("{upgraded}=metal"),
        "--schematic",
        &format!("{cp}={empty}"),
        "--schematic",
        &format!("{aws}={CUSTOM_SCHEMATIC}"),
        "--config",
        &format!("{cp}=multidoc"),
        "--config",
        &format!("{aws}=multidoc"),
        "--config",
        &format!("{upgraded}=v1alpha1"),
        "--apply-node",
        &cp,
        "--pull-node",
        &aws,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    let lines = run_checker(&sim, binary, "114", &args).await;

    let expected: Vec<(&str, &str)> = vec![
        ("Version", &cp),
        ("ServiceList", &cp),
        ("EtcdMemberList", &cp),
        ("Events", &cp),
        ("COSIGet", &cp),
        ("COSIWatch", &cp),
        ("Version", &aws),
        ("ServiceList", &aws),
        ("Platform", &cp),
        ("Platform", &aws),
        ("Platform", &upgraded),
        ("Schematic", &cp),
        ("Schematic", &aws),
        ("MachineConfig", &cp),
        ("MachineConfig", &aws),
        ("MachineConfig", &upgraded),
        ("ApplyKubeAPIServerImage", &cp),
        ("ApplyConflictRefused", &cp),
        ("PullGenericInstaller", &aws),
        ("PullFactoryInstaller", &aws),
    ];
    for (check, node) in expected {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("PASS {check}[{node}]"))),
            "check {check}[{node}] did not run: {lines:#?}"
        );
    }

    // What the node saw: one accepted apply that moved kube-apiserver to the next patch, one refused.
    let applies: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method == APPLY_METHOD)
        .collect();
    assert_eq!(applies.len(), 2, "{applies:#?}");
    assert_eq!(applies[0].result, "ok", "{applies:#?}");
    assert_eq!(
        applies[0].params["images"]["apiserver"], "registry.k8s.io/kube-apiserver:v1.37.1",
        "{applies:#?}"
    );
    assert!(
        applies[1].result.starts_with("InvalidArgument"),
        "{applies:#?}"
    );
    let snapshot = sim
        .wait_for("cp-1", Duration::from_secs(30), |s| {
            s.control_plane
                .as_ref()
                .is_some_and(|c| c.apiserver.running && c.apiserver.version == "1.37.1")
        })
        .await
        .expect("kube-apiserver restarted on 1.37.1");
    assert_eq!(snapshot.kubelet.version, "1.37.0");

    // The generic installer's pull failed as a registry miss; the factory's went through.
    let pulls: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method == PULL_METHOD)
        .map(|c| {
            (
                c.params["image_ref"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                c.result,
            )
        })
        .collect();
    assert!(
        pulls.iter().any(
            |(image, result)| image == "ghcr.io/siderolabs/installer:v1.14.1"
                && result.starts_with("NotFound")
        ),
        "{pulls:#?}"
    );
    assert!(
        pulls
            .iter()
            .any(|(image, result)| *image == factory_aws && result == "ok"),
        "{pulls:#?}"
    );
}
