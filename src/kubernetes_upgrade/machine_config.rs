//! Reading and patching the image fields of a Talos machine config (multi-document YAML).
//!
//! The config holds the cluster's secrets (CA keys, tokens), so nothing here ever puts config text in
//! an error: errors name the field or the document, never a value read from the config.
//!
//! A patch changes only the `v1alpha1` document (the one with `version: v1alpha1`). The other documents
//! (`HostnameConfig`, `TimeSyncConfig`, …) are kept byte for byte, comments included, whenever the
//! document boundaries can be found line by line (a line that is exactly `---`); only when they cannot
//! is the whole config re-encoded. The `v1alpha1` document itself is re-encoded with serde_yaml, which
//! keeps keys and their order but drops comments and formatting, as talosctl's own re-encoding does.

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
    #[error("{path} in the machine config is not a {expected}")]
    WrongType {
        path: String,
        expected: &'static str,
    },
}

/// The image fields of the `v1alpha1` document. Control-plane fields are read only when
/// `control_plane` (a worker's config has none, and any there would not be used).
pub fn configured_images(
    config: &[u8],
    control_plane: bool,
) -> Result<ConfiguredImages, ConfigError> {
    let text = std::str::from_utf8(config).map_err(|_| ConfigError::NotUtf8)?;
    let documents = parse_documents(text)?;
    let doc = v1alpha1_index(&documents).map(|i| &documents[i])?;
    let read = |field: ImageField| read_string(doc, field.config_path());
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

/// The config with `field` set to `image` in the `v1alpha1` document, creating missing intermediate
/// mappings. `Ok(None)` when the field already holds exactly `image`: nothing to apply.
pub fn set_image(
    config: &[u8],
    field: ImageField,
    image: &str,
) -> Result<Option<Vec<u8>>, ConfigError> {
    let text = std::str::from_utf8(config).map_err(|_| ConfigError::NotUtf8)?;
    let path = field.config_path();

    // Preferred: patch the v1alpha1 segment only and keep every other segment's text as it is.
    if let Some(segments) = split_segments(text) {
        let parsed: Vec<Option<Value>> = segments
            .iter()
            .map(|segment| parse_single(segment))
            .collect::<Result<_, _>>()?;
        let present: Vec<&Value> = parsed.iter().flatten().collect();
        let index = v1alpha1_index_of(&present)?;
        // Map the index among non-empty documents back to the segment it came from.
        let segment_index = parsed
            .iter()
            .enumerate()
            .filter(|(_, doc)| doc.is_some())
            .nth(index)
            .map(|(i, _)| i)
            .ok_or(ConfigError::NoV1alpha1)?;
        let mut doc = parsed[segment_index]
            .clone()
            .ok_or(ConfigError::NoV1alpha1)?;
        if read_string(&doc, path)?.as_deref() == Some(image) {
            return Ok(None);
        }
        set_string(&mut doc, path, image)?;
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
    let index = v1alpha1_index(&documents)?;
    if read_string(&documents[index], path)?.as_deref() == Some(image) {
        return Ok(None);
    }
    set_string(&mut documents[index], path, image)?;
    let encoded: Vec<String> = documents.iter().map(encode).collect::<Result<_, _>>()?;
    Ok(Some(encoded.join("---\n").into_bytes()))
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

fn v1alpha1_index(documents: &[Value]) -> Result<usize, ConfigError> {
    let refs: Vec<&Value> = documents.iter().collect();
    v1alpha1_index_of(&refs)
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

/// The string at `path`; `None` when the field or one of its parents is absent or null (unset).
fn read_string(doc: &Value, path: &[&str]) -> Result<Option<String>, ConfigError> {
    let mut current = doc;
    for (depth, key) in path.iter().enumerate() {
        match current {
            Value::Null => return Ok(None),
            Value::Mapping(map) => match map.get(*key) {
                Some(value) => current = value,
                None => return Ok(None),
            },
            _ => return Err(wrong_type(&path[..depth], "mapping")),
        }
    }
    match current {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        _ => Err(wrong_type(path, "string")),
    }
}

/// Sets the string at `path`, creating absent (or null) intermediate mappings.
fn set_string(doc: &mut Value, path: &[&str], value: &str) -> Result<(), ConfigError> {
    let Some((last, parents)) = path.split_last() else {
        return Ok(());
    };
    let mut current = doc;
    for (depth, key) in parents.iter().enumerate() {
        let map = as_mapping(current, &path[..depth])?;
        let child = map
            .entry(Value::String((*key).to_string()))
            .or_insert(Value::Null);
        current = child;
    }
    let map = as_mapping(current, parents)?;
    map.insert(
        Value::String((*last).to_string()),
        Value::String(value.to_string()),
    );
    Ok(())
}

/// The mapping at `value`, turning a null (an empty `apiServer:`) into an empty mapping.
fn as_mapping<'a>(value: &'a mut Value, path: &[&str]) -> Result<&'a mut Mapping, ConfigError> {
    if value.is_null() {
        *value = Value::Mapping(Mapping::new());
    }
    match value {
        Value::Mapping(map) => Ok(map),
        _ => Err(wrong_type(path, "mapping")),
    }
}

fn wrong_type(path: &[&str], expected: &'static str) -> ConfigError {
    let path = if path.is_empty() {
        "the v1alpha1 document".to_string()
    } else {
        path.join(".")
    };
    ConfigError::WrongType { path, expected }
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
}
