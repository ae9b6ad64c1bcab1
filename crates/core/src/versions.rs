//! Talos and Kubernetes versions and the rules that decide whether a target is valid
//! (design/protocol.md "Status lifecycle"; reference/talos-api.md §3.5, §4 step 2, §5, §7).
//!
//! Every error's `Display` is one human sentence (two where the protocol's wording has two) meant for
//! the `*-message` annotation: it says why the target is refused and what to do instead.
//!
//! # Parsing
//!
//! A version is `MAJOR.MINOR.PATCH` with an optional leading `v` (`1.12.0`, `v1.12.0`) and an optional
//! pre-release (`1.13.0-beta.1`), surrounding whitespace ignored. `1.12` is refused rather than read as
//! `1.12.0`: a release line is not a release, and guessing a patch would upgrade to something the user
//! did not name. Build metadata (`+…`) is refused because semver ordering ignores it, so two "different"
//! targets could compare equal.
//!
//! # Rules and where their data comes from
//!
//! * Talos upgrade path: the installer's `UpgradeableFrom` pre-flight (§3.5), compared on
//!   MAJOR.MINOR.PATCH as Talos does, so a pre-release host counts as its release.
//! * Kubernetes upgrade path: `talosctl upgrade-k8s` allows `X.Y → X.Y` and `X.Y → X.(Y+1)` only (§4).
//! * Talos ↔ Kubernetes support matrix (§5), compared on whole minors as Talos does (`max` is `x.y.99`).
//!
//! Releases newer than the tables follow the patterns every recent row obeys (checked by the tests):
//! Talos 1.N accepts hosts from 1.(N−2).0, and supports Kubernetes 1.(N+18) to 1.(N+23). Releases older
//! than the tables (Talos < 1.7) and other major versions are unknown and refused, because a wrong guess
//! there would let the controller issue an upgrade that Talos then refuses halfway through a cluster.

use std::fmt;
use std::str::FromStr;

use semver::{BuildMetadata, Version};

use crate::annotations::UpgradeKind;

/// A release line, `MAJOR.MINOR` (e.g. `1.12`); printed without a patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MinorVersion {
    pub major: u64,
    pub minor: u64,
}

impl MinorVersion {
    pub const fn new(major: u64, minor: u64) -> MinorVersion {
        MinorVersion { major, minor }
    }
}

impl fmt::Display for MinorVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A version string that is not `MAJOR.MINOR.PATCH`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{input:?} is not a version: use MAJOR.MINOR.PATCH, e.g. {example}")]
pub struct VersionParseError {
    /// The text as given, without surrounding whitespace.
    pub input: String,
    /// Which kind of version was expected (decides the example when none can be derived).
    pub kind: UpgradeKind,
    /// A well-formed version to suggest: the input completed when that is obvious (`1.12` →
    /// `1.12.0`), otherwise a recent release of `kind`.
    pub example: String,
}

/// Parse `MAJOR.MINOR.PATCH[-pre]`, optionally with one leading `v`.
fn parse_version(input: &str, kind: UpgradeKind) -> Result<Version, VersionParseError> {
    let text = input.trim();
    let bare = text.strip_prefix('v').unwrap_or(text);
    let error = |example: String| VersionParseError {
        input: text.to_string(),
        kind,
        example,
    };
    match Version::parse(bare) {
        Ok(version) if version.build.is_empty() => Ok(version),
        Ok(version) => Err(error(
            Version::new(version.major, version.minor, version.patch).to_string(),
        )),
        Err(_) => Err(error(suggest_version(bare, kind))),
    }
}

/// The example for a parse error: `1.12` (the usual mistake, naming the release line) becomes
/// `1.12.0`; anything else gets a recent release so the message always shows the expected shape.
fn suggest_version(bare: &str, kind: UpgradeKind) -> String {
    if let Some((major, minor)) = bare.split_once('.')
        && let (Some(major), Some(minor)) = (parse_number(major), parse_number(minor))
    {
        return format!("{major}.{minor}.0");
    }
    match kind {
        UpgradeKind::Talos => "1.12.0".to_string(),
        UpgradeKind::Kubernetes => "1.35.0".to_string(),
    }
}

fn parse_number(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Defines a version newtype; Talos and Kubernetes versions share the format but must not be mixed up,
/// so each gets its own type.
macro_rules! version_type {
    ($(#[$doc:meta])* $name:ident, $kind:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(Version);

        impl $name {
            /// A release version `major.minor.patch`.
            pub const fn new(major: u64, minor: u64, patch: u64) -> $name {
                $name(Version::new(major, minor, patch))
            }

            /// Parse `1.12.0` or `v1.12.0` (see the module documentation).
            pub fn parse(text: &str) -> Result<$name, VersionParseError> {
                parse_version(text, $kind).map($name)
            }

            /// Wrap a semver version. Build metadata is dropped: it plays no part in which release
            /// this is, and keeping it would make equal releases compare unequal.
            pub fn from_semver(mut version: Version) -> $name {
                version.build = BuildMetadata::EMPTY;
                $name(version)
            }

            pub fn semver(&self) -> &Version {
                &self.0
            }

            pub fn major(&self) -> u64 {
                self.0.major
            }

            pub fn minor(&self) -> u64 {
                self.0.minor
            }

            pub fn patch(&self) -> u64 {
                self.0.patch
            }

            /// The release line, e.g. `1.12`.
            pub fn minor_version(&self) -> MinorVersion {
                MinorVersion::new(self.0.major, self.0.minor)
            }

            /// The image tag / `Version` API spelling, with the leading `v`: `v1.12.0`.
            pub fn tag(&self) -> String {
                format!("v{}", self.0)
            }
        }

        /// Without the leading `v`, as the `*-current` and `*-available` annotations spell it.
        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = VersionParseError;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                $name::parse(text)
            }
        }
    };
}

version_type!(
    /// A Talos Linux version, e.g. `1.12.0`.
    TalosVersion,
    UpgradeKind::Talos
);

impl TalosVersion {
    /// MAJOR.MINOR.PATCH without the pre-release: the installer's pre-flight compares hosts this way,
    /// so a `1.11.0-beta.0` host passes a "1.11.0 or newer" rule.
    fn core(&self) -> (u64, u64, u64) {
        (self.0.major, self.0.minor, self.0.patch)
    }
}

version_type!(
    /// A Kubernetes version, e.g. `1.35.0`.
    KubernetesVersion,
    UpgradeKind::Kubernetes
);

/// Where a rule's numbers came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RuleSource {
    /// The reference table, copied from Talos's `pkg/machinery/compatibility`.
    Table,
    /// A release newer than the table: extrapolated from the pattern its recent rows follow.
    Pattern,
}

// ----------------------------------------------------------------------------------------------
// Talos upgrade path (§3.5)
// ----------------------------------------------------------------------------------------------

/// Which hosts the installer of a Talos release line accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TalosUpgradeConstraint {
    /// The target release line.
    pub target: MinorVersion,
    /// Oldest host version that can upgrade to `target` in one step (inclusive).
    pub min_host: TalosVersion,
    /// Hosts at or above this are refused as too new to downgrade. Listed for completeness: a
    /// downgrade is refused before this matters, and an upgrade's host is always below it.
    pub max_host: TalosVersion,
    pub source: RuleSource,
}

