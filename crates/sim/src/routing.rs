//! What apid does before a call reaches machined: authorization, `node`/`nodes` proxying
//! (talos-api.md §1.5), and — simulator only — injected call failures and the call record.
//!
//! Every node serves the API of every other node in-process: a `node: <ip|name>` header routes the
//! call to that node's state, as one-to-one proxying would (control planes only; a down target answers
//! `Unavailable`). `nodes: a,b` fans MachineService and ClusterService calls out, as apid's one-to-many
//! mode does (talos v1.14.1 `internal/app/apid/pkg/director/director.go`, which allows it for those
//! services and refuses it with `InvalidArgument` for the others): unary replies are aggregated with
//! `metadata.hostname` / `metadata.error`; the messages of streamed replies are merged as they come, each
//! stamped with `metadata.hostname`, and a node that cannot be reached or whose stream fails adds one
//! message carrying only `metadata.error` (`internal/app/apid/pkg/backend/apid.go` `AppendInfo` and
//! `BuildError` with `streaming` set).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Status};

use super::auth::{self, PeerIdentity};
use super::cluster::Cluster;
use super::node::Node;
use super::record::CallId;
use talos_api::proto::{cluster, common, google, machine};

/// Per-endpoint context shared by the service implementations of one node's server.
#[derive(Debug, Clone)]
pub(crate) struct ApiContext {
    pub cluster: Arc<Cluster>,
    /// The node whose port received the connection.
    pub endpoint: Arc<Node>,
}

/// Where a call goes.
pub(crate) enum Targets {
    /// This node's own state, or one proxied node.
    One(Arc<Node>),
    /// One-to-many: each entry is the header value (apid's `hostname`) and the node or the error
    /// reaching it.
    Many(Vec<(String, Result<Arc<Node>, Status>)>),
}

/// How a method may be proxied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proxy {
    /// Unary MachineService methods: `node` and `nodes`.
    Unary,
    /// Streaming methods: `node`, and `nodes` for MachineService and ClusterService (apid refuses it
    /// for ImageService and LifecycleService).
    Streaming,
    /// COSI: `node` only; `nodes` is refused by apid.
    Cosi,
}

fn header_values(
    req_meta: &tonic::metadata::MetadataMap,
    key: &str,
) -> Result<Vec<String>, Status> {
    let mut out = Vec::new();
    for value in req_meta.get_all(key) {
        let text = value
            .to_str()
            .map_err(|_| Status::invalid_argument(format!("{key} metadata is not valid text")))?;
        // Multiple values may arrive as repeated headers or joined with commas.
        out.extend(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string),
        );
    }
    Ok(out)
}

impl ApiContext {
    pub(crate) fn new(cluster: Arc<Cluster>, endpoint: Arc<Node>) -> Self {
        ApiContext { cluster, endpoint }
    }

    /// Authorize and route a call. `method` is the full gRPC path.
    pub(crate) fn route<T>(
        &self,
        req: &Request<T>,
        method: &str,
        proxy: Proxy,
    ) -> Result<Targets, Status> {
        let peer = peer(req)?;
        if let Err(denied) = auth::authorize(&peer, method) {
            tracing::debug!(remote = ?peer.remote, %method, "call refused: not authorized");
            return Err(denied);
        }
        if self.endpoint.is_down() {
            // A call racing the power cut: the connection is about to die anyway.
            return Err(Status::unavailable("node is shutting down"));
        }
        let meta = req.metadata();
        let nodes = header_values(meta, "nodes")?;
        if !nodes.is_empty() {
            // A worker has no apid client certificate to forward with: `Director` refuses the whole
            // call (`aggregateDirector` without a backend factory), unless it is asked about itself
            // alone, which it answers as a call with no header.
            if !self.endpoint.role.is_control_plane() {
                return match nodes.as_slice() {
                    [one]
                        if self
                            .cluster
                            .resolve(one)
                            .is_some_and(|node| node.index == self.endpoint.index) =>
                    {
                        check_injected_failure(&self.endpoint)?;
                        Ok(Targets::One(self.endpoint.clone()))
                    }
                    _ => Err(Status::permission_denied("no request forwarding")),
                };
            }
            if self.endpoint.faults.current().no_one_to_many {
                return Err(Status::invalid_argument(format!(
                    "one-2-many proxying is not supported for method {method}"
                )));
            }
            // apid's explicit list of services it fans out; COSI (`/cosi.resource.State/…`) is not
            // in it.
            return match proxy {
                Proxy::Cosi | Proxy::Streaming if !one_to_many_allowed(method) => {
                    Err(Status::invalid_argument(format!(
                        "one-2-many proxying is not supported for method {method}"
                    )))
                }
                Proxy::Cosi | Proxy::Streaming | Proxy::Unary => Ok(Targets::Many(
                    nodes
                        .into_iter()
                        .map(|n| {
                            let target = self.forward_to(&n);
                            (n, target)
                        })
                        .collect(),
                )),
            };
        }
        let node = header_values(meta, "node")?;
        match node.as_slice() {
            [] => {
                let target = self.endpoint.clone();
                check_injected_failure(&target)?;
                Ok(Targets::One(target))
            }
            [one] => Ok(Targets::One(self.forward_to(one)?)),
            _ => Err(Status::invalid_argument(
                "node metadata must be single-valued",
            )),
        }
    }

