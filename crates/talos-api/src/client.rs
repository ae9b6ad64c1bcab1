//! [`TalosClient`]: one mTLS gRPC channel to apid and the calls an upgrade needs.

use std::collections::VecDeque;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::config::TalosCredentials;
use super::cosi::{self, CosiResource, CosiWatchStream, resources};
use super::error::{Result, TalosError};
use super::events::{self, EventStream, EventsOptions};
use super::tls::{DeadPeerDetection, TalosTls, TlsConnector};
use super::types::{
    ApplyMode, ApplyOutcome, ContainerdNamespace, EtcdMember, EtcdMemberStatus,
    LegacyUpgradeOptions, LifecycleUpgradeOutcome, MachineConfigBytes, MachineType, RebootMode,
    ServiceInfo, VersionInfo,
};
use crate::proto::common;
use crate::proto::cosi::resource as cosi_pb;
use crate::proto::cosi::resource::state_client::StateClient;
use crate::proto::machine;
use crate::proto::machine::image_service_client::ImageServiceClient;
use crate::proto::machine::lifecycle_service_client::LifecycleServiceClient;
use crate::proto::machine::machine_service_client::MachineServiceClient;
use crate::proto::resource::config as config_pb;
use crate::proto::talos::resource::definitions::{k8s as k8s_pb, runtime as runtime_pb};

/// apid's port.
pub const DEFAULT_PORT: u16 = 50000;

/// Talos's gRPC message size limit (`GRPCMaxMessageSize`); tonic's default of 4 MiB is too small for
/// large machine configs and manifest lists.
pub const MAX_MESSAGE_SIZE: usize = 32 * 1024 * 1024;

/// The path Talos exposes the kernel boot id at; it changes on every boot, so comparing it before and
/// after proves a reboot happened.
const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Which machine the client talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Dial the node itself at `https://<ip>:<port>`; its certificate is verified for that IP (apid
    /// certificates carry every node address as an IP SAN).
    Node(IpAddr),
    /// Dial an apid endpoint and talk to that machine: an IP, `host`, `host:port`, `[v6]:port` or an
    /// `https://` URL as written in a talosconfig. The certificate is verified for that host.
    Endpoint(String),
    /// Dial `endpoint` (a control-plane node) and let its apid proxy every call to `node` (an IP or
    /// host name without port) via the gRPC metadata header `node`. Only the endpoint's certificate is
    /// verified by us; apid authenticates the hop to the node.
    ViaEndpoint { endpoint: String, node: String },
}

/// Connection settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectOptions {
    /// Port used when the target does not name one.
    pub port: u16,
    /// Bound for the TCP connect and, separately, the TLS handshake.
    pub connect_timeout: Duration,
    /// Bound for each unary call (and for short bounded streams: boot id, COSI list, opening a
    /// watch or event stream). Long-lived streams themselves are not bounded.
    pub request_timeout: Duration,
    /// Bound for calls that pull images or run the installer (legacy `Upgrade` pulls the installer
    /// before it answers, `ImagePull`, `ImageService.Pull`, `LifecycleService.Upgrade`).
    pub long_request_timeout: Duration,
    /// How a connection notices a node that vanished without closing it (power loss, network cut):
    /// see [`DeadPeerDetection`].
    pub dead_peer: DeadPeerDetection,
    /// Verify the server certificate for this name (DNS or IP) instead of the dialled host. For
    /// endpoints behind NAT, a VIP or a load balancer whose address is not in the certificate.
    pub server_name: Option<String>,
    /// Told the operation and result code of every call (for the Talos API calls metric).
    pub observer: Option<CallObserver>,
}

/// Receives `(operation, code)` for every Talos API call a client makes: `code` is `OK` or a gRPC code
/// name (`Unavailable`, `DeadlineExceeded`, …). Both are fixed strings, so a metric's labels stay bounded.
#[derive(Clone)]
pub struct CallObserver(std::sync::Arc<dyn Fn(&'static str, &'static str) + Send + Sync>);

impl CallObserver {
    pub fn new(observe: impl Fn(&'static str, &'static str) + Send + Sync + 'static) -> Self {
        CallObserver(std::sync::Arc::new(observe))
    }

    fn observe(&self, operation: &'static str, code: &'static str) {
        (self.0)(operation, code)
    }
}

impl std::fmt::Debug for CallObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallObserver")
    }
}

impl PartialEq for CallObserver {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for CallObserver {}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port: DEFAULT_PORT,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            long_request_timeout: Duration::from_secs(15 * 60),
            dead_peer: DeadPeerDetection::APID,
            server_name: None,
            observer: None,
        }
    }
}

/// A client for one Talos machine's API.
///
/// Cheap to clone (clones share the connection). The connection re-establishes itself on the next
/// call after it broke, so one client can be kept across a node reboot: calls fail with
/// [`TalosError::Unreachable`] while the node is down and succeed once it is back.
///
/// Every unary call is bounded by [`ConnectOptions::request_timeout`] and fails with
/// [`TalosError::Timeout`] when it fires.
#[derive(Clone)]
pub struct TalosClient {
    channel: Channel,
    /// Human-readable target for errors and logs, e.g. `10.0.0.5:50000`.
    endpoint: Arc<str>,
    /// Value of the `node` header for [`Target::ViaEndpoint`].
    node: Option<AsciiMetadataValue>,
    request_timeout: Duration,
    long_request_timeout: Duration,
    observer: Option<CallObserver>,
}

impl std::fmt::Debug for TalosClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TalosClient")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Everything needed to open the channel, computed before any I/O.
struct Prepared {
    endpoint: Endpoint,
    connector: TlsConnector,
    label: Arc<str>,
    node: Option<AsciiMetadataValue>,
}

