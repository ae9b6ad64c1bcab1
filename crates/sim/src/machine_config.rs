//! Machine configs: the multi-document YAML a simulated node boots with, and how the node reads and
//! validates one pushed by `ApplyConfiguration` (only the fields upgrades touch are interpreted; the
//! rest is stored byte-exact, as Talos does).

use base64::Engine as _;
use semver::Version;
use serde_yaml::Value;

use super::compat;
use super::config::Role;
use super::image_ref::ImageRef;

/// A Kubernetes component whose image a machine config selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Component {
    Kubelet,
    ApiServer,
    ControllerManager,
    Scheduler,
    Proxy,
}

impl Component {
    pub(crate) const ALL: [Component; 5] = [
        Component::Kubelet,
        Component::ApiServer,
        Component::ControllerManager,
        Component::Scheduler,
        Component::Proxy,
    ];

    /// The Talos 1.14 document that configures the component (machinery v1.14.1
    /// `config/types/k8s/{kubelet,apiserver,controller_manager,scheduler,proxy}.go`).
    pub(crate) fn kind(self) -> &'static str {
        match self {
            Component::Kubelet => "KubeletConfig",
            Component::ApiServer => "KubeAPIServerConfig",
            Component::ControllerManager => "KubeControllerManagerConfig",
            Component::Scheduler => "KubeSchedulerConfig",
            Component::Proxy => "KubeProxyConfig",
        }
    }

    fn from_kind(kind: &str) -> Option<Component> {
        Component::ALL.into_iter().find(|c| c.kind() == kind)
    }

    /// How the document's own `Validate` names the component in its errors.
    fn document_name(self) -> &'static str {
        match self {
            Component::Kubelet => "kubelet",
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
            Component::Scheduler => "scheduler",
            Component::Proxy => "proxy",
        }
    }

    /// The deprecated v1alpha1 section holding the component's settings (and its `image`).
    fn v1alpha1_section(self) -> [&'static str; 2] {
        match self {
            Component::Kubelet => ["machine", "kubelet"],
            Component::ApiServer => ["cluster", "apiServer"],
            Component::ControllerManager => ["cluster", "controllerManager"],
            Component::Scheduler => ["cluster", "scheduler"],
            Component::Proxy => ["cluster", "proxy"],
        }
    }

    /// `enabled: false` turns the component off, and its document needs no image then.
    fn can_be_disabled(self) -> bool {
        matches!(
            self,
            Component::ControllerManager | Component::Scheduler | Component::Proxy
        )
    }
}

/// The images a machine config selects (defaults filled in for absent fields, as Talos does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ComponentImages {
    pub kubelet: String,
    pub apiserver: String,
    pub controller_manager: String,
    pub scheduler: String,
    pub proxy: String,
}

impl ComponentImages {
    pub(crate) fn get(&self, component: Component) -> &str {
        match component {
            Component::Kubelet => &self.kubelet,
            Component::ApiServer => &self.apiserver,
            Component::ControllerManager => &self.controller_manager,
            Component::Scheduler => &self.scheduler,
            Component::Proxy => &self.proxy,
        }
    }

    fn get_mut(&mut self, component: Component) -> &mut String {
        match component {
            Component::Kubelet => &mut self.kubelet,
            Component::ApiServer => &mut self.apiserver,
            Component::ControllerManager => &mut self.controller_manager,
            Component::Scheduler => &mut self.scheduler,
            Component::Proxy => &mut self.proxy,
        }
    }
}

/// One document of a config other than the v1alpha1 one, identified as Talos's config decoder does
/// (`apiVersion`/`kind`/`name`, and the line its mapping starts on, for its errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DocumentId {
    pub api_version: String,
    pub kind: String,
    pub name: String,
    pub line: usize,
}

/// A Kube* component document of a config created on Talos 1.14.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KubeDocument {
    pub component: Component,
    /// Top-level `image` (empty when left out).
    pub image: String,
    /// `enabled` (controller manager, scheduler, proxy); absent means true.
    pub enabled: bool,
}

/// What the node takes from a parsed machine config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParsedConfig {
    pub machine_type: Role,
    pub install_image: Option<String>,
    /// The images the components run: from the component's document where the config has one,
    /// from the v1alpha1 field otherwise, the running Talos's default when neither says
    /// (machinery v1.14.1 `config/container/container.go`, `K8s*Config`: the document wins).
    pub images: ComponentImages,
    /// The v1alpha1 view alone (field or default), which v1alpha1's own validation checks.
    pub v1alpha1_images: ComponentImages,
    /// Every document besides the v1alpha1 one, in order.
    pub documents: Vec<DocumentId>,
    /// The Kube* component documents, in order.
    pub kube_documents: Vec<KubeDocument>,
    /// The v1alpha1 sections a 1.14 document conflicts with, present in this config.
    pub v1alpha1_sections: Vec<V1Alpha1Section>,
}

