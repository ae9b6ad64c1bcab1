//! Cordon, drain and uncordon of a workload Node, as the controller does around a Talos ≥ 1.13 reboot
//! (Talos < 1.13 drains by itself inside `MachineService.Upgrade`).
//!
//! A drain is a series of passes, one per reconcile, rather than one long call: each pass cordons the node
//! (idempotent), asks the eviction API to evict every pod that has to go and is not already leaving, and
//! reports what is left. The eviction API enforces PodDisruptionBudgets: a pod whose budget allows no
//! disruption is refused with 429 and stays; a later pass tries again, until the run's drain timeout.
//! Pods that never leave a node by eviction are not waited for, as `kubectl drain` and Talos do: mirror pods
//! of static pods and pods of DaemonSets. Finished pods (Succeeded, Failed) hold nothing.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use serde_json::json;

use talos_upgrade_core::talos::DrainStatus;

/// Field manager of the controller's writes to workload Nodes.
const FIELD_MANAGER: &str = "talos-upgrade-controller";
/// kubelet marks the mirror pod of a static pod with this annotation.
const MIRROR_POD_ANNOTATION: &str = "kubernetes.io/config.mirror";

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("{action} of Node {node} failed: {source}")]
    Kube {
        action: &'static str,
        node: String,
        #[source]
        source: kube::Error,
    },
}

/// Sets `spec.unschedulable` on `node`, as `kubectl cordon` does.
pub async fn cordon(client: &kube::Client, node: &str) -> Result<(), DrainError> {
    set_unschedulable(client, node, true, "cordon").await
}

/// Clears `spec.unschedulable` on `node`, as `kubectl uncordon` does.
pub async fn uncordon(client: &kube::Client, node: &str) -> Result<(), DrainError> {
    set_unschedulable(client, node, false, "uncordon").await
}

async fn set_unschedulable(
    client: &kube::Client,
    node: &str,
    unschedulable: bool,
    action: &'static str,
) -> Result<(), DrainError> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            node,
            &PatchParams {
                field_manager: Some(FIELD_MANAGER.to_string()),
                ..PatchParams::default()
            },
            &Patch::Merge(json!({"spec": {"unschedulable": unschedulable}})),
        )
        .await
        .map(|_| ())
        .map_err(|source| DrainError::Kube {
            action,
            node: node.to_string(),
            source,
        })
}

/// One drain pass over `node`: cordon it, evict the pods that have to go, and report what is left.
pub async fn drain_pass(client: &kube::Client, node: &str) -> Result<DrainStatus, DrainError> {
    cordon(client, node).await?;
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|source| DrainError::Kube {
            action: "listing the pods",
            node: node.to_string(),
            source,
        })?;
    let mut status = DrainStatus::default();
    for pod in on_node.items.iter().filter(|pod| must_leave(pod)) {
        status.remaining += 1;
        if pod.metadata.deletion_timestamp.is_some() {
            // Already leaving: evicted by an earlier pass (or deleted by someone); wait for it to go.
            continue;
        }
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
        match api.evict(name, &EvictParams::default()).await {
            Ok(_) => {}
            // Gone in the meantime.
            Err(kube::Error::Api(answer)) if answer.code == 404 => status.remaining -= 1,
            Err(kube::Error::Api(answer)) => {
                // 429 is a PodDisruptionBudget saying no; the first refusal names the blocker.
                if status.blocked.is_none() {
                    status.blocked = Some(format!(
                        "eviction of pod {namespace}/{name} refused: {}",
                        refusal_reason(&answer)
                    ));
                }
            }
            Err(error) => {
                if status.blocked.is_none() {
                    status.blocked = Some(format!(
                        "eviction of pod {namespace}/{name} failed: {error}"
                    ));
                }
            }
        }
    }
    Ok(status)
}

/// Whether a pod on a draining node has to leave it before the node reboots.
fn must_leave(pod: &Pod) -> bool {
    let mirror = pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(MIRROR_POD_ANNOTATION));
    let daemon = pod
        .metadata
        .owner_references
        .as_ref()
        .is_some_and(|owners| {
            owners
                .iter()
                .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
        });
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    !(mirror || daemon || finished)
}

/// The API server's sentence for a refused eviction, with the budget's own explanation when it gives one
/// ("The disruption budget web needs 2 healthy pods and has 2 currently").
fn refusal_reason(answer: &kube::core::Status) -> String {
    let message = answer.message.trim_end_matches('.');
    let causes: Vec<&str> = answer
        .details
        .as_ref()
        .map(|d| {
            d.causes
                .iter()
                .map(|c| c.message.as_str())
                .filter(|m| !m.is_empty())
                .collect()
        })
        .unwrap_or_default();
    if causes.is_empty() {
        message.to_string()
    } else {
        format!("{message} ({})", causes.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn mirror_daemonset_and_finished_pods_do_not_hold_a_drain() {
        let cases = [
            (json!({"metadata": {"name": "web"}}), true),
            (
                json!({"metadata": {"name": "kube-apiserver-cp-1",
                    "annotations": {"kubernetes.io/config.mirror": "abc"}}}),
                false,
            ),
            (
                json!({"metadata": {"name": "proxy-x", "ownerReferences": [{"apiVersion": "apps/v1",
                    "kind": "DaemonSet", "name": "kube-proxy", "uid": "u", "controller": true}]}}),
                false,
            ),
            (
                json!({"metadata": {"name": "web-x", "ownerReferences": [{"apiVersion": "apps/v1",
                    "kind": "ReplicaSet", "name": "web", "uid": "u", "controller": true}]}}),
                true,
            ),
            (
                json!({"metadata": {"name": "job"}, "status": {"phase": "Succeeded"}}),
                false,
            ),
            (
                json!({"metadata": {"name": "crashed"}, "status": {"phase": "Failed"}}),
                false,
            ),
            (
                json!({"metadata": {"name": "running"}, "status": {"phase": "Running"}}),
                true,
            ),
        ];
        for (value, expected) in cases {
            let p = pod(value);
            assert_eq!(must_leave(&p), expected, "{:?}", p.metadata.name);
        }
    }

    #[test]
    fn a_refusal_reads_with_the_budgets_explanation() {
        let answer: kube::core::Status = serde_json::from_value(json!({
            "status": "Failure",
            "message": "Cannot evict pod as it would violate the pod's disruption budget.",
            "reason": "TooManyRequests",
            "details": {"causes": [{"reason": "DisruptionBudget",
                "message": "The disruption budget web needs 1 healthy pods and has 1 currently"}]},
            "code": 429
        }))
        .expect("status");
        assert_eq!(
            refusal_reason(&answer),
            "Cannot evict pod as it would violate the pod's disruption budget (The disruption budget \
             web needs 1 healthy pods and has 1 currently)"
        );
    }
}
