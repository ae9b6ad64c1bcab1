//! COSI's own `meta` namespace (cosi-project/runtime v1.16 `pkg/resource/meta`): one
//! `ResourceDefinitions.meta.cosi.dev` per resource type a node serves and one `Namespaces.meta.cosi.dev`
//! per namespace. A client learns the resource types from them: `talosctl get ms` lists every
//! ResourceDefinition and matches `ms` against each one's id and `allAliases`, then reads the resource
//! in its `defaultNamespace` (machinery `client/resources.go`, `ResolveResourceKind`) and prints a table
//! with its `printColumns` (talosctl `cmd/talos/output/table.go`).
//!
//! Talos creates these when machined starts (talos v1.14.1
//! `internal/app/machined/pkg/runtime/v1alpha2/v1alpha2_state.go`, through cosi's
//! `pkg/state/registry`), owned by `meta`, from each resource's `ResourceDefinition()` completed by
//! cosi's `ResourceDefinitionSpec.Fill` (`pkg/resource/meta/spec/resource_definition.go`), which
//! [`Definition::fill`] reproduces.

use prost::Message;
use serde::Serialize;

use super::resources::{DesiredResource, ResourceKey};

pub(crate) const META_NS: &str = "meta";
pub(crate) const RESOURCE_DEFINITION_TYPE: &str = "ResourceDefinitions.meta.cosi.dev";
pub(crate) const NAMESPACE_TYPE: &str = "Namespaces.meta.cosi.dev";
/// `meta.Owner`, the owner the registries create with.
const OWNER: &str = "meta";

/// `ResourceDefinitionSpec` (cosi-project/runtime `api/v1alpha1/meta.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct ResourceDefinitionSpec {
    #[prost(string, tag = "1")]
    pub resource_type: String,
    #[prost(string, tag = "2")]
    pub display_type: String,
    #[prost(string, tag = "3")]
    pub default_namespace: String,
    #[prost(string, repeated, tag = "4")]
    pub aliases: Vec<String>,
    #[prost(string, repeated, tag = "5")]
    pub all_aliases: Vec<String>,
    #[prost(message, repeated, tag = "6")]
    pub print_columns: Vec<PrintColumnSpec>,
    /// `NON_SENSITIVE` = 0, `SENSITIVE` = 1.
    #[prost(int32, tag = "7")]
    pub sensitivity: i32,
}

/// `ResourceDefinitionSpec.PrintColumn` (cosi-project/runtime `api/v1alpha1/meta.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PrintColumnSpec {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub json_path: String,
}

/// `NamespaceSpec` (cosi-project/runtime `api/v1alpha1/meta.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct NamespaceSpec {
    #[prost(string, tag = "1")]
    pub description: String,
}

/// `ResourceDefinitionSpec_SENSITIVE`.
const SENSITIVE: i32 = 1;

/// A column `talosctl get` adds to its table: a header and a Kubernetes JSONPath into the YAML spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrintColumn {
    pub name: &'static str,
    pub json_path: &'static str,
}

/// A resource definition as the resource declares it, before `Fill`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Declared<'a> {
    pub type_: &'a str,
    pub default_namespace: &'a str,
    pub aliases: &'a [&'a str],
    pub print_columns: Vec<PrintColumn>,
    pub sensitive: bool,
}

/// A filled resource definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Definition {
    pub type_: String,
    pub display_type: String,
    pub default_namespace: String,
    pub aliases: Vec<String>,
    pub all_aliases: Vec<String>,
    pub print_columns: Vec<PrintColumn>,
    pub sensitive: bool,
}

/// The YAML of a `ResourceDefinitionSpec`: its Go struct's `yaml` tags, in field order.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DefinitionYaml<'a> {
    #[serde(rename = "type")]
    type_: &'a str,
    display_type: &'a str,
    default_namespace: &'a str,
    aliases: &'a [String],
    all_aliases: &'a [String],
    print_columns: Vec<ColumnYaml<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sensitivity: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ColumnYaml<'a> {
    name: &'a str,
    json_path: &'a str,
}

