//! COSI resources (`cosi.resource.State`): typed resources, watch events, and the resource types,
//! namespaces and ids an upgrade needs.
//!
//! A resource's spec travels as `spec.proto_spec`, encoded with the Talos resource message of its
//! type (see [`resources`] for which message goes with which type). [`CosiResource<S>`] decodes it
//! with the prost type `S` the caller names.

use std::collections::{BTreeMap, VecDeque};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;

use super::error::TalosError;
use crate::proto::cosi::resource as pb;

/// Resource types, namespaces and well-known ids (Talos 1.7+; `Versions` since 1.10), with the spec
/// message each type's `proto_spec` decodes into.
pub mod resources {
    /// Namespace of machine config resources.
    pub const NS_CONFIG: &str = "config";
    /// Namespace of runtime resources (machine status, version, services, extensions).
    pub const NS_RUNTIME: &str = "runtime";
    /// Namespace of node-level Kubernetes resources (kubelet, nodename, static pods).
    pub const NS_K8S: &str = "k8s";
    /// Namespace of control-plane Kubernetes resources (component configs, manifests).
    pub const NS_CONTROLPLANE: &str = "controlplane";
    /// Namespace of etcd resources.
    pub const NS_ETCD: &str = "etcd";

    /// Machine config (Sensitive: needs `os:admin`). Spec `resource::config::MachineConfigSpec`.
    pub mod machine_config {
        pub const NAMESPACE: &str = super::NS_CONFIG;
        pub const TYPE: &str = "MachineConfigs.config.talos.dev";
        /// The config in effect.
        pub const ID_ACTIVE: &str = "v1alpha1";
        /// The config on disk; differs from the active one after a STAGED or TRY apply.
        pub const ID_PERSISTENT: &str = "persistent";
    }

    /// Machine type (init, controlplane, worker). Spec `resource::config::MachineTypeSpec`.
    pub mod machine_type {
        pub const NAMESPACE: &str = super::NS_CONFIG;
        pub const TYPE: &str = "MachineTypes.config.talos.dev";
        pub const ID: &str = "machine-type";
    }

    /// Machine stage and readiness. Spec `talos::resource::definitions::runtime::MachineStatusSpec`.
    pub mod machine_status {
        use crate::proto::talos::resource::definitions::enums::RuntimeMachineStage;
        use crate::proto::talos::resource::definitions::runtime::MachineStatusSpec;

        pub const NAMESPACE: &str = super::NS_RUNTIME;
        pub const TYPE: &str = "MachineStatuses.runtime.talos.dev";
        pub const ID: &str = "machine";

        /// Stage `running` and every readiness check met: the node finished booting and is ready (the
        /// resource's side of [`crate::EventPayload::is_running_and_ready`]).
        pub fn is_running_and_ready(status: &MachineStatusSpec) -> bool {
            status.stage() == RuntimeMachineStage::MachineStageRunning
                && status.status.as_ref().is_some_and(|s| s.ready)
        }

        /// Whether the stage takes the node down (`upgrading`, `rebooting`, `shutting down`,
        /// `resetting`: each ends in a reboot or a power-off, reference talos-api.md §1.6, "Machine
        /// stage is derived from events").
        pub fn takes_node_down(status: &MachineStatusSpec) -> bool {
            matches!(
                status.stage(),
                RuntimeMachineStage::MachineStageUpgrading
                    | RuntimeMachineStage::MachineStageRebooting
                    | RuntimeMachineStage::MachineStageShuttingDown
                    | RuntimeMachineStage::MachineStageResetting
            )
        }
    }

    /// Talos version (Talos 1.10+). Spec `talos::resource::definitions::runtime::VersionSpec`.
    pub mod version {
        pub const NAMESPACE: &str = super::NS_RUNTIME;
        pub const TYPE: &str = "Versions.runtime.talos.dev";
        pub const ID: &str = "version";
    }

    /// Talos services (id = service id such as `kubelet`, `etcd`, `apid`); destroyed when the service
    /// stops. Spec `talos::resource::definitions::v1alpha1::ServiceSpec`.
    pub mod service {
        pub const NAMESPACE: &str = super::NS_RUNTIME;
        pub const TYPE: &str = "Services.v1alpha1.talos.dev";
        pub const ID_KUBELET: &str = "kubelet";
        pub const ID_ETCD: &str = "etcd";
        pub const ID_APID: &str = "apid";
    }

