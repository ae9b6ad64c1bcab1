use super::*;
use crate::versions::{
    check_kubernetes_target_supported, check_kubernetes_upgrade, check_talos_target_supports,
    check_talos_upgrade_across,
};

fn t(text: &str) -> TalosVersion {
    TalosVersion::parse(text).expect("test version")
}

fn k(text: &str) -> KubernetesVersion {
    KubernetesVersion::parse(text).expect("test version")
}

fn talos_list(texts: &[&str]) -> Vec<TalosVersion> {
    texts.iter().map(|text| t(text)).collect()
}

fn kubernetes_list(texts: &[&str]) -> Vec<KubernetesVersion> {
    texts.iter().map(|text| k(text)).collect()
}

/// The seed guide's catalog.
fn seed_catalog() -> Catalog {
    Catalog::new(
        talos_list(&["1.11.6", "1.12.0"]),
        kubernetes_list(&["1.34.1", "1.35.0"]),
    )
}

#[test]
fn seed_guide_example() {
    let catalog = seed_catalog();
    let talos = talos_available(&catalog, &t("1.11.6"), &t("1.11.6"), &[k("1.34.1")]);
    assert_eq!(talos, Some(t("1.12.0")));
    assert_eq!(
        upgrade_available_message(&t("1.11.6"), &t("1.12.0")),
        "Upgrade available: 1.11.6 → 1.12.0"
    );
    // Talos 1.11 stops at Kubernetes 1.34: nothing to offer until Talos is upgraded.
    assert_eq!(
        kubernetes_available(&catalog, &k("1.34.1"), &[t("1.11.6")]),
        None
    );
    assert_eq!(
        kubernetes_available(&catalog, &k("1.34.1"), &[t("1.12.0")]),
        Some(k("1.35.0"))
    );
    // One node left behind on 1.11 still blocks it.
    assert_eq!(
        kubernetes_available(
            &catalog,
            &k("1.34.1"),
            &[t("1.12.0"), t("1.11.6"), t("1.12.0")]
        ),
        None
    );
}

#[test]
fn talos_available_table() {
    let builtin = Catalog::builtin();
    let empty = Catalog::empty();
    let seed = seed_catalog();
    // (catalog, lowest, highest, running Kubernetes, expected)
    type Case<'a> = (
        &'a Catalog,
        &'a str,
        &'a str,
        Vec<KubernetesVersion>,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        // Already on the newest: nothing.
        (
            &seed,
            "1.12.0",
            "1.12.0",
            kubernetes_list(&["1.35.0"]),
            None,
        ),
        // Unknown Kubernetes: the support check is skipped, as the controller skips it.
        (&seed, "1.11.6", "1.11.6", vec![], Some("1.12.0")),
        // Talos 1.12 needs Kubernetes ≥ 1.30: a cluster on 1.29 gets nothing from the seed catalog.
        (
            &seed,
            "1.11.6",
            "1.11.6",
            kubernetes_list(&["1.29.3"]),
            None,
        ),
        // Mixed Kubernetes components: both ends must be supported.
        (
            &seed,
            "1.11.6",
            "1.11.6",
            kubernetes_list(&["1.29.3", "1.34.1"]),
            None,
        ),
        // Interrupted run: finishing it is the next step.
        (
            &seed,
            "1.11.6",
            "1.12.0",
            kubernetes_list(&["1.34.1"]),
            Some("1.12.0"),
        ),
        // Built-in: the newest line one installer step away (1.13 accepts hosts from 1.11.0).
        (
            &builtin,
            "1.11.6",
            "1.11.6",
            kubernetes_list(&["1.34.1"]),
            Some("1.13.9"),
        ),
        (
            &builtin,
            "1.11.0",
            "1.11.0",
            kubernetes_list(&["1.31.4"]),
            Some("1.13.9"),
        ),
        // 1.13 needs Kubernetes ≥ 1.31; on 1.30 the best is the newest 1.12.
        (
            &builtin,
            "1.11.6",
            "1.11.6",
            kubernetes_list(&["1.30.5"]),
            Some("1.12.11"),
        ),
        // A 1.9 host: 1.11 is the furthest one step reaches.
        (
            &builtin,
            "1.9.6",
            "1.9.6",
            kubernetes_list(&["1.32.4"]),
            Some("1.11.6"),
        ),
        // A 1.8 host: 1.9 and 1.10 accept it, not 1.11.
        (
            &builtin,
            "1.8.4",
            "1.8.4",
            kubernetes_list(&["1.31.4"]),
            Some("1.10.9"),
        ),
        // The next line's newest patch (Talos 1.14 accepts hosts from 1.12.0).
        (
            &builtin,
            "1.13.2",
            "1.13.2",
            kubernetes_list(&["1.36.0"]),
            Some("1.14.1"),
        ),
        // Only a newer patch is left.
        (
            &builtin,
            "1.14.0",
            "1.14.0",
            kubernetes_list(&["1.37.0"]),
            Some("1.14.1"),
        ),
        (
            &builtin,
            "1.14.1",
            "1.14.1",
            kubernetes_list(&["1.37.0"]),
            None,
        ),
        // A node beyond every catalog entry: nothing (anything would downgrade it).
        (
            &builtin,
            "1.13.0",
            "1.14.9",
            kubernetes_list(&["1.36.3"]),
            None,
        ),
        // Pre-release host counts as its release for the installer; the release itself is newer.
        (
            &builtin,
            "1.12.0-beta.1",
            "1.12.0-beta.1",
            kubernetes_list(&["1.34.1"]),
            Some("1.14.1"),
        ),
        // A host older than the tables still reaches the lines whose installers accept it
        // (1.7 and 1.8 accept hosts from 1.4.0 and 1.5.0).
        (
            &builtin,
            "1.5.0",
            "1.5.0",
            kubernetes_list(&["1.28.0"]),
            Some("1.8.4"),
        ),
        (&empty, "1.11.6", "1.11.6", vec![], None),
    ];
    for (catalog, lowest, highest, running, expected) in cases {
        assert_eq!(
            talos_available(catalog, &t(lowest), &t(highest), &running),
            expected.map(t),
            "lowest {lowest}, highest {highest}, Kubernetes {running:?}"
        );
    }
}

