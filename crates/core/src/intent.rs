//! What the annotations on a `KubernetesCluster` ask for ([`UpgradeIntent`], the user-written keys), as
//! types.
//!
//! Reading rules, the same for every key (design/protocol.md leaves them open; user documentation of
//! the annotations must state them):
//!
//! * Values are trimmed; an empty or all-blank value counts as absent. `kubectl annotate k=` is the
//!   easiest way to leave an empty value behind, and nobody means "upgrade to the empty version" by it.
//! * Keywords (`true`, `false`, `workers-first`, `control-planes-first`) are matched ASCII
//!   case-insensitively: `True` has one obvious meaning, refusing it would only cost the user a retry.
//! * A value that does not fit its key is never silently replaced by a default: it becomes an
//!   [`InvalidOption`] naming the annotation and the accepted values, for the controller to report.
//!   Where a reading is still needed, the safe one is taken: an unrecognised `paused` holds the
//!   upgrade (holding is reversible, proceeding is not), an unrecognised `resume` or reset does nothing
//!   (both act once and cannot be taken back).
//! * An invalid target is not an option error: it is the protocol's "invalid target" (status `failed`
//!   with the reason), so it is kept as [`Target::Invalid`].

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use crate::alert_gate::AlertGate;
use crate::annotations::{self, UpgradeKind};
use crate::health_checks::HealthChecks;
use crate::holds::{self, MaintenanceWindows};
use crate::plan::PlanMode;
pub use crate::run::UpgradeOrder;
use crate::silences::SilenceMode;
use crate::talos::installer::{self, InstallerOverride};
use crate::versions::{KubernetesVersion, TalosVersion, VersionParseError};

/// A `*-target` annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target<V> {
    /// No target (missing or empty): nothing to upgrade, and an upgrade in progress stops after the
    /// node(s) in flight.
    Absent,
    /// Not a version; the upgrade fails once with `reason` and waits for the value to change.
    Invalid {
        /// The annotation value as written (untrimmed), so "did the value change?" compares what the
        /// user actually wrote.
        raw: String,
        reason: VersionParseError,
    },
    /// A well-formed version (not yet checked against the cluster, see [`crate::versions`]).
    Version(V),
}

impl<V> Target<V> {
    pub fn version(&self) -> Option<&V> {
        match self {
            Target::Version(version) => Some(version),
            Target::Absent | Target::Invalid { .. } => None,
        }
    }

    pub fn is_absent(&self) -> bool {
        match self {
            Target::Absent => true,
            Target::Invalid { .. } | Target::Version(_) => false,
        }
    }
}

/// A user-written annotation whose value does not fit it. `Display` is one sentence for an Event or
/// the `*-message` annotation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Annotation {key} has the invalid value {value:?}: {reason}")]
pub struct InvalidOption {
    /// The full annotation key.
    pub key: &'static str,
    /// The value as written.
    pub value: String,
    /// What would be accepted.
    pub reason: String,
}

const BOOL_REASON: &str = "use \"true\" or \"false\"";
const ORDER_REASON: &str = "use workers-first (the default) or control-planes-first";
const PARALLEL_REASON: &str = "use a whole number of 1 or more (the default is 1)";
const SCHEMATIC_REASON: &str = "use an Image Factory schematic id: 64 lowercase hexadecimal digits";
const SECRET_REASON: &str = "use a Secret name: at most 253 lowercase letters, digits, '-' and '.', starting and ending with a letter or digit";

