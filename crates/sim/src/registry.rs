//! What the container registries hold, as far as the simulated nodes pull from them, and the Talos
//! platforms and Image Factory schematics behind installer image names.
//!
//! Talos 1.14 stopped publishing the generic installer: the default installer is the Image Factory's
//! `factory.talos.dev/<platform>-installer/<schematic>:v<version>` (talos-1.14.md §1; machinery v1.14.1
//! `gendata/data/factory`; talos v1.14.1 `pkg/images/images.go`, `Makefile` target `push`). The model:
//! - `ghcr.io/siderolabs/installer` has no tag of Talos 1.14 or later;
//! - on the factory, only installers exist: `<platform>-installer[-secureboot]/<schematic>` for a
//!   known platform and `installer[-secureboot]/<schematic>`, the schematic 64 lowercase hex digits,
//!   the tag a Talos version;
//! - every other registry and repository holds whatever is asked of it (private mirrors).

use semver::Version;

use super::image_ref::ImageRef;

/// The Image Factory's host (machinery v1.14.1 `gendata/data/factory`, `gendata.ImageFactory`).
pub(crate) const IMAGE_FACTORY: &str = "factory.talos.dev";

/// The generic installer, not published from 1.14 on (`<REG>/<USER>/installer`, machinery
/// `gendata.ImagesRegistry` / `gendata.ImagesUsername`).
pub(crate) const GENERIC_INSTALLER: &str = "ghcr.io/siderolabs/installer";

/// The empty ("vanilla") schematic: the factory's image with no customization (talos v1.14.1
/// `pkg/images/images.go` `DefaultInstallerImageSchematic`).
pub(crate) const EMPTY_SCHEMATIC: &str =
    "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";

/// The platforms Talos knows: machinery v1.14.1 `platforms/platforms.go`, `MetalPlatform()` and
/// `CloudPlatforms()`, spelled as `Platform.Name` (what a node reports as its platform).
pub(crate) const PLATFORMS: &[&str] = &[
    "metal",
    "aws",
    "gcp",
    "equinixMetal",
    "azure",
    "digital-ocean",
    "nocloud",
    "openstack",
    "vmware",
    "akamai",
    "cloudstack",
    "hcloud",
    "oracle",
    "upcloud",
    "vultr",
    "exoscale",
    "opennebula",
    "scaleway",
    "alibabacloud",
];

/// Platforms a node can report that the Image Factory builds nothing for: `container`, a Talos node
/// running in a container (`talosctl cluster create` with docker), whose runtime mode is `container`
/// (talos `internal/app/machined/pkg/runtime`; not in machinery's `platforms.go`, which lists what can be
/// built).
pub(crate) const NODE_ONLY_PLATFORMS: &[&str] = &["container"];

/// The platform a node runs on when its config says nothing.
pub(crate) const DEFAULT_PLATFORM: &str = "metal";

/// A platform a simulated node may run on.
pub(crate) fn is_platform(name: &str) -> bool {
    PLATFORMS.contains(&name) || NODE_ONLY_PLATFORMS.contains(&name)
}

/// `MachineService.Version`'s `platform.mode`: Talos's runtime mode, `metal` on bare metal, `container`
/// in a container and `cloud` on every cloud platform (talos `internal/app/machined/pkg/runtime/mode.go`).
pub(crate) fn platform_mode(platform: &str) -> &'static str {
    match platform {
        "metal" => "metal",
        "container" => "container",
        _ => "cloud",
    }
}

