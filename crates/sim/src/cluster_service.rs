//! `cluster.ClusterService.HealthCheck`: the server side of `talosctl health` (its default, `--server`).
//!
//! A control plane runs the cluster checks itself and streams their progress, as machined does (talos
//! v1.14.1 `internal/app/machined/internal/server/v1alpha1/v1alpha1_cluster.go`): first
//! `discovered nodes: [...]`, then one line per change of a check's state, worded as talosctl's own
//! reporter words them (`waiting for etcd to be healthy: OK`). The checks are Talos's default cluster
//! checks (`pkg/cluster/check/default.go`), in the same order and with the same error texts; each polls
//! until it passes, is skipped, or the request's `wait_timeout` runs out, and then the call ends with
//! `DeadlineExceeded` ("context deadline exceeded") after the check's last error.
//!
//! Talos runs them through its own API with the caller's roles; the simulator asks the simulated nodes
//! directly, through the same one-to-one forwarding rules (a node that is down or unknown answers as
//! apid would). Where Talos reads a resource the simulator does not serve (`VolumeStatus` for the disk
//! size check, `Diagnostic`), the check is skipped, as Talos skips it on nodes without that resource.
//! The kubelet and CNI are treated as configured, as on every simulated node. The Kubernetes checks use
//! the workload kubeconfig the control plane would hand out ([`crate::kubeconfig`]); without one they
//! are skipped, as Talos skips them when `Kubeconfig` answers `FailedPrecondition`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node as K8sNode, Pod};
use kube::api::{Api, ListParams};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::machine_service::MachineApi;
use super::node::Node;
use super::node_resources::{
    APISERVER_CONFIG_TYPE, CONTROLLER_MANAGER_CONFIG_TYPE, CONTROLPLANE_NS, K8S_NS,
    SCHEDULER_CONFIG_TYPE, STATIC_POD_STATUS_TYPE, type_info,
};
use super::routing::{ApiContext, MessageStream, Proxy, fan_out_stream, grpc_error_text};
use talos_api::proto::cluster;
use talos_api::proto::cluster::cluster_service_server::ClusterService;

pub(crate) const HEALTH_CHECK: &str = "/cluster.ClusterService/HealthCheck";

/// `k8s.LabelNodeRoleControlPlane`.
const CONTROL_PLANE_LABEL: &str = "node-role.kubernetes.io/control-plane";

#[derive(Debug, Clone)]
pub(crate) struct ClusterApi {
    ctx: ApiContext,
}

impl ClusterApi {
    pub(crate) fn new(ctx: ApiContext) -> Self {
        ClusterApi { ctx }
    }

    /// Start the checks on `node` (the node machined runs on).
    fn health_check_on(
        &self,
        node: Arc<Node>,
        req: &cluster::HealthCheckRequest,
    ) -> Result<MessageStream<cluster::HealthCheckProgress>, Status> {
        // machinehelper.CheckControlplane.
        if !node.role.is_control_plane() {
            return Err(Status::unimplemented(
                "cluster health check is only available on control plane nodes",
            ));
        }
        // A missing timeout is zero, as in Go: the checks run out at once.
        let wait = req
            .wait_timeout
            .and_then(|d| Duration::try_from(d).ok())
            .unwrap_or_default();
        let info = ClusterInfo::build(&self.ctx, req.cluster_info.as_ref())?;
        let checker = Checker {
            local: ApiContext::new(self.ctx.cluster.clone(), node.clone()),
            machine: MachineApi::new(ApiContext::new(self.ctx.cluster.clone(), node.clone())),
            info,
            force_endpoint: req
                .cluster_info
                .as_ref()
                .map(|c| c.force_endpoint.clone())
                .unwrap_or_default(),
            kube: Mutex::new(None),
        };
        let boot = node.boot_token();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            let deadline = Instant::now() + wait;
            tokio::select! {
                _ = boot.cancelled() => {
                    let _ = tx.send(Err(Status::unavailable("node is rebooting"))).await;
                }
                _ = tx.closed() => {}
                () = checker.run(&tx, deadline) => {}
            }
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }
}

#[tonic::async_trait]
impl ClusterService for ClusterApi {
    type HealthCheckStream = MessageStream<cluster::HealthCheckProgress>;

    async fn health_check(
        &self,
        request: Request<cluster::HealthCheckRequest>,
    ) -> Result<Response<Self::HealthCheckStream>, Status> {
        let targets = self.ctx.route(&request, HEALTH_CHECK, Proxy::Streaming)?;
        let req = request.into_inner();
        let stream = fan_out_stream(targets, |node| {
            let stream = self.health_check_on(node, &req);
            async move { stream }
        })
        .await?;
        Ok(Response::new(stream))
    }
}