/// A v1alpha1 section (or field) that a Talos 1.14 document replaces; present together with that
/// document it is a validation error (`V1Alpha1ConflictValidate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum V1Alpha1Section {
    /// `.machine.kubelet`, `.cluster.apiServer`, ... (the component's section).
    Component(Component),
    /// `.cluster.controlPlane.localAPIServerPort` (non-zero).
    LocalApiServerPort,
    /// `.machine.controlPlane.controllerManager`.
    MachineControllerManager,
    /// `.machine.controlPlane.scheduler`.
    MachineScheduler,
    /// `.machine.install`.
    MachineInstall,
}

/// Kinds registered in machinery v1.14.1's `config/types` that v1.13.5's registry does not know: a
/// node below 1.14 cannot decode a config carrying one of them.
const KINDS_NEW_IN_1_14: &[&str] = &[
    "BGPInstanceConfig",
    "CRIBaseRuntimeSpecConfig",
    "CRICustomizationConfig",
    "ContainerConfig",
    "DiscoveryIdentityConfig",
    "DiscoveryServiceConfig",
    "EtcFileConfig",
    "FilesystemScrubConfig",
    "FilesystemTrimConfig",
    "HTTPProbeConfig",
    "ImageCacheConfig",
    "KernelModuleConfig",
    "KubeAPIServerCAConfig",
    "KubeAPIServerConfig",
    "KubeAdmissionControlConfig",
    "KubeAggregatorCAConfig",
    "KubeAuditPolicyConfig",
    "KubeAuthenticationConfig",
    "KubeAuthorizerConfig",
    "KubeClusterConfig",
    "KubeControllerManagerConfig",
    "KubeCoreDNSConfig",
    "KubeCredentialProviderConfig",
    "KubeEtcdEncryptionConfig",
    "KubeExternalManifestConfig",
    "KubeFlannelCNIConfig",
    "KubeInlineManifestConfig",
    "KubeNetworkConfig",
    "KubeNodeConfig",
    "KubePrismConfig",
    "KubeProxyConfig",
    "KubeSchedulerConfig",
    "KubeServiceAccountConfig",
    "KubeStaticPodConfig",
    "KubeTalosAPIAccessConfig",
    "KubeletConfig",
    "LVMLogicalVolumeConfig",
    "LVMVolumeGroupConfig",
    "RAIDArrayConfig",
    "SecurityProfileConfig",
    "SysctlConfig",
    "SysfsConfig",
    "UdevRulesConfig",
    "UnattendedInstallConfig",
    "VethConfig",
];

/// The kinds that implement `container.ControlplaneOnlyConfig` in machinery v1.14.1
/// (`config/types/k8s`): a worker config carrying one fails validation.
const CONTROL_PLANE_ONLY_KINDS: &[&str] = &[
    "KubeAPIServerConfig",
    "KubeAdmissionControlConfig",
    "KubeAggregatorCAConfig",
    "KubeAuditPolicyConfig",
    "KubeAuthenticationConfig",
    "KubeAuthorizerConfig",
    "KubeControllerManagerConfig",
    "KubeCoreDNSConfig",
    "KubeEtcdEncryptionConfig",
    "KubeFlannelCNIConfig",
    "KubeProxyConfig",
    "KubeSchedulerConfig",
    "KubeServiceAccountConfig",
    "KubeTalosAPIAccessConfig",
];

/// The CAs a generated config carries, as `talosctl gen config` puts them in (PEM).
pub(crate) struct ConfigSecrets {
    /// The Talos OS CA: `.machine.ca` (the key only on control planes).
    pub os_ca_crt: String,
    pub os_ca_key: String,
    /// The etcd CA: `.cluster.etcd.ca`, control planes only.
    pub etcd_ca_crt: String,
    pub etcd_ca_key: String,
}

/// Inputs for a generated config.
pub(crate) struct ConfigInputs<'a> {
    pub cluster_name: &'a str,
    pub node_name: &'a str,
    pub role: Role,
    pub kubernetes_version: &'a Version,
    pub installer_image: &'a str,
    pub control_plane_endpoint: &'a str,
    /// A mirror for the component images, replacing `registry.k8s.io` and `ghcr.io/siderolabs`.
    pub image_registry: Option<&'a str>,
    /// The install image in an `UnattendedInstallConfig` document rather than `machine.install`.
    pub unattended_install: bool,
    /// The component images in Kube* documents rather than v1alpha1 fields (Talos 1.14's shape).
    pub kubernetes_documents: bool,
    pub secrets: &'a ConfigSecrets,
}