impl TalosClient {
    /// Connect now: TCP, TLS handshake (the server certificate is verified against the talosconfig CA
    /// here, so a wrong CA or name fails with [`TalosError::Tls`]) and HTTP/2 setup. An unreachable
    /// node fails with [`TalosError::Unreachable`].
    ///
    /// With TLS 1.3 the server checks our client certificate after the client considers the handshake
    /// done, so a client certificate the server rejects surfaces on the first call, as
    /// [`TalosError::Tls`].
    pub async fn connect(
        credentials: &TalosCredentials,
        target: Target,
        options: &ConnectOptions,
    ) -> Result<TalosClient> {
        let resolved = resolve(&target, options)?;
        let tls = TalosTls::new(credentials, &resolved.label)?;
        let prepared = prepare(&tls, resolved, options)?;
        // TCP connect and TLS handshake each have their own timeout; this bounds the sum, in case
        // anything else (HTTP/2 setup) stalls.
        let budget = options.connect_timeout.saturating_mul(2);
        tracing::debug!(endpoint = %prepared.label, "connecting to Talos apid");
        let connecting = prepared
            .endpoint
            .connect_with_connector(prepared.connector.clone());
        let channel = match tokio::time::timeout(budget, connecting).await {
            Err(_) => {
                return Err(TalosError::Unreachable {
                    endpoint: prepared.label.to_string(),
                    reason: format!("connection not established within {budget:?}"),
                });
            }
            Ok(Err(e)) => return Err(TalosError::from_transport(&prepared.label, &e)),
            Ok(Ok(channel)) => channel,
        };
        Ok(Self::from_parts(channel, prepared, options))
    }

    /// Build a client without connecting; the first call connects. Fails only on invalid arguments or
    /// unusable credentials. Must be called inside a tokio runtime.
    pub fn lazy(
        credentials: &TalosCredentials,
        target: Target,
        options: &ConnectOptions,
    ) -> Result<TalosClient> {
        let resolved = resolve(&target, options)?;
        let tls = TalosTls::new(credentials, &resolved.label)?;
        Ok(Self::lazy_prepared(
            prepare(&tls, resolved, options)?,
            options,
        ))
    }

    /// [`TalosClient::lazy`] with a TLS configuration shared with other clients of the same
    /// credentials (a cluster's nodes): one configuration and one session cache for all of them.
    pub fn lazy_with(
        tls: &TalosTls,
        target: Target,
        options: &ConnectOptions,
    ) -> Result<TalosClient> {
        let prepared = prepare(tls, resolve(&target, options)?, options)?;
        Ok(Self::lazy_prepared(prepared, options))
    }

    fn lazy_prepared(prepared: Prepared, options: &ConnectOptions) -> TalosClient {
        let channel = prepared
            .endpoint
            .connect_with_connector_lazy(prepared.connector.clone());
        Self::from_parts(channel, prepared, options)
    }

    fn from_parts(channel: Channel, prepared: Prepared, options: &ConnectOptions) -> TalosClient {
        TalosClient {
            channel,
            endpoint: prepared.label,
            node: prepared.node,
            request_timeout: options.request_timeout,
            long_request_timeout: options.long_request_timeout,
            observer: options.observer.clone(),
        }
    }

    /// The target as shown in errors, e.g. `10.0.0.5:50000` or `node 10.0.0.5 via 10.0.0.2:50000`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A client for `node` that shares this client's connection and asks this client's machine (a
    /// control plane, whose apid forwards by the `node` header) to relay every call to `node`, as
    /// [`Target::ViaEndpoint`] does. Many nodes over one connection: one TLS session and one set of
    /// HTTP/2 buffers instead of one per node.
    pub fn relayed_to(&self, node: IpAddr) -> Result<TalosClient> {
        let (label, header) = relayed(&node.to_string(), &self.endpoint)?;
        Ok(TalosClient {
            endpoint: label.into(),
            node: Some(header),
            ..self.clone()
        })
    }

    // ----- one-to-many (apid's `nodes` metadata) -----
    //
    // A call sent to a control plane's apid with the `nodes` metadata is made by that apid on every
    // node named, and its reply holds one message per node stamped with `metadata.hostname` (the
    // name as sent) and, for a node that could not answer, `metadata.error` and `metadata.status`
    // (talos v1.14.1 `internal/app/apid/pkg/director/director.go` `Director` / `aggregateDirector`,
    // `internal/app/apid/pkg/backend/apid.go` `AppendInfo` / `BuildError`). apid allows it for
    // MachineService and ClusterService (and a few others), never for COSI. Talos deprecated it in
    // 1.14 (`common.Metadata` is marked for removal in v2.0), so a reply that does not answer each
    // node named once is refused here as a whole ([`TalosError::Decode`]) and the caller asks node
    // by node instead.

    /// `Version` of each node in `nodes`, in one call this client's apid fans out. `Err` when the
    /// call as a whole failed or was not fanned out; otherwise each node's own answer or error (named
    /// `node <ip> via <this endpoint>`, as a relayed client names it).
    pub async fn versions_of(
        &self,
        nodes: &[IpAddr],
    ) -> Result<Vec<(IpAddr, Result<VersionInfo>)>> {
        let request = self.many_request((), nodes)?;
        let resp = self
            .unary("Version", self.machine().version(request))
            .await?;
        self.each_once("Version", nodes, resp.messages, |_, message| {
            Ok(VersionInfo::from(message))
        })
    }

    /// `EtcdStatus` of each control plane in `nodes`, in one call (see [`TalosClient::versions_of`]).
    pub async fn etcd_statuses_of(
        &self,
        nodes: &[IpAddr],
    ) -> Result<Vec<(IpAddr, Result<EtcdMemberStatus>)>> {
        let request = self.many_request((), nodes)?;
        let resp = self
            .unary("EtcdStatus", self.machine().etcd_status(request))
            .await?;
        self.each_once("EtcdStatus", nodes, resp.messages, |node, status| {
            status
                .member_status
                .map(EtcdMemberStatus::from)
                .ok_or_else(|| node.decode_error("EtcdStatus: reply without member_status"))
        })
    }

    /// `EtcdMemberList` as each control plane in `nodes` reports it, in one call (see
    /// [`TalosClient::versions_of`]).
    pub async fn etcd_member_lists_of(
        &self,
        nodes: &[IpAddr],
    ) -> Result<Vec<(IpAddr, Result<Vec<EtcdMember>>)>> {
        let req = machine::EtcdMemberListRequest { query_local: false };
        let request = self.many_request(req, nodes)?;
        let resp = self
            .unary("EtcdMemberList", self.machine().etcd_member_list(request))
            .await?;
        self.each_once("EtcdMemberList", nodes, resp.messages, |_, members| {
            Ok(members.members.into_iter().map(EtcdMember::from).collect())
        })
    }

