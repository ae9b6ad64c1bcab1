//! Syncing the bootstrap manifests a control plane's Talos renders (`Manifests.kubernetes.talos.dev`)
//! into the workload cluster, the last step of `talosctl upgrade-k8s` (talos-api.md §4 step 10).
//!
//! Two modes, chosen by the lowest Talos version of the cluster ([`ManifestMode::for_lowest_talos`]):
//! - [`ManifestMode::ServerSideApply`] (Talos ≥ 1.13, which applies its manifests that way itself):
//!   server-side apply with field manager `talos`, forced, so the fields Talos owns are taken back.
//! - [`ManifestMode::Legacy`]: per object GET; create when missing; otherwise a dry-run update shows
//!   what the object would become, and only when that differs from what is stored is it updated
//!   (talosctl's comparison). Every write names field manager [`LEGACY_FIELD_MANAGER`].
//!
//! Namespaces, CRDs, ServiceAccounts, ConfigMaps and Secrets go first (what the others refer to), the
//! rest in the order Talos lists them (by manifest id).
//!
//! Left out, unlike talosctl: pruning objects a newer Talos no longer renders (and the inventory
//! ConfigMap that tracks them), and waiting for the rollout of the updated DaemonSets and Deployments.
//! The decision core verifies what it needs from the nodes; a rollout wait would also never end on a
//! cluster without DaemonSet/Deployment controllers, such as the tests' control plane.

use std::collections::HashMap;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersion;
use kube::discovery::{self, ApiCapabilities, ApiGroup, Scope};
use serde_json::Value as Json;

use super::{ExecuteError, ManifestMode};
use talos_api::proto::talos::resource::definitions::k8s as k8s_pb;
use talos_api::{TalosClient, resources};

/// The field manager Talos itself uses for its manifests.
pub const FIELD_MANAGER: &str = "talos";

/// The field manager of the legacy sync's creates and updates: the controller's own name, as its
/// other writes have (drains, the KubernetesCluster's annotations).
///
/// talosctl's legacy sync names none (go-kubernetes v0.2.28 for talosctl 1.12, v0.2.41 for 1.14.1,
/// `kubernetes/manifests/sync.go`: `Create`/`Update` with empty options), so the API server takes
/// the User-Agent's product, `Go-http-client`; without a name the controller's writes were recorded
/// as `unknown`. A Talos 1.12 node's own bootstrap create names `talos` (talos v1.12.0
/// `internal/app/machined/pkg/controllers/k8s/manifest_apply.go`). None of these names changes what a
/// later sync does once the cluster runs Talos ≥ 1.13: an update's entry (operation `Update`) is
/// another owner than a server-side apply's (`talos`, operation `Apply`) whatever its name, and the
/// forced apply of talosctl (fluxcd/pkg/ssa, `ForceOwnership`) and of this controller's
/// [`ManifestMode::ServerSideApply`] takes the fields it sets over from any of them alike (a Talos
/// node only creates what is missing). So nothing is gained by borrowing `talos` or talosctl's
/// anonymous name, and a name of our own keeps `managedFields` saying who changed the object.
pub const LEGACY_FIELD_MANAGER: &str = "talos-upgrade-controller";

/// How many times a legacy update is retried when someone else changed the object in between.
const CONFLICT_ATTEMPTS: usize = 3;

/// What a sync did, for the log.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncSummary {
    pub created: usize,
    pub updated: usize,
    pub unchanged: usize,
    /// Applied server-side (the API server does not say whether anything changed).
    pub applied: usize,
}

/// The manifest objects the node's Talos renders, flattened, in the order Talos lists them.
pub(super) async fn rendered_objects(
    client: &TalosClient,
    node: &str,
) -> Result<Vec<Json>, ExecuteError> {
    use resources::manifest as r;
    let mut manifests = client
        .cosi_list::<k8s_pb::ManifestSpec>(r::NAMESPACE, r::TYPE)
        .await
        .map_err(|e| {
            super::execute::classify(
                e,
                &format!("listing the bootstrap manifests of node {node}"),
            )
        })?;
    // Talos applies them in id order (`00-…`, `10-…`).
    manifests.sort_by(|a, b| a.metadata.id.cmp(&b.metadata.id));
    Ok(manifests
        .into_iter()
        .flat_map(|manifest| manifest.spec.items)
        .filter_map(|item| item.object)
        .map(|object| struct_to_json(&object))
        .collect())
}