/// §3.5: (target minor, min host minor, refused host minor), all Talos 1.x, hosts at `.0`.
const TALOS_UPGRADE_TABLE: [(u64, u64, u64); 8] = [
    (7, 4, 9),
    (8, 5, 10),
    (9, 8, 11),
    (10, 8, 12),
    (11, 9, 13),
    (12, 10, 14),
    (13, 11, 15),
    (14, 12, 16),
];

/// Oldest Talos release line the controller knows (first row of both tables).
pub const OLDEST_KNOWN_TALOS: MinorVersion = MinorVersion::new(1, 7);

/// The installer constraint of `target`'s release line: the §3.5 row, or for a newer 1.x line the
/// pattern every row since 1.10 follows (hosts from two minors back, refusing hosts two minors ahead).
/// `None` for lines older than 1.7 and for other major versions.
pub fn talos_upgrade_constraint(target: &TalosVersion) -> Option<TalosUpgradeConstraint> {
    let line = target.minor_version();
    if line.major != 1 {
        return None;
    }
    let row = |min: u64, max: u64, source| TalosUpgradeConstraint {
        target: line,
        min_host: TalosVersion::new(1, min, 0),
        max_host: TalosVersion::new(1, max, 0),
        source,
    };
    if let Some(&(_, min, max)) = TALOS_UPGRADE_TABLE.iter().find(|r| r.0 == line.minor) {
        return Some(row(min, max, RuleSource::Table));
    }
    let newest = TALOS_UPGRADE_TABLE[TALOS_UPGRADE_TABLE.len() - 1].0;
    if line.minor > newest {
        return Some(row(line.minor - 2, line.minor + 2, RuleSource::Pattern));
    }
    None
}

/// A Talos target that is valid from the running version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TalosStep {
    /// Every node already runs the target: complete at once, nothing to do.
    AlreadyThere,
    /// Upgrade the nodes that are not on the target yet.
    Upgrade,
}

/// Why a Talos target cannot be reached from the running version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TalosPathError {
    #[error("Downgrade from {from} to {to} is not supported: choose a target of {from} or newer")]
    Downgrade {
        from: TalosVersion,
        to: TalosVersion,
    },

    #[error(
        "Talos {from} cannot upgrade to {to}: this controller only knows upgrade paths within Talos 1.x"
    )]
    UnsupportedMajor {
        from: TalosVersion,
        to: TalosVersion,
    },

    #[error(
        "Talos {to} is older than {OLDEST_KNOWN_TALOS}, the oldest release this controller upgrades to: choose a target of {OLDEST_KNOWN_TALOS}.0 or newer"
    )]
    TargetTooOld {
        from: TalosVersion,
        to: TalosVersion,
    },

    /// The target's installer refuses the host; `via` is the release line to upgrade to first.
    #[error("Talos {from} cannot upgrade to {to} in one step: upgrade to {via} first")]
    TooFarForOneStep {
        from: TalosVersion,
        to: TalosVersion,
        via: MinorVersion,
    },
}

/// Check a Talos target against the lowest version running on the nodes (the node furthest from the
/// target decides whether one step is enough). See [`check_talos_upgrade_across`] for mixed clusters.
pub fn check_talos_upgrade(
    from: &TalosVersion,
    to: &TalosVersion,
) -> Result<TalosStep, TalosPathError> {
    if from == to {
        return Ok(TalosStep::AlreadyThere);
    }
    if to < from {
        return Err(TalosPathError::Downgrade {
            from: from.clone(),
            to: to.clone(),
        });
    }
    if from.major() != to.major() || to.major() != 1 {
        return Err(TalosPathError::UnsupportedMajor {
            from: from.clone(),
            to: to.clone(),
        });
    }
    let Some(constraint) = talos_upgrade_constraint(to) else {
        // Talos 1.x below the table (the only case left): the controller does not drive such releases.
        return Err(TalosPathError::TargetTooOld {
            from: from.clone(),
            to: to.clone(),
        });
    };
    if from.core() < constraint.min_host.core() {
        return Err(TalosPathError::TooFarForOneStep {
            from: from.clone(),
            to: to.clone(),
            via: talos_stepping_stone(from, &constraint),
        });
    }
    Ok(TalosStep::Upgrade)
}

/// Check a Talos target against every node: the lowest version decides the path, and a node already
/// past the target (the highest version) would be downgraded, which is refused naming that version.
pub fn check_talos_upgrade_across(
    lowest: &TalosVersion,
    highest: &TalosVersion,
    to: &TalosVersion,
) -> Result<TalosStep, TalosPathError> {
    let step = check_talos_upgrade(lowest, to)?;
    if highest > to {
        return Err(TalosPathError::Downgrade {
            from: highest.clone(),
            to: to.clone(),
        });
    }
    Ok(step)
}

/// The release line to upgrade to before `constraint.target`: the newest line below the target that
/// `from` reaches in one step, which is the fewest hops. When no known line qualifies (a host older than
/// the tables), name the oldest line the target accepts, which is at least a necessary stop.
fn talos_stepping_stone(from: &TalosVersion, constraint: &TalosUpgradeConstraint) -> MinorVersion {
    let major = constraint.target.major;
    ((from.minor() + 1)..constraint.target.minor)
        .rev()
        .map(|minor| MinorVersion::new(major, minor))
        .find(|line| {
            talos_upgrade_constraint(&TalosVersion::new(line.major, line.minor, 0))
                .is_some_and(|step| from.core() >= step.min_host.core())
        })
        .unwrap_or(constraint.min_host.minor_version())
}

// ----------------------------------------------------------------------------------------------
// Kubernetes upgrade path (§4 step 2)
// ----------------------------------------------------------------------------------------------

/// A Kubernetes target that is valid from the running version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KubernetesStep {
    /// Every component already runs the target.
    AlreadyThere,
    /// A newer release of the same minor.
    Patch,
    /// The next minor.
    Minor,
}

/// Why a Kubernetes target cannot be reached from the running version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubernetesPathError {
    #[error("Downgrade from {from} to {to} is not supported: choose a target of {from} or newer")]
    Downgrade {
        from: KubernetesVersion,
        to: KubernetesVersion,
    },

    /// `next` is the minor to upgrade to first.
    #[error("Kubernetes upgrades go one minor version at a time: upgrade {from} to {next} first")]
    SkipsMinor {
        from: KubernetesVersion,
        to: KubernetesVersion,
        next: MinorVersion,
    },

    #[error(
        "Kubernetes {from} cannot upgrade to {to}: only upgrades within Kubernetes 1.x are supported"
    )]
    UnsupportedMajor {
        from: KubernetesVersion,
        to: KubernetesVersion,
    },
}

/// Check a Kubernetes target against the lowest version running (the lowest component version, as
/// `talosctl upgrade-k8s` detects it). See [`check_kubernetes_upgrade_across`] for mixed versions.
pub fn check_kubernetes_upgrade(
    from: &KubernetesVersion,
    to: &KubernetesVersion,
) -> Result<KubernetesStep, KubernetesPathError> {
    if from == to {
        return Ok(KubernetesStep::AlreadyThere);
    }
    if to < from {
        return Err(KubernetesPathError::Downgrade {
            from: from.clone(),
            to: to.clone(),
        });
    }
    if from.major() != to.major() || to.major() != 1 {
        return Err(KubernetesPathError::UnsupportedMajor {
            from: from.clone(),
            to: to.clone(),
        });
    }
    // `to > from` with equal majors, so the minor is equal or higher.
    match to.minor() - from.minor() {
        0 => Ok(KubernetesStep::Patch),
        1 => Ok(KubernetesStep::Minor),
        _ => Err(KubernetesPathError::SkipsMinor {
            from: from.clone(),
            to: to.clone(),
            next: MinorVersion::new(from.major(), from.minor() + 1),
        }),
    }
}