    /// The boot id of each node in `nodes` (`MachineService.Read`, streamed), in one call this
    /// client's apid fans out: each node's chunks come stamped with its name, and a node that cannot
    /// be read adds one message carrying only the error. See [`TalosClient::versions_of`].
    pub async fn boot_ids_of(&self, nodes: &[IpAddr]) -> Result<Vec<(IpAddr, Result<String>)>> {
        let req = machine::ReadRequest {
            path: BOOT_ID_PATH.to_owned(),
        };
        let request = self.many_request(req, nodes)?;
        let read = async {
            let mut stream = self.open(self.machine().read(request)).await?;
            let mut chunks = Vec::new();
            while let Some(chunk) = stream.next().await {
                chunks.push(chunk.map_err(|st| TalosError::from_status(&self.endpoint, &st))?);
            }
            Ok(chunks)
        };
        let chunks = self.within("Read", self.request_timeout, read).await?;
        let mut read: Vec<(IpAddr, TalosClient, Result<Vec<u8>>)> = nodes
            .iter()
            .map(|node| Ok((*node, self.relayed_to(*node)?, Ok(Vec::new()))))
            .collect::<Result<_>>()?;
        for chunk in chunks {
            let Some(index) = self.answering(nodes, chunk.metadata.as_ref()) else {
                return Err(self.not_fanned_out("Read", nodes.len()));
            };
            let (_, node, bytes) = &mut read[index];
            match node.check_metadata(chunk.metadata.as_ref()) {
                Err(error) => *bytes = Err(error),
                Ok(()) => {
                    if let Ok(bytes) = bytes {
                        bytes.extend_from_slice(&chunk.bytes);
                    }
                }
            }
        }
        Ok(read
            .into_iter()
            .map(|(address, node, bytes)| {
                (address, bytes.and_then(|bytes| node.boot_id_from(bytes)))
            })
            .collect())
    }

    /// A request naming `nodes` for apid to fan out to, sent to this client's own apid (never
    /// through a relay: apid does not fan a call it was asked to forward).
    fn many_request<T>(&self, message: T, nodes: &[IpAddr]) -> Result<tonic::Request<T>> {
        if self.node.is_some() || nodes.is_empty() {
            return Err(TalosError::InvalidArgument {
                endpoint: self.endpoint.to_string(),
                message: "a call fanned out to several nodes goes to a control plane's own apid, \
                          naming at least one node"
                    .into(),
            });
        }
        let mut req = tonic::Request::new(message);
        // One header field per node, as grpc-go's `metadata.AppendToOutgoingContext` sends them
        // (talosctl's `client.WithNodes`): apid reads the key's values, it does not split on commas.
        for node in nodes {
            let value =
                node_header(&node.to_string()).map_err(|message| TalosError::InvalidArgument {
                    endpoint: self.endpoint.to_string(),
                    message,
                })?;
            req.metadata_mut().append("nodes", value);
        }
        req.set_timeout(self.request_timeout);
        Ok(req)
    }

    /// Which of `nodes` a fanned-out message answers for, by its `metadata.hostname` (the node as it
    /// was named in the request).
    fn answering(&self, nodes: &[IpAddr], metadata: Option<&common::Metadata>) -> Option<usize> {
        let hostname: IpAddr = metadata?.hostname.trim().parse().ok()?;
        nodes.iter().position(|node| *node == hostname)
    }

    /// Each node's answer in a fanned-out unary reply, which must hold exactly one message for each
    /// node named (anything else is not a fan-out this client understands: the whole call fails).
    fn each_once<M: Reply, T>(
        &self,
        op: &str,
        nodes: &[IpAddr],
        messages: Vec<M>,
        decode: impl Fn(&TalosClient, M) -> Result<T>,
    ) -> Result<Vec<(IpAddr, Result<T>)>> {
        let mut answers: Vec<Option<M>> = nodes.iter().map(|_| None).collect();
        for message in messages {
            let Some(index) = self.answering(nodes, message.metadata()) else {
                return Err(self.not_fanned_out(op, nodes.len()));
            };
            if answers[index].replace(message).is_some() {
                return Err(self.not_fanned_out(op, nodes.len()));
            }
        }
        nodes
            .iter()
            .zip(answers)
            .map(|(address, message)| {
                let node = self.relayed_to(*address)?;
                let message = message.ok_or_else(|| self.not_fanned_out(op, nodes.len()))?;
                let answer = node
                    .check_metadata(message.metadata())
                    .and_then(|()| decode(&node, message));
                Ok((*address, answer))
            })
            .collect()
    }

    fn not_fanned_out(&self, op: &str, nodes: usize) -> TalosError {
        self.decode_error(&format!(
            "{op}: the reply to a call fanned out to {nodes} nodes does not answer each of them once"
        ))
    }

    // ----- MachineService -----

    /// Talos version, platform and features of the node.
    pub async fn version(&self) -> Result<VersionInfo> {
        let resp = self
            .unary("Version", self.machine().version(self.request(())))
            .await?;
        Ok(self.single("Version", resp.messages)?.into())
    }

    /// Talos services and their state.
    pub async fn service_list(&self) -> Result<Vec<ServiceInfo>> {
        let resp = self
            .unary("ServiceList", self.machine().service_list(self.request(())))
            .await?;
        let list = self.single("ServiceList", resp.messages)?;
        Ok(list.services.into_iter().map(ServiceInfo::from).collect())
    }

    /// Status of this node's etcd member. Workers answer [`TalosError::Unimplemented`].
    pub async fn etcd_status(&self) -> Result<EtcdMemberStatus> {
        let resp = self
            .unary("EtcdStatus", self.machine().etcd_status(self.request(())))
            .await?;
        let status = self.single("EtcdStatus", resp.messages)?;
        status
            .member_status
            .map(EtcdMemberStatus::from)
            .ok_or_else(|| self.decode_error("EtcdStatus: reply without member_status"))
    }

    /// Members of the etcd cluster, as this control-plane node's etcd reports them.
    pub async fn etcd_member_list(&self) -> Result<Vec<EtcdMember>> {
        let req = machine::EtcdMemberListRequest { query_local: false };
        let resp = self
            .unary(
                "EtcdMemberList",
                self.machine().etcd_member_list(self.request(req)),
            )
            .await?;
        let members = self.single("EtcdMemberList", resp.messages)?;
        Ok(members.members.into_iter().map(EtcdMember::from).collect())
    }