/// Applies `objects` to the workload cluster in `mode`.
pub async fn apply_objects(
    workload: &kube::Client,
    objects: Vec<Json>,
    mode: ManifestMode,
) -> Result<SyncSummary, ExecuteError> {
    let mut objects = objects;
    // A stable sort: the rest keep Talos's order.
    objects.sort_by_key(|object| apply_rank(object.get("kind").and_then(Json::as_str)));
    let mut discovery = Discovery::default();
    let mut summary = SyncSummary::default();
    for object in objects {
        // Only apiVersion, kind and metadata are typed in a DynamicObject, so a decoding error can
        // quote those but never a Secret's data.
        let object: DynamicObject = serde_json::from_value(object).map_err(|e| {
            ExecuteError::Refused(format!("a bootstrap manifest object is malformed: {e}"))
        })?;
        let what = describe(&object);
        let Some(name) = object.metadata.name.clone() else {
            return Err(ExecuteError::Refused(format!(
                "bootstrap manifest {what} has no name"
            )));
        };
        let api = discovery.api_for(workload, &object, &what).await?;
        match mode {
            ManifestMode::ServerSideApply => {
                let params = PatchParams::apply(FIELD_MANAGER).force();
                api.patch(&name, &params, &Patch::Apply(&object))
                    .await
                    .map_err(|e| kube_error(e, &format!("applying {what}")))?;
                summary.applied += 1;
            }
            ManifestMode::Legacy => match legacy_apply(&api, &name, object, &what).await? {
                Legacy::Created => summary.created += 1,
                Legacy::Updated => summary.updated += 1,
                Legacy::Unchanged => summary.unchanged += 1,
            },
        }
    }
    Ok(summary)
}

enum Legacy {
    Created,
    Updated,
    Unchanged,
}

async fn legacy_apply(
    api: &Api<DynamicObject>,
    name: &str,
    object: DynamicObject,
    what: &str,
) -> Result<Legacy, ExecuteError> {
    for _ in 0..CONFLICT_ATTEMPTS {
        let current = api
            .get_opt(name)
            .await
            .map_err(|e| kube_error(e, &format!("reading {what}")))?;
        let Some(current) = current else {
            match api.create(&legacy_params(false), &object).await {
                Ok(_) => return Ok(Legacy::Created),
                // Created by someone else meanwhile: compare with theirs.
                Err(kube::Error::Api(status)) if status.code == 409 => continue,
                Err(error) => return Err(kube_error(error, &format!("creating {what}"))),
            }
        };
        let mut desired = object.clone();
        desired.metadata.resource_version = current.metadata.resource_version.clone();
        // The server's answer includes its defaults, so it compares like for like with what is stored.
        let would_be = match api.replace(name, &legacy_params(true), &desired).await {
            Ok(object) => object,
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(kube_error(error, &format!("checking {what} for changes"))),
        };
        if comparable(&would_be) == comparable(&current) {
            return Ok(Legacy::Unchanged);
        }
        match api.replace(name, &legacy_params(false), &desired).await {
            Ok(_) => return Ok(Legacy::Updated),
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(error) => return Err(kube_error(error, &format!("updating {what}"))),
        }
    }
    Err(ExecuteError::Transient(format!(
        "{what} kept changing while it was being updated; trying again later"
    )))
}

/// A legacy create or update (or its dry run), under [`LEGACY_FIELD_MANAGER`].
fn legacy_params(dry_run: bool) -> PostParams {
    PostParams {
        dry_run,
        field_manager: Some(LEGACY_FIELD_MANAGER.to_string()),
    }
}

/// An object as JSON without the bookkeeping a write changes whatever the content: `managedFields`
/// (timestamps), `resourceVersion` and `generation`.
fn comparable(object: &DynamicObject) -> Json {
    let mut value = serde_json::to_value(object).unwrap_or(Json::Null);
    if let Some(metadata) = value.get_mut("metadata").and_then(Json::as_object_mut) {
        for key in ["managedFields", "resourceVersion", "generation"] {
            metadata.remove(key);
        }
    }
    value
}

/// Objects others refer to come first.
fn apply_rank(kind: Option<&str>) -> u8 {
    match kind {
        Some("Namespace") => 0,
        Some("CustomResourceDefinition") => 1,
        Some("ServiceAccount") => 2,
        Some("ConfigMap") | Some("Secret") => 3,
        _ => 4,
    }
}

fn describe(object: &DynamicObject) -> String {
    let kind = object
        .types
        .as_ref()
        .map(|t| t.kind.as_str())
        .unwrap_or("object");
    match (&object.metadata.namespace, &object.metadata.name) {
        (Some(ns), Some(name)) => format!("{kind} {ns}/{name}"),
        (None, Some(name)) => format!("{kind} {name}"),
        (_, None) => format!("{kind} without a name"),
    }
}

/// API groups resolved during one sync; each group-version is asked for once.
#[derive(Default)]
struct Discovery {
    groups: HashMap<String, ApiGroup>,
}

impl Discovery {
    async fn api_for(
        &mut self,
        client: &kube::Client,
        object: &DynamicObject,
        what: &str,
    ) -> Result<Api<DynamicObject>, ExecuteError> {
        let Some(types) = object.types.as_ref() else {
            return Err(ExecuteError::Refused(format!(
                "bootstrap manifest {what} has no apiVersion or kind"
            )));
        };
        let (resource, capabilities) = self
            .resolve(client, &types.api_version, &types.kind, what)
            .await?;
        Ok(match capabilities.scope {
            Scope::Cluster => Api::all_with(client.clone(), &resource),
            Scope::Namespaced => {
                let namespace = object.metadata.namespace.as_deref().unwrap_or("default");
                Api::namespaced_with(client.clone(), namespace, &resource)
            }
        })
    }

