//! The release catalog: which Talos and Kubernetes releases exist, and from them the newest valid
//! next target the controller advertises in `talos-available` / `kubernetes-available`
//! (design/protocol.md, "Annotations"; docs/releases.md).
//!
//! "Available" is decided by the same rules that decide whether a target is accepted
//! ([`crate::versions`]), so a user who copies an `*-available` value into the matching `*-target`
//! never gets a refusal. The tests check this over many combinations.
//!
//! Three layers, each optional except the first:
//! * the built-in catalog ([`Catalog::builtin`]): releases named in the project's reference material,
//!   so the controller gives useful advice with no network access at all;
//! * an operator's YAML file ([`CatalogOverride`], [`mod@file`]) that extends or replaces the built-in lists;
//! * live sources (the controller's `catalog_sources`): a background task that merges the Talos Image
//!   Factory's version list and a registry's Kubernetes tag list into the catalog. Off by default; a
//!   reconcile only ever reads a snapshot and never waits for the network.
//!
//! Reading the file and fetching the live lists are the controller's (IO); this module only parses and
//! decides.

pub mod file;

use std::collections::BTreeSet;
use std::fmt;

use crate::versions::{self, KubernetesStep, KubernetesVersion, TalosStep, TalosVersion};

pub use file::{CatalogFileError, CatalogOverride};

/// Known Talos releases: for each release line of the reference tables (talos-api.md header and §5)
/// its `.0` and the newest patch the reference names; for 1.13 and 1.14 every patch the Go module
/// proxy serves of `github.com/siderolabs/talos/pkg/machinery` (1.13.0–1.13.9, 1.14.1; its 1.14.0 is
/// the GA of the line that 1.14.1 patches). Nothing is guessed.
const BUILTIN_TALOS: [(u64, u64, u64); 24] = [
    (1, 7, 0),
    (1, 7, 7),
    (1, 8, 0),
    (1, 8, 4),
    (1, 9, 0),
    (1, 9, 6),
    (1, 10, 0),
    (1, 10, 9),
    (1, 11, 0),
    (1, 11, 6),
    (1, 12, 0),
    (1, 12, 11),
    (1, 13, 0),
    (1, 13, 1),
    (1, 13, 2),
    (1, 13, 3),
    (1, 13, 4),
    (1, 13, 5),
    (1, 13, 6),
    (1, 13, 7),
    (1, 13, 8),
    (1, 13, 9),
    (1, 14, 0),
    (1, 14, 1),
];

/// Known Kubernetes releases: the `.0` of every minor in the §5 support matrix (1.25 to 1.37) and the
/// patches Talos names as its defaults (`constants.DefaultKubernetesVersion` of machinery 1.13.0,
/// 1.13.5, 1.13.9 and 1.14.1: 1.36.0, 1.36.2, 1.36.3 and 1.37.0).
const BUILTIN_KUBERNETES: [(u64, u64, u64); 22] = [
    (1, 25, 0),
    (1, 26, 0),
    (1, 27, 0),
    (1, 28, 0),
    (1, 29, 0),
    (1, 30, 0),
    (1, 30, 5),
    (1, 31, 0),
    (1, 31, 1),
    (1, 31, 4),
    (1, 32, 0),
    (1, 32, 4),
    (1, 33, 0),
    (1, 33, 6),
    (1, 34, 0),
    (1, 34, 1),
    (1, 35, 0),
    (1, 35, 4),
    (1, 36, 0),
    (1, 36, 2),
    (1, 36, 3),
    (1, 37, 0),
];

/// A set of known releases. Holds releases only: pre-releases are never advertised, so they are
/// dropped on the way in (see [`Catalog::insert_talos`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    talos: BTreeSet<TalosVersion>,
    kubernetes: BTreeSet<KubernetesVersion>,
    /// The operator allows targets newer than every release known (`--allow-unknown-releases`):
    /// their rules are then the pattern of the known lines, not facts.
    allow_unknown: bool,
}

impl Catalog {
    /// A catalog with no releases: nothing is ever available.
    pub fn empty() -> Catalog {
        Catalog::default()
    }

    /// The catalog shipped with the controller.
    pub fn builtin() -> Catalog {
        Catalog::new(
            BUILTIN_TALOS
                .iter()
                .map(|&(major, minor, patch)| TalosVersion::new(major, minor, patch)),
            BUILTIN_KUBERNETES
                .iter()
                .map(|&(major, minor, patch)| KubernetesVersion::new(major, minor, patch)),
        )
    }

    /// A catalog of exactly these releases (pre-releases are dropped).
    pub fn new(
        talos: impl IntoIterator<Item = TalosVersion>,
        kubernetes: impl IntoIterator<Item = KubernetesVersion>,
    ) -> Catalog {
        let mut catalog = Catalog::empty();
        for version in talos {
            catalog.insert_talos(version);
        }
        for version in kubernetes {
            catalog.insert_kubernetes(version);
        }
        catalog
    }

    /// Add a Talos release; returns false (and adds nothing) for a pre-release.
    pub fn insert_talos(&mut self, version: TalosVersion) -> bool {
        if !version.semver().pre.is_empty() {
            return false;
        }
        self.talos.insert(version);
        true
    }

    /// Add a Kubernetes release; returns false (and adds nothing) for a pre-release.
    pub fn insert_kubernetes(&mut self, version: KubernetesVersion) -> bool {
        if !version.semver().pre.is_empty() {
            return false;
        }
        self.kubernetes.insert(version);
        true
    }

    /// The same releases, with targets newer than all of them allowed (see [`Catalog::unknown`]).
    pub fn allowing_unknown(mut self, allow: bool) -> Catalog {
        self.allow_unknown = allow;
        self
    }

