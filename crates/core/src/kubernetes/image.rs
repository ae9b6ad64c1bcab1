//! Which image a node should run for a target: its current image with only the tag changed.

use crate::versions::KubernetesVersion;

/// An image field of a node's machine config that the Kubernetes upgrade changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ImageField {
    ApiServer,
    ControllerManager,
    Scheduler,
    Proxy,
    Kubelet,
}

impl ImageField {
    /// The path of the field in the v1alpha1 machine config document (configs created before Talos
    /// 1.14; see [`document_kind`](Self::document_kind) for the others).
    pub fn config_path(self) -> &'static [&'static str] {
        match self {
            ImageField::ApiServer => &["cluster", "apiServer", "image"],
            ImageField::ControllerManager => &["cluster", "controllerManager", "image"],
            ImageField::Scheduler => &["cluster", "scheduler", "image"],
            ImageField::Proxy => &["cluster", "proxy", "image"],
            ImageField::Kubelet => &["machine", "kubelet", "image"],
        }
    }

    /// The `kind` of the Talos 1.14 machine-config document (`apiVersion: v1alpha1`) that holds the
    /// image in its top-level `image` field and replaces [`config_path`](Self::config_path). Talos
    /// reads the document where the config has one and the v1alpha1 field otherwise, and refuses a
    /// config that has both (machinery v1.14.1 `config/types/k8s`: the `KubeAPIServerConfig`,
    /// `KubeControllerManagerConfig`, `KubeSchedulerConfig`, `KubeProxyConfig` and `KubeletConfig`
    /// constants in `apiserver.go`, `controller_manager.go`, `scheduler.go`, `proxy.go`, `kubelet.go`,
    /// and their `V1Alpha1ConflictValidate`).
    pub fn document_kind(self) -> &'static str {
        match self {
            ImageField::ApiServer => "KubeAPIServerConfig",
            ImageField::ControllerManager => "KubeControllerManagerConfig",
            ImageField::Scheduler => "KubeSchedulerConfig",
            ImageField::Proxy => "KubeProxyConfig",
            ImageField::Kubelet => "KubeletConfig",
        }
    }

    /// The repository Talos uses when the config leaves the field unset (the `talosctl upgrade-k8s`
    /// defaults).
    pub fn default_repository(self) -> &'static str {
        match self {
            ImageField::ApiServer => "registry.k8s.io/kube-apiserver",
            ImageField::ControllerManager => "registry.k8s.io/kube-controller-manager",
            ImageField::Scheduler => "registry.k8s.io/kube-scheduler",
            ImageField::Proxy => "registry.k8s.io/kube-proxy",
            ImageField::Kubelet => "ghcr.io/siderolabs/kubelet",
        }
    }

    /// Whether the image is pulled into containerd's `system` namespace (the kubelet, which Talos runs
    /// itself) rather than the `k8s.io` (CRI) namespace the static pods use.
    pub fn pulls_into_system_namespace(self) -> bool {
        match self {
            ImageField::Kubelet => true,
            ImageField::ApiServer
            | ImageField::ControllerManager
            | ImageField::Scheduler
            | ImageField::Proxy => false,
        }
    }

    /// The component the image runs, as messages name it.
    pub fn as_str(self) -> &'static str {
        match self {
            ImageField::ApiServer => "kube-apiserver",
            ImageField::ControllerManager => "kube-controller-manager",
            ImageField::Scheduler => "kube-scheduler",
            ImageField::Proxy => "kube-proxy",
            ImageField::Kubelet => "kubelet",
        }
    }
}

impl std::fmt::Display for ImageField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the image for the target cannot be derived from the node's current one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the {field} image {image:?} is not a valid image reference ({problem}), so the new image cannot be derived from it: correct {path} (or the image of the {kind} document, where the node's config has one)",
    path = field.config_path().join("."),
    kind = field.document_kind()
)]
pub struct ImageError {
    pub field: ImageField,
    pub image: String,
    pub problem: &'static str,
}