    /// System extensions (any id); the Image Factory schematic is the extension named `schematic`.
    /// Spec `talos::resource::definitions::extensions::Layer`.
    pub mod extension_status {
        pub const NAMESPACE: &str = super::NS_RUNTIME;
        pub const TYPE: &str = "ExtensionStatuses.runtime.talos.dev";
    }

    /// Kubernetes node name. Spec `talos::resource::definitions::k8s::NodenameSpec`.
    pub mod nodename {
        pub const NAMESPACE: &str = super::NS_K8S;
        pub const TYPE: &str = "Nodenames.kubernetes.talos.dev";
        pub const ID: &str = "nodename";
    }

    /// Kubernetes node status (id = node name). Spec `talos::resource::definitions::k8s::NodeStatusSpec`.
    pub mod node_status {
        pub const NAMESPACE: &str = super::NS_K8S;
        pub const TYPE: &str = "NodeStatuses.kubernetes.talos.dev";
    }

    /// Kubelet spec. Spec `talos::resource::definitions::k8s::KubeletSpecSpec`.
    pub mod kubelet_spec {
        pub const NAMESPACE: &str = super::NS_K8S;
        pub const TYPE: &str = "KubeletSpecs.kubernetes.talos.dev";
        pub const ID: &str = "kubelet";
    }

    /// Rendered static pods (ids [`KUBE_APISERVER`], ...).
    /// Spec `talos::resource::definitions::k8s::StaticPodSpec`.
    pub mod static_pod {
        pub const NAMESPACE: &str = super::NS_K8S;
        pub const TYPE: &str = "StaticPods.kubernetes.talos.dev";
    }

    /// Static pod status as kubelet reports it; id `<pod-namespace>/<pod-name>`, e.g.
    /// `kube-system/kube-apiserver-<nodename>`. Spec `talos::resource::definitions::k8s::StaticPodStatusSpec`.
    pub mod static_pod_status {
        pub const NAMESPACE: &str = super::NS_K8S;
        pub const TYPE: &str = "StaticPodStatuses.kubernetes.talos.dev";

        /// The id of the status of static pod `component` (e.g. `kube-apiserver`) on node `nodename`.
        pub fn id(component: &str, nodename: &str) -> String {
            format!("kube-system/{component}-{nodename}")
        }
    }

    /// kube-apiserver config (id [`KUBE_APISERVER`]); its `metadata.version`
    /// is the pod annotation `talos.dev/config-version`. Spec `talos::resource::definitions::k8s::APIServerConfigSpec`.
    pub mod api_server_config {
        pub const NAMESPACE: &str = super::NS_CONTROLPLANE;
        pub const TYPE: &str = "APIServerConfigs.kubernetes.talos.dev";
        pub const ID: &str = super::KUBE_APISERVER;
    }

    /// kube-controller-manager config. Spec `talos::resource::definitions::k8s::ControllerManagerConfigSpec`.
    pub mod controller_manager_config {
        pub const NAMESPACE: &str = super::NS_CONTROLPLANE;
        pub const TYPE: &str = "ControllerManagerConfigs.kubernetes.talos.dev";
        pub const ID: &str = super::KUBE_CONTROLLER_MANAGER;
    }

    /// kube-scheduler config. Spec `talos::resource::definitions::k8s::SchedulerConfigSpec`.
    pub mod scheduler_config {
        pub const NAMESPACE: &str = super::NS_CONTROLPLANE;
        pub const TYPE: &str = "SchedulerConfigs.kubernetes.talos.dev";
        pub const ID: &str = super::KUBE_SCHEDULER;
    }

    /// Bootstrap manifests (ids like `10-kube-proxy`, `11-core-dns`).
    /// Spec `talos::resource::definitions::k8s::ManifestSpec`.
    pub mod manifest {
        pub const NAMESPACE: &str = super::NS_CONTROLPLANE;
        pub const TYPE: &str = "Manifests.kubernetes.talos.dev";
    }

