//! The health checks' IO (issue #23): reads the objects each of a cluster's checks names in its
//! workload cluster and hands them to the pure verdict ([`talos_upgrade_core::health_checks`]).
//!
//! A check's `apiVersion` and `kind` are resolved to a resource by discovery of that one group
//! version (`discovery::pinned_kind`: one request), kept per cluster for [`DISCOVERY_TTL`] so that a
//! run's looks do not ask again every poll; a named object is read with `get`, a selector with one
//! `list`. The checks of a look are read at once, each within [`TIMEOUT`].
//!
//! Whatever keeps a check from being told (a kind the cluster does not serve, a read that is refused
//! or times out, a missing object) is [`Read::Failed`] or [`Read::NotFound`], which the verdict turns
//! into a hold that says why: it never counts as healthy. Messages name the kind, the object and the
//! API server's answer; the workload credentials never appear in them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::discovery::{ApiCapabilities, Scope};

use talos_upgrade_core::crd::KubernetesCluster;
use talos_upgrade_core::health_checks::{self, HealthCheck, HealthChecks, Objects, Read};
use talos_upgrade_core::holds::ExternalCheck;

/// How long one check's read may take, discovery included: a reconcile waits for it (the alert gate's
/// deadline too).
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// How long a resolved kind is reused. A CRD changing its served versions is rare; five minutes of a
/// stale answer at worst shows as "cannot be evaluated", which holds.
pub const DISCOVERY_TTL: Duration = Duration::from_secs(300);

/// (group, version, kind) → the resource and its scope, as resolved at some instant.
type Resolved = HashMap<(String, String, String), (Instant, ApiResource, Scope)>;

/// Reads the health checks' objects; keeps what discovery found, per cluster (namespace, name).
/// Clones share the cache.
#[derive(Clone, Default)]
pub struct HealthReader {
    resolved: Arc<Mutex<HashMap<(String, String), Resolved>>>,
}

impl std::fmt::Debug for HealthReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthReader").finish_non_exhaustive()
    }
}

impl HealthReader {
    /// Every check of `checks` read in `workload` and judged: the gate's answer.
    pub async fn check(
        &self,
        cluster: &KubernetesCluster,
        checks: &HealthChecks,
        workload: &kube::Client,
    ) -> ExternalCheck {
        let key = &(cluster.namespace().unwrap_or_default(), cluster.name_any());
        let reads = futures::future::join_all(checks.checks.iter().map(|check| async move {
            let read = tokio::time::timeout(TIMEOUT, self.read(key, check, workload))
                .await
                .unwrap_or_else(|_| {
                    Read::Failed(format!(
                        "reading {} did not finish within {}s",
                        what(check),
                        TIMEOUT.as_secs()
                    ))
                });
            (check, health_checks::evaluate(check, &read))
        }))
        .await;
        health_checks::verdict(&reads)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Resolved>> {
        self.resolved
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn read(
        &self,
        cluster: &(String, String),
        check: &HealthCheck,
        workload: &kube::Client,
    ) -> Read {
        let (resource, scope) = match self.resolve(cluster, check, workload).await {
            Ok(resolved) => resolved,
            Err(reason) => return Read::Failed(reason),
        };
        let api: Api<DynamicObject> = match (&scope, &check.namespace, &check.objects) {
            (Scope::Cluster, Some(namespace), _) => {
                return Read::Failed(format!(
                    "{} is cluster-scoped, and the check names namespace {namespace}: remove it",
                    check.kind
                ));
            }
            (Scope::Namespaced, None, Objects::Named(_)) => {
                return Read::Failed(format!(
                    "{} is namespaced, and the check names no namespace",
                    check.kind
                ));
            }
            (Scope::Namespaced, Some(namespace), _) => {
                Api::namespaced_with(workload.clone(), namespace, &resource)
            }
            // Cluster-scoped, or every namespace for a selector.
            (Scope::Cluster, None, _) | (Scope::Namespaced, None, Objects::Selected(_)) => {
                Api::all_with(workload.clone(), &resource)
            }
        };
        let answer = match &check.objects {
            Objects::Named(name) => api
                .get_opt(name)
                .await
                .map(|found| found.into_iter().collect::<Vec<_>>()),
            Objects::Selected(selector) => api
                .list(&ListParams::default().labels(selector))
                .await
                .map(|list| list.items),
        };
        match answer {
            Ok(objects) if objects.is_empty() && matches!(check.objects, Objects::Named(_)) => {
                // The kind may have gone since it was resolved: ask discovery again next time.
                self.unresolve(cluster, check);
                Read::NotFound
            }
            Ok(objects) => Read::Objects(
                objects
                    .iter()
                    .filter_map(|object| serde_json::to_value(object).ok())
                    .collect(),
            ),
            Err(error) => Read::Failed(format!("reading {}: {}", what(check), api_error(&error))),
        }
    }

    /// The check's resource: from the cache while fresh, else by discovery.
    async fn resolve(
        &self,
        cluster: &(String, String),
        check: &HealthCheck,
        workload: &kube::Client,
    ) -> Result<(ApiResource, Scope), String> {
        let gvk = (
            check.group.clone(),
            check.version.clone(),
            check.kind.clone(),
        );
        let cached = self
            .lock()
            .get(cluster)
            .and_then(|resolved| resolved.get(&gvk))
            .filter(|(at, _, _)| at.elapsed() < DISCOVERY_TTL)
            .map(|(_, resource, scope)| (resource.clone(), scope.clone()));
        if let Some(resolved) = cached {
            return Ok(resolved);
        }
        let asked = GroupVersionKind::gvk(&check.group, &check.version, &check.kind);
        let (resource, ApiCapabilities { scope, .. }) =
            kube::discovery::pinned_kind(workload, &asked)
                .await
                .map_err(|error| match error {
                    kube::Error::Discovery(kube::error::DiscoveryError::MissingKind(_)) => {
                        format!("no kind {} in {}", check.kind, check.api_version)
                    }
                    kube::Error::Api(status) if status.code == 404 => format!(
                        "no kind {} in {}: the cluster does not serve {}",
                        check.kind, check.api_version, check.api_version
                    ),
                    other => format!(
                        "looking up kind {} in {}: {}",
                        check.kind,
                        check.api_version,
                        api_error(&other)
                    ),
                })?;
        self.lock()
            .entry(cluster.clone())
            .or_default()
            .insert(gvk, (Instant::now(), resource.clone(), scope.clone()));
        Ok((resource, scope))
    }

    fn unresolve(&self, cluster: &(String, String), check: &HealthCheck) {
        if let Some(resolved) = self.lock().get_mut(cluster) {
            resolved.remove(&(
                check.group.clone(),
                check.version.clone(),
                check.kind.clone(),
            ));
        }
    }
}

/// `CephCluster rook-ceph/rook-ceph`, `Deployment in shop matching app=web`.
fn what(check: &HealthCheck) -> String {
    let place = |name: &str| match &check.namespace {
        Some(namespace) => format!("{namespace}/{name}"),
        None => name.to_string(),
    };
    match &check.objects {
        Objects::Named(name) => format!("{} {}", check.kind, place(name)),
        Objects::Selected(selector) => match &check.namespace {
            Some(namespace) => format!("{}s in {namespace} matching {selector}", check.kind),
            None => format!("{}s matching {selector}", check.kind),
        },
    }
}

/// The API server's answer in words: its message and code for a refusal (`forbidden` names the user
/// and the verb, never a credential), kube's error otherwise.
fn api_error(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => {
            format!("{} ({} {})", status.message, status.code, status.reason)
        }
        other => other.to_string(),
    }
}