#[test]
fn kubernetes_available_table() {
    let builtin = Catalog::builtin();
    let seed = seed_catalog();
    // (catalog, current, Talos on the nodes, expected)
    let cases: Vec<(&Catalog, &str, Vec<TalosVersion>, Option<&str>)> = vec![
        (&seed, "1.35.0", talos_list(&["1.12.0"]), None),
        // No node known: support cannot be vouched for.
        (&seed, "1.34.1", vec![], None),
        // A newer patch of the same minor.
        (&seed, "1.34.0", talos_list(&["1.11.6"]), Some("1.34.1")),
        // Built-in: one minor at a time, newest patch of the next minor.
        (&builtin, "1.34.1", talos_list(&["1.12.11"]), Some("1.35.4")),
        (
            &builtin,
            "1.34.1",
            talos_list(&["1.13.9", "1.13.9"]),
            Some("1.35.4"),
        ),
        (&builtin, "1.33.0", talos_list(&["1.11.6"]), Some("1.34.1")),
        // Talos 1.11 tops out at 1.34: only the newer 1.34 patch.
        (&builtin, "1.34.0", talos_list(&["1.11.6"]), Some("1.34.1")),
        (&builtin, "1.34.1", talos_list(&["1.11.6"]), None),
        (&builtin, "1.36.3", talos_list(&["1.13.9"]), None),
        // Talos too old to be known supports nothing.
        (&builtin, "1.28.0", talos_list(&["1.6.0"]), None),
        // A cluster whose Kubernetes is below the catalog: 1.24 → 1.25.0 on Talos 1.7.
        (&builtin, "1.24.9", talos_list(&["1.7.7"]), Some("1.25.0")),
    ];
    for (catalog, current, talos, expected) in cases {
        assert_eq!(
            kubernetes_available(catalog, &k(current), &talos),
            expected.map(k),
            "current {current}, Talos {talos:?}"
        );
    }
}