/// A node as the checks know it: its internal IP and every IP it has.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct NodeInfo {
    internal: IpAddr,
    ips: Vec<IpAddr>,
}

impl NodeInfo {
    fn of(ip: IpAddr) -> Self {
        NodeInfo {
            internal: ip,
            ips: vec![ip],
        }
    }
}

/// `cluster.Info`: the nodes to check, by type.
#[derive(Debug, Clone)]
struct ClusterInfo {
    control_planes: Vec<NodeInfo>,
    workers: Vec<NodeInfo>,
}

impl ClusterInfo {
    /// The nodes named in the request, or, when it names none, the cluster's members (Talos asks its
    /// discovery service; every simulated node is a member).
    fn build(ctx: &ApiContext, request: Option<&cluster::ClusterInfo>) -> Result<Self, Status> {
        let parse = |ips: &[String]| -> Result<Vec<NodeInfo>, Status> {
            ips.iter()
                .map(|ip| {
                    ip.parse::<IpAddr>().map(NodeInfo::of).map_err(|_| {
                        Status::unknown(format!("ParseAddr({ip:?}): unable to parse IP"))
                    })
                })
                .collect()
        };
        let (control_planes, workers) = match request {
            Some(info) if !info.control_plane_nodes.is_empty() || !info.worker_nodes.is_empty() => {
                (
                    parse(&info.control_plane_nodes)?,
                    parse(&info.worker_nodes)?,
                )
            }
            _ => {
                let of_role = |control_plane: bool| {
                    ctx.cluster
                        .nodes
                        .iter()
                        .filter(|n| n.role.is_control_plane() == control_plane)
                        .map(|n| NodeInfo::of(IpAddr::V4(n.address)))
                        .collect()
                };
                (of_role(true), of_role(false))
            }
        };
        Ok(ClusterInfo {
            control_planes,
            workers,
        })
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.control_planes
            .iter()
            .chain(&self.workers)
            .cloned()
            .collect()
    }

    fn internal_ips(nodes: &[NodeInfo]) -> Vec<String> {
        nodes.iter().map(|n| n.internal.to_string()).collect()
    }

    /// Whether `ip` is a control plane or a worker here.
    fn is_control_plane(&self, ip: &str) -> Option<bool> {
        let is = |list: &[NodeInfo]| list.iter().any(|n| n.internal.to_string() == ip);
        if is(&self.control_planes) {
            Some(true)
        } else if is(&self.workers) {
            Some(false)
        } else {
            None
        }
    }
}

/// Why a check did not pass this time.
enum Failure {
    /// `conditions.ErrSkipAssertion`: the check does not apply.
    Skip,
    Error(String),
}

impl From<String> for Failure {
    fn from(error: String) -> Self {
        Failure::Error(error)
    }
}

type Outcome = Result<(), Failure>;

/// The checks of `check.DefaultClusterChecks()`, in order, with their descriptions and poll intervals.
#[derive(Debug, Clone, Copy)]
enum Check {
    EtcdHealthy,
    EtcdConsistent,
    EtcdControlPlanes,
    ApidReady,
    MemorySizes,
    DiskSizes,
    NoDiagnostics,
    KubeletHealthy,
    Booted,
    K8sNodesReported,
    StaticPods,
    ControlPlaneComponents,
    K8sNodesReady,
    KubeProxy,
    CoreDns,
    K8sNodesSchedulable,
}

const CHECKS: [Check; 16] = [
    Check::EtcdHealthy,
    Check::EtcdConsistent,
    Check::EtcdControlPlanes,
    Check::ApidReady,
    Check::MemorySizes,
    Check::DiskSizes,
    Check::NoDiagnostics,
    Check::KubeletHealthy,
    Check::Booted,
    Check::K8sNodesReported,
    Check::StaticPods,
    Check::ControlPlaneComponents,
    Check::K8sNodesReady,
    Check::KubeProxy,
    Check::CoreDns,
    Check::K8sNodesSchedulable,
];

