//! The real `talosctl` v1.14.1 (built by `scripts/build-talosctl.sh` from the Go module proxy) against a
//! simulated 3 + 2 cluster of each API generation: Talos 1.11.6, where `talosctl upgrade` falls back to
//! the legacy `MachineService.Upgrade`, and Talos 1.13.4, where it pulls through `ImageService` and
//! installs through `LifecycleService` (talos v1.14.1 `cmd/talosctl/cmd/talos/upgrade.go`). Each test
//! reads what a person would read: the node names, versions, column headers and phases talosctl prints.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;
use talos_sim::{NodeInfo, SimConfig, Simulator, Timings};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{PATIENCE, init, wait_snapshot};

const LEGACY: &str = "1.11.6";
const LEGACY_KUBERNETES: &str = "1.34.1";
const LEGACY_TARGET: &str = "ghcr.io/siderolabs/installer:v1.12.0";
/// 1.13.4: the LifecycleService generation, and a version on which KubeletSpecs and APIServerConfigs
/// are sensitive (machinery v1.13.4).
const LIFECYCLE: &str = "1.13.4";
const LIFECYCLE_KUBERNETES: &str = "1.35.0";
const LIFECYCLE_TARGET: &str = "ghcr.io/siderolabs/installer:v1.13.5";

/// The talosctl binary, built once for every test of this binary (the first caller builds, the others
/// wait). A cold build takes minutes on 2 cores; a warm cache answers at once.
fn talosctl_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(build_talosctl)
}

/// Runs the build script (it caches the binary outside the repository) and returns the path it prints
/// as its last line of stdout. A talosctl that cannot be built fails the test, loudly.
fn build_talosctl() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-talosctl.sh");
    let output = std::process::Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "{} failed with {}: talosctl could not be built",
        script.display(),
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let path = PathBuf::from(
        stdout
            .lines()
            .last()
            .unwrap_or_else(|| panic!("{} printed no path", script.display()))
            .trim(),
    );
    assert!(path.is_file(), "{} is not a file", path.display());
    path
}

/// Removes the talosconfig however the test ends.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A simulated cluster and a talosctl pointed at it.
struct Cluster {
    sim: Simulator,
    talosconfig: TempFile,
    binary: &'static Path,
}

async fn cluster(name: &str, talos: &str, kubernetes: &str) -> Cluster {
    cluster_as(name, talos, kubernetes, "os:admin").await
}

async fn cluster_as(name: &str, talos: &str, kubernetes: &str, role: &str) -> Cluster {
    init();
    // Built before the simulator starts: nothing else runs on the runtime yet, so blocking is fine.
    let binary = talosctl_binary();
    let config = SimConfig::uniform(name, 3, 2, talos, kubernetes).with_timings(Timings::fast());
    let sim = Simulator::start(config).await.expect("simulator starts");
    for node in sim.nodes() {
        wait_snapshot(&sim, &node.name, "the node to be ready", |s| s.ready).await;
    }
    let talosconfig = TempFile(std::env::temp_dir().join(format!(
        "tuc-talosctl-{name}-{}.talosconfig",
        std::process::id()
    )));
    std::fs::write(&talosconfig.0, sim.talosconfig(role)).expect("write the talosconfig");
    Cluster {
        sim,
        talosconfig,
        binary,
    }
}

/// What one talosctl run printed, with a report to show when an assertion fails.
struct Run {
    stdout: String,
    stderr: String,
    report: String,
    success: bool,
}