pub(crate) fn default_images(kubernetes: &Version) -> ComponentImages {
    let tag = compat::tag(kubernetes);
    ComponentImages {
        kubelet: format!("ghcr.io/siderolabs/kubelet:{tag}"),
        apiserver: format!("registry.k8s.io/kube-apiserver:{tag}"),
        controller_manager: format!("registry.k8s.io/kube-controller-manager:{tag}"),
        scheduler: format!("registry.k8s.io/kube-scheduler:{tag}"),
        proxy: format!("registry.k8s.io/kube-proxy:{tag}"),
    }
}

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// A plausible `talosctl gen config` result: the v1alpha1 document plus further documents, so clients
/// must cope with multi-document configs. Worker configs carry no control-plane component images, as
/// generated worker configs don't. With `kubernetes_documents` the shape is machinery v1.14.1
/// `config/generate` with the 1.14 contract: no `.machine.kubelet` nor `.cluster.{apiServer,
/// controllerManager,scheduler,proxy}`, a `KubeletConfig` document on every node and the four
/// control-plane documents on control planes, each with its `image`. The config passes Talos's own
/// validation (the Go conformance check runs machinery's on it), hence the CAs.
pub(crate) fn generate(inputs: &ConfigInputs<'_>) -> String {
    let mut images = default_images(inputs.kubernetes_version);
    if let Some(registry) = inputs.image_registry {
        for component in Component::ALL {
            let image = images.get_mut(component);
            if let Some((_, name)) = image.rsplit_once('/') {
                *image = format!("{registry}/{name}");
            }
        }
    }
    let control_plane = inputs.role.is_control_plane();
    let documents = inputs.kubernetes_documents;
    let secrets = inputs.secrets;
    let mut out = String::new();
    out.push_str("version: v1alpha1\ndebug: false\npersist: true\nmachine:\n");
    out.push_str(&format!("    type: {}\n", inputs.role.as_str()));
    out.push_str("    token: simtok.0123456789abcdef\n");
    out.push_str(&format!(
        "    ca:\n        crt: {}\n",
        b64(&secrets.os_ca_crt)
    ));
    if control_plane {
        out.push_str(&format!("        key: {}\n", b64(&secrets.os_ca_key)));
    }
    out.push_str("    certSANs: []\n");
    if !documents {
        out.push_str(&format!(
            "    kubelet:\n        image: {}\n        defaultRuntimeSeccompProfileEnabled: true\n",
            images.kubelet
        ));
    }
    out.push_str(&format!(
        "    network:\n        hostname: {}\n",
        inputs.node_name
    ));
    if !inputs.unattended_install {
        out.push_str(&format!(
            "    install:\n        disk: /dev/sda\n        image: {}\n        wipe: false\n",
            inputs.installer_image
        ));
    }
    out.push_str("cluster:\n");
    out.push_str(&format!("    clusterName: {}\n", inputs.cluster_name));
    out.push_str(&format!(
        "    controlPlane:\n        endpoint: {}\n",
        inputs.control_plane_endpoint
    ));
    out.push_str("    network:\n        dnsDomain: cluster.local\n        podSubnets:\n            - 10.244.0.0/16\n        serviceSubnets:\n            - 10.96.0.0/12\n");
    if control_plane {
        if !documents {
            for (key, component) in [
                ("apiServer", Component::ApiServer),
                ("controllerManager", Component::ControllerManager),
                ("scheduler", Component::Scheduler),
                ("proxy", Component::Proxy),
            ] {
                out.push_str(&format!(
                    "    {key}:\n        image: {}\n",
                    images.get(component)
                ));
            }
        }
        out.push_str(&format!(
            "    etcd:\n        ca:\n            crt: {}\n            key: {}\n        advertisedSubnets: []\n",
            b64(&secrets.etcd_ca_crt),
            b64(&secrets.etcd_ca_key)
        ));
    }
    out.push_str("---\napiVersion: v1alpha1\nkind: TimeSyncConfig\nntp:\n    servers:\n        - time.cloudflare.com\n");
    if documents {
        out.push_str(&format!(
            "---\napiVersion: v1alpha1\nkind: KubeletConfig\nimage: {}\ndefaultRuntimeSeccompProfileEnabled: true\n",
            images.kubelet
        ));
        if control_plane {
            for component in [
                Component::ApiServer,
                Component::ControllerManager,
                Component::Scheduler,
                Component::Proxy,
            ] {
                out.push_str(&format!(
                    "---\napiVersion: v1alpha1\nkind: {}\nimage: {}\n",
                    component.kind(),
                    images.get(component)
                ));
            }
        }
    }
    if inputs.unattended_install {
        out.push_str(&format!(
            "---\napiVersion: v1alpha1\nkind: UnattendedInstallConfig\ninstaller:\n    image: {}\nprovisioning:\n    diskSelector:\n        match: disk.dev_path == '/dev/sda'\n",
            inputs.installer_image
        ));
    }
    out
}

fn lookup<'a>(doc: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let mut cur = doc;
    for key in path {
        cur = cur.get(*key)?;
    }
    Some(cur)
}

/// Present and not null, as Go's YAML decoder leaves a pointer field nil for a missing or null key.
fn present(doc: &Value, path: &[&str]) -> bool {
    lookup(doc, path).is_some_and(|v| !v.is_null())
}

fn lookup_str(doc: &Value, path: &[&str]) -> Result<Option<String>, String> {
    match lookup(doc, path) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("{} must be a string", path.join("."))),
    }
}