impl Definition {
    /// cosi's `ResourceDefinitionSpec.Fill`: the display type is the singular of the type's first
    /// label; unless a resource opts out (none the simulator serves does), the aliases gain the display
    /// type in lower case and, for two capitals or more, the capitals (`MachineStatuses` → `ms`), with
    /// an `s` unless they end in `S` (`ResourceDefinitions` → `rd`, `rds`), and `allAliases` the
    /// lower-case plural with each prefix of the suffix
    /// (`machinestatuses`, `machinestatuses.runtime`, `machinestatuses.runtime.talos`) followed by the
    /// aliases.
    pub(crate) fn fill(declared: &Declared<'_>) -> Definition {
        let (name, suffix) = declared
            .type_
            .split_once('.')
            .expect("a resource type is <Plural>.<suffix>");
        let display_type = singular(name);
        let mut aliases: Vec<String> = declared.aliases.iter().map(|a| a.to_string()).collect();
        aliases.push(display_type.to_lowercase());
        let mut all_aliases = vec![name.to_lowercase()];
        let labels: Vec<&str> = suffix.split('.').collect();
        for i in 1..labels.len() {
            all_aliases.push(format!("{}.{}", name.to_lowercase(), labels[..i].join(".")));
        }
        let capitals: String = name.chars().filter(char::is_ascii_uppercase).collect();
        if capitals.len() > 1 {
            aliases.push(capitals.to_lowercase());
            if !capitals.ends_with('S') {
                aliases.push(format!("{}s", capitals.to_lowercase()));
            }
        }
        all_aliases.extend(aliases.iter().cloned());
        Definition {
            type_: declared.type_.to_string(),
            display_type,
            default_namespace: declared.default_namespace.to_string(),
            aliases,
            all_aliases,
            print_columns: declared.print_columns.clone(),
            sensitive: declared.sensitive,
        }
    }

    /// The resource's id: the type in lower case (`ResourceDefinitionSpec.ID`).
    pub(crate) fn id(&self) -> String {
        self.type_.to_lowercase()
    }

    /// The `ResourceDefinitions.meta.cosi.dev` resource.
    pub(crate) fn resource(&self) -> DesiredResource {
        let spec = ResourceDefinitionSpec {
            resource_type: self.type_.clone(),
            display_type: self.display_type.clone(),
            default_namespace: self.default_namespace.clone(),
            aliases: self.aliases.clone(),
            all_aliases: self.all_aliases.clone(),
            print_columns: self
                .print_columns
                .iter()
                .map(|c| PrintColumnSpec {
                    name: c.name.to_string(),
                    json_path: c.json_path.to_string(),
                })
                .collect(),
            sensitivity: if self.sensitive { SENSITIVE } else { 0 },
        };
        let yaml = to_yaml(&DefinitionYaml {
            type_: &self.type_,
            display_type: &self.display_type,
            default_namespace: &self.default_namespace,
            aliases: &self.aliases,
            all_aliases: &self.all_aliases,
            print_columns: self
                .print_columns
                .iter()
                .map(|c| ColumnYaml {
                    name: c.name,
                    json_path: c.json_path,
                })
                .collect(),
            sensitivity: self.sensitive.then_some("sensitive"),
        });
        meta_resource(RESOURCE_DEFINITION_TYPE, self.id(), &spec, yaml)
    }
}

/// What Talos says each namespace holds (talos v1.14.1 `v1alpha2_state.go`, `meta` from cosi's
/// `NamespaceRegistry.RegisterDefault`).
pub(crate) fn namespace_description(namespace: &str) -> Option<&'static str> {
    Some(match namespace {
        META_NS => "Metadata namespace which contains resource and namespace definitions.",
        "runtime" => "Talos v1alpha1 subsystems glue resources.",
        "cluster" => "Cluster configuration and discovery resources.",
        "cluster-raw" => "Cluster unmerged raw resources.",
        "config" => "Talos node configuration.",
        "etcd" => "etcd resources.",
        "files" => "Files and file-like resources.",
        "hardware" => "Hardware resources.",
        "k8s" => "Kubernetes all node types resources.",
        "controlplane" => "Kubernetes control plane resources.",
        "kubespan" => "KubeSpan resources.",
        "network" => "Networking resources.",
        "network-config" => "Networking configuration resources.",
        "cri" => "CRI Seccomp resources.",
        "containers" => "Talos-managed container resources.",
        "secrets" => "Resources with secret material.",
        "security" => "Security resources.",
        "perf" => "Stats resources.",
        "storage" => "Storage resources.",
        _ => return None,
    })
}

/// The `Namespaces.meta.cosi.dev` resource of `namespace`.
pub(crate) fn namespace_resource(namespace: &str) -> DesiredResource {
    let description = namespace_description(namespace).unwrap_or_default();
    meta_resource(
        NAMESPACE_TYPE,
        namespace.to_string(),
        &NamespaceSpec {
            description: description.to_string(),
        },
        to_yaml(&serde_json::json!({ "description": description })),
    )
}

