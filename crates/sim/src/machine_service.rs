//! `machine.MachineService` as machined answers it (talos-api.md §1.3, §3.1), per routed node.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use uuid::Uuid;

use super::compat;
use super::etcd::ForfeitError;
use super::events::{Tail, new_xid};
use super::image_ref::ImageRef;
use super::kubeconfig;
use super::logs;
use super::machine_config;
use super::node::Node;
use super::node_state::Slot;
use super::registry;
use super::routing::{ApiContext, MessageStream, Proxy, fan_out, fan_out_stream};
use super::sequences;
use talos_api::proto::{common, machine};

use machine::apply_configuration_request::Mode as ApplyMode;
use machine::machine_service_server::MachineService;

pub(crate) const APPLY_CONFIGURATION: &str = "/machine.MachineService/ApplyConfiguration";
pub(crate) const DMESG: &str = "/machine.MachineService/Dmesg";
pub(crate) const EVENTS: &str = "/machine.MachineService/Events";
pub(crate) const ETCD_MEMBER_LIST: &str = "/machine.MachineService/EtcdMemberList";
pub(crate) const ETCD_FORFEIT_LEADERSHIP: &str = "/machine.MachineService/EtcdForfeitLeadership";
pub(crate) const ETCD_SNAPSHOT: &str = "/machine.MachineService/EtcdSnapshot";
pub(crate) const ETCD_STATUS: &str = "/machine.MachineService/EtcdStatus";
pub(crate) const IMAGE_PULL: &str = "/machine.MachineService/ImagePull";
pub(crate) const KUBECONFIG: &str = "/machine.MachineService/Kubeconfig";
pub(crate) const LOGS: &str = "/machine.MachineService/Logs";
pub(crate) const LOGS_CONTAINERS: &str = "/machine.MachineService/LogsContainers";
pub(crate) const MEMORY: &str = "/machine.MachineService/Memory";
pub(crate) const READ: &str = "/machine.MachineService/Read";
pub(crate) const REBOOT: &str = "/machine.MachineService/Reboot";
pub(crate) const ROLLBACK: &str = "/machine.MachineService/Rollback";
pub(crate) const SERVICE_LIST: &str = "/machine.MachineService/ServiceList";
pub(crate) const UPGRADE: &str = "/machine.MachineService/Upgrade";
pub(crate) const VERSION: &str = "/machine.MachineService/Version";

/// The only file `Read` serves: what talosctl reads to detect a reboot.
pub(crate) const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Default TRY-mode timeout (`try_mode_timeout` unset).
const DEFAULT_TRY_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub(crate) struct MachineApi {
    ctx: ApiContext,
}

impl MachineApi {
    pub(crate) fn new(ctx: ApiContext) -> Self {
        MachineApi { ctx }
    }
}

fn only_control_plane(node: &Node, what: &str) -> Result<(), Status> {
    if node.role.is_control_plane() {
        Ok(())
    } else {
        Err(Status::unimplemented(format!(
            "{what} is only available on control plane nodes"
        )))
    }
}

fn etcd_running(node: &Node) -> Result<(), Status> {
    let running = node.read(|s| {
        s.services
            .get("etcd")
            .is_some_and(|svc| svc.state == "Running")
    });
    if running {
        Ok(())
    } else {
        Err(Status::unavailable(
            "failed to create etcd client: etcd is not running on this node",
        ))
    }
}

/// The size of the chunks `EtcdSnapshot` streams.
const SNAPSHOT_CHUNK: usize = 64 * 1024;

