//! The real `talosctl` v1.14.1 (built by `scripts/build-talosctl.sh` from the Go module proxy) against a
//! simulated 3 + 2 cluster of each API generation: Talos 1.11.6, where `talosctl upgrade` falls back to
//! the legacy `MachineService.Upgrade`, and Talos 1.13.4, where it pulls through `ImageService` and
//! installs through `LifecycleService` (talos v1.14.1 `cmd/talosctl/cmd/talos/upgrade.go`). The `v1_12_`
//! tests do the same with talosctl v1.12.0 (`scripts/build-talosctl.sh 1.12`), the release of the
//! machinery the Go conformance check uses, which makes the legacy call on both generations. Each test
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
use crate::mirrored;

const LEGACY: &str = "1.11.6";
const LEGACY_KUBERNETES: &str = "1.34.1";
const LEGACY_TARGET: &str = "ghcr.io/siderolabs/installer:v1.12.0";
/// 1.13.4: the LifecycleService generation, and a version on which KubeletSpecs and APIServerConfigs
/// are sensitive (machinery v1.13.4).
const LIFECYCLE: &str = "1.13.4";
const LIFECYCLE_KUBERNETES: &str = "1.35.0";
const LIFECYCLE_TARGET: &str = "ghcr.io/siderolabs/installer:v1.13.5";

/// The talosctl releases `scripts/build-talosctl.sh` builds, each from its own wrapper module.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Talosctl {
    /// v1.14.1: ImageService and LifecycleService on Talos >= 1.13, the legacy Upgrade below; a
    /// `--nodes` list sent as one call per node with the `node` header.
    V1_14,
    /// v1.12.0, the release of the machinery the Go conformance check uses: the legacy
    /// `MachineService.Upgrade` only, and every `--nodes` list sent through the endpoint as one
    /// one-to-many request (apid's `nodes` metadata).
    V1_12,
}

impl Talosctl {
    /// The script's argument.
    fn release(self) -> &'static str {
        match self {
            Talosctl::V1_14 => "1.14",
            Talosctl::V1_12 => "1.12",
        }
    }

    /// The client's tag, as `talosctl version` prints it.
    fn tag(self) -> &'static str {
        match self {
            Talosctl::V1_14 => "v1.14.1",
            Talosctl::V1_12 => "v1.12.0",
        }
    }

    /// The binary, built once per release for every test of this binary (the first caller builds, the
    /// others wait). A cold build takes minutes on 2 cores; a warm cache answers at once.
    pub(crate) fn binary(self) -> &'static Path {
        static V1_14: OnceLock<PathBuf> = OnceLock::new();
        static V1_12: OnceLock<PathBuf> = OnceLock::new();
        let built = match self {
            Talosctl::V1_14 => &V1_14,
            Talosctl::V1_12 => &V1_12,
        };
        built.get_or_init(|| build_talosctl(self.release()))
    }
}

/// Runs the build script for `release` (it caches the binary outside the repository) and returns the
/// path it prints as its last line of stdout. A talosctl that cannot be built fails the test, loudly.
fn build_talosctl(release: &str) -> PathBuf {
    testenv::script::binary(&testenv::script::path("build-talosctl.sh"), &[release])
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
    talosctl: Talosctl,
}

async fn cluster(name: &str, talos: &str, kubernetes: &str) -> Cluster {
    cluster_as(name, talos, kubernetes, "os:admin").await
}

async fn cluster_as(name: &str, talos: &str, kubernetes: &str, role: &str) -> Cluster {
    cluster_with(Talosctl::V1_14, name, talos, kubernetes, role).await
}

/// A 3 + 2 cluster of `talos`, and `talosctl` with a `role` talosconfig for it.
async fn cluster_with(
    talosctl: Talosctl,
    name: &str,
    talos: &str,
    kubernetes: &str,
    role: &str,
) -> Cluster {
    init();
    // Built before the simulator starts: nothing else runs on the runtime yet, so blocking is fine.
    talosctl.binary();
    let sim = start_sim(name, talos, kubernetes, Timings::fast()).await;
    talosctl_for(sim, talosctl, name, role)
}

/// A 3 + 2 cluster of `talos` with `timings`, every node ready.
async fn start_sim(name: &str, talos: &str, kubernetes: &str, timings: Timings) -> Simulator {
    let config = SimConfig::uniform(name, 3, 2, talos, kubernetes).with_timings(timings);
    let sim = Simulator::start(config).await.expect("simulator starts");
    for node in sim.nodes() {
        wait_snapshot(&sim, &node.name, "the node to be ready", |s| s.ready).await;
    }
    sim
}