/// Check a Kubernetes target against every component: the lowest version decides the path, and a
/// component already past the target (the highest version) would be downgraded, which is refused.
pub fn check_kubernetes_upgrade_across(
    lowest: &KubernetesVersion,
    highest: &KubernetesVersion,
    to: &KubernetesVersion,
) -> Result<KubernetesStep, KubernetesPathError> {
    let step = check_kubernetes_upgrade(lowest, to)?;
    if highest > to {
        return Err(KubernetesPathError::Downgrade {
            from: highest.clone(),
            to: to.clone(),
        });
    }
    Ok(step)
}

// ----------------------------------------------------------------------------------------------
// Talos ↔ Kubernetes support matrix (§5)
// ----------------------------------------------------------------------------------------------

/// The Kubernetes minors a Talos release line supports, both ends inclusive (any patch of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KubernetesRange {
    pub min: MinorVersion,
    pub max: MinorVersion,
    pub source: RuleSource,
}

impl KubernetesRange {
    /// Compared on whole minors, as Talos does (`min.0 <= k8s < max.99`), so a pre-release of a
    /// supported minor counts as supported.
    pub fn contains(&self, kubernetes: &KubernetesVersion) -> bool {
        let line = kubernetes.minor_version();
        self.min <= line && line <= self.max
    }
}

impl fmt::Display for KubernetesRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} to {}", self.min, self.max)
    }
}

/// §5: (Talos minor, min Kubernetes minor, max Kubernetes minor), all 1.x.
/// Talos 1.14's row is `compatibility/talos114/talos114.go` of `github.com/siderolabs/talos/pkg/machinery`
/// v1.14.1 (`MinimumKubernetesVersion` 1.32.0, `MaximumKubernetesVersion` 1.37.99); no 1.15 row
/// exists there yet, so none is listed here.
const KUBERNETES_SUPPORT_TABLE: [(u64, u64, u64); 8] = [
    (7, 25, 30),
    (8, 26, 31),
    (9, 27, 32),
    (10, 28, 33),
    (11, 29, 34),
    (12, 30, 35),
    (13, 31, 36),
    (14, 32, 37),
];

/// Talos 1.N supports Kubernetes 1.(N+18) to 1.(N+23): true of every row of the table.
const KUBERNETES_MIN_OFFSET: u64 = 18;
const KUBERNETES_MAX_OFFSET: u64 = 23;

/// The §5 row for `talos`'s release line; `None` outside the table (Talos 1.7–1.14).
pub fn kubernetes_support(talos: &TalosVersion) -> Option<KubernetesRange> {
    let line = talos.minor_version();
    if line.major != 1 {
        return None;
    }
    KUBERNETES_SUPPORT_TABLE
        .iter()
        .find(|row| row.0 == line.minor)
        .map(|&(_, min, max)| KubernetesRange {
            min: MinorVersion::new(1, min),
            max: MinorVersion::new(1, max),
            source: RuleSource::Table,
        })
}

/// What the controller assumes `talos` supports: the table row, or for a 1.x line newer than the table
/// the pattern 1.(N+18)–1.(N+23). `None` (unknown, treated as unsupported) for lines older than the
/// table and for other majors: the controller cannot vouch for them.
pub fn expected_kubernetes_support(talos: &TalosVersion) -> Option<KubernetesRange> {
    if let Some(range) = kubernetes_support(talos) {
        return Some(range);
    }
    let line = talos.minor_version();
    let newest = KUBERNETES_SUPPORT_TABLE[KUBERNETES_SUPPORT_TABLE.len() - 1].0;
    (line.major == 1 && line.minor > newest).then(|| KubernetesRange {
        min: MinorVersion::new(1, line.minor + KUBERNETES_MIN_OFFSET),
        max: MinorVersion::new(1, line.minor + KUBERNETES_MAX_OFFSET),
        source: RuleSource::Pattern,
    })
}

/// Whether `talos` runs `kubernetes`, per [`expected_kubernetes_support`]; an unknown Talos supports
/// nothing.
pub fn talos_supports(talos: &TalosVersion, kubernetes: &KubernetesVersion) -> bool {
    expected_kubernetes_support(talos).is_some_and(|range| range.contains(kubernetes))
}

/// The oldest known Talos release line that supports `kubernetes`, to name in advice.
fn oldest_talos_supporting(kubernetes: &KubernetesVersion) -> Option<MinorVersion> {
    if let Some(row) = KUBERNETES_SUPPORT_TABLE.iter().find(|row| {
        let range = MinorVersion::new(1, row.1)..=MinorVersion::new(1, row.2);
        range.contains(&kubernetes.minor_version())
    }) {
        return Some(MinorVersion::new(1, row.0));
    }
    // Beyond the table: the pattern's oldest line with max ≥ the target is minor − 23.
    let newest_max = KUBERNETES_SUPPORT_TABLE[KUBERNETES_SUPPORT_TABLE.len() - 1].2;
    (kubernetes.major() == 1 && kubernetes.minor() > newest_max)
        .then(|| MinorVersion::new(1, kubernetes.minor() - KUBERNETES_MAX_OFFSET))
}

/// Why a Kubernetes target cannot run on a node's Talos. The controller reports these as `blocked`
/// (protocol): the upgrade starts by itself once Talos is upgraded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KubernetesSupportError {
    /// The protocol's wording, verbatim.
    #[error("Talos {talos} does not support K8s {kubernetes}. Upgrade Talos first.")]
    TalosTooOld {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
        max: MinorVersion,
    },

    /// Only reachable with a target below what the node's Talos supports; upgrading Talos cannot fix
    /// that, so the advice is a newer target.
    #[error("Talos {talos} does not support K8s {kubernetes}. Choose Kubernetes {min} or newer.")]
    KubernetesTooOld {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
        min: MinorVersion,
    },

    #[error(
        "Talos {talos} is not a release this controller knows, so it cannot tell whether it supports K8s {kubernetes}. Upgrade Talos to {OLDEST_KNOWN_TALOS} or newer, or upgrade the controller."
    )]
    UnknownTalos {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
    },
}

/// Check that a node running `talos` supports the Kubernetes `target`. Call it for every node (or
/// for the lowest and the highest Talos version: support ranges only move up with the Talos minor).
pub fn check_kubernetes_target_supported(
    talos: &TalosVersion,
    target: &KubernetesVersion,
) -> Result<(), KubernetesSupportError> {
    let Some(range) = expected_kubernetes_support(talos) else {
        return Err(KubernetesSupportError::UnknownTalos {
            talos: talos.clone(),
            kubernetes: target.clone(),
        });
    };
    let line = target.minor_version();
    if line > range.max {
        return Err(KubernetesSupportError::TalosTooOld {
            talos: talos.clone(),
            kubernetes: target.clone(),
            max: range.max,
        });
    }
    if line < range.min {
        return Err(KubernetesSupportError::KubernetesTooOld {
            talos: talos.clone(),
            kubernetes: target.clone(),
            min: range.min,
        });
    }
    Ok(())
}