    /// One-to-one proxying to `target` (an IP or hostname): the node, or the error apid answers.
    pub(crate) fn forward_to(&self, target: &str) -> Result<Arc<Node>, Status> {
        let Some(node) = self.cluster.resolve(target) else {
            return Err(Status::unavailable(format!(
                "connection error: desc = \"transport: Error while dialing: dial tcp {target}:{}: connect: connection refused\"",
                self.cluster.port
            )));
        };
        if node.index != self.endpoint.index {
            if !self.endpoint.role.is_control_plane() {
                // Workers have no apid client certificate to forward with.
                return Err(Status::permission_denied("no request forwarding"));
            }
            if node.is_down() {
                return Err(Status::unavailable(format!(
                    "connection error: desc = \"transport: Error while dialing: dial tcp {}:{}: connect: connection refused\"",
                    node.address, self.cluster.port
                )));
            }
        }
        check_injected_failure(node)?;
        Ok(node.clone())
    }

    /// Record a mutating call on `node` as it arrives.
    pub(crate) fn record(&self, node: &Node, method: &str, params: serde_json::Value) -> CallId {
        self.cluster
            .record
            .begin(&node.name, &self.endpoint.name, method, params)
    }

    pub(crate) fn finish<T>(&self, id: CallId, result: &Result<T, Status>) {
        self.cluster.record.finish(id, outcome(result));
    }
}

/// The services apid proxies one-to-many (director.go's explicit list, of which the simulator serves
/// these two).
fn one_to_many_allowed(method: &str) -> bool {
    method.starts_with("/machine.MachineService/") || method.starts_with("/cluster.ClusterService/")
}

/// `"ok"` or `"<code>: <message>"` for the call record.
pub(crate) fn outcome<T>(result: &Result<T, Status>) -> String {
    match result {
        Ok(_) => "ok".to_string(),
        Err(status) => format!("{:?}: {}", status.code(), status.message()),
    }
}

pub(crate) fn peer<T>(req: &Request<T>) -> Result<PeerIdentity, Status> {
    req.extensions()
        .get::<PeerIdentity>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("no verified client certificate"))
}

fn check_injected_failure(node: &Node) -> Result<(), Status> {
    if node.faults.take_call_failure() {
        Err(Status::unavailable("injected fault: call failed"))
    } else {
        Ok(())
    }
}

/// A unary reply envelope: `XxxResponse { repeated Xxx messages = 1 }` with metadata at field 1 of
/// each message, so apid can aggregate replies and stamp each with the node it came from.
pub(crate) trait Envelope: Default {
    type Message: Default;
    fn messages_mut(&mut self) -> &mut Vec<Self::Message>;
    fn metadata_mut(message: &mut Self::Message) -> &mut Option<common::Metadata>;
}

macro_rules! envelope {
    ($resp:ty, $msg:ty) => {
        impl Envelope for $resp {
            type Message = $msg;
            fn messages_mut(&mut self) -> &mut Vec<$msg> {
                &mut self.messages
            }
            fn metadata_mut(message: &mut $msg) -> &mut Option<common::Metadata> {
                &mut message.metadata
            }
        }
    };
}

envelope!(machine::VersionResponse, machine::Version);
envelope!(machine::ServiceListResponse, machine::ServiceList);
envelope!(machine::EtcdStatusResponse, machine::EtcdStatus);
envelope!(machine::EtcdMemberListResponse, machine::EtcdMembers);
envelope!(
    machine::EtcdForfeitLeadershipResponse,
    machine::EtcdForfeitLeadership
);
envelope!(machine::UpgradeResponse, machine::Upgrade);
envelope!(machine::RebootResponse, machine::Reboot);
envelope!(machine::RollbackResponse, machine::Rollback);
envelope!(
    machine::ApplyConfigurationResponse,
    machine::ApplyConfiguration
);
envelope!(machine::ImagePullResponse, machine::ImagePull);
envelope!(machine::MemoryResponse, machine::Memory);
envelope!(machine::LogsContainersResponse, machine::LogsContainer);