    /// Move etcd leadership away from this node. Returns the new leader's name, or an empty string if
    /// this node was not the leader.
    pub async fn etcd_forfeit_leadership(&self) -> Result<String> {
        let req = machine::EtcdForfeitLeadershipRequest {};
        let resp = self
            .unary(
                "EtcdForfeitLeadership",
                self.machine().etcd_forfeit_leadership(self.request(req)),
            )
            .await?;
        Ok(self.single("EtcdForfeitLeadership", resp.messages)?.member)
    }

    /// Open a snapshot of this control plane's etcd database (`MachineService.EtcdSnapshot`, what
    /// `talosctl etcd snapshot` reads): the server streams the database in chunks, read with
    /// [`SnapshotStream::next_chunk`]. Needs `os:admin`, `os:operator` or `os:etcd:backup`; a worker
    /// answers [`TalosError::Unimplemented`]. Opening is bounded by the request timeout, the whole
    /// stream by the long request timeout (sent as `grpc-timeout`, so the node stops when we do).
    pub async fn etcd_snapshot(&self) -> Result<SnapshotStream> {
        let req = machine::EtcdSnapshotRequest {};
        let mut machine = self.machine();
        let open = self.open(machine.etcd_snapshot(self.long_request(req)));
        let inner = self
            .within("EtcdSnapshot", self.request_timeout, open)
            .await?;
        Ok(SnapshotStream {
            inner,
            client: self.clone(),
            deadline: tokio::time::Instant::now() + self.long_request_timeout,
        })
    }

    /// Legacy in-place upgrade (`MachineService.Upgrade`, all Talos 1.x; deprecated in 1.13). The node
    /// pulls and validates `image` before answering (bounded by the long request timeout), then runs
    /// the upgrade sequence asynchronously. Returns the sequence's actor id, which its events carry.
    pub async fn upgrade_legacy(
        &self,
        image: &str,
        options: &LegacyUpgradeOptions,
    ) -> Result<String> {
        let req = machine::UpgradeRequest {
            image: image.to_owned(),
            preserve: options.preserve,
            stage: options.stage,
            force: options.force,
            reboot_mode: options.reboot_mode as i32,
        };
        let mut machine = self.machine();
        let fut = machine.upgrade(self.long_request(req));
        let resp = self
            .bounded("Upgrade", self.long_request_timeout, fut)
            .await?;
        Ok(self.single("Upgrade", resp.messages)?.actor_id)
    }

    /// Reboot the node. Returns the reboot sequence's actor id.
    pub async fn reboot(&self, mode: RebootMode) -> Result<String> {
        let req = machine::RebootRequest { mode: mode as i32 };
        let resp = self
            .unary("Reboot", self.machine().reboot(self.request(req)))
            .await?;
        Ok(self.single("Reboot", resp.messages)?.actor_id)
    }

    /// Boot the previous A/B slot; the node reboots (no actor id).
    pub async fn rollback(&self) -> Result<()> {
        let req = machine::RollbackRequest {};
        let resp = self
            .unary("Rollback", self.machine().rollback(self.request(req)))
            .await?;
        // The reply carries nothing but metadata; an empty list is fine too.
        if let Some(first) = resp.messages.first() {
            self.check_metadata(first.metadata.as_ref())?;
        }
        Ok(())
    }