impl Check {
    fn description(self) -> &'static str {
        match self {
            Check::EtcdHealthy => "etcd to be healthy",
            Check::EtcdConsistent => "etcd members to be consistent across nodes",
            Check::EtcdControlPlanes => "etcd members to be control plane nodes",
            Check::ApidReady => "apid to be ready",
            Check::MemorySizes => "all nodes memory sizes",
            Check::DiskSizes => "all nodes disk sizes",
            Check::NoDiagnostics => "no diagnostics",
            Check::KubeletHealthy => "kubelet to be healthy",
            Check::Booted => "all nodes to finish boot sequence",
            Check::K8sNodesReported => "all k8s nodes to report",
            Check::StaticPods => "all control plane static pods to be running",
            Check::ControlPlaneComponents => "all control plane components to be ready",
            Check::K8sNodesReady => "all k8s nodes to report ready",
            Check::KubeProxy => "kube-proxy to report ready",
            Check::CoreDns => "coredns to report ready",
            Check::K8sNodesSchedulable => "all k8s nodes to report schedulable",
        }
    }

    fn interval(self) -> Duration {
        match self {
            // "give more time per each attempt, as this check is going to build and cache kubeconfig"
            Check::K8sNodesReported => Duration::from_secs(30),
            _ => Duration::from_secs(5),
        }
    }
}

/// Runs the checks for one `HealthCheck` call, as the node's local client would.
struct Checker {
    /// The node machined runs on, as the endpoint its local client talks to.
    local: ApiContext,
    machine: MachineApi,
    info: ClusterInfo,
    force_endpoint: String,
    /// The Kubernetes client, once built (`cluster.KubernetesClient` caches it).
    kube: Mutex<Option<kube::Client>>,
}

type Progress = mpsc::Sender<Result<cluster::HealthCheckProgress, Status>>;

/// A node that answered `Version`: its IP as asked, the node, its platform mode.
type Answered = (String, Arc<Node>, String);

impl Checker {
    async fn run(&self, tx: &Progress, deadline: Instant) {
        let send = |message: String| async move {
            let _ = tx
                .send(Ok(cluster::HealthCheckProgress {
                    metadata: None,
                    message,
                }))
                .await;
        };
        send(format!(
            "discovered nodes: {}",
            go_quoted(&ClusterInfo::internal_ips(&self.info.nodes()))
        ))
        .await;
        // healthReporter: a line is sent when it differs from the previous one.
        let mut last = String::new();
        for check in CHECKS {
            let mut report = |status: String| {
                let line = format!("waiting for {}: {status}", check.description())
                    .trim()
                    .to_string();
                (line != last).then(|| {
                    last = line.clone();
                    line
                })
            };
            if Instant::now() >= deadline {
                let _ = tx
                    .send(Err(Status::deadline_exceeded("context deadline exceeded")))
                    .await;
                return;
            }
            if let Some(line) = report("...".to_string()) {
                send(line).await;
            }
            loop {
                let started = Instant::now();
                let run_until = (started + check.interval()).min(deadline);
                let outcome = match tokio::time::timeout_at(run_until, self.assert(check)).await {
                    Ok(outcome) => outcome,
                    Err(_) => Err(Failure::Error("context deadline exceeded".to_string())),
                };
                let status = match &outcome {
                    Ok(()) => "OK".to_string(),
                    Err(Failure::Skip) => "SKIP".to_string(),
                    Err(Failure::Error(error)) => error.clone(),
                };
                if let Some(line) = report(status) {
                    send(line).await;
                }
                if !matches!(outcome, Err(Failure::Error(_))) {
                    break;
                }
                let next = started + check.interval();
                if next >= deadline {
                    tokio::time::sleep_until(deadline).await;
                    let _ = tx
                        .send(Err(Status::deadline_exceeded("context deadline exceeded")))
                        .await;
                    return;
                }
                tokio::time::sleep_until(next).await;
            }
        }
    }

    async fn assert(&self, check: Check) -> Outcome {
        match check {
            Check::EtcdHealthy => self.service_health("etcd"),
            Check::EtcdConsistent => self.etcd_consistent(),
            Check::EtcdControlPlanes => self.etcd_control_planes(),
            Check::ApidReady => self.apid_ready(),
            Check::MemorySizes => self.memory_sizes(),
            Check::DiskSizes => self.unserved_resource("VolumeStatuses.block.talos.dev"),
            Check::NoDiagnostics => self.unserved_resource("Diagnostics.runtime.talos.dev"),
            Check::KubeletHealthy => self.service_health("kubelet"),
            Check::Booted => self.booted(),
            Check::K8sNodesReported => self.k8s_nodes_reported().await,
            Check::StaticPods => self.static_pods(),
            Check::ControlPlaneComponents => self.control_plane_components().await,
            Check::K8sNodesReady => self.k8s_nodes_ready().await,
            Check::KubeProxy => self.kube_proxy().await,
            Check::CoreDns => self.coredns().await,
            Check::K8sNodesSchedulable => self.k8s_nodes_schedulable().await,
        }
    }

