//! The project's KubernetesCluster CRD (src/crd.rs, deploy/crd.yaml) against a real kube-apiserver: it is
//! up to date, installs, keeps every field vitistack writes, reads objects with and without a status,
//! shows its printer columns, and the status the controller writes satisfies vitistack's own schema.

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use talos_upgrade_core::crd::{
    self, ClusterCondition, KubernetesCluster, KubernetesClusterStatus, Phase, condition,
};
use testenv::{ControlPlane, TestNamespace};
use tokio::sync::OnceCell;

/// vitistack's published CRD (vitistack/common @ 26fba3f).
const VITISTACK_CRD: &str =
    include_str!("../fixtures/vitistack-crds/vitistack.io_kubernetesclusters.yaml");
/// vitistack's CRD is installed under this group instead of vitistack.io, so it can sit beside ours
/// (only one `kubernetesclusters.vitistack.io` can exist per API server).
const VITISTACK_COPY_GROUP: &str = "vitistack-schema.test";

/// The realistic object of vitistack-compat.md §2, as vitistack's operator writes it, with the fields
/// the controller does not model (storage, metadata, autoscaling, taint, status.state, a `Valid`
/// condition). `NAMESPACE` is replaced by the test's namespace.
const VITISTACK_EXAMPLE: &str = include_str!("../fixtures/vitistack-kubernetescluster.yaml");

/// Installs our CRD once per test binary (tests run concurrently; two racing `kubectl apply`s could
/// both try to create it) and waits until it is served.
async fn install_crd(ns: &TestNamespace) {
    static INSTALLED: OnceCell<()> = OnceCell::const_new();
    INSTALLED
        .get_or_init(|| async {
            ns.kubectl_apply(&crd::crd_yaml()).await;
            wait_established(ns, "kubernetesclusters.vitistack.io").await;
        })
        .await;
}

async fn wait_established(ns: &TestNamespace, crd_name: &str) {
    ns.wait_crd_established(crd_name).await;
}

fn example(namespace: &str) -> Value {
    serde_yaml::from_str(&VITISTACK_EXAMPLE.replace("NAMESPACE", namespace)).expect("example YAML")
}

fn dynamic_api(ns: &TestNamespace, resource: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(ns.client.clone(), &ns.name, resource)
}

fn our_resource() -> ApiResource {
    ApiResource::erase::<KubernetesCluster>(&())
}

/// Creates the object, then writes its status through the status subresource (create ignores it).
async fn create_with_status(api: &Api<DynamicObject>, object: &Value) -> DynamicObject {
    let created: DynamicObject = serde_json::from_value(object.clone()).expect("object");
    let name = created.metadata.name.clone().expect("name");
    api.create(&PostParams::default(), &created)
        .await
        .unwrap_or_else(|e| panic!("creating {name}: {e}"));
    if let Some(status) = object.get("status") {
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .unwrap_or_else(|e| panic!("writing the status of {name}: {e}"))
    } else {
        api.get(&name).await.expect("read back")
    }
}

#[test]
fn committed_crd_is_up_to_date() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/crd.yaml");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == crd::crd_yaml(),
        "deploy/crd.yaml is not what src/crd.rs generates; regenerate it with\n\n    \
         cargo run -- crd > deploy/crd.yaml\n"
    );
}