    /// The kernel boot id (changes on every boot), read via `MachineService.Read`. Needs `os:admin`.
    pub async fn boot_id(&self) -> Result<String> {
        let req = machine::ReadRequest {
            path: BOOT_ID_PATH.to_owned(),
        };
        let read = async {
            let mut stream = self.open(self.machine().read(self.request(req))).await?;
            let mut bytes = Vec::new();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|st| TalosError::from_status(&self.endpoint, &st))?;
                self.check_metadata(chunk.metadata.as_ref())?;
                bytes.extend_from_slice(&chunk.bytes);
            }
            Ok(bytes)
        };
        let bytes = self.within("Read", self.request_timeout, read).await?;
        self.boot_id_from(bytes)
    }

    fn boot_id_from(&self, bytes: Vec<u8>) -> Result<String> {
        let text =
            String::from_utf8(bytes).map_err(|_| self.decode_error("boot id is not UTF-8 text"))?;
        let id = text.trim();
        if id.is_empty() {
            return Err(self.decode_error("boot id is empty"));
        }
        Ok(id.to_owned())
    }

    /// Apply a full machine config (all YAML documents). `Auto` lets the node decide between a live
    /// apply and a reboot; `NoReboot` fails with [`TalosError::InvalidArgument`] if a reboot is needed.
    pub async fn apply_configuration(
        &self,
        data: Vec<u8>,
        mode: ApplyMode,
        dry_run: bool,
    ) -> Result<ApplyOutcome> {
        let req = machine::ApplyConfigurationRequest {
            data,
            mode: mode as i32,
            dry_run,
            try_mode_timeout: None,
        };
        let resp = self
            .unary(
                "ApplyConfiguration",
                self.machine().apply_configuration(self.request(req)),
            )
            .await?;
        let applied = self.single("ApplyConfiguration", resp.messages)?;
        let mode = ApplyMode::try_from(applied.mode).map_err(|_| {
            self.decode_error(&format!(
                "ApplyConfiguration: unknown mode {}",
                applied.mode
            ))
        })?;
        Ok(ApplyOutcome {
            mode,
            warnings: applied.warnings,
            mode_details: applied.mode_details,
        })
    }

    /// Legacy unary image pull (`MachineService.ImagePull`, what `upgrade-k8s` uses to pre-pull
    /// Kubernetes images). Blocks until the image is pulled; bounded by the long request timeout.
    /// Very old nodes answer [`TalosError::Unimplemented`]. A missing image is [`TalosError::NotFound`].
    pub async fn image_pull_legacy(
        &self,
        reference: &str,
        namespace: ContainerdNamespace,
    ) -> Result<()> {
        let req = machine::ImagePullRequest {
            namespace: namespace as i32,
            reference: reference.to_owned(),
        };
        let mut machine = self.machine();
        let fut = machine.image_pull(self.long_request(req));
        let resp = self
            .bounded("ImagePull", self.long_request_timeout, fut)
            .await?;
        if let Some(first) = resp.messages.first() {
            self.check_metadata(first.metadata.as_ref())?;
        }
        Ok(())
    }

    /// Open the node's runtime event stream. The "hello" event the server sends first is consumed
    /// here, so the stream yields only real events. Opening is bounded by the request timeout; the
    /// stream itself is not.
    ///
    /// To observe an upgrade or reboot, open the stream before acting (talosctl does), so no event is
    /// missed.
    pub async fn events(&self, options: EventsOptions) -> Result<EventStream> {
        let req = machine::EventsRequest {
            tail_events: options.tail_events,
            tail_id: options.tail_id.unwrap_or_default(),
            tail_seconds: options
                .tail_seconds
                .map_or(0, |seconds| i32::try_from(seconds).unwrap_or(i32::MAX)),
            with_actor_id: options.actor_id.unwrap_or_default(),
        };
        let open = async {
            let mut stream = self
                .open(self.machine().events(self.stream_request(req)))
                .await?;
            let first = match stream.next().await {
                None => None,
                Some(Err(st)) => return Err(TalosError::from_stream_status(&self.endpoint, &st)),
                Some(Ok(raw)) => {
                    self.check_metadata(raw.metadata.as_ref())?;
                    // Normally the payload-less hello (decodes to None). Should a server skip it, keep
                    // the event instead of losing it.
                    events::decode_event(raw)
                        .map_err(|e| self.decode_error(&format!("event: {e}")))?
                }
            };
            Ok((stream, first))
        };
        let (stream, first) = self.within("Events", self.request_timeout, open).await?;
        Ok(EventStream::new(stream, self.endpoint.clone(), first))
    }

    // ----- ImageService / LifecycleService (Talos 1.13+) -----

    /// Pull `image` into containerd's system namespace with the CRI driver, as talosctl does for the
    /// installer before `LifecycleService.Upgrade`. Consumes the progress stream and returns the
    /// resolved image name. Bounded by the long request timeout.
    pub async fn image_pull(&self, image: &str) -> Result<String> {
        let req = machine::ImageServicePullRequest {
            containerd: Some(system_containerd()),
            image_ref: image.to_owned(),
        };
        let pull = async {
            let mut stream = self
                .open(self.images().pull(self.long_request(req)))
                .await?;
            let mut name = None;
            while let Some(msg) = stream.next().await {
                let msg = msg.map_err(|st| TalosError::from_status(&self.endpoint, &st))?;
                match msg.response {
                    Some(machine::image_service_pull_response::Response::Name(n)) => name = Some(n),
                    Some(machine::image_service_pull_response::Response::PullProgress(p)) => {
                        tracing::trace!(endpoint = %self.endpoint, layer = %p.layer_id, "image pull progress");
                    }
                    None => {}
                }
            }
            name.ok_or_else(|| self.decode_error("image pull ended without the image name"))
        };
        self.within("ImageService.Pull", self.long_request_timeout, pull)
            .await
    }

    /// Run the installer for `image` on the live system (`LifecycleService.Upgrade`, Talos 1.13+). This
    /// installs into the inactive boot slot; it does not drain or reboot; the caller does both.
    /// Pull the image first with [`TalosClient::image_pull`]. Bounded by the long request timeout.
    ///
    /// A non-zero installer exit code is returned as [`TalosError::UpgradeFailed`] with the last lines
    /// of installer output.
    pub async fn lifecycle_upgrade(&self, image: &str) -> Result<LifecycleUpgradeOutcome> {
        let req = machine::LifecycleServiceUpgradeRequest {
            containerd: Some(system_containerd()),
            source: Some(machine::InstallArtifactsSource {
                image_name: image.to_owned(),
            }),
        };
        let run = async {
            let mut stream = self
                .open(self.lifecycle().upgrade(self.long_request(req)))
                .await?;
            let mut messages = Vec::new();
            let mut exit_code = None;
            while let Some(msg) = stream.next().await {
                let msg = msg.map_err(|st| TalosError::from_status(&self.endpoint, &st))?;
                use machine::lifecycle_service_install_progress::Response;
                match msg.progress.and_then(|p| p.response) {
                    Some(Response::Message(line)) => messages.push(line),
                    Some(Response::ExitCode(code)) => exit_code = Some(code),
                    None => {}
                }
            }
            let exit_code = exit_code
                .ok_or_else(|| self.decode_error("installer output ended without an exit code"))?;
            if exit_code != 0 {
                let tail_start = messages.len().saturating_sub(5);
                return Err(TalosError::UpgradeFailed {
                    endpoint: self.endpoint.to_string(),
                    exit_code,
                    output_tail: messages[tail_start..].join(" | "),
                });
            }
            Ok(LifecycleUpgradeOutcome {
                exit_code,
                messages,
            })
        };
        self.within("LifecycleService.Upgrade", self.long_request_timeout, run)
            .await
    }

    // ----- COSI -----

    /// Get one resource, its spec decoded as `S`. `Ok(None)` if it does not exist.
    pub async fn cosi_get<S: prost::Message + Default>(
        &self,
        namespace: &str,
        resource_type: &str,
        id: &str,
    ) -> Result<Option<CosiResource<S>>> {
        let req = cosi_pb::GetRequest {
            namespace: namespace.to_owned(),
            r#type: resource_type.to_owned(),
            id: id.to_owned(),
            options: Some(cosi_pb::GetOptions {}),
        };
        // What the call's own trace line (`talos_api::call`) does not name: which resource.
        tracing::trace!(target: "talos_api::cosi", resource_type, id, "COSI Get");
        let resp = match self
            .unary("COSI Get", self.cosi().get(self.request(req)))
            .await
        {
            Ok(resp) => resp,
            Err(TalosError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let resource = resp
            .resource
            .ok_or_else(|| self.decode_error("COSI Get: reply without resource"))?;
        cosi::decode_resource(resource)
            .map(Some)
            .map_err(|m| self.decode_error(&m))
    }

    /// List all resources of a type in a namespace. Bounded by the request timeout.
    pub async fn cosi_list<S: prost::Message + Default>(
        &self,
        namespace: &str,
        resource_type: &str,
    ) -> Result<Vec<CosiResource<S>>> {
        let req = cosi_pb::ListRequest {
            namespace: namespace.to_owned(),
            r#type: resource_type.to_owned(),
            options: Some(cosi_pb::ListOptions::default()),
        };
        let list = async {
            let mut stream = self.open(self.cosi().list(self.request(req))).await?;
            let mut out = Vec::new();
            while let Some(msg) = stream.next().await {
                let msg = msg.map_err(|st| TalosError::from_status(&self.endpoint, &st))?;
                if let Some(resource) = msg.resource {
                    out.push(cosi::decode_resource(resource).map_err(|m| self.decode_error(&m))?);
                }
            }
            Ok(out)
        };
        self.within("COSI List", self.request_timeout, list).await
    }

    /// Watch one resource (`id: Some`) or a whole type (`id: None`).
    ///
    /// A single-resource watch first yields the current state (`Created`, or `Destroyed` with a
    /// tombstone if it does not exist), then changes. A type watch with `bootstrap = true` first
    /// yields `Created` for every existing resource and then one `Bootstrapped`. `bootstrap` is
    /// invalid with an id. The "watch established" message is consumed here; opening is bounded by the
    /// request timeout, the stream is not.
    pub async fn cosi_watch<S: prost::Message + Default>(
        &self,
        namespace: &str,
        resource_type: &str,
        id: Option<&str>,
        bootstrap: bool,
    ) -> Result<CosiWatchStream<S>> {
        if id.is_some() && bootstrap {
            return Err(TalosError::InvalidArgument {
                endpoint: self.endpoint.to_string(),
                message: "bootstrap contents are only available for a watch of a whole type".into(),
            });
        }
        let req = cosi_pb::WatchRequest {
            namespace: namespace.to_owned(),
            r#type: resource_type.to_owned(),
            id: id.map(str::to_owned),
            options: Some(cosi_pb::WatchOptions {
                bootstrap_contents: bootstrap,
                ..Default::default()
            }),
            // 1: the server sends BOOTSTRAPPED and ERRORED events (the Go client sends 1 too).
            api_version: 1,
        };
        let open = async {
            let mut stream = self.open(self.cosi_watch_call(req)).await?;
            // The server's first response has no events and only confirms the watch; if one does
            // carry events, keep them.
            let first = match stream.next().await {
                None => VecDeque::new(),
                Some(Err(st)) => return Err(TalosError::from_stream_status(&self.endpoint, &st)),
                Some(Ok(resp)) => resp.event.into(),
            };
            Ok((stream, first))
        };
        let (stream, first) = self
            .within("COSI Watch", self.request_timeout, open)
            .await?;
        Ok(CosiWatchStream::new(stream, self.endpoint.clone(), first))
    }

    /// The node's machine status (stage and readiness).
    pub async fn machine_status(&self) -> Result<runtime_pb::MachineStatusSpec> {
        use resources::machine_status as r;
        Ok(self
            .cosi_get_required(r::NAMESPACE, r::TYPE, r::ID)
            .await?
            .spec)
    }

    /// The Talos version from the `Versions.runtime.talos.dev` resource (Talos 1.10+). `Ok(None)` on
    /// nodes that do not have it (older Talos answers PermissionDenied "resource type ... is not
    /// supported"); use [`TalosClient::version`] there.
    pub async fn talos_version_resource(&self) -> Result<Option<String>> {
        use resources::version as r;
        match self
            .cosi_get::<runtime_pb::VersionSpec>(r::NAMESPACE, r::TYPE, r::ID)
            .await
        {
            Ok(found) => Ok(found.map(|res| res.spec.version)),
            Err(TalosError::PermissionDenied { message, .. })
                if message.contains("not supported") =>
            {
                Ok(None)
            }
            Err(TalosError::Unimplemented { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The active machine config (all YAML documents, byte-exact). Needs `os:admin`.
    pub async fn machine_config(&self) -> Result<MachineConfigBytes> {
        use resources::machine_config as r;
        let res = self
            .cosi_get_required::<config_pb::MachineConfigSpec>(r::NAMESPACE, r::TYPE, r::ID_ACTIVE)
            .await?;
        Ok(MachineConfigBytes::new(res.spec.yaml_marshalled))
    }

    /// The machine's role.
    pub async fn machine_type(&self) -> Result<MachineType> {
        use resources::machine_type as r;
        let res = self
            .cosi_get_required::<config_pb::MachineTypeSpec>(r::NAMESPACE, r::TYPE, r::ID)
            .await?;
        Ok(res.spec.machine_type())
    }

    /// The node's Kubernetes node name.
    pub async fn nodename(&self) -> Result<String> {
        use resources::nodename as r;
        let res = self
            .cosi_get_required::<k8s_pb::NodenameSpec>(r::NAMESPACE, r::TYPE, r::ID)
            .await?;
        Ok(res.spec.nodename)
    }

    async fn cosi_get_required<S: prost::Message + Default>(
        &self,
        namespace: &str,
        resource_type: &str,
        id: &str,
    ) -> Result<CosiResource<S>> {
        self.cosi_get(namespace, resource_type, id)
            .await?
            .ok_or_else(|| TalosError::NotFound {
                endpoint: self.endpoint.to_string(),
                message: format!("resource {namespace}/{resource_type}/{id} does not exist"),
            })
    }

    // ----- plumbing -----

    fn machine(&self) -> MachineServiceClient<Channel> {
        MachineServiceClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    fn images(&self) -> ImageServiceClient<Channel> {
        ImageServiceClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    fn lifecycle(&self) -> LifecycleServiceClient<Channel> {
        LifecycleServiceClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    fn cosi(&self) -> StateClient<Channel> {
        StateClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }

    /// `State.Watch` as the generated client makes it, with [`WatchCodec`]'s decode buffer: a watch
    /// stays open for as long as it follows its resource, each with its buffer.
    async fn cosi_watch_call(
        &self,
        req: cosi_pb::WatchRequest,
    ) -> std::result::Result<tonic::Response<tonic::Streaming<cosi_pb::WatchResponse>>, tonic::Status>
    {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE);
        grpc.ready()
            .await
            .map_err(|error| tonic::Status::unknown(format!("Service was not ready: {error}")))?;
        let mut request = self.stream_request(req);
        request
            .extensions_mut()
            .insert(tonic::GrpcMethod::new("cosi.resource.State", "Watch"));
        grpc.server_streaming(
            request,
            http::uri::PathAndQuery::from_static("/cosi.resource.State/Watch"),
            WatchCodec,
        )
        .await
    }

    /// A request with the `node` header (when proxying) and the request timeout as `grpc-timeout`, so
    /// the server gives up when we do.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        self.request_with_timeout(message, Some(self.request_timeout))
    }

    fn long_request<T>(&self, message: T) -> tonic::Request<T> {
        self.request_with_timeout(message, Some(self.long_request_timeout))
    }

    /// For long-lived streams (events, watches): no `grpc-timeout`, because the server applies it to
    /// the whole stream and would cut it off.
    fn stream_request<T>(&self, message: T) -> tonic::Request<T> {
        self.request_with_timeout(message, None)
    }

    fn request_with_timeout<T>(&self, message: T, timeout: Option<Duration>) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        if let Some(node) = &self.node {
            req.metadata_mut().insert("node", node.clone());
        }
        if let Some(timeout) = timeout {
            req.set_timeout(timeout);
        }
        req
    }

    /// A unary call bounded by the request timeout.
    fn unary<R, F>(
        &self,
        op: &'static str,
        call: F,
    ) -> impl Future<Output = Result<R>> + use<'_, R, F>
    where
        F: Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        self.bounded(op, self.request_timeout, call)
    }

    fn bounded<R, F>(
        &self,
        op: &'static str,
        timeout: Duration,
        call: F,
    ) -> impl Future<Output = Result<R>> + use<'_, R, F>
    where
        F: Future<Output = std::result::Result<tonic::Response<R>, tonic::Status>>,
    {
        let endpoint = &self.endpoint;
        self.within(op, timeout, async move {
            call.await
                .map(tonic::Response::into_inner)
                .map_err(|st| TalosError::from_status(endpoint, &st))
        })
    }

    /// Run `fut` bounded by `timeout`; on expiry the call is dropped (which cancels it on the wire).
    ///
    /// The call's own future (tonic's and the channel's, about 8 KB in a debug build) goes to the
    /// heap as the call is made, not when it is first polled: a look that joins several calls, or
    /// chooses between them, then holds one pointer per call rather than the space of every call it
    /// might make, in every reconcile future at once (docs/performance.md, "Memory").
    fn within<R, F>(
        &self,
        op: &'static str,
        timeout: Duration,
        fut: F,
    ) -> impl Future<Output = Result<R>> + use<'_, R, F>
    where
        F: Future<Output = Result<R>>,
    {
        let fut = Box::pin(fut);
        async move {
            let result = match tokio::time::timeout(timeout, fut).await {
                Ok(result) => result,
                Err(_) => Err(TalosError::Timeout {
                    endpoint: self.endpoint.to_string(),
                    message: format!("{op} did not complete within {timeout:?}"),
                }),
            };
            let code = result.as_ref().map_or_else(TalosError::code, |_| "OK");
            // One line per call at trace level, for reading which looks ask what (every call, the
            // read-only ones included, which the simulators do not record).
            tracing::trace!(
                target: "talos_api::call",
                op,
                endpoint = %self.endpoint,
                node = self.node.as_ref().and_then(|node| node.to_str().ok()).unwrap_or(""),
                code
            );
            if let Some(observer) = &self.observer {
                observer.observe(op, code);
            }
            result
        }
    }

    /// Await the start of a server stream (response headers).
    async fn open<R>(
        &self,
        call: impl Future<
            Output = std::result::Result<tonic::Response<tonic::Streaming<R>>, tonic::Status>,
        >,
    ) -> Result<tonic::Streaming<R>> {
        call.await
            .map(tonic::Response::into_inner)
            .map_err(|st| TalosError::from_stream_status(&self.endpoint, &st))
    }

    /// The first message of a unary envelope (`messages[0]`), after checking its `metadata.error`.
    fn single<M: Reply>(&self, op: &str, messages: Vec<M>) -> Result<M> {
        let count = messages.len();
        let first = messages
            .into_iter()
            .next()
            .ok_or_else(|| self.decode_error(&format!("{op}: reply has no messages")))?;
        if count > 1 {
            // Only one-to-many proxying (header `nodes`) produces more, which the single-node calls
            // never ask for (the `*_of` calls read those replies).
            tracing::debug!(endpoint = %self.endpoint, op, count, "ignoring extra reply messages");
        }
        self.check_metadata(first.metadata())?;
        Ok(first)
    }

    fn check_metadata(&self, metadata: Option<&common::Metadata>) -> Result<()> {
        match events::metadata_error(&self.endpoint, metadata) {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    fn decode_error(&self, message: &str) -> TalosError {
        TalosError::Decode {
            endpoint: self.endpoint.to_string(),
            message: message.to_owned(),
        }
    }
}

/// The chunks of an etcd snapshot being streamed ([`TalosClient::etcd_snapshot`]).
pub struct SnapshotStream {
    inner: tonic::Streaming<common::Data>,
    client: TalosClient,
    deadline: tokio::time::Instant,
}

impl SnapshotStream {
    /// The next chunk, `None` at the end of the snapshot. A stream cut short (the node went away, it
    /// answered an error midway) is an `Err`, never a short `None`.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>> {
        let next = tokio::time::timeout_at(self.deadline, self.inner.message()).await;
        let chunk = match next {
            Err(_) => {
                return Err(TalosError::Timeout {
                    endpoint: self.client.endpoint.to_string(),
                    message: "EtcdSnapshot did not complete within the long request timeout"
                        .to_owned(),
                });
            }
            Ok(Err(st)) => return Err(TalosError::from_stream_status(&self.client.endpoint, &st)),
            Ok(Ok(None)) => return Ok(None),
            Ok(Ok(Some(chunk))) => chunk,
        };
        self.client.check_metadata(chunk.metadata.as_ref())?;
        Ok(Some(chunk.bytes))
    }
}

impl std::fmt::Debug for SnapshotStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotStream")
            .field("endpoint", &self.client.endpoint)
            .finish_non_exhaustive()
    }
}

/// An inner reply message: field 1 is always `common.Metadata`.
trait Reply {
    fn metadata(&self) -> Option<&common::Metadata>;
}

macro_rules! replies {
    ($($ty:ty),* $(,)?) => {
        $(impl Reply for $ty {
            fn metadata(&self) -> Option<&common::Metadata> {
                self.metadata.as_ref()
            }
        })*
    };
}

replies!(
    machine::Version,
    machine::ServiceList,
    machine::EtcdStatus,
    machine::EtcdMembers,
    machine::EtcdForfeitLeadership,
    machine::Upgrade,
    machine::Reboot,
    machine::ApplyConfiguration,
);

/// containerd instance talosctl uses for the installer: CRI driver, `system` namespace.
fn system_containerd() -> common::ContainerdInstance {
    common::ContainerdInstance {
        driver: common::ContainerDriver::Cri as i32,
        namespace: common::ContainerdNamespace::NsSystem as i32,
    }
}

/// A target resolved: what to dial, how errors name it, and the `node` header.
struct Resolved {
    /// `host:port` to dial.
    authority: String,
    /// The target as errors name it.
    label: String,
    node: Option<AsciiMetadataValue>,
}

fn resolve(target: &Target, options: &ConnectOptions) -> Result<Resolved> {
    let (authority, label, node) = match target {
        Target::Node(ip) => {
            let addr = SocketAddr::new(*ip, options.port).to_string();
            (addr.clone(), addr, None)
        }
        Target::Endpoint(endpoint) => {
            let authority = endpoint_authority(endpoint, options.port)?;
            (authority.clone(), authority, None)
        }
        Target::ViaEndpoint { endpoint, node } => {
            let authority = endpoint_authority(endpoint, options.port)?;
            let (label, value) = relayed(node, &authority)?;
            (authority, label, Some(value))
        }
    };
    Ok(Resolved {
        authority,
        label,
        node,
    })
}

/// Turn a resolved target into an endpoint and its TLS connector.
fn prepare(tls: &TalosTls, resolved: Resolved, options: &ConnectOptions) -> Result<Prepared> {
    let Resolved {
        authority,
        label,
        node,
    } = resolved;
    let host = authority
        .rsplit_once(':')
        .map_or(authority.as_str(), |(host, _)| host);
    let connector = TlsConnector {
        tls: tls.clone(),
        authority: authority.as_str().into(),
        server_name: TlsConnector::server_name(host, options.server_name.as_deref())?,
        connect_timeout: options.connect_timeout,
        dead_peer: options.dead_peer,
    };
    let invalid = |what: &str| TalosError::Config(format!("Talos endpoint {label}: {what}"));
    // The connector makes the TLS connection itself, so tonic is given a plain `http` address to dial
    // and told, through the origin, that requests go to `https` (the `:scheme` apid sees).
    let origin: tonic::codegen::http::Uri = format!("https://{authority}")
        .parse()
        .map_err(|_| invalid("not a valid address"))?;
    let endpoint = Endpoint::from_shared(format!("http://{authority}"))
        .map_err(|_| invalid("not a valid address"))?
        // No HTTP/2 keepalive pings: the socket's TCP keepalive finds a vanished node instead
        // (`DeadPeerDetection`, which says why).
        .origin(origin);
    Ok(Prepared {
        endpoint,
        connector,
        label: label.into(),
        node,
    })
}

/// How errors name `node` reached through the apid at `via`, and the `node` header asking `via` to
/// relay each call to it.
fn relayed(node: &str, via: &str) -> Result<(String, AsciiMetadataValue)> {
    let label = format!("node {node} via {via}");
    let header = node_header(node).map_err(|message| TalosError::InvalidArgument {
        endpoint: label.clone(),
        message,
    })?;
    Ok((label, header))
}

fn node_header(node: &str) -> std::result::Result<AsciiMetadataValue, String> {
    let node = node.trim();
    if node.is_empty() {
        return Err("node name is empty".into());
    }
    AsciiMetadataValue::try_from(node)
        .map_err(|_| format!("node {node:?} is not a valid header value"))
}

/// `host:port` for an endpoint written as in a talosconfig: `10.0.0.2`, `10.0.0.2:50001`, `host`,
/// `host:port`, `fd00::1`, `[fd00::1]`, `[fd00::1]:50001` or `https://host[:port][/]`.
fn endpoint_authority(raw: &str, default_port: u16) -> Result<String> {
    let invalid = |why: &str| TalosError::Config(format!("Talos endpoint {raw:?}: {why}"));
    let mut s = raw.trim();
    if let Some(rest) = s.strip_prefix("https://") {
        s = rest;
    } else if s.contains("://") {
        return Err(invalid("only https:// URLs are supported"));
    }
    let s = s.strip_suffix('/').unwrap_or(s);
    if s.is_empty() {
        return Err(invalid("empty address"));
    }
    if s.contains('/') {
        return Err(invalid("an endpoint has no path"));
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, default_port).to_string());
    }
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr.to_string());
    }
    if let Some(inner) = s.strip_prefix('[').and_then(|v| v.strip_suffix(']')) {
        let ip: IpAddr = inner
            .parse()
            .map_err(|_| invalid("not an IPv6 address in brackets"))?;
        return Ok(SocketAddr::new(ip, default_port).to_string());
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((host, port)) => {
            let port: u16 = port.parse().map_err(|_| invalid("port is not a number"))?;
            (host, port)
        }
        None => (s, default_port),
    };
    let valid_host = !host.is_empty()
        && host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
    if !valid_host {
        return Err(invalid("not a valid host name"));
    }
    Ok(format!("{host}:{port}"))
}

