//! Living beside another controller of the same annotations (vitistack's talos-operator reads and
//! writes every `upgrade.vitistack.io/*` key this controller does): whether this controller may act on
//! a cluster at all, decided before anything else in a reconcile.
//!
//! * `upgrade.vitistack.io/do-not-reconcile` (any non-empty value, as vitistack reads it) excludes the
//!   cluster: nothing is looked at or touched; the controller only says so, once.
//! * Another field manager holding one of the controller-written keys ([`CONTROLLER_KEYS`]) in
//!   `metadata.managedFields`, or an upgrade condition where the CRD keys conditions by type, is
//!   another controller driving the same upgrades: this one refuses to act, naming it and saying how
//!   to hand the cluster over. Managers of the user's own keys never count, nor do people's tools
//!   (`kubectl …` managers): a hand edit of a controller key is not a second controller, and the
//!   controller's next report takes the key back.
//!
//! The decision is over the annotations and the (manager, fields) pairs only; reading managedFields
//! from the object is the caller's.

use std::collections::BTreeMap;

use crate::annotations::{self, CONTROLLER_KEYS, UpgradeKind};

/// The field manager of every write this controller makes to a KubernetesCluster.
pub const FIELD_MANAGER: &str = "talos-upgrade-controller";

/// The managers that are this controller: [`FIELD_MANAGER`], and `unknown`, what the API server
/// records for a client that names no manager and sends no User-Agent, as the controller's writes did
/// before it named its manager (an object it wrote then still carries that entry).
pub const OWN_FIELD_MANAGERS: [&str; 2] = [FIELD_MANAGER, "unknown"];

/// The upgrade conditions, which only the upgrade controller writes.
pub const UPGRADE_CONDITIONS: [&str; 2] = ["TalosUpgrade", "KubernetesUpgrade"];

/// What one field manager holds of the object, as read from one `managedFields` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldWriter {
    pub manager: String,
    /// Annotation keys (`metadata.annotations`) the entry holds.
    pub annotations: Vec<String>,
    /// Condition types the entry holds, where the CRD declares `status.conditions` a list keyed by
    /// `type` (`k:{"type":"TalosUpgrade"}`). An atomic list (vitistack's CRD, the project's) says
    /// only who wrote the list last, which tells nothing about upgrades.
    pub conditions: Vec<String>,
}

/// Whether the controller may act on a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Standing {
    /// Nothing against it: the reconcile goes on.
    Act,
    /// `do-not-reconcile` is set: touch nothing.
    Excluded,
    /// Other controllers write the upgrade annotations or conditions: touch nothing.
    Contested(Contest),
}

/// Who else drives the cluster's upgrades, and with which fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contest {
    /// The other managers, sorted, each once.
    pub managers: Vec<String>,
    /// The controller-written annotation keys they hold, in [`CONTROLLER_KEYS`] order.
    pub keys: Vec<&'static str>,
    /// The upgrade conditions they hold.
    pub conditions: Vec<&'static str>,
}

/// Decides whether the controller may act on a cluster with `annotations`, whose managedFields hold
/// `writers`. Exclusion comes first: it is the user's explicit word, and it needs nothing else read.
pub fn standing(annotations: &BTreeMap<String, String>, writers: &[FieldWriter]) -> Standing {
    if excluded(annotations) {
        return Standing::Excluded;
    }
    let others: Vec<&FieldWriter> = writers
        .iter()
        .filter(|writer| !is_own_or_a_person(&writer.manager))
        .filter(|writer| {
            writer.annotations.iter().any(|key| is_controller_key(key))
                || writer
                    .conditions
                    .iter()
                    .any(|kind| UPGRADE_CONDITIONS.contains(&kind.as_str()))
        })
        .collect();
    if others.is_empty() {
        return Standing::Act;
    }
    let mut managers: Vec<String> = others.iter().map(|w| w.manager.clone()).collect();
    managers.sort();
    managers.dedup();
    let held = |key: &str| {
        others
            .iter()
            .any(|w| w.annotations.iter().any(|k| k == key))
    };
    let keys = CONTROLLER_KEYS
        .into_iter()
        .filter(|key| held(key))
        .collect();
    let conditions = UPGRADE_CONDITIONS
        .into_iter()
        .filter(|kind| {
            others
                .iter()
                .any(|w| w.conditions.iter().any(|c| c == kind))
        })
        .collect();
    Standing::Contested(Contest {
        managers,
        keys,
        conditions,
    })
}