/// Why a Talos target cannot run the Kubernetes version the cluster runs. The protocol makes this an
/// invalid target (`failed`), decided before any node is touched.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TalosSupportError {
    /// The usual case: a Talos minor upgrade raises the Kubernetes floor above what runs. The advice
    /// names the minor to reach; the Kubernetes upgrade itself still goes one minor at a time.
    #[error(
        "Talos {talos} does not support the running Kubernetes {kubernetes}. Upgrade Kubernetes to {min} first."
    )]
    KubernetesTooOld {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
        min: MinorVersion,
    },

    /// Support ranges only move up with the Talos minor, so this happens only when the cluster already
    /// runs a Kubernetes newer than its own Talos line supports (Talos < 1.11 did not enforce the
    /// matrix) and the target stays on an old line. Smaller Talos steps would make it worse; the fix
    /// is a newer Talos target, named by `supported_from` when known.
    #[error("{}", talos_too_old_for_running(.talos, .kubernetes, .supported_from))]
    KubernetesTooNew {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
        supported_from: Option<MinorVersion>,
    },

    #[error(
        "Talos {talos} is not a release this controller knows, so it cannot tell whether it supports the running Kubernetes {kubernetes}. Choose a Talos target of {OLDEST_KNOWN_TALOS}.0 or newer within 1.x."
    )]
    UnknownTalos {
        talos: TalosVersion,
        kubernetes: KubernetesVersion,
    },
}

fn talos_too_old_for_running(
    talos: &TalosVersion,
    kubernetes: &KubernetesVersion,
    supported_from: &Option<MinorVersion>,
) -> String {
    match supported_from {
        Some(line) => format!(
            "Talos {talos} does not support the running Kubernetes {kubernetes}. Choose a Talos target of {line}.0 or newer."
        ),
        None => format!(
            "Talos {talos} does not support the running Kubernetes {kubernetes}. Choose a Talos target that supports it."
        ),
    }
}

/// Check that the Talos `target` supports the Kubernetes version the cluster runs. With mixed
/// component versions call it for the lowest and the highest.
pub fn check_talos_target_supports(
    target: &TalosVersion,
    running: &KubernetesVersion,
) -> Result<(), TalosSupportError> {
    let Some(range) = expected_kubernetes_support(target) else {
        return Err(TalosSupportError::UnknownTalos {
            talos: target.clone(),
            kubernetes: running.clone(),
        });
    };
    let line = running.minor_version();
    if line < range.min {
        return Err(TalosSupportError::KubernetesTooOld {
            talos: target.clone(),
            kubernetes: running.clone(),
            min: range.min,
        });
    }
    if line > range.max {
        return Err(TalosSupportError::KubernetesTooNew {
            talos: target.clone(),
            kubernetes: running.clone(),
            supported_from: oldest_talos_supporting(running),
        });
    }
    Ok(())
}

// ----------------------------------------------------------------------------------------------
// Installer images (§7)
// ----------------------------------------------------------------------------------------------

/// The plain release installer, for nodes whose current image is unknown. Never substitute it for a
/// factory image: it lacks the schematic's extensions and Talos refuses it on such nodes.
pub const DEFAULT_INSTALLER_REPOSITORY: &str = "ghcr.io/siderolabs/installer";

/// `ghcr.io/siderolabs/installer:v<target>`.
pub fn default_installer_image(target: &TalosVersion) -> String {
    format!("{DEFAULT_INSTALLER_REPOSITORY}:{}", target.tag())
}

/// Why the target installer image cannot be derived from the node's current one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error(
        "The node's installer image is empty, so the target image cannot be derived from it: set the install image in its machine config (installer.image of its UnattendedInstallConfig, or machine.install.image) to the installer the node was installed with, or name one with the upgrade.vitistack.io/talos-installer-image annotation"
    )]
    Empty,

    #[error(
        "The node's installer image {image:?} is not a valid image reference ({problem}), so the target image cannot be derived from it: correct the install image in its machine config (installer.image of its UnattendedInstallConfig, or machine.install.image)"
    )]
    Invalid {
        image: String,
        problem: &'static str,
    },
}

/// The installer image for `target` on a node installed from `current_image`: same registry (port
/// included), repository path and Image Factory schematic, tag `v<target>`, digest dropped (it pins
/// the old release). Covers `ghcr.io/siderolabs/installer:vX`,
/// `factory.talos.dev/installer[-secureboot]/<schematic>:vX` and
/// `factory.talos.dev/<platform>-installer[-secureboot]/<schematic>:vX` alike, since only the tag changes.
pub fn installer_image_for(
    current_image: &str,
    target: &TalosVersion,
) -> Result<String, ImageError> {
    let image = current_image.trim();
    if image.is_empty() {
        return Err(ImageError::Empty);
    }
    let invalid = |problem| ImageError::Invalid {
        image: image.to_string(),
        problem,
    };
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid("it contains whitespace"));
    }
    let name = match image.split_once('@') {
        Some((name, digest)) => {
            if !valid_digest(digest) {
                return Err(invalid("its digest is malformed"));
            }
            name
        }
        None => image,
    };
    // A ':' after the last '/' starts the tag; one before it belongs to a registry port.
    let last_component = name.rfind('/').map_or(0, |i| i + 1);
    let repository = match name[last_component..].rfind(':') {
        Some(i) => {
            let split = last_component + i;
            if !valid_tag(&name[split + 1..]) {
                return Err(invalid("its tag is malformed"));
            }
            &name[..split]
        }
        None => name,
    };
    check_repository(repository).map_err(invalid)?;
    Ok(format!("{repository}:{}", target.tag()))
}

/// OCI distribution grammar: `[a-z0-9]+([+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]+`.
fn valid_digest(digest: &str) -> bool {
    let Some((algorithm, encoded)) = digest.split_once(':') else {
        return false;
    };
    !algorithm.is_empty()
        && algorithm
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"+._-".contains(&b))
        && !encoded.is_empty()
        && encoded
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"=_-".contains(&b))
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