/// How large a watch's decode buffer starts: one COSI watch event of a small resource (a machine
/// status is a few hundred bytes). tonic starts every stream's buffer at 8 KiB
/// (`tonic::codec::DEFAULT_CODEC_BUFFER_SIZE`) and keeps it for the stream's life; the buffer still
/// grows for a larger message.
const WATCH_BUFFER: usize = 1024;

/// prost's codec for `State.Watch`, with a [`WATCH_BUFFER`] decode buffer.
#[derive(Debug, Clone, Copy, Default)]
struct WatchCodec;

impl tonic::codec::Codec for WatchCodec {
    type Encode = cosi_pb::WatchRequest;
    type Decode = cosi_pb::WatchResponse;
    type Encoder = tonic_prost::ProstEncoder<cosi_pb::WatchRequest>;
    type Decoder = tonic_prost::ProstDecoder<cosi_pb::WatchResponse>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstCodec::<Self::Encode, Self::Decode>::raw_encoder(
            tonic::codec::BufferSettings::default(),
        )
    }

    fn decoder(&mut self) -> Self::Decoder {
        // tonic's own yield threshold (`DEFAULT_YIELD_THRESHOLD`, not exported).
        let default_yield = 32 * 1024;
        tonic_prost::ProstCodec::<Self::Encode, Self::Decode>::raw_decoder(
            tonic::codec::BufferSettings::new(WATCH_BUFFER, default_yield),
        )
    }
}

#[cfg(test)]
mod tests;