    /// The local etcd member id (16 lowercase hex digits).
    /// Spec `talos::resource::definitions::etcd::MemberSpec`.
    pub mod etcd_member {
        pub const NAMESPACE: &str = super::NS_ETCD;
        pub const TYPE: &str = "EtcdMembers.etcd.talos.dev";
        pub const ID: &str = "local";
    }

    /// Static pod / component id of kube-apiserver.
    pub const KUBE_APISERVER: &str = "kube-apiserver";
    /// Static pod / component id of kube-controller-manager.
    pub const KUBE_CONTROLLER_MANAGER: &str = "kube-controller-manager";
    /// Static pod / component id of kube-scheduler.
    pub const KUBE_SCHEDULER: &str = "kube-scheduler";
}

/// Resource metadata.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CosiMetadata {
    pub namespace: String,
    /// Full resource type, e.g. `MachineStatuses.runtime.talos.dev`.
    pub resource_type: String,
    pub id: String,
    /// Bumped on every spec change. 0 when the server sends `undefined` (tombstones).
    pub version: u64,
    /// Controller that owns the resource.
    pub owner: String,
    /// `running` or `tearingDown`.
    pub phase: String,
    pub created: Option<jiff::Timestamp>,
    pub updated: Option<jiff::Timestamp>,
    pub finalizers: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// A resource with its spec decoded as `S`.
///
/// A watch tombstone (a `DESTROYED` event for a resource that does not exist) has no spec; its
/// `spec` is `S::default()`.
#[derive(Debug, Clone, PartialEq)]
pub struct CosiResource<S> {
    pub metadata: CosiMetadata,
    pub spec: S,
}

/// Kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CosiEventType {
    Created,
    Updated,
    Destroyed,
    /// End of the initial contents of a kind watch with `bootstrap = true`.
    Bootstrapped,
    Noop,
}

/// One watch event. `resource` is `None` only for [`CosiEventType::Bootstrapped`] and
/// [`CosiEventType::Noop`]; `old` is the previous version on [`CosiEventType::Updated`].
#[derive(Debug, Clone, PartialEq)]
pub struct CosiEvent<S> {
    pub event_type: CosiEventType,
    pub resource: Option<CosiResource<S>>,
    pub old: Option<CosiResource<S>>,
}

/// Decode a COSI resource, its spec as `S`. Errors are descriptions for [`TalosError::Decode`].
pub fn decode_resource<S: prost::Message + Default>(
    resource: pb::Resource,
) -> Result<CosiResource<S>, String> {
    let md = resource.metadata.unwrap_or_default();
    let version = match md.version.as_str() {
        "" | "undefined" => 0,
        v => v.parse::<u64>().map_err(|_| {
            format!(
                "resource {}/{}/{}: version {v:?} is not a number",
                md.namespace, md.r#type, md.id
            )
        })?,
    };
    let spec = match resource.spec {
        Some(spec) if !spec.proto_spec.is_empty() => S::decode(spec.proto_spec.as_slice())
            .map_err(|e| {
                format!(
                    "resource {}/{}/{}: spec does not decode: {e}",
                    md.namespace, md.r#type, md.id
                )
            })?,
        _ => S::default(),
    };
    let ts = |t: Option<prost_types::Timestamp>| {
        t.and_then(|t| jiff::Timestamp::new(t.seconds, t.nanos).ok())
    };
    let metadata = CosiMetadata {
        version,
        created: ts(md.created),
        updated: ts(md.updated),
        namespace: md.namespace,
        resource_type: md.r#type,
        id: md.id,
        owner: md.owner,
        phase: md.phase,
        finalizers: md.finalizers,
        labels: md.labels.into_iter().collect(),
        annotations: md.annotations.into_iter().collect(),
    };
    Ok(CosiResource { metadata, spec })
}