impl Cluster {
    fn node(&self, name: &str) -> NodeInfo {
        self.sim
            .nodes()
            .into_iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    fn ip(&self, name: &str) -> String {
        self.node(name).address.to_string()
    }

    /// `talosctl --endpoints <cp-1> --nodes <nodes> <args>`, `nodes` one name or several joined by
    /// commas.
    fn command(&self, nodes: &str, args: &[&str]) -> tokio::process::Command {
        let endpoint = self.node("cp-1");
        let nodes: Vec<String> = nodes.split(',').map(|n| self.ip(n)).collect();
        let mut command = tokio::process::Command::new(self.binary);
        command
            .arg("--talosconfig")
            .arg(&self.talosconfig.0)
            .args([
                "--endpoints",
                &format!("{}:{}", endpoint.address, endpoint.port),
                "--nodes",
                &nodes.join(","),
            ])
            .args(args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// Runs `talosctl --nodes <node> <args>` to its end.
    async fn run(&self, node: &str, args: &[&str]) -> Run {
        // The simulator serves this process's runtime, so the child is awaited, never waited on blocking.
        let output: Output =
            tokio::time::timeout(Duration::from_secs(120), self.command(node, args).output())
                .await
                .unwrap_or_else(|_| panic!("talosctl {} did not finish", args.join(" ")))
                .expect("run talosctl");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        let report = format!(
            "talosctl --nodes {node} {} exited with {}\n--- stdout\n{stdout}--- stderr\n{stderr}",
            args.join(" "),
            output.status
        );
        println!("{report}");
        Run {
            stdout,
            stderr,
            report,
            success: output.status.success(),
        }
    }

    /// Runs talosctl, which must succeed.
    async fn ok(&self, node: &str, args: &[&str]) -> Run {
        let run = self.run(node, args).await;
        assert!(run.success, "{}", run.report);
        run
    }
}

/// The rows of a table talosctl prints (a tabwriter with at least 3 spaces between columns), keyed by
/// the header's column names; a cell is what lies under its header.
fn table(run: &Run) -> Vec<BTreeMap<String, String>> {
    let mut lines = run.stdout.lines().filter(|l| !l.trim().is_empty());
    let header = lines
        .next()
        .unwrap_or_else(|| panic!("no table\n{}", run.report));
    let mut columns: Vec<(usize, String)> = Vec::new();
    let mut start = 0;
    for part in header.split("   ") {
        if !part.trim().is_empty() {
            let offset = start + (part.len() - part.trim_start().len());
            columns.push((offset, part.trim().to_string()));
        }
        start += part.len() + 3;
    }
    lines
        .map(|line| {
            columns
                .iter()
                .enumerate()
                .map(|(i, (offset, name))| {
                    let end = columns.get(i + 1).map_or(line.len(), |(next, _)| *next);
                    let cell = line.get(*offset..end.min(line.len())).unwrap_or_default();
                    (name.clone(), cell.trim().to_string())
                })
                .collect()
        })
        .collect()
}

fn headers(run: &Run) -> Vec<String> {
    let header = run.stdout.lines().next().unwrap_or_default();
    header
        .split("   ")
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect()
}

/// The cell of `column` in the row whose `key` column is `value`.
fn cell(rows: &[BTreeMap<String, String>], key: &str, value: &str, column: &str) -> String {
    rows.iter()
        .find(|row| row.get(key).map(String::as_str) == Some(value))
        .and_then(|row| row.get(column).cloned())
        .unwrap_or_else(|| panic!("no row with {key} = {value} and a {column} column in {rows:#?}"))
}

/// The names of the simulated nodes, control planes first.
fn names(cluster: &Cluster) -> Vec<String> {
    cluster.sim.nodes().into_iter().map(|n| n.name).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_service_and_etcd_on_a_legacy_cluster() {
    let c = cluster("tctl-basics", LEGACY, LEGACY_KUBERNETES).await;

    // `version`: the client's tag and the node's, as Talos's version template prints them.
    let run = c.ok("cp-1", &["version"]).await;
    let (client, server) = run
        .stdout
        .split_once("Server:")
        .unwrap_or_else(|| panic!("no Server section\n{}", run.report));
    assert!(client.contains("Tag:         v1.14.1"), "{}", run.report);
    assert!(
        server.contains(&format!("NODE:        {}", c.ip("cp-1"))),
        "{}",
        run.report
    );
    assert!(
        server.contains(&format!("Tag:         v{LEGACY}")),
        "{}",
        run.report
    );
    // `service`: every service of a control plane, running and healthy.
    let run = c.ok("cp-1", &["service"]).await;
    assert_eq!(
        headers(&run),
        [
            "NODE",
            "SERVICE",
            "STATE",
            "HEALTH",
            "LAST CHANGE",
            "LAST EVENT"
        ]
    );
    let rows = table(&run);
    for service in ["apid", "etcd", "kubelet", "machined", "trustd"] {
        assert_eq!(cell(&rows, "SERVICE", service, "STATE"), "Running");
        assert_eq!(cell(&rows, "SERVICE", service, "HEALTH"), "OK");
        assert_eq!(cell(&rows, "SERVICE", service, "NODE"), c.ip("cp-1"));
    }
    // A worker runs no etcd.
    let run = c.ok("worker-1", &["service"]).await;
    assert!(
        table(&run).iter().all(|row| row["SERVICE"] != "etcd"),
        "{}",
        run.report
    );

    // `etcd members`: the three control planes, by hostname, with their peer and client URLs.
    let run = c.ok("cp-1", &["etcd", "members"]).await;
    let members = table(&run);
    let mut hostnames: Vec<&str> = members.iter().map(|m| m["HOSTNAME"].as_str()).collect();
    hostnames.sort_unstable();
    assert_eq!(hostnames, ["cp-1", "cp-2", "cp-3"], "{}", run.report);
    for name in ["cp-1", "cp-2", "cp-3"] {
        let ip = c.ip(name);
        assert_eq!(
            cell(&members, "HOSTNAME", name, "PEER URLS"),
            format!("https://{ip}:2380")
        );
        assert_eq!(
            cell(&members, "HOSTNAME", name, "CLIENT URLS"),
            format!("https://{ip}:2379")
        );
        assert_eq!(cell(&members, "HOSTNAME", name, "LEARNER"), "false");
    }

    // `etcd status`: cp-2's own member, and a leader among the members.
    let run = c.ok("cp-2", &["etcd", "status"]).await;
    let status = table(&run);
    assert_eq!(status.len(), 1, "{}", run.report);
    assert_eq!(status[0]["NODE"], c.ip("cp-2"));
    assert_eq!(
        status[0]["MEMBER"],
        cell(&members, "HOSTNAME", "cp-2", "ID")
    );
    assert!(
        members.iter().any(|m| m["ID"] == status[0]["LEADER"]),
        "the leader {} is a member\n{}",
        status[0]["LEADER"],
        run.report
    );
    assert_eq!(status[0]["LEARNER"], "false");
}

/// `talosctl get` of the resources a person reads on a cluster of `talos`.
async fn get_resources(c: &Cluster, talos: &str) {
    let tag = format!("v{talos}");

    // `get members`: every node of the cluster as discovery reports it, whichever node is asked.
    for asked in ["cp-1", "worker-2"] {
        let run = c.ok(asked, &["get", "members"]).await;
        assert_eq!(
            headers(&run),
            [
                "NODE",
                "NAMESPACE",
                "TYPE",
                "ID",
                "VERSION",
                "HOSTNAME",
                "MACHINE TYPE",
                "OS",
                "ADDRESSES"
            ]
        );
        let rows = table(&run);
        let mut ids: Vec<&str> = rows.iter().map(|r| r["ID"].as_str()).collect();
        ids.sort_unstable();
        assert_eq!(ids, names(c), "{}", run.report);
        for node in c.sim.nodes() {
            let name = node.name.as_str();
            assert_eq!(cell(&rows, "ID", name, "NAMESPACE"), "cluster");
            assert_eq!(cell(&rows, "ID", name, "TYPE"), "Member");
            assert_eq!(cell(&rows, "ID", name, "HOSTNAME"), name);
            assert_eq!(cell(&rows, "ID", name, "MACHINE TYPE"), node.role.as_str());
            assert_eq!(cell(&rows, "ID", name, "OS"), format!("Talos ({tag})"));
            assert_eq!(
                cell(&rows, "ID", name, "ADDRESSES"),
                format!("[\"{}\"]", node.address)
            );
        }
    }

    // `get machinestatus` (by its full name) on two nodes at once.
    let run = c.ok("cp-1,worker-1", &["get", "machinestatus"]).await;
    assert_eq!(
        headers(&run),
        [
            "NODE",
            "NAMESPACE",
            "TYPE",
            "ID",
            "VERSION",
            "STAGE",
            "READY"
        ]
    );
    let rows = table(&run);
    assert_eq!(rows.len(), 2, "{}", run.report);
    for name in ["cp-1", "worker-1"] {
        let ip = c.ip(name);
        assert_eq!(cell(&rows, "NODE", &ip, "TYPE"), "MachineStatus");
        assert_eq!(cell(&rows, "NODE", &ip, "ID"), "machine");
        assert_eq!(cell(&rows, "NODE", &ip, "STAGE"), "running");
        assert_eq!(cell(&rows, "NODE", &ip, "READY"), "true");
    }

    // `get ms -o yaml`: the alias resolves, and the document is the resource's metadata and spec.
    let run = c.ok("cp-1", &["get", "ms", "-o", "yaml"]).await;
    let doc: serde_yaml::Value = serde_yaml::from_str(&run.stdout).expect("YAML");
    assert_eq!(doc["node"], c.ip("cp-1").as_str(), "{}", run.report);
    assert_eq!(doc["metadata"]["namespace"], "runtime");
    assert_eq!(doc["metadata"]["type"], "MachineStatuses.runtime.talos.dev");
    assert_eq!(doc["metadata"]["id"], "machine");
    assert_eq!(doc["metadata"]["owner"], "runtime.MachineStatusController");
    assert_eq!(doc["spec"]["stage"], "running");
    assert_eq!(doc["spec"]["status"]["ready"], true);

    // `get nodename` on a worker.
    let run = c.ok("worker-2", &["get", "nodename"]).await;
    assert_eq!(headers(&run).last().map(String::as_str), Some("NODENAME"));
    assert_eq!(cell(&table(&run), "ID", "nodename", "NODENAME"), "worker-2");

    // `get staticpodstatus`: the control plane's static pods, Ready as kubelet reports them.
    let run = c.ok("cp-2", &["get", "staticpodstatus"]).await;
    assert_eq!(headers(&run).last().map(String::as_str), Some("READY"));
    let rows = table(&run);
    for component in [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        let id = format!("kube-system/{component}-cp-2");
        assert_eq!(cell(&rows, "ID", &id, "TYPE"), "StaticPodStatus");
        assert_eq!(cell(&rows, "ID", &id, "READY"), "True");
    }
    // A worker has none: the header and no row.
    let run = c.ok("worker-1", &["get", "podstatus"]).await;
    assert!(table(&run).is_empty(), "{}", run.report);

    // `get kubeletspec` (no extra columns) and its spec in YAML.
    let run = c.ok("worker-1", &["get", "kubeletspec"]).await;
    assert_eq!(
        headers(&run),
        ["NODE", "NAMESPACE", "TYPE", "ID", "VERSION"]
    );
    assert_eq!(cell(&table(&run), "ID", "kubelet", "TYPE"), "KubeletSpec");
    let run = c
        .ok("worker-1", &["get", "kubeletspec", "-o", "yaml"])
        .await;
    let doc: serde_yaml::Value = serde_yaml::from_str(&run.stdout).expect("YAML");
    assert_eq!(
        doc["spec"]["expectedNodename"], "worker-1",
        "{}",
        run.report
    );

    // `get mc v1alpha1 -o yaml`: the spec is the machine config's text, not a string of a string.
    let run = c
        .ok("worker-1", &["get", "mc", "v1alpha1", "-o", "yaml"])
        .await;
    let doc: serde_yaml::Value = serde_yaml::from_str(&run.stdout).expect("YAML");
    let text = doc["spec"]
        .as_str()
        .unwrap_or_else(|| panic!("the spec is the config's text\n{}", run.report));
    let first = serde_yaml::Deserializer::from_str(text)
        .next()
        .expect("a document");
    let config = serde_yaml::Value::deserialize(first).expect("the config is YAML");
    assert_eq!(config["machine"]["type"], "worker", "{}", run.report);
    assert_eq!(config["machine"]["network"]["hostname"], "worker-1");

    // `get apiserverconfig` in its default namespace, controlplane.
    let run = c.ok("cp-3", &["get", "apiserverconfig"]).await;
    assert_eq!(
        cell(&table(&run), "ID", "kube-apiserver", "NAMESPACE"),
        "controlplane"
    );

    // `get version`: the Version column (and from 1.13 the Name column) after the metadata's VERSION.
    let run = c.ok("cp-1", &["get", "version"]).await;
    let header = headers(&run);
    let rows = table(&run);
    let named = talos.starts_with("1.13") || talos.starts_with("1.14");
    if named {
        assert_eq!(
            header,
            [
                "NODE",
                "NAMESPACE",
                "TYPE",
                "ID",
                "VERSION",
                "NAME",
                "VERSION"
            ]
        );
        assert_eq!(cell(&rows, "ID", "version", "NAME"), "Talos");
    } else {
        assert_eq!(
            header,
            ["NODE", "NAMESPACE", "TYPE", "ID", "VERSION", "VERSION"]
        );
    }
    // The last column (the spec's version) wins the duplicated key; the row's end shows it too.
    assert!(
        run.stdout
            .lines()
            .any(|l| l.contains("Version") && l.trim_end().ends_with(&tag)),
        "{}",
        run.report
    );

    // `get rd`: a definition per type the node serves, with the aliases cosi adds.
    let run = c.ok("cp-1", &["get", "rd"]).await;
    assert_eq!(
        headers(&run),
        ["NODE", "NAMESPACE", "TYPE", "ID", "VERSION", "ALIASES"]
    );
    let rows = table(&run);
    for (id, aliases) in [
        ("machinestatuses.runtime.talos.dev", "machinestatus ms"),
        ("members.cluster.talos.dev", "member"),
        (
            "resourcedefinitions.meta.cosi.dev",
            "api-resources resourcedefinition rd rds",
        ),
        (
            "staticpodstatuses.kubernetes.talos.dev",
            "podstatus staticpodstatus sps",
        ),
        ("services.v1alpha1.talos.dev", "svc service"),
    ] {
        assert_eq!(cell(&rows, "ID", id, "TYPE"), "ResourceDefinition");
        assert_eq!(cell(&rows, "ID", id, "NAMESPACE"), "meta");
        assert_eq!(cell(&rows, "ID", id, "ALIASES"), aliases);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_on_a_legacy_cluster() {
    let c = cluster("tctl-get-legacy", LEGACY, LEGACY_KUBERNETES).await;
    get_resources(&c, LEGACY).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_on_a_lifecycle_cluster() {
    let c = cluster("tctl-get-lifecycle", LIFECYCLE, LIFECYCLE_KUBERNETES).await;
    get_resources(&c, LIFECYCLE).await;
}

/// Sensitive types are the admin's: an `os:reader` talosconfig reads MachineStatus but not
/// KubeletSpec on 1.13.4, where machinery marks it sensitive, and reads both on 1.11.6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_is_refused_what_talos_marks_sensitive() {
    let c = cluster_as(
        "tctl-reader-new",
        LIFECYCLE,
        LIFECYCLE_KUBERNETES,
        "os:reader",
    )
    .await;
    let run = c.ok("cp-1", &["get", "ms"]).await;
    assert_eq!(cell(&table(&run), "ID", "machine", "STAGE"), "running");
    let run = c.run("cp-1", &["get", "kubeletspec"]).await;
    assert!(!run.success, "{}", run.report);
    assert!(
        run.stderr.contains("PermissionDenied")
            && run
                .stderr
                .contains("KubeletSpecs.kubernetes.talos.dev\" requires the os:admin role"),
        "{}",
        run.report
    );
    // The definition says why.
    let run = c
        .ok(
            "cp-1",
            &[
                "get",
                "rd",
                "kubeletspecs.kubernetes.talos.dev",
                "-o",
                "yaml",
            ],
        )
        .await;
    let doc: serde_yaml::Value = serde_yaml::from_str(&run.stdout).expect("YAML");
    assert_eq!(doc["spec"]["sensitivity"], "sensitive", "{}", run.report);

    let c = cluster_as("tctl-reader-old", LEGACY, LEGACY_KUBERNETES, "os:reader").await;
    let run = c.ok("cp-1", &["get", "kubeletspec"]).await;
    assert_eq!(cell(&table(&run), "ID", "kubelet", "TYPE"), "KubeletSpec");
}

/// A `get members --watch` running beside an upgrade: the bootstrap rows, then the upgraded worker's
/// member updated to its new OS. Returns the watch's output lines until then.
async fn watch_member_update(
    c: &Cluster,
    watch: &mut tokio::process::Child,
    worker: &str,
    os: &str,
) -> Vec<String> {
    let stdout = watch.stdout.take().expect("the watch's stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(PATIENCE * 4, async {
        while let Some(line) = lines.next_line().await.expect("read the watch") {
            seen.push(line.clone());
            let fields: Vec<&str> = line.split_whitespace().collect();
            // An update row has no event mark: NODE NAMESPACE TYPE ID VERSION HOSTNAME ...
            if fields.get(3) == Some(&worker) && line.contains(os) {
                return true;
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(
        found,
        "the watch on {} never showed {worker} on {os}; it printed:\n{}",
        c.ip("cp-1"),
        seen.join("\n")
    );
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_wait_on_a_legacy_cluster() {
    let c = cluster("tctl-upgrade-legacy", LEGACY, LEGACY_KUBERNETES).await;
    let mut watch = c
        .command("cp-1", &["get", "members", "--watch"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the watch");

    let run = c
        .ok(
            "worker-1",
            &[
                "upgrade",
                "--image",
                LEGACY_TARGET,
                "--wait",
                "--progress",
                "plain",
            ],
        )
        .await;
    let output = format!("{}{}", run.stdout, run.stderr);
    // talosctl 1.14.1 finds no LifecycleService below 1.13.0-alpha.3 and falls back.
    assert!(
        output.contains("New upgrade API is not available, falling back to legacy"),
        "{}",
        run.report
    );
    // The legacy tracker follows the upgrade sequence to the reboot, then the new boot. It reports the
    // latest event every 100 ms (talos v1.14.1 `cmd/talosctl/pkg/talos/action/tracker.go`), so which
    // intermediate phases get printed depends on timing; the final line does not.
    let ip = c.ip("worker-1");
    assert!(
        output.contains(&format!("\"{ip}\": post check passed")),
        "no post check\n{}",
        run.report
    );
    assert_one_upgrade_and_one_reboot(&c, "worker-1", "/machine.MachineService/Upgrade");

    // The node runs the new version, as the simulator and talosctl see it.
    let snapshot = c.sim.node_snapshot("worker-1").expect("worker-1");
    assert_eq!(snapshot.talos_version, "1.12.0");
    let run = c.ok("worker-1", &["version"]).await;
    let server = run
        .stdout
        .split_once("Server:")
        .map(|(_, s)| s)
        .unwrap_or("");
    assert!(server.contains("Tag:         v1.12.0"), "{}", run.report);

    // The watch saw worker-1's member change to the new OS; the others stay on the old one.
    let seen = watch_member_update(&c, &mut watch, "worker-1", "Talos (v1.12.0)").await;
    assert!(
        seen.iter()
            .any(|l| l.contains("HOSTNAME") && l.contains("OS")),
        "{seen:#?}"
    );
    watch.kill().await.expect("stop the watch");
    let run = c.ok("cp-1", &["get", "members"]).await;
    let rows = table(&run);
    assert_eq!(cell(&rows, "ID", "worker-1", "OS"), "Talos (v1.12.0)");
    assert_eq!(
        cell(&rows, "ID", "worker-2", "OS"),
        format!("Talos (v{LEGACY})")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_wait_on_a_lifecycle_cluster() {
    let c = cluster("tctl-upgrade-lifecycle", LIFECYCLE, LIFECYCLE_KUBERNETES).await;
    // `--drain` (on by default) would cordon and evict through the Kubernetes API, which the simulated
    // cluster has only when a workload cluster is attached; the node cordons itself anyway.
    let run = c
        .ok(
            "worker-2",
            &[
                "upgrade",
                "--image",
                LIFECYCLE_TARGET,
                "--wait",
                "--drain=false",
                "--progress",
                "plain",
            ],
        )
        .await;
    let output = format!("{}{}", run.stdout, run.stderr);
    let ip = c.ip("worker-2");
    assert!(
        !output.contains("falling back to legacy"),
        "a 1.13 node has the LifecycleService\n{}",
        run.report
    );
    // The pull through ImageService, the installer through LifecycleService (their output printed
    // line by line), then the reboot, whose tracker prints the latest event every 100 ms: only its
    // final line is certain.
    for line in [
        format!("{ip}: pulled image {LIFECYCLE_TARGET}"),
        format!("{ip}: upgrade completed"),
        format!("\"{ip}\": post check passed"),
    ] {
        assert!(output.contains(&line), "no {line:?}\n{}", run.report);
    }
    assert_one_upgrade_and_one_reboot(&c, "worker-2", "/machine.LifecycleService/Upgrade");
    let snapshot = c.sim.node_snapshot("worker-2").expect("worker-2");
    assert_eq!(snapshot.talos_version, "1.13.5");

    // Another node's discovery shows the new OS.
    let run = c.ok("cp-2", &["get", "members"]).await;
    let rows = table(&run);
    assert_eq!(cell(&rows, "ID", "worker-2", "OS"), "Talos (v1.13.5)");
    assert_eq!(
        cell(&rows, "ID", "worker-1", "OS"),
        format!("Talos (v{LIFECYCLE})")
    );
}

/// The simulator received exactly one `upgrade` call (of `method`) for `short`, and the node went down
/// exactly once: talosctl upgraded and rebooted it once.
fn assert_one_upgrade_and_one_reboot(c: &Cluster, short: &str, method: &str) {
    let name = c.sim.node_snapshot(short).expect("the node").name;
    let upgrades = c
        .sim
        .record()
        .iter()
        .filter(|call| call.node == name && call.method == method)
        .count();
    assert_eq!(upgrades, 1, "{method} to {name}: {}", c.sim.record_json());
    let downs = c
        .sim
        .power_events()
        .iter()
        .filter(|e| e.node == name && e.kind == talos_sim::PowerKind::Down)
        .count();
    assert_eq!(downs, 1, "{name} went down {downs} times");
}