    /// A call forwarded to `ip` by the local apid: the node, or the error the caller would get.
    fn reach(&self, ip: &str) -> Result<Arc<Node>, Status> {
        self.local.forward_to(ip)
    }

    /// `check.ServiceHealthAssertion` on the control planes (`service.go`).
    fn service_health(&self, service: &str) -> Outcome {
        let nodes = ClusterInfo::internal_ips(&self.info.control_planes);
        let mut infos = Vec::new();
        for ip in &nodes {
            let node = self.reach(ip).map_err(|status| {
                format!(
                    "error getting service info for service {service:?} from node {ip:?}: {}",
                    grpc_error_text(&status)
                )
            })?;
            let list = self.machine.service_list_of(&node);
            infos.extend(
                list.messages
                    .into_iter()
                    .flat_map(|m| m.services)
                    .filter(|s| s.id == service)
                    .map(|s| (ip.clone(), s)),
            );
        }
        if infos.len() != nodes.len() {
            return Err(format!(
                "expected a response with {} node(s), got {}",
                nodes.len(),
                infos.len()
            )
            .into());
        }
        infos.sort_by(|a, b| a.0.cmp(&b.0));
        let mut errors = Vec::new();
        for (ip, info) in infos {
            let events = info.events.map(|e| e.events).unwrap_or_default();
            let Some(last) = events.last() else {
                errors.push(format!(
                    "{ip}: no events recorded yet for service {service:?}"
                ));
                continue;
            };
            if last.state != "Running" {
                errors.push(format!(
                    "{ip}: service {service:?} not in expected state \"Running\": current state [{}] {}",
                    last.state, last.msg
                ));
                continue;
            }
            if !info.health.is_some_and(|h| h.healthy) {
                errors.push(format!("{ip}: service is not healthy: {service}"));
            }
        }
        multierror(errors)
    }

    /// `check.EtcdConsistentAssertion` (`etcd.go`).
    fn etcd_consistent(&self) -> Outcome {
        let mut responses = Vec::new();
        for ip in ClusterInfo::internal_ips(&self.info.control_planes) {
            let members = self
                .reach(&ip)
                .and_then(|node| self.machine.etcd_member_list_of(&node))
                .map_err(|status| {
                    format!(
                        "error getting etcd member list from node {ip:?}: {}",
                        grpc_error_text(&status)
                    )
                })?;
            let Some(first) = members.messages.into_iter().next() else {
                return Err(format!("node {ip:?}: no messages returned").into());
            };
            responses.push((ip, first.members));
        }
        responses.sort_by(|a, b| a.0.cmp(&b.0));
        let key =
            |m: &talos_api::proto::machine::EtcdMember| (m.hostname.clone(), m.id, m.is_learner);
        let mut known = BTreeSet::new();
        for (i, (ip, members)) in responses.iter().enumerate() {
            if i == 0 {
                known = members.iter().map(key).collect();
                continue;
            }
            if members.len() != known.len() {
                let expected: Vec<String> = known.iter().map(|k| k.0.clone()).collect();
                let actual: Vec<String> = members.iter().map(|m| m.hostname.clone()).collect();
                return Err(format!(
                    "{ip}: expected to have {} members, got {}",
                    go_list(&expected),
                    go_list(&actual)
                )
                .into());
            }
            if let Some(unexpected) = members.iter().find(|m| !known.contains(&key(m))) {
                return Err(
                    format!("{ip}: found unexpected etcd member {}", unexpected.hostname).into(),
                );
            }
        }
        Ok(())
    }

    /// `check.EtcdControlPlaneNodesAssertion` (`etcd.go`): asked of the local node.
    fn etcd_control_planes(&self) -> Outcome {
        let list = self
            .machine
            .etcd_member_list_of(&self.local.endpoint)
            .map_err(|status| grpc_error_text(&status))?;
        let mut member_ips = Vec::new();
        for member in list.messages.iter().flat_map(|m| &m.members) {
            for url in &member.peer_urls {
                let host = url
                    .split_once("://")
                    .map_or(url.as_str(), |(_, rest)| rest)
                    .split('/')
                    .next()
                    .unwrap_or_default();
                let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
                member_ips.push(host.trim_matches(['[', ']']).to_string());
            }
        }
        let control_planes: Vec<String> = self
            .info
            .control_planes
            .iter()
            .flat_map(|n| n.ips.iter().map(IpAddr::to_string))
            .collect();
        if member_ips.iter().all(|ip| control_planes.contains(ip)) {
            Ok(())
        } else {
            Err(format!(
                "etcd member ips {} are not subset of control plane node ips {}",
                go_quoted(&member_ips),
                go_quoted(&control_planes)
            )
            .into())
        }
    }