/// Decode one watch event. `Err` carries the error text of an `ERRORED` event or a decode failure.
pub(crate) fn decode_watch_event<S: prost::Message + Default>(
    endpoint: &str,
    event: pb::Event,
) -> Result<CosiEvent<S>, TalosError> {
    let decode_err = |message: String| TalosError::Decode {
        endpoint: endpoint.to_owned(),
        message,
    };
    let event_type = match pb::EventType::try_from(event.event_type) {
        Ok(pb::EventType::Created) => CosiEventType::Created,
        Ok(pb::EventType::Updated) => CosiEventType::Updated,
        Ok(pb::EventType::Destroyed) => CosiEventType::Destroyed,
        Ok(pb::EventType::Bootstrapped) => CosiEventType::Bootstrapped,
        Ok(pb::EventType::Noop) => CosiEventType::Noop,
        Ok(pb::EventType::Errored) => {
            return Err(TalosError::Watch {
                endpoint: endpoint.to_owned(),
                message: event
                    .error
                    .unwrap_or_else(|| "ERRORED event without message".into()),
            });
        }
        Err(_) => {
            return Err(decode_err(format!(
                "unknown watch event type {}",
                event.event_type
            )));
        }
    };
    let resource = event
        .resource
        .map(decode_resource::<S>)
        .transpose()
        .map_err(decode_err)?;
    let old = event
        .old
        .map(decode_resource::<S>)
        .transpose()
        .map_err(decode_err)?;
    if resource.is_none()
        && matches!(
            event_type,
            CosiEventType::Created | CosiEventType::Updated | CosiEventType::Destroyed
        )
    {
        return Err(decode_err(format!(
            "{event_type:?} watch event without a resource"
        )));
    }
    Ok(CosiEvent {
        event_type,
        resource,
        old,
    })
}

/// A live COSI watch, opened by [`TalosClient::cosi_watch`](super::TalosClient::cosi_watch).
///
/// The "watch established" message has already been consumed. Ends (`None`) when the server closes
/// the stream; yields one `Err` when the connection drops (usually [`TalosError::Unreachable`]) or the
/// watch reports `ERRORED` ([`TalosError::Watch`]), then ends. Not subject to the request timeout.
pub struct CosiWatchStream<S> {
    inner: tonic::Streaming<pb::WatchResponse>,
    endpoint: Arc<str>,
    buffered: VecDeque<pb::Event>,
    done: bool,
    _spec: PhantomData<fn() -> S>,
}

impl<S> CosiWatchStream<S> {
    pub(crate) fn new(
        inner: tonic::Streaming<pb::WatchResponse>,
        endpoint: Arc<str>,
        buffered: VecDeque<pb::Event>,
    ) -> Self {
        CosiWatchStream {
            inner,
            endpoint,
            buffered,
            done: false,
            _spec: PhantomData,
        }
    }
}