/// `[registry[:port]/]path/…`: the first component is a registry when it looks like a host (has a
/// '.' or ':' or is `localhost`), as container runtimes decide; path components are lowercase.
fn check_repository(repository: &str) -> Result<(), &'static str> {
    if repository.is_empty() {
        return Err("it has no repository");
    }
    let components: Vec<&str> = repository.split('/').collect();
    if components.iter().any(|c| c.is_empty()) {
        return Err("its repository has an empty path component");
    }
    let first = components[0];
    let has_registry = components.len() > 1
        && (first.contains(['.', ':']) || first == "localhost" || first.starts_with('['));
    let (registry, path) = if has_registry {
        (Some(first), &components[1..])
    } else {
        (None, &components[..])
    };
    if let Some(registry) = registry {
        let host_chars = registry
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
        if !host_chars {
            return Err("its registry host is malformed");
        }
    }
    for component in path {
        let chars_ok = component
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
        let ends_ok = component
            .bytes()
            .next()
            .zip(component.bytes().last())
            .is_some_and(|(a, z)| a.is_ascii_alphanumeric() && z.is_ascii_alphanumeric());
        if !chars_ok || !ends_ok {
            return Err("its repository path is malformed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tv(text: &str) -> TalosVersion {
        TalosVersion::parse(text).unwrap()
    }

    fn kv(text: &str) -> KubernetesVersion {
        KubernetesVersion::parse(text).unwrap()
    }

    // ----- parsing -----

    #[test]
    fn parses_versions() {
        let cases = [
            ("1.12.0", "1.12.0"),
            ("v1.12.0", "1.12.0"),
            ("  v1.12.0\n", "1.12.0"),
            ("1.13.0-beta.1", "1.13.0-beta.1"),
            ("v1.37.0-rc.0", "1.37.0-rc.0"),
            ("0.0.0", "0.0.0"),
            ("10.200.3000", "10.200.3000"),
        ];
        for (text, display) in cases {
            let talos = tv(text);
            assert_eq!(talos.to_string(), display, "{text:?}");
            assert_eq!(talos.tag(), format!("v{display}"), "{text:?}");
            let kubernetes = kv(text);
            assert_eq!(kubernetes.to_string(), display, "{text:?}");
            assert_eq!(text.parse::<TalosVersion>().unwrap(), talos);
        }
        let v = tv("v1.12.3");
        assert_eq!((v.major(), v.minor(), v.patch()), (1, 12, 3));
        assert_eq!(v.minor_version(), MinorVersion::new(1, 12));
        assert_eq!(v.minor_version().to_string(), "1.12");
        assert_eq!(v.semver(), &Version::new(1, 12, 3));
    }

    #[test]
    fn refuses_malformed_versions() {
        // (input, Talos message, Kubernetes message)
        let cases = [
            (
                "1.12",
                r#""1.12" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""1.12" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
            ),
            (
                "v1.35",
                r#""v1.35" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
                r#""v1.35" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "1",
                r#""1" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""1" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "latest",
                r#""latest" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""latest" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "",
                r#""" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "1.12.0+build.5",
                r#""1.12.0+build.5" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""1.12.0+build.5" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
            ),
            (
                "vv1.12.0",
                r#""vv1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""vv1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "V1.12.0",
                r#""V1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""V1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "1.012.0",
                r#""1.012.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""1.012.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "1.12.0.1",
                r#""1.12.0.1" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""1.12.0.1" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                "v 1.12.0",
                r#""v 1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                r#""v 1.12.0" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.35.0"#,
            ),
            (
                " 1.11 ",
                r#""1.11" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.11.0"#,
                r#""1.11" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.11.0"#,
            ),
        ];
        for (text, talos_message, kubernetes_message) in cases {
            let talos = TalosVersion::parse(text).unwrap_err();
            assert_eq!(talos.to_string(), talos_message, "{text:?}");
            assert_eq!(talos.kind, UpgradeKind::Talos);
            let kubernetes = KubernetesVersion::parse(text).unwrap_err();
            assert_eq!(kubernetes.to_string(), kubernetes_message, "{text:?}");
            assert_eq!(kubernetes.kind, UpgradeKind::Kubernetes);
        }
    }

    #[test]
    fn from_semver_drops_build_metadata() {
        let v = TalosVersion::from_semver(Version::parse("1.12.0+abc").unwrap());
        assert_eq!(v, TalosVersion::new(1, 12, 0));
        assert_eq!(v.to_string(), "1.12.0");
    }

    #[test]
    fn orders_like_semver() {
        assert!(tv("1.13.0-alpha.1") < tv("1.13.0"));
        assert!(tv("1.12.11") < tv("1.13.0-alpha.1"));
        assert!(tv("v1.9.6") < tv("1.10.0"));
        assert_eq!(tv("v1.12.0"), tv("1.12.0"));
    }

    // ----- Talos upgrade path -----

    #[test]
    fn talos_constraint_table_matches_the_reference() {
        // §3.5 verbatim: target, min host, refused host ≥.
        let rows = [
            ("1.7.0", "1.4.0", "1.9.0"),
            ("1.8.0", "1.5.0", "1.10.0"),
            ("1.9.0", "1.8.0", "1.11.0"),
            ("1.10.0", "1.8.0", "1.12.0"),
            ("1.11.0", "1.9.0", "1.13.0"),
            ("1.12.0", "1.10.0", "1.14.0"),
            ("1.13.0", "1.11.0", "1.15.0"),
            ("1.14.0", "1.12.0", "1.16.0"),
        ];
        for (target, min, max) in rows {
            let c = talos_upgrade_constraint(&tv(target)).unwrap();
            assert_eq!(c.min_host, tv(min), "{target}");
            assert_eq!(c.max_host, tv(max), "{target}");
            assert_eq!(c.source, RuleSource::Table, "{target}");
            assert_eq!(c.target, tv(target).minor_version());
        }
        // The pattern used beyond the table reproduces every row since 1.10.
        for &(minor, min, max) in &TALOS_UPGRADE_TABLE {
            if minor >= 10 {
                assert_eq!((min, max), (minor - 2, minor + 2), "1.{minor}");
            }
        }
        // Beyond the table: the pattern.
        let c = talos_upgrade_constraint(&tv("1.15.2")).unwrap();
        assert_eq!(
            (c.min_host, c.max_host, c.source),
            (tv("1.13.0"), tv("1.17.0"), RuleSource::Pattern)
        );
        let c = talos_upgrade_constraint(&tv("1.20.0")).unwrap();
        assert_eq!(c.min_host, tv("1.18.0"));
        // Unknown: older lines and other majors.
        assert_eq!(talos_upgrade_constraint(&tv("1.6.7")), None);
        assert_eq!(talos_upgrade_constraint(&tv("2.0.0")), None);
        assert_eq!(talos_upgrade_constraint(&tv("0.14.0")), None);
    }

    /// Ok(step) or Err(message).
    fn talos_path(from: &str, to: &str) -> Result<TalosStep, String> {
        check_talos_upgrade(&tv(from), &tv(to)).map_err(|e| e.to_string())
    }

    #[test]
    fn talos_path_accepts_what_the_installer_accepts() {
        use TalosStep::{AlreadyThere, Upgrade};
        let cases = [
            // equal
            ("1.12.0", "1.12.0", AlreadyThere),
            ("v1.11.6", "1.11.6", AlreadyThere),
            ("1.13.0-beta.1", "1.13.0-beta.1", AlreadyThere),
            // patch
            ("1.11.5", "1.11.6", Upgrade),
            ("1.13.0-beta.1", "1.13.0", Upgrade),
            // each row's minimum host, and one minor ahead of it
            ("1.4.0", "1.7.0", Upgrade),
            ("1.6.7", "1.7.7", Upgrade),
            ("1.5.0", "1.8.0", Upgrade),
            ("1.7.7", "1.8.4", Upgrade),
            ("1.8.0", "1.9.0", Upgrade),
            ("1.8.4", "1.10.9", Upgrade),
            ("1.9.0", "1.10.0", Upgrade),
            ("1.9.6", "1.11.6", Upgrade),
            ("1.10.0", "1.12.0", Upgrade),
            ("1.10.9", "1.11.6", Upgrade),
            ("1.11.0", "1.13.0", Upgrade),
            ("1.11.6", "1.12.0", Upgrade),
            ("1.12.0", "1.14.0", Upgrade),
            ("1.13.9", "1.14.0", Upgrade),
            // beyond the table: pattern, two minors back
            ("1.13.0", "1.15.0", Upgrade),
            ("1.18.0", "1.20.1", Upgrade),
            // pre-release host compared on its core, as Talos does
            ("1.11.0-beta.0", "1.13.0", Upgrade),
        ];
        for (from, to, step) in cases {
            assert_eq!(talos_path(from, to), Ok(step), "{from} → {to}");
        }
    }

    #[test]
    fn talos_path_refuses_with_advice() {
        let cases = [
            // below each row's minimum host; `via` is the newest line reachable in one step
            (
                "1.3.9",
                "1.7.0",
                "Talos 1.3.9 cannot upgrade to 1.7.0 in one step: upgrade to 1.4 first",
            ),
            (
                "1.4.2",
                "1.8.0",
                "Talos 1.4.2 cannot upgrade to 1.8.0 in one step: upgrade to 1.7 first",
            ),
            (
                "1.7.7",
                "1.9.0",
                "Talos 1.7.7 cannot upgrade to 1.9.0 in one step: upgrade to 1.8 first",
            ),
            (
                "1.7.7",
                "1.10.0",
                "Talos 1.7.7 cannot upgrade to 1.10.0 in one step: upgrade to 1.8 first",
            ),
            (
                "1.8.4",
                "1.11.0",
                "Talos 1.8.4 cannot upgrade to 1.11.0 in one step: upgrade to 1.10 first",
            ),
            (
                "1.9.6",
                "1.12.0",
                "Talos 1.9.6 cannot upgrade to 1.12.0 in one step: upgrade to 1.11 first",
            ),
            (
                "1.10.9",
                "1.13.0",
                "Talos 1.10.9 cannot upgrade to 1.13.0 in one step: upgrade to 1.12 first",
            ),
            (
                "1.11.6",
                "1.14.0",
                "Talos 1.11.6 cannot upgrade to 1.14.0 in one step: upgrade to 1.13 first",
            ),
            (
                "1.7.0",
                "1.13.0",
                "Talos 1.7.0 cannot upgrade to 1.13.0 in one step: upgrade to 1.8 first",
            ),
            (
                "1.10.0-alpha.1",
                "1.13.0",
                "Talos 1.10.0-alpha.1 cannot upgrade to 1.13.0 in one step: upgrade to 1.12 first",
            ),
            // beyond the table
            (
                "1.12.5",
                "1.15.0",
                "Talos 1.12.5 cannot upgrade to 1.15.0 in one step: upgrade to 1.14 first",
            ),
            (
                "1.14.0",
                "1.17.0",
                "Talos 1.14.0 cannot upgrade to 1.17.0 in one step: upgrade to 1.16 first",
            ),
            // downgrades, including patch and pre-release
            (
                "1.12.0",
                "1.11.6",
                "Downgrade from 1.12.0 to 1.11.6 is not supported: choose a target of 1.12.0 or newer",
            ),
            (
                "1.12.3",
                "1.12.2",
                "Downgrade from 1.12.3 to 1.12.2 is not supported: choose a target of 1.12.3 or newer",
            ),
            (
                "1.13.0",
                "1.13.0-rc.0",
                "Downgrade from 1.13.0 to 1.13.0-rc.0 is not supported: choose a target of 1.13.0 or newer",
            ),
            // majors and unknown old lines
            (
                "1.12.0",
                "2.0.0",
                "Talos 1.12.0 cannot upgrade to 2.0.0: this controller only knows upgrade paths within Talos 1.x",
            ),
            (
                "2.0.0",
                "2.1.0",
                "Talos 2.0.0 cannot upgrade to 2.1.0: this controller only knows upgrade paths within Talos 1.x",
            ),
            (
                "1.5.0",
                "1.6.7",
                "Talos 1.6.7 is older than 1.7, the oldest release this controller upgrades to: choose a target of 1.7.0 or newer",
            ),
        ];
        for (from, to, message) in cases {
            assert_eq!(
                talos_path(from, to),
                Err(message.to_string()),
                "{from} → {to}"
            );
        }
        // The stepping stone is also available as data.
        assert_eq!(
            check_talos_upgrade(&tv("1.10.9"), &tv("1.13.0")),
            Err(TalosPathError::TooFarForOneStep {
                from: tv("1.10.9"),
                to: tv("1.13.0"),
                via: MinorVersion::new(1, 12),
            })
        );
    }

    #[test]
    fn talos_path_across_mixed_nodes() {
        let across = |lowest: &str, highest: &str, to: &str| {
            check_talos_upgrade_across(&tv(lowest), &tv(highest), &tv(to))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            across("1.12.0", "1.12.0", "1.12.0"),
            Ok(TalosStep::AlreadyThere)
        );
        assert_eq!(across("1.11.6", "1.12.0", "1.12.0"), Ok(TalosStep::Upgrade));
        assert_eq!(
            across("1.12.3", "1.12.5", "1.12.4"),
            Err("Downgrade from 1.12.5 to 1.12.4 is not supported: choose a target of 1.12.5 or newer".into())
        );
        // The path from the lowest node is reported before a downgrade of the highest.
        assert_eq!(
            across("1.10.9", "1.13.2", "1.13.0"),
            Err("Talos 1.10.9 cannot upgrade to 1.13.0 in one step: upgrade to 1.12 first".into())
        );
    }

    // ----- Kubernetes upgrade path -----

    #[test]
    fn kubernetes_path() {
        use KubernetesStep::{AlreadyThere, Minor, Patch};
        let ok = [
            ("1.34.1", "1.34.1", AlreadyThere),
            ("v1.34.1", "1.34.1", AlreadyThere),
            ("1.34.1", "1.34.2", Patch),
            ("1.35.0-rc.0", "1.35.0", Patch),
            ("1.34.1", "1.35.0", Minor),
            ("1.33.6", "1.34.0", Minor),
            ("1.34.9", "1.35.4", Minor),
            ("1.36.3", "1.37.0-rc.0", Minor),
        ];
        for (from, to, step) in ok {
            assert_eq!(
                check_kubernetes_upgrade(&kv(from), &kv(to)),
                Ok(step),
                "{from} → {to}"
            );
        }
        let refused = [
            (
                "1.33.4",
                "1.35.0",
                "Kubernetes upgrades go one minor version at a time: upgrade 1.33.4 to 1.34 first",
            ),
            (
                "1.30.5",
                "1.34.1",
                "Kubernetes upgrades go one minor version at a time: upgrade 1.30.5 to 1.31 first",
            ),
            (
                "1.34.1",
                "1.33.6",
                "Downgrade from 1.34.1 to 1.33.6 is not supported: choose a target of 1.34.1 or newer",
            ),
            (
                "1.34.2",
                "1.34.1",
                "Downgrade from 1.34.2 to 1.34.1 is not supported: choose a target of 1.34.2 or newer",
            ),
            (
                "1.35.0",
                "1.35.0-rc.1",
                "Downgrade from 1.35.0 to 1.35.0-rc.1 is not supported: choose a target of 1.35.0 or newer",
            ),
            (
                "1.40.0",
                "2.0.0",
                "Kubernetes 1.40.0 cannot upgrade to 2.0.0: only upgrades within Kubernetes 1.x are supported",
            ),
        ];
        for (from, to, message) in refused {
            assert_eq!(
                check_kubernetes_upgrade(&kv(from), &kv(to)).map_err(|e| e.to_string()),
                Err(message.to_string()),
                "{from} → {to}"
            );
        }
        assert_eq!(
            check_kubernetes_upgrade(&kv("1.33.4"), &kv("1.35.0")),
            Err(KubernetesPathError::SkipsMinor {
                from: kv("1.33.4"),
                to: kv("1.35.0"),
                next: MinorVersion::new(1, 34),
            })
        );
    }

    #[test]
    fn kubernetes_path_across_mixed_components() {
        let across = |lowest: &str, highest: &str, to: &str| {
            check_kubernetes_upgrade_across(&kv(lowest), &kv(highest), &kv(to))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            across("1.33.6", "1.34.1", "1.34.1"),
            Ok(KubernetesStep::Minor)
        );
        assert_eq!(
            across("1.34.0", "1.34.3", "1.34.2"),
            Err("Downgrade from 1.34.3 to 1.34.2 is not supported: choose a target of 1.34.3 or newer".into())
        );
    }

    // ----- support matrix -----

    #[test]
    fn support_table_matches_the_reference_and_the_pattern() {
        let rows = [
            ("1.7.7", 25, 30),
            ("1.8.4", 26, 31),
            ("1.9.6", 27, 32),
            ("1.10.9", 28, 33),
            ("1.11.6", 29, 34),
            ("1.12.11", 30, 35),
            ("1.13.9", 31, 36),
            ("1.14.0-rc.0", 32, 37),
        ];
        for (talos, min, max) in rows {
            let talos = tv(talos);
            let range = kubernetes_support(&talos).unwrap();
            assert_eq!(range.min, MinorVersion::new(1, min), "{talos}");
            assert_eq!(range.max, MinorVersion::new(1, max), "{talos}");
            assert_eq!(range.source, RuleSource::Table);
            assert_eq!(expected_kubernetes_support(&talos), Some(range));
            // The fallback pattern reproduces every row.
            assert_eq!(min, talos.minor() + KUBERNETES_MIN_OFFSET, "{talos}");
            assert_eq!(max, talos.minor() + KUBERNETES_MAX_OFFSET, "{talos}");
        }
        for unknown in ["1.6.7", "1.16.0", "2.0.0", "0.9.0"] {
            assert_eq!(kubernetes_support(&tv(unknown)), None, "{unknown}");
        }
        let future = expected_kubernetes_support(&tv("1.16.0")).unwrap();
        assert_eq!(
            (future.min, future.max, future.source),
            (
                MinorVersion::new(1, 34),
                MinorVersion::new(1, 39),
                RuleSource::Pattern
            )
        );
        assert_eq!(future.to_string(), "1.34 to 1.39");
        for unknown in ["1.6.7", "2.0.0", "0.9.0"] {
            assert_eq!(expected_kubernetes_support(&tv(unknown)), None, "{unknown}");
        }
    }

    #[test]
    fn support_matrix_boundaries() {
        let cases = [
            ("1.11.6", "1.28.15", false),
            ("1.11.6", "1.29.0", true),
            ("1.11.6", "1.34.0", true),
            ("1.11.6", "1.34.99", true),
            ("1.11.6", "1.35.0", false),
            ("1.12.0", "1.29.9", false),
            ("1.12.0", "1.30.0", true),
            ("1.12.0", "1.35.0", true),
            ("1.12.0", "1.35.4", true),
            ("1.12.0", "1.36.0", false),
            ("1.13.0", "1.30.5", false),
            ("1.13.0", "1.31.0", true),
            ("1.13.0", "1.36.3", true),
            ("1.13.0", "1.37.0", false),
            ("1.7.0", "1.24.17", false),
            ("1.7.0", "1.25.0", true),
            ("1.7.0", "1.30.5", true),
            ("1.7.0", "1.31.0", false),
            ("1.14.0", "1.37.0-rc.0", true),
            ("1.15.0", "1.38.0", true),
            ("1.15.0", "1.39.0", false),
            // pattern beyond the table
            ("1.16.0", "1.34.0", true),
            ("1.16.0", "1.39.0", true),
            ("1.16.0", "1.40.0", false),
            ("1.16.0", "1.33.0", false),
            // unknown Talos supports nothing
            ("1.6.7", "1.29.0", false),
            ("2.0.0", "1.40.0", false),
            // other Kubernetes majors
            ("1.12.0", "2.30.0", false),
        ];
        for (talos, kubernetes, supported) in cases {
            assert_eq!(
                talos_supports(&tv(talos), &kv(kubernetes)),
                supported,
                "Talos {talos} / K8s {kubernetes}"
            );
        }
    }

    #[test]
    fn kubernetes_target_against_node_talos() {
        let check = |talos: &str, target: &str| {
            check_kubernetes_target_supported(&tv(talos), &kv(target)).map_err(|e| e.to_string())
        };
        assert_eq!(check("1.11.6", "1.34.1"), Ok(()));
        assert_eq!(check("1.12.0", "1.35.0"), Ok(()));
        assert_eq!(
            check("1.11.6", "1.35.0"),
            Err("Talos 1.11.6 does not support K8s 1.35.0. Upgrade Talos first.".into())
        );
        assert_eq!(
            check("1.13.0", "1.30.5"),
            Err(
                "Talos 1.13.0 does not support K8s 1.30.5. Choose Kubernetes 1.31 or newer.".into()
            )
        );
        assert_eq!(
            check("1.6.7", "1.29.0"),
            Err("Talos 1.6.7 is not a release this controller knows, so it cannot tell whether it supports K8s 1.29.0. Upgrade Talos to 1.7 or newer, or upgrade the controller.".into())
        );
        assert_eq!(
            check_kubernetes_target_supported(&tv("1.11.6"), &kv("1.35.0")),
            Err(KubernetesSupportError::TalosTooOld {
                talos: tv("1.11.6"),
                kubernetes: kv("1.35.0"),
                max: MinorVersion::new(1, 34),
            })
        );
    }

    #[test]
    fn talos_target_against_running_kubernetes() {
        let check = |target: &str, running: &str| {
            check_talos_target_supports(&tv(target), &kv(running)).map_err(|e| e.to_string())
        };
        assert_eq!(check("1.13.0", "1.31.0"), Ok(()));
        assert_eq!(check("1.12.0", "1.34.1"), Ok(()));
        assert_eq!(
            check("1.13.0", "1.30.5"),
            Err("Talos 1.13.0 does not support the running Kubernetes 1.30.5. Upgrade Kubernetes to 1.31 first.".into())
        );
        assert_eq!(
            check("1.12.0", "1.29.9"),
            Err("Talos 1.12.0 does not support the running Kubernetes 1.29.9. Upgrade Kubernetes to 1.30 first.".into())
        );
        // Running Kubernetes beyond the target line: advice names the oldest line that supports it.
        assert_eq!(
            check("1.9.6", "1.33.1"),
            Err("Talos 1.9.6 does not support the running Kubernetes 1.33.1. Choose a Talos target of 1.10.0 or newer.".into())
        );
        assert_eq!(
            check("1.15.0", "1.40.2"),
            Err("Talos 1.15.0 does not support the running Kubernetes 1.40.2. Choose a Talos target of 1.17.0 or newer.".into())
        );
        assert_eq!(
            check("1.12.0", "2.1.0"),
            Err("Talos 1.12.0 does not support the running Kubernetes 2.1.0. Choose a Talos target that supports it.".into())
        );
        assert_eq!(
            check("2.0.0", "1.35.0"),
            Err("Talos 2.0.0 is not a release this controller knows, so it cannot tell whether it supports the running Kubernetes 1.35.0. Choose a Talos target of 1.7.0 or newer within 1.x.".into())
        );
    }

    #[test]
    fn oldest_talos_for_kubernetes() {
        let cases = [
            ("1.25.0", Some((1, 7))),
            ("1.30.5", Some((1, 7))),
            ("1.31.0", Some((1, 8))),
            ("1.33.1", Some((1, 10))),
            ("1.38.0", Some((1, 15))),
            ("1.39.0", Some((1, 16))),
            ("1.24.0", None),
            ("2.0.0", None),
        ];
        for (kubernetes, expected) in cases {
            let expected = expected.map(|(major, minor)| MinorVersion::new(major, minor));
            assert_eq!(
                oldest_talos_supporting(&kv(kubernetes)),
                expected,
                "{kubernetes}"
            );
            if let Some(line) = expected {
                assert!(talos_supports(
                    &TalosVersion::new(line.major, line.minor, 0),
                    &kv(kubernetes)
                ));
            }
        }
    }

    // ----- installer images -----

    #[test]
    fn installer_images_keep_everything_but_the_tag() {
        const SCHEMATIC: &str = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
        let cases = [
            (
                "ghcr.io/siderolabs/installer:v1.11.6".to_string(),
                "ghcr.io/siderolabs/installer:v1.12.0".to_string(),
            ),
            (
                format!("factory.talos.dev/installer/{SCHEMATIC}:v1.11.6"),
                format!("factory.talos.dev/installer/{SCHEMATIC}:v1.12.0"),
            ),
            (
                format!("factory.talos.dev/installer-secureboot/{SCHEMATIC}:v1.11.6"),
                format!("factory.talos.dev/installer-secureboot/{SCHEMATIC}:v1.12.0"),
            ),
            (
                format!("factory.talos.dev/metal-installer/{SCHEMATIC}:v1.11.6"),
                format!("factory.talos.dev/metal-installer/{SCHEMATIC}:v1.12.0"),
            ),
            (
                format!("factory.talos.dev/nocloud-installer-secureboot/{SCHEMATIC}:v1.11.6"),
                format!("factory.talos.dev/nocloud-installer-secureboot/{SCHEMATIC}:v1.12.0"),
            ),
            (
                format!("factory.talos.dev/aws-installer/{SCHEMATIC}:latest"),
                format!("factory.talos.dev/aws-installer/{SCHEMATIC}:v1.12.0"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1.11.6@sha256:0123456789abcdef".to_string(),
                "ghcr.io/siderolabs/installer:v1.12.0".to_string(),
            ),
            (
                format!("factory.talos.dev/metal-installer/{SCHEMATIC}@sha256:abcdef0123"),
                format!("factory.talos.dev/metal-installer/{SCHEMATIC}:v1.12.0"),
            ),
            (
                "registry.local:5000/siderolabs/installer:v1.11.6".to_string(),
                "registry.local:5000/siderolabs/installer:v1.12.0".to_string(),
            ),
            (
                "registry.local:5000/siderolabs/installer".to_string(),
                "registry.local:5000/siderolabs/installer:v1.12.0".to_string(),
            ),
            (
                "localhost/installer:v1.11.6".to_string(),
                "localhost/installer:v1.12.0".to_string(),
            ),
            (
                "[fd00::1]:5000/siderolabs/installer:v1.11.6".to_string(),
                "[fd00::1]:5000/siderolabs/installer:v1.12.0".to_string(),
            ),
            (
                "  siderolabs/installer:v1.11.6\n".to_string(),
                "siderolabs/installer:v1.12.0".to_string(),
            ),
        ];
        let target = tv("1.12.0");
        for (current, expected) in cases {
            assert_eq!(
                installer_image_for(&current, &target),
                Ok(expected),
                "{current:?}"
            );
        }
        assert_eq!(
            installer_image_for("ghcr.io/siderolabs/installer:v1.12.0", &tv("1.13.0-beta.1")),
            Ok("ghcr.io/siderolabs/installer:v1.13.0-beta.1".to_string())
        );
    }

    #[test]
    fn installer_images_refused() {
        let cases = [
            ("", None),
            ("   ", None),
            (":v1.11.6", Some("it has no repository")),
            ("@sha256:abc", Some("it has no repository")),
            (
                "ghcr.io/siderolabs/installer:",
                Some("its tag is malformed"),
            ),
            (
                "ghcr.io/siderolabs/installer:-v1",
                Some("its tag is malformed"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1@sha256",
                Some("its digest is malformed"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1@:abc",
                Some("its digest is malformed"),
            ),
            (
                "ghcr.io/siderolabs/installer:v1@sha256:",
                Some("its digest is malformed"),
            ),
            (
                "ghcr.io//installer:v1",
                Some("its repository has an empty path component"),
            ),
            (
                "/installer:v1",
                Some("its repository has an empty path component"),
            ),
            (
                "ghcr.io/siderolabs/:v1",
                Some("its repository has an empty path component"),
            ),
            (
                "ghcr.io/SideroLabs/installer:v1",
                Some("its repository path is malformed"),
            ),
            (
                "ghcr.io/siderolabs/installer-:v1",
                Some("its repository path is malformed"),
            ),
            (
                "ghcr.io/sidero labs/installer:v1",
                Some("it contains whitespace"),
            ),
            (
                "ghc_r.io/siderolabs/installer:v1",
                Some("its registry host is malformed"),
            ),
        ];
        let target = tv("1.12.0");
        for (current, problem) in cases {
            let error = installer_image_for(current, &target).unwrap_err();
            match problem {
                None => assert_eq!(error, ImageError::Empty, "{current:?}"),
                Some(problem) => assert_eq!(
                    error,
                    ImageError::Invalid {
                        image: current.trim().to_string(),
                        problem
                    },
                    "{current:?}"
                ),
            }
        }
        assert_eq!(
            installer_image_for(":v1.11.6", &target)
                .unwrap_err()
                .to_string(),
            r#"The node's installer image ":v1.11.6" is not a valid image reference (it has no repository), so the target image cannot be derived from it: correct the install image in its machine config (installer.image of its UnattendedInstallConfig, or machine.install.image)"#
        );
        assert_eq!(
            installer_image_for("", &target).unwrap_err().to_string(),
            "The node's installer image is empty, so the target image cannot be derived from it: set the install image in its machine config (installer.image of its UnattendedInstallConfig, or machine.install.image) to the installer the node was installed with, or name one with the upgrade.vitistack.io/talos-installer-image annotation"
        );
    }

    #[test]
    fn default_installer() {
        assert_eq!(
            default_installer_image(&tv("1.12.0")),
            "ghcr.io/siderolabs/installer:v1.12.0"
        );
        assert_eq!(
            default_installer_image(&tv("v1.11.6")),
            "ghcr.io/siderolabs/installer:v1.11.6"
        );
    }
}