    /// Version from every node (`check.ApidReadyAssertion`, and `getNonContainerNodes` of the size
    /// checks): the nodes that answered with their platform mode, and the errors joined.
    fn versions(&self) -> (Vec<Answered>, Vec<String>) {
        let mut answered = Vec::new();
        let mut errors = Vec::new();
        for ip in ClusterInfo::internal_ips(&self.info.nodes()) {
            match self.reach(&ip) {
                Ok(node) => {
                    let mode = self
                        .machine
                        .version_of(&node)
                        .messages
                        .first()
                        .and_then(|m| m.platform.as_ref())
                        .map(|p| p.mode.clone())
                        .unwrap_or_default();
                    answered.push((ip, node, mode));
                }
                Err(status) => errors.push(format!(
                    "error getting version from node {ip:?}: {}",
                    grpc_error_text(&status)
                )),
            }
        }
        (answered, errors)
    }

    fn apid_ready(&self) -> Outcome {
        let (_, errors) = self.versions();
        joined(errors)
    }

    /// `check.AllNodesMemorySizes` (`nodes.go`), against `minimal.Memory`.
    fn memory_sizes(&self) -> Outcome {
        let (answered, errors) = self.versions();
        joined(errors)?;
        const MIB: u64 = 1024 * 1024;
        let mut problems = Vec::new();
        for (ip, node, mode) in answered {
            if mode == "container" {
                continue;
            }
            let Some(control_plane) = self.info.is_control_plane(&ip) else {
                return Err(format!("unexpected node {ip:?} in response").into());
            };
            let minimum = if control_plane {
                1848 * MIB - 150 * MIB
            } else {
                1024 * MIB - 150 * MIB
            };
            let total = self
                .machine
                .memory_of(&node)
                .messages
                .first()
                .and_then(|m| m.meminfo)
                .map_or(0, |m| m.memtotal * 1024);
            if total < minimum {
                problems.push(format!(
                    "node {ip:?} does not meet memory requirements: expected at least {} MiB, actual {} MiB",
                    minimum / MIB,
                    total / MIB
                ));
            }
        }
        multierror(problems)
    }

    /// A check that reads a resource type: skipped when the simulator does not serve the type
    /// (Talos skips on `PermissionDenied`), passed otherwise (the simulated disks are large enough
    /// and there are no diagnostics).
    fn unserved_resource(&self, type_: &str) -> Outcome {
        let (_, errors) = self.versions();
        joined(errors)?;
        if type_info(type_).is_none() {
            Err(Failure::Skip)
        } else {
            Ok(())
        }
    }

