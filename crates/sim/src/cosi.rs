//! `cosi.resource.State` (Get/List/Watch) over a node's resource store, with the semantics of the COSI
//! runtime server Talos embeds (talos-api.md §2.2): unknown types/namespaces are PermissionDenied,
//! sensitive types need `os:admin`, a watch opens with an empty response, a single-resource watch
//! reports the current state first (CREATED or a DESTROYED tombstone), a kind watch can bootstrap
//! with the current contents and a BOOTSTRAPPED marker. Writes are not served (Unimplemented).

use std::sync::Arc;

use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::discovery::{self, ClusterChanges};
use super::node::Node;
use super::node_resources::{TypeInfo, type_info};
use super::resources::{CLUSTER_NS, Change, ChangeKind, ResourceKey, StoredResource, tombstone};
use super::routing::{ApiContext, Proxy, peer, single};
use talos_api::proto::cosi::resource as cosi;

pub(crate) const GET: &str = "/cosi.resource.State/Get";
pub(crate) const LIST: &str = "/cosi.resource.State/List";
pub(crate) const WATCH: &str = "/cosi.resource.State/Watch";

#[derive(Debug, Clone)]
pub(crate) struct StateApi {
    ctx: ApiContext,
}

impl StateApi {
    pub(crate) fn new(ctx: ApiContext) -> Self {
        StateApi { ctx }
    }

    /// Route the call and check the resource type, namespace and the caller's right to read it.
    fn resolve<T>(
        &self,
        request: &Request<T>,
        method: &str,
        namespace: &str,
        type_: &str,
    ) -> Result<(Arc<Node>, &'static TypeInfo), Status> {
        let node = single(self.ctx.route(request, method, Proxy::Cosi)?)?;
        let version = node.version();
        let info = type_info(type_)
            .filter(|t| t.served_on(&version))
            .ok_or_else(|| {
                Status::permission_denied(format!("resource type {type_:?} is not supported"))
            })?;
        if info.namespace != namespace {
            return Err(Status::permission_denied(format!(
                "namespace {namespace:?} is not supported for resource type {type_:?}"
            )));
        }
        if info.sensitive_on(&version) && !peer(request)?.roles.admin {
            return Err(Status::permission_denied(format!(
                "access to resource type {type_:?} requires the os:admin role"
            )));
        }
        if namespace == CLUSTER_NS {
            // What discovery knows is the rest of the cluster: bring it up to date before reading.
            discovery::refresh(&self.ctx.cluster, &node);
        }
        Ok((node, info))
    }
}

fn unsupported_queries(
    label_queries: usize,
    id_query: Option<&cosi::IdQuery>,
) -> Result<(), Status> {
    if label_queries > 0 || id_query.is_some_and(|q| !q.regexp.is_empty()) {
        Err(Status::unimplemented(
            "label and id queries are not supported by the simulator",
        ))
    } else {
        Ok(())
    }
}

fn event(
    kind: cosi::EventType,
    resource: Option<cosi::Resource>,
    old: Option<cosi::Resource>,
) -> cosi::WatchResponse {
    cosi::WatchResponse {
        event: vec![cosi::Event {
            resource,
            event_type: kind as i32,
            old,
            error: None,
            bookmark: None,
        }],
    }
}

fn change_event(change: &Change) -> cosi::WatchResponse {
    let kind = match change.kind {
        ChangeKind::Created => cosi::EventType::Created,
        ChangeKind::Updated => cosi::EventType::Updated,
        ChangeKind::Destroyed => cosi::EventType::Destroyed,
    };
    event(
        kind,
        Some(change.resource.to_proto()),
        change.old.as_ref().map(StoredResource::to_proto),
    )
}

type WatchStream = ReceiverStream<Result<cosi::WatchResponse, Status>>;
type ListStream = ReceiverStream<Result<cosi::ListResponse, Status>>;