/// The YAML documents of `text`, each with the 1-based line its content starts on (where Talos's
/// decoder reports the document). Documents are split at `---` lines, as YAML does at the top level.
fn split_documents(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut first_line = None;
    for (index, line) in text.lines().enumerate() {
        if line.starts_with("---") && line[3..].trim().is_empty() {
            out.push((
                first_line.unwrap_or(index + 1),
                std::mem::take(&mut current),
            ));
            first_line = None;
            continue;
        }
        let content = line.trim();
        if first_line.is_none() && !content.is_empty() && !content.starts_with('#') {
            first_line = Some(index + 1);
        }
        current.push_str(line);
        current.push('\n');
    }
    out.push((first_line.unwrap_or(0), current));
    out
}

/// Parse a full machine config (all documents) and extract what the simulator acts on.
/// `defaults` supplies images for absent fields.
pub(crate) fn parse(data: &[u8], defaults: &ComponentImages) -> Result<ParsedConfig, String> {
    let text = std::str::from_utf8(data).map_err(|_| "config is not valid UTF-8".to_string())?;
    let mut v1alpha1 = None;
    let mut unattended_image = None;
    let mut documents: Vec<DocumentId> = Vec::new();
    let mut kube_documents = Vec::new();
    for (line, chunk) in split_documents(text) {
        let value: Value =
            serde_yaml::from_str(&chunk).map_err(|e| format!("failed to parse config: {e}"))?;
        if value.is_null() {
            continue;
        }
        if !value.is_mapping() {
            return Err("failed to parse config: document is not a mapping".into());
        }
        if value.get("version").and_then(Value::as_str) == Some("v1alpha1") {
            if v1alpha1.is_some() {
                return Err("failed to parse config: duplicate v1alpha1 document".into());
            }
            v1alpha1 = Some(value);
            continue;
        }
        let Some(kind) = value.get("kind").and_then(Value::as_str) else {
            return Err(
                "failed to parse config: document has neither version: v1alpha1 nor kind".into(),
            );
        };
        let id = DocumentId {
            api_version: lookup_str(&value, &["apiVersion"])?.unwrap_or_default(),
            kind: kind.to_string(),
            name: lookup_str(&value, &["name"])?.unwrap_or_default(),
            line,
        };
        // machinery `config/configloader/internal/decoder/decoder.go`.
        if documents
            .iter()
            .any(|d| (&d.api_version, &d.kind, &d.name) == (&id.api_version, &id.kind, &id.name))
        {
            return Err(format!(
                "duplicate document {}/{}/{} is not allowed (line {})",
                id.api_version, id.kind, id.name, id.line
            ));
        }
        if kind == "UnattendedInstallConfig" {
            unattended_image = lookup_str(&value, &["installer", "image"])?;
        } else if let Some(component) = Component::from_kind(kind) {
            let enabled = match lookup(&value, &["enabled"]) {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(format!("{kind}: enabled must be a boolean")),
            };
            kube_documents.push(KubeDocument {
                component,
                image: lookup_str(&value, &["image"])?.unwrap_or_default(),
                enabled,
            });
        }
        documents.push(id);
    }
    let doc = v1alpha1.ok_or("failed to parse config: no v1alpha1 document (version: v1alpha1)")?;
    let machine_type = match lookup_str(&doc, &["machine", "type"])?.as_deref() {
        Some("controlplane") | Some("init") => Role::ControlPlane,
        Some("worker") => Role::Worker,
        Some(other) => return Err(format!("unknown machine type {other:?}")),
        None => return Err("machine.type is required".into()),
    };
    let mut v1alpha1_images = defaults.clone();
    let mut v1alpha1_sections = Vec::new();
    for component in Component::ALL {
        let [top, key] = component.v1alpha1_section();
        if present(&doc, &[top, key]) {
            v1alpha1_sections.push(V1Alpha1Section::Component(component));
        }
        if let Some(image) = lookup_str(&doc, &[top, key, "image"])?
            && !image.is_empty()
        {
            *v1alpha1_images.get_mut(component) = image;
        }
    }
    let port = lookup(&doc, &["cluster", "controlPlane", "localAPIServerPort"]);
    if port.is_some_and(|p| !p.is_null() && p.as_u64() != Some(0)) {
        v1alpha1_sections.push(V1Alpha1Section::LocalApiServerPort);
    }
    for (key, section) in [
        (
            "controllerManager",
            V1Alpha1Section::MachineControllerManager,
        ),
        ("scheduler", V1Alpha1Section::MachineScheduler),
    ] {
        if present(&doc, &["machine", "controlPlane", key]) {
            v1alpha1_sections.push(section);
        }
    }
    if present(&doc, &["machine", "install"]) {
        v1alpha1_sections.push(V1Alpha1Section::MachineInstall);
    }
    let mut images = v1alpha1_images.clone();
    for kube in &kube_documents {
        if kube.enabled {
            *images.get_mut(kube.component) = kube.image.clone();
        }
    }
    Ok(ParsedConfig {
        machine_type,
        // Talos 1.14 reads the install image from `UnattendedInstallConfig` where a config has one.
        install_image: match unattended_image {
            Some(image) => Some(image),
            None => lookup_str(&doc, &["machine", "install", "image"])?,
        },
        images,
        v1alpha1_images,
        documents,
        kube_documents,
        v1alpha1_sections,
    })
}