fn meta_resource(type_: &str, id: String, spec: &impl Message, yaml: String) -> DesiredResource {
    DesiredResource {
        key: ResourceKey {
            namespace: META_NS.to_string(),
            type_: type_.to_string(),
            id,
        },
        owner: OWNER.to_string(),
        proto_spec: spec.encode_to_vec(),
        yaml_spec: yaml,
        labels: Default::default(),
        annotations: Default::default(),
    }
}

fn to_yaml(value: &impl Serialize) -> String {
    // Plain structs of strings and lists: serializing cannot fail.
    serde_yaml::to_string(value).unwrap_or_default()
}

/// The singular of a plural type name, as go-pluralize (github.com/gertd/go-pluralize, which `Fill`
/// uses) makes it for the names Talos has: `-uses` → `-us` (`Statuses`), `-ies` → `-y`
/// (`Policies`), `-sses` → `-ss` (`Addresses`), `Metadatas` → `Metadata`, otherwise the final `s`
/// goes (`Members`, `Services`, `Configs`).
fn singular(plural: &str) -> String {
    for (ending, replacement) in [("uses", "us"), ("sses", "ss"), ("ies", "y")] {
        if let Some(stem) = plural.strip_suffix(ending) {
            return format!("{stem}{replacement}");
        }
    }
    plural.strip_suffix('s').unwrap_or(plural).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared<'a>(type_: &'a str, aliases: &'a [&'a str]) -> Declared<'a> {
        Declared {
            type_,
            default_namespace: "runtime",
            aliases,
            print_columns: Vec::new(),
            sensitive: false,
        }
    }

    #[test]
    fn fill_adds_the_aliases_cosi_adds() {
        let filled = Definition::fill(&declared("MachineStatuses.runtime.talos.dev", &[]));
        assert_eq!(filled.display_type, "MachineStatus");
        assert_eq!(filled.aliases, ["machinestatus", "ms"]);
        assert_eq!(
            filled.all_aliases,
            [
                "machinestatuses",
                "machinestatuses.runtime",
                "machinestatuses.runtime.talos",
                "machinestatus",
                "ms"
            ]
        );
        assert_eq!(filled.id(), "machinestatuses.runtime.talos.dev");

        // A single capital adds no abbreviation; declared aliases come first.
        let filled = Definition::fill(&declared("Services.v1alpha1.talos.dev", &["svc"]));
        assert_eq!(filled.display_type, "Service");
        assert_eq!(filled.aliases, ["svc", "service"]);

        // Capitals not ending in S get a plural too.
        let filled = Definition::fill(&declared("APIServerConfigs.kubernetes.talos.dev", &[]));
        assert_eq!(filled.display_type, "APIServerConfig");
        assert_eq!(filled.aliases, ["apiserverconfig", "apisc", "apiscs"]);
    }

    #[test]
    fn singulars() {
        for (plural, singular_) in [
            ("StaticPodStatuses", "StaticPodStatus"),
            ("PlatformMetadatas", "PlatformMetadata"),
            ("APIServerConfigs", "APIServerConfig"),
            ("ResourceDefinitions", "ResourceDefinition"),
            ("Namespaces", "Namespace"),
            ("Addresses", "Address"),
        ] {
            assert_eq!(singular(plural), singular_);
        }
    }

    #[test]
    fn definition_yaml_is_what_talosctl_reads() {
        let rd = Definition::fill(&Declared {
            type_: RESOURCE_DEFINITION_TYPE,
            default_namespace: META_NS,
            aliases: &["api-resources"],
            print_columns: vec![PrintColumn {
                name: "Aliases",
                json_path: "{.aliases[:]}",
            }],
            sensitive: false,
        })
        .resource();
        let yaml: serde_yaml::Value = serde_yaml::from_str(&rd.yaml_spec).unwrap();
        assert_eq!(yaml["type"], "ResourceDefinitions.meta.cosi.dev");
        assert_eq!(yaml["displayType"], "ResourceDefinition");
        assert_eq!(yaml["aliases"][0], "api-resources");
        assert_eq!(yaml["printColumns"][0]["jsonPath"], "{.aliases[:]}");
        assert!(yaml.get("sensitivity").is_none());
        let spec = ResourceDefinitionSpec::decode(rd.proto_spec.as_slice()).unwrap();
        assert_eq!(spec.all_aliases.last().unwrap(), "rds");
        assert_eq!(rd.key.id, "resourcedefinitions.meta.cosi.dev");
    }
}
