//! Proves the node simulator speaks the real Talos API: Talos's own Go client library
//! (`github.com/siderolabs/talos/pkg/machinery`, driven by `tests/conformance`, the way talosctl drives it)
//! checks Version, ServiceList, EtcdMemberList, Events, COSI Get/Watch and the legacy Upgrade against a
//! simulated 5-node cluster over mutual TLS.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use talos_sim::{SimConfig, Simulator, Timings};

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

/// Builds the Go program (cached by the script; the first build takes about two minutes on 2 cores)
/// and returns the binary's path, the script's last line of stdout.
fn build_conformance() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-conformance.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "{} failed with {}",
        script.display(),
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let binary = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    assert!(
        binary.is_file(),
        "{} printed no binary path (got {stdout:?})",
        script.display()
    );
    binary
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
    let binary = build_conformance();

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
    let run = tokio::process::Command::new(&binary)
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