impl<S> std::fmt::Debug for CosiWatchStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosiWatchStream")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl<S: prost::Message + Default> Stream for CosiWatchStream<S> {
    type Item = Result<CosiEvent<S>, TalosError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(raw) = this.buffered.pop_front() {
                let item = decode_watch_event(&this.endpoint, raw);
                if matches!(item, Err(TalosError::Watch { .. })) {
                    this.done = true;
                    this.buffered.clear();
                }
                return Poll::Ready(Some(item));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(status))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(TalosError::from_stream_status(
                        &this.endpoint,
                        &status,
                    ))));
                }
                // One response may carry several events (or none); queue them and loop.
                Poll::Ready(Some(Ok(resp))) => this.buffered.extend(resp.event),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::talos::resource::definitions::{enums, runtime};
    use prost::Message as _;

    fn machine_status_resource(version: &str, stage: enums::RuntimeMachineStage) -> pb::Resource {
        let spec = runtime::MachineStatusSpec {
            stage: stage as i32,
            status: Some(runtime::MachineStatusStatus {
                ready: true,
                unmet_conditions: vec![],
            }),
        };
        pb::Resource {
            metadata: Some(pb::Metadata {
                namespace: resources::machine_status::NAMESPACE.into(),
                r#type: resources::machine_status::TYPE.into(),
                id: resources::machine_status::ID.into(),
                version: version.into(),
                owner: "runtime.MachineStatusController".into(),
                phase: "running".into(),
                created: Some(prost_types::Timestamp {
                    seconds: 1_700_000_000,
                    nanos: 0,
                }),
                labels: [("a".to_string(), "b".to_string())].into_iter().collect(),
                ..Default::default()
            }),
            spec: Some(pb::Spec {
                proto_spec: spec.encode_to_vec(),
                yaml_spec: String::new(),
            }),
        }
    }

    #[test]
    fn the_machine_stages_that_take_a_node_down() {
        use enums::RuntimeMachineStage as Stage;
        let cases = [
            (Stage::MachineStageUnknown, false),
            (Stage::MachineStageBooting, false),
            (Stage::MachineStageInstalling, false),
            (Stage::MachineStageMaintenance, false),
            (Stage::MachineStageRunning, false),
            (Stage::MachineStageRebooting, true),
            (Stage::MachineStageShuttingDown, true),
            (Stage::MachineStageResetting, true),
            (Stage::MachineStageUpgrading, true),
        ];
        for (stage, down) in cases {
            let status = runtime::MachineStatusSpec {
                stage: stage as i32,
                status: None,
            };
            assert_eq!(
                resources::machine_status::takes_node_down(&status),
                down,
                "{stage:?}"
            );
        }
    }

    #[test]
    fn decodes_resource_and_spec() {
        let r: CosiResource<runtime::MachineStatusSpec> = decode_resource(machine_status_resource(
            "7",
            enums::RuntimeMachineStage::MachineStageRunning,
        ))
        .unwrap();
        assert_eq!(r.metadata.version, 7);
        assert_eq!(
            r.metadata.resource_type,
            "MachineStatuses.runtime.talos.dev"
        );
        assert_eq!(r.metadata.labels.get("a").map(String::as_str), Some("b"));
        assert_eq!(
            r.metadata.created.map(|t| t.as_second()),
            Some(1_700_000_000)
        );
        assert_eq!(
            r.spec.stage(),
            enums::RuntimeMachineStage::MachineStageRunning
        );
        assert!(r.spec.status.unwrap().ready);
    }

    #[test]
    fn tombstone_has_default_spec_and_version_zero() {
        let tomb = pb::Resource {
            metadata: Some(pb::Metadata {
                version: "undefined".into(),
                ..Default::default()
            }),
            spec: None,
        };
        let r: CosiResource<runtime::MachineStatusSpec> = decode_resource(tomb).unwrap();
        assert_eq!(r.metadata.version, 0);
        assert_eq!(r.spec, runtime::MachineStatusSpec::default());
    }

    #[test]
    fn bad_version_is_an_error() {
        let mut res =
            machine_status_resource("x7", enums::RuntimeMachineStage::MachineStageBooting);
        res.spec = None;
        let err = decode_resource::<runtime::MachineStatusSpec>(res).unwrap_err();
        assert!(err.contains("\"x7\""), "{err}");
    }

    #[test]
    fn watch_events_decode() {
        let ev = pb::Event {
            resource: Some(machine_status_resource(
                "3",
                enums::RuntimeMachineStage::MachineStageBooting,
            )),
            event_type: pb::EventType::Updated as i32,
            old: Some(machine_status_resource(
                "2",
                enums::RuntimeMachineStage::MachineStageRebooting,
            )),
            error: None,
            bookmark: None,
        };
        let ev = decode_watch_event::<runtime::MachineStatusSpec>("ep", ev).unwrap();
        assert_eq!(ev.event_type, CosiEventType::Updated);
        assert_eq!(ev.resource.unwrap().metadata.version, 3);
        assert_eq!(ev.old.unwrap().metadata.version, 2);

        let boot = pb::Event {
            event_type: pb::EventType::Bootstrapped as i32,
            ..Default::default()
        };
        let ev = decode_watch_event::<runtime::MachineStatusSpec>("ep", boot).unwrap();
        assert_eq!(ev.event_type, CosiEventType::Bootstrapped);
        assert!(ev.resource.is_none());

        let errored = pb::Event {
            event_type: pb::EventType::Errored as i32,
            error: Some("buffer overrun".into()),
            ..Default::default()
        };
        let err = decode_watch_event::<runtime::MachineStatusSpec>("ep", errored).unwrap_err();
        assert!(
            matches!(err, TalosError::Watch { ref message, .. } if message == "buffer overrun")
        );
    }

    #[test]
    fn static_pod_status_id() {
        assert_eq!(
            resources::static_pod_status::id(resources::KUBE_APISERVER, "cp-1"),
            "kube-system/kube-apiserver-cp-1"
        );
    }
}