/// `do-not-reconcile` holds a non-empty value (as [`crate::intent::UpgradeIntent`] reads it).
pub fn excluded(annotations: &BTreeMap<String, String>) -> bool {
    annotations
        .get(annotations::DO_NOT_RECONCILE)
        .is_some_and(|value| !value.is_empty())
}

fn is_controller_key(key: &str) -> bool {
    CONTROLLER_KEYS.contains(&key)
}

/// This controller, or a person's tool: `kubectl annotate`, `kubectl edit`, `kubectl patch`,
/// client-side apply (`kubectl-annotate`, `kubectl-edit`, `kubectl-patch`,
/// `kubectl-client-side-apply`, `kubectl`).
fn is_own_or_a_person(manager: &str) -> bool {
    OWN_FIELD_MANAGERS.contains(&manager) || manager == "kubectl" || manager.starts_with("kubectl-")
}

/// The sentence of `*-message` while excluded.
pub const EXCLUDED_MESSAGE: &str = "Excluded: upgrade.vitistack.io/do-not-reconcile is set; the controller touches nothing on this cluster until it is removed";

/// The sentence of `*-message` (and of the Warning Event) while contested, for the cluster `name` in
/// `namespace`: who else writes, what, and how to hand the cluster over either way.
pub fn contested_message(contest: &Contest, namespace: &str, name: &str) -> String {
    let managers = contest
        .managers
        .iter()
        .map(|m| format!("{m:?}"))
        .collect::<Vec<_>>()
        .join(" and ");
    let mut fields: Vec<String> = contest.keys.iter().map(|k| k.to_string()).collect();
    fields.extend(contest.conditions.iter().map(|c| format!("condition {c}")));
    let removal = if contest.keys.is_empty() {
        format!(
            "remove its {} condition(s) from status.conditions",
            contest.conditions.join(", ")
        )
    } else {
        let keys = contest
            .keys
            .iter()
            .map(|k| format!("{k}-"))
            .collect::<Vec<_>>()
            .join(" ");
        format!(
            "remove the annotations it wrote (kubectl -n {namespace} annotate kubernetescluster {name} {keys})"
        )
    };
    format!(
        "Not acting: the upgrade fields of this cluster ({}) are also written by {managers}; only one controller may drive its upgrades. To hand the cluster over to talos-upgrade-controller, stop {managers} from upgrading it, then {removal}; to leave it to {managers}, do nothing: this controller touches no node while they write",
        fields.join(", ")
    )
}

/// The `*-message` keys the controller writes while it does not act: both, unless the only evidence of
/// the other controller is in a message key, which writing it over would erase (the API server moves a
/// changed field to its last writer), so that the next reconcile would act. Those keep the other's
/// sentence; the Warning Event says it.
pub fn message_keys(standing: &Standing) -> Vec<&'static str> {
    let all: Vec<&'static str> = UpgradeKind::ALL.iter().map(|k| k.message_key()).collect();
    match standing {
        Standing::Act => Vec::new(),
        Standing::Excluded => all,
        Standing::Contested(contest) => {
            let survives =
                !contest.conditions.is_empty() || contest.keys.iter().any(|key| !all.contains(key));
            if survives {
                all
            } else {
                all.into_iter()
                    .filter(|key| !contest.keys.contains(key))
                    .collect()
            }
        }
    }
}

