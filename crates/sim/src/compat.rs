//! Version rules the simulated nodes enforce: the Talos ↔ Kubernetes support matrix (talos-api.md §5),
//! the installer's upgrade-path pre-flight (§3.5) and which APIs a Talos version serves (§1.1, §2.3).

use semver::Version;

/// Parse "1.11.6" or "v1.11.6".
pub(crate) fn parse_version(text: &str) -> Result<Version, String> {
    let trimmed = text.trim().trim_start_matches('v');
    Version::parse(trimmed).map_err(|e| format!("not a semantic version: {e}"))
}

/// `vX.Y.Z` as Talos and Kubernetes tags spell it.
pub(crate) fn tag(version: &Version) -> String {
    format!("v{version}")
}

/// Supported Kubernetes minors (inclusive) of a Talos minor, from `pkg/machinery/compatibility/talosXY`.
/// Talos checks `min <= k8s < max` with max `x.y.99`, i.e. whole minors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KubernetesRange {
    pub min_minor: u64,
    pub max_minor: u64,
}

impl std::fmt::Display for KubernetesRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "1.{}.0 to 1.{}.x", self.min_minor, self.max_minor)
    }
}

/// The matrix of §5. Every listed Talos 1.N supports Kubernetes 1.(N+18) – 1.(N+23); releases outside
/// the table follow the same rule, which is also how upstream has moved so far.
pub(crate) fn kubernetes_range(talos: &Version) -> KubernetesRange {
    KubernetesRange {
        min_minor: talos.minor + 18,
        max_minor: talos.minor + 23,
    }
}

/// Talos `DefaultKubernetesVersion` (newest patch at the newest tag checked, §5).
pub(crate) fn default_kubernetes_version(talos: &Version) -> Version {
    match talos.minor {
        7 => Version::new(1, 30, 5),
        8 => Version::new(1, 31, 4),
        9 => Version::new(1, 32, 4),
        10 => Version::new(1, 33, 6),
        11 => Version::new(1, 34, 1),
        12 => Version::new(1, 35, 4),
        13 => Version::new(1, 36, 3),
        minor => Version::new(1, minor + 23, 0),
    }
}

/// Since Talos 1.11 the node refuses machine configs whose Kubernetes images are outside its range.
pub(crate) fn enforces_kubernetes_matrix(talos: &Version) -> bool {
    (talos.major, talos.minor) >= (1, 11)
}

/// Check a Kubernetes version against what `talos` supports, in Talos's words
/// (`KubernetesVersion.SupportedWith`, machinery v1.13.5 and v1.14.1 `compatibility/kubernetes_version.go`).
pub(crate) fn check_kubernetes(talos: &Version, kubernetes: &Version) -> Result<(), String> {
    let range = kubernetes_range(talos);
    if kubernetes.major < 1 || (kubernetes.major == 1 && kubernetes.minor < range.min_minor) {
        return Err(format!(
            "version of Kubernetes {kubernetes} is too old to be used with Talos {talos}"
        ));
    }
    if kubernetes.major > 1 || kubernetes.minor > range.max_minor {
        return Err(format!(
            "version of Kubernetes {kubernetes} is too new to be used with Talos {talos}"
        ));
    }
    Ok(())
}

/// The installer pre-flight `UpgradeableFrom`: (minimum host version, first refused host version).
fn upgradeable_from(target: &Version) -> (Version, Version) {
    match target.minor {
        7 => (Version::new(1, 4, 0), Version::new(1, 9, 0)),
        8 => (Version::new(1, 5, 0), Version::new(1, 10, 0)),
        9 => (Version::new(1, 8, 0), Version::new(1, 11, 0)),
        10 => (Version::new(1, 8, 0), Version::new(1, 12, 0)),
        // 1.11 onwards: two minors back, refusing hosts two minors ahead.
        minor if minor >= 11 => (Version::new(1, minor - 2, 0), Version::new(1, minor + 2, 0)),
        // Older targets than the table: only allow the same minor, the simulator never models them.
        minor => (Version::new(1, minor, 0), Version::new(1, minor + 1, 0)),
    }
}

/// Would the installer of `target` accept a node running `host`? The refusal in the installer's words
/// (`TalosVersion.UpgradeableFrom`, machinery v1.14.1 `compatibility/talos_version.go`; no Talos release
/// the simulator models denies a host version outright, so its third message never appears).
pub(crate) fn check_upgrade_path(host: &Version, target: &Version) -> Result<(), String> {
    let (min, refused) = upgradeable_from(target);
    let host_core = Version::new(host.major, host.minor, host.patch);
    if host_core < min {
        return Err(format!(
            "host version {host} is too old to upgrade to Talos {target}"
        ));
    }
    if host_core >= refused {
        return Err(format!(
            "host version {host} is too new to downgrade to Talos {target}"
        ));
    }
    Ok(())
}