    /// `check.AllNodesBootedAssertion` (`events.go`): every node's MachineStatus stage.
    fn booted(&self) -> Outcome {
        let mut stages: BTreeMap<(i32, &'static str), Vec<String>> = BTreeMap::new();
        for ip in ClusterInfo::internal_ips(&self.info.nodes()) {
            let node = self.reach(&ip).map_err(|status| grpc_error_text(&status))?;
            let stage = node.read(|s| s.stage);
            stages
                .entry((stage.to_resource() as i32, stage.yaml_name()))
                .or_default()
                .push(ip);
        }
        if stages.keys().any(|(_, name)| *name == "unknown") {
            // Talos keeps waiting for a node that has not reported yet.
            return Err("context deadline exceeded".to_string().into());
        }
        stages.retain(|(_, name), _| *name != "running");
        if stages.is_empty() {
            return Ok(());
        }
        let message: Vec<String> = stages
            .into_iter()
            .map(|((_, name), mut ips)| {
                ips.sort();
                format!("{name}: {}", go_list(&ips))
            })
            .collect();
        Err(format!("nodes are not running: {}", message.join(", ")).into())
    }

    /// `check.K8sControlPlaneStaticPods` (`kubernetes.go`).
    fn static_pods(&self) -> Outcome {
        for ip in ClusterInfo::internal_ips(&self.info.control_planes) {
            let node = self.reach(&ip).map_err(|status| {
                format!(
                    "error listing static pods config for node {ip}: {}",
                    grpc_error_text(&status)
                )
            })?;
            let mut expected = BTreeSet::new();
            for (id, type_) in [
                ("kube-system/kube-apiserver", APISERVER_CONFIG_TYPE),
                (
                    "kube-system/kube-controller-manager",
                    CONTROLLER_MANAGER_CONFIG_TYPE,
                ),
                ("kube-system/kube-scheduler", SCHEDULER_CONFIG_TYPE),
            ] {
                if !node.store.list(CONTROLPLANE_NS, type_).is_empty() {
                    expected.insert(id);
                }
            }
            for status in node.store.list(K8S_NS, STATIC_POD_STATUS_TYPE) {
                expected.retain(|pod| !status.key().id.starts_with(pod));
            }
            if !expected.is_empty() {
                let missing: Vec<String> = expected.into_iter().map(str::to_string).collect();
                return Err(
                    format!("missing static pods on node {ip}: {}", go_list(&missing)).into(),
                );
            }
        }
        Ok(())
    }

    /// `cluster.KubernetesClient.K8sClient`: the kubeconfig the local control plane hands out.
    /// Without one, `Kubeconfig` answers `FailedPrecondition` and the Kubernetes checks are skipped.
    async fn k8s(&self) -> Result<kube::Client, Failure> {
        if let Some(client) = self.kube.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Ok(client);
        }
        let Some(text) = self.local.cluster.workload_kubeconfig.get() else {
            return Err(Failure::Skip);
        };
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)
            .map_err(|e| format!("error parsing kubeconfig: {e}"))?;
        let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .map_err(|e| e.to_string())?;
        if !self.force_endpoint.is_empty() {
            let endpoint = self
                .force_endpoint
                .strip_prefix("https://")
                .unwrap_or(&self.force_endpoint);
            let endpoint = if endpoint.contains(':') {
                endpoint.to_string()
            } else {
                format!("{endpoint}:6443")
            };
            config.cluster_url = format!("https://{endpoint}")
                .parse()
                .map_err(|e| format!("{e}"))?;
        }
        let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
        *self.kube.lock().unwrap_or_else(|p| p.into_inner()) = Some(client.clone());
        Ok(client)
    }

    async fn k8s_nodes(&self) -> Result<Vec<K8sNode>, Failure> {
        let client = self.k8s().await?;
        Api::<K8sNode>::all(client)
            .list(&ListParams::default())
            .await
            .map(|list| list.items)
            .map_err(|e| Failure::Error(e.to_string()))
    }

    /// `check.K8sAllNodesReportedAssertion`.
    async fn k8s_nodes_reported(&self) -> Outcome {
        let nodes = self.k8s_nodes().await?;
        let actual = nodes.iter().map(node_info).collect::<Result<Vec<_>, _>>()?;
        nodes_match(&self.info.nodes(), actual)
    }

    /// `check.K8sFullControlPlaneAssertion`.
    async fn control_plane_components(&self) -> Outcome {
        let nodes = self.k8s_nodes().await?;
        let client = self.k8s().await?;
        let actual = nodes
            .iter()
            .filter(|n| {
                n.metadata
                    .labels
                    .as_ref()
                    .is_some_and(|l| l.contains_key(CONTROL_PLANE_LABEL))
            })
            .map(node_info)
            .collect::<Result<Vec<_>, _>>()?;
        let found = actual.len();
        nodes_match(&self.info.control_planes, actual)?;
        let daemonsets = Api::<DaemonSet>::namespaced(client.clone(), "kube-system")
            .list(
                &ListParams::default()
                    .labels("k8s-app in (kube-apiserver,kube-scheduler,kube-controller-manager)"),
            )
            .await
            .map_err(|e| e.to_string())?;
        for ds in daemonsets.items {
            let name = ds.metadata.name.clone().unwrap_or_default();
            let status = ds.status.unwrap_or_default();
            let desired = status.desired_number_scheduled;
            for (what, value) in [
                ("current number scheduled", status.current_number_scheduled),
                ("number available", status.number_available.unwrap_or(0)),
                ("number ready", status.number_ready),
            ] {
                if value != desired {
                    return Err(
                        format!("expected {what} for {name} to be {desired}, got {value}").into(),
                    );
                }
            }
        }
        let pods = Api::<Pod>::namespaced(client, "kube-system");
        for app in [
            "kube-apiserver",
            "kube-scheduler",
            "kube-controller-manager",
        ] {
            let list = pods
                .list(&ListParams::default().labels(&format!("k8s-app = {app}")))
                .await
                .map_err(|e| format!("error listing pods for app {app}: {e}"))?;
            let items: Vec<Pod> = list
                .items
                .into_iter()
                .filter(|p| {
                    !p.metadata.annotations.as_ref().is_some_and(|a| {
                        a.contains_key("checkpointer.alpha.coreos.com/checkpoint-of")
                    })
                })
                .collect();
            if items.len() != found {
                return Err(format!(
                    "expected number of pods for {app} to be {found}, got {}",
                    items.len()
                )
                .into());
            }
            let not_ready: Vec<String> = items
                .iter()
                .filter(|p| pod_condition(p, "Ready").is_some_and(|s| s != "True"))
                .map(|p| p.metadata.name.clone().unwrap_or_default())
                .collect();
            if !not_ready.is_empty() {
                return Err(
                    format!("some pods are not ready for {app}: {}", go_list(&not_ready)).into(),
                );
            }
        }
        Ok(())
    }

    /// `check.K8sAllNodesReadyAssertion`.
    async fn k8s_nodes_ready(&self) -> Outcome {
        let not_ready: Vec<String> = self
            .k8s_nodes()
            .await?
            .iter()
            .filter(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
                    .is_some_and(|c| c.status != "True")
            })
            .map(|n| n.metadata.name.clone().unwrap_or_default())
            .collect();
        if not_ready.is_empty() {
            Ok(())
        } else {
            Err(format!("some nodes are not ready: {}", go_list(&not_ready)).into())
        }
    }

    /// `check.K8sAllNodesSchedulableAssertion` (which names the first one it finds).
    async fn k8s_nodes_schedulable(&self) -> Outcome {
        let unschedulable = self
            .k8s_nodes()
            .await?
            .into_iter()
            .find(|n| n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true));
        match unschedulable {
            None => Ok(()),
            Some(node) => Err(format!(
                "some nodes are not schedulable: [{}]",
                node.metadata.name.unwrap_or_default()
            )
            .into()),
        }
    }

    /// kube-proxy: skipped unless its DaemonSet exists with replicas.
    async fn kube_proxy(&self) -> Outcome {
        let client = self.k8s().await?;
        let list = Api::<DaemonSet>::namespaced(client, "kube-system")
            .list(&ListParams::default().labels("k8s-app=kube-proxy"))
            .await
            .map_err(|e| e.to_string())?;
        let replicas = match list.items.first() {
            Some(ds) => ds.status.as_ref().map_or(0, |s| s.desired_number_scheduled),
            None => return Err(Failure::Skip),
        };
        if replicas == 0 {
            return Err(Failure::Skip);
        }
        self.pods_ready(replicas, "k8s-app=kube-proxy").await
    }

    /// CoreDNS: skipped unless its Deployment exists.
    async fn coredns(&self) -> Outcome {
        let client = self.k8s().await?;
        let list = Api::<Deployment>::namespaced(client, "kube-system")
            .list(&ListParams::default().labels("k8s-app=kube-dns"))
            .await
            .map_err(|e| e.to_string())?;
        let Some(deployment) = list.items.first() else {
            return Err(Failure::Skip);
        };
        let replicas = deployment
            .spec
            .as_ref()
            .and_then(|s| s.replicas)
            .unwrap_or(0);
        self.pods_ready(replicas, "k8s-app=kube-dns").await
    }

    /// `check.K8sPodReadyAssertion` in `kube-system`.
    async fn pods_ready(&self, replicas: i32, selector: &str) -> Outcome {
        let client = self.k8s().await?;
        let pods = Api::<Pod>::namespaced(client, "kube-system")
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(|e| e.to_string())?
            .items;
        if pods.is_empty() {
            return Err(format!(
                "no pods found for namespace \"kube-system\" and label selector {selector:?}"
            )
            .into());
        }
        let mut ready = Vec::new();
        let mut not_ready = Vec::new();
        for pod in &pods {
            let status = pod.status.as_ref();
            if pod.metadata.deletion_timestamp.is_some()
                || status.and_then(|s| s.phase.as_deref()) == Some("Failed")
            {
                continue;
            }
            let all_terminated = status
                .and_then(|s| s.container_statuses.as_ref())
                .is_none_or(|c| {
                    c.iter()
                        .all(|c| c.state.as_ref().is_some_and(|s| s.terminated.is_some()))
                });
            if all_terminated {
                continue;
            }
            let name = pod.metadata.name.clone().unwrap_or_default();
            if pod_condition(pod, "Ready") == Some("True") {
                ready.push(name);
            } else {
                not_ready.push(name);
            }
        }
        if ready.is_empty() {
            return Err(format!(
                "no ready pods found for namespace \"kube-system\" and label selector {selector:?}"
            )
            .into());
        }
        if !not_ready.is_empty() {
            return Err(format!("some pods are not ready: {}", go_list(&not_ready)).into());
        }
        if ready.len() != replicas as usize {
            return Err(format!("expected {replicas} ready pods, got {}", ready.len()).into());
        }
        Ok(())
    }
}

