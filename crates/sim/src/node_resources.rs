//! The COSI resources a node exposes (talos-api.md §2.3), derived from its state.
//!
//! Each resource's `proto_spec` is the matching Talos spec message, and `yaml_spec` is the YAML Talos
//! prints for it (camelCase keys). The type table also drives the State service's access checks.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Mutex;

use prost::Message;
use semver::Version;
use serde_json::{Value as Json, json};

use super::compat;
use super::config::Role;
use super::etcd::EtcdMemberSnapshot;
use super::meta::{self, PrintColumn};
use super::node_state::{NodeState, RunningComponent};
use super::registry;
use super::resources::{CLUSTER_NS, DesiredResource, ResourceKey};
use talos_api::proto::resource::config as cfg;
use talos_api::proto::talos::resource::definitions::{etcd, extensions, k8s, runtime, v1alpha1};

pub(crate) const CONFIG_NS: &str = "config";
pub(crate) const RUNTIME_NS: &str = "runtime";
pub(crate) const K8S_NS: &str = "k8s";
pub(crate) const CONTROLPLANE_NS: &str = "controlplane";
pub(crate) const ETCD_NS: &str = "etcd";

pub(crate) const MACHINE_STATUS_TYPE: &str = "MachineStatuses.runtime.talos.dev";
pub(crate) const VERSION_TYPE: &str = "Versions.runtime.talos.dev";
pub(crate) const MACHINE_CONFIG_TYPE: &str = "MachineConfigs.config.talos.dev";
pub(crate) const MACHINE_TYPE_TYPE: &str = "MachineTypes.config.talos.dev";
pub(crate) const NODENAME_TYPE: &str = "Nodenames.kubernetes.talos.dev";
pub(crate) const SERVICE_TYPE: &str = "Services.v1alpha1.talos.dev";
pub(crate) const KUBELET_SPEC_TYPE: &str = "KubeletSpecs.kubernetes.talos.dev";
pub(crate) const KUBELET_CONFIG_TYPE: &str = "KubeletConfigs.kubernetes.talos.dev";
pub(crate) const BOOTSTRAP_MANIFESTS_CONFIG_TYPE: &str =
    "BootstrapManifestsConfigs.kubernetes.talos.dev";
pub(crate) const STATIC_POD_TYPE: &str = "StaticPods.kubernetes.talos.dev";
pub(crate) const STATIC_POD_STATUS_TYPE: &str = "StaticPodStatuses.kubernetes.talos.dev";
pub(crate) const APISERVER_CONFIG_TYPE: &str = "APIServerConfigs.kubernetes.talos.dev";
pub(crate) const CONTROLLER_MANAGER_CONFIG_TYPE: &str =
    "ControllerManagerConfigs.kubernetes.talos.dev";
pub(crate) const SCHEDULER_CONFIG_TYPE: &str = "SchedulerConfigs.kubernetes.talos.dev";
pub(crate) const MANIFEST_TYPE: &str = "Manifests.kubernetes.talos.dev";
pub(crate) const ETCD_MEMBER_TYPE: &str = "EtcdMembers.etcd.talos.dev";
pub(crate) const PLATFORM_METADATA_TYPE: &str = "PlatformMetadatas.talos.dev";
pub(crate) const EXTENSION_STATUS_TYPE: &str = "ExtensionStatuses.runtime.talos.dev";
pub(crate) const IMAGE_FACTORY_SCHEMATIC_TYPE: &str = "ImageFactorySchematics.runtime.talos.dev";
pub(crate) const MEMBER_TYPE: &str = "Members.cluster.talos.dev";
pub(crate) const AFFILIATE_TYPE: &str = "Affiliates.cluster.talos.dev";

/// A Talos version as `(major, minor, patch)`, for what changed in a patch release.
pub(crate) type Since = (u64, u64, u64);

/// Every Talos version the simulator plays.
const ALWAYS: Since = (0, 0, 0);

/// A resource type the simulator serves, with the definition Talos declares for it (its
/// `ResourceDefinition()` in machinery `resources/...`), which `talosctl get` reads from the node's
/// `ResourceDefinitions.meta.cosi.dev` ([`super::meta`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TypeInfo {
    pub type_: &'static str,
    /// The namespace the resources live in: the definition's `DefaultNamespace`.
    pub namespace: &'static str,
    /// Reading needs `os:admin` from this Talos version on (`None`: never), the definition's
    /// `Sensitivity`.
    pub sensitive_since: Option<Since>,
    /// The type only exists on Talos ≥ this minor (1.x).
    pub since_minor: u64,
    /// The aliases the definition declares (cosi's `Fill` adds the generated ones).
    pub aliases: &'static [&'static str],
    /// The definition's `PrintColumns`, each with the first Talos version that has it.
    pub columns: &'static [(PrintColumn, Since)],
}

