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
/// its `.0` and the newest patch the reference names. Intermediate patches are left out rather than
/// guessed; the newest patch of a line is the one worth advertising anyway.
const BUILTIN_TALOS: [(u64, u64, u64); 14] = [
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
    (1, 13, 9),
];

/// Known Kubernetes releases: the `.0` of every minor in the §5 support matrix (1.25 to 1.36) and the
/// patches §5 names as Talos defaults (the newest known per minor). 1.37 is only known as a release
/// candidate, so it is not listed.
const BUILTIN_KUBERNETES: [(u64, u64, u64); 20] = [
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
    (1, 36, 3),
];

/// A set of known releases. Holds releases only: pre-releases are never advertised, so they are
/// dropped on the way in (see [`Catalog::insert_talos`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    talos: BTreeSet<TalosVersion>,
    kubernetes: BTreeSet<KubernetesVersion>,
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
