//! Which installer image takes a node to the target Talos version.
//!
//! The rule of design/protocol.md is to keep the node's own image (registry, repository, Image Factory
//! schematic) and change only the tag. Talos 1.14 broke that rule for one image: the generic installer
//! `ghcr.io/siderolabs/installer` is no longer published from 1.14 (talos v1.14.1 `Makefile` target
//! `push` no longer pushes it; its CHANGELOG, "Default Installer Image"), and the default became the
//! Image Factory's `factory.talos.dev/<platform>-installer/<schematic>` with the empty ("vanilla")
//! schematic (talos v1.14.1 `pkg/images/images.go`: `InstallerImageRepository`,
//! `DefaultInstallerImageSchematic`). So:
//!
//! 1. An override annotation, when set, names the installer for every node: a repository
//!    (`talos-installer-image`) or an Image Factory schematic (`talos-schematic`).
//! 2. A node on the generic installer, going to Talos ≥ 1.14, gets the factory image for its own
//!    platform (read from the node, never guessed) with the empty schematic.
//! 3. Every other node keeps its image and gets the target's tag (its registry, so private factories
//!    and mirrors keep working, and its schematic, so its extensions stay).
//!
//! Whatever cannot be decided this way fails the node before any call to it, saying what to set.

use semver::Version;

use crate::versions::{self, TalosVersion};

/// The generic installer's repository, published for Talos releases before 1.14 only.
pub const GENERIC_INSTALLER: &str = versions::DEFAULT_INSTALLER_REPOSITORY;

/// The public Image Factory (machinery v1.14.1 `gendata.ImageFactory`).
pub const IMAGE_FACTORY: &str = "factory.talos.dev";

/// The empty ("vanilla") schematic: the factory image with no extensions, what the generic installer
/// was (talos v1.14.1 `pkg/images/images.go` `DefaultInstallerImageSchematic`, and talosctl's
/// `ImageFactoryEmptySchematicID`).
pub const EMPTY_SCHEMATIC: &str =
    "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";

/// The platforms the Image Factory builds installers for: machinery v1.14.1 `platforms/platforms.go`
/// (`MetalPlatform`, `CloudPlatforms`). Single-board computers are `metal` with an overlay, which is
/// part of the schematic, not of the platform.
pub const FACTORY_PLATFORMS: &[&str] = &[
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

/// The first Talos minor without a generic installer.
const FACTORY_ONLY_FROM: (u64, u64) = (1, 14);

/// What a node says about how it was installed: read from the node before its upgrade starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallSource {
    /// The install image of its running config (`UnattendedInstallConfig` `installer.image`, else
    /// `machine.install.image`); empty when the config has neither.
    pub image: String,
    /// The platform the node reports (`MachineService.Version` `platform.name`: `metal`, `aws`, …);
    /// `None` when it reports none.
    pub platform: Option<String>,
}

impl InstallSource {
    pub fn new(image: impl Into<String>, platform: Option<&str>) -> Self {
        InstallSource {
            image: image.into(),
            platform: platform.map(str::to_string),
        }
    }
}

/// An installer named by the cluster's annotations, for every node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstallerOverride {
    /// `talos-installer-image`: a repository without a tag; the target's tag is added.
    Repository(String),
    /// `talos-schematic`: an Image Factory schematic id, used with each node's platform.
    Schematic(String),
}

/// The installer image that takes the node installed from `source` to `target`, or why there is none
/// (one sentence that says what to set).
pub fn installer_image(
    source: &InstallSource,
    target: &Version,
    installer_override: Option<&InstallerOverride>,
) -> Result<String, String> {
    let tag = TalosVersion::from_semver(target.clone()).tag();
    match installer_override {
        Some(InstallerOverride::Repository(repository)) => {
            return Ok(format!("{repository}:{tag}"));
        }
        Some(InstallerOverride::Schematic(schematic)) => {
            let platform = factory_platform(source, "the talos-schematic annotation")?;
            let host = factory_host(&source.image).unwrap_or(IMAGE_FACTORY);
            return Ok(format!("{host}/{platform}-installer/{schematic}:{tag}"));
        }
        None => {}
    }
    let current =
        versions::installer_image_for(&source.image, &TalosVersion::from_semver(target.clone()))
            .map_err(|e| e.to_string())?;
    if repository_of(&source.image) == GENERIC_INSTALLER
        && (target.major, target.minor) >= FACTORY_ONLY_FROM
    {
        let platform = factory_platform(
            source,
            &format!("its installer {GENERIC_INSTALLER}, which has no Talos {target} images"),
        )?;
        return Ok(format!(
            "{IMAGE_FACTORY}/{platform}-installer/{EMPTY_SCHEMATIC}:{tag}"
        ));
    }
    Ok(current)
}