/// The image `field` should have on a node for `target`: the node's current image (`current`; `None` or
/// empty when the config leaves the field unset, which means the Talos default) with only the tag
/// changed to `v<target>`. Registry (port included), repository and mirror stay; a digest is dropped
/// (it pins the old release); for the kubelet a flavour suffix after the version (`v1.34.1-fat`) is
/// kept, as `talosctl upgrade-k8s` keeps it.
pub fn desired_image(
    field: ImageField,
    current: Option<&str>,
    target: &KubernetesVersion,
) -> Result<String, ImageError> {
    let current = current.map(str::trim).filter(|c| !c.is_empty());
    let Some(image) = current else {
        return Ok(format!("{}:{}", field.default_repository(), target.tag()));
    };
    let invalid = |problem| ImageError {
        field,
        image: image.to_string(),
        problem,
    };
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid("it contains whitespace"));
    }
    let name = match image.split_once('@') {
        Some((name, digest)) if !digest.is_empty() && !digest.contains('@') => name,
        Some(_) => return Err(invalid("its digest is malformed")),
        None => image,
    };
    // A ':' after the last '/' starts the tag; one before it belongs to a registry port.
    let last_component = name.rfind('/').map_or(0, |i| i + 1);
    let (repository, tag) = match name[last_component..].rfind(':') {
        Some(i) => {
            let split = last_component + i;
            let tag = &name[split + 1..];
            if !valid_tag(tag) {
                return Err(invalid("its tag is malformed"));
            }
            (&name[..split], Some(tag))
        }
        None => (name, None),
    };
    if repository.is_empty()
        || repository.starts_with('/')
        || repository.ends_with('/')
        || repository.contains("//")
    {
        return Err(invalid("its repository is malformed"));
    }
    let suffix = match (field, tag) {
        (ImageField::Kubelet, Some(tag)) => flavour_suffix(tag),
        _ => "",
    };
    Ok(format!("{repository}:{}{suffix}", target.tag()))
}

/// The `-fat` of `v1.34.1-fat`: what follows the version in a kubelet tag, unless it is a pre-release
/// (`-rc.0`), which belongs to the old version and must not be carried over.
fn flavour_suffix(tag: &str) -> &str {
    let Some(version) = tag.strip_prefix('v') else {
        return "";
    };
    let Ok(parsed) = semver::Version::parse(version) else {
        return "";
    };
    let pre = parsed.pre.as_str();
    let is_release_candidate = ["alpha", "beta", "rc"].iter().any(|p| pre.starts_with(p));
    if pre.is_empty() || is_release_candidate || !parsed.build.is_empty() {
        return "";
    }
    // The suffix is the tag's tail after the version core, `-` included.
    tag.len()
        .checked_sub(pre.len() + 1)
        .and_then(|start| tag.get(start..))
        .filter(|suffix| suffix.starts_with('-'))
        .unwrap_or_default()
}

/// OCI tag grammar: `[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}`.
fn valid_tag(tag: &str) -> bool {
    tag.len() <= 128
        && tag
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && tag
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
}