/// Run a unary handler on the routed target(s). One target: its reply or error as is (one-to-one
/// proxying passes both through verbatim). Many: replies concatenated, each message stamped with
/// `metadata.hostname`; a failing backend contributes a message carrying only `metadata.error/status`
/// and the call itself succeeds.
pub(crate) async fn fan_out<R, F, Fut>(targets: Targets, mut handler: F) -> Result<R, Status>
where
    R: Envelope,
    F: FnMut(Arc<Node>) -> Fut,
    Fut: Future<Output = Result<R, Status>>,
{
    match targets {
        Targets::One(node) => handler(node).await,
        Targets::Many(list) => {
            let mut out = R::default();
            for (hostname, target) in list {
                let result = match target {
                    Ok(node) => handler(node).await,
                    Err(status) => Err(status),
                };
                match result {
                    Ok(mut reply) => {
                        for mut message in reply.messages_mut().drain(..) {
                            *R::metadata_mut(&mut message) = Some(common::Metadata {
                                hostname: hostname.clone(),
                                ..Default::default()
                            });
                            out.messages_mut().push(message);
                        }
                    }
                    Err(status) => {
                        let mut message = R::Message::default();
                        *R::metadata_mut(&mut message) = Some(error_metadata(&hostname, &status));
                        out.messages_mut().push(message);
                    }
                }
            }
            Ok(out)
        }
    }
}

/// What apid puts into a reply for a node it could not get an answer from (`BuildError`): the node,
/// the error as grpc-go prints it, and the status.
fn error_metadata(hostname: &str, status: &Status) -> common::Metadata {
    common::Metadata {
        hostname: hostname.to_string(),
        error: grpc_error_text(status),
        status: Some(google::rpc::Status {
            code: status.code() as i32,
            message: status.message().to_string(),
            details: Vec::new(),
        }),
    }
}

/// A status as a Go client prints the error: `rpc error: code = <Code> desc = <message>`.
pub(crate) fn grpc_error_text(status: &Status) -> String {
    format!(
        "rpc error: code = {} desc = {}",
        code_name(status.code()),
        status.message()
    )
}

/// A streamed reply message: `common.Metadata` at field 1, which apid stamps in one-to-many mode.
pub(crate) trait Stamped: Default + Send + 'static {
    fn metadata_mut(&mut self) -> &mut Option<common::Metadata>;
}

macro_rules! stamped {
    ($msg:ty) => {
        impl Stamped for $msg {
            fn metadata_mut(&mut self) -> &mut Option<common::Metadata> {
                &mut self.metadata
            }
        }
    };
}

stamped!(machine::Event);
stamped!(common::Data);
stamped!(cluster::HealthCheckProgress);

/// The reply stream of a streaming method.
pub(crate) type MessageStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Open a streaming reply on the routed target(s). One target: its stream or error as is (one-to-one
/// proxying passes both through). Many: every node's stream is opened, then their messages are
/// merged in arrival order, each stamped with `metadata.hostname`; a node that cannot be reached, or
/// whose stream ends in an error, contributes one message carrying only `metadata.error/status`.
/// The merged stream ends, successfully, when every node's stream has ended.
pub(crate) async fn fan_out_stream<T, F, Fut>(
    targets: Targets,
    mut open: F,
) -> Result<MessageStream<T>, Status>
where
    T: Stamped,
    F: FnMut(Arc<Node>) -> Fut,
    Fut: Future<Output = Result<MessageStream<T>, Status>>,
{
    let list = match targets {
        Targets::One(node) => return open(node).await,
        Targets::Many(list) => list,
    };
    let error_message = |hostname: &str, status: &Status| {
        let mut message = T::default();
        *message.metadata_mut() = Some(error_metadata(hostname, status));
        message
    };
    // Room for one error per node before anyone reads, so opening never waits on the reader.
    let (tx, rx) = mpsc::channel(list.len().max(64));
    for (hostname, target) in list {
        let opened = match target {
            Ok(node) => open(node).await,
            Err(status) => Err(status),
        };
        match opened {
            Err(status) => {
                let _ = tx.send(Ok(error_message(&hostname, &status))).await;
            }
            Ok(mut stream) => {
                let tx = tx.clone();
                tokio::spawn(async move {
                    loop {
                        let item = tokio::select! {
                            // The client went away: stop reading this node.
                            _ = tx.closed() => return,
                            item = stream.next() => item,
                        };
                        let (message, last) = match item {
                            None => return,
                            Some(Ok(mut message)) => {
                                message.metadata_mut().get_or_insert_default().hostname =
                                    hostname.clone();
                                (message, false)
                            }
                            Some(Err(status)) => (error_message(&hostname, &status), true),
                        };
                        if tx.send(Ok(message)).await.is_err() || last {
                            return;
                        }
                    }
                });
            }
        }
    }
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// grpc-go's spelling of a code, as it appears in `metadata.error`.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// The single target of a COSI, ImageService or LifecycleService call (fan-out was refused in
/// `route`).
pub(crate) fn single(targets: Targets) -> Result<Arc<Node>, Status> {
    match targets {
        Targets::One(node) => Ok(node),
        Targets::Many(_) => Err(Status::internal("unexpected one-to-many target")),
    }
}