/// What a node running `talos` says when it cannot even decode `config`: a node below 1.14 does not
/// know the kinds 1.14 added, and its decoder stops at the first one (machinery v1.13.5
/// `config/configloader/internal/decoder/decoder.go` wrapping `config/internal/registry` `New`).
pub(crate) fn check_decodable(config: &ParsedConfig, talos: &Version) -> Result<(), String> {
    if compat::knows_kubernetes_documents(talos) {
        return Ok(());
    }
    match config
        .documents
        .iter()
        .find(|d| KINDS_NEW_IN_1_14.contains(&d.kind.as_str()))
    {
        Some(d) => Err(format!(
            "error decoding document {}/{}/{} (line {}): {:?} {:?}: not registered",
            d.api_version, d.kind, d.name, d.line, d.kind, d.api_version
        )),
        None => Ok(()),
    }
}

/// Errors joined the way hashicorp/go-multierror prints them (what Talos's validation returns).
fn multierror(errors: &[String]) -> String {
    match errors {
        [one] => format!("1 error occurred:\n\t* {one}\n\n"),
        many => format!(
            "{} errors occurred:\n\t{}\n\n",
            many.len(),
            many.iter()
                .map(|e| format!("* {e}"))
                .collect::<Vec<_>>()
                .join("\n\t")
        ),
    }
}

/// `compatibility.ValidateKubernetesImageTag` (machinery v1.14.1 `compatibility/kubernetes_image.go`):
/// the image's `:v<version>` tag, and that version supported by the running Talos.
fn validate_kubernetes_image_tag(image: &str, talos: &Version) -> Result<(), String> {
    let invalid = || {
        format!(
            "failed to parse Kubernetes version from image reference {image:?}: invalid image reference: {image:?}"
        )
    };
    let version = ImageRef::parse(image)
        .ok()
        .filter(|i| i.tag.as_deref().is_some_and(|t| t.starts_with('v')))
        .and_then(|i| i.version())
        .ok_or_else(invalid)?;
    compat::check_kubernetes(talos, &version)
}