/// The tag of an image reference, digest ignored: `v1.34.1` of `registry.local:5000/kube-apiserver:v1.34.1`.
pub fn image_tag(image: &str) -> Option<&str> {
    let name = image.split_once('@').map_or(image, |(name, _)| name);
    let last_component = name.rfind('/').map_or(0, |i| i + 1);
    name[last_component..]
        .rfind(':')
        .map(|i| &name[last_component + i + 1..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> KubernetesVersion {
        KubernetesVersion::parse("1.35.0").expect("version")
    }

    #[test]
    fn only_the_tag_changes() {
        let digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        let with_digest = format!("registry.k8s.io/kube-apiserver:v1.34.1@{digest}");
        let only_digest = format!("registry.k8s.io/kube-scheduler@{digest}");
        // (field, current, desired)
        let cases = [
            (
                ImageField::ApiServer,
                Some("registry.k8s.io/kube-apiserver:v1.34.1"),
                "registry.k8s.io/kube-apiserver:v1.35.0",
            ),
            (
                ImageField::ApiServer,
                Some("registry.local:5000/kube-apiserver:v1.34.1"),
                "registry.local:5000/kube-apiserver:v1.35.0",
            ),
            (
                ImageField::ControllerManager,
                Some("registry.local:5000/kube-controller-manager"),
                "registry.local:5000/kube-controller-manager:v1.35.0",
            ),
            (
                ImageField::ApiServer,
                Some(with_digest.as_str()),
                "registry.k8s.io/kube-apiserver:v1.35.0",
            ),
            (
                ImageField::Scheduler,
                Some(only_digest.as_str()),
                "registry.k8s.io/kube-scheduler:v1.35.0",
            ),
            (
                ImageField::Kubelet,
                Some("ghcr.io/siderolabs/kubelet:v1.34.1-fat"),
                "ghcr.io/siderolabs/kubelet:v1.35.0-fat",
            ),
            (
                ImageField::Kubelet,
                Some("mirror.example.com/siderolabs/kubelet:v1.34.1-slim"),
                "mirror.example.com/siderolabs/kubelet:v1.35.0-slim",
            ),
            (
                ImageField::Kubelet,
                Some("ghcr.io/siderolabs/kubelet:v1.35.0-rc.1"),
                "ghcr.io/siderolabs/kubelet:v1.35.0",
            ),
            (
                ImageField::Kubelet,
                Some("ghcr.io/siderolabs/kubelet:latest"),
                "ghcr.io/siderolabs/kubelet:v1.35.0",
            ),
            // Only the kubelet keeps a suffix.
            (
                ImageField::Proxy,
                Some("registry.k8s.io/kube-proxy:v1.34.1-custom"),
                "registry.k8s.io/kube-proxy:v1.35.0",
            ),
            // Unset: the Talos default.
            (
                ImageField::Proxy,
                None,
                "registry.k8s.io/kube-proxy:v1.35.0",
            ),
            (
                ImageField::Kubelet,
                Some(""),
                "ghcr.io/siderolabs/kubelet:v1.35.0",
            ),
            // Already there: stable.
            (
                ImageField::Kubelet,
                Some("ghcr.io/siderolabs/kubelet:v1.35.0-fat"),
                "ghcr.io/siderolabs/kubelet:v1.35.0-fat",
            ),
        ];
        for (field, current, desired) in cases {
            assert_eq!(
                desired_image(field, current, &target()).as_deref(),
                Ok(desired),
                "{field} {current:?}"
            );
        }
    }

    #[test]
    fn broken_references_are_refused_naming_the_field() {
        let cases = [
            ("registry.k8s.io/kube-apiserver:v1 .34", "whitespace"),
            ("registry.k8s.io/kube-apiserver:", "tag"),
            ("registry.k8s.io/kube-apiserver@", "digest"),
            ("/kube-apiserver:v1.34.1", "repository"),
        ];
        for (image, problem) in cases {
            let error = desired_image(ImageField::ApiServer, Some(image), &target())
                .expect_err(image)
                .to_string();
            assert!(error.contains(problem), "{image}: {error}");
            assert!(error.contains("cluster.apiServer.image"), "{error}");
        }
    }

    #[test]
    fn tags_are_read_past_registry_ports_and_digests() {
        let cases = [
            (
                "registry.local:5000/kube-apiserver:v1.34.1",
                Some("v1.34.1"),
            ),
            ("registry.local:5000/kube-apiserver", None),
            ("k8s/kube-scheduler:v1.34.1@sha256:abc", Some("v1.34.1")),
        ];
        for (image, tag) in cases {
            assert_eq!(image_tag(image), tag, "{image}");
        }
    }
}
