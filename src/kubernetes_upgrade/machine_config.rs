//! Reading and patching the image fields of a Talos machine config (multi-document YAML).
//!
//! The config holds the cluster's secrets (CA keys, tokens), so nothing here ever puts config text in
//! an error: errors name the field or the document, never a value read from the config.
//!
//! Where a component's image lives depends on the node, and on the component: configs created on
//! Talos 1.14 keep it in a dedicated document (`KubeAPIServerConfig`, `KubeControllerManagerConfig`,
//! `KubeSchedulerConfig`, `KubeProxyConfig`, `KubeletConfig`, each with a top-level `image`, see
//! [`ImageField::document_kind`]) and lack the v1alpha1 section; configs upgraded from 1.13 keep the
//! v1alpha1 field ([`ImageField::config_path`]); a config may mix both. So, per component:
//! - reading takes the document where the config has that kind, the v1alpha1 field otherwise, as
//!   Talos's own getters do (machinery v1.14.1 `config/container/container.go`, `K8sAPIServerConfig`,
//!   `K8sKubeletConfig`, …: the document if there is one, else the v1alpha1 bridge);
//! - patching sets the document's `image` where the config has that kind, the v1alpha1 field
//!   otherwise, as `talosctl upgrade-k8s` 1.14 does (machinery v1.14.1
//!   `config/generate/stdpatches/guess.go`, `GuessVersionContractKube*`: `Container.Has(kind)` picks
//!   the current contract, whose `stdpatches.go` patch is the document). It never writes both: Talos
//!   refuses a config with a document and its v1alpha1 equivalent (`V1Alpha1ConflictValidate` in
//!   machinery v1.14.1 `config/types/k8s/*.go`), so a v1alpha1 field is never created next to a
//!   document, and no document is added to a v1alpha1-shaped config.
//!
//! A patch changes only the one document that holds the image. The other documents (`HostnameConfig`,
//! `TimeSyncConfig`, the v1alpha1 document when a `Kube*Config` is patched, …) are kept byte for
//! byte, comments included, whenever the document boundaries can be found line by line (a line that
//! is exactly `---`); only when they cannot is the whole config re-encoded. The patched document
//! itself is re-encoded with serde_yaml, which keeps keys and their order but drops comments and
//! formatting, as talosctl's own re-encoding does.
//!
//! Every config must still have exactly one v1alpha1 document (`version: v1alpha1`), whichever shape
//! its images have: it is what makes the text a node's machine config.

use serde::Deserialize as _;
use serde_yaml::{Mapping, Value};

use talos_upgrade_core::kubernetes::{ConfiguredImages, ImageField};

/// Why a machine config cannot be read or patched. Never carries config content.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("the machine config is not UTF-8 text")]
    NotUtf8,
    /// serde_yaml's message names a position and the kind of problem, not the content.
    #[error("the machine config is not valid YAML: {0}")]
    Yaml(String),
    #[error("the machine config has no v1alpha1 document (version: v1alpha1)")]
    NoV1alpha1,
    #[error("the machine config has more than one v1alpha1 document")]
    DuplicateV1alpha1,
    /// Talos itself refuses such a config (machinery v1.14.1 `config/container/container.go`, `New`:
    /// "duplicate document"), so which one counts cannot be told.
    #[error("the machine config has more than one {kind} document")]
    DuplicateDocument { kind: &'static str },
    /// `path` names the field and, outside the v1alpha1 document, the document kind.
    #[error("{path} in the machine config is not a {expected}")]
    WrongType {
        path: String,
        expected: &'static str,
    },
}

/// The image fields of the config, each from its document where the config has that kind and from
/// the v1alpha1 document otherwise. Control-plane fields are read only when `control_plane` (a
/// worker's config has none, and any there would not be used).
pub fn configured_images(
    config: &[u8],
    control_plane: bool,
) -> Result<ConfiguredImages, ConfigError> {
    let text = std::str::from_utf8(config).map_err(|_| ConfigError::NotUtf8)?;
    let documents = parse_documents(text)?;
    let refs: Vec<&Value> = documents.iter().collect();
    let read = |field: ImageField| {
        let place = place_of(&refs, field)?;
        read_string(refs[place.index], &place)
    };
    let control = |field: ImageField| {
        if control_plane { read(field) } else { Ok(None) }
    };
    Ok(ConfiguredImages {
        api_server: control(ImageField::ApiServer)?,
        controller_manager: control(ImageField::ControllerManager)?,
        scheduler: control(ImageField::Scheduler)?,
        proxy: control(ImageField::Proxy)?,
        kubelet: read(ImageField::Kubelet)?,
    })
}

