//! Standing aside: a cluster the controller must not act on (`do-not-reconcile`, or another
//! controller writing its upgrade fields; the decision is the core's,
//! [`talos_upgrade_core::coexistence`]). This module reads the field managers from the object's
//! `metadata.managedFields` and, when the controller stands aside, says so once: the `*-message`
//! annotations and one Event, nothing else written, nothing looked at.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::event_recorder::EventRecorder;
use kube::api::{Api, Patch};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};

use talos_upgrade_core::coexistence::{self, FieldWriter, Standing};
use talos_upgrade_core::crd::KubernetesCluster;

/// The Event reasons.
pub const EXCLUDED_REASON: &str = "Excluded";
pub const CONFLICT_REASON: &str = "ControllerConflict";

/// What the controller last said of each cluster it stands aside from: it says it once, not at every
/// reconcile. A restarted controller finds the message in the annotations and does not say it again.
#[derive(Default)]
pub struct Said(Mutex<HashMap<(String, String), String>>);

impl Said {
    fn get(&self, key: &(String, String)) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .cloned()
    }

    fn note(&self, key: (String, String), message: String) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, message);
    }

    /// The controller acts on the cluster again (or it is gone): a later exclusion is said again.
    pub fn forget(&self, key: &(String, String)) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

/// The field managers of `cluster` with the annotation keys and keyed condition types each holds.
pub fn writers(cluster: &KubernetesCluster) -> Vec<FieldWriter> {
    cluster
        .meta()
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|entry| {
            let fields = &entry.fields_v1.as_ref()?.0;
            Some(FieldWriter {
                manager: entry.manager.clone().unwrap_or_default(),
                annotations: children(&fields["f:metadata"]["f:annotations"], "f:")
                    .map(str::to_string)
                    .collect(),
                conditions: children(&fields["f:status"]["f:conditions"], "k:")
                    .filter_map(|key| {
                        let key: serde_json::Value = serde_json::from_str(key).ok()?;
                        key["type"].as_str().map(str::to_string)
                    })
                    .collect(),
            })
        })
        .collect()
}

/// Reduces each `managedFields` entry of a watched cluster to what [`writers`] reads: the names of its
/// annotation keys and of its keyed conditions, each with an empty value. The watch's store keeps
/// every cluster (and a reconcile in flight an older copy too), and the rest of a FieldsV1 tree
/// (spec, status, labels, each node a JSON map) was most of their size. The object is only read: the
/// controller writes clusters with patches, never by sending a stored copy back.
pub fn keep_what_is_read(cluster: &mut KubernetesCluster) {
    for entry in cluster.metadata.managed_fields.iter_mut().flatten() {
        let Some(fields) = entry.fields_v1.as_mut() else {
            continue;
        };
        let names = |set: &serde_json::Value, prefix: &'static str| -> serde_json::Map<_, _> {
            children(set, prefix)
                .map(|name| (format!("{prefix}{name}"), serde_json::json!({})))
                .collect()
        };
        let mut kept = serde_json::Map::new();
        let annotations = names(&fields.0["f:metadata"]["f:annotations"], "f:");
        if !annotations.is_empty() {
            kept.insert(
                "f:metadata".into(),
                serde_json::json!({ "f:annotations": annotations }),
            );
        }
        let conditions = names(&fields.0["f:status"]["f:conditions"], "k:");
        if !conditions.is_empty() {
            kept.insert(
                "f:status".into(),
                serde_json::json!({ "f:conditions": conditions }),
            );
        }
        fields.0 = serde_json::Value::Object(kept);
    }
}

/// The names of a FieldsV1 set's members of one kind (`f:<field>`, `k:<key JSON>`).
fn children<'a>(
    set: &'a serde_json::Value,
    prefix: &'static str,
) -> impl Iterator<Item = &'a str> + 'a {
    set.as_object()
        .into_iter()
        .flatten()
        .filter_map(move |(name, _)| name.strip_prefix(prefix))
}