/// The node's platform as it appears in a factory image name (lower case, as talos v1.14.1
/// `internal/app/machined/pkg/controllers/runtime/unattended_install.go` builds it), or why the
/// factory image cannot be named. `needed_for` says what needs the platform.
fn factory_platform(source: &InstallSource, needed_for: &str) -> Result<String, String> {
    let what_to_set = format!(
        "set the annotation {} to the installer repository to use (for example \
         {IMAGE_FACTORY}/metal-installer/<schematic>; the target's tag is added)",
        crate::annotations::TALOS_INSTALLER_IMAGE
    );
    let Some(platform) = source.platform.as_deref().filter(|p| !p.trim().is_empty()) else {
        return Err(format!(
            "the node reports no platform, which the Image Factory installer for {needed_for} is \
             named after: {what_to_set}"
        ));
    };
    if !FACTORY_PLATFORMS.contains(&platform) {
        return Err(format!(
            "the node's platform {platform:?} is not one the Image Factory builds installers for \
             (needed for {needed_for}): {what_to_set}"
        ));
    }
    Ok(platform.to_ascii_lowercase())
}

/// The registry host of a factory-shaped image (`<host>/[<platform>-]installer[-secureboot]/<schematic>`),
/// so a schematic override keeps a private factory.
fn factory_host(image: &str) -> Option<&str> {
    let repository = repository_of(image);
    let mut parts = repository.split('/');
    let host = parts.next()?;
    let name = parts.next()?;
    let schematic = parts.next()?;
    (parts.next().is_none()
        && (name.ends_with("installer") || name.ends_with("installer-secureboot"))
        && is_schematic_id(schematic))
    .then_some(host)
}

/// `image` without its tag and digest.
fn repository_of(image: &str) -> &str {
    let image = image.trim();
    let name = image.split_once('@').map_or(image, |(name, _)| name);
    let last_component = name.rfind('/').map_or(0, |i| i + 1);
    match name[last_component..].rfind(':') {
        Some(i) => &name[..last_component + i],
        None => name,
    }
}

/// An Image Factory schematic id: 64 lowercase hex digits (a SHA-256).
pub fn is_schematic_id(text: &str) -> bool {
    text.len() == 64
        && text
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a `talos-installer-image` value: an image repository without tag or digest.
pub fn parse_installer_repository(text: &str) -> Result<String, &'static str> {
    if text.contains('@') {
        return Err("name a repository without a digest");
    }
    if repository_of(text) != text {
        return Err("name a repository without a tag; the target's tag is added");
    }
    // The tag-swapping check accepts exactly the well-formed repositories.
    versions::installer_image_for(&format!("{text}:v0.0.0"), &TalosVersion::from_semver(Version::new(0, 0, 0)))
        .map(|_| text.to_string())
        .map_err(|_| "name a valid image repository, for example factory.talos.dev/metal-installer/<schematic>")
}

/// What an installer's exit code says about its failure: whether trying again may help, and the
/// failure in words (the code's meaning, then the installer's own last lines).
///
/// The codes are Talos 1.14's (machinery v1.14.1 `constants/constants.go`, "Installer/imager exit
/// codes", stable across releases). Talos does not say which are worth retrying; this follows Omni
/// (`internal/backend/talos/lifecycle/exitcode.go`): invalid input (2) and an unsupported operation (3)
/// fail the same way every time, everything else may pass. One exception: the host-version pre-flight
/// check exits 4 (environment) with `compatibility/talos_version.go`'s words, and a version the
/// installer refuses stays refused, so that is permanent too. Installers before 1.14 exit 1 on every
/// failure: unknown, so retried within the node's deadline.
pub fn installer_exit(code: i32, output: &str) -> (bool, String) {
    let (retry, meaning) = match code {
        2 => (false, "invalid input"),
        3 => (false, "unsupported for this version"),
        4 if refuses_host_version(output) => (false, "the host's Talos version is refused"),
        4 => (true, "a host prerequisite is missing"),
        5 => (true, "an external dependency failed, such as an image pull"),
        6 => (true, "a local I/O failure"),
        7 => (true, "the installation failed"),
        _ => (true, "an unknown failure"),
    };
    let output = output.trim();
    let words = if output.is_empty() {
        format!("the installer exited with code {code} ({meaning})")
    } else {
        format!("the installer exited with code {code} ({meaning}): {output}")
    };
    (retry, words)
}