/// The config with `field` set to `image`: the `image` of the field's document where the config has
/// that kind, else the v1alpha1 field (creating missing intermediate mappings). `Ok(None)` when the
/// field already holds exactly `image`: nothing to apply.
pub fn set_image(
    config: &[u8],
    field: ImageField,
    image: &str,
) -> Result<Option<Vec<u8>>, ConfigError> {
    let text = std::str::from_utf8(config).map_err(|_| ConfigError::NotUtf8)?;

    // Preferred: patch the one segment that holds the image and keep every other segment's text as
    // it is.
    if let Some(segments) = split_segments(text) {
        let parsed: Vec<Option<Value>> = segments
            .iter()
            .map(|segment| parse_single(segment))
            .collect::<Result<_, _>>()?;
        let present: Vec<&Value> = parsed.iter().flatten().collect();
        let place = place_of(&present, field)?;
        // Map the index among non-empty documents back to the segment it came from.
        let segment_index = parsed
            .iter()
            .enumerate()
            .filter(|(_, doc)| doc.is_some())
            .nth(place.index)
            .map(|(i, _)| i)
            .ok_or(ConfigError::NoV1alpha1)?;
        let mut doc = parsed[segment_index]
            .clone()
            .ok_or(ConfigError::NoV1alpha1)?;
        if read_string(&doc, &place)?.as_deref() == Some(image) {
            return Ok(None);
        }
        set_string(&mut doc, &place, image)?;
        let mut out = String::with_capacity(text.len() + image.len());
        for (i, segment) in segments.iter().enumerate() {
            if i > 0 {
                out.push_str("---\n");
            }
            if i == segment_index {
                out.push_str(&encode(&doc)?);
            } else {
                out.push_str(segment);
            }
        }
        return Ok(Some(out.into_bytes()));
    }

    // Fallback for configs whose document markers carry content (`--- !tag`, `--- {…}`): every document
    // is re-encoded; the values stay the same.
    let mut documents = parse_documents(text)?;
    let place = {
        let refs: Vec<&Value> = documents.iter().collect();
        place_of(&refs, field)?
    };
    let doc = &mut documents[place.index];
    if read_string(doc, &place)?.as_deref() == Some(image) {
        return Ok(None);
    }
    set_string(doc, &place, image)?;
    let encoded: Vec<String> = documents.iter().map(encode).collect::<Result<_, _>>()?;
    Ok(Some(encoded.join("---\n").into_bytes()))
}

/// Where one component's image is kept in one config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    /// The index of the document among the config's non-empty documents.
    index: usize,
    /// The kind of that document; `None` for the v1alpha1 document.
    kind: Option<&'static str>,
    /// The field inside that document.
    path: &'static [&'static str],
}

impl Place {
    /// The first `depth` keys of the path, for an error.
    fn describe(&self, depth: usize) -> String {
        let keys = self.path[..depth].join(".");
        match (self.kind, keys.is_empty()) {
            (None, true) => "the v1alpha1 document".to_string(),
            (None, false) => keys,
            (Some(kind), true) => format!("the {kind} document"),
            (Some(kind), false) => format!("{keys} of the {kind} document"),
        }
    }
}

/// The image field's path inside its dedicated document (the `image` yaml tag of `PodImage`,
/// `ProxyImage`, `KubeletImage` in machinery v1.14.1 `config/types/k8s/*.go`).
const DOCUMENT_IMAGE_PATH: &[&str] = &["image"];

/// The document of `field`'s kind if the config has one (the `Container.Has` test of machinery
/// v1.14.1 `config/container/container.go`: any document whose kind matches), else the v1alpha1
/// field. The config must have exactly one v1alpha1 document either way.
fn place_of(documents: &[&Value], field: ImageField) -> Result<Place, ConfigError> {
    let v1alpha1 = v1alpha1_index_of(documents)?;
    let kind = field.document_kind();
    let mut found = documents
        .iter()
        .enumerate()
        .filter(|(_, doc)| doc.get("kind").and_then(Value::as_str) == Some(kind))
        .map(|(i, _)| i);
    match (found.next(), found.next()) {
        (Some(_), Some(_)) => Err(ConfigError::DuplicateDocument { kind }),
        (Some(index), None) => Ok(Place {
            index,
            kind: Some(kind),
            path: DOCUMENT_IMAGE_PATH,
        }),
        (None, _) => Ok(Place {
            index: v1alpha1,
            kind: None,
            path: field.config_path(),
        }),
    }
}

/// Every non-empty document of a multi-document YAML text.
fn parse_documents(text: &str) -> Result<Vec<Value>, ConfigError> {
    let mut documents = Vec::new();
    for document in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(document).map_err(yaml_error)?;
        if !value.is_null() {
            documents.push(value);
        }
    }
    Ok(documents)
}

/// One segment (text between document markers) as a document; `None` when it holds no document
/// (empty, only comments). A segment that is more than one document means the split went wrong.
fn parse_single(segment: &str) -> Result<Option<Value>, ConfigError> {
    let mut documents = parse_documents(segment)?;
    match documents.len() {
        0 => Ok(None),
        1 => Ok(documents.pop()),
        _ => Err(ConfigError::Yaml(
            "a document marker could not be told apart from content".to_string(),
        )),
    }
}