impl TypeInfo {
    /// Does a node on `version` serve this type?
    pub(crate) fn served_on(&self, version: &Version) -> bool {
        version.minor >= self.since_minor || version.major > 1
    }

    /// Is the type sensitive (readable with `os:admin` only) on `version`?
    pub(crate) fn sensitive_on(&self, version: &Version) -> bool {
        self.sensitive_since
            .is_some_and(|since| (version.major, version.minor, version.patch) >= since)
    }

    /// The definition as Talos `version` declares it.
    pub(crate) fn declared_on(&self, version: &Version) -> meta::Declared<'static> {
        let core = (version.major, version.minor, version.patch);
        meta::Declared {
            type_: self.type_,
            default_namespace: self.namespace,
            aliases: self.aliases,
            print_columns: self
                .columns
                .iter()
                .filter(|(_, since)| core >= *since)
                .map(|(column, _)| *column)
                .collect(),
            sensitive: self.sensitive_on(version),
        }
    }
}

const fn column(name: &'static str, json_path: &'static str) -> (PrintColumn, Since) {
    (PrintColumn { name, json_path }, ALWAYS)
}

/// Marked sensitive by "fix: mark more resources as sensitive" (talos 166854959, 1.14.0-alpha.2,
/// backported): machinery v1.13.4 and v1.14.1 have it, v1.13.3 and v1.12.0 do not. Whether a 1.12
/// patch got it is not verified (the module proxy here serves no machinery between v1.12.0 and v1.13.3),
/// so 1.12 nodes keep the types readable.
const MORE_SENSITIVE: Since = (1, 13, 4);