/// The user-written annotations, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeIntent {
    pub talos_target: Target<TalosVersion>,
    pub kubernetes_target: Target<KubernetesVersion>,
    /// `resume: "true"`: retry the failed upgrade from the node that failed.
    pub resume: bool,
    /// `talos-reset-upgrade-state: "true"`.
    pub talos_reset: bool,
    /// `kubernetes-reset-upgrade-state: "true"`.
    pub kubernetes_reset: bool,
    /// `paused`; also true for an unrecognised value (see the module documentation).
    pub paused: bool,
    /// `upgrade-order`; an `Err` has no usable order, so no Talos run should start until it is fixed.
    pub order: Result<UpgradeOrder, InvalidOption>,
    /// `max-parallel-workers`; an `Err` has no usable batch size, as for `order`.
    pub max_parallel_workers: Result<NonZeroU32, InvalidOption>,
    /// `credentials-secret`: `Ok(None)` means "use the configured name template".
    pub credentials_secret: Result<Option<String>, InvalidOption>,
    /// `talos-installer-image` or `talos-schematic`: `Ok(None)` means "derive each node's installer from
    /// its own"; both at once is an error (which would win is not obvious).
    pub installer: Result<Option<InstallerOverride>, InvalidOption>,
    /// `alert-gate`: `Ok(None)` means "the operator's alert selector, if Prometheus is configured"; an
    /// `Err` names the accepted forms, and no Talos run starts until it is fixed (a gate the user meant
    /// to narrow or widen must not silently fall back to another).
    pub alert_gate: Result<Option<AlertGate>, InvalidOption>,
    /// `health-checks`: `Ok(None)` is none. An `Err` names the check and its problem, and no Talos run
    /// starts until it is fixed (a check the user wrote must not silently pass).
    pub health_checks: Result<Option<HealthChecks>, InvalidOption>,
    /// `alert-silences`: `Ok(None)` means the default (`node` when Alertmanager is configured); an
    /// `Err` names the accepted modes, and no Talos run starts until it is fixed.
    pub alert_silences: Result<Option<SilenceMode>, InvalidOption>,
    /// `maintenance-window` (or, when absent, the operator's default: see
    /// [`UpgradeIntent::with_default_window`]): `Ok(None)` is no window. An `Err` keeps the Talos run
    /// from starting nodes until it is fixed (a window the user meant must not become none).
    pub maintenance_window: Result<Option<MaintenanceWindows>, InvalidOption>,
    /// `force-start: "true"`: the Talos run starts now and goes on outside the windows (one-shot).
    pub force_start: bool,
    /// `talos-rollback`: roll the last Talos run's nodes back (one-shot, consumed when accepted).
    /// `None` when absent or blank; an `Err` refuses the rollback (no run is held by it).
    pub talos_rollback: Option<Result<crate::talos::rollback::RollbackRequest, InvalidOption>>,
    /// `soak-after-node`, `soak-after-control-planes`: `Ok(None)` is no soak.
    pub soak_after_node: Result<Option<Duration>, InvalidOption>,
    pub soak_after_control_planes: Result<Option<Duration>, InvalidOption>,
    /// `pause-after-nodes`: the canary; `Ok(None)` is none.
    pub pause_after_nodes: Result<Option<NonZeroU32>, InvalidOption>,
    /// `do-not-reconcile` holds a non-empty value (any value, even `"false"`, as vitistack's
    /// talos-operator reads it): the controller touches nothing on the cluster.
    pub do_not_reconcile: bool,
    /// `upgrade-plan`: whether a target that needs several steps becomes a plan. An `Err` names the
    /// accepted values, and the one-step rules apply until it is fixed (refusing a far target is
    /// reversible, a plan the user did not ask for is not).
    pub upgrade_plan: Result<PlanMode, InvalidOption>,
    /// `plan-preview: "true"`: show the plan, touch nothing.
    pub plan_preview: bool,
    /// `etcd-snapshot`: `Ok(None)` means the default (`talos` when the controller has a snapshot
    /// destination; `talos-and-kubernetes` adds one before a Kubernetes run's first control plane);
    /// an `Err` names the accepted modes, and no run starts until it is fixed (a snapshot the user
    /// asked for must not silently become none).
    pub etcd_snapshot: Result<Option<crate::etcd_snapshot::SnapshotMode>, InvalidOption>,
    /// Unrecognised values of the flag annotations (`resume`, the resets, `paused`), whose fields above
    /// hold the safe reading.
    pub invalid_flags: Vec<InvalidOption>,
}

impl UpgradeIntent {
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> UpgradeIntent {
        let mut invalid_flags = Vec::new();
        let mut flag = |key: &'static str, on_invalid: bool| match read_flag(annotations, key) {
            Ok(value) => value,
            Err(invalid) => {
                invalid_flags.push(invalid);
                on_invalid
            }
        };
        // Flags read in key-table order, so reports come out in a stable order.
        let resume = flag(annotations::RESUME, false);
        let talos_reset = flag(annotations::TALOS_RESET_UPGRADE_STATE, false);
        let kubernetes_reset = flag(annotations::KUBERNETES_RESET_UPGRADE_STATE, false);
        let paused = flag(annotations::PAUSED, true);
        let force_start = flag(annotations::FORCE_START, false);
        let plan_preview = flag(annotations::PLAN_PREVIEW, false);
        UpgradeIntent {
            talos_target: read_target(annotations, annotations::TALOS_TARGET, TalosVersion::parse),
            kubernetes_target: read_target(
                annotations,
                annotations::KUBERNETES_TARGET,
                KubernetesVersion::parse,
            ),
            resume,
            talos_reset,
            kubernetes_reset,
            paused,
            order: read_order(annotations),
            max_parallel_workers: read_max_parallel_workers(annotations),
            credentials_secret: read_credentials_secret(annotations),
            installer: read_installer(annotations),
            alert_gate: read_alert_gate(annotations),
            health_checks: read_health_checks(annotations),
            alert_silences: read_alert_silences(annotations),
            maintenance_window: read_maintenance_window(annotations),
            force_start,
            talos_rollback: value(annotations, annotations::TALOS_ROLLBACK).map(|text| {
                crate::talos::rollback::RollbackRequest::parse(text)
                    .map_err(|reason| invalid(annotations, annotations::TALOS_ROLLBACK, &reason))
            }),
            soak_after_node: read_duration(annotations, annotations::SOAK_AFTER_NODE),
            soak_after_control_planes: read_duration(
                annotations,
                annotations::SOAK_AFTER_CONTROL_PLANES,
            ),
            pause_after_nodes: read_pause_after_nodes(annotations),
            do_not_reconcile: annotations
                .get(annotations::DO_NOT_RECONCILE)
                .is_some_and(|value| !value.is_empty()),
            upgrade_plan: read_upgrade_plan(annotations),
            plan_preview,
            etcd_snapshot: read_etcd_snapshot(annotations),
            invalid_flags,
        }
    }

    /// The operator's default maintenance window (`--maintenance-window`), for a cluster without the
    /// annotation; `always` on the cluster opts out of it.
    pub fn with_default_window(mut self, default: Option<&MaintenanceWindows>) -> UpgradeIntent {
        if let Ok(window @ None) = &mut self.maintenance_window {
            *window = default.cloned();
        }
        self
    }

    /// The reset flag of `kind`.
    pub fn reset(&self, kind: UpgradeKind) -> bool {
        match kind {
            UpgradeKind::Talos => self.talos_reset,
            UpgradeKind::Kubernetes => self.kubernetes_reset,
        }
    }

    /// Whether `kind` has a target annotation (valid or not).
    pub fn has_target(&self, kind: UpgradeKind) -> bool {
        match kind {
            UpgradeKind::Talos => !self.talos_target.is_absent(),
            UpgradeKind::Kubernetes => !self.kubernetes_target.is_absent(),
        }
    }

    /// Every invalid option value, in annotation-table order, for the controller to report.
    pub fn invalid_options(&self) -> Vec<&InvalidOption> {
        let mut all: Vec<&InvalidOption> = self.invalid_flags.iter().collect();
        all.extend(self.order.as_ref().err());
        all.extend(self.max_parallel_workers.as_ref().err());
        all.extend(self.credentials_secret.as_ref().err());
        all.extend(self.installer.as_ref().err());
        all.extend(self.alert_gate.as_ref().err());
        all.extend(self.health_checks.as_ref().err());
        all.extend(self.alert_silences.as_ref().err());
        all.extend(self.maintenance_window.as_ref().err());
        all.extend(self.soak_after_node.as_ref().err());
        all.extend(self.soak_after_control_planes.as_ref().err());
        all.extend(self.pause_after_nodes.as_ref().err());
        all.extend(self.upgrade_plan.as_ref().err());
        all.extend(self.etcd_snapshot.as_ref().err());
        all
    }
}

