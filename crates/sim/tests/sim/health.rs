//! `talosctl health`, `events`, `dmesg`, `logs`, `kubeconfig` and `upgrade-k8s --dry-run` against the
//! simulator: the real talosctl v1.14.1 (built by scripts/build-talosctl.sh) where it matters what a
//! person reads, and the Rust client for the wire details (one-to-many stamping, error codes).
//!
//! The Kubernetes half of the health checks needs a real API server holding exactly the simulated
//! cluster's Nodes and static pods, so these tests mirror their clusters into one of their own (one per
//! test binary, mirrored.rs) and take turns on it.

use std::path::PathBuf;
use std::process::{Output, Stdio};

use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

use talos_api::proto::cluster;
use talos_api::proto::cluster::cluster_service_client::ClusterServiceClient;
use talos_api::proto::common;
use talos_api::proto::machine;
use talos_sim::{ClientRole, Fault, SimConfig, Simulator, Timings};
use tokio_stream::StreamExt;
use tonic::Code;

use crate::common::*;
use crate::mirrored;
use crate::talosctl::Talosctl;

/// A scratch directory for one test's files (talosconfig, written kubeconfigs).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tuc-health-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write");
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A simulated cluster mirrored into the tests' API server, with the kubeconfig its control planes
/// hand out pointing there, and an admin talosconfig on disk.
struct World {
    sim: Simulator,
    scratch: Scratch,
    talosconfig: PathBuf,
}

impl World {
    fn ip(&self, node: &str) -> String {
        self.sim
            .nodes()
            .into_iter()
            .find(|n| n.name == node)
            .unwrap_or_else(|| panic!("no node {node}"))
            .address
            .to_string()
    }

    fn ips(&self, control_plane: bool) -> Vec<String> {
        self.sim
            .nodes()
            .into_iter()
            .filter(|n| n.role.is_control_plane() == control_plane)
            .map(|n| n.address.to_string())
            .collect()
    }

    /// `talosctl --talosconfig … -e <cp-1> <args>`, not started yet.
    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut command = tokio::process::Command::new(Talosctl::V1_14.binary());
        command
            .arg("--talosconfig")
            .arg(&self.talosconfig)
            .args(["-e", &self.ip("cp-1")])
            .args(args)
            .env("HOME", &self.scratch.0)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        command
    }

    /// `talosctl … <args>` to its end. Awaited, never waited on blocking: the simulator answers it
    /// from this test's runtime.
    async fn talosctl(&self, args: &[&str]) -> Run {
        let output = tokio::time::timeout(Duration::from_secs(180), self.command(args).output())
            .await
            .unwrap_or_else(|_| panic!("talosctl {} did not finish", args.join(" ")))
            .expect("running talosctl");
        let run = Run::from(args, output);
        // Shown with --nocapture, and for a failing test.
        println!("$ talosctl {}\n{run}", run.args);
        run
    }

    /// `health` with the cluster's nodes named explicitly.
    async fn health(&self, server: bool, wait: &str) -> Run {
        let control_planes = self.ips(true).join(",");
        let workers = self.ips(false).join(",");
        let server = format!("--server={server}");
        self.talosctl(&[
            "-n",
            &self.ip("cp-1"),
            "health",
            &server,
            "--control-plane-nodes",
            &control_planes,
            "--worker-nodes",
            &workers,
            "--wait-timeout",
            wait,
        ])
        .await
    }
}

/// A finished talosctl run.
struct Run {
    args: String,
    success: bool,
    stdout: String,
    stderr: String,
}

impl Run {
    fn from(args: &[&str], output: Output) -> Self {
        Run {
            args: args.join(" "),
            success: output.status.success(),
            stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        }
    }

    fn ok(&self) -> &Self {
        assert!(self.success, "talosctl {} failed:\n{self}", self.args);
        self
    }

    fn failed(&self) -> &Self {
        assert!(!self.success, "talosctl {} succeeded:\n{self}", self.args);
        self
    }

    fn shows(&self, text: &str) -> &Self {
        assert!(
            self.stdout.contains(text) || self.stderr.contains(text),
            "talosctl {} does not show {text:?}:\n{self}",
            self.args
        );
        self
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "--- stdout\n{}--- stderr\n{}---",
            self.stdout, self.stderr
        )
    }
}