    /// Why `target` cannot be a target: newer than every release of its kind this catalog knows
    /// (built in, from the operator's file or from live sources), unless the operator allows that.
    /// `kind` names the kind in the sentence ("Talos", "Kubernetes").
    pub fn unknown<V: Ord + std::fmt::Display>(
        &self,
        kind: &str,
        target: &V,
        known: impl DoubleEndedIterator<Item = V>,
    ) -> Option<String> {
        if self.allow_unknown {
            return None;
        }
        let newest = known.max()?;
        (*target > newest).then(|| {
            format!(
                "{kind} {target} is an unknown release; the newest known is {newest}. Set a known \
                 release, add it to the release catalog (--release-catalog, or live sources), or \
                 start the controller with --allow-unknown-releases"
            )
        })
    }

    /// Known Talos releases, oldest first.
    pub fn talos(&self) -> impl DoubleEndedIterator<Item = &TalosVersion> {
        self.talos.iter()
    }

    /// Known Kubernetes releases, oldest first.
    pub fn kubernetes(&self) -> impl DoubleEndedIterator<Item = &KubernetesVersion> {
        self.kubernetes.iter()
    }

    /// Add every release of `other`.
    pub fn merge(&mut self, other: &Catalog) {
        self.talos.extend(other.talos.iter().cloned());
        self.kubernetes.extend(other.kubernetes.iter().cloned());
        self.allow_unknown |= other.allow_unknown;
    }

    /// Apply an operator's file: each list the file gives is merged into this catalog, or replaces
    /// this catalog's list when the file says `replace: true`. A list the file leaves out is kept.
    pub fn with_override(mut self, file: &CatalogOverride) -> Catalog {
        if let Some(talos) = &file.talos {
            if file.replace {
                self.talos.clear();
            }
            self.talos.extend(talos.iter().cloned());
        }
        if let Some(kubernetes) = &file.kubernetes {
            if file.replace {
                self.kubernetes.clear();
            }
            self.kubernetes.extend(kubernetes.iter().cloned());
        }
        self
    }
}

/// The newest catalog Talos release that is a valid next target for a cluster whose nodes run
/// `lowest`..=`highest`: newer than `lowest`, accepted by [`versions::check_talos_upgrade_across`]
/// (one installer step from `lowest`, no node downgraded) and supporting every Kubernetes version in
/// `running_kubernetes` ([`versions::check_talos_target_supports`]). Pass the lowest and the highest
/// Kubernetes component version when they differ, one when they agree, none when Kubernetes could
/// not be observed; the support check is then skipped, exactly as the controller skips it when it
/// validates a target.
///
/// In a cluster left mixed by an interrupted run, the highest version itself can be the answer:
/// finishing that run is a valid next step.
pub fn talos_available(
    catalog: &Catalog,
    lowest: &TalosVersion,
    highest: &TalosVersion,
    running_kubernetes: &[KubernetesVersion],
) -> Option<TalosVersion> {
    catalog
        .talos()
        .rev()
        .take_while(|candidate| *candidate > lowest)
        .find(|candidate| {
            matches!(
                versions::check_talos_upgrade_across(lowest, highest, candidate),
                Ok(TalosStep::Upgrade)
            ) && running_kubernetes
                .iter()
                .all(|running| versions::check_talos_target_supports(candidate, running).is_ok())
        })
        .cloned()
}

/// The newest catalog Kubernetes release that is a valid next target from `current` (the lowest
/// component version): a newer patch of the same minor or a release of the next minor
/// ([`versions::check_kubernetes_upgrade`]), and supported by the Talos version of every node
/// ([`versions::check_kubernetes_target_supported`]). `None` when there is none, and also when
/// `talos_on_nodes` is empty: with no node's Talos known, support cannot be vouched for (the protocol
/// shows `kubernetes-available` only once Talos on every node supports it).
///
/// With components on different versions use [`kubernetes_available_across`].
pub fn kubernetes_available(
    catalog: &Catalog,
    current: &KubernetesVersion,
    talos_on_nodes: &[TalosVersion],
) -> Option<KubernetesVersion> {
    kubernetes_available_across(catalog, current, current, talos_on_nodes)
}

/// [`kubernetes_available`] for components on `lowest`..=`highest`: the lowest decides the path and
/// no component may be downgraded ([`versions::check_kubernetes_upgrade_across`]). In a cluster left
/// mixed by an interrupted upgrade, the highest version itself can be the answer.
pub fn kubernetes_available_across(
    catalog: &Catalog,
    lowest: &KubernetesVersion,
    highest: &KubernetesVersion,
    talos_on_nodes: &[TalosVersion],
) -> Option<KubernetesVersion> {
    if talos_on_nodes.is_empty() {
        return None;
    }
    catalog
        .kubernetes()
        .rev()
        .take_while(|candidate| *candidate > lowest)
        .find(|candidate| {
            matches!(
                versions::check_kubernetes_upgrade_across(lowest, highest, candidate),
                Ok(KubernetesStep::Patch | KubernetesStep::Minor)
            ) && talos_on_nodes
                .iter()
                .all(|talos| versions::check_kubernetes_target_supported(talos, candidate).is_ok())
        })
        .cloned()
}

/// The `*-message` sentence for an idle cluster with an upgrade available, as the seed guide shows it:
/// `Upgrade available: 1.11.6 → 1.12.0`. Versions print without the leading `v`.
pub fn upgrade_available_message(
    current: &impl fmt::Display,
    available: &impl fmt::Display,
) -> String {
    format!("Upgrade available: {current} → {available}")
}

#[cfg(test)]
mod tests;
