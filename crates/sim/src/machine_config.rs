//! Machine configs: the multi-document YAML a simulated node boots with, and how the node reads and
//! validates one pushed by `ApplyConfiguration` (only the fields upgrades touch are interpreted; the
//! rest is stored byte-exact, as Talos does).

use semver::Version;
use serde::Deserialize;
use serde_yaml::Value;

use super::compat;
use super::config::Role;
use super::image_ref::ImageRef;

/// The images a machine config selects (defaults filled in for absent fields, as Talos does).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ComponentImages {
    pub kubelet: String,
    pub apiserver: String,
    pub controller_manager: String,
    pub scheduler: String,
    pub proxy: String,
}

/// What the node takes from a parsed machine config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParsedConfig {
    pub machine_type: Role,
    pub install_image: Option<String>,
    pub images: ComponentImages,
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

/// A plausible `talosctl gen config` result: the v1alpha1 document plus one extra document, so clients
/// must cope with multi-document configs. Worker configs carry no control-plane component images, as
/// generated worker configs don't.
pub(crate) fn generate(inputs: &ConfigInputs<'_>) -> String {
    let mut images = default_images(inputs.kubernetes_version);
    if let Some(registry) = inputs.image_registry {
        let mirrored = |image: &mut String| {
            if let Some((_, name)) = image.rsplit_once('/') {
                *image = format!("{registry}/{name}");
            }
        };
        for image in [
            &mut images.kubelet,
            &mut images.apiserver,
            &mut images.controller_manager,
            &mut images.scheduler,
            &mut images.proxy,
        ] {
            mirrored(image);
        }
    }
    let mut out = String::new();
    out.push_str("version: v1alpha1\ndebug: false\npersist: true\nmachine:\n");
    out.push_str(&format!("    type: {}\n", inputs.role.as_str()));
    out.push_str("    token: simtok.0123456789abcdef\n    certSANs: []\n");
    out.push_str(&format!(
        "    kubelet:\n        image: {}\n        defaultRuntimeSeccompProfileEnabled: true\n",
        images.kubelet
    ));
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
    if inputs.role.is_control_plane() {
        out.push_str(&format!(
            "    apiServer:\n        image: {}\n",
            images.apiserver
        ));
        out.push_str(&format!(
            "    controllerManager:\n        image: {}\n",
            images.controller_manager
        ));
        out.push_str(&format!(
            "    scheduler:\n        image: {}\n",
            images.scheduler
        ));
        out.push_str(&format!("    proxy:\n        image: {}\n", images.proxy));
        out.push_str("    etcd:\n        advertisedSubnets: []\n");
    }
    out.push_str("---\napiVersion: v1alpha1\nkind: TimeSyncConfig\nntp:\n    servers:\n        - time.cloudflare.com\n");
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

fn lookup_str(doc: &Value, path: &[&str]) -> Result<Option<String>, String> {
    match lookup(doc, path) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("{} must be a string", path.join("."))),
    }
}

/// Parse a full machine config (all documents) and extract what the simulator acts on.
/// `defaults` supplies images for absent fields.
pub(crate) fn parse(data: &[u8], defaults: &ComponentImages) -> Result<ParsedConfig, String> {
    let text = std::str::from_utf8(data).map_err(|_| "config is not valid UTF-8".to_string())?;
    let mut v1alpha1 = None;
    let mut unattended_image = None;
    for document in serde_yaml::Deserializer::from_str(text) {
        let value =
            Value::deserialize(document).map_err(|e| format!("failed to parse config: {e}"))?;
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
        } else if value.get("kind").and_then(Value::as_str) == Some("UnattendedInstallConfig") {
            unattended_image = lookup_str(&value, &["installer", "image"])?;
        } else if value.get("kind").and_then(Value::as_str).is_none() {
            return Err(
                "failed to parse config: document has neither version: v1alpha1 nor kind".into(),
            );
        }
    }
    let doc = v1alpha1.ok_or("failed to parse config: no v1alpha1 document (version: v1alpha1)")?;
    let machine_type = match lookup_str(&doc, &["machine", "type"])?.as_deref() {
        Some("controlplane") | Some("init") => Role::ControlPlane,
        Some("worker") => Role::Worker,
        Some(other) => return Err(format!("unknown machine type {other:?}")),
        None => return Err("machine.type is required".into()),
    };
    let pick = |path: &[&str], default: &str| -> Result<String, String> {
        Ok(lookup_str(&doc, path)?.unwrap_or_else(|| default.to_string()))
    };
    Ok(ParsedConfig {
        machine_type,
        // Talos 1.14 reads the install image from `UnattendedInstallConfig` where a config has one.
        install_image: match unattended_image {
            Some(image) => Some(image),
            None => lookup_str(&doc, &["machine", "install", "image"])?,
        },
        images: ComponentImages {
            kubelet: pick(&["machine", "kubelet", "image"], &defaults.kubelet)?,
            apiserver: pick(&["cluster", "apiServer", "image"], &defaults.apiserver)?,
            controller_manager: pick(
                &["cluster", "controllerManager", "image"],
                &defaults.controller_manager,
            )?,
            scheduler: pick(&["cluster", "scheduler", "image"], &defaults.scheduler)?,
            proxy: pick(&["cluster", "proxy", "image"], &defaults.proxy)?,
        },
    })
}

/// The node-side validation of an applied config: machine type unchanged, component images tagged,
/// and (Talos ≥ 1.11) their Kubernetes versions inside the node's support range — kubelet on every
/// node, control-plane images on control planes (talos-api.md §1.3 ApplyConfiguration, §5).
pub(crate) fn validate(config: &ParsedConfig, role: Role, talos: &Version) -> Result<(), String> {
    if config.machine_type != role {
        return Err(format!(
            "machine type can't be changed from {role} to {}",
            config.machine_type
        ));
    }
    let mut checked = vec![("machine.kubelet.image", &config.images.kubelet)];
    if role.is_control_plane() {
        checked.push(("cluster.apiServer.image", &config.images.apiserver));
        checked.push((
            "cluster.controllerManager.image",
            &config.images.controller_manager,
        ));
        checked.push(("cluster.scheduler.image", &config.images.scheduler));
    }
    for (field, image) in checked {
        let parsed = ImageRef::parse_tagged(image).map_err(|e| format!("{field}: {e}"))?;
        if compat::enforces_kubernetes_matrix(talos) {
            let version = parsed.version().ok_or_else(|| {
                format!("{field}: image tag of {image:?} is not a Kubernetes version")
            })?;
            compat::check_kubernetes(talos, &version).map_err(|e| format!("{field}: {e}"))?;
        }
    }
    if let Some(install) = &config.install_image {
        ImageRef::parse(install).map_err(|e| format!("machine.install.image: {e}"))?;
    }
    Ok(())
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
        })
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
    fn garbage_is_rejected() {
        let defaults = default_images(&Version::new(1, 34, 1));
        assert!(parse(b"not: [valid", &defaults).is_err());
        assert!(parse(b"kind: Foo\n", &defaults).is_err());
        assert!(parse(b"- a\n- b\n", &defaults).is_err());
    }
}