/// The node-side validation of an applied config (talos-api.md §1.3 ApplyConfiguration, §5): the
/// machine type unchanged, then what machinery's `Container.Validate` checks that the simulator models,
/// in its order and words: v1alpha1's Kubernetes image versions (Talos ≥ 1.11; kubelet where
/// `.machine.kubelet` is set, the control-plane static pods on control planes), each Kube* document's
/// own validation (image required unless disabled, its tag in range), the conflicts of each document
/// with the v1alpha1 sections it replaces, and control-plane-only documents on a worker. Below 1.11,
/// where Talos does not check versions, the simulator still insists on tagged images.
pub(crate) fn validate(config: &ParsedConfig, role: Role, talos: &Version) -> Result<(), String> {
    if config.machine_type != role {
        return Err(format!(
            "machine type can't be changed from {role} to {}",
            config.machine_type
        ));
    }
    let control_plane = role.is_control_plane();
    let matrix = compat::enforces_kubernetes_matrix(talos);
    let mut errors = Vec::new();

    // v1alpha1.Config.ValidateKubernetesVersions (`config/types/v1alpha1/v1alpha1_validation.go`).
    let mut v1alpha1_checked = Vec::new();
    if config
        .v1alpha1_sections
        .contains(&V1Alpha1Section::Component(Component::Kubelet))
        || !config
            .kube_documents
            .iter()
            .any(|d| d.component == Component::Kubelet)
    {
        v1alpha1_checked.push(("kubelet", "machine.kubelet.image", Component::Kubelet));
    }
    if control_plane {
        v1alpha1_checked.push((
            "kube-apiserver",
            "cluster.apiServer.image",
            Component::ApiServer,
        ));
        v1alpha1_checked.push((
            "kube-controller-manager",
            "cluster.controllerManager.image",
            Component::ControllerManager,
        ));
        v1alpha1_checked.push((
            "kube-scheduler",
            "cluster.scheduler.image",
            Component::Scheduler,
        ));
    }
    let mut v1alpha1_errors = Vec::new();
    for (name, field, component) in v1alpha1_checked {
        let image = config.v1alpha1_images.get(component);
        if matrix {
            if let Err(e) = validate_kubernetes_image_tag(image, talos) {
                v1alpha1_errors.push(format!("{name} image is not valid: {e}"));
            }
        } else if let Err(e) = ImageRef::parse_tagged(image) {
            v1alpha1_errors.push(format!("{field}: {e}"));
        }
    }
    if !v1alpha1_errors.is_empty() {
        errors.push(format!("v1alpha1.Config: {}", multierror(&v1alpha1_errors)));
    }

    // Each document's Validate (`config/types/k8s/*.go`), then V1Alpha1ConflictValidate.
    for kube in &config.kube_documents {
        let name = kube.component.document_name();
        if kube.component.can_be_disabled() && !kube.enabled {
            continue;
        }
        if kube.image.is_empty() {
            errors.push(format!(
                "{}: {name} image cannot be empty",
                kube.component.kind()
            ));
        } else if let Err(e) = validate_kubernetes_image_tag(&kube.image, talos) {
            errors.push(format!(
                "{}: {name} image is not valid: {e}",
                kube.component.kind()
            ));
        }
    }
    let has = |section| config.v1alpha1_sections.contains(&section);
    for document in &config.documents {
        let conflicts: &[(V1Alpha1Section, &str)] = match document.kind.as_str() {
            "KubeletConfig" => &[(
                V1Alpha1Section::Component(Component::Kubelet),
                "kubelet config is already set in v1alpha1 config (.machine.kubelet)",
            )],
            "KubeAPIServerConfig" => &[
                (
                    V1Alpha1Section::Component(Component::ApiServer),
                    "kube-apiserver config is already set in v1alpha1 config (.cluster.apiServer)",
                ),
                (
                    V1Alpha1Section::LocalApiServerPort,
                    "kube-apiserver API port is already set in v1alpha1 config (.cluster.controlPlane.localAPIServerPort)",
                ),
            ],
            "KubeControllerManagerConfig" => &[
                (
                    V1Alpha1Section::Component(Component::ControllerManager),
                    "kube-controller-manager config is already set in v1alpha1 config (.cluster.controllerManager)",
                ),
                (
                    V1Alpha1Section::MachineControllerManager,
                    "kube-controller-manager config is already set in v1alpha1 config (.machine.controlplane.controllerManager)",
                ),
            ],
            "KubeSchedulerConfig" => &[
                (
                    V1Alpha1Section::Component(Component::Scheduler),
                    "kube-scheduler config is already set in v1alpha1 config (.cluster.scheduler)",
                ),
                (
                    V1Alpha1Section::MachineScheduler,
                    "kube-scheduler config is already set in v1alpha1 config (.machine.controlplane.scheduler)",
                ),
            ],
            "KubeProxyConfig" => &[(
                V1Alpha1Section::Component(Component::Proxy),
                "cluster proxy config in v1alpha1 config (.machine.cluster.proxy) can't be used with KubeProxyConfig document, please remove it to avoid conflicts",
            )],
            "UnattendedInstallConfig" => &[(
                V1Alpha1Section::MachineInstall,
                "UnattendedInstallConfig config is incompatible with v1alpha1 config (.machine.install)",
            )],
            _ => &[],
        };
        // Each validator returns its first conflict only.
        if let Some((_, message)) = conflicts.iter().find(|(section, _)| has(*section)) {
            errors.push(message.to_string());
        }
    }

    // Container.validateContainer (`config/container/validate.go`).
    if !control_plane {
        let mut kinds: Vec<&str> = config
            .documents
            .iter()
            .map(|d| d.kind.as_str())
            .filter(|k| CONTROL_PLANE_ONLY_KINDS.contains(k))
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        if !kinds.is_empty() {
            errors.push(format!(
                "the following document kinds are only allowed on control plane machines: [{}]",
                kinds.join(" ")
            ));
        }
    }

    if let Some(install) = &config.install_image
        && let Err(e) = ImageRef::parse(install)
    {
        errors.push(format!("machine.install.image: {e}"));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(multierror(&errors))
    }
}