/// `talosctl` with a `role` talosconfig for `sim`.
fn talosctl_for(sim: Simulator, talosctl: Talosctl, name: &str, role: &str) -> Cluster {
    let talosconfig = TempFile(std::env::temp_dir().join(format!(
        "tuc-talosctl-{name}-{}.talosconfig",
        std::process::id()
    )));
    sim.write_talosconfig(&talosconfig.0, role)
        .expect("write the talosconfig");
    Cluster {
        sim,
        talosconfig,
        talosctl,
    }
}

/// What one talosctl run printed, with a report to show when an assertion fails.
struct Run {
    stdout: String,
    stderr: String,
    report: String,
    success: bool,
}

impl Run {
    /// What talosctl printed, stdout and stderr together.
    fn output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// Asserts that talosctl printed each of `lines` (on stdout or stderr).
    fn assert_shows<S: AsRef<str>>(&self, lines: &[S]) {
        let output = self.output();
        for line in lines {
            let line = line.as_ref();
            assert!(output.contains(line), "no {line:?}\n{}", self.report);
        }
    }
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
        let mut command = tokio::process::Command::new(self.talosctl.binary());
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
    version_service_and_etcd(&c).await;
}

/// `version`, `service`, `etcd members` and `etcd status` on a cluster of [`LEGACY`].
async fn version_service_and_etcd(c: &Cluster) {
    // `version`: the client's tag and the node's, as Talos's version template prints them.
    let run = c.ok("cp-1", &["version"]).await;
    let (client, server) = run
        .stdout
        .split_once("Server:")
        .unwrap_or_else(|| panic!("no Server section\n{}", run.report));
    assert!(
        client.contains(&format!("Tag:         {}", c.talosctl.tag())),
        "{}",
        run.report
    );
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
    let output = run.output();
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
    let output = run.output();
    let ip = c.ip("worker-2");
    assert!(
        !output.contains("falling back to legacy"),
        "a 1.13 node has the LifecycleService\n{}",
        run.report
    );
    // The pull through ImageService, the installer through LifecycleService (their output printed
    // line by line), then the reboot, whose tracker prints the latest event every 100 ms: only its
    // final line is certain.
    run.assert_shows(&[
        format!("{ip}: pulled image {LIFECYCLE_TARGET}"),
        format!("{ip}: upgrade completed"),
        format!("\"{ip}\": post check passed"),
    ]);
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

// talosctl v1.12.0, the release of the machinery the Go conformance check uses. Its client differs from
// 1.14.1's where the simulator answers differently: it sends a `--nodes` list through the endpoint as
// one request with apid's `nodes` metadata (1.14.1 sends one call per node), its `upgrade` always makes
// the legacy `MachineService.Upgrade` call, on every generation (talos v1.12.0
// `cmd/talosctl/cmd/talos/upgrade.go` knows no ImageService or LifecycleService; Talos 1.13 and 1.14
// still serve the legacy call), and its health checks never skip Kubernetes. Like 1.14.1 it warns
// before `get` and `upgrade` when a node runs an older release than the client: here, 1.11.6.

/// The warning talosctl v1.12.0 prints (`helpers.ClientVersionCheck`) for a node on an older release.
fn older_server_warning(c: &Cluster, node: &str, talos: &str) -> String {
    format!(
        "WARNING: {}: server version {talos} is older than client version 1.12.0",
        c.ip(node)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_version_service_and_etcd_on_a_legacy_cluster() {
    let c = cluster_with(
        Talosctl::V1_12,
        "tctl12-basics",
        LEGACY,
        LEGACY_KUBERNETES,
        "os:admin",
    )
    .await;
    version_service_and_etcd(&c).await;

    // Two nodes in one request through cp-1: one Server entry per node, each stamped with its node.
    let run = c.ok("cp-1,worker-1", &["version"]).await;
    let server = run
        .stdout
        .split_once("Server:")
        .map(|(_, s)| s)
        .unwrap_or_else(|| panic!("no Server section\n{}", run.report));
    for name in ["cp-1", "worker-1"] {
        assert!(
            server.contains(&format!("NODE:        {}", c.ip(name))),
            "{}",
            run.report
        );
    }
    assert_eq!(
        server.matches(&format!("Tag:         v{LEGACY}")).count(),
        2,
        "{}",
        run.report
    );

    // `service` on a control plane and a worker at once: etcd runs on the control plane only.
    let run = c.ok("cp-2,worker-2", &["service"]).await;
    let rows = table(&run);
    let (cp, worker) = (c.ip("cp-2"), c.ip("worker-2"));
    let on = |node: &str, service: &str| {
        rows.iter()
            .find(|r| r["NODE"] == node && r["SERVICE"] == service)
            .map(|r| (r["STATE"].clone(), r["HEALTH"].clone()))
    };
    for node in [&cp, &worker] {
        assert_eq!(
            on(node, "kubelet"),
            Some(("Running".into(), "OK".into())),
            "{}",
            run.report
        );
    }
    assert_eq!(on(&cp, "etcd"), Some(("Running".into(), "OK".into())));
    assert_eq!(on(&worker, "etcd"), None, "{}", run.report);

    // `get` checks the client's version against the nodes' first: 1.11.6 is older than 1.12.0.
    let run = c.ok("worker-2", &["get", "nodename"]).await;
    assert!(
        run.stderr
            .contains(&older_server_warning(&c, "worker-2", LEGACY)),
        "{}",
        run.report
    );
    assert_eq!(cell(&table(&run), "ID", "nodename", "NODENAME"), "worker-2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_get_on_a_legacy_cluster() {
    let c = cluster_with(
        Talosctl::V1_12,
        "tctl12-get-legacy",
        LEGACY,
        LEGACY_KUBERNETES,
        "os:admin",
    )
    .await;
    get_resources(&c, LEGACY).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_get_on_a_lifecycle_cluster() {
    let c = cluster_with(
        Talosctl::V1_12,
        "tctl12-get-lifecycle",
        LIFECYCLE,
        LIFECYCLE_KUBERNETES,
        "os:admin",
    )
    .await;
    get_resources(&c, LIFECYCLE).await;
    // A node newer than the client draws no warning.
    let run = c.ok("cp-1", &["get", "ms"]).await;
    assert!(!run.stderr.contains("WARNING"), "{}", run.report);
}

/// A cluster for talosctl v1.12.0's `upgrade --wait`, whose nodes stay off for 2 s when they reboot.
///
/// v1.12.0's tracker, once the upgrade stops all services, reconnects to the node's event stream after
/// its 1 s retry interval asking for new events only (tail 0); only a reconnect refused while the node
/// is off makes it replay the node's events from the start. With [`Timings::fast`] a node is off for
/// 150 ms and ready 120 ms later, all inside that second, so the tracker waits for a boot it has
/// already missed until its 30-minute timeout. v1.14.1 resumes from the last event it saw (talos v1.14.1
/// `cmd/talosctl/pkg/talos/action/node.go`), and real machines take far longer than a second to reboot.
async fn cluster_for_1_12_upgrades(name: &str, talos: &str, kubernetes: &str) -> Cluster {
    init();
    Talosctl::V1_12.binary();
    let timings = Timings {
        reboot_ms: 2_000,
        ..Timings::fast()
    };
    let sim = start_sim(name, talos, kubernetes, timings).await;
    talosctl_for(sim, Talosctl::V1_12, name, "os:admin")
}

/// `talosctl upgrade --image <image>` (v1.12.0 waits by default) of `node`, which must end with the
/// tracker's post check; returns what it printed, stdout and stderr together.
async fn upgrade_1_12(c: &Cluster, node: &str, image: &str) -> String {
    let run = c.ok(node, &["upgrade", "--image", image]).await;
    let output = run.output();
    // No new API to try, so nothing falls back.
    assert!(!output.contains("falling back"), "{}", run.report);
    // The tracker prints the latest event every 100 ms, so only its last line is certain.
    assert!(
        output.contains(&format!("\"{}\": post check passed", c.ip(node))),
        "no post check\n{}",
        run.report
    );
    output
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_upgrade_a_worker_and_a_control_plane_on_a_legacy_cluster() {
    let c = cluster_for_1_12_upgrades("tctl12-upgrade-legacy", LEGACY, LEGACY_KUBERNETES).await;
    // A worker, then a control plane (not the endpoint), whose legacy call takes etcd's upgrade mutex
    // and checks the members' health before it is accepted.
    for node in ["worker-1", "cp-2"] {
        let output = upgrade_1_12(&c, node, LEGACY_TARGET).await;
        assert!(
            output.contains(&older_server_warning(&c, node, LEGACY)),
            "{output}"
        );
        assert_one_upgrade_and_one_reboot(&c, node, "/machine.MachineService/Upgrade");
        let snapshot = c.sim.node_snapshot(node).expect("the node");
        assert_eq!(snapshot.talos_version, "1.12.0", "{node}");
    }

    // Both upgraded nodes in one request: the new tag on each; the others stay.
    let run = c.ok("worker-1,cp-2", &["version"]).await;
    let server = run.stdout.split_once("Server:").map_or("", |(_, s)| s);
    assert_eq!(
        server.matches("Tag:         v1.12.0").count(),
        2,
        "{}",
        run.report
    );
    let run = c.ok("cp-1", &["get", "members"]).await;
    let rows = table(&run);
    for (name, os) in [
        ("worker-1", "Talos (v1.12.0)".to_string()),
        ("cp-2", "Talos (v1.12.0)".to_string()),
        ("cp-1", format!("Talos (v{LEGACY})")),
        ("worker-2", format!("Talos (v{LEGACY})")),
    ] {
        assert_eq!(cell(&rows, "ID", name, "OS"), os, "{}", run.report);
    }
    // cp-2 is back in etcd: three members, none a learner.
    let run = c.ok("cp-1", &["etcd", "members"]).await;
    let members = table(&run);
    let mut hostnames: Vec<&str> = members.iter().map(|m| m["HOSTNAME"].as_str()).collect();
    hostnames.sort_unstable();
    assert_eq!(hostnames, ["cp-1", "cp-2", "cp-3"], "{}", run.report);
    assert!(
        members.iter().all(|m| m["LEARNER"] == "false"),
        "{}",
        run.report
    );
}

/// On Talos 1.13 talosctl v1.12.0 still makes the legacy call, which the node serves: no ImageService
/// pull, no LifecycleService install.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_upgrade_makes_the_legacy_call_on_a_lifecycle_cluster() {
    let c = cluster_for_1_12_upgrades("tctl12-upgrade-lifecycle", LIFECYCLE, LIFECYCLE_KUBERNETES)
        .await;
    for node in ["worker-2", "cp-3"] {
        let output = upgrade_1_12(&c, node, LIFECYCLE_TARGET).await;
        // A node newer than the client draws no warning.
        assert!(!output.contains("WARNING"), "{output}");
        assert_one_upgrade_and_one_reboot(&c, node, "/machine.MachineService/Upgrade");
        let snapshot = c.sim.node_snapshot(node).expect("the node");
        assert_eq!(snapshot.talos_version, "1.13.5", "{node}");
    }
    let new_api: Vec<_> = c
        .sim
        .record()
        .into_iter()
        .filter(|call| {
            call.method.starts_with("/machine.LifecycleService/")
                || call.method.starts_with("/machine.ImageService/")
        })
        .map(|call| format!("{} {}", call.node, call.method))
        .collect();
    assert!(new_api.is_empty(), "{new_api:#?}");
    let run = c.ok("cp-1", &["get", "members"]).await;
    let rows = table(&run);
    assert_eq!(cell(&rows, "ID", "worker-2", "OS"), "Talos (v1.13.5)");
    assert_eq!(cell(&rows, "ID", "cp-3", "OS"), "Talos (v1.13.5)");
    assert_eq!(
        cell(&rows, "ID", "worker-1", "OS"),
        format!("Talos (v{LIFECYCLE})")
    );
}

/// A cluster as [`cluster_with`] makes it, mirrored into the health tests' API server
/// ([`mirrored::mirror`]: the caller holds its turn), with the kubeconfig its control planes hand out
/// pointing there; returns once every Node is Ready with its static pods.
async fn mirrored_cluster(
    talosctl: Talosctl,
    name: &str,
    talos: &str,
    kubernetes: &str,
) -> Cluster {
    init();
    talosctl.binary();
    let sim = start_sim(name, talos, kubernetes, Timings::fast()).await;
    mirrored::mirror(&sim, name).await;
    talosctl_for(sim, talosctl, name, "os:admin")
}

/// `talosctl -n cp-1 health --server=false` with the cluster's nodes named, waiting up to `wait`.
async fn health_client_side(c: &Cluster, wait: &str) -> Run {
    let ips = |control_plane: bool| {
        c.sim
            .nodes()
            .into_iter()
            .filter(|n| n.role.is_control_plane() == control_plane)
            .map(|n| n.address.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    c.run(
        "cp-1",
        &[
            "health",
            "--server=false",
            "--control-plane-nodes",
            &ips(true),
            "--worker-nodes",
            &ips(false),
            "--wait-timeout",
            wait,
        ],
    )
    .await
}

/// `talosctl health --server=false`: talosctl v1.12.0 runs every check itself against the nodes (through
/// the endpoint) and the cluster's Kubernetes API, and all pass. Unlike v1.14.1 it asks for no
/// KubeletConfig or BootstrapManifestsConfig first, and it never skips the Kubernetes checks (v1.14.1
/// skips them when the node answers `Kubeconfig` with FailedPrecondition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_health_client_side_passes_on_a_healthy_cluster() {
    let _turn = mirrored::take_turn().await;
    let c = mirrored_cluster(Talosctl::V1_12, "tctl12-health", LEGACY, LEGACY_KUBERNETES).await;
    let run = health_client_side(&c, "2m").await;
    assert!(run.success, "{}", run.report);
    run.assert_shows(&[
        "waiting for etcd to be healthy: OK",
        "waiting for etcd members to be consistent across nodes: OK",
        "waiting for etcd members to be control plane nodes: OK",
        "waiting for apid to be ready: OK",
        "waiting for all nodes memory sizes: OK",
        "waiting for kubelet to be healthy: OK",
        "waiting for all nodes to finish boot sequence: OK",
        "waiting for all k8s nodes to report: OK",
        "waiting for all control plane static pods to be running: OK",
        "waiting for all control plane components to be ready: OK",
        "waiting for all k8s nodes to report ready: OK",
        "waiting for all k8s nodes to report schedulable: OK",
    ]);
}

/// Without a workload kubeconfig a node answers `Kubeconfig` with FailedPrecondition: talosctl v1.14.1
/// then skips the Kubernetes checks (health.rs), v1.12.0 retries the first of them until its wait
/// ends and fails, the Talos checks before it passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn v1_12_health_without_a_workload_kubeconfig_fails_at_the_kubernetes_checks() {
    let c = cluster_with(
        Talosctl::V1_12,
        "tctl12-health-nokube",
        LEGACY,
        LEGACY_KUBERNETES,
        "os:admin",
    )
    .await;
    let run = health_client_side(&c, "8s").await;
    assert!(!run.success, "{}", run.report);
    run.assert_shows(&[
        "waiting for etcd to be healthy: OK",
        "waiting for kubelet to be healthy: OK",
        "waiting for all nodes to finish boot sequence: OK",
        "waiting for all k8s nodes to report: rpc error: code = FailedPrecondition",
    ]);
    assert!(
        !run.output()
            .contains("waiting for all k8s nodes to report: SKIP"),
        "{}",
        run.report
    );
}

/// `talosctl etcd snapshot` (talos v1.14.1 `cmd/talosctl/cmd/talos/etcd.go`) reads the simulator's
/// stream with Talos's own client: it saves the bytes the node recorded sending, and its own check of
/// etcd's appended SHA-256 (the size modulo 512 is 32) passes. (It then opens the file as a bbolt
/// database for its summary, which the simulator's stand-in is not, so the run's exit status is not
/// asserted.) A worker answers Talos's control-plane-only error.
#[tokio::test]
async fn etcd_snapshot_streams_to_talosctl() {
    let c = cluster("tctl-snapshot", LEGACY, LEGACY_KUBERNETES).await;
    let path =
        std::env::temp_dir().join(format!("tuc-talosctl-snapshot-{}.db", std::process::id()));
    let _cleanup = TempFile(path.clone());
    let shown = path.display().to_string();
    let run = c.run("cp-2", &["etcd", "snapshot", &shown]).await;
    let calls: Vec<_> = c
        .sim
        .record()
        .into_iter()
        .filter(|call| call.method == "/machine.MachineService/EtcdSnapshot")
        .collect();
    assert_eq!(calls.len(), 1, "{}", run.report);
    let size = calls[0].params["size"].as_u64().expect("size");
    run.assert_shows(&[format!("etcd snapshot saved to {shown:?} ({size} bytes)")]);
    let bytes = std::fs::read(&path).expect("the saved snapshot");
    assert_eq!(bytes.len() as u64, size);
    let sha: String = ring::digest::digest(&ring::digest::SHA256, &bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(calls[0].params["sha256"], sha);

    let worker = c.run("worker-1", &["etcd", "snapshot", &shown]).await;
    assert!(!worker.success, "{}", worker.report);
    worker.assert_shows(&["etcd snapshot is only available on control plane nodes"]);
}