/// The text split at lines that are exactly `---` (the form Talos and talosctl write), each segment
/// keeping its own line endings. `None` when some line starts a document in another way (`--- x`,
/// `...`), which this split does not understand.
fn split_segments(text: &str) -> Option<Vec<&str>> {
    let mut segments = Vec::new();
    let mut start = 0;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let bare = line.trim_end_matches(['\n', '\r']);
        if bare.trim_end() == "---" {
            segments.push(&text[start..offset]);
            start = offset + line.len();
        } else if bare.starts_with("---") || bare.starts_with("...") {
            // A marker with content after it, or a document end marker.
            let rest = &bare[3..];
            if rest.is_empty() || rest.starts_with([' ', '\t']) {
                return None;
            }
        }
        offset += line.len();
    }
    segments.push(&text[start..]);
    Some(segments)
}

fn is_v1alpha1(doc: &Value) -> bool {
    doc.get("version").and_then(Value::as_str) == Some("v1alpha1")
}

fn v1alpha1_index_of(documents: &[&Value]) -> Result<usize, ConfigError> {
    let mut found = documents
        .iter()
        .enumerate()
        .filter(|(_, doc)| is_v1alpha1(doc));
    let (index, _) = found.next().ok_or(ConfigError::NoV1alpha1)?;
    if found.next().is_some() {
        return Err(ConfigError::DuplicateV1alpha1);
    }
    Ok(index)
}

/// The string at the place's path; `None` when the field or one of its parents is absent or null
/// (unset).
fn read_string(doc: &Value, place: &Place) -> Result<Option<String>, ConfigError> {
    let mut current = doc;
    for (depth, key) in place.path.iter().enumerate() {
        match current {
            Value::Null => return Ok(None),
            Value::Mapping(map) => match map.get(*key) {
                Some(value) => current = value,
                None => return Ok(None),
            },
            _ => return Err(wrong_type(place, depth, "mapping")),
        }
    }
    match current {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        _ => Err(wrong_type(place, place.path.len(), "string")),
    }
}

/// Sets the string at the place's path, creating absent (or null) intermediate mappings.
fn set_string(doc: &mut Value, place: &Place, value: &str) -> Result<(), ConfigError> {
    let Some((last, parents)) = place.path.split_last() else {
        return Ok(());
    };
    let mut current = doc;
    for (depth, key) in parents.iter().enumerate() {
        let map = as_mapping(current, place, depth)?;
        let child = map
            .entry(Value::String((*key).to_string()))
            .or_insert(Value::Null);
        current = child;
    }
    let map = as_mapping(current, place, parents.len())?;
    map.insert(
        Value::String((*last).to_string()),
        Value::String(value.to_string()),
    );
    Ok(())
}

/// The mapping at `value` (the first `depth` keys of the place's path), turning a null (an empty
/// `apiServer:`) into an empty mapping.
fn as_mapping<'a>(
    value: &'a mut Value,
    place: &Place,
    depth: usize,
) -> Result<&'a mut Mapping, ConfigError> {
    if value.is_null() {
        *value = Value::Mapping(Mapping::new());
    }
    match value {
        Value::Mapping(map) => Ok(map),
        _ => Err(wrong_type(place, depth, "mapping")),
    }
}

fn wrong_type(place: &Place, depth: usize, expected: &'static str) -> ConfigError {
    ConfigError::WrongType {
        path: place.describe(depth),
        expected,
    }
}

fn encode(doc: &Value) -> Result<String, ConfigError> {
    serde_yaml::to_string(doc).map_err(yaml_error)
}