/// The central promise: an advertised version is exactly a target the controller accepts, and it
/// is the newest such catalog entry; when nothing is advertised, no catalog entry would be accepted
/// as an upgrade.
#[test]
fn available_is_exactly_the_newest_accepted_target() {
    let catalog = Catalog::builtin().with_override(&CatalogOverride {
        replace: false,
        talos: Some(talos_list(&["1.14.0", "1.14.2", "1.15.1", "1.6.3"])),
        kubernetes: Some(kubernetes_list(&["1.24.2", "1.37.1", "1.38.0", "1.34.7"])),
    });
    let talos_hosts = talos_list(&[
        "1.6.0", "1.7.0", "1.7.7", "1.8.0", "1.8.4", "1.9.2", "1.10.0", "1.10.9", "1.11.0",
        "1.11.6", "1.12.0", "1.12.5", "1.13.0", "1.13.9", "1.14.0", "1.14.2", "1.15.1", "1.16.0",
        "2.0.0",
    ]);
    let kubernetes_running = kubernetes_list(&[
        "1.24.2", "1.25.0", "1.27.3", "1.29.0", "1.30.5", "1.31.0", "1.32.4", "1.33.6", "1.34.0",
        "1.34.1", "1.35.0", "1.35.4", "1.36.3", "1.37.1", "1.38.0",
    ]);
    let talos_accepts = |lowest: &TalosVersion,
                         highest: &TalosVersion,
                         running: &[KubernetesVersion],
                         c: &TalosVersion| {
        c > lowest
            && check_talos_upgrade_across(lowest, highest, c).is_ok()
            && running
                .iter()
                .all(|r| check_talos_target_supports(c, r).is_ok())
    };
    let mut checked = 0;
    for lowest in &talos_hosts {
        for highest in talos_hosts.iter().filter(|h| *h >= lowest) {
            for running in &kubernetes_running {
                for running_set in [vec![], vec![running.clone()]] {
                    let available = talos_available(&catalog, lowest, highest, &running_set);
                    let accepted: Vec<&TalosVersion> = catalog
                        .talos()
                        .filter(|c| talos_accepts(lowest, highest, &running_set, c))
                        .collect();
                    assert_eq!(
                        available.as_ref(),
                        accepted.last().copied(),
                        "Talos {lowest}..{highest}, Kubernetes {running_set:?}"
                    );
                    if let Some(target) = &available {
                        assert_eq!(
                            check_talos_upgrade_across(lowest, highest, target),
                            Ok(TalosStep::Upgrade)
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    for current in &kubernetes_running {
        for a in &talos_hosts {
            for b in &talos_hosts {
                let nodes = [a.clone(), b.clone()];
                let available = kubernetes_available(&catalog, current, &nodes);
                let accepted: Vec<&KubernetesVersion> = catalog
                    .kubernetes()
                    .filter(|c| {
                        matches!(
                            check_kubernetes_upgrade(current, c),
                            Ok(KubernetesStep::Patch | KubernetesStep::Minor)
                        ) && nodes
                            .iter()
                            .all(|talos| check_kubernetes_target_supported(talos, c).is_ok())
                    })
                    .collect();
                assert_eq!(
                    available.as_ref(),
                    accepted.last().copied(),
                    "Kubernetes {current}, Talos {nodes:?}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 5000, "only {checked} combinations checked");
}

#[test]
fn builtin_catalog_is_consistent_with_the_version_rules() {
    let catalog = Catalog::builtin();
    // Every built-in Talos release is one the controller upgrades to, and every Kubernetes release
    // is supported by at least one built-in Talos release.
    for talos in catalog.talos() {
        assert!(
            crate::versions::kubernetes_support(talos).is_some(),
            "{talos}"
        );
    }
    for kubernetes in catalog.kubernetes() {
        assert!(
            catalog
                .talos()
                .any(|talos| check_kubernetes_target_supported(talos, kubernetes).is_ok()),
            "{kubernetes}"
        );
    }
    // Each Talos line of the tables has its .0 and the newest known patch (talos-api.md).
    for (line, newest) in [(7, 7), (8, 4), (9, 6), (10, 9), (11, 6), (12, 11), (13, 9)] {
        assert!(catalog.talos().any(|v| *v == TalosVersion::new(1, line, 0)));
        assert!(
            catalog
                .talos()
                .any(|v| *v == TalosVersion::new(1, line, newest))
        );
    }
}

#[test]
fn kubernetes_available_across_mixed_components() {
    let builtin = Catalog::builtin();
    let on_113 = talos_list(&["1.13.9"]);
    // (lowest, highest, expected)
    for (lowest, highest, expected) in [
        ("1.34.1", "1.34.1", Some("1.35.4")),
        // Interrupted at 1.35.0: the newest 1.35 finishes it.
        ("1.34.1", "1.35.0", Some("1.35.4")),
        // A component already past every 1.35 in the catalog: nothing without a downgrade.
        ("1.34.1", "1.35.9", None),
        ("1.35.0", "1.35.4", Some("1.36.3")),
    ] {
        assert_eq!(
            kubernetes_available_across(&builtin, &k(lowest), &k(highest), &on_113),
            expected.map(k),
            "{lowest}..{highest}"
        );
    }
    // Every answer is one the controller accepts for that range.
    for lowest in kubernetes_list(&["1.30.5", "1.33.0", "1.34.1", "1.35.0"]) {
        for highest in kubernetes_list(&["1.34.1", "1.35.0", "1.35.4", "1.36.0"]) {
            if highest < lowest {
                continue;
            }
            if let Some(target) = kubernetes_available_across(&builtin, &lowest, &highest, &on_113)
            {
                assert!(
                    matches!(
                        crate::versions::check_kubernetes_upgrade_across(
                            &lowest, &highest, &target
                        ),
                        Ok(KubernetesStep::Patch | KubernetesStep::Minor)
                    ),
                    "{lowest}..{highest} → {target}"
                );
            }
        }
    }
}

#[test]
fn catalog_holds_releases_only() {
    let mut catalog = Catalog::empty();
    assert!(!catalog.insert_talos(t("1.13.0-alpha.1")));
    assert!(!catalog.insert_kubernetes(k("1.37.0-rc.0")));
    assert!(catalog.insert_talos(t("1.13.0")));
    assert_eq!(catalog.talos().collect::<Vec<_>>(), vec![&t("1.13.0")]);
    assert_eq!(catalog.kubernetes().count(), 0);
}

#[test]
fn override_merges_or_replaces_each_given_list() {
    let extra = CatalogOverride {
        replace: false,
        talos: Some(talos_list(&["1.14.1"])),
        kubernetes: None,
    };
    let merged = Catalog::builtin().with_override(&extra);
    assert!(merged.talos().any(|v| *v == t("1.14.1")));
    assert!(merged.talos().any(|v| *v == t("1.13.9")));
    assert_eq!(
        merged.kubernetes().collect::<Vec<_>>(),
        Catalog::builtin().kubernetes().collect::<Vec<_>>()
    );

    let replaced = Catalog::builtin().with_override(&CatalogOverride {
        replace: true,
        ..extra
    });
    assert_eq!(replaced.talos().collect::<Vec<_>>(), vec![&t("1.14.1")]);
    // The file left the Kubernetes list out: the built-in one stays.
    assert_eq!(
        replaced.kubernetes().count(),
        Catalog::builtin().kubernetes().count()
    );

    let seed = CatalogOverride::parse(
        "replace: true\ntalos: [1.11.6, 1.12.0]\nkubernetes: [1.34.1, 1.35.0]\n",
        "seed.yaml",
    )
    .expect("valid");
    assert_eq!(Catalog::builtin().with_override(&seed), seed_catalog());
}

#[test]
fn a_target_newer_than_every_known_release_is_unknown_unless_allowed() {
    let builtin = Catalog::builtin();
    let talos = |v: &str| TalosVersion::parse(v).expect("version");
    let known = || builtin.talos().cloned();
    assert_eq!(builtin.unknown("Talos", &talos("1.14.1"), known()), None);
    // Below the newest but not listed (an intermediate patch): not "newer than every release".
    assert_eq!(builtin.unknown("Talos", &talos("1.12.5"), known()), None);
    assert_eq!(
        builtin
            .unknown("Talos", &talos("1.15.0"), known())
            .as_deref(),
        Some(
            "Talos 1.15.0 is an unknown release; the newest known is 1.14.1. Set a known release, \
             add it to the release catalog (--release-catalog, or live sources), or start the \
             controller with --allow-unknown-releases"
        )
    );
    let allowed = Catalog::builtin().allowing_unknown(true);
    assert_eq!(
        allowed.unknown("Talos", &talos("1.15.0"), allowed.talos().cloned()),
        None
    );
    // An empty list knows nothing to compare with: nothing is called unknown.
    assert_eq!(
        Catalog::empty().unknown("Talos", &talos("1.15.0"), std::iter::empty()),
        None
    );
}