/// `TalosVersion.UpgradeableFrom`'s refusals (machinery v1.14.1 `compatibility/talos_version.go`).
fn refuses_host_version(output: &str) -> bool {
    let host_refused = output.contains("host version")
        && [
            "is too old to upgrade",
            "is too new to downgrade",
            "is denied for upgrade",
        ]
        .iter()
        .any(|words| output.contains(words));
    // "upgrades to version X are not supported": the target itself is refused.
    host_refused || output.contains("are not supported")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(image: &str, platform: Option<&str>) -> InstallSource {
        InstallSource {
            image: image.to_string(),
            platform: platform.map(str::to_string),
        }
    }

    const OWN: &str = "0f3e6bbf0aa3b4e4b6d4ce18ef7b2e5d8f7f4a1a0c9e8d7c6b5a493827160514";

    #[test]
    fn the_installer_for_each_kind_of_node_and_target() {
        let v = |s: &str| Version::parse(s).unwrap();
        let vanilla = |platform: &str, tag: &str| {
            format!("factory.talos.dev/{platform}-installer/{EMPTY_SCHEMATIC}:{tag}")
        };
        // (current image, platform, target, expected)
        let own_factory = format!("factory.talos.dev/metal-installer/{OWN}:v1.13.5");
        let own_private = format!("factory.example.corp:5000/installer-secureboot/{OWN}:v1.13.5");
        type Case<'a> = (&'a str, Option<&'a str>, &'a str, Result<String, &'a str>);
        let cases: Vec<Case> = vec![
            // Below 1.14 the generic installer still exists: kept.
            (
                "ghcr.io/siderolabs/installer:v1.12.5",
                Some("metal"),
                "1.13.5",
                Ok("ghcr.io/siderolabs/installer:v1.13.5".into()),
            ),
            // From 1.14: the factory image of the node's platform, empty schematic.
            (
                "ghcr.io/siderolabs/installer:v1.13.5",
                Some("metal"),
                "1.14.1",
                Ok(vanilla("metal", "v1.14.1")),
            ),
            (
                "ghcr.io/siderolabs/installer:v1.13.5@sha256:abcd",
                Some("aws"),
                "1.14.0",
                Ok(vanilla("aws", "v1.14.0")),
            ),
            (
                "ghcr.io/siderolabs/installer:v1.13.5",
                Some("equinixMetal"),
                "1.14.1",
                Ok(vanilla("equinixmetal", "v1.14.1")),
            ),
            // A platform the factory has no installer for, or none reported: refused, naming what to set.
            (
                "ghcr.io/siderolabs/installer:v1.13.5",
                Some("container"),
                "1.14.1",
                Err("\"container\" is not one the Image Factory builds"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1.13.5",
                None,
                "1.14.1",
                Err("reports no platform"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1.13.5",
                Some(""),
                "1.14.1",
                Err("talos-installer-image"),
            ),
            // A factory image keeps its host, path and schematic, at every target.
            (
                &own_factory,
                Some("metal"),
                "1.14.1",
                Ok(format!("factory.talos.dev/metal-installer/{OWN}:v1.14.1")),
            ),
            (
                &own_private,
                None,
                "1.14.1",
                Ok(format!(
                    "factory.example.corp:5000/installer-secureboot/{OWN}:v1.14.1"
                )),
            ),
            // A mirror of the generic installer under another name is the operator's own: kept.
            (
                "registry.example.corp/siderolabs/installer:v1.13.5",
                None,
                "1.14.1",
                Ok("registry.example.corp/siderolabs/installer:v1.14.1".into()),
            ),
            // Nothing to derive from.
            ("", Some("metal"), "1.14.1", Err("installer image is empty")),
        ];
        for (image, platform, target, expected) in cases {
            let got = installer_image(&source(image, platform), &v(target), None);
            match expected {
                Ok(image_expected) => assert_eq!(got, Ok(image_expected), "{image} → {target}"),
                Err(words) => {
                    let reason = got.expect_err(image);
                    assert!(reason.contains(words), "{image} → {target}: {reason}");
                }
            }
        }
    }

    #[test]
    fn an_override_names_the_installer_of_every_node() {
        let target = Version::new(1, 14, 1);
        let repository =
            InstallerOverride::Repository("registry.example.corp/talos/installer".into());
        for image in ["ghcr.io/siderolabs/installer:v1.13.5", ""] {
            assert_eq!(
                installer_image(&source(image, None), &target, Some(&repository)),
                Ok("registry.example.corp/talos/installer:v1.14.1".into())
            );
        }
        let schematic = InstallerOverride::Schematic(OWN.into());
        assert_eq!(
            installer_image(
                &source("ghcr.io/siderolabs/installer:v1.13.5", Some("hcloud")),
                &target,
                Some(&schematic)
            ),
            Ok(format!("factory.talos.dev/hcloud-installer/{OWN}:v1.14.1"))
        );
        // A private factory is kept.
        assert_eq!(
            installer_image(
                &source(
                    &format!("factory.example.corp/metal-installer/{EMPTY_SCHEMATIC}:v1.13.5"),
                    Some("metal")
                ),
                &target,
                Some(&schematic)
            ),
            Ok(format!(
                "factory.example.corp/metal-installer/{OWN}:v1.14.1"
            ))
        );
        let reason = installer_image(
            &source("ghcr.io/siderolabs/installer:v1.13.5", None),
            &target,
            Some(&schematic),
        )
        .unwrap_err();
        assert!(reason.contains("talos-schematic"), "{reason}");
    }

    #[test]
    fn installer_repositories_and_schematics_are_checked() {
        assert_eq!(
            parse_installer_repository("factory.talos.dev/metal-installer/abc"),
            Ok("factory.talos.dev/metal-installer/abc".into())
        );
        assert_eq!(
            parse_installer_repository("localhost:5000/installer"),
            Ok("localhost:5000/installer".into())
        );
        for bad in [
            "ghcr.io/siderolabs/installer:v1.14.1",
            "a/b@sha256:00",
            "Upper/Case",
            "a b",
        ] {
            assert!(parse_installer_repository(bad).is_err(), "{bad}");
        }
        assert!(is_schematic_id(EMPTY_SCHEMATIC));
        assert!(!is_schematic_id(&EMPTY_SCHEMATIC.to_uppercase()));
        assert!(!is_schematic_id("abc"));
    }

    #[test]
    fn installer_exit_codes() {
        // (code, output, retried?, words in the reason)
        let cases = [
            (
                1,
                "error: something",
                true,
                "code 1 (an unknown failure): error: something",
            ),
            (
                2,
                "invalid kernel argument",
                false,
                "code 2 (invalid input): invalid kernel argument",
            ),
            (3, "", false, "code 3 (unsupported for this version)"),
            (
                4,
                "pre-flight: /dev/sda is missing",
                true,
                "a host prerequisite is missing",
            ),
            (
                4,
                "host version 1.11.6 is too old to upgrade to Talos 1.14.1",
                false,
                "the host's Talos version is refused",
            ),
            (
                4,
                "host version 1.16.0 is too new to downgrade to Talos 1.14.1",
                false,
                "refused",
            ),
            (
                5,
                "failed to pull overlay",
                true,
                "an external dependency failed",
            ),
            (6, "", true, "a local I/O failure"),
            (7, "", true, "the installation failed"),
            (42, "", true, "code 42 (an unknown failure)"),
        ];
        for (code, output, retry, words) in cases {
            let (retried, reason) = installer_exit(code, output);
            assert_eq!(retried, retry, "{code} {output}");
            assert!(reason.contains(words), "{code}: {reason}");
            assert!(reason.starts_with(&format!("the installer exited with code {code}")));
        }
    }
}