/// Start a 3+2 cluster on Talos 1.13 / Kubernetes 1.34.1, mirror it into the tests' API server and wait
/// until every node is registered Ready with its static pods.
async fn world(name: &str) -> World {
    init();
    let sim = Simulator::start(
        SimConfig::uniform(name, 3, 2, "1.13.0", "1.34.1").with_timings(Timings::fast()),
    )
    .await
    .expect("simulator");
    mirrored::mirror(&sim, name).await;
    let scratch = Scratch::new(name);
    let talosconfig = scratch.write("talosconfig", &sim.talosconfig(ClientRole::Admin));
    World {
        sim,
        scratch,
        talosconfig,
    }
}

#[tokio::test]
async fn talosctl_health_passes_on_a_healthy_cluster() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-ok").await;
    let ips = world.ips(true).into_iter().chain(world.ips(false));
    let discovered: Vec<String> = ips.map(|ip| format!("{ip:?}")).collect();
    world
        .health(true, "2m")
        .await
        .ok()
        .shows(&format!("discovered nodes: [{}]", discovered.join(" ")))
        .shows("waiting for etcd to be healthy: OK")
        .shows("waiting for etcd members to be consistent across nodes: OK")
        .shows("waiting for apid to be ready: OK")
        .shows("waiting for all nodes memory sizes: OK")
        .shows("waiting for kubelet to be healthy: OK")
        .shows("waiting for all nodes to finish boot sequence: OK")
        .shows("waiting for all k8s nodes to report: OK")
        .shows("waiting for all control plane static pods to be running: OK")
        .shows("waiting for all control plane components to be ready: OK")
        .shows("waiting for all k8s nodes to report ready: OK")
        .shows("waiting for all k8s nodes to report schedulable: OK");
}

/// talosctl runs the checks itself. Before its kubelet check it asks the node for
/// `KubeletConfigs.kubernetes.talos.dev` (talos v1.14.1 `pkg/cluster/check/default.go`
/// `kubeletDisabled`), and before its node readiness check for
/// `BootstrapManifestsConfigs.kubernetes.talos.dev` (`cniDisabledStatus`), which the simulator serves
/// as Talos does (a KubeletConfig `kubelet` on every node, a BootstrapManifestsConfig `manifests` with
/// `cniName: flannel` on control planes): without them talosctl stopped at "kubelet to be healthy" with
/// `PermissionDenied`.
#[tokio::test]
async fn talosctl_health_client_side_passes_on_a_healthy_cluster() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-client").await;
    world
        .health(false, "2m")
        .await
        .ok()
        .shows("waiting for etcd to be healthy: OK")
        .shows("waiting for apid to be ready: OK")
        .shows("waiting for all nodes memory sizes: OK")
        .shows("waiting for all nodes disk sizes: SKIP")
        .shows("waiting for kubelet to be healthy: OK")
        .shows("waiting for all nodes to finish boot sequence: OK")
        .shows("waiting for all k8s nodes to report: OK")
        .shows("waiting for all control plane static pods to be running: OK")
        .shows("waiting for all control plane components to be ready: OK")
        .shows("waiting for all k8s nodes to report ready: OK")
        .shows("waiting for all k8s nodes to report schedulable: OK");
}

#[tokio::test]
async fn talosctl_health_fails_while_a_member_of_etcd_is_unhealthy() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-etcd").await;
    world
        .sim
        .inject_fault("cp-2", Fault::EtcdUnhealthy)
        .expect("fault");
    let cp2 = world.ip("cp-2");

    world
        .health(false, "12s")
        .await
        .failed()
        .shows(&format!("{cp2}: service is not healthy: etcd"))
        .shows("context deadline exceeded");
    world
        .health(true, "12s")
        .await
        .failed()
        .shows(&format!("{cp2}: service is not healthy: etcd"))
        .shows("context deadline exceeded");
}