#[tokio::test]
async fn vitistack_object_round_trips_without_losing_fields() {
    let ns = ControlPlane::shared().test_namespace("crd-roundtrip").await;
    install_crd(&ns).await;
    let original = example(&ns.name);
    let raw = dynamic_api(&ns, &our_resource());
    let stored = create_with_status(&raw, &original).await;

    // Every field survives the API server (nothing pruned), exactly as written.
    assert_eq!(stored.data["spec"], original["spec"]);
    assert_eq!(stored.data["status"], original["status"]);

    // The typed read sees what the controller needs.
    let typed: Api<KubernetesCluster> = Api::namespaced(ns.client.clone(), &ns.name);
    let kc = typed.get("t-test-001-4y8e").await.expect("typed read");
    assert_eq!(kc.cluster_id(), Some("t-test-001-4y8e"));
    assert_eq!(kc.topology_version(), Some("1.35.4"));
    assert_eq!(
        kc.phase().and_then(Phase::parse),
        Some(Phase::UpgradingTalos)
    );
    assert_eq!(
        kc.annotation("upgrade.vitistack.io/talos-current"),
        Some("v1.12.7")
    );
    let status = kc.status.clone().expect("status");
    assert_eq!(status.workers, Some(3));
    assert_eq!(status.conditions.len(), 2);

    // A full write of the typed object (which the controller never does) loses nothing either.
    let replaced = typed
        .replace("t-test-001-4y8e", &PostParams::default(), &kc)
        .await
        .expect("replace");
    assert_eq!(
        replaced.metadata.resource_version,
        kc.metadata.resource_version
    );
    typed
        .replace_status("t-test-001-4y8e", &PostParams::default(), &kc)
        .await
        .expect("replace status");
    let after = raw.get("t-test-001-4y8e").await.expect("raw read");
    assert_eq!(after.data["spec"], original["spec"]);
    assert_eq!(after.data["status"], original["status"]);

    // The controller's status write changes its condition and phase and nothing else.
    let now = jiff::Timestamp::now();
    let mut desired = status.clone();
    desired.phase = Some(Phase::Ready.to_string());
    assert!(crd::set_condition(
        &mut desired.conditions,
        condition::TALOS_UPGRADE,
        false,
        condition::Reason::Completed.as_str(),
        "Talos upgrade completed: now running 1.13.7",
        now,
    ));
    let patch =
        KubernetesClusterStatus::merge_patch(Some(&status), &desired, now).expect("a change");
    assert!(patch["status"].get("state").is_none(), "{patch}");
    typed
        .patch_status(
            "t-test-001-4y8e",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .expect("status patch");
    let after = raw.get("t-test-001-4y8e").await.expect("raw read");
    let mut want = original["status"].clone();
    want["phase"] = json!("Ready");
    want["conditions"][1] = serde_json::to_value(&desired.conditions[1]).unwrap();
    assert_eq!(after.data["status"], want);
    assert_eq!(
        after.data["status"]["conditions"][1]["lastTransitionTime"],
        crd::format_time(now)
    );
    assert_eq!(after.data["spec"], original["spec"]);
}

#[tokio::test]
async fn cluster_without_status_reads_and_gets_a_complete_status() {
    let ns = ControlPlane::shared().test_namespace("crd-nostatus").await;
    install_crd(&ns).await;
    ns.kubectl_apply(
        "apiVersion: vitistack.io/v1alpha1\n\
         kind: KubernetesCluster\n\
         metadata: {name: bare}\n\
         spec: {data: {clusterId: bare-1}}\n",
    )
    .await;

    let typed: Api<KubernetesCluster> = Api::namespaced(ns.client.clone(), &ns.name);
    let kc = typed
        .get("bare")
        .await
        .expect("typed read of a cluster without status");
    assert_eq!(kc.status, None);
    assert_eq!(kc.cluster_id(), Some("bare-1"));
    assert_eq!(kc.topology_version(), None);
    let listed = typed.list(&Default::default()).await.expect("list");
    assert_eq!(listed.items.len(), 1);

    let now = jiff::Timestamp::now();
    let mut desired = KubernetesClusterStatus {
        phase: Some(Phase::UpgradingTalos.to_string()),
        ..Default::default()
    };
    crd::set_condition(
        &mut desired.conditions,
        condition::TALOS_UPGRADE,
        true,
        condition::Reason::InProgress.as_str(),
        "Upgrading node cp-1 (1/3)",
        now,
    );
    let patch = KubernetesClusterStatus::merge_patch(None, &desired, now).expect("a change");
    typed
        .patch_status("bare", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("status patch");
    let status = typed.get("bare").await.unwrap().status.expect("status");
    assert_eq!(status.phase.as_deref(), Some("UpgradingTalos"));
    assert_eq!(status.conditions, desired.conditions);
    assert_eq!(
        status.state.as_ref().unwrap()["lastUpdatedBy"],
        crd::FIELD_OWNER
    );
}

#[tokio::test]
async fn kubectl_get_shows_the_printer_columns() {
    let ns = ControlPlane::shared().test_namespace("crd-columns").await;
    install_crd(&ns).await;
    create_with_status(&dynamic_api(&ns, &our_resource()), &example(&ns.name)).await;

    let wide = ns.kubectl_ok(&["get", "kc", "-o", "wide"]).await;
    let mut lines = wide.lines();
    let header: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME", "PHASE", "TALOS", "K8S", "PROVIDER", "REGION", "CPS", "WORKERS", "MESSAGE",
            "AGE"
        ],
        "{wide}"
    );
    let row: Vec<&str> = lines.next().unwrap_or("").split_whitespace().collect();
    assert_eq!(
        row[..8],
        [
            "t-test-001-4y8e",
            "UpgradingTalos",
            "v1.12.7",
            "1.35.4",
            "talos",
            "south",
            "1",
            "3"
        ],
        "{wide}"
    );
    assert!(wide.contains("Upgrading Talos"), "{wide}");

    // Message has priority 1: only in the wide output, as in vitistack's CRD.
    let narrow = ns.kubectl_ok(&["get", "kubernetesclusters"]).await;
    assert!(!narrow.contains("MESSAGE"), "{narrow}");
    assert!(narrow.contains("TALOS"), "{narrow}");
}