    async fn resolve(
        &mut self,
        client: &kube::Client,
        api_version: &str,
        kind: &str,
        what: &str,
    ) -> Result<(ApiResource, ApiCapabilities), ExecuteError> {
        let gv: GroupVersion = api_version.parse().map_err(|_| {
            ExecuteError::Refused(format!(
                "bootstrap manifest {what} has an invalid apiVersion {api_version:?}"
            ))
        })?;
        if !self.groups.contains_key(api_version) {
            let group = discovery::pinned_group(client, &gv)
                .await
                .map_err(|e| kube_error(e, &format!("discovering the API of {what}")))?;
            self.groups.insert(api_version.to_string(), group);
        }
        self.groups
            .get(api_version)
            .and_then(|group| {
                group
                    .versioned_resources(&gv.version)
                    .into_iter()
                    .find(|(resource, _)| resource.kind == kind)
            })
            // Possibly a CRD applied moments ago that the API server does not serve yet.
            .ok_or_else(|| {
                ExecuteError::Transient(format!(
                    "the workload cluster does not serve {kind} in {api_version} (yet) for {what}"
                ))
            })
    }
}

/// Whether a Kubernetes API error is final. The API server's message names the object and the
/// problem; it never holds credentials.
fn kube_error(error: kube::Error, doing: &str) -> ExecuteError {
    match &error {
        // Conflicts, throttling and server-side trouble pass; not found here means the group or
        // namespace is not there yet (a CRD or Namespace applied in the same sync).
        kube::Error::Api(status)
            if matches!(status.code, 404 | 409 | 429) || status.code >= 500 =>
        {
            ExecuteError::Transient(format!("{doing} failed: {error}"))
        }
        // Invalid, forbidden, unsupported: the manifest or our rights are wrong.
        kube::Error::Api(_) => ExecuteError::Refused(format!("{doing} was refused: {error}")),
        _ => ExecuteError::Transient(format!("{doing} failed: {error}")),
    }
}

/// A `google.protobuf.Struct` (how Talos carries manifest objects) as JSON. Struct numbers are
/// doubles; whole numbers become JSON integers, because the API server refuses `2.0` for an integer
/// field such as `replicas` (protojson writes them as integers too).
pub fn struct_to_json(object: &prost_types::Struct) -> Json {
    Json::Object(
        object
            .fields
            .iter()
            .map(|(key, value)| (key.clone(), value_to_json(value)))
            .collect(),
    )
}

fn value_to_json(value: &prost_types::Value) -> Json {
    use prost_types::value::Kind;
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::BoolValue(b)) => Json::Bool(*b),
        Some(Kind::StringValue(s)) => Json::String(s.clone()),
        Some(Kind::NumberValue(n)) => number(*n),
        Some(Kind::ListValue(list)) => Json::Array(list.values.iter().map(value_to_json).collect()),
        Some(Kind::StructValue(object)) => struct_to_json(object),
    }
}

fn number(n: f64) -> Json {
    // 2^53: beyond it a double no longer holds every integer, so it cannot have been one exactly.
    const EXACT: f64 = 9_007_199_254_740_992.0;
    if n.fract() == 0.0 && n.abs() <= EXACT {
        Json::from(n as i64)
    } else {
        serde_json::Number::from_f64(n).map_or(Json::Null, Json::Number)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_types::value::Kind;
    use serde_json::json;

    fn value(kind: Kind) -> prost_types::Value {
        prost_types::Value { kind: Some(kind) }
    }

    #[test]
    fn structs_become_json_with_whole_numbers_as_integers() {
        let object = prost_types::Struct {
            fields: [
                ("replicas".to_string(), value(Kind::NumberValue(2.0))),
                ("ratio".to_string(), value(Kind::NumberValue(0.5))),
                ("name".to_string(), value(Kind::StringValue("x".into()))),
                (
                    "list".to_string(),
                    value(Kind::ListValue(prost_types::ListValue {
                        values: vec![value(Kind::BoolValue(true)), value(Kind::NullValue(0))],
                    })),
                ),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            struct_to_json(&object),
            json!({"replicas": 2, "ratio": 0.5, "name": "x", "list": [true, null]})
        );
    }

    #[test]
    fn legacy_writes_and_their_dry_runs_name_the_controller_as_field_manager() {
        for dry_run in [false, true] {
            let params = legacy_params(dry_run);
            assert_eq!(params.dry_run, dry_run);
            assert_eq!(
                params.field_manager.as_deref(),
                Some("talos-upgrade-controller")
            );
        }
    }

    #[test]
    fn referenced_kinds_go_first_and_the_rest_keep_their_order() {
        let mut kinds = vec![
            Some("DaemonSet"),
            Some("ConfigMap"),
            Some("Deployment"),
            Some("ServiceAccount"),
            Some("Namespace"),
            None,
        ];
        kinds.sort_by_key(|k| apply_rank(*k));
        assert_eq!(
            kinds,
            vec![
                Some("Namespace"),
                Some("ServiceAccount"),
                Some("ConfigMap"),
                Some("DaemonSet"),
                Some("Deployment"),
                None
            ]
        );
    }
}