/// Version of a component from its image tag, for display ("1.34.1"), or the tag itself if it is not
/// a version.
pub(crate) fn image_version(image: &str) -> String {
    match ImageRef::parse(image) {
        Ok(parsed) => match parsed.version() {
            Some(v) => v.to_string(),
            None => parsed.tag.unwrap_or_default(),
        },
        Err(_) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generated(role: Role) -> String {
        generate(&ConfigInputs {
            cluster_name: "demo",
            node_name: "cp-1",
            role,
            kubernetes_version: &Version::new(1, 34, 1),
            installer_image: "ghcr.io/siderolabs/installer:v1.11.6",
            control_plane_endpoint: "https://127.1.1.1:6443",
            image_registry: None,
            unattended_install: false,
            kubernetes_documents: false,
            secrets: &SECRETS,
        })
    }

    /// Stand-ins: nothing in the simulator reads the CAs back.
    const SECRETS: ConfigSecrets = ConfigSecrets {
        os_ca_crt: String::new(),
        os_ca_key: String::new(),
        etcd_ca_crt: String::new(),
        etcd_ca_key: String::new(),
    };

    /// A config created on Talos 1.14 (Kube* documents, UnattendedInstallConfig) for `role`.
    fn created_on_1_14(role: Role) -> String {
        generate(&ConfigInputs {
            cluster_name: "demo",
            node_name: "n-1",
            role,
            kubernetes_version: &Version::new(1, 37, 0),
            installer_image: "factory.talos.dev/metal-installer/abc:v1.14.1",
            control_plane_endpoint: "https://127.1.1.1:6443",
            image_registry: None,
            unattended_install: true,
            kubernetes_documents: true,
            secrets: &SECRETS,
        })
    }

    fn talos(v: &str) -> Version {
        compat::parse_version(v).unwrap()
    }

    #[test]
    fn a_config_created_on_talos_1_14_carries_its_install_image_in_unattended_install_config() {
        let text = generate(&ConfigInputs {
            cluster_name: "demo",
            node_name: "worker-1",
            role: Role::Worker,
            kubernetes_version: &Version::new(1, 37, 0),
            installer_image: "factory.talos.dev/metal-installer/abc:v1.14.0",
            control_plane_endpoint: "https://127.1.1.1:6443",
            image_registry: None,
            unattended_install: true,
            kubernetes_documents: false,
            secrets: &SECRETS,
        });
        assert!(!text.contains("    install:"), "{text}");
        assert!(text.contains("kind: UnattendedInstallConfig"), "{text}");
        let parsed = parse(text.as_bytes(), &default_images(&Version::new(1, 37, 0))).unwrap();
        assert_eq!(
            parsed.install_image.as_deref(),
            Some("factory.talos.dev/metal-installer/abc:v1.14.0")
        );
    }

    #[test]
    fn a_mirror_replaces_the_registry_of_every_component_image() {
        let text = generate(&ConfigInputs {
            cluster_name: "demo",
            node_name: "cp-1",
            role: Role::ControlPlane,
            kubernetes_version: &Version::new(1, 34, 1),
            installer_image: "ghcr.io/siderolabs/installer:v1.11.6",
            control_plane_endpoint: "https://127.1.1.1:6443",
            image_registry: Some("mirror.local:5000/k8s"),
            unattended_install: false,
            kubernetes_documents: false,
            secrets: &SECRETS,
        });
        let parsed = parse(text.as_bytes(), &default_images(&Version::new(1, 34, 1))).unwrap();
        assert_eq!(
            parsed.images.apiserver,
            "mirror.local:5000/k8s/kube-apiserver:v1.34.1"
        );
        assert_eq!(
            parsed.images.kubelet,
            "mirror.local:5000/k8s/kubelet:v1.34.1"
        );
        assert_eq!(
            parsed.images.proxy,
            "mirror.local:5000/k8s/kube-proxy:v1.34.1"
        );
    }

    #[test]
    fn generated_config_parses_back() {
        let defaults = default_images(&Version::new(1, 34, 1));
        let text = generated(Role::ControlPlane);
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        assert_eq!(parsed.machine_type, Role::ControlPlane);
        assert_eq!(
            parsed.images.apiserver,
            "registry.k8s.io/kube-apiserver:v1.34.1"
        );
        assert_eq!(
            parsed.install_image.as_deref(),
            Some("ghcr.io/siderolabs/installer:v1.11.6")
        );
        validate(&parsed, Role::ControlPlane, &Version::new(1, 11, 6)).unwrap();
        let worker = generated(Role::Worker);
        assert!(!worker.contains("apiServer"));
        assert!(worker.contains("kubelet:v1.34.1"));
    }

    #[test]
    fn validation_enforces_tags_and_matrix() {
        let defaults = default_images(&Version::new(1, 34, 1));
        let text = generated(Role::ControlPlane)
            .replace("kube-apiserver:v1.34.1", "kube-apiserver:v1.36.0");
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let err = validate(&parsed, Role::ControlPlane, &Version::new(1, 11, 6)).unwrap_err();
        assert!(err.contains("1.36.0"), "{err}");
        // Talos 1.10 does not enforce the matrix at apply time.
        validate(&parsed, Role::ControlPlane, &Version::new(1, 10, 3)).unwrap();

        let text =
            generated(Role::ControlPlane).replace("kube-scheduler:v1.34.1", "kube-scheduler");
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let err = validate(&parsed, Role::ControlPlane, &Version::new(1, 10, 3)).unwrap_err();
        assert!(err.contains("must have a tag"), "{err}");

        let text = generated(Role::ControlPlane).replace("type: controlplane", "type: worker");
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        assert!(validate(&parsed, Role::ControlPlane, &Version::new(1, 11, 6)).is_err());
    }

    #[test]
    fn a_config_created_on_1_14_takes_its_images_from_the_kube_documents() {
        let defaults = default_images(&Version::new(1, 37, 0));
        let text = created_on_1_14(Role::ControlPlane);
        for absent in [
            "    kubelet:",
            "    apiServer:",
            "    proxy:",
            "    install:",
        ] {
            assert!(!text.contains(absent), "{absent} in\n{text}");
        }
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let kinds: Vec<&str> = parsed
            .kube_documents
            .iter()
            .map(|d| d.component.kind())
            .collect();
        assert_eq!(
            kinds,
            [
                "KubeletConfig",
                "KubeAPIServerConfig",
                "KubeControllerManagerConfig",
                "KubeSchedulerConfig",
                "KubeProxyConfig"
            ]
        );
        validate(&parsed, Role::ControlPlane, &talos("1.14.1")).unwrap();

        // Patching the document moves the component; the v1alpha1 view stays on the default.
        let patched = text.replace(
            "kind: KubeAPIServerConfig\nimage: registry.k8s.io/kube-apiserver:v1.37.0",
            "kind: KubeAPIServerConfig\nimage: registry.k8s.io/kube-apiserver:v1.37.1",
        );
        let parsed = parse(patched.as_bytes(), &defaults).unwrap();
        assert_eq!(
            parsed.images.apiserver,
            "registry.k8s.io/kube-apiserver:v1.37.1"
        );
        assert_eq!(parsed.v1alpha1_images.apiserver, defaults.apiserver);

        let worker = created_on_1_14(Role::Worker);
        let parsed = parse(worker.as_bytes(), &defaults).unwrap();
        assert_eq!(parsed.kube_documents.len(), 1);
        validate(&parsed, Role::Worker, &talos("1.14.1")).unwrap();
    }

    #[test]
    fn both_shapes_for_one_component_are_refused_in_talos_words() {
        let defaults = default_images(&Version::new(1, 37, 0));
        let text = created_on_1_14(Role::ControlPlane).replacen(
            "cluster:\n",
            "cluster:\n    apiServer:\n        image: registry.k8s.io/kube-apiserver:v1.37.0\n",
            1,
        );
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let err = validate(&parsed, Role::ControlPlane, &talos("1.14.1")).unwrap_err();
        assert_eq!(
            err,
            "1 error occurred:\n\t* kube-apiserver config is already set in v1alpha1 config (.cluster.apiServer)\n\n"
        );
        let text = created_on_1_14(Role::Worker).replacen(
            "machine:\n",
            "machine:\n    kubelet:\n        image: ghcr.io/siderolabs/kubelet:v1.37.0\n",
            1,
        );
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let err = validate(&parsed, Role::Worker, &talos("1.14.1")).unwrap_err();
        assert!(
            err.contains("kubelet config is already set in v1alpha1 config (.machine.kubelet)"),
            "{err}"
        );
    }

    #[test]
    fn kube_documents_are_checked_as_talos_checks_them() {
        let defaults = default_images(&Version::new(1, 37, 0));
        let v = talos("1.14.1");
        // Control-plane documents in a worker config.
        let text = format!(
            "{}---\napiVersion: v1alpha1\nkind: KubeSchedulerConfig\nimage: registry.k8s.io/kube-scheduler:v1.37.0\n",
            created_on_1_14(Role::Worker)
        );
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        let err = validate(&parsed, Role::Worker, &v).unwrap_err();
        assert!(
            err.contains("the following document kinds are only allowed on control plane machines: [KubeSchedulerConfig]"),
            "{err}"
        );
        // The image is required, and its tag must be a version this Talos supports.
        let text = created_on_1_14(Role::ControlPlane)
            .replace("image: registry.k8s.io/kube-proxy:v1.37.0", "enabled: true");
        let err = validate(
            &parse(text.as_bytes(), &defaults).unwrap(),
            Role::ControlPlane,
            &v,
        )
        .unwrap_err();
        assert!(
            err.contains("KubeProxyConfig: proxy image cannot be empty"),
            "{err}"
        );
        let text = created_on_1_14(Role::ControlPlane).replace(
            "image: registry.k8s.io/kube-scheduler:v1.37.0",
            "image: registry.k8s.io/kube-scheduler:v1.38.0",
        );
        let err = validate(
            &parse(text.as_bytes(), &defaults).unwrap(),
            Role::ControlPlane,
            &v,
        )
        .unwrap_err();
        assert!(
            err.contains("KubeSchedulerConfig: scheduler image is not valid: version of Kubernetes 1.38.0 is too new to be used with Talos 1.14.1"),
            "{err}"
        );
        // A disabled component needs no image.
        let text = created_on_1_14(Role::ControlPlane).replace(
            "image: registry.k8s.io/kube-proxy:v1.37.0",
            "enabled: false",
        );
        validate(
            &parse(text.as_bytes(), &defaults).unwrap(),
            Role::ControlPlane,
            &v,
        )
        .unwrap();
    }

    #[test]
    fn a_node_below_1_14_cannot_decode_the_new_kinds() {
        let defaults = default_images(&Version::new(1, 37, 0));
        let text = created_on_1_14(Role::Worker);
        let parsed = parse(text.as_bytes(), &defaults).unwrap();
        check_decodable(&parsed, &talos("1.14.0")).unwrap();
        let err = check_decodable(&parsed, &talos("1.13.5")).unwrap_err();
        let line = text
            .lines()
            .position(|l| l == "apiVersion: v1alpha1")
            .map(|i| i + 1)
            .unwrap();
        // TimeSyncConfig (known to 1.13) comes first; KubeletConfig is the first unknown one.
        let kubelet_line = text
            .lines()
            .position(|l| l == "kind: KubeletConfig")
            .unwrap();
        assert!(line < kubelet_line);
        assert_eq!(
            err,
            format!(
                "error decoding document v1alpha1/KubeletConfig/ (line {kubelet_line}): \"KubeletConfig\" \"v1alpha1\": not registered"
            )
        );
    }

    #[test]
    fn garbage_is_rejected() {
        let defaults = default_images(&Version::new(1, 34, 1));
        assert!(parse(b"not: [valid", &defaults).is_err());
        assert!(parse(b"kind: Foo\n", &defaults).is_err());
        assert!(parse(b"- a\n- b\n", &defaults).is_err());
    }
}