fn read_upgrade_plan(annotations: &BTreeMap<String, String>) -> Result<PlanMode, InvalidOption> {
    match value(annotations, annotations::UPGRADE_PLAN) {
        None => Ok(PlanMode::default()),
        Some(text) => PlanMode::parse(text)
            .ok_or_else(|| invalid(annotations, annotations::UPGRADE_PLAN, PlanMode::REASON)),
    }
}

fn read_maintenance_window(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<MaintenanceWindows>, InvalidOption> {
    let Some(text) = value(annotations, annotations::MAINTENANCE_WINDOW) else {
        return Ok(None);
    };
    MaintenanceWindows::parse(text)
        .map(Some)
        .map_err(|reason| invalid(annotations, annotations::MAINTENANCE_WINDOW, &reason))
}

fn read_duration(
    annotations: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<Option<Duration>, InvalidOption> {
    let Some(text) = value(annotations, key) else {
        return Ok(None);
    };
    holds::parse_duration(text)
        .map(Some)
        .ok_or_else(|| invalid(annotations, key, holds::DURATION_SYNTAX))
}

fn read_pause_after_nodes(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<NonZeroU32>, InvalidOption> {
    let Some(text) = value(annotations, annotations::PAUSE_AFTER_NODES) else {
        return Ok(None);
    };
    text.parse::<NonZeroU32>().map(Some).map_err(|_| {
        invalid(
            annotations,
            annotations::PAUSE_AFTER_NODES,
            "use a whole number of 1 or more: the nodes the run upgrades before it pauses once",
        )
    })
}

fn read_alert_gate(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<AlertGate>, InvalidOption> {
    let Some(text) = value(annotations, annotations::ALERT_GATE) else {
        return Ok(None);
    };
    AlertGate::parse(text)
        .map(Some)
        .map_err(|reason| invalid(annotations, annotations::ALERT_GATE, &reason))
}

fn read_etcd_snapshot(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<crate::etcd_snapshot::SnapshotMode>, InvalidOption> {
    let Some(text) = value(annotations, annotations::ETCD_SNAPSHOT) else {
        return Ok(None);
    };
    crate::etcd_snapshot::SnapshotMode::parse(text)
        .map(Some)
        .map_err(|reason| invalid(annotations, annotations::ETCD_SNAPSHOT, &reason))
}

fn read_alert_silences(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<SilenceMode>, InvalidOption> {
    let Some(text) = value(annotations, annotations::ALERT_SILENCES) else {
        return Ok(None);
    };
    SilenceMode::parse(text)
        .map(Some)
        .map_err(|reason| invalid(annotations, annotations::ALERT_SILENCES, &reason))
}

/// A multi-line list of checks would make the whole value the message: a long one is shown cut, the
/// reason names the check anyway.
fn read_health_checks(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<HealthChecks>, InvalidOption> {
    let Some(text) = value(annotations, annotations::HEALTH_CHECKS) else {
        return Ok(None);
    };
    HealthChecks::parse(text).map_err(|reason| {
        let mut invalid = invalid(annotations, annotations::HEALTH_CHECKS, &reason);
        if let Some((at, _)) = invalid.value.char_indices().nth(80) {
            invalid.value = format!("{}…", &invalid.value[..at]);
        }
        invalid
    })
}

/// The trimmed value of `key`; `None` when missing or blank. The plan and its preview read the
/// targets through it too, so a blank one means the same everywhere.
pub(crate) fn value<'a>(annotations: &'a BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    annotations
        .get(key)
        .map(|raw| raw.trim())
        .filter(|value| !value.is_empty())
}

fn invalid(
    annotations: &BTreeMap<String, String>,
    key: &'static str,
    reason: &str,
) -> InvalidOption {
    InvalidOption {
        key,
        value: annotations.get(key).cloned().unwrap_or_default(),
        reason: reason.to_string(),
    }
}

fn read_target<V>(
    annotations: &BTreeMap<String, String>,
    key: &str,
    parse: fn(&str) -> Result<V, VersionParseError>,
) -> Target<V> {
    let Some(text) = value(annotations, key) else {
        return Target::Absent;
    };
    match parse(text) {
        Ok(version) => Target::Version(version),
        Err(reason) => Target::Invalid {
            raw: annotations.get(key).cloned().unwrap_or_default(),
            reason,
        },
    }
}

fn read_flag(
    annotations: &BTreeMap<String, String>,
    key: &'static str,
) -> Result<bool, InvalidOption> {
    match value(annotations, key) {
        None => Ok(false),
        Some(text) if text.eq_ignore_ascii_case("true") => Ok(true),
        Some(text) if text.eq_ignore_ascii_case("false") => Ok(false),
        Some(_) => Err(invalid(annotations, key, BOOL_REASON)),
    }
}

fn read_order(annotations: &BTreeMap<String, String>) -> Result<UpgradeOrder, InvalidOption> {
    match value(annotations, annotations::UPGRADE_ORDER) {
        None => Ok(UpgradeOrder::default()),
        Some(text) => UpgradeOrder::parse(text)
            .ok_or_else(|| invalid(annotations, annotations::UPGRADE_ORDER, ORDER_REASON)),
    }
}

fn read_max_parallel_workers(
    annotations: &BTreeMap<String, String>,
) -> Result<NonZeroU32, InvalidOption> {
    let Some(text) = value(annotations, annotations::MAX_PARALLEL_WORKERS) else {
        return Ok(NonZeroU32::MIN);
    };
    // Digits only: `u32::from_str` would also take `+3`, which is not what the table documents.
    text.bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| text.parse::<NonZeroU32>().ok())
        .flatten()
        .ok_or_else(|| {
            invalid(
                annotations,
                annotations::MAX_PARALLEL_WORKERS,
                PARALLEL_REASON,
            )
        })
}

fn read_credentials_secret(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<String>, InvalidOption> {
    let Some(text) = value(annotations, annotations::CREDENTIALS_SECRET) else {
        return Ok(None);
    };
    // Checked here so a typo is reported as such, instead of as a Secret that cannot be found.
    if is_dns_subdomain(text) {
        Ok(Some(text.to_string()))
    } else {
        Err(invalid(
            annotations,
            annotations::CREDENTIALS_SECRET,
            SECRET_REASON,
        ))
    }
}

fn read_installer(
    annotations: &BTreeMap<String, String>,
) -> Result<Option<InstallerOverride>, InvalidOption> {
    let repository = value(annotations, annotations::TALOS_INSTALLER_IMAGE);
    let schematic = value(annotations, annotations::TALOS_SCHEMATIC);
    match (repository, schematic) {
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(invalid(
            annotations,
            annotations::TALOS_SCHEMATIC,
            "set either talos-installer-image or talos-schematic, not both",
        )),
        (Some(text), None) => installer::parse_installer_repository(text)
            .map(|repository| Some(InstallerOverride::Repository(repository)))
            .map_err(|reason| invalid(annotations, annotations::TALOS_INSTALLER_IMAGE, reason)),
        (None, Some(text)) if installer::is_schematic_id(text) => {
            Ok(Some(InstallerOverride::Schematic(text.to_string())))
        }
        (None, Some(_)) => Err(invalid(
            annotations,
            annotations::TALOS_SCHEMATIC,
            SCHEMATIC_REASON,
        )),
    }
}

/// RFC 1123 subdomain, the rule for Secret names.
fn is_dns_subdomain(name: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    name.len() <= 253
        && name.bytes().next().is_some_and(alnum)
        && name.bytes().last().is_some_and(alnum)
        && name.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
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

    fn intent(pairs: &[(&str, &str)]) -> UpgradeIntent {
        UpgradeIntent::from_annotations(&map(pairs))
    }

    /// Expected reading of a target value: `Ok(display)` for a version, `Err(message)` for invalid.
    type Expect = Option<Result<&'static str, &'static str>>;

    #[test]
    fn targets() {
        let cases: [(Option<&str>, Expect); 14] = [
            (None, None),
            (Some(""), None),
            (Some("   "), None),
            (Some("1.12.0"), Some(Ok("1.12.0"))),
            (Some("v1.12.0"), Some(Ok("1.12.0"))),
            (Some(" v1.12.0 "), Some(Ok("1.12.0"))),
            (Some("1.12.0\n"), Some(Ok("1.12.0"))),
            (Some("1.13.0-beta.1"), Some(Ok("1.13.0-beta.1"))),
            (
                Some("1.12"),
                Some(Err(
                    r#""1.12" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                )),
            ),
            (
                Some(" v1.12 "),
                Some(Err(
                    r#""v1.12" is not a version: use MAJOR.MINOR.PATCH, e.g. 1.12.0"#,
                )),
            ),
            (Some("latest"), Some(Err(""))),
            (Some("1.12.x"), Some(Err(""))),
            (Some("1.12.0+x"), Some(Err(""))),
            (Some("v"), Some(Err(""))),
        ];
        for kind in UpgradeKind::ALL {
            for (raw, expected) in cases {
                let pairs: Vec<(&str, &str)> = raw
                    .map(|raw| (kind.target_key(), raw))
                    .into_iter()
                    .collect();
                let intent = intent(&pairs);
                let (display, invalid) = match kind {
                    UpgradeKind::Talos => describe(&intent.talos_target),
                    UpgradeKind::Kubernetes => describe(&intent.kubernetes_target),
                };
                // The other kind is untouched.
                let other_absent = match kind {
                    UpgradeKind::Talos => intent.kubernetes_target.is_absent(),
                    UpgradeKind::Kubernetes => intent.talos_target.is_absent(),
                };
                assert!(other_absent, "{kind} {raw:?}");
                assert_eq!(
                    intent.has_target(kind),
                    expected.is_some(),
                    "{kind} {raw:?}"
                );
                match expected {
                    None => assert_eq!((display, invalid), (None, None), "{kind} {raw:?}"),
                    Some(Ok(version)) => {
                        assert_eq!(display.as_deref(), Some(version), "{kind} {raw:?}");
                        assert_eq!(invalid, None, "{kind} {raw:?}");
                    }
                    Some(Err(message)) => {
                        let (invalid_raw, reason) = invalid.expect("invalid target");
                        assert_eq!(Some(invalid_raw.as_str()), raw, "raw kept as written");
                        if !message.is_empty() {
                            assert_eq!(reason, message, "{kind} {raw:?}");
                        }
                        assert_eq!(display, None);
                    }
                }
            }
        }
    }

    /// (version display, (raw, reason)) of a target.
    fn describe<V: std::fmt::Display>(
        target: &Target<V>,
    ) -> (Option<String>, Option<(String, String)>) {
        match target {
            Target::Absent => (None, None),
            Target::Invalid { raw, reason } => (None, Some((raw.clone(), reason.to_string()))),
            Target::Version(version) => (Some(version.to_string()), None),
        }
    }

    #[test]
    fn both_targets_at_once() {
        let intent = intent(&[(TALOS_TARGET, "v1.12.0"), (KUBERNETES_TARGET, "1.35.0")]);
        assert_eq!(
            intent.talos_target,
            Target::Version(TalosVersion::new(1, 12, 0))
        );
        assert_eq!(
            intent.kubernetes_target.version(),
            Some(&KubernetesVersion::new(1, 35, 0))
        );
        let intent = intent_with_bad_kubernetes();
        assert_eq!(
            intent.talos_target.version(),
            Some(&TalosVersion::new(1, 12, 0))
        );
        assert!(matches!(intent.kubernetes_target, Target::Invalid { .. }));
    }

    fn intent_with_bad_kubernetes() -> UpgradeIntent {
        intent(&[(TALOS_TARGET, "1.12.0"), (KUBERNETES_TARGET, "1.35")])
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        let intent = intent(&[("unrelated/key", "x"), (TALOS_STATUS, "failed")]);
        assert_eq!(intent.talos_target, Target::Absent);
        assert_eq!(intent.kubernetes_target, Target::Absent);
        assert!(
            !intent.resume && !intent.talos_reset && !intent.kubernetes_reset && !intent.paused
        );
        assert_eq!(intent.order, Ok(UpgradeOrder::WorkersFirst));
        assert_eq!(intent.max_parallel_workers, Ok(NonZeroU32::MIN));
        assert_eq!(intent.credentials_secret, Ok(None));
        assert!(intent.invalid_options().is_empty());
    }

    /// Which flag a row sets.
    #[derive(Debug, Clone, Copy)]
    enum Flag {
        Resume,
        TalosReset,
        KubernetesReset,
        Paused,
    }

    #[test]
    fn flags() {
        let flags = [
            (Flag::Resume, RESUME, false),
            (Flag::TalosReset, TALOS_RESET_UPGRADE_STATE, false),
            (Flag::KubernetesReset, KUBERNETES_RESET_UPGRADE_STATE, false),
            (Flag::Paused, PAUSED, true),
        ];
        // (value, reading, valid); invalid rows read as the flag's safe value.
        let values = [
            ("true", Some(true)),
            ("True", Some(true)),
            ("TRUE", Some(true)),
            (" true\n", Some(true)),
            ("false", Some(false)),
            ("False", Some(false)),
            ("", Some(false)),
            ("  ", Some(false)),
            ("yes", None),
            ("1", None),
            ("on", None),
            ("t", None),
            ("truee", None),
        ];
        for (flag, key, safe) in flags {
            for (raw, reading) in values {
                let intent = intent(&[(key, raw)]);
                let got = match flag {
                    Flag::Resume => intent.resume,
                    Flag::TalosReset => intent.talos_reset,
                    Flag::KubernetesReset => intent.kubernetes_reset,
                    Flag::Paused => intent.paused,
                };
                assert_eq!(got, reading.unwrap_or(safe), "{key}={raw:?}");
                match reading {
                    Some(_) => assert!(intent.invalid_options().is_empty(), "{key}={raw:?}"),
                    None => assert_eq!(
                        intent.invalid_options(),
                        vec![&InvalidOption {
                            key,
                            value: raw.to_string(),
                            reason: BOOL_REASON.to_string(),
                        }],
                        "{key}={raw:?}"
                    ),
                }
            }
        }
        let intent = intent(&[(TALOS_RESET_UPGRADE_STATE, "true")]);
        assert!(intent.reset(UpgradeKind::Talos) && !intent.reset(UpgradeKind::Kubernetes));
        let intent = super::tests::intent(&[(KUBERNETES_RESET_UPGRADE_STATE, "true")]);
        assert!(!intent.reset(UpgradeKind::Talos) && intent.reset(UpgradeKind::Kubernetes));
    }

    #[test]
    fn upgrade_order() {
        let cases = [
            ("workers-first", Some(UpgradeOrder::WorkersFirst)),
            (
                "control-planes-first",
                Some(UpgradeOrder::ControlPlanesFirst),
            ),
            (
                " Control-Planes-First ",
                Some(UpgradeOrder::ControlPlanesFirst),
            ),
            ("", Some(UpgradeOrder::WorkersFirst)),
            ("sideways", None),
            ("controlplanes-first", None),
            ("workers_first", None),
            ("workers", None),
        ];
        for (raw, expected) in cases {
            let intent = intent(&[(UPGRADE_ORDER, raw)]);
            match expected {
                Some(order) => assert_eq!(intent.order, Ok(order), "{raw:?}"),
                None => {
                    let error = intent.order.clone().unwrap_err();
                    assert_eq!(error.key, UPGRADE_ORDER);
                    assert_eq!(error.value, raw);
                    assert_eq!(intent.invalid_options(), vec![&error]);
                }
            }
        }
        assert_eq!(
            intent(&[(UPGRADE_ORDER, "sideways")])
                .order
                .unwrap_err()
                .to_string(),
            r#"Annotation upgrade.vitistack.io/upgrade-order has the invalid value "sideways": use workers-first (the default) or control-planes-first"#
        );
        for order in [UpgradeOrder::WorkersFirst, UpgradeOrder::ControlPlanesFirst] {
            assert_eq!(UpgradeOrder::parse(order.as_str()), Some(order));
            assert_eq!(order.to_string(), order.as_str());
        }
    }

    #[test]
    fn max_parallel_workers() {
        let cases = [
            ("1", Some(1)),
            ("3", Some(3)),
            (" 10 ", Some(10)),
            ("007", Some(7)),
            ("4294967295", Some(u32::MAX)),
            ("", Some(1)),
            ("0", None),
            ("00", None),
            ("-1", None),
            ("+2", None),
            ("abc", None),
            ("2.5", None),
            ("1e3", None),
            ("4294967296", None),
            ("3 workers", None),
        ];
        for (raw, expected) in cases {
            let intent = intent(&[(MAX_PARALLEL_WORKERS, raw)]);
            match expected {
                Some(n) => assert_eq!(
                    intent.max_parallel_workers.map(NonZeroU32::get),
                    Ok(n),
                    "{raw:?}"
                ),
                None => {
                    let error = intent.max_parallel_workers.clone().unwrap_err();
                    assert_eq!(
                        (error.key, error.value.as_str()),
                        (MAX_PARALLEL_WORKERS, raw)
                    );
                    assert_eq!(intent.invalid_options().len(), 1);
                }
            }
        }
        assert_eq!(
            intent(&[(MAX_PARALLEL_WORKERS, "0")])
                .max_parallel_workers
                .unwrap_err()
                .to_string(),
            r#"Annotation upgrade.vitistack.io/max-parallel-workers has the invalid value "0": use a whole number of 1 or more (the default is 1)"#
        );
    }

    #[test]
    fn credentials_secret() {
        let long = "a".repeat(253);
        let too_long = "a".repeat(254);
        let cases = [
            ("cluster-a", Some(Some("cluster-a"))),
            (" cluster-a.talos ", Some(Some("cluster-a.talos"))),
            ("0abc9", Some(Some("0abc9"))),
            (long.as_str(), Some(Some(long.as_str()))),
            ("", Some(None)),
            (too_long.as_str(), None),
            ("Cluster-A", None),
            ("-cluster", None),
            ("cluster-", None),
            ("cluster_a", None),
            ("ns/cluster", None),
        ];
        for (raw, expected) in cases {
            let intent = intent(&[(CREDENTIALS_SECRET, raw)]);
            match expected {
                Some(name) => assert_eq!(
                    intent.credentials_secret,
                    Ok(name.map(str::to_string)),
                    "{raw:?}"
                ),
                None => {
                    let error = intent.credentials_secret.clone().unwrap_err();
                    assert_eq!(error.key, CREDENTIALS_SECRET, "{raw:?}");
                    assert_eq!(intent.invalid_options(), vec![&error]);
                }
            }
        }
    }

    #[test]
    fn invalid_options_are_all_reported_in_table_order() {
        let intent = intent(&[
            (CREDENTIALS_SECRET, "Bad_Name"),
            (MAX_PARALLEL_WORKERS, "0"),
            (UPGRADE_ORDER, "sideways"),
            (PAUSED, "please"),
            (RESUME, "yes"),
            (TALOS_TARGET, "1.12.0"),
        ]);
        let keys: Vec<&str> = intent.invalid_options().iter().map(|o| o.key).collect();
        assert_eq!(
            keys,
            [
                RESUME,
                PAUSED,
                UPGRADE_ORDER,
                MAX_PARALLEL_WORKERS,
                CREDENTIALS_SECRET
            ]
        );
        // An unrecognised pause holds; an unrecognised resume does nothing.
        assert!(intent.paused);
        assert!(!intent.resume);
        // A valid target is unaffected by bad options.
        assert_eq!(
            intent.talos_target.version(),
            Some(&TalosVersion::new(1, 12, 0))
        );
    }

    /// The installer override: a repository without tag (`talos-installer-image`) or a schematic id
    /// (`talos-schematic`), never both; a bad value names the annotation and what to write.
    #[test]
    fn installer_overrides() {
        const SCHEMATIC: &str = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
        // (annotations, the override or the invalid key and words of its reason)
        type Case<'a> = (
            Vec<(&'a str, &'a str)>,
            Result<Option<InstallerOverride>, (&'a str, &'a str)>,
        );
        let cases: Vec<Case> = vec![
            (vec![], Ok(None)),
            (vec![(TALOS_INSTALLER_IMAGE, "  ")], Ok(None)),
            (
                vec![(
                    TALOS_INSTALLER_IMAGE,
                    " registry.example.corp/talos/installer ",
                )],
                Ok(Some(InstallerOverride::Repository(
                    "registry.example.corp/talos/installer".into(),
                ))),
            ),
            (
                vec![(TALOS_SCHEMATIC, SCHEMATIC)],
                Ok(Some(InstallerOverride::Schematic(SCHEMATIC.into()))),
            ),
            (
                vec![(
                    TALOS_INSTALLER_IMAGE,
                    "ghcr.io/siderolabs/installer:v1.14.1",
                )],
                Err((TALOS_INSTALLER_IMAGE, "without a tag")),
            ),
            (
                vec![(TALOS_SCHEMATIC, "not-a-schematic")],
                Err((TALOS_SCHEMATIC, "64 lowercase hexadecimal digits")),
            ),
            (
                vec![
                    (TALOS_SCHEMATIC, SCHEMATIC),
                    (
                        TALOS_INSTALLER_IMAGE,
                        "registry.example.corp/talos/installer",
                    ),
                ],
                Err((TALOS_SCHEMATIC, "not both")),
            ),
        ];
        for (pairs, expected) in cases {
            let intent = intent(&pairs);
            match expected {
                Ok(installer) => {
                    assert_eq!(intent.installer, Ok(installer), "{pairs:?}");
                    assert!(intent.invalid_options().is_empty(), "{pairs:?}");
                }
                Err((key, words)) => {
                    let error = intent.installer.clone().expect_err("invalid");
                    assert_eq!(error.key, key, "{pairs:?}");
                    assert!(error.to_string().contains(words), "{pairs:?}: {error}");
                    assert_eq!(intent.invalid_options(), vec![&error]);
                }
            }
        }
    }

    /// `alert-gate`: absent or blank is the operator's selector; a bad value names the key and every
    /// accepted form (the forms themselves are tested in `alert_gate`).
    #[test]
    fn alert_gate() {
        assert_eq!(intent(&[]).alert_gate, Ok(None));
        assert_eq!(intent(&[(ALERT_GATE, " ")]).alert_gate, Ok(None));
        assert_eq!(
            intent(&[(ALERT_GATE, "off")]).alert_gate,
            Ok(Some(AlertGate::Off))
        );
        let bad = intent(&[(ALERT_GATE, "NodeDown"), (TALOS_TARGET, "1.12.0")]);
        let error = bad.alert_gate.clone().expect_err("invalid");
        assert_eq!(bad.invalid_options(), vec![&error]);
        assert_eq!(
            error.to_string(),
            "Annotation upgrade.vitistack.io/alert-gate has the invalid value \"NodeDown\": use off, \
             alerts: <AlertName>, <AlertName>..., a label selector such as {severity=~\"critical|warning\", \
             team=\"storage\"}, or promql: <expression that must return nothing>"
        );
    }

    /// `health-checks`: absent, blank or `[]` is none; a bad list names the key, the check and its
    /// problem, with a long value shown cut (the checks themselves are tested in `health_checks`).
    #[test]
    fn health_checks() {
        assert_eq!(intent(&[]).health_checks, Ok(None));
        assert_eq!(intent(&[(HEALTH_CHECKS, " ")]).health_checks, Ok(None));
        assert_eq!(intent(&[(HEALTH_CHECKS, "[]")]).health_checks, Ok(None));
        let ok = "[{apiVersion: v1, kind: Node, name: w-1, condition: Ready}]";
        let checks = intent(&[(HEALTH_CHECKS, ok)]).health_checks;
        assert_eq!(checks.expect("valid").expect("one").checks.len(), 1);
        let long = "[{check: ceph, apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: \
                    rook-ceph, name: rook-ceph, selector: app=ceph, condition: Ready}]";
        let bad = intent(&[(HEALTH_CHECKS, long), (TALOS_TARGET, "1.12.0")]);
        let error = bad.health_checks.clone().expect_err("invalid");
        assert_eq!(bad.invalid_options(), vec![&error]);
        assert_eq!(
            error.to_string(),
            "Annotation upgrade.vitistack.io/health-checks has the invalid value \"[{check: ceph, \
             apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: rook-c…\": \
             health check \"ceph\": both name and selector are given; use name for one object or \
             selector for every object it matches"
        );
    }

    /// `alert-silences`: absent or blank is the default; a bad value names the key and the modes.
    #[test]
    fn alert_silences() {
        assert_eq!(intent(&[]).alert_silences, Ok(None));
        assert_eq!(intent(&[(ALERT_SILENCES, " ")]).alert_silences, Ok(None));
        assert_eq!(
            intent(&[(ALERT_SILENCES, "run")]).alert_silences,
            Ok(Some(SilenceMode::Run))
        );
        let bad = intent(&[(ALERT_SILENCES, "nodes"), (TALOS_TARGET, "1.12.0")]);
        let error = bad.alert_silences.clone().expect_err("invalid");
        assert_eq!(bad.invalid_options(), vec![&error]);
        assert_eq!(
            error.to_string(),
            "Annotation upgrade.vitistack.io/alert-silences has the invalid value \"nodes\": use \
             off, node (one silence per node being upgraded) or run (one silence for all the run's \
             nodes while the run goes on)"
        );
    }

    /// `etcd-snapshot`: absent or blank is the default; a bad value names the key and the modes.
    #[test]
    fn etcd_snapshot() {
        use crate::etcd_snapshot::SnapshotMode;
        assert_eq!(intent(&[]).etcd_snapshot, Ok(None));
        assert_eq!(intent(&[(ETCD_SNAPSHOT, " ")]).etcd_snapshot, Ok(None));
        for (text, mode) in [
            ("off", SnapshotMode::Off),
            ("talos", SnapshotMode::Talos),
            ("talos-and-kubernetes", SnapshotMode::TalosAndKubernetes),
        ] {
            assert_eq!(
                intent(&[(ETCD_SNAPSHOT, text)]).etcd_snapshot,
                Ok(Some(mode))
            );
        }
        let bad = intent(&[(ETCD_SNAPSHOT, "always"), (TALOS_TARGET, "1.12.0")]);
        let error = bad.etcd_snapshot.clone().expect_err("invalid");
        assert_eq!(bad.invalid_options(), vec![&error]);
        assert_eq!(
            error.to_string(),
            "Annotation upgrade.vitistack.io/etcd-snapshot has the invalid value \"always\": use \
             off, talos (a snapshot before the first control plane of a Talos run; the default \
             when the controller has a snapshot destination) or talos-and-kubernetes (also one \
             before the first control plane of a Kubernetes run)"
        );
    }

    /// The gates' options: a window (the cluster's over the operator's default, `always` opting out
    /// of it), the soaks, the canary and force-start; each bad value names its key and the forms.
    #[test]
    fn gate_options() {
        let none = intent(&[]);
        assert_eq!(none.maintenance_window, Ok(None));
        assert_eq!(none.soak_after_node, Ok(None));
        assert_eq!(none.soak_after_control_planes, Ok(None));
        assert_eq!(none.pause_after_nodes, Ok(None));
        assert!(!none.force_start);

        let default = MaintenanceWindows::parse("Sat,Sun 02:00 8h UTC").expect("valid");
        let own = "Mon-Fri 22:00 4h Europe/Oslo";
        let cases: [(Option<&str>, Option<String>); 3] = [
            (None, Some(default.to_string())),
            (Some(own), Some(own.to_string())),
            // `always`: a window that is always open, so the default does not apply.
            (Some("always"), Some("always".to_string())),
        ];
        for (annotation, expected) in cases {
            let pairs: Vec<(&str, &str)> = annotation
                .map(|window| (MAINTENANCE_WINDOW, window))
                .into_iter()
                .collect();
            let window = intent(&pairs)
                .with_default_window(Some(&default))
                .maintenance_window
                .expect("valid");
            assert_eq!(window.map(|w| w.to_string()), expected, "{annotation:?}");
        }

        let set = intent(&[
            (SOAK_AFTER_NODE, "1h30m"),
            (SOAK_AFTER_CONTROL_PLANES, "90s"),
            (PAUSE_AFTER_NODES, "2"),
            (FORCE_START, "true"),
        ]);
        assert_eq!(set.soak_after_node, Ok(Some(Duration::from_secs(5400))));
        assert_eq!(
            set.soak_after_control_planes,
            Ok(Some(Duration::from_secs(90)))
        );
        assert_eq!(
            set.pause_after_nodes,
            Ok(NonZeroU32::new(2).map(Some).expect("2"))
        );
        assert!(set.force_start);

        let bad = intent(&[
            (TALOS_TARGET, "1.12.0"),
            (MAINTENANCE_WINDOW, "Someday 25:00 4h UTC"),
            (SOAK_AFTER_NODE, "0s"),
            (SOAK_AFTER_CONTROL_PLANES, "30m1h"),
            (PAUSE_AFTER_NODES, "0"),
            (FORCE_START, "now"),
        ]);
        let keys: Vec<&str> = bad.invalid_options().iter().map(|o| o.key).collect();
        assert_eq!(
            keys,
            [
                FORCE_START,
                MAINTENANCE_WINDOW,
                SOAK_AFTER_NODE,
                SOAK_AFTER_CONTROL_PLANES,
                PAUSE_AFTER_NODES
            ]
        );
        // An unrecognised force-start does not force.
        assert!(!bad.force_start);
        let window = bad.maintenance_window.clone().expect_err("invalid");
        assert!(
            window.to_string().starts_with(
                "Annotation upgrade.vitistack.io/maintenance-window has the invalid value \
                 \"Someday 25:00 4h UTC\": "
            ),
            "{window}"
        );
        let soak = bad.soak_after_node.clone().expect_err("invalid");
        assert_eq!(
            soak.to_string(),
            "Annotation upgrade.vitistack.io/soak-after-node has the invalid value \"0s\": use a \
             duration such as 30s, 10m, 4h or 1h30m (hours, minutes, seconds), more than zero"
        );
        let canary = bad.pause_after_nodes.clone().expect_err("invalid");
        assert_eq!(
            canary.to_string(),
            "Annotation upgrade.vitistack.io/pause-after-nodes has the invalid value \"0\": use a \
             whole number of 1 or more: the nodes the run upgrades before it pauses once"
        );
    }

    /// `do-not-reconcile` is read as vitistack's talos-operator reads it: any non-empty value excludes
    /// the cluster (even "false": both controllers must agree on which clusters they leave alone);
    /// missing or empty does not. It leaves every other reading as it is.
    #[test]
    fn do_not_reconcile_is_any_non_empty_value() {
        let cases: [(Option<&str>, bool); 7] = [
            (None, false),
            (Some(""), false),
            (Some("true"), true),
            (Some("yes"), true),
            (Some("false"), true),
            (Some(" "), true),
            (Some("maintenance by team-a until Friday"), true),
        ];
        for (raw, excluded) in cases {
            let mut pairs = vec![(TALOS_TARGET, "1.12.0")];
            pairs.extend(raw.map(|raw| (DO_NOT_RECONCILE, raw)));
            let intent = intent(&pairs);
            assert_eq!(intent.do_not_reconcile, excluded, "{raw:?}");
            assert_eq!(
                intent.talos_target.version(),
                Some(&TalosVersion::new(1, 12, 0))
            );
            assert!(intent.invalid_options().is_empty(), "{raw:?}");
        }
    }
}