/// vitistack's own CRD requires `phase`, `conditions` and a fully populated `state` once a status
/// exists; the status the controller creates from nothing must pass its validation.
#[tokio::test]
async fn status_created_from_nothing_satisfies_vitistacks_schema() {
    let ns = ControlPlane::shared().test_namespace("crd-vitistack").await;
    let copy = VITISTACK_CRD.replace("vitistack.io", VITISTACK_COPY_GROUP);
    assert_eq!(
        copy.matches(VITISTACK_COPY_GROUP).count(),
        2,
        "the fixture changed"
    );
    ns.kubectl_apply(&copy).await;
    wait_established(&ns, &format!("kubernetesclusters.{VITISTACK_COPY_GROUP}")).await;
    let resource = ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(VITISTACK_COPY_GROUP, "v1alpha1", "KubernetesCluster"),
        "kubernetesclusters",
    );
    let api = dynamic_api(&ns, &resource);

    let mut object = example(&ns.name);
    object["apiVersion"] = json!(format!("{VITISTACK_COPY_GROUP}/v1alpha1"));
    object.as_object_mut().unwrap().remove("status");
    create_with_status(&api, &object).await;

    // The check is real: a status without a complete state is rejected.
    let rejected = api
        .patch_status(
            "t-test-001-4y8e",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Ready", "conditions": []}})),
        )
        .await;
    assert!(
        matches!(&rejected, Err(kube::Error::Api(status)) if status.code == 422),
        "{rejected:?}"
    );

    let now = jiff::Timestamp::now();
    let mut desired = KubernetesClusterStatus::default();
    crd::set_condition(
        &mut desired.conditions,
        condition::KUBERNETES_UPGRADE,
        false,
        condition::Reason::Blocked.as_str(),
        "Waiting for Talos upgrade to complete",
        now,
    );
    let patch = KubernetesClusterStatus::merge_patch(None, &desired, now).expect("a change");
    let written = api
        .patch_status(
            "t-test-001-4y8e",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap_or_else(|e| panic!("vitistack's schema rejected {patch}: {e}"));
    let status = &written.data["status"];
    assert_eq!(status["phase"], "");
    let conditions: Vec<ClusterCondition> =
        serde_json::from_value(status["conditions"].clone()).unwrap();
    assert_eq!(conditions, desired.conditions);

    // Once written, it reads back as our type, and later patches need no state.
    let kc: KubernetesCluster = serde_json::from_value(json!({
        "apiVersion": "vitistack.io/v1alpha1",
        "kind": "KubernetesCluster",
        "metadata": written.metadata,
        "spec": written.data["spec"],
        "status": status,
    }))
    .expect("typed");
    let current = kc.status.expect("status");
    let mut desired = current.clone();
    desired.phase = Some(Phase::UpgradingKubernetes.to_string());
    let patch = KubernetesClusterStatus::merge_patch(Some(&current), &desired, now).unwrap();
    assert_eq!(patch, json!({"status": {"phase": "UpgradingKubernetes"}}));
    api.patch_status(
        "t-test-001-4y8e",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .expect("phase patch accepted by vitistack's schema");
}