#[tokio::test]
async fn talosctl_health_fails_while_a_node_is_down() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-down").await;
    world
        .sim
        .inject_fault("worker-2", Fault::NeverReturns)
        .expect("fault");
    admin(&world.sim, "worker-2")
        .await
        .reboot(machine::RebootRequest::default())
        .await
        .expect("reboot");
    wait_snapshot(&world.sim, "worker-2", "worker-2 down", |s| s.down).await;
    let down = world.ip("worker-2");

    let refused =
        format!("error getting version from node \"{down}\": rpc error: code = Unavailable");
    world
        .health(false, "12s")
        .await
        .failed()
        .shows("waiting for etcd to be healthy: OK")
        .shows(&refused)
        .shows("connection refused");
    world.health(true, "12s").await.failed().shows(&refused);
}

#[tokio::test]
async fn talosctl_reads_events_dmesg_and_logs_through_one_endpoint() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-streams").await;
    let (cp2, worker) = (world.ip("cp-2"), world.ip("worker-1"));
    let nodes = format!("{cp2},{worker}");

    // `events` follows forever: read until both nodes showed their tail, then stop it.
    let mut child = world
        .command(&["-n", &nodes, "events", "--tail", "5"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("talosctl events");
    let mut reader = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut lines = Vec::new();
    let read = tokio::time::timeout(PATIENCE, async {
        while let Some(line) = reader.next_line().await.expect("read") {
            lines.push(line);
            let rows = |ip: &str| lines.iter().filter(|l| l.starts_with(ip)).count();
            if rows(&cp2) >= 5 && rows(&worker) >= 5 {
                break;
            }
        }
    })
    .await;
    let _ = child.kill().await;
    assert!(read.is_ok(), "events stopped short:\n{}", lines.join("\n"));
    let text = lines.join("\n");
    println!("$ talosctl -n {nodes} events --tail 5\n{text}");
    assert!(
        lines.first().is_some_and(|l| l.starts_with("NODE")),
        "events prints its table header:\n{text}"
    );
    for ip in [&cp2, &worker] {
        let rows = lines.iter().filter(|l| l.starts_with(ip.as_str())).count();
        assert!(rows >= 5, "five events of {ip} (its tail):\n{text}");
    }
    assert!(
        text.contains("machine.ServiceStateEvent") || text.contains("machine.MachineStatusEvent"),
        "events name their payload type:\n{text}"
    );

    world
        .talosctl(&["-n", &nodes, "dmesg"])
        .await
        .ok()
        .shows(&format!("{cp2}: kern:  notice: ["))
        .shows("Linux version")
        .shows(&format!("{worker}: user: warning: ["))
        .shows("[talos] service[kubelet](Running): Health check successful");

    world
        .talosctl(&["-n", &nodes, "logs", "kubelet"])
        .await
        .ok()
        .shows(&format!("{cp2}: {{\"ts\":"))
        .shows(&format!("{worker}: {{\"ts\":"))
        .shows("\"msg\":\"Started kubelet\"");
    world
        .talosctl(&["-n", &cp2, "logs", "machined", "--tail", "3"])
        .await
        .ok()
        .shows(&format!("{cp2}: [talos] "));
    world
        .talosctl(&["-n", &worker, "logs", "etcd"])
        .await
        .failed()
        .shows("log \"etcd\" was not registered");
}

#[tokio::test]
async fn talosctl_kubeconfig_and_upgrade_k8s_reach_the_workload_cluster() {
    let _turn = mirrored::take_turn().await;
    let world = world("health-kubeconfig").await;
    let cp1 = world.ip("cp-1");
    let target = world.scratch.0.join("out").join("kubeconfig");
    world
        .talosctl(&["-n", &cp1, "kubeconfig", target.to_str().expect("utf-8")])
        .await
        .ok();
    let written = std::fs::read_to_string(&target).expect("talosctl wrote the kubeconfig");
    assert!(
        written.contains(&format!("server: {}", mirrored::api_server().server())),
        "the written kubeconfig points at the workload API server:\n{}",
        written
            .lines()
            .filter(|l| l.contains("server"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    world
        .talosctl(&[
            "-n",
            &world.ip("worker-1"),
            "kubeconfig",
            world.scratch.0.to_str().expect("utf-8"),
        ])
        .await
        .failed()
        .shows("kubeconfig is only available on control plane nodes");

    world
        .talosctl(&["-n", &cp1, "upgrade-k8s", "--to", "1.35.0", "--dry-run"])
        .await
        .shows("automatically detected the lowest Kubernetes version 1.34.1");

    // Without a kubeconfig the node answers as Talos does when it cannot make one.
    world.sim.set_workload_kubeconfig(None).expect("unset");
    world
        .talosctl(&[
            "-n",
            &cp1,
            "kubeconfig",
            world.scratch.0.join("again").to_str().expect("utf-8"),
        ])
        .await
        .failed()
        .shows("FailedPrecondition");
}

// The wire details, with the Rust client (no talosctl, no API server).

async fn plain_cluster(name: &str) -> Simulator {
    init();
    Simulator::start(
        SimConfig::uniform(name, 2, 1, "1.13.0", "1.34.1").with_timings(Timings::fast()),
    )
    .await
    .expect("simulator")
}

fn with_nodes<T>(message: T, nodes: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("nodes", nodes.parse().expect("header"));
    request
}

/// Read a data stream to its end: (hostname, text) per message, errors as ("error", text).
async fn read_data(stream: &mut tonic::Streaming<common::Data>) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let read = tokio::time::timeout(PATIENCE, async {
        while let Some(item) = stream.next().await {
            let data = item.expect("stream item");
            let meta = data.metadata.clone().unwrap_or_default();
            if meta.error.is_empty() {
                out.push((
                    meta.hostname,
                    String::from_utf8_lossy(&data.bytes).into_owned(),
                ));
            } else {
                out.push((format!("error from {}", meta.hostname), meta.error));
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the stream did not end; so far: {out:#?}");
    out
}

#[tokio::test]
async fn streams_fan_out_to_the_nodes_header_each_message_stamped_with_its_node() {
    let sim = plain_cluster("fanout").await;
    let mut cp = admin(&sim, "cp-1").await;

    let mut stream = cp
        .dmesg(with_nodes(
            machine::DmesgRequest::default(),
            "cp-2,worker-1,10.255.0.1",
        ))
        .await
        .expect("dmesg")
        .into_inner();
    let lines = read_data(&mut stream).await;
    for node in ["cp-2", "worker-1"] {
        assert!(
            lines
                .iter()
                .any(|(host, text)| host == node && text.contains("Linux version")),
            "{node}'s kernel log: {lines:#?}"
        );
    }
    assert!(
        lines
            .iter()
            .any(|(host, text)| host == "error from 10.255.0.1"
                && text.starts_with("rpc error: code = Unavailable desc = connection error")),
        "an unreachable node adds one error message: {lines:#?}"
    );

    let mut events = cp
        .events(with_nodes(
            machine::EventsRequest {
                tail_events: 3,
                ..Default::default()
            },
            "cp-1,worker-1",
        ))
        .await
        .expect("events")
        .into_inner();
    let mut per_node = std::collections::BTreeMap::<String, usize>::new();
    while per_node.values().filter(|n| **n >= 4).count() < 2 {
        let event = tokio::time::timeout(PATIENCE, events.next())
            .await
            .expect("events keep coming")
            .expect("open")
            .expect("event");
        *per_node
            .entry(event.metadata.unwrap_or_default().hostname)
            .or_default() += 1;
    }
    assert_eq!(
        per_node.keys().cloned().collect::<Vec<_>>(),
        ["cp-1", "worker-1"],
        "hello + 3 events from each node, each stamped"
    );

    let mut logs = cp
        .logs(with_nodes(
            machine::LogsRequest {
                namespace: "system".into(),
                id: "etcd".into(),
                tail_lines: 2,
                ..Default::default()
            },
            "cp-2,worker-1",
        ))
        .await
        .expect("logs")
        .into_inner();
    let lines = read_data(&mut logs).await;
    assert_eq!(
        lines.iter().filter(|(host, _)| host == "cp-2").count(),
        2,
        "tail_lines 2: {lines:#?}"
    );
    assert!(
        lines
            .iter()
            .any(|(host, text)| host == "error from worker-1"
                && text == "rpc error: code = Unknown desc = log \"etcd\" was not registered"),
        "{lines:#?}"
    );

    // ImageService is not proxied one-to-many by apid.
    let mut images = images(&sim, "cp-1").await;
    let status = images
        .pull(with_nodes(
            machine::ImageServicePullRequest::default(),
            "cp-2",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status
            .message()
            .contains("one-2-many proxying is not supported")
    );
}

#[tokio::test]
async fn memory_containers_and_kubeconfig_answer_as_talos() {
    let sim = plain_cluster("reads").await;
    let mut cp = admin(&sim, "cp-1").await;
    let memory = cp
        .memory(with_nodes((), "cp-1,worker-1"))
        .await
        .expect("memory")
        .into_inner();
    let totals: Vec<(String, u64)> = memory
        .messages
        .iter()
        .map(|m| {
            (
                m.metadata.clone().unwrap_or_default().hostname,
                m.meminfo.unwrap_or_default().memtotal,
            )
        })
        .collect();
    assert_eq!(totals.len(), 2);
    // talosctl health wants 1698 MiB on a control plane and 874 MiB on a worker.
    assert!(
        totals.iter().all(|(_, kib)| kib / 1024 > 1698),
        "{totals:?}"
    );

    let containers = cp.logs_containers(()).await.expect("ids").into_inner();
    let ids = &containers.messages[0].ids;
    for id in ["apid", "etcd", "kubelet", "machined"] {
        assert!(ids.contains(&id.to_string()), "{ids:?}");
    }

    let status = cp.kubeconfig(()).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    let mut worker = admin(&sim, "worker-1").await;
    let status = worker.kubeconfig(()).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert_eq!(
        status.message(),
        "kubeconfig is only available on control plane nodes"
    );

    let refused = sim
        .set_workload_kubeconfig(Some(TOKEN_KUBECONFIG))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("user field \"client-certificate-data\" is not set"),
        "{refused}"
    );
}

/// A token kubeconfig, as `kubectl` users have them (talosctl refuses those).
const TOKEN_KUBECONFIG: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:6443\nusers:\n- name: u\n  user:\n    token: abc\ncontexts:\n- name: x\n  context:\n    cluster: c\n    user: u\ncurrent-context: x\n";

#[tokio::test]
async fn server_side_health_streams_talos_progress_lines() {
    let sim = plain_cluster("server-health").await;
    let channel = channel_as(&sim, "cp-1", ClientRole::Admin).await;
    let mut health = ClusterServiceClient::new(channel.clone());
    let mut stream = health
        .health_check(cluster::HealthCheckRequest {
            wait_timeout: Some(prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            cluster_info: None,
        })
        .await
        .expect("health check")
        .into_inner();
    let mut lines = Vec::new();
    let ended = tokio::time::timeout(PATIENCE, async {
        while let Some(item) = stream.next().await {
            lines.push(item.expect("progress").message);
        }
    })
    .await;
    assert!(ended.is_ok(), "the check did not finish: {lines:#?}");
    let ips: Vec<String> = sim
        .nodes()
        .into_iter()
        .map(|n| format!("{:?}", n.address.to_string()))
        .collect();
    assert_eq!(lines[0], format!("discovered nodes: [{}]", ips.join(" ")));
    for line in [
        "waiting for etcd to be healthy: ...",
        "waiting for etcd to be healthy: OK",
        "waiting for all nodes memory sizes: OK",
        "waiting for all nodes disk sizes: SKIP",
        "waiting for all nodes to finish boot sequence: OK",
        // No workload kubeconfig: Kubeconfig answers FailedPrecondition and Kubernetes is skipped.
        "waiting for all k8s nodes to report: SKIP",
        "waiting for all k8s nodes to report schedulable: SKIP",
    ] {
        assert!(lines.iter().any(|l| l == line), "{line:?} in {lines:#?}");
    }

    let mut on_worker = ClusterServiceClient::new(channel);
    let mut request = tonic::Request::new(cluster::HealthCheckRequest::default());
    request
        .metadata_mut()
        .insert("node", "worker-1".parse().expect("header"));
    let status = on_worker.health_check(request).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
    assert_eq!(
        status.message(),
        "cluster health check is only available on control plane nodes"
    );
}