// The definitions below are machinery v1.14.1's, identical in v1.11.6, v1.12.0 and v1.13.x except
// where a `Since` says otherwise.
pub(crate) const TYPES: &[TypeInfo] = &[
    // `resources/runtime/machine_status.go`
    TypeInfo {
        type_: MACHINE_STATUS_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[
            column("Stage", "{.stage}"),
            column("Ready", "{.status.ready}"),
        ],
    },
    // `resources/runtime/version.go`: the spec has a name (and the table its column) from 1.13.0.
    TypeInfo {
        type_: VERSION_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 10,
        aliases: &[],
        columns: &[
            (
                PrintColumn {
                    name: "Name",
                    json_path: "{.name}",
                },
                VERSION_NAME_SINCE,
            ),
            column("Version", "{.version}"),
        ],
    },
    // `resources/config/machine_config.go`
    TypeInfo {
        type_: MACHINE_CONFIG_TYPE,
        namespace: CONFIG_NS,
        sensitive_since: Some(ALWAYS),
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/config/machine_type.go`
    TypeInfo {
        type_: MACHINE_TYPE_TYPE,
        namespace: CONFIG_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[column("Type", "{@}")],
    },
    // `resources/k8s/nodename.go`
    TypeInfo {
        type_: NODENAME_TYPE,
        namespace: K8S_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[column("Nodename", "{.nodename}")],
    },
    // `resources/v1alpha1/service.go`
    TypeInfo {
        type_: SERVICE_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &["svc"],
        columns: &[
            column("Running", "{.running}"),
            column("Healthy", "{.healthy}"),
            column("Health Unknown", "{.unknown}"),
        ],
    },
    // `resources/k8s/kubelet_spec.go`
    TypeInfo {
        type_: KUBELET_SPEC_TYPE,
        namespace: K8S_NS,
        sensitive_since: Some(MORE_SENSITIVE),
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/kubelet_config.go` (sensitive from v1.13.4, as KubeletSpec)
    TypeInfo {
        type_: KUBELET_CONFIG_TYPE,
        namespace: K8S_NS,
        sensitive_since: Some(MORE_SENSITIVE),
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/manifests_config.go`
    TypeInfo {
        type_: BOOTSTRAP_MANIFESTS_CONFIG_TYPE,
        namespace: CONTROLPLANE_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/static_pod.go` (not sensitive; `talosctl upgrade-k8s` reads the pods' commands
    // for removed flags, go-kubernetes v0.2.41 `kubernetes/upgrade/checks.go`)
    TypeInfo {
        type_: STATIC_POD_TYPE,
        namespace: K8S_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/static_pod_status.go`
    TypeInfo {
        type_: STATIC_POD_STATUS_TYPE,
        namespace: K8S_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &["podstatus"],
        columns: &[column(
            "Ready",
            r#"{.conditions[?(@.type=="Ready")].status}"#,
        )],
    },
    // `resources/k8s/apiserver_config.go`
    TypeInfo {
        type_: APISERVER_CONFIG_TYPE,
        namespace: CONTROLPLANE_NS,
        sensitive_since: Some(MORE_SENSITIVE),
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/controllermanager_config.go`
    TypeInfo {
        type_: CONTROLLER_MANAGER_CONFIG_TYPE,
        namespace: CONTROLPLANE_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/scheduler_config.go`
    TypeInfo {
        type_: SCHEDULER_CONFIG_TYPE,
        namespace: CONTROLPLANE_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/k8s/manifest.go`
    TypeInfo {
        type_: MANIFEST_TYPE,
        namespace: CONTROLPLANE_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[],
    },
    // `resources/etcd/member.go`
    TypeInfo {
        type_: ETCD_MEMBER_TYPE,
        namespace: ETCD_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[column("Member ID", "{.memberID}")],
    },
    // `resources/runtime/platform_metadata.go`
    TypeInfo {
        type_: PLATFORM_METADATA_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[
            column("Platform", "{.platform}"),
            column("Type", "{.instanceType}"),
            column("Region", "{.region}"),
            column("Zone", "{.zone}"),
        ],
    },
    // `resources/runtime/extension_status.go`
    TypeInfo {
        type_: EXTENSION_STATUS_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &["extensions"],
        columns: &[
            column("Name", "{.metadata.name}"),
            column("Version", "{.metadata.version}"),
        ],
    },
    // New in 1.14 (machinery v1.14.1 `resources/runtime/image_factory_schematic.go`).
    TypeInfo {
        type_: IMAGE_FACTORY_SCHEMATIC_TYPE,
        namespace: RUNTIME_NS,
        sensitive_since: None,
        since_minor: 14,
        aliases: &[],
        columns: &[
            column("Schematic ID", "{.schematicId}"),
            column("Flavor", "{.flavor}"),
            column("API URL", "{.apiUrl}"),
        ],
    },
    // `resources/cluster/member.go` (the resources: [`super::discovery`])
    TypeInfo {
        type_: MEMBER_TYPE,
        namespace: CLUSTER_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[
            column("Hostname", "{.hostname}"),
            column("Machine Type", "{.machineType}"),
            column("OS", "{.operatingSystem}"),
            column("Addresses", "{.addresses}"),
        ],
    },
    // `resources/cluster/affiliate.go`
    TypeInfo {
        type_: AFFILIATE_TYPE,
        namespace: CLUSTER_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &[],
        columns: &[
            column("Hostname", "{.hostname}"),
            column("Machine Type", "{.machineType}"),
            column("Addresses", "{.addresses}"),
        ],
    },
    // cosi-project/runtime `pkg/resource/meta/resource_definition.go`
    TypeInfo {
        type_: meta::RESOURCE_DEFINITION_TYPE,
        namespace: meta::META_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &["api-resources"],
        columns: &[column("Aliases", "{.aliases[:]}")],
    },
    // cosi-project/runtime `pkg/resource/meta/namespace.go`
    TypeInfo {
        type_: meta::NAMESPACE_TYPE,
        namespace: meta::META_NS,
        sensitive_since: None,
        since_minor: 0,
        aliases: &["ns"],
        columns: &[],
    },
];

/// `VersionSpec` has a `name` from Talos 1.13.0 (machinery v1.12.0 `resources/runtime/version.go` has
/// only `version`, v1.13.0 both).
const VERSION_NAME_SINCE: Since = (1, 13, 0);

/// The fields of `KubeletConfigSpec` (machinery v1.14.1 `resources/k8s/kubelet_config.go`) the
/// simulator fills, with their `protobuf:"N"` tags; the workspace's protos do not carry it. `talosctl
/// health` only needs the resource to exist (talos v1.14.1 `pkg/cluster/check/default.go`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KubeletConfigSpec {
    #[prost(string, tag = "1")]
    pub image: String,
    #[prost(string, repeated, tag = "2")]
    pub cluster_dns: Vec<String>,
    #[prost(string, tag = "3")]
    pub cluster_domain: String,
    #[prost(bool, tag = "8")]
    pub default_runtime_seccomp_enabled: bool,
}

/// The field of `BootstrapManifestsConfigSpec` (machinery v1.14.1 `resources/k8s/manifests_config.go`)
/// `talosctl health` reads: the CNI (`none` turns its CNI checks off).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct BootstrapManifestsConfigSpec {
    #[prost(string, tag = "21")]
    pub cni_name: String,
}

/// `PlatformMetadataSpec` (machinery v1.14.1 `resources/runtime/platform_metadata.go`, identical in
/// v1.13): the COSI spec is the Go struct encoded with its `protobuf:"N"` tags. Written here because the
/// workspace's protos (`proto/`) do not carry it.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PlatformMetadataSpec {
    #[prost(string, tag = "1")]
    pub platform: String,
    #[prost(string, tag = "2")]
    pub hostname: String,
    #[prost(string, tag = "3")]
    pub region: String,
    #[prost(string, tag = "4")]
    pub zone: String,
    #[prost(string, tag = "5")]
    pub instance_type: String,
    #[prost(string, tag = "6")]
    pub instance_id: String,
    #[prost(string, tag = "7")]
    pub provider_id: String,
    #[prost(bool, tag = "8")]
    pub spot: bool,
    #[prost(string, tag = "9")]
    pub internal_dns: String,
    #[prost(string, tag = "10")]
    pub external_dns: String,
    #[prost(map = "string, string", tag = "11")]
    pub tags: std::collections::HashMap<String, String>,
}

/// `ImageFactorySchematicSpec` (machinery v1.14.1 `resources/runtime/image_factory_schematic.go`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ImageFactorySchematicSpec {
    #[prost(string, tag = "1")]
    pub schematic_id: String,
    #[prost(string, tag = "2")]
    pub flavor: String,
    #[prost(string, tag = "3")]
    pub api_url: String,
}

/// The virtual extension's name that carries the schematic id (machinery v1.14.1
/// `constants.ImageFactorySchematicExtensionName`).
pub(crate) const SCHEMATIC_EXTENSION: &str = "schematic";

/// Who a node is: what its resources say about it besides its state.
pub(crate) struct NodeIdentity<'a> {
    pub name: &'a str,
    pub role: Role,
    pub address: Ipv4Addr,
    pub platform: &'a str,
}