#[tonic::async_trait]
impl cosi::state_server::State for StateApi {
    async fn get(
        &self,
        request: Request<cosi::GetRequest>,
    ) -> Result<Response<cosi::GetResponse>, Status> {
        let (namespace, type_, id) = {
            let r = request.get_ref();
            (r.namespace.clone(), r.r#type.clone(), r.id.clone())
        };
        let (node, _) = self.resolve(&request, GET, &namespace, &type_)?;
        let key = ResourceKey {
            namespace,
            type_,
            id,
        };
        let resource = node.store.get(&key).ok_or_else(|| {
            Status::not_found(format!(
                "resource {}({}/{}@undefined) doesn't exist",
                key.type_, key.namespace, key.id
            ))
        })?;
        Ok(Response::new(cosi::GetResponse {
            resource: Some(resource.to_proto()),
        }))
    }

    type ListStream = ListStream;

    async fn list(
        &self,
        request: Request<cosi::ListRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let r = request.get_ref().clone();
        let (node, _) = self.resolve(&request, LIST, &r.namespace, &r.r#type)?;
        if let Some(options) = &r.options {
            unsupported_queries(options.label_query.len(), options.id_query.as_ref())?;
        }
        let resources = node.store.list(&r.namespace, &r.r#type);
        let (tx, rx) = mpsc::channel(resources.len().max(1));
        for resource in resources {
            // The channel is sized for every item, so this never fails.
            let _ = tx.try_send(Ok(cosi::ListResponse {
                resource: Some(resource.to_proto()),
            }));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<cosi::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let r = request.get_ref().clone();
        let (node, _) = self.resolve(&request, WATCH, &r.namespace, &r.r#type)?;
        let options = r.options.clone().unwrap_or_default();
        if r.id.is_some() && (options.bootstrap_contents || !options.label_query.is_empty()) {
            return Err(Status::unimplemented(
                "bootstrap_contents and label queries are not supported for a single resource watch",
            ));
        }
        unsupported_queries(options.label_query.len(), options.id_query.as_ref())?;

        let (current, mut changes, generation) = node.store.watch(&r.namespace, &r.r#type);
        let mut initial = vec![cosi::WatchResponse { event: Vec::new() }];
        match &r.id {
            Some(id) => {
                let key = ResourceKey {
                    namespace: r.namespace.clone(),
                    type_: r.r#type.clone(),
                    id: id.clone(),
                };
                initial.push(match current.iter().find(|c| c.key() == &key) {
                    Some(resource) => {
                        event(cosi::EventType::Created, Some(resource.to_proto()), None)
                    }
                    None => event(cosi::EventType::Destroyed, Some(tombstone(&key)), None),
                });
            }
            None if options.bootstrap_contents => {
                for resource in &current {
                    initial.push(event(
                        cosi::EventType::Created,
                        Some(resource.to_proto()),
                        None,
                    ));
                }
                if r.api_version >= 1 {
                    initial.push(event(cosi::EventType::Bootstrapped, None, None));
                }
            }
            None => {}
        }

        let boot = node.boot_token();
        // A watch of the `cluster` namespace follows the other nodes: each change to one of them
        // refreshes this node's view, and the store reports what that changed.
        let mut cluster_changes =
            (r.namespace == CLUSTER_NS).then(|| ClusterChanges::new(&self.ctx.cluster));
        let cluster = self.ctx.cluster.clone();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(async move {
            for response in initial {
                if tx.send(Ok(response)).await.is_err() {
                    return;
                }
            }
            let wanted = |change: &Change| {
                let key = change.resource.key();
                change.generation == generation
                    && key.namespace == r.namespace
                    && key.type_ == r.r#type
                    && r.id.as_ref().is_none_or(|id| &key.id == id)
            };
            loop {
                tokio::select! {
                    biased;
                    _ = boot.cancelled() => {
                        // Flush the changes made before the power cut (e.g. stage "rebooting").
                        loop {
                            match changes.try_recv() {
                                Ok(change) if change.generation != generation => break,
                                Ok(change) => {
                                    if wanted(&change) && tx.send(Ok(change_event(&change))).await.is_err() {
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
                    _ = async { cluster_changes.as_mut().expect("guarded").changed().await },
                        if cluster_changes.is_some() => discovery::refresh(&cluster, &node),
                    received = changes.recv() => match received {
                        Ok(change) => {
                            if wanted(&change) && tx.send(Ok(change_event(&change))).await.is_err() {
                                return;
                            }
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => {
                            let _ = tx.send(Err(Status::aborted("watch buffer overrun"))).await;
                            return;
                        }
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}