fn pod_condition<'a>(pod: &'a Pod, type_: &str) -> Option<&'a str> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.as_str())
}

/// A Kubernetes Node's addresses as the checks read them (InternalIP, then ExternalIP).
fn node_info(node: &K8sNode) -> Result<NodeInfo, Failure> {
    let mut internal = None;
    let mut ips = Vec::new();
    for address in node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
    {
        if address.type_ != "InternalIP" && address.type_ != "ExternalIP" {
            continue;
        }
        let ip: IpAddr = address
            .address
            .parse()
            .map_err(|_| format!("ParseAddr({:?}): unable to parse IP", address.address))?;
        if address.type_ == "InternalIP" {
            internal = Some(ip);
        }
        ips.push(ip);
    }
    Ok(NodeInfo {
        internal: internal.unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
        ips,
    })
}

/// `cluster.NodesMatch` (`pkg/cluster/cluster.go`).
fn nodes_match(expected: &[NodeInfo], mut actual: Vec<NodeInfo>) -> Outcome {
    for node in expected {
        match actual
            .iter()
            .position(|a| a.ips.iter().any(|ip| node.ips.contains(ip)))
        {
            Some(found) => {
                actual.remove(found);
            }
            None => {
                let ips: Vec<String> = node.ips.iter().map(IpAddr::to_string).collect();
                return Err(
                    format!("can't find expected node with IPs {}", go_quoted(&ips)).into(),
                );
            }
        }
    }
    if actual.is_empty() {
        return Ok(());
    }
    let mut unexpected: Vec<IpAddr> = actual.into_iter().flat_map(|n| n.ips).collect();
    unexpected.sort();
    let unexpected: Vec<String> = unexpected.iter().map(IpAddr::to_string).collect();
    Err(format!("unexpected nodes with IPs {}", go_quoted(&unexpected)).into())
}