pub(crate) fn type_info(type_: &str) -> Option<&'static TypeInfo> {
    TYPES.iter().find(|t| t.type_ == type_)
}

/// The `meta` namespace of a node on `version`: a ResourceDefinition per type it serves and a
/// Namespace per namespace those types live in (Talos registers all of its namespaces, also those of
/// the types the simulator does not serve; those are left out here).
fn meta_resources(version: &Version) -> Vec<DesiredResource> {
    // The same for every node on a version, and computed on every state change: built once.
    static BUILT: Mutex<BTreeMap<Since, Vec<DesiredResource>>> = Mutex::new(BTreeMap::new());
    let core = (version.major, version.minor, version.patch);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    built
        .entry(core)
        .or_insert_with(|| {
            let served: Vec<&TypeInfo> = TYPES.iter().filter(|t| t.served_on(version)).collect();
            let namespaces: BTreeSet<&str> = served.iter().map(|t| t.namespace).collect();
            served
                .iter()
                .map(|t| meta::Definition::fill(&t.declared_on(version)).resource())
                .chain(namespaces.into_iter().map(meta::namespace_resource))
                .collect()
        })
        .clone()
}

/// Convert JSON into a `google.protobuf.Struct` (what Talos puts in pod and manifest specs).
pub(crate) fn json_to_struct(value: &Json) -> prost_types::Struct {
    match json_to_value(value).kind {
        Some(prost_types::value::Kind::StructValue(s)) => s,
        _ => prost_types::Struct::default(),
    }
}

