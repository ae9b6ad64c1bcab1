//! Container image references (`repo[:tag][@digest]`) as the simulated node validates them.
//!
//! Talos (since 1.11) insists on a tag even when a digest is present, and the simulator derives the
//! version an installer installs, or a Kubernetes component runs, from that tag.

use semver::Version;

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ImageRef {
    pub repository: String,
    pub tag: Option<String>,
    pub digest: Option<String>,
}

impl ImageRef {
    pub(crate) fn parse(text: &str) -> Result<ImageRef, String> {
        if text.is_empty() {
            return Err("image reference is empty".into());
        }
        if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!("image reference {text:?} contains whitespace"));
        }
        let (name, digest) = match text.split_once('@') {
            Some((name, digest)) => {
                if !digest.contains(':') {
                    return Err(format!("image reference {text:?} has a malformed digest"));
                }
                (name, Some(digest.to_string()))
            }
            None => (text, None),
        };
        // A ':' after the last '/' separates the tag; one before it belongs to a registry port.
        let last_slash = name.rfind('/').map_or(0, |i| i + 1);
        let (repository, tag) = match name[last_slash..].rfind(':') {
            Some(i) => {
                let split = last_slash + i;
                (&name[..split], Some(name[split + 1..].to_string()))
            }
            None => (name, None),
        };
        if repository.is_empty() || repository.ends_with('/') || repository.starts_with('/') {
            return Err(format!("image reference {text:?} has no repository"));
        }
        if let Some(tag) = &tag {
            let valid = !tag.is_empty()
                && tag.len() <= 128
                && tag
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-')
                && !tag.starts_with(['.', '-']);
            if !valid {
                return Err(format!("image reference {text:?} has an invalid tag"));
            }
        }
        Ok(ImageRef {
            repository: repository.to_string(),
            tag,
            digest,
        })
    }

    /// Parse and require a tag (Talos rejects tagless refs in machine configs).
    pub(crate) fn parse_tagged(text: &str) -> Result<ImageRef, String> {
        let image = Self::parse(text)?;
        if image.tag.is_none() {
            return Err(format!("image reference {text:?} must have a tag"));
        }
        Ok(image)
    }

    /// The version in the tag: `v1.34.1` → 1.34.1; suffixes such as `-fat` are ignored.
    pub(crate) fn version(&self) -> Option<Version> {
        let tag = self.tag.as_deref()?.trim_start_matches('v');
        if let Ok(v) = Version::parse(tag) {
            // Talos kubelet tags may carry a flavour suffix ("-fat", "-slim"); it is not a pre-release.
            if v.pre.as_str().chars().all(|c| c.is_ascii_alphabetic()) {
                return Some(Version::new(v.major, v.minor, v.patch));
            }
            return Some(v);
        }
        None
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.repository)?;
        if let Some(tag) = &self.tag {
            write!(f, ":{tag}")?;
        }
        if let Some(digest) = &self.digest {
            write!(f, "@{digest}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        let i = ImageRef::parse("ghcr.io/siderolabs/installer:v1.11.6").unwrap();
        assert_eq!(i.repository, "ghcr.io/siderolabs/installer");
        assert_eq!(i.tag.as_deref(), Some("v1.11.6"));
        assert_eq!(i.version(), Some(Version::new(1, 11, 6)));

        let i = ImageRef::parse("localhost:5000/kubelet").unwrap();
        assert_eq!(i.repository, "localhost:5000/kubelet");
        assert_eq!(i.tag, None);

        let i = ImageRef::parse("registry.k8s.io/kube-apiserver:v1.34.1@sha256:abc").unwrap();
        assert_eq!(i.tag.as_deref(), Some("v1.34.1"));
        assert_eq!(i.digest.as_deref(), Some("sha256:abc"));

        let i = ImageRef::parse("ghcr.io/siderolabs/kubelet:v1.35.0-fat").unwrap();
        assert_eq!(i.version(), Some(Version::new(1, 35, 0)));
        let i = ImageRef::parse("ghcr.io/siderolabs/kubelet:v1.37.0-rc.0").unwrap();
        assert_eq!(i.version().unwrap().pre.as_str(), "rc.0");
    }

    #[test]
    fn rejects_bad_refs() {
        assert!(ImageRef::parse("").is_err());
        assert!(ImageRef::parse("a b:v1").is_err());
        assert!(ImageRef::parse(":v1").is_err());
        assert!(ImageRef::parse_tagged("registry.k8s.io/kube-apiserver").is_err());
        assert!(ImageRef::parse_tagged("registry.k8s.io/kube-apiserver@sha256:abc").is_err());
        assert!(ImageRef::parse("repo:").is_err());
    }
}
