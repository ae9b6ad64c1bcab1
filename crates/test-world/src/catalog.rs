//! The release catalog of the user guide's example (examples/release-catalog.yaml): Talos 1.11.6 →
//! 1.12.0, Kubernetes 1.34.1 → 1.35.0. The built-in catalog knows newer releases; with this one the
//! `talos-available` and `kubernetes-available` annotations read as the guide shows them, and the tests'
//! expectations do not move when the built-in lists grow.

use talos_upgrade_controller::catalog_sources::CatalogHandle;
use talos_upgrade_core::catalog::{Catalog, CatalogOverride};

const GUIDE_CATALOG: &str = include_str!("../../../examples/release-catalog.yaml");

/// The guide's releases as a catalog: the built-in one with examples/release-catalog.yaml over it.
pub fn guide_releases() -> Catalog {
    let guide = CatalogOverride::parse(GUIDE_CATALOG, "examples/release-catalog.yaml")
        .expect("examples/release-catalog.yaml, compiled in, is a valid catalog override");
    Catalog::builtin().with_override(&guide)
}

/// [`guide_releases`] as the controller takes its catalog (fixed: no live sources).
pub fn guide_catalog() -> CatalogHandle {
    CatalogHandle::fixed(guide_releases())
}

/// [`guide_catalog`] with targets newer than its releases allowed (`--allow-unknown-releases`): the
/// end-to-end suites keep the guide's `*-available` while they upgrade to releases beyond it (Talos
/// 1.13, 1.14) to reach the lifecycle API.
pub fn guide_catalog_allowing_unknown() -> CatalogHandle {
    CatalogHandle::fixed(guide_releases().allowing_unknown(true))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_guide_catalog_parses() {
        super::guide_releases();
    }
}