/// serde_yaml's errors describe the problem and its position; they do not quote the document.
fn yaml_error(error: serde_yaml::Error) -> ConfigError {
    ConfigError::Yaml(error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A control plane whose config was created before Talos 1.14: every image in the v1alpha1
    /// document.
    const CONFIG: &str = "\
version: v1alpha1
debug: false
machine:
    type: controlplane
    token: secret-token.0123456789abcdef
    kubelet:
        image: ghcr.io/siderolabs/kubelet:v1.34.1
        defaultRuntimeSeccompProfileEnabled: true
    install:
        disk: /dev/sda
cluster:
    clusterName: demo
    apiServer:
        image: registry.k8s.io/kube-apiserver:v1.34.1
        certSANs:
            - 10.0.0.1
    controllerManager:
    proxy:
        disabled: false
---
# the hostname, set by the provisioner
apiVersion: v1alpha1
kind: HostnameConfig
hostname:   cp-1      # odd spacing kept
---
apiVersion: v1alpha1
kind: TimeSyncConfig
ntp:
    servers: [time.cloudflare.com]
";

    fn documents(bytes: &[u8]) -> Vec<Value> {
        parse_documents(std::str::from_utf8(bytes).expect("utf-8")).expect("yaml")
    }

    #[test]
    fn images_are_read_from_the_v1alpha1_document() {
        let images = configured_images(CONFIG.as_bytes(), true).expect("read");
        assert_eq!(
            images,
            ConfiguredImages {
                api_server: Some("registry.k8s.io/kube-apiserver:v1.34.1".into()),
                controller_manager: None,
                scheduler: None,
                proxy: None,
                kubelet: Some("ghcr.io/siderolabs/kubelet:v1.34.1".into()),
            }
        );
        let worker = configured_images(CONFIG.as_bytes(), false).expect("read");
        assert_eq!(worker.api_server, None);
        assert_eq!(worker.kubelet, images.kubelet);
    }

    #[test]
    fn one_field_changes_and_the_other_documents_stay_byte_exact() {
        let patched = set_image(
            CONFIG.as_bytes(),
            ImageField::ApiServer,
            "registry.k8s.io/kube-apiserver:v1.35.0",
        )
        .expect("patch")
        .expect("changed");
        let text = String::from_utf8(patched.clone()).expect("utf-8");
        // The other documents, comments and odd spacing included, are untouched.
        let tail = CONFIG.split_once("---\n").expect("marker").1;
        assert!(text.ends_with(tail), "{text}");

        let before = documents(CONFIG.as_bytes());
        let after = documents(&patched);
        assert_eq!(after.len(), 3);
        assert_eq!(after[1..], before[1..]);
        let mut expected = before[0].clone();
        expected["cluster"]["apiServer"]["image"] =
            Value::String("registry.k8s.io/kube-apiserver:v1.35.0".into());
        assert_eq!(after[0], expected);

        // Key order of the v1alpha1 document is kept.
        let keys: Vec<&str> = after[0]
            .as_mapping()
            .expect("mapping")
            .keys()
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(keys, ["version", "debug", "machine", "cluster"]);
        assert_eq!(
            configured_images(&patched, true)
                .expect("read")
                .api_server
                .as_deref(),
            Some("registry.k8s.io/kube-apiserver:v1.35.0")
        );
    }

    #[test]
    fn missing_and_empty_parents_are_created() {
        // `controllerManager:` is null, `scheduler` is absent, `proxy` has other keys.
        for (field, image) in [
            (
                ImageField::ControllerManager,
                "registry.k8s.io/kube-controller-manager:v1.35.0",
            ),
            (
                ImageField::Scheduler,
                "registry.k8s.io/kube-scheduler:v1.35.0",
            ),
            (ImageField::Proxy, "registry.k8s.io/kube-proxy:v1.35.0"),
        ] {
            let patched = set_image(CONFIG.as_bytes(), field, image)
                .expect("patch")
                .expect("changed");
            let images = configured_images(&patched, true).expect("read");
            assert_eq!(images.get(field), Some(image), "{field}");
            let after = documents(&patched);
            assert_eq!(after[0]["cluster"]["proxy"]["disabled"], Value::Bool(false));
        }
        // A worker config without any `cluster.proxy` or `machine.kubelet`.
        let worker = "version: v1alpha1\nmachine:\n  type: worker\ncluster:\n  clusterName: w\n";
        let patched = set_image(
            worker.as_bytes(),
            ImageField::Kubelet,
            "ghcr.io/siderolabs/kubelet:v1.35.0",
        )
        .expect("patch")
        .expect("changed");
        assert_eq!(
            configured_images(&patched, false)
                .expect("read")
                .kubelet
                .as_deref(),
            Some("ghcr.io/siderolabs/kubelet:v1.35.0")
        );
    }

    #[test]
    fn an_image_already_set_is_not_patched() {
        assert_eq!(
            set_image(
                CONFIG.as_bytes(),
                ImageField::Kubelet,
                "ghcr.io/siderolabs/kubelet:v1.34.1"
            ),
            Ok(None)
        );
    }

    #[test]
    fn the_v1alpha1_document_may_come_anywhere() {
        let config = "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: w-1\n---\nversion: v1alpha1\nmachine:\n  type: worker\n";
        let patched = set_image(
            config.as_bytes(),
            ImageField::Kubelet,
            "ghcr.io/siderolabs/kubelet:v1.35.0",
        )
        .expect("patch")
        .expect("changed");
        let text = String::from_utf8(patched).expect("utf-8");
        assert!(
            text.starts_with("apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: w-1\n---\n"),
            "{text}"
        );
        assert!(text.contains("kubelet:v1.35.0"), "{text}");
    }

    #[test]
    fn markers_with_content_fall_back_to_re_encoding_every_document() {
        let config = "--- \nversion: v1alpha1\nmachine:\n  type: worker\n--- {apiVersion: v1alpha1, kind: HostnameConfig, hostname: w-1}\n";
        let patched = set_image(
            config.as_bytes(),
            ImageField::Kubelet,
            "ghcr.io/siderolabs/kubelet:v1.35.0",
        )
        .expect("patch")
        .expect("changed");
        let after = documents(&patched);
        assert_eq!(after.len(), 2);
        assert_eq!(after[1]["hostname"], Value::String("w-1".into()));
        assert_eq!(
            after[0]["machine"]["kubelet"]["image"],
            Value::String("ghcr.io/siderolabs/kubelet:v1.35.0".into())
        );
    }

    #[test]
    fn broken_configs_are_refused_without_their_content() {
        let no_v1alpha1 = "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: w-1\n";
        assert_eq!(
            configured_images(no_v1alpha1.as_bytes(), false),
            Err(ConfigError::NoV1alpha1)
        );
        let twice = "version: v1alpha1\n---\nversion: v1alpha1\n";
        assert_eq!(
            set_image(twice.as_bytes(), ImageField::Kubelet, "k:v1"),
            Err(ConfigError::DuplicateV1alpha1)
        );
        let scalar_parent = "version: v1alpha1\nmachine:\n  kubelet: top-secret-value\n";
        let error = set_image(scalar_parent.as_bytes(), ImageField::Kubelet, "k:v1")
            .expect_err("not a mapping");
        assert_eq!(
            error,
            ConfigError::WrongType {
                path: "machine.kubelet".into(),
                expected: "mapping"
            }
        );
        let not_a_string = "version: v1alpha1\nmachine:\n  kubelet:\n    image: [secret]\n";
        let error = configured_images(not_a_string.as_bytes(), false).expect_err("not a string");
        assert!(!error.to_string().contains("secret"), "{error}");
        let garbage = "version: v1alpha1\nmachine: [token: hunter2\n";
        let error = configured_images(garbage.as_bytes(), false).expect_err("not yaml");
        assert!(!error.to_string().contains("hunter2"), "{error}");
        assert_eq!(
            configured_images(&[0xff, 0xfe], false),
            Err(ConfigError::NotUtf8)
        );
    }

    /// A worker created before Talos 1.14.
    const V1ALPHA1_WORKER: &str = "\
version: v1alpha1
debug: false
persist: true
machine:
    type: worker
    token: secret-token.0123456789abcdef
    kubelet:
        image: ghcr.io/siderolabs/kubelet:v1.36.2-fat
        defaultRuntimeSeccompProfileEnabled: true
    install:
        disk: /dev/sda
        image: ghcr.io/siderolabs/installer:v1.13.5
cluster:
    clusterName: demo
    controlPlane:
        endpoint: https://demo:6443
---
apiVersion: v1alpha1
kind: HostnameConfig
hostname: w-1
";

    /// A control plane as `talosctl gen config` 1.14 writes it (machinery v1.14.1
    /// `config/generate/init.go`, `kubernetes.go`; the stability sample
    /// `config/types/v1alpha1/testdata/stability/v1.14/base-controlplane.yaml`): no `machine.kubelet`,
    /// `machine.install`, `cluster.apiServer`, … in the v1alpha1 document, the images in `Kube*Config`
    /// documents, an `UnattendedInstallConfig` for the install disk, and other documents around them.
    /// Secrets are fakes.
    const M14_CP: &str = "\
version: v1alpha1
debug: false
persist: true
machine:
    type: controlplane
    token: secret-token.0123456789abcdef
    ca:
        crt: c2VjcmV0LWNhLWNydA==
        key: c2VjcmV0LWNhLWtleQ==
    certSANs: []
    features:
        diskQuotaSupport: true
cluster:
    token: secret-cluster-token.0123456789
    etcd:
        ca:
            crt: c2VjcmV0LWV0Y2QtY3J0
            key: c2VjcmV0LWV0Y2Qta2V5
---
apiVersion: v1alpha1
kind: UnattendedInstallConfig
installer:
    image: factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.14.1
provisioning:
    diskSelector:
        match: disk.dev_path == \"/dev/sda\"
    wipe: false
---
# NTP servers, set by the provisioner
apiVersion: v1alpha1
kind: TimeSyncConfig
ntp:
    servers:   [time.cloudflare.com]   # odd spacing kept
---
apiVersion: v1alpha1
kind: HostnameConfig
auto: stable
---
apiVersion: v1alpha1
kind: KubeClusterConfig
clusterName: demo
endpoint: https://demo:6443
---
apiVersion: v1alpha1
kind: KubeNodeConfig
nodeIP: {}
labels:
    node-role.kubernetes.io/control-plane: \"\"
taints:
    node-role.kubernetes.io/control-plane: NoSchedule
---
apiVersion: v1alpha1
kind: KubeletConfig
image: ghcr.io/siderolabs/kubelet:v1.36.2
config: {}
defaultRuntimeSeccompProfileEnabled: true
---
apiVersion: v1alpha1
kind: KubeNetworkConfig
dnsDomain: cluster.local
podSubnets:
    - 10.244.0.0/16
serviceSubnets:
    - 10.96.0.0/12
---
apiVersion: v1alpha1
kind: KubeServiceAccountConfig
issuer:
    privateKey: |
        -----BEGIN EC PRIVATE KEY-----
        c2VjcmV0LXNlcnZpY2UtYWNjb3VudC1rZXk=
        -----END EC PRIVATE KEY-----
    issuerURL: https://demo:6443
---
apiVersion: v1alpha1
kind: KubeAPIServerConfig
image: registry.k8s.io/kube-apiserver:v1.36.2
---
apiVersion: v1alpha1
kind: KubeControllerManagerConfig
image: registry.k8s.io/kube-controller-manager:v1.36.2
---
apiVersion: v1alpha1
kind: KubeSchedulerConfig
image: registry.k8s.io/kube-scheduler:v1.36.2
config: {}
---
apiVersion: v1alpha1
kind: KubeProxyConfig
image: registry.k8s.io/kube-proxy:v1.36.2
config: {}
---
apiVersion: v1alpha1
kind: KubeCoreDNSConfig
enabled: true
";

    /// A worker as `talosctl gen config` 1.14 writes it (the stability sample `base-worker.yaml`):
    /// only `KubeletConfig` among the image documents (the control-plane ones are refused on workers).
    const M14_WORKER: &str = "\
version: v1alpha1
debug: false
persist: true
machine:
    type: worker
    token: secret-token.0123456789abcdef
    ca:
        crt: c2VjcmV0LWNhLWNydA==
        key: \"\"
    certSANs: []
    features:
        diskQuotaSupport: true
cluster:
    token: secret-cluster-token.0123456789
---
apiVersion: v1alpha1
kind: UnattendedInstallConfig
installer:
    image: factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba:v1.14.1
provisioning:
    diskSelector:
        match: disk.dev_path == \"/dev/sda\"
    wipe: false
---
apiVersion: v1alpha1
kind: TimeSyncConfig
ntp:
    servers:
        - time.cloudflare.com
---
apiVersion: v1alpha1
kind: KubeClusterConfig
clusterName: demo
endpoint: https://demo:6443
---
apiVersion: v1alpha1
kind: KubeNodeConfig
nodeIP: {}
---
apiVersion: v1alpha1
kind: KubeletConfig
image: ghcr.io/siderolabs/kubelet:v1.36.2-slim
config: {}
defaultRuntimeSeccompProfileEnabled: true
";

    /// A control plane upgraded from 1.13 whose kubelet and scheduler were moved to their documents
    /// by hand (the v1alpha1 sections removed in the same change, as Talos requires); a
    /// `KubeProxyConfig` disables kube-proxy and, as it may then, leaves `image` out.
    const MIXED_CP: &str = "\
version: v1alpha1
machine:
    type: controlplane
    token: secret-token.0123456789abcdef
    install:
        disk: /dev/sda
        image: ghcr.io/siderolabs/installer:v1.13.5
cluster:
    clusterName: demo
    apiServer:
        image: registry.local:5000/kube-apiserver:v1.36.2
        certSANs:
            - 10.0.0.1
    controllerManager:
        image: registry.local:5000/kube-controller-manager:v1.36.2
---
apiVersion: v1alpha1
kind: KubeletConfig
image: registry.local:5000/kubelet:v1.36.2
config: {}
---
apiVersion: v1alpha1
kind: KubeSchedulerConfig
image: registry.local:5000/kube-scheduler:v1.36.2
---
apiVersion: v1alpha1
kind: KubeProxyConfig
enabled: false
---
apiVersion: v1alpha1
kind: HostnameConfig
hostname: cp-1
";

    const FIELDS: [ImageField; 5] = [
        ImageField::ApiServer,
        ImageField::ControllerManager,
        ImageField::Scheduler,
        ImageField::Proxy,
        ImageField::Kubelet,
    ];

    /// The text of each document, split at the `---` lines the fixtures use.
    fn segments(text: &str) -> Vec<&str> {
        text.split("\n---\n").collect()
    }

    fn is_kind(doc: &Value, kind: &str) -> bool {
        doc.get("kind").and_then(Value::as_str) == Some(kind)
    }

    #[test]
    fn images_come_from_the_document_where_the_config_has_one() {
        let some = |image: &str| Some(image.to_string());
        // (case, config, control plane, expected images)
        let cases = [
            (
                "v1alpha1 control plane",
                CONFIG,
                true,
                ConfiguredImages {
                    api_server: some("registry.k8s.io/kube-apiserver:v1.34.1"),
                    controller_manager: None,
                    scheduler: None,
                    proxy: None,
                    kubelet: some("ghcr.io/siderolabs/kubelet:v1.34.1"),
                },
            ),
            (
                "v1alpha1 worker",
                V1ALPHA1_WORKER,
                false,
                ConfiguredImages {
                    kubelet: some("ghcr.io/siderolabs/kubelet:v1.36.2-fat"),
                    ..ConfiguredImages::default()
                },
            ),
            (
                "1.14 control plane",
                M14_CP,
                true,
                ConfiguredImages {
                    api_server: some("registry.k8s.io/kube-apiserver:v1.36.2"),
                    controller_manager: some("registry.k8s.io/kube-controller-manager:v1.36.2"),
                    scheduler: some("registry.k8s.io/kube-scheduler:v1.36.2"),
                    proxy: some("registry.k8s.io/kube-proxy:v1.36.2"),
                    kubelet: some("ghcr.io/siderolabs/kubelet:v1.36.2"),
                },
            ),
            (
                "1.14 worker",
                M14_WORKER,
                false,
                ConfiguredImages {
                    kubelet: some("ghcr.io/siderolabs/kubelet:v1.36.2-slim"),
                    ..ConfiguredImages::default()
                },
            ),
            (
                "mixed control plane",
                MIXED_CP,
                true,
                ConfiguredImages {
                    api_server: some("registry.local:5000/kube-apiserver:v1.36.2"),
                    controller_manager: some("registry.local:5000/kube-controller-manager:v1.36.2"),
                    scheduler: some("registry.local:5000/kube-scheduler:v1.36.2"),
                    // The document is there without an image: unset, never the v1alpha1 section.
                    proxy: None,
                    kubelet: some("registry.local:5000/kubelet:v1.36.2"),
                },
            ),
            (
                // A control plane's config read as a worker's: only the kubelet counts.
                "1.14 control plane read as a worker",
                M14_CP,
                false,
                ConfiguredImages {
                    kubelet: some("ghcr.io/siderolabs/kubelet:v1.36.2"),
                    ..ConfiguredImages::default()
                },
            ),
        ];
        for (case, config, control_plane, expected) in cases {
            assert_eq!(
                configured_images(config.as_bytes(), control_plane),
                Ok(expected),
                "{case}"
            );
        }
    }

    #[test]
    fn each_image_is_patched_where_the_node_keeps_it_and_nowhere_else() {
        use ImageField::*;
        // (case, config, control plane, field, the document kind patched; `None`: the v1alpha1 one)
        let cases = [
            ("v1alpha1 control plane", CONFIG, true, ApiServer, None),
            (
                "v1alpha1 control plane",
                CONFIG,
                true,
                ControllerManager,
                None,
            ),
            ("v1alpha1 control plane", CONFIG, true, Scheduler, None),
            ("v1alpha1 control plane", CONFIG, true, Proxy, None),
            ("v1alpha1 control plane", CONFIG, true, Kubelet, None),
            ("v1alpha1 worker", V1ALPHA1_WORKER, false, Kubelet, None),
            (
                "1.14 control plane",
                M14_CP,
                true,
                ApiServer,
                Some("KubeAPIServerConfig"),
            ),
            (
                "1.14 control plane",
                M14_CP,
                true,
                ControllerManager,
                Some("KubeControllerManagerConfig"),
            ),
            (
                "1.14 control plane",
                M14_CP,
                true,
                Scheduler,
                Some("KubeSchedulerConfig"),
            ),
            (
                "1.14 control plane",
                M14_CP,
                true,
                Proxy,
                Some("KubeProxyConfig"),
            ),
            (
                "1.14 control plane",
                M14_CP,
                true,
                Kubelet,
                Some("KubeletConfig"),
            ),
            (
                "1.14 worker",
                M14_WORKER,
                false,
                Kubelet,
                Some("KubeletConfig"),
            ),
            ("mixed control plane", MIXED_CP, true, ApiServer, None),
            (
                "mixed control plane",
                MIXED_CP,
                true,
                ControllerManager,
                None,
            ),
            // No `cluster.scheduler` in the v1alpha1 document: it is not created.
            (
                "mixed control plane",
                MIXED_CP,
                true,
                Scheduler,
                Some("KubeSchedulerConfig"),
            ),
            // The document has no `image` yet: it gets one there.
            (
                "mixed control plane",
                MIXED_CP,
                true,
                Proxy,
                Some("KubeProxyConfig"),
            ),
            (
                "mixed control plane",
                MIXED_CP,
                true,
                Kubelet,
                Some("KubeletConfig"),
            ),
        ];
        for (case, config, control_plane, field, kind) in cases {
            let case = format!("{case}, {field}");
            let image = format!("{}:v1.37.0", field.default_repository());
            let patched = set_image(config.as_bytes(), field, &image)
                .unwrap_or_else(|e| panic!("{case}: {e}"))
                .unwrap_or_else(|| panic!("{case}: nothing to apply"));
            let text = String::from_utf8(patched.clone()).expect("utf-8");

            // Exactly one document changed, the expected one; every other keeps its text.
            let (before, after) = (segments(config), segments(&text));
            assert_eq!(before.len(), after.len(), "{case}: {text}");
            let changed: Vec<usize> = (0..before.len())
                .filter(|&i| before[i] != after[i])
                .collect();
            assert_eq!(changed.len(), 1, "{case}: {text}");
            let (old, new) = (documents(config.as_bytes()), documents(&patched));
            let index = changed[0];
            match kind {
                Some(kind) => assert!(is_kind(&old[index], kind), "{case}"),
                None => assert!(is_v1alpha1(&old[index]), "{case}"),
            }

            // The changed document is the old one with the one field set (serde_yaml's index
            // inserts missing keys and turns a null into a mapping).
            let path = if kind.is_some() {
                &["image"][..]
            } else {
                field.config_path()
            };
            let mut expected = old[index].clone();
            let mut slot = &mut expected;
            for key in path {
                slot = &mut slot[*key];
            }
            *slot = Value::String(image.clone());
            assert_eq!(new[index], expected, "{case}");

            // The shapes are not mixed: no document is added, no v1alpha1 section next to one.
            let count = |docs: &[Value]| {
                docs.iter()
                    .filter(|d| is_kind(d, field.document_kind()))
                    .count()
            };
            assert_eq!(count(&new), count(&old), "{case}");

            // Read back as Talos reads it, and a second patch has nothing to do.
            let images = configured_images(&patched, control_plane).expect("read");
            assert_eq!(images.get(field), Some(image.as_str()), "{case}");
            assert_eq!(set_image(&patched, field, &image), Ok(None), "{case}");
        }
    }

    #[test]
    fn an_image_already_configured_is_not_patched_in_either_shape() {
        for (case, config, control_plane) in [
            ("v1alpha1 control plane", CONFIG, true),
            ("v1alpha1 worker", V1ALPHA1_WORKER, false),
            ("1.14 control plane", M14_CP, true),
            ("1.14 worker", M14_WORKER, false),
            ("mixed control plane", MIXED_CP, true),
        ] {
            let images = configured_images(config.as_bytes(), control_plane).expect("read");
            for field in FIELDS {
                if let Some(image) = images.get(field) {
                    assert_eq!(
                        set_image(config.as_bytes(), field, image),
                        Ok(None),
                        "{case}, {field}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_1_14_patch_keeps_the_v1alpha1_document_and_the_others_byte_exact() {
        let patched = set_image(
            M14_CP.as_bytes(),
            ImageField::Kubelet,
            "ghcr.io/siderolabs/kubelet:v1.37.0",
        )
        .expect("patch")
        .expect("changed");
        let text = String::from_utf8(patched).expect("utf-8");
        // Everything before the KubeletConfig document, comments, odd spacing and the
        // UnattendedInstallConfig's own `image` included, is the original text.
        let kubelet = "apiVersion: v1alpha1\nkind: KubeletConfig\n";
        let start = M14_CP.find(kubelet).expect("kubelet document");
        assert_eq!(text[..start], M14_CP[..start]);
        // So is everything after it.
        let rest = &M14_CP[start..];
        let tail = &rest[rest.find("\n---\n").expect("next document")..];
        assert!(text.ends_with(tail), "{text}");
        // The KubeletConfig keeps its other keys, in order.
        assert!(
            text.contains(
                "kind: KubeletConfig\nimage: ghcr.io/siderolabs/kubelet:v1.37.0\nconfig: {}\n\
                 defaultRuntimeSeccompProfileEnabled: true\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn documents_are_found_when_markers_carry_content_too() {
        let config = "--- \nversion: v1alpha1\nmachine:\n  type: worker\n--- {apiVersion: v1alpha1, kind: KubeletConfig, image: 'ghcr.io/siderolabs/kubelet:v1.36.2'}\n";
        let patched = set_image(
            config.as_bytes(),
            ImageField::Kubelet,
            "ghcr.io/siderolabs/kubelet:v1.37.0",
        )
        .expect("patch")
        .expect("changed");
        let after = documents(&patched);
        assert_eq!(after.len(), 2);
        assert_eq!(after[0], documents(config.as_bytes())[0]);
        assert_eq!(
            after[1]["image"],
            Value::String("ghcr.io/siderolabs/kubelet:v1.37.0".into())
        );
    }

    #[test]
    fn broken_documents_are_refused_naming_the_kind_without_their_content() {
        let v1alpha1 = "version: v1alpha1\nmachine:\n  type: controlplane\n  token: secret-token\n";
        let twice = format!(
            "{v1alpha1}---\napiVersion: v1alpha1\nkind: KubeletConfig\nimage: k:v1\n\
             ---\napiVersion: v1alpha1\nkind: KubeletConfig\nimage: secret-kubelet:v1\n"
        );
        let listed = format!(
            "{v1alpha1}---\napiVersion: v1alpha1\nkind: KubeAPIServerConfig\nimage: [secret-image]\n"
        );
        let mapped = format!(
            "{v1alpha1}---\napiVersion: v1alpha1\nkind: KubeProxyConfig\nimage:\n  secret: value\n"
        );
        let wrong_type = |path: &str| ConfigError::WrongType {
            path: path.to_string(),
            expected: "string",
        };
        // (case, config, field, expected error)
        let cases = [
            (
                "a kind twice",
                twice.as_str(),
                ImageField::Kubelet,
                ConfigError::DuplicateDocument {
                    kind: "KubeletConfig",
                },
            ),
            (
                "a list for an image",
                listed.as_str(),
                ImageField::ApiServer,
                wrong_type("image of the KubeAPIServerConfig document"),
            ),
            (
                "a mapping for an image",
                mapped.as_str(),
                ImageField::Proxy,
                wrong_type("image of the KubeProxyConfig document"),
            ),
        ];
        for (case, config, field, expected) in cases {
            let read = configured_images(config.as_bytes(), true).expect_err(case);
            let patch = set_image(config.as_bytes(), field, "k:v2").expect_err(case);
            assert_eq!((&read, &patch), (&expected, &expected), "{case}");
            let message = expected.to_string();
            assert!(message.contains(field.document_kind()), "{case}: {message}");
            assert!(!message.contains("secret"), "{case}: {message}");
        }
        assert_eq!(
            ConfigError::DuplicateDocument {
                kind: "KubeletConfig"
            }
            .to_string(),
            "the machine config has more than one KubeletConfig document"
        );
        assert_eq!(
            wrong_type("image of the KubeAPIServerConfig document").to_string(),
            "image of the KubeAPIServerConfig document in the machine config is not a string"
        );
        // A 1.14-shaped config still needs its v1alpha1 document.
        let no_v1alpha1 = "apiVersion: v1alpha1\nkind: KubeletConfig\nimage: k:v1\n";
        assert_eq!(
            set_image(no_v1alpha1.as_bytes(), ImageField::Kubelet, "k:v2"),
            Err(ConfigError::NoV1alpha1)
        );
    }
}