/// Says once why the controller does not act on `cluster`: the `*-message` annotations the core
/// allows, and one Event (Normal when excluded, Warning when contested). Touches nothing else.
pub async fn stand_aside(
    api: &Api<KubernetesCluster>,
    recorder: &EventRecorder,
    said: &Said,
    cluster: &KubernetesCluster,
    standing: &Standing,
) -> Result<(), kube::Error> {
    let (namespace, name) = (cluster.namespace().unwrap_or_default(), cluster.name_any());
    let (message, type_, reason) = match standing {
        Standing::Act => return Ok(()),
        Standing::Excluded => (
            coexistence::EXCLUDED_MESSAGE.to_string(),
            EventType::Normal,
            EXCLUDED_REASON,
        ),
        Standing::Contested(contest) => (
            coexistence::contested_message(contest, &namespace, &name),
            EventType::Warning,
            CONFLICT_REASON,
        ),
    };
    let key = (namespace, name.clone());
    if said.get(&key).as_deref() == Some(message.as_str()) {
        return Ok(());
    }
    let keys = coexistence::message_keys(standing);
    let patch = coexistence::message_patch(cluster.annotations(), &keys, &message);
    let written = patch.is_some();
    if let Some(annotations) = patch {
        let annotations: BTreeMap<&str, String> = annotations;
        let body = serde_json::json!({"metadata": {"annotations": annotations}});
        api.patch(&name, &super::report::patch_params(), &Patch::Merge(body))
            .await?;
    }
    // Once: with the message written now, or with no message key to write it in. A message already
    // in place was said (by this controller before a restart).
    if written || keys.is_empty() {
        let event = Event {
            type_,
            reason: reason.to_string(),
            note: Some(message.clone()),
            action: "StandAside".to_string(),
            secondary: None,
        };
        if let Err(error) = recorder.publish(&event, &cluster.object_ref(&())).await {
            tracing::warn!(%error, reason, "publishing event");
        }
    }
    said.note(key, message);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry};

    fn entry(manager: &str, fields: serde_json::Value) -> ManagedFieldsEntry {
        ManagedFieldsEntry {
            manager: Some(manager.to_string()),
            operation: Some("Update".to_string()),
            fields_type: Some("FieldsV1".to_string()),
            fields_v1: Some(FieldsV1(fields)),
            ..ManagedFieldsEntry::default()
        }
    }

    /// managedFields as the API server writes them: annotations as `f:<key>` members, a list keyed by
    /// type as `k:{"type":…}` members, an atomic list as one `f:conditions` field.
    #[test]
    fn writers_are_read_from_managed_fields() {
        let mut cluster = KubernetesCluster::new("c", Default::default());
        cluster.metadata.managed_fields = Some(vec![
            entry(
                "talos-operator",
                serde_json::json!({"f:metadata": {"f:annotations": {
                    ".": {},
                    "f:upgrade.vitistack.io/talos-status": {},
                    "f:example.com/x": {}
                }}}),
            ),
            entry(
                "manager",
                serde_json::json!({"f:status": {"f:conditions": {
                    ".": {},
                    "k:{\"type\":\"TalosUpgrade\"}": {".": {}, "f:status": {}},
                }}}),
            ),
            entry(
                "atomic",
                serde_json::json!({"f:status": {"f:conditions": {}, "f:phase": {}}}),
            ),
        ]);
        let writers = writers(&cluster);
        assert_eq!(
            writers,
            vec![
                FieldWriter {
                    manager: "talos-operator".into(),
                    annotations: vec![
                        "example.com/x".into(),
                        "upgrade.vitistack.io/talos-status".into()
                    ],
                    conditions: vec![],
                },
                FieldWriter {
                    manager: "manager".into(),
                    annotations: vec![],
                    conditions: vec!["TalosUpgrade".into()],
                },
                FieldWriter {
                    manager: "atomic".into(),
                    ..FieldWriter::default()
                },
            ]
        );
    }

    /// The watch keeps of managedFields only what `writers` reads: the same writers come out, and
    /// the spec, labels and status fields are gone.
    #[test]
    fn the_watch_keeps_what_writers_read() {
        let mut cluster = KubernetesCluster::new("c", Default::default());
        cluster.metadata.managed_fields = Some(vec![
            entry(
                "provisioner",
                serde_json::json!({
                    "f:metadata": {"f:labels": {".": {}, "f:team": {}}, "f:annotations": {
                        ".": {}, "f:upgrade.vitistack.io/talos-target": {}
                    }},
                    "f:spec": {".": {}, "f:data": {"f:clusterId": {}, "f:nodes": {}}},
                }),
            ),
            entry(
                "talos-upgrade-controller",
                serde_json::json!({"f:status": {
                    "f:phase": {},
                    "f:conditions": {".": {}, "k:{\"type\":\"TalosUpgrade\"}": {
                        ".": {}, "f:status": {}, "f:message": {}
                    }},
                }}),
            ),
            entry("spec-only", serde_json::json!({"f:spec": {"f:data": {}}})),
        ]);
        let before = writers(&cluster);
        keep_what_is_read(&mut cluster);
        assert_eq!(writers(&cluster), before);
        let kept: Vec<serde_json::Value> = cluster
            .metadata
            .managed_fields
            .iter()
            .flatten()
            .map(|entry| entry.fields_v1.as_ref().unwrap().0.clone())
            .collect();
        assert_eq!(
            kept,
            vec![
                serde_json::json!({"f:metadata": {"f:annotations": {
                    "f:upgrade.vitistack.io/talos-target": {}
                }}}),
                serde_json::json!({"f:status": {"f:conditions": {
                    "k:{\"type\":\"TalosUpgrade\"}": {}
                }}}),
                serde_json::json!({}),
            ]
        );
    }
}