/// An Image Factory schematic id: 64 lowercase hex digits (a SHA-256).
pub(crate) fn is_schematic_id(text: &str) -> bool {
    text.len() == 64
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The installer repository name of a factory image: `installer`, `installer-secureboot`,
/// `<platform>-installer` or `<platform>-installer-secureboot`; the platform part, if any.
fn factory_installer_platform(name: &str) -> Option<Option<&str>> {
    let base = name.strip_suffix("-secureboot").unwrap_or(name);
    if base == "installer" {
        return Some(None);
    }
    base.strip_suffix("-installer").map(Some)
}

/// A factory-shaped installer repository (`<host>/<…>installer[-secureboot]/<schematic>`, any host, so
/// a private factory counts): its host and schematic.
pub(crate) fn factory_schematic(image: &str) -> Option<(String, String)> {
    let parsed = ImageRef::parse(image).ok()?;
    let mut parts = parsed.repository.rsplitn(3, '/');
    let schematic = parts.next()?;
    let name = parts.next()?;
    let host = parts.next()?;
    (factory_installer_platform(name).is_some() && is_schematic_id(schematic))
        .then(|| (host.to_string(), schematic.to_string()))
}

/// The installer a node created on Talos `talos` was installed from by default: `talosctl gen config`
/// 1.14 uses the factory's `metal` installer with the empty schematic (talos v1.14.1
/// `cmd/talosctl/cmd/mgmt/gen/config.go`), earlier releases the generic installer.
pub(crate) fn default_installer_image(talos: &Version) -> String {
    if (talos.major, talos.minor) >= (1, 14) {
        format!("{IMAGE_FACTORY}/metal-installer/{EMPTY_SCHEMATIC}:v{talos}")
    } else {
        format!("{GENERIC_INSTALLER}:v{talos}")
    }
}

/// Resolve `reference` as containerd would before pulling: an error in containerd's words (its
/// resolver's "failed to resolve reference …: …: not found") if the registry does not have it.
pub(crate) fn resolve(reference: &str) -> Result<(), String> {
    let image = ImageRef::parse(reference)?;
    let talos_tag = || {
        image
            .tag
            .as_deref()
            .filter(|t| t.starts_with('v'))
            .and_then(|_| image.version())
    };
    let present = if image.repository == GENERIC_INSTALLER {
        // The last generic installer is 1.13's; a tag that is not a version (a digest) is left alone.
        talos_tag().is_none_or(|v| (v.major, v.minor) < (1, 14))
    } else if let Some(path) = image.repository.strip_prefix(&format!("{IMAGE_FACTORY}/")) {
        let installer = match path.split_once('/') {
            Some((name, schematic)) => {
                let known = match factory_installer_platform(name) {
                    Some(None) => true,
                    Some(Some(platform)) => PLATFORMS.iter().any(|p| p.to_lowercase() == platform),
                    None => false,
                };
                known && is_schematic_id(schematic)
            }
            None => false,
        };
        installer && talos_tag().is_some()
    } else {
        true
    };
    if present {
        Ok(())
    } else {
        Err(format!(
            "failed to resolve reference {reference:?}: {reference}: not found"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generic_installer_ends_with_1_13() {
        assert!(resolve("ghcr.io/siderolabs/installer:v1.13.5").is_ok());
        assert!(resolve("ghcr.io/siderolabs/installer:v1.11.6").is_ok());
        let err = resolve("ghcr.io/siderolabs/installer:v1.14.1").unwrap_err();
        assert_eq!(
            err,
            "failed to resolve reference \"ghcr.io/siderolabs/installer:v1.14.1\": ghcr.io/siderolabs/installer:v1.14.1: not found"
        );
        assert!(resolve("ghcr.io/siderolabs/installer:v1.15.0").is_err());
        assert!(resolve("ghcr.io/siderolabs/installer:v1.14.0-beta.1").is_err());
    }

    #[test]
    fn the_factory_serves_installers_of_known_platforms_and_schematics() {
        for image in [
            format!("factory.talos.dev/metal-installer/{EMPTY_SCHEMATIC}:v1.14.1"),
            format!("factory.talos.dev/aws-installer-secureboot/{EMPTY_SCHEMATIC}:v1.14.1"),
            format!("factory.talos.dev/equinixmetal-installer/{EMPTY_SCHEMATIC}:v1.14.1"),
            format!("factory.talos.dev/installer/{EMPTY_SCHEMATIC}:v1.10.3"),
            format!("factory.talos.dev/installer-secureboot/{EMPTY_SCHEMATIC}:v1.13.0"),
        ] {
            assert!(resolve(&image).is_ok(), "{image}");
        }
        for image in [
            format!("factory.talos.dev/mars-installer/{EMPTY_SCHEMATIC}:v1.14.1"),
            "factory.talos.dev/metal-installer/not-a-schematic:v1.14.1".to_string(),
            format!(
                "factory.talos.dev/metal-installer/{}:v1.14.1",
                EMPTY_SCHEMATIC.to_uppercase()
            ),
            format!("factory.talos.dev/metal-installer/{EMPTY_SCHEMATIC}:latest"),
            "factory.talos.dev/metal-installer:v1.14.1".to_string(),
        ] {
            assert!(resolve(&image).is_err(), "{image}");
        }
        // A private mirror holds what it is asked for.
        assert!(resolve("registry.local:5000/siderolabs/installer:v1.14.1").is_ok());
        // A node can run in a container, but nothing is built for that platform.
        assert!(is_platform("container") && platform_mode("container") == "container");
        assert!(
            resolve(&format!(
                "factory.talos.dev/container-installer/{EMPTY_SCHEMATIC}:v1.14.1"
            ))
            .is_err()
        );
    }

    #[test]
    fn the_schematic_is_read_from_a_factory_installer_of_any_host() {
        let image = format!("factory.talos.dev/metal-installer/{EMPTY_SCHEMATIC}:v1.14.1");
        assert_eq!(
            factory_schematic(&image),
            Some(("factory.talos.dev".to_string(), EMPTY_SCHEMATIC.to_string()))
        );
        let private = format!("factory.local:8080/installer-secureboot/{EMPTY_SCHEMATIC}:v1.13.0");
        assert_eq!(
            factory_schematic(&private).map(|(host, _)| host),
            Some("factory.local:8080".to_string())
        );
        assert_eq!(
            factory_schematic("ghcr.io/siderolabs/installer:v1.13.5"),
            None
        );
    }
}