/// A deterministic stand-in for an etcd snapshot of the simulated cluster: whole bbolt pages (4 KiB)
/// of bytes derived from the etcd members (the same on every member, a few hundred KiB), followed by
/// the SHA-256 of those bytes, as etcd's `Maintenance.Snapshot` appends it (etcd v3.6
/// `server/etcdserver/api/v3rpc/maintenance.go`) and `etcdutl snapshot restore` checks it
/// (`etcdutl/snapshot/v3_snapshot.go`, `hasChecksum`: the size modulo 512 is 32).
pub(crate) fn pseudo_snapshot(members: &[super::etcd::Member]) -> Vec<u8> {
    let mut seed: u64 = 0xcbf2_9ce4_8422_2325;
    for member in members {
        for b in member.name.bytes().chain(member.id.to_le_bytes()) {
            seed = (seed ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let pages = 64 + (seed % 32) as usize;
    let mut data = Vec::with_capacity(pages * 4096 + 32);
    let mut state = seed | 1;
    while data.len() < pages * 4096 {
        // xorshift64: cheap, deterministic, not compressible to nothing.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        data.extend_from_slice(&state.to_le_bytes());
    }
    let hash = ring::digest::digest(&ring::digest::SHA256, &data);
    data.extend_from_slice(hash.as_ref());
    data
}

/// Lower-case hex, as `sha256sum` prints a digest.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A stable fake git sha for a version, so `Version` looks like a real build.
fn fake_sha(version: &str) -> String {
    let mut hash: u32 = 0x811c_9dc5;
    for b in version.bytes() {
        hash = (hash ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    format!("{hash:08x}")
}

fn is_installer(image: &ImageRef) -> bool {
    image.repository.contains("installer")
}

/// Pull an image as containerd would: one attempt (Talos 1.14's `image.Pull`), failing as the registry
/// model says (an image the registry does not have, talos-1.14.md §1.3) or as the InstallerPullFails
/// fault says. The error is containerd's, wrapped as Talos wraps it.
pub(crate) async fn pull_image(
    ctx: &ApiContext,
    node: &Node,
    reference: &str,
) -> Result<(), String> {
    let image = ImageRef::parse(reference)?;
    if node.read(|s| s.pulled_images.contains(reference)) {
        return Ok(());
    }
    tokio::time::sleep(ctx.cluster.timings.pull()).await;
    check_pullable(node, &image, reference)?;
    node.update(&ctx.cluster.etcd, |s| {
        s.pulled_images.insert(reference.to_string());
    });
    Ok(())
}

/// Whether `reference` can be pulled on `node` now: the InstallerPullFails fault, then the registry.
/// The fault answers as the registry does for an image it does not have (containerd's resolver, as
/// [`registry::resolve`] words it): the node is told the installer is not found, whatever holds it.
pub(crate) fn check_pullable(node: &Node, image: &ImageRef, reference: &str) -> Result<(), String> {
    if is_installer(image) && node.faults.current().installer_pull_fails {
        return Err(format!(
            "failed to pull image {reference:?}: failed to resolve reference {reference:?}: \
             {reference}: not found"
        ));
    }
    registry::resolve(reference).map_err(|e| format!("failed to pull image {reference:?}: {e}"))
}

/// The `NotFound` status of a pull RPC that failed: Talos wraps containerd's error as `error pulling
/// image: …` (talos v1.13.0 `internal/app/images/images.go` for `ImageService.Pull`,
/// `internal/app/machined/internal/server/v1alpha1/v1alpha1_images.go` for `MachineService.ImagePull`).
pub(crate) fn pull_not_found(reason: String) -> tonic::Status {
    tonic::Status::not_found(format!("error pulling image: {reason}"))
}

/// The Talos version an installer image installs: its tag's, or why the simulator cannot tell.
pub(crate) fn installer_version(image: &str) -> Result<semver::Version, String> {
    ImageRef::parse(image)?.version().ok_or_else(|| {
        format!("installer image tag of {image:?} is not a Talos version the simulator can install")
    })
}

/// What a legacy upgrade or LifecycleService.Upgrade installs from `image`, or why it cannot.
pub(crate) fn install_target(node: &Node, image: &str) -> Result<Slot, String> {
    let version = installer_version(image)?;
    compat::check_upgrade_path(&node.version(), &version)?;
    Ok(Slot {
        version,
        installer_image: image.to_string(),
    })
}

impl MachineApi {
    pub(crate) fn version_of(&self, node: &Node) -> machine::VersionResponse {
        let version = node.version();
        machine::VersionResponse {
            messages: vec![machine::Version {
                metadata: None,
                version: Some(machine::VersionInfo {
                    tag: compat::tag(&version),
                    sha: fake_sha(&version.to_string()),
                    built: "2025-11-01T00:00:00Z".to_string(),
                    go_version: "go1.24.9".to_string(),
                    os: "linux".to_string(),
                    arch: "amd64".to_string(),
                }),
                platform: Some(machine::PlatformInfo {
                    name: node.platform.clone(),
                    mode: registry::platform_mode(&node.platform).to_string(),
                }),
                features: Some(machine::FeaturesInfo { rbac: true }),
            }],
        }
    }

    pub(crate) fn service_list_of(&self, node: &Node) -> machine::ServiceListResponse {
        // etcd's health check is a quorum read through the local member (talos v1.14.1
        // `system/services/etcd.go`): it fails while the member is faulted or the cluster has no quorum.
        let etcd_failure = node.role.is_control_plane().then(|| {
            let etcd = &self.ctx.cluster.etcd;
            if etcd.member(&node.name).is_some_and(|m| m.faulted) {
                Some("etcdserver: member is unhealthy (injected fault)")
            } else if !etcd.has_quorum() {
                Some("context deadline exceeded")
            } else {
                None
            }
        });
        let services = node.read(|s| {
            s.services
                .iter()
                .map(|(id, svc)| {
                    let failure = (id == "etcd" && svc.state == "Running")
                        .then_some(etcd_failure.flatten())
                        .flatten();
                    machine::ServiceInfo {
                        id: id.clone(),
                        state: svc.state.to_string(),
                        events: Some(machine::ServiceEvents {
                            events: vec![machine::ServiceEvent {
                                msg: match (svc.state, failure) {
                                    ("Running", Some(failure)) => {
                                        format!("Health check failed: {failure}")
                                    }
                                    ("Running", None) => "Health check successful".to_string(),
                                    _ => "Service finished successfully".to_string(),
                                },
                                state: svc.state.to_string(),
                                ts: Some(svc.since.into()),
                            }],
                        }),
                        health: Some(machine::ServiceHealth {
                            unknown: false,
                            healthy: svc.healthy && failure.is_none(),
                            last_message: failure.unwrap_or_default().to_string(),
                            last_change: Some(svc.since.into()),
                        }),
                    }
                })
                .collect()
        });
        machine::ServiceListResponse {
            messages: vec![machine::ServiceList {
                metadata: None,
                services,
            }],
        }
    }

    fn etcd_status_of(&self, node: &Node) -> Result<machine::EtcdStatusResponse, Status> {
        only_control_plane(node, "etcd status")?;
        etcd_running(node)?;
        let etcd = &self.ctx.cluster.etcd;
        let member = etcd
            .member(&node.name)
            .ok_or_else(|| Status::internal("no etcd member for this node"))?;
        let (term, index) = etcd.raft();
        let mut errors = Vec::new();
        if member.faulted {
            errors.push("etcdserver: member is unhealthy (injected fault)".to_string());
        }
        if !etcd.has_quorum() {
            errors.push("etcdserver: no leader".to_string());
        }
        let version = node.version();
        Ok(machine::EtcdStatusResponse {
            messages: vec![machine::EtcdStatus {
                metadata: None,
                member_status: Some(machine::EtcdMemberStatus {
                    protocol_version: compat::etcd_version(&version).to_string(),
                    db_size: 20 * 1024 * 1024,
                    db_size_in_use: 12 * 1024 * 1024,
                    leader: etcd.leader().unwrap_or(0),
                    raft_index: index,
                    raft_term: term,
                    raft_applied_index: index,
                    errors,
                    is_learner: false,
                    member_id: member.id,
                    storage_version: if compat::enforces_kubernetes_matrix(&version) {
                        "3.6.0".to_string()
                    } else {
                        String::new()
                    },
                }),
            }],
        })
    }

    pub(crate) fn etcd_member_list_of(
        &self,
        node: &Node,
    ) -> Result<machine::EtcdMemberListResponse, Status> {
        only_control_plane(node, "etcd members list")?;
        etcd_running(node)?;
        let etcd = &self.ctx.cluster.etcd;
        if !etcd.has_quorum() {
            return Err(Status::unavailable(
                "etcdserver: request timed out (no quorum)",
            ));
        }
        let members = etcd.members();
        Ok(machine::EtcdMemberListResponse {
            messages: vec![machine::EtcdMembers {
                metadata: None,
                legacy_members: members.iter().map(|m| m.name.clone()).collect(),
                members: members
                    .iter()
                    .map(|m| machine::EtcdMember {
                        id: m.id,
                        hostname: m.name.clone(),
                        peer_urls: vec![m.peer_url()],
                        client_urls: vec![m.client_url()],
                        is_learner: false,
                    })
                    .collect(),
            }],
        })
    }

    /// `/proc/meminfo` of a plausible machine: 4 GiB for a control plane, 8 GiB for a worker (above
    /// what `talosctl health` requires: talos v1.14.1 `pkg/minimal` `Memory`), a little different on
    /// every node.
    pub(crate) fn memory_of(&self, node: &Node) -> machine::MemoryResponse {
        let gib: u64 = if node.role.is_control_plane() { 4 } else { 8 };
        let spread = 4096 * (node.index as u64 % 7);
        // What the kernel keeps for itself is not in MemTotal.
        let total = gib * 1024 * 1024 - 174_988;
        let used = 1_100_000 + spread * 16;
        let cached = 1_350_000 + spread * 8;
        let free = total - used - cached;
        machine::MemoryResponse {
            messages: vec![machine::Memory {
                metadata: None,
                meminfo: Some(machine::MemInfo {
                    memtotal: total,
                    memfree: free,
                    memavailable: free + cached - 120_000,
                    buffers: 4_116,
                    cached,
                    active: used / 2 + cached / 2,
                    inactive: used / 2,
                    activeanon: used / 2,
                    inactiveanon: 40_960,
                    activefile: cached / 2,
                    inactivefile: cached / 2,
                    anonpages: used - 160_000,
                    mapped: 420_000,
                    shmem: 40_960,
                    slab: 160_000,
                    sreclaimable: 90_000,
                    sunreclaim: 70_000,
                    kernelstack: 11_000,
                    pagetables: 9_500,
                    commitlimit: total / 2,
                    committedas: used * 2,
                    vmalloctotal: 34_359_738_367,
                    vmallocused: 30_000,
                    hugepagesize: 2_048,
                    directmap4k: 180_000,
                    directmap2m: total - 180_000,
                    ..Default::default()
                }),
            }],
        }
    }

    /// The service logs this node has (`LogsContainers`).
    fn logs_containers_of(&self, node: &Node) -> machine::LogsContainersResponse {
        machine::LogsContainersResponse {
            messages: vec![machine::LogsContainer {
                metadata: None,
                ids: logs::registered(node),
            }],
        }
    }

    /// `Logs` as machined answers it (talos v1.14.1 `v1alpha1_server.go` `Logs`): the `system`
    /// namespace, or the id `kubelet`, is a service log (`log "x" was not registered` for a service the
    /// node does not run); anything else is a container, and the simulator runs none.
    fn logs_on(
        &self,
        node: &Node,
        req: &machine::LogsRequest,
    ) -> Result<MessageStream<common::Data>, Status> {
        if req.namespace == "system" || req.id == "kubelet" {
            if !logs::registered(node).contains(&req.id) {
                return Err(Status::unknown(format!(
                    "log {:?} was not registered",
                    req.id
                )));
            }
            let start = match usize::try_from(req.tail_lines) {
                Ok(n) => logs::Start::Last(n),
                Err(_) => logs::Start::All,
            };
            return Ok(logs::stream(
                node,
                logs::Source::Service(req.id.clone()),
                start,
                req.follow,
            ));
        }
        if req.namespace.is_empty() {
            return Err(Status::invalid_argument("namespace can't be empty"));
        }
        if req.driver == common::ContainerDriver::Cri as i32 && req.namespace != "k8s.io" {
            return Err(Status::unknown(
                "CRI inspector is supported only for K8s namespace",
            ));
        }
        Err(Status::unknown(format!("container {:?} not found", req.id)))
    }

    /// `Kubeconfig` (talos v1.14.1 `v1alpha1_server.go`): control planes only, the admin kubeconfig of
    /// the workload cluster as a `.tar.gz` holding `kubeconfig`, in one chunk. Without one the node
    /// answers `FailedPrecondition`, as Talos does when its config lacks what a kubeconfig is made of;
    /// talosctl's health checks skip their Kubernetes part on that code.
    fn kubeconfig_on(&self, node: &Node) -> Result<MessageStream<common::Data>, Status> {
        only_control_plane(node, "kubeconfig")?;
        let Some(text) = self.ctx.cluster.workload_kubeconfig.get() else {
            return Err(Status::failed_precondition(
                "k8s API server CA config is not set: the simulator was given no kubeconfig of a \
                 workload cluster (Simulator::set_workload_kubeconfig, or workload_kubeconfig in its config)",
            ));
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let archive = kubeconfig::tar_gz("kubeconfig", 0o600, text.as_bytes(), now);
        Ok(Box::pin(tokio_stream::once(Ok(common::Data {
            metadata: None,
            bytes: archive,
        }))))
    }

    /// `EtcdSnapshot` (talos v1.14.1 `v1alpha1_server.go`): control planes only (a worker answers
    /// `Unimplemented`, `machinehelper.CheckControlplane`), from the local etcd member, streamed in
    /// chunks. Recorded like a call that changes something, with the bytes sent and their SHA-256, so
    /// a test can compare them with what the controller stored. The `etcd-snapshot-fails` fault
    /// answers Talos's error for a snapshot etcd could not read; `etcd-snapshot-truncated` ends the
    /// stream cleanly after half the database (no error: what a real stream cut short looks like).
    fn etcd_snapshot_on(&self, node: &Node) -> Result<DataStream, Status> {
        let faults = node.faults.current();
        let snapshot = (|| {
            only_control_plane(node, "etcd snapshot")?;
            etcd_running(node)?;
            if faults.etcd_snapshot_fails {
                return Err(Status::unknown(
                    "failed reading etcd snapshot: rpc error: code = Unavailable desc = etcdserver: \
                     snapshot read failed (injected fault)",
                ));
            }
            let mut data = pseudo_snapshot(&self.ctx.cluster.etcd.members());
            if faults.etcd_snapshot_truncated {
                data.truncate(data.len() / 2);
            }
            Ok(data)
        })();
        let params = match &snapshot {
            Ok(data) => json!({
                "size": data.len(),
                "sha256": hex(ring::digest::digest(&ring::digest::SHA256, data).as_ref()),
            }),
            Err(_) => json!({}),
        };
        let call = self.ctx.record(node, ETCD_SNAPSHOT, params);
        self.ctx.finish(call, &snapshot);
        let data = snapshot?;
        let chunks: Vec<Result<common::Data, Status>> = data
            .chunks(SNAPSHOT_CHUNK)
            .map(|chunk| {
                Ok(common::Data {
                    metadata: None,
                    bytes: chunk.to_vec(),
                })
            })
            .collect();
        Ok(Box::pin(tokio_stream::iter(chunks)))
    }

    async fn forfeit_on(
        &self,
        node: Arc<Node>,
    ) -> Result<machine::EtcdForfeitLeadershipResponse, Status> {
        let call = self.ctx.record(&node, ETCD_FORFEIT_LEADERSHIP, json!({}));
        let result = (|| {
            only_control_plane(&node, "etcd forfeit leadership")?;
            etcd_running(&node)?;
            let member = self
                .ctx
                .cluster
                .etcd
                .forfeit(&node.name)
                .map_err(|e| match e {
                    ForfeitError::OnlyOneMember => Status::unknown(e.to_string()),
                    ForfeitError::NoHealthyPeer => Status::unavailable(e.to_string()),
                })?;
            self.ctx.cluster.publish_control_planes();
            Ok(machine::EtcdForfeitLeadershipResponse {
                messages: vec![machine::EtcdForfeitLeadership {
                    metadata: None,
                    member,
                }],
            })
        })();
        self.ctx.finish(call, &result);
        result
    }

    async fn image_pull_on(
        &self,
        node: Arc<Node>,
        req: &machine::ImagePullRequest,
    ) -> Result<machine::ImagePullResponse, Status> {
        let call = self.ctx.record(
            &node,
            IMAGE_PULL,
            json!({"reference": req.reference, "namespace": req.namespace}),
        );
        let result = async {
            ImageRef::parse(&req.reference).map_err(Status::invalid_argument)?;
            pull_image(&self.ctx, &node, &req.reference)
                .await
                .map_err(pull_not_found)?;
            Ok(machine::ImagePullResponse {
                messages: vec![machine::ImagePull { metadata: None }],
            })
        }
        .await;
        self.ctx.finish(call, &result);
        result
    }

    async fn reboot_on(
        &self,
        node: Arc<Node>,
        req: &machine::RebootRequest,
    ) -> Result<machine::RebootResponse, Status> {
        if node.faults.take_lost_reboot() {
            // Lost before machined: not in the call record, and nothing happens to the node.
            return Err(Status::unavailable(
                "injected fault: the reboot was lost on its way",
            ));
        }
        let mode = machine::reboot_request::Mode::try_from(req.mode)
            .map(|m| m.as_str_name())
            .unwrap_or("UNKNOWN");
        let call = self.ctx.record(&node, REBOOT, json!({"mode": mode}));
        let actor = Uuid::new_v4().to_string();
        let cluster = &self.ctx.cluster;
        match sequences::lock_sequence(cluster, &node, "reboot") {
            Ok(()) => sequences::spawn_reboot(cluster, &node, actor.clone()),
            Err(_) => sequences::emit_locked(&node, &actor, "reboot"),
        }
        let result = Ok(machine::RebootResponse {
            messages: vec![machine::Reboot {
                metadata: None,
                actor_id: actor,
            }],
        });
        self.ctx.finish(call, &result);
        result
    }

    async fn rollback_on(&self, node: Arc<Node>) -> Result<machine::RollbackResponse, Status> {
        let call = self.ctx.record(&node, ROLLBACK, json!({}));
        let cluster = &self.ctx.cluster;
        let result = (|| {
            let previous = node.read(|s| s.previous.clone()).ok_or_else(|| {
                Status::unknown("cannot rollback to previous version, label does not exist")
            })?;
            if let Err(running) = sequences::lock_sequence(cluster, &node, "reboot") {
                return Err(Status::failed_precondition(format!(
                    "sequence {running:?} is running"
                )));
            }
            node.update(&cluster.etcd, |s| s.next_boot = Some(previous));
            sequences::spawn_reboot(cluster, &node, String::new());
            Ok(machine::RollbackResponse {
                messages: vec![machine::Rollback { metadata: None }],
            })
        })();
        self.ctx.finish(call, &result);
        result
    }

    async fn upgrade_on(
        &self,
        node: Arc<Node>,
        req: &machine::UpgradeRequest,
    ) -> Result<machine::UpgradeResponse, Status> {
        let reboot_mode = machine::upgrade_request::RebootMode::try_from(req.reboot_mode)
            .unwrap_or(machine::upgrade_request::RebootMode::Default);
        let call = self.ctx.record(
            &node,
            UPGRADE,
            json!({
                "image": req.image,
                "preserve": req.preserve,
                "stage": req.stage,
                "force": req.force,
                "reboot_mode": reboot_mode.as_str_name(),
                // Whether this node led etcd when the call arrived (null on a worker): the controller
                // moves leadership off a control plane before upgrading it, and the tests check that.
                "etcd_leader": self.ctx.cluster.etcd.snapshot_for(&node.name).map(|m| m.leader),
            }),
        );
        let result = self.legacy_upgrade(&node, req, reboot_mode).await;
        self.ctx.finish(call, &result);
        result
    }

    async fn legacy_upgrade(
        &self,
        node: &Arc<Node>,
        req: &machine::UpgradeRequest,
        reboot_mode: machine::upgrade_request::RebootMode,
    ) -> Result<machine::UpgradeResponse, Status> {
        let cluster = &self.ctx.cluster;
        let invalid_image = |e: String| {
            Status::unknown(format!(
                "error validating installer image {:?}: {e}",
                req.image
            ))
        };
        // Pull + validate synchronously, as machined does: a bad image fails the RPC.
        pull_image(&self.ctx, node, &req.image)
            .await
            .map_err(invalid_image)?;
        let target = install_target(node, &req.image).map_err(invalid_image)?;

        let version = node.version();
        let skip_etcd = req.force || (req.preserve && compat::preserve_skips_etcd_checks(&version));
        // Held only for the pre-checks, released when the RPC returns.
        let _mutex = if node.role.is_control_plane() && !skip_etcd {
            let lock = cluster
                .etcd
                .try_lock_upgrade(&node.name)
                .map_err(Status::unknown)?;
            cluster
                .etcd
                .validate_for_upgrade()
                .map_err(|e| Status::unknown(format!("error validating etcd for upgrade: {e}")))?;
            Some(lock)
        } else {
            None
        };

        let actor = Uuid::new_v4().to_string();
        match sequences::lock_sequence(cluster, node, "upgrade") {
            Ok(()) => sequences::spawn_legacy_upgrade(
                cluster,
                node,
                actor.clone(),
                target,
                reboot_mode == machine::upgrade_request::RebootMode::Powercycle,
            ),
            Err(_) => sequences::emit_locked(node, &actor, "upgrade"),
        }
        Ok(machine::UpgradeResponse {
            messages: vec![machine::Upgrade {
                metadata: None,
                ack: "Upgrade request received".to_string(),
                actor_id: actor,
            }],
        })
    }

    async fn apply_on(
        &self,
        node: Arc<Node>,
        req: &machine::ApplyConfigurationRequest,
    ) -> Result<machine::ApplyConfigurationResponse, Status> {
        let mode = ApplyMode::try_from(req.mode).unwrap_or(ApplyMode::Reboot);
        let defaults = node.default_images();
        let parsed = machine_config::parse(&req.data, &defaults);
        let mut params = json!({
            "mode": mode.as_str_name(),
            "dry_run": req.dry_run,
            "config_bytes": req.data.len(),
        });
        if let Ok(parsed) = &parsed {
            params["images"] = json!({
                "kubelet": parsed.images.kubelet,
                "apiserver": parsed.images.apiserver,
                "controller_manager": parsed.images.controller_manager,
                "scheduler": parsed.images.scheduler,
                "proxy": parsed.images.proxy,
            });
            // The Kube* documents the config carries (Talos 1.14's shape), in order.
            params["kube_documents"] = json!(
                parsed
                    .kube_documents
                    .iter()
                    .map(|d| d.component.kind())
                    .collect::<Vec<_>>()
            );
        }
        let call = self.ctx.record(&node, APPLY_CONFIGURATION, params);
        let result = self.apply(&node, req, mode, parsed);
        self.ctx.finish(call, &result);
        result
    }

    fn apply(
        &self,
        node: &Arc<Node>,
        req: &machine::ApplyConfigurationRequest,
        mode: ApplyMode,
        parsed: Result<machine_config::ParsedConfig, String>,
    ) -> Result<machine::ApplyConfigurationResponse, Status> {
        let cluster = &self.ctx.cluster;
        if node.faults.current().apply_config_rejected {
            return Err(Status::invalid_argument(
                "configuration validation failed: rejected by injected fault",
            ));
        }
        let parsed = parsed.map_err(Status::invalid_argument)?;
        let version = node.version();
        // A node that cannot decode a document refuses the config before validating anything.
        machine_config::check_decodable(&parsed, &version).map_err(Status::invalid_argument)?;
        machine_config::validate(&parsed, node.role, &version).map_err(|e| {
            Status::invalid_argument(format!("configuration validation failed: {e}"))
        })?;
        let modern = (version.major, version.minor) >= (1, 14);
        let used = match mode {
            ApplyMode::Reboot if modern => {
                return Err(Status::unimplemented(
                    "apply configuration in REBOOT mode is only supported in maintenance mode",
                ));
            }
            // Every change the simulator models can be applied live.
            ApplyMode::Auto => ApplyMode::NoReboot,
            other => other,
        };
        let reply = |details: &str| machine::ApplyConfigurationResponse {
            messages: vec![machine::ApplyConfiguration {
                metadata: None,
                warnings: Vec::new(),
                mode: used as i32,
                mode_details: details.to_string(),
            }],
        };
        if req.dry_run {
            return Ok(reply(
                "Dry run summary:\nApplied configuration without a reboot (dry run)",
            ));
        }
        match used {
            ApplyMode::Staged => {
                node.update(&cluster.etcd, |s| s.staged_config = Some(req.data.clone()));
                Ok(reply("Staged configuration to be applied after a reboot"))
            }
            ApplyMode::Reboot => {
                self.apply_live(node, req.data.clone(), parsed);
                let actor = Uuid::new_v4().to_string();
                match sequences::lock_sequence(cluster, node, "reboot") {
                    Ok(()) => sequences::spawn_reboot(cluster, node, actor),
                    Err(_) => sequences::emit_locked(node, &actor, "reboot"),
                }
                Ok(reply("Applied configuration with a reboot"))
            }
            ApplyMode::Try => {
                let previous = node.read(|s| s.config.clone());
                let tried = req.data.clone();
                self.apply_live(node, tried.clone(), parsed);
                let timeout = req
                    .try_mode_timeout
                    .and_then(|d| Duration::try_from(d).ok())
                    .unwrap_or(DEFAULT_TRY_TIMEOUT);
                let api = self.clone();
                let node2 = node.clone();
                sequences::spawn_in_boot(node, async move {
                    tokio::time::sleep(timeout).await;
                    // Revert unless something else was applied meanwhile.
                    if node2.read(|s| s.config == tried) {
                        let defaults = node2.default_images();
                        if let Ok(parsed) = machine_config::parse(&previous, &defaults) {
                            api.apply_live(&node2, previous, parsed);
                        }
                    }
                });
                Ok(reply(&format!(
                    "Applied configuration in a try mode, will be rolled back in {}s",
                    timeout.as_secs()
                )))
            }
            _ => {
                self.apply_live(node, req.data.clone(), parsed);
                Ok(reply("Applied configuration without a reboot"))
            }
        }
    }

    /// Store the config (MachineConfig and the derived *Config/KubeletSpec resources bump at once)
    /// and let components follow after `apply_ms`.
    fn apply_live(&self, node: &Arc<Node>, data: Vec<u8>, parsed: machine_config::ParsedConfig) {
        let cluster = &self.ctx.cluster;
        let old = node.read(|s| s.parsed.images.clone());
        let new = parsed.images.clone();
        node.update(&cluster.etcd, |s| {
            s.config = data;
            s.parsed = parsed;
        });
        let kubelet_changed = old.kubelet != new.kubelet;
        let static_pods_changed = node.role.is_control_plane()
            && (old.apiserver != new.apiserver
                || old.controller_manager != new.controller_manager
                || old.scheduler != new.scheduler);
        sequences::apply_effects(cluster, node, kubelet_changed, static_pods_changed);
    }
}

type EventStream = MessageStream<machine::Event>;
type DataStream = MessageStream<common::Data>;

/// Stream events of `node`: hello, the replayed tail, then live events until the client goes away or
/// the node's boot ends (then `Unavailable`, what a proxied stream sees when its backend reboots).
fn event_stream(node: &Node, tail: Tail, actor: String) -> EventStream {
    let (history, mut live, epoch) = node.events.subscribe();
    let replay = tail.select(history);
    let boot = node.boot_token();
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let matches = |e: &super::events::NodeEvent| actor.is_empty() || e.actor_id == actor;
        let hello = machine::Event {
            metadata: None,
            data: None,
            id: new_xid(),
            actor_id: actor.clone(),
        };
        if tx.send(Ok(hello)).await.is_err() {
            return;
        }
        for event in replay.iter().filter(|e| matches(e)) {
            if tx.send(Ok(event.to_proto())).await.is_err() {
                return;
            }
        }
        loop {
            tokio::select! {
                biased;
                _ = boot.cancelled() => {
                    // Deliver everything that happened before the power cut, then end the way a
                    // stream ends when apid goes away.
                    loop {
                        match live.try_recv() {
                            Ok(event) if event.epoch != epoch => break,
                            Ok(event) => {
                                if matches(&event) && tx.send(Ok(event.to_proto())).await.is_err() {
                                    return;
                                }
                            }
                            Err(broadcast::error::TryRecvError::Lagged(_)) => continue,
                            Err(_) => break,
                        }
                    }
                    let _ = tx.send(Err(Status::unavailable("node is rebooting"))).await;
                    return;
                }
                _ = tx.closed() => return,
                received = live.recv() => match received {
                    // A later boot's events never reach a stream of an earlier boot.
                    Ok(event) if event.epoch != epoch => {}
                    Ok(event) => {
                        if matches(&event) && tx.send(Ok(event.to_proto())).await.is_err() {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let _ = tx.send(Err(Status::aborted("event buffer overrun"))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

#[tonic::async_trait]
impl MachineService for MachineApi {
    async fn apply_configuration(
        &self,
        request: Request<machine::ApplyConfigurationRequest>,
    ) -> Result<Response<machine::ApplyConfigurationResponse>, Status> {
        let targets = self
            .ctx
            .route(&request, APPLY_CONFIGURATION, Proxy::Unary)?;
        let req = request.into_inner();
        let reply = fan_out(targets, |node| self.apply_on(node, &req)).await?;
        Ok(Response::new(reply))
    }

    type EventsStream = EventStream;

    async fn events(
        &self,
        request: Request<machine::EventsRequest>,
    ) -> Result<Response<Self::EventsStream>, Status> {
        let targets = self.ctx.route(&request, EVENTS, Proxy::Streaming)?;
        let req = request.into_inner();
        let tail = Tail::from_request(&req).map_err(Status::invalid_argument)?;
        let stream = fan_out_stream(targets, |node| {
            let stream = event_stream(&node, tail.clone(), req.with_actor_id.clone());
            async move { Ok(stream) }
        })
        .await?;
        Ok(Response::new(stream))
    }

    type DmesgStream = DataStream;

    async fn dmesg(
        &self,
        request: Request<machine::DmesgRequest>,
    ) -> Result<Response<Self::DmesgStream>, Status> {
        let targets = self.ctx.route(&request, DMESG, Proxy::Streaming)?;
        let req = request.into_inner();
        // `tail` means "only new messages", and only makes sense with `follow` (talosctl's flag help).
        let start = if req.tail {
            logs::Start::Now
        } else {
            logs::Start::All
        };
        let stream = fan_out_stream(targets, |node| {
            let stream = logs::stream(&node, logs::Source::Kernel, start, req.follow);
            async move { Ok(stream) }
        })
        .await?;
        Ok(Response::new(stream))
    }

    type KubeconfigStream = DataStream;

    async fn kubeconfig(
        &self,
        request: Request<()>,
    ) -> Result<Response<Self::KubeconfigStream>, Status> {
        let targets = self.ctx.route(&request, KUBECONFIG, Proxy::Streaming)?;
        let stream = fan_out_stream(targets, |node| {
            let stream = self.kubeconfig_on(&node);
            async move { stream }
        })
        .await?;
        Ok(Response::new(stream))
    }

    type LogsStream = DataStream;

    async fn logs(
        &self,
        request: Request<machine::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let targets = self.ctx.route(&request, LOGS, Proxy::Streaming)?;
        let req = request.into_inner();
        let stream = fan_out_stream(targets, |node| {
            let stream = self.logs_on(&node, &req);
            async move { stream }
        })
        .await?;
        Ok(Response::new(stream))
    }

    async fn logs_containers(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::LogsContainersResponse>, Status> {
        let targets = self.ctx.route(&request, LOGS_CONTAINERS, Proxy::Unary)?;
        let reply = fan_out(
            targets,
            |node| async move { Ok(self.logs_containers_of(&node)) },
        )
        .await?;
        Ok(Response::new(reply))
    }

    async fn memory(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::MemoryResponse>, Status> {
        let targets = self.ctx.route(&request, MEMORY, Proxy::Unary)?;
        let reply = fan_out(targets, |node| async move { Ok(self.memory_of(&node)) }).await?;
        Ok(Response::new(reply))
    }

    async fn etcd_member_list(
        &self,
        request: Request<machine::EtcdMemberListRequest>,
    ) -> Result<Response<machine::EtcdMemberListResponse>, Status> {
        let targets = self.ctx.route(&request, ETCD_MEMBER_LIST, Proxy::Unary)?;
        let reply = fan_out(
            targets,
            |node| async move { self.etcd_member_list_of(&node) },
        )
        .await?;
        Ok(Response::new(reply))
    }

    async fn etcd_forfeit_leadership(
        &self,
        request: Request<machine::EtcdForfeitLeadershipRequest>,
    ) -> Result<Response<machine::EtcdForfeitLeadershipResponse>, Status> {
        let targets = self
            .ctx
            .route(&request, ETCD_FORFEIT_LEADERSHIP, Proxy::Unary)?;
        let reply = fan_out(targets, |node| self.forfeit_on(node)).await?;
        Ok(Response::new(reply))
    }

    type EtcdSnapshotStream = DataStream;

    async fn etcd_snapshot(
        &self,
        request: Request<machine::EtcdSnapshotRequest>,
    ) -> Result<Response<Self::EtcdSnapshotStream>, Status> {
        let targets = self.ctx.route(&request, ETCD_SNAPSHOT, Proxy::Streaming)?;
        let stream = fan_out_stream(targets, |node| {
            let stream = self.etcd_snapshot_on(&node);
            async move { stream }
        })
        .await?;
        Ok(Response::new(stream))
    }

    async fn etcd_status(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::EtcdStatusResponse>, Status> {
        let targets = self.ctx.route(&request, ETCD_STATUS, Proxy::Unary)?;
        let reply = fan_out(targets, |node| async move { self.etcd_status_of(&node) }).await?;
        Ok(Response::new(reply))
    }

    async fn image_pull(
        &self,
        request: Request<machine::ImagePullRequest>,
    ) -> Result<Response<machine::ImagePullResponse>, Status> {
        let targets = self.ctx.route(&request, IMAGE_PULL, Proxy::Unary)?;
        let req = request.into_inner();
        let reply = fan_out(targets, |node| self.image_pull_on(node, &req)).await?;
        Ok(Response::new(reply))
    }

    type ReadStream = DataStream;

    async fn read(
        &self,
        request: Request<machine::ReadRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let targets = self.ctx.route(&request, READ, Proxy::Streaming)?;
        let path = request.into_inner().path;
        let stream = fan_out_stream(targets, |node| {
            let result: Result<DataStream, Status> = if path == BOOT_ID_PATH {
                let boot_id = node.read(|s| s.boot_id.to_string());
                Ok(Box::pin(tokio_stream::once(Ok(common::Data {
                    metadata: None,
                    bytes: format!("{boot_id}\n").into_bytes(),
                }))))
            } else {
                Err(Status::not_found(format!(
                    "open {path}: no such file or directory"
                )))
            };
            async move { result }
        })
        .await?;
        Ok(Response::new(stream))
    }

    async fn reboot(
        &self,
        request: Request<machine::RebootRequest>,
    ) -> Result<Response<machine::RebootResponse>, Status> {
        let targets = self.ctx.route(&request, REBOOT, Proxy::Unary)?;
        let req = request.into_inner();
        let reply = fan_out(targets, |node| self.reboot_on(node, &req)).await?;
        Ok(Response::new(reply))
    }

    async fn rollback(
        &self,
        request: Request<machine::RollbackRequest>,
    ) -> Result<Response<machine::RollbackResponse>, Status> {
        let targets = self.ctx.route(&request, ROLLBACK, Proxy::Unary)?;
        let reply = fan_out(targets, |node| self.rollback_on(node)).await?;
        Ok(Response::new(reply))
    }

    async fn service_list(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::ServiceListResponse>, Status> {
        let targets = self.ctx.route(&request, SERVICE_LIST, Proxy::Unary)?;
        let reply = fan_out(
            targets,
            |node| async move { Ok(self.service_list_of(&node)) },
        )
        .await?;
        Ok(Response::new(reply))
    }

    async fn upgrade(
        &self,
        request: Request<machine::UpgradeRequest>,
    ) -> Result<Response<machine::UpgradeResponse>, Status> {
        let targets = self.ctx.route(&request, UPGRADE, Proxy::Unary)?;
        let req = request.into_inner();
        let reply = fan_out(targets, |node| self.upgrade_on(node, &req)).await?;
        Ok(Response::new(reply))
    }

    async fn version(
        &self,
        request: Request<()>,
    ) -> Result<Response<machine::VersionResponse>, Status> {
        let targets = self.ctx.route(&request, VERSION, Proxy::Unary)?;
        let reply = fan_out(targets, |node| async move { Ok(self.version_of(&node)) }).await?;
        Ok(Response::new(reply))
    }
}