/// Talos 1.14 knows the multi-document Kubernetes configs (`KubeletConfig`, `KubeAPIServerConfig`, …),
/// its installer reports categorized exit codes, and it has `ImageFactorySchematics`.
pub(crate) fn knows_kubernetes_documents(talos: &Version) -> bool {
    (talos.major, talos.minor) >= (1, 14)
}

/// An installer of this Talos version exits with a code per failure category (machinery v1.14.1
/// `constants/constants.go`, "Installer/imager exit codes"); older installers exit 1 on every failure.
pub(crate) fn installer_has_exit_codes(installer: &Version) -> bool {
    (installer.major, installer.minor) >= (1, 14)
}

/// ImageService and LifecycleService exist from Talos 1.13.0.
pub(crate) fn has_lifecycle_api(talos: &Version) -> bool {
    (talos.major, talos.minor) >= (1, 13)
}

/// `Versions.runtime.talos.dev` exists from Talos 1.10.
pub(crate) fn has_version_resource(talos: &Version) -> bool {
    (talos.major, talos.minor) >= (1, 10)
}

/// Since 1.12.9 / 1.13.4, `preserve` also skips the control-plane etcd pre-checks of a legacy upgrade.
pub(crate) fn preserve_skips_etcd_checks(talos: &Version) -> bool {
    let core = (talos.major, talos.minor, talos.patch);
    match (talos.major, talos.minor) {
        (1, 12) => core >= (1, 12, 9),
        (1, 13) => core >= (1, 13, 4),
        (major, minor) => (major, minor) > (1, 13),
    }
}

/// Since 1.12.0 the MachineConfig `yaml_spec` is a YAML string scalar holding the config.
pub(crate) fn machine_config_yaml_spec_is_scalar(talos: &Version) -> bool {
    (talos.major, talos.minor) >= (1, 12)
}

/// etcd release shipped by a Talos minor (what EtcdStatus reports as protocol version).
pub(crate) fn etcd_version(talos: &Version) -> &'static str {
    if (talos.major, talos.minor) >= (1, 11) {
        "3.6.5"
    } else {
        "3.5.21"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Version {
        parse_version(s).unwrap()
    }

    #[test]
    fn matrix_matches_the_reference_table() {
        let cases = [
            ("1.7.0", 25, 30),
            ("1.10.3", 28, 33),
            ("1.11.6", 29, 34),
            ("1.12.0", 30, 35),
            ("1.13.0", 31, 36),
            ("1.15.0", 33, 38),
        ];
        for (talos, min, max) in cases {
            assert_eq!(
                kubernetes_range(&v(talos)),
                KubernetesRange {
                    min_minor: min,
                    max_minor: max
                }
            );
        }
        assert!(check_kubernetes(&v("1.11.6"), &v("1.34.1")).is_ok());
        assert!(check_kubernetes(&v("1.11.6"), &v("1.34.99")).is_ok());
        let err = check_kubernetes(&v("1.11.6"), &v("1.35.0")).unwrap_err();
        assert!(err.contains("1.35.0"), "{err}");
        assert!(check_kubernetes(&v("1.11.6"), &v("1.28.9")).is_err());
    }

    #[test]
    fn upgrade_paths() {
        assert!(check_upgrade_path(&v("1.11.6"), &v("1.12.0")).is_ok());
        assert!(check_upgrade_path(&v("1.10.0"), &v("1.12.0")).is_ok());
        assert!(check_upgrade_path(&v("1.9.5"), &v("1.12.0")).is_err());
        assert!(check_upgrade_path(&v("1.14.0"), &v("1.12.0")).is_err());
        assert!(check_upgrade_path(&v("1.8.0"), &v("1.10.0")).is_ok());
        assert!(check_upgrade_path(&v("1.7.0"), &v("1.10.0")).is_err());
        // Downgrade within the window is fine (rollback of a minor).
        assert!(check_upgrade_path(&v("1.12.1"), &v("1.11.6")).is_ok());
    }

    #[test]
    fn feature_gates() {
        assert!(!has_lifecycle_api(&v("1.12.9")));
        assert!(has_lifecycle_api(&v("1.13.0")));
        assert!(preserve_skips_etcd_checks(&v("1.12.9")));
        assert!(!preserve_skips_etcd_checks(&v("1.12.8")));
        assert!(!preserve_skips_etcd_checks(&v("1.13.3")));
        assert!(preserve_skips_etcd_checks(&v("1.14.0")));
        assert!(!preserve_skips_etcd_checks(&v("1.11.6")));
    }
}