fn json_to_value(value: &Json) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match value {
        Json::Null => Kind::NullValue(0),
        Json::Bool(b) => Kind::BoolValue(*b),
        Json::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Json::String(s) => Kind::StringValue(s.clone()),
        Json::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.iter().map(json_to_value).collect(),
        }),
        Json::Object(map) => Kind::StructValue(prost_types::Struct {
            fields: map
                .iter()
                .map(|(k, v)| (k.clone(), json_to_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

fn to_yaml(value: &Json) -> String {
    // Serializing a JSON value to YAML cannot fail (no non-string keys, no unsupported types).
    serde_yaml::to_string(value).unwrap_or_default()
}

fn resource(
    namespace: &str,
    type_: &str,
    id: &str,
    owner: &str,
    spec: &impl Message,
    yaml: String,
) -> DesiredResource {
    DesiredResource {
        key: ResourceKey {
            namespace: namespace.to_string(),
            type_: type_.to_string(),
            id: id.to_string(),
        },
        owner: owner.to_string(),
        proto_spec: spec.encode_to_vec(),
        yaml_spec: yaml,
        labels: BTreeMap::new(),
        annotations: BTreeMap::new(),
    }
}

/// The full set of resources the node exposes in `state`.
pub(crate) fn desired(
    node: &NodeIdentity<'_>,
    state: &NodeState,
    etcd_member: Option<&EtcdMemberSnapshot>,
) -> Vec<DesiredResource> {
    let NodeIdentity {
        name,
        role,
        address,
        platform,
    } = *node;
    let version = &state.current.version;
    // meta/ResourceDefinitions and meta/Namespaces: what a node of this version serves.
    let mut out = meta_resources(version);

    // runtime/PlatformMetadatas/platformmetadata: the platform the node booted on.
    out.push(resource(
        RUNTIME_NS,
        PLATFORM_METADATA_TYPE,
        "platformmetadata",
        "network.PlatformConfigController",
        &PlatformMetadataSpec {
            platform: platform.to_string(),
            hostname: name.to_string(),
            ..Default::default()
        },
        to_yaml(&json!({"platform": platform, "hostname": name})),
    ));

    // runtime/ExtensionStatuses: a node booted from an Image Factory asset carries the factory's virtual
    // `schematic` extension (version = schematic id); from 1.14 machined also derives
    // ImageFactorySchematic from it (talos v1.14.1 `controllers/runtime/image_factory_schematic.go`:
    // flavor = the author before " (", apiUrl = the URL in the parentheses).
    if let Some((host, schematic)) = registry::factory_schematic(&state.current.installer_image) {
        let api_url = format!("https://{host}");
        let author = format!("Image Factory ({api_url})");
        let description = "Virtual extension which specifies the schematic ID";
        out.push(resource(
            RUNTIME_NS,
            EXTENSION_STATUS_TYPE,
            "0",
            "runtime.ExtensionStatusController",
            &extensions::Layer {
                image: String::new(),
                metadata: Some(extensions::Metadata {
                    name: SCHEMATIC_EXTENSION.to_string(),
                    version: schematic.clone(),
                    author: author.clone(),
                    description: description.to_string(),
                    compatibility: None,
                }),
            },
            to_yaml(&json!({
                "image": "",
                "metadata": {
                    "name": SCHEMATIC_EXTENSION,
                    "version": schematic,
                    "author": author,
                    "description": description,
                    "compatibility": {"talos": {"version": ""}},
                },
            })),
        ));
        if compat::knows_kubernetes_documents(version) {
            out.push(resource(
                RUNTIME_NS,
                IMAGE_FACTORY_SCHEMATIC_TYPE,
                "image-factory-schematic",
                "runtime.ImageFactorySchematicController",
                &ImageFactorySchematicSpec {
                    schematic_id: schematic.clone(),
                    flavor: "Image Factory".to_string(),
                    api_url: api_url.clone(),
                },
                to_yaml(&json!({
                    "schematicId": schematic,
                    "flavor": "Image Factory",
                    "apiUrl": api_url,
                })),
            ));
        }
    }

    // runtime/MachineStatuses/machine
    let spec = runtime::MachineStatusSpec {
        stage: state.stage.to_resource() as i32,
        status: Some(runtime::MachineStatusStatus {
            ready: state.ready,
            unmet_conditions: state
                .unmet
                .iter()
                .map(|c| runtime::UnmetCondition {
                    name: c.name.clone(),
                    reason: c.reason.clone(),
                })
                .collect(),
        }),
    };
    let unmet: Vec<Json> = state
        .unmet
        .iter()
        .map(|c| json!({"name": c.name, "reason": c.reason}))
        .collect();
    let yaml = to_yaml(&json!({
        "stage": state.stage.yaml_name(),
        "status": {"ready": state.ready, "unmetConditions": unmet},
    }));
    out.push(resource(
        RUNTIME_NS,
        MACHINE_STATUS_TYPE,
        "machine",
        "runtime.MachineStatusController",
        &spec,
        yaml,
    ));

    // runtime/Versions/version (1.10+). The spec carries the name on every version, although machinery
    // before v1.13.0 has no `name` field (v1.11.6, v1.12.0 `resources/runtime/version.go`), as
    // tests/sim/cosi.rs expects; the table's Name column follows the version (see TYPES).
    if compat::has_version_resource(version) {
        let tag = compat::tag(version);
        let spec = runtime::VersionSpec {
            version: tag.clone(),
            name: "Talos".to_string(),
        };
        let yaml = to_yaml(&json!({"name": "Talos", "version": tag}));
        out.push(resource(
            RUNTIME_NS,
            VERSION_TYPE,
            "version",
            "runtime.VersionController",
            &spec,
            yaml,
        ));
    }

    // config/MachineConfigs/{v1alpha1,persistent}. Where the YAML spec is a string scalar, Talos marks
    // the resource with the `talos.dev/yaml-spec` annotation (machinery v1.12.0 and later
    // `resources/config/machine_config.go`), which tells `talosctl get mc -o yaml` not to wrap the spec
    // in a string once more (talosctl `cmd/talos/output/yaml.go`).
    let scalar = compat::machine_config_yaml_spec_is_scalar(version);
    let machine_config = |id: &str, bytes: &[u8]| {
        let text = String::from_utf8_lossy(bytes).into_owned();
        let yaml = if scalar {
            to_yaml(&Json::String(text))
        } else {
            text
        };
        let spec = cfg::MachineConfigSpec {
            yaml_marshalled: bytes.to_vec(),
        };
        let mut resource = resource(CONFIG_NS, MACHINE_CONFIG_TYPE, id, "", &spec, yaml);
        if scalar {
            resource
                .annotations
                .insert("talos.dev/yaml-spec".to_string(), "1".to_string());
        }
        resource
    };
    out.push(machine_config("v1alpha1", &state.config));
    let persistent = state.staged_config.as_ref().unwrap_or(&state.config);
    out.push(machine_config("persistent", persistent));

    // config/MachineTypes/machine-type
    let machine_type = if role.is_control_plane() {
        cfg::MachineType::ControlPlane
    } else {
        cfg::MachineType::Worker
    };
    out.push(resource(
        CONFIG_NS,
        MACHINE_TYPE_TYPE,
        "machine-type",
        "config.MachineTypeController",
        &cfg::MachineTypeSpec {
            machine_type: machine_type as i32,
        },
        // A bare string: the spec's MarshalYAML returns `Type.String()` (machinery
        // `resources/config/machine_type.go`), which the table's `{@}` column prints.
        to_yaml(&json!(role.as_str())),
    ));

    // k8s/Nodenames/nodename
    out.push(resource(
        K8S_NS,
        NODENAME_TYPE,
        "nodename",
        "k8s.NodenameController",
        &k8s::NodenameSpec {
            nodename: name.to_string(),
            hostname_version: "1".to_string(),
            skip_node_registration: false,
        },
        to_yaml(&json!({"nodename": name, "hostnameVersion": "1", "skipNodeRegistration": false})),
    ));

    // runtime/Services/<id>: only services that run exist (the resource goes away when one stops).
    for (id, service) in &state.services {
        if service.state != "Running" {
            continue;
        }
        let spec = v1alpha1::ServiceSpec {
            running: true,
            healthy: service.healthy,
            unknown: false,
        };
        let yaml = to_yaml(&json!({"running": true, "healthy": service.healthy, "unknown": false}));
        out.push(resource(
            RUNTIME_NS,
            SERVICE_TYPE,
            id,
            "v1alpha1.ServiceController",
            &spec,
            yaml,
        ));
    }

    // k8s/KubeletSpecs/kubelet: rendered from the config, so it follows the config immediately.
    let kubelet_image = &state.parsed.images.kubelet;
    let args = vec![
        "--config=/etc/kubernetes/kubelet.yaml".to_string(),
        format!("--hostname-override={name}"),
        format!("--node-ip={address}"),
    ];
    let kubelet_config = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "clusterDomain": "cluster.local",
    });
    out.push(resource(
        K8S_NS,
        KUBELET_SPEC_TYPE,
        "kubelet",
        "k8s.KubeletSpecController",
        &k8s::KubeletSpecSpec {
            image: kubelet_image.clone(),
            args: args.clone(),
            expected_nodename: name.to_string(),
            config: Some(json_to_struct(&kubelet_config)),
        },
        to_yaml(&json!({
            "image": kubelet_image,
            "args": args,
            "expectedNodename": name,
            "config": kubelet_config,
        })),
    ));

    // k8s/KubeletConfigs/kubelet: the kubelet's settings from the machine config (the source of
    // KubeletSpec).
    out.push(resource(
        K8S_NS,
        KUBELET_CONFIG_TYPE,
        "kubelet",
        "k8s.KubeletConfigController",
        &KubeletConfigSpec {
            image: kubelet_image.clone(),
            cluster_dns: vec!["10.96.0.10".to_string()],
            cluster_domain: "cluster.local".to_string(),
            default_runtime_seccomp_enabled: true,
        },
        to_yaml(&json!({
            "image": kubelet_image,
            "clusterDNS": ["10.96.0.10"],
            "clusterDomain": "cluster.local",
            "defaultRuntimeSeccompEnabled": true,
        })),
    ));

    if role.is_control_plane() {
        // controlplane/BootstrapManifestsConfigs/manifests: the bootstrap manifests' settings; the
        // generated configs use Talos's default CNI, flannel.
        out.push(resource(
            CONTROLPLANE_NS,
            BOOTSTRAP_MANIFESTS_CONFIG_TYPE,
            "manifests",
            "k8s.ManifestsConfigController",
            &BootstrapManifestsConfigSpec {
                cni_name: "flannel".to_string(),
            },
            to_yaml(&json!({"cniName": "flannel"})),
        ));
        control_plane_resources(name, state, etcd_member, &mut out);
    }
    out
}

fn control_plane_resources(
    name: &str,
    state: &NodeState,
    etcd_member: Option<&EtcdMemberSnapshot>,
    out: &mut Vec<DesiredResource>,
) {
    let images = &state.parsed.images;

    // controlplane/*Configs: rendered from the machine config; their version is the pods' config-version.
    out.push(resource(
        CONTROLPLANE_NS,
        APISERVER_CONFIG_TYPE,
        "kube-apiserver",
        "k8s.ControlPlaneAPIServerController",
        &k8s::ApiServerConfigSpec {
            image: images.apiserver.clone(),
        },
        to_yaml(&json!({"image": images.apiserver})),
    ));
    out.push(resource(
        CONTROLPLANE_NS,
        CONTROLLER_MANAGER_CONFIG_TYPE,
        "kube-controller-manager",
        "k8s.ControlPlaneControllerManagerController",
        &k8s::ControllerManagerConfigSpec {
            enabled: true,
            image: images.controller_manager.clone(),
        },
        to_yaml(&json!({"enabled": true, "image": images.controller_manager})),
    ));
    out.push(resource(
        CONTROLPLANE_NS,
        SCHEDULER_CONFIG_TYPE,
        "kube-scheduler",
        "k8s.ControlPlaneSchedulerController",
        &k8s::SchedulerConfigSpec {
            enabled: true,
            image: images.scheduler.clone(),
        },
        to_yaml(&json!({"enabled": true, "image": images.scheduler})),
    ));
    // controlplane/*Configs/final-<component> (Talos 1.14): the configs merged with Talos's defaults,
    // which the static pods are rendered from and whose version they carry (talos v1.14.1
    // `controllers/k8s/control_plane_final.go`, transform controllers of the unprefixed ones; machinery
    // `resources/k8s/k8s.go` `FinalPrefix`). Their own version counters; the simulator changes them
    // together with the unprefixed ones, so the two read the same.
    if (state.current.version.major, state.current.version.minor) >= (1, 14) {
        out.push(resource(
            CONTROLPLANE_NS,
            APISERVER_CONFIG_TYPE,
            "final-kube-apiserver",
            "k8s.ControlPlaneAPIServerFinalController",
            &k8s::ApiServerConfigSpec {
                image: images.apiserver.clone(),
            },
            to_yaml(&json!({"image": images.apiserver})),
        ));
        out.push(resource(
            CONTROLPLANE_NS,
            CONTROLLER_MANAGER_CONFIG_TYPE,
            "final-kube-controller-manager",
            "k8s.ControlPlaneControllerManagerFinalController",
            &k8s::ControllerManagerConfigSpec {
                enabled: true,
                image: images.controller_manager.clone(),
            },
            to_yaml(&json!({"enabled": true, "image": images.controller_manager})),
        ));
        out.push(resource(
            CONTROLPLANE_NS,
            SCHEDULER_CONFIG_TYPE,
            "final-kube-scheduler",
            "k8s.ControlPlaneSchedulerFinalController",
            &k8s::SchedulerConfigSpec {
                enabled: true,
                image: images.scheduler.clone(),
            },
            to_yaml(&json!({"enabled": true, "image": images.scheduler})),
        ));
    }

    // k8s/StaticPods/<component>: the pod manifests machined renders for kubelet
    // (k8s.ControlPlaneStaticPodController, `internal/app/machined/pkg/controllers/k8s/
    // control_plane_static_pod.go` and `k8stemplates/`), stamped with the config resource's version.
    // Simplification: rendered from the running component, so the manifest follows the config after
    // the simulated apply delay rather than at once.
    for (component, running) in [
        ("kube-apiserver", &state.apiserver),
        ("kube-controller-manager", &state.controller_manager),
        ("kube-scheduler", &state.scheduler),
    ] {
        if !running.running {
            continue;
        }
        let pod = static_pod(component, running);
        out.push(resource(
            K8S_NS,
            STATIC_POD_TYPE,
            component,
            "k8s.ControlPlaneStaticPodController",
            &k8s::StaticPodSpec {
                pod: Some(json_to_struct(&pod)),
            },
            // The spec's MarshalYAML returns the pod itself (machinery `resources/k8s/static_pod.go`).
            to_yaml(&pod),
        ));
    }

    // k8s/StaticPodStatuses/kube-system/<component>-<node>: what kubelet reports for running pods.
    let kubelet_up = state
        .services
        .get("kubelet")
        .is_some_and(|s| s.state == "Running");
    if kubelet_up {
        for (component, running) in [
            ("kube-apiserver", &state.apiserver),
            ("kube-controller-manager", &state.controller_manager),
            ("kube-scheduler", &state.scheduler),
        ] {
            if !running.running {
                continue;
            }
            let status = pod_status(component, running);
            out.push(resource(
                K8S_NS,
                STATIC_POD_STATUS_TYPE,
                &format!("kube-system/{component}-{name}"),
                "k8s.StaticPodStatusController",
                &k8s::StaticPodStatusSpec {
                    pod_status: Some(json_to_struct(&status)),
                },
                // The pod status itself: the spec's MarshalYAML returns it (machinery
                // `resources/k8s/static_pod_status.go`), so the table's Ready column finds
                // `.conditions`.
                to_yaml(&status),
            ));
        }
    }

    // controlplane/Manifests: a couple of bootstrap manifests, kube-proxy following the config.
    for (id, objects) in [
        ("10-kube-proxy", kube_proxy_manifest(&images.proxy)),
        ("11-core-dns", core_dns_manifest()),
    ] {
        let spec = k8s::ManifestSpec {
            items: objects
                .iter()
                .map(|o| k8s::SingleManifest {
                    object: Some(json_to_struct(o)),
                })
                .collect(),
        };
        let yaml = to_yaml(&json!({"items": objects}));
        out.push(resource(
            CONTROLPLANE_NS,
            MANIFEST_TYPE,
            id,
            "k8s.ManifestController",
            &spec,
            yaml,
        ));
    }

    // etcd/EtcdMembers/local
    if let Some(member) = etcd_member {
        out.push(resource(
            ETCD_NS,
            ETCD_MEMBER_TYPE,
            "local",
            "etcd.MemberController",
            &etcd::MemberSpec {
                member_id: member.member_id.clone(),
            },
            to_yaml(&json!({"memberID": member.member_id})),
        ));
    }
}

/// A static pod manifest as machined renders it (talos v1.14.1 `k8stemplates/apiserver.go` and
/// siblings): its metadata, labels and annotations, one container running the component's binary.
fn static_pod(component: &str, running: &RunningComponent) -> Json {
    let version = running
        .image
        .rsplit_once(':')
        .map(|(_, tag)| tag)
        .unwrap_or_default();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": component,
            "namespace": "kube-system",
            "annotations": {
                "talos.dev/config-version": running.config_version.to_string(),
            },
            "labels": {
                "tier": "control-plane",
                "k8s-app": component,
                "component": component,
                "app.kubernetes.io/name": component,
                "app.kubernetes.io/version": version,
                "app.kubernetes.io/component": "control-plane",
                "app.kubernetes.io/managed-by": "Talos",
            },
        },
        "spec": {
            "priorityClassName": "system-cluster-critical",
            "hostNetwork": true,
            "containers": [{
                "name": component,
                "image": running.image,
                "command": [format!("/usr/local/bin/{component}")],
            }],
        },
        "status": {},
    })
}