/// Go's `%v` of a `[]string`: `[a b]`.
fn go_list(items: &[String]) -> String {
    format!("[{}]", items.join(" "))
}

/// Go's `%q` of a `[]string`: `["a" "b"]`.
fn go_quoted(items: &[String]) -> String {
    let quoted: Vec<String> = items.iter().map(|i| format!("{i:?}")).collect();
    format!("[{}]", quoted.join(" "))
}

/// hashicorp/go-multierror's list format.
fn multierror(errors: Vec<String>) -> Outcome {
    match errors.as_slice() {
        [] => Ok(()),
        [one] => Err(format!("1 error occurred:\n\t* {one}\n\n").into()),
        many => Err(format!(
            "{} errors occurred:\n\t* {}\n\n",
            many.len(),
            many.join("\n\t* ")
        )
        .into()),
    }
}

/// `errors.Join`.
fn joined(errors: Vec<String>) -> Outcome {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n").into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_as_go_prints_them() {
        let Err(Failure::Error(one)) = multierror(vec!["a: service is not healthy: etcd".into()])
        else {
            panic!("an error");
        };
        assert_eq!(
            one,
            "1 error occurred:\n\t* a: service is not healthy: etcd\n\n"
        );
        let Err(Failure::Error(two)) = multierror(vec!["x".into(), "y".into()]) else {
            panic!("an error");
        };
        assert_eq!(two, "2 errors occurred:\n\t* x\n\t* y\n\n");
        assert_eq!(go_quoted(&["10.0.0.1".into()]), "[\"10.0.0.1\"]");
        assert_eq!(go_list(&["a".into(), "b".into()]), "[a b]");
    }

    #[test]
    fn nodes_must_match_both_ways() {
        let ip = |s: &str| NodeInfo::of(s.parse().unwrap());
        assert!(nodes_match(&[ip("10.0.0.1")], vec![ip("10.0.0.1")]).is_ok());
        let Err(Failure::Error(missing)) = nodes_match(&[ip("10.0.0.1")], vec![]) else {
            panic!("an error");
        };
        assert_eq!(missing, "can't find expected node with IPs [\"10.0.0.1\"]");
        let Err(Failure::Error(extra)) =
            nodes_match(&[ip("10.0.0.1")], vec![ip("10.0.0.2"), ip("10.0.0.1")])
        else {
            panic!("an error");
        };
        assert_eq!(extra, "unexpected nodes with IPs [\"10.0.0.2\"]");
    }
}