/// The annotations to write so that `keys` say `message`: `None` when they already do (the message is
/// written, and its Event sent, once; a restarted controller finds it there).
pub fn message_patch(
    annotations: &BTreeMap<String, String>,
    keys: &[&'static str],
    message: &str,
) -> Option<BTreeMap<&'static str, String>> {
    let stale: BTreeMap<&'static str, String> = keys
        .iter()
        .filter(|key| annotations.get(**key).map(String::as_str) != Some(message))
        .map(|key| (*key, message.to_string()))
        .collect();
    (!stale.is_empty()).then_some(stale)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::annotations::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn writer(manager: &str, keys: &[&str], conditions: &[&str]) -> FieldWriter {
        FieldWriter {
            manager: manager.to_string(),
            annotations: keys.iter().map(|k| k.to_string()).collect(),
            conditions: conditions.iter().map(|c| c.to_string()).collect(),
        }
    }

    fn contested(
        managers: &[&str],
        keys: &[&'static str],
        conditions: &[&'static str],
    ) -> Standing {
        Standing::Contested(Contest {
            managers: managers.iter().map(|m| m.to_string()).collect(),
            keys: keys.to_vec(),
            conditions: conditions.to_vec(),
        })
    }

    /// (what, annotations, writers, expected standing)
    type Case<'a> = (
        &'a str,
        &'a [(&'a str, &'a str)],
        Vec<FieldWriter>,
        Standing,
    );

    #[test]
    fn standings() {
        let excluded = [(DO_NOT_RECONCILE, "true")];
        let cases: Vec<Case> = vec![
            ("nothing written", &[], vec![], Standing::Act),
            (
                "only this controller",
                &[],
                vec![writer(FIELD_MANAGER, &CONTROLLER_KEYS, &UPGRADE_CONDITIONS)],
                Standing::Act,
            ),
            (
                "this controller before it named its manager",
                &[],
                vec![writer("unknown", &[TALOS_STATUS, TALOS_MESSAGE], &[])],
                Standing::Act,
            ),
            (
                "people write the user keys",
                &[],
                vec![
                    writer("kubectl-annotate", &[TALOS_TARGET, PAUSED], &[]),
                    writer("kubectl-edit", &[KUBERNETES_TARGET], &[]),
                    writer("argocd-controller", &[TALOS_TARGET, DO_NOT_RECONCILE], &[]),
                    writer("manager", &["example.com/owner"], &["Valid"]),
                ],
                Standing::Act,
            ),
            (
                "a person's hand edit of a controller key",
                &[],
                vec![
                    writer("kubectl-annotate", &[TALOS_STATUS], &[]),
                    writer("kubectl-client-side-apply", &[TALOS_CURRENT], &[]),
                    writer("kubectl", &[TALOS_MESSAGE], &[]),
                ],
                Standing::Act,
            ),
            (
                "another controller writes the status",
                &[],
                vec![
                    writer(FIELD_MANAGER, &[TALOS_MESSAGE], &[]),
                    writer("talos-operator", &[TALOS_TARGET, TALOS_STATUS], &[]),
                ],
                contested(&["talos-operator"], &[TALOS_STATUS], &[]),
            ),
            (
                "two others, keys in table order, each manager once",
                &[],
                vec![
                    writer("manager", &[KUBERNETES_PROGRESS, TALOS_CURRENT], &[]),
                    writer("talos-operator", &[FAILED_NODES], &[]),
                    writer("manager", &[TALOS_AVAILABLE], &[]),
                ],
                contested(
                    &["manager", "talos-operator"],
                    &[
                        TALOS_CURRENT,
                        TALOS_AVAILABLE,
                        KUBERNETES_PROGRESS,
                        FAILED_NODES,
                    ],
                    &[],
                ),
            ),
            (
                "an upgrade condition keyed by type",
                &[],
                vec![writer("manager", &[], &["Valid", "KubernetesUpgrade"])],
                contested(&["manager"], &[], &["KubernetesUpgrade"]),
            ),
            (
                "excluded comes first",
                &excluded,
                vec![writer("talos-operator", &[TALOS_STATUS], &[])],
                Standing::Excluded,
            ),
            (
                "excluded by any non-empty value",
                &[(DO_NOT_RECONCILE, "false")],
                vec![],
                Standing::Excluded,
            ),
            (
                "an empty value excludes nothing",
                &[(DO_NOT_RECONCILE, "")],
                vec![],
                Standing::Act,
            ),
        ];
        for (what, annotations, writers, expected) in cases {
            assert_eq!(standing(&map(annotations), &writers), expected, "{what}");
        }
    }

    #[test]
    fn the_contested_message_names_the_manager_and_the_hand_over() {
        let Standing::Contested(contest) = standing(
            &map(&[]),
            &[writer(
                "talos-operator",
                &[TALOS_CURRENT, TALOS_STATUS],
                &[],
            )],
        ) else {
            panic!("contested");
        };
        assert_eq!(
            contested_message(&contest, "team-a", "prod"),
            "Not acting: the upgrade fields of this cluster (upgrade.vitistack.io/talos-current, \
             upgrade.vitistack.io/talos-status) are also written by \"talos-operator\"; only one \
             controller may drive its upgrades. To hand the cluster over to talos-upgrade-controller, \
             stop \"talos-operator\" from upgrading it, then remove the annotations it wrote \
             (kubectl -n team-a annotate kubernetescluster prod upgrade.vitistack.io/talos-current- \
             upgrade.vitistack.io/talos-status-); to leave it to \"talos-operator\", do nothing: this \
             controller touches no node while they write"
        );
        let conditions_only = Contest {
            managers: vec!["a".into(), "b".into()],
            keys: vec![],
            conditions: vec!["TalosUpgrade"],
        };
        let message = contested_message(&conditions_only, "ns", "c");
        assert!(message.contains("(condition TalosUpgrade)"), "{message}");
        assert!(message.contains("written by \"a\" and \"b\""), "{message}");
        assert!(
            message.contains("remove its TalosUpgrade condition(s) from status.conditions"),
            "{message}"
        );
    }

    #[test]
    fn message_keys_never_erase_the_evidence() {
        let both = vec![TALOS_MESSAGE, KUBERNETES_MESSAGE];
        let cases: Vec<(&str, Standing, Vec<&str>)> = vec![
            ("acting: nothing", Standing::Act, vec![]),
            ("excluded: both", Standing::Excluded, both.clone()),
            (
                "evidence beyond the messages",
                contested(&["x"], &[TALOS_STATUS, TALOS_MESSAGE], &[]),
                both.clone(),
            ),
            (
                "a condition is evidence enough",
                contested(&["x"], &[TALOS_MESSAGE], &["TalosUpgrade"]),
                both.clone(),
            ),
            (
                "only the Talos message: keep it",
                contested(&["x"], &[TALOS_MESSAGE], &[]),
                vec![KUBERNETES_MESSAGE],
            ),
            (
                "only messages: write none",
                contested(&["x"], &[TALOS_MESSAGE, KUBERNETES_MESSAGE], &[]),
                vec![],
            ),
        ];
        for (what, standing, expected) in cases {
            assert_eq!(message_keys(&standing), expected, "{what}");
        }
    }

    #[test]
    fn the_message_is_written_once() {
        let keys = [TALOS_MESSAGE, KUBERNETES_MESSAGE];
        let fresh = message_patch(&map(&[(TALOS_MESSAGE, "Upgrade available")]), &keys, "M");
        assert_eq!(
            fresh,
            Some(BTreeMap::from([
                (TALOS_MESSAGE, "M".to_string()),
                (KUBERNETES_MESSAGE, "M".to_string())
            ]))
        );
        let half = message_patch(&map(&[(TALOS_MESSAGE, "M")]), &keys, "M");
        assert_eq!(
            half,
            Some(BTreeMap::from([(KUBERNETES_MESSAGE, "M".to_string())]))
        );
        let done = map(&[(TALOS_MESSAGE, "M"), (KUBERNETES_MESSAGE, "M")]);
        assert_eq!(message_patch(&done, &keys, "M"), None);
        assert_eq!(message_patch(&done, &[], "other"), None);
    }
}