/// A `corev1.PodStatus` as JSON, as kubelet reports a running, Ready static pod.
fn pod_status(component: &str, running: &RunningComponent) -> Json {
    json!({
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": "True"},
            {"type": "ContainersReady", "status": "True"},
            {"type": "PodScheduled", "status": "True"},
        ],
        "containerStatuses": [{
            "name": component,
            "image": running.image,
            "imageID": format!("{}@sha256:{}", running.image.split(':').next().unwrap_or_default(), "0".repeat(64)),
            "ready": true,
            "started": true,
            "restartCount": 0,
        }],
    })
}

fn kube_proxy_manifest(image: &str) -> Vec<Json> {
    vec![
        json!({
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system"},
        }),
        json!({
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "kube-proxy", "namespace": "kube-system", "labels": {"k8s-app": "kube-proxy"}},
            "spec": {
                "selector": {"matchLabels": {"k8s-app": "kube-proxy"}},
                "template": {
                    "metadata": {"labels": {"k8s-app": "kube-proxy"}},
                    "spec": {
                        "serviceAccountName": "kube-proxy",
                        "hostNetwork": true,
                        "containers": [{
                            "name": "kube-proxy",
                            "image": image,
                            "command": ["/usr/local/bin/kube-proxy", "--cluster-cidr=10.244.0.0/16"],
                        }],
                    },
                },
            },
        }),
    ]
}

fn core_dns_manifest() -> Vec<Json> {
    vec![json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "coredns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"k8s-app": "kube-dns"}},
            "template": {
                "metadata": {"labels": {"k8s-app": "kube-dns"}},
                "spec": {"containers": [{"name": "coredns", "image": "registry.k8s.io/coredns/coredns:v1.12.1"}]},
            },
        },
    })]
}
