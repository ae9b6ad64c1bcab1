//! The health checks (issue #23 item 5) against real objects: the workload cluster of the test world
//! is the test API server itself, so the objects the checks read are created there, in the test's
//! namespace: a `StorageHealth` of a test CRD (standing for a storage system's health resource, such as
//! Rook's CephCluster) whose status the test writes through the status subresource, and a Deployment
//! whose status the test writes the same way (the test API server runs no deployment controller).
//!
//! What is asserted is what a user sees: `talos-status` and `talos-message`, the cluster's Events, the
//! hold metric, and the upgrade calls the simulated nodes received.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use serde_json::json;
use talos_sim::Fault;

use crate::world::{World, WorldSpec};

const PATIENCE: Duration = Duration::from_secs(120);

/// A namespaced kind with a status subresource and any fields: a storage system's health resource.
const STORAGE_HEALTH_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: storagehealths.e2e.health.vitistack.io
spec:
  group: e2e.health.vitistack.io
  scope: Namespaced
  names: {plural: storagehealths, singular: storagehealth, kind: StorageHealth, listKind: StorageHealthList}
  versions:
    - name: v1
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
"#;

const GROUP: &str = "e2e.health.vitistack.io";

/// One control plane and two workers (workers go first), the controller started.
fn small() -> WorldSpec {
    WorldSpec {
        control_planes: 1,
        workers: 2,
        ..WorldSpec::default()
    }
}

fn storage_health(world: &World) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, "v1", "StorageHealth"));
    Api::namespaced_with(world.ns.client.clone(), &world.ns.name, &resource)
}

/// Installs the CRD and creates StorageHealth `name` reporting `health`.
async fn create_storage(world: &World, name: &str, health: &str) {
    test_world::install_crd(&world.ns.client, STORAGE_HEALTH_CRD)
        .await
        .expect("the StorageHealth CRD");
    let api = storage_health(world);
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"),
        "kind": "StorageHealth",
        "metadata": {"name": name, "labels": {"app": "storage"}},
        "spec": {"pool": "replicated"},
    }))
    .expect("a StorageHealth");
    api.create(&PostParams::default(), &object)
        .await
        .expect("create the StorageHealth");
    set_storage(world, name, health).await;
}

/// Writes `status.health` of StorageHealth `name`, as its operator would.
async fn set_storage(world: &World, name: &str, health: &str) {
    storage_health(world)
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"health": health}})),
        )
        .await
        .expect("the StorageHealth's status");
}

/// The check of the storage system: healthy when it says HEALTH_OK. A YAML list, as a user writes it.
fn storage_check(world: &World) -> String {
    format!(
        "- check: storage\n  apiVersion: {GROUP}/v1\n  kind: StorageHealth\n  namespace: {}\n  \
         name: ceph\n  condition:\n    cel: object.status.health == 'HEALTH_OK'\n",
        world.ns.name
    )
}

fn hold_metric(world: &World, name: &str) -> Option<String> {
    world
        .metrics
        .encode()
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && l.contains("gate=\"health-checks\""))
        .and_then(|l| l.rsplit(' ').next().map(str::to_string))
}

async fn wait_for_message(world: &World, words: &str) -> String {
    world
        .wait_for_annotation_matching(
            "talos-message",
            PATIENCE,
            &format!("a message saying {words:?}"),
            |m| m.contains(words),
        )
        .await
}

/// The run held before its first node, as a user sees it: in progress, the message saying why, an
/// Event saying the same, and not one upgrade call.
async fn assert_held(world: &World, words: &str) -> String {
    let message = wait_for_message(world, words).await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    assert!(message.starts_with("Waiting: "), "{message}");
    let events = world.events().await;
    assert!(
        events
            .iter()
            .any(|(reason, m)| reason == "UpgradeWaiting" && m.contains(words)),
        "no UpgradeWaiting Event says {words:?}: {events:#?}"
    );
    assert_eq!(world.upgrade_calls(), Vec::<String>::new(), "{message}");
    message
}

/// Sets the checks to `checks` and asserts that the run holds saying `words` ([`assert_held`]).
async fn checks_hold(world: &World, checks: &str, words: &str) {
    world.annotate("health-checks", checks).await;
    assert_held(world, words).await;
}

/// Once the controller has read the cluster, the storage check and a run to 1.12.0.
async fn start_with_storage_check(world: &World) {
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world.annotate("health-checks", &storage_check(world)).await;
    world.annotate("talos-target", "1.12.0").await;
}

/// The run completes, every node upgraded once.
async fn assert_completed(world: &World) {
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_each_node_upgraded_once(3);
}

/// Writes the Available condition of Deployment `web`, as the deployment controller would.
async fn set_availability(deployments: &Api<Deployment>, status: &str, reason: &str) {
    let availability = json!({"status": {"conditions": [{
        "type": "Available", "status": status, "reason": reason,
        "message": "Deployment does not have minimum availability.",
    }]}});
    deployments
        .patch_status("web", &PatchParams::default(), &Patch::Merge(availability))
        .await
        .expect("the Deployment's status");
}

#[tokio::test]
async fn a_failing_check_holds_the_run_across_a_restart_until_the_object_is_healthy() {
    let world = World::start("health-hold", small()).await;
    create_storage(&world, "ceph", "HEALTH_WARN").await;
    start_with_storage_check(&world).await;

    let expected = format!(
        "Waiting: health check \"storage\" failing: StorageHealth {}/ceph: object.status.health == \
         'HEALTH_OK' is false (0/3 done)",
        world.ns.name
    );
    let message = assert_held(&world, "health check \"storage\" failing").await;
    assert_eq!(message, expected);
    assert_eq!(
        hold_metric(&world, "talos_upgrade_hold").as_deref(),
        Some("1")
    );
    assert_eq!(
        hold_metric(&world, "talos_upgrade_holds_total").as_deref(),
        Some("1")
    );

    // A new controller reads the object again and holds again, without a second Event.
    world.restart_controller().await;
    world.wait_for_reconciles(3, PATIENCE).await;
    assert_eq!(assert_held(&world, &expected).await, expected);
    assert_eq!(world.event_count("UpgradeWaiting").await, 1);

    // The storage system recovers: the run goes on, every node once.
    set_storage(&world, "ceph", "HEALTH_OK").await;
    assert_completed(&world).await;
    assert_eq!(
        hold_metric(&world, "talos_upgrade_hold").as_deref(),
        Some("0")
    );
}

#[tokio::test]
async fn available_conditions_missing_objects_and_unknown_kinds_hold_and_say_why() {
    let world = World::start("health-kinds", small()).await;
    create_storage(&world, "ceph", "HEALTH_OK").await;
    let ns = world.ns.name.clone();
    // A Deployment the deployment controller would report unavailable (the test API server runs
    // none, so the test writes its status).
    let deployments: Api<Deployment> = Api::namespaced(world.ns.client.clone(), &ns);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web", "labels": {"app": "web"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "registry.invalid/web:1"}]},
            },
        },
    }))
    .expect("a Deployment");
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .expect("create the Deployment");
    set_availability(&deployments, "False", "MinimumReplicasUnavailable").await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;

    // A kind its group does not have.
    world
        .annotate(
            "health-checks",
            &format!(
                "[{{check: ghost, apiVersion: {GROUP}/v1, kind: GhostHealth, namespace: {ns}, \
                 name: ceph, condition: Ready}}]"
            ),
        )
        .await;
    world.annotate("talos-target", "1.12.0").await;
    assert_held(
        &world,
        &format!("health check \"ghost\" cannot be evaluated: no kind GhostHealth in {GROUP}/v1"),
    )
    .await;

    // A group the cluster does not serve.
    checks_hold(
        &world,
        "[{check: rook, apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: rook-ceph, \
             name: rook-ceph, condition: 'cel: object.status.ceph.health == \"HEALTH_OK\"'}]",
        "health check \"rook\" cannot be evaluated: no kind CephCluster in ceph.rook.io/v1: the \
         cluster does not serve ceph.rook.io/v1",
    )
    .await;

    // A named object that is not there, and a selector that matches nothing: a typo holds.
    checks_hold(
        &world,
        &format!(
            "[{{check: storage, apiVersion: {GROUP}/v1, kind: StorageHealth, namespace: {ns}, \
                 name: cepth, condition: 'cel: object.status.health == \"HEALTH_OK\"'}}]"
        ),
        &format!(
            "health check \"storage\" cannot be evaluated: StorageHealth {ns}/cepth not found"
        ),
    )
    .await;
    checks_hold(
        &world,
        &format!(
            "[{{check: web, apiVersion: apps/v1, kind: Deployment, namespace: {ns}, selector: \
                 app=wbe, condition: Available}}]"
        ),
        &format!(
            "health check \"web\" cannot be evaluated: no Deployment in namespace {ns} matches the \
             selector app=wbe"
        ),
    )
    .await;

    // The Deployment's Available condition, with both checks: the failing one is named.
    checks_hold(
        &world,
        &format!(
            "[{{check: storage, apiVersion: {GROUP}/v1, kind: StorageHealth, namespace: {ns}, \
                 selector: app=storage, condition: 'cel: object.status.health == \"HEALTH_OK\"'}}, \
                 {{check: web, apiVersion: apps/v1, kind: Deployment, namespace: {ns}, selector: \
                 app=web, condition: Available}}]"
        ),
        &format!(
            "health check \"web\" failing: Deployment {ns}/web: condition Available is False \
             (MinimumReplicasUnavailable: Deployment does not have minimum availability.)"
        ),
    )
    .await;
    set_availability(&deployments, "True", "MinimumReplicasAvailable").await;
    assert_completed(&world).await;
}

#[tokio::test]
async fn an_invalid_annotation_keeps_the_run_from_starting_and_touches_no_node() {
    let world = World::start("health-invalid", small()).await;
    world
        .wait_for_annotation("talos-current", "1.11.6", "60s")
        .await;
    world
        .annotate(
            "health-checks",
            "[{check: ceph, apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: rook-ceph, \
             name: rook-ceph, selector: app=ceph, condition: Ready}]",
        )
        .await;
    world.annotate("talos-target", "1.12.0").await;
    let refused = wait_for_message(&world, "upgrade.vitistack.io/health-checks").await;
    assert!(
        refused.starts_with(
            "Talos upgrade not started: Annotation upgrade.vitistack.io/health-checks has the \
             invalid value "
        ),
        "{refused}"
    );
    assert!(
        refused.ends_with(
            "health check \"ceph\": both name and selector are given; use name for one object or \
             selector for every object it matches"
        ),
        "{refused}"
    );
    assert_eq!(world.annotation("talos-status").await, "failed");
    let invalid = world.event_messages("InvalidOption").await;
    assert!(
        invalid.iter().any(|m| m.contains("both name and selector")),
        "{invalid:?}"
    );

    // An expression that does not compile is refused the same way.
    world
        .annotate(
            "health-checks",
            "[{check: ceph, apiVersion: ceph.rook.io/v1, kind: CephCluster, namespace: rook-ceph, \
             name: rook-ceph, condition: 'cel: object.status.ceph.health =='}]",
        )
        .await;
    wait_for_message(
        &world,
        "health check \"ceph\": the CEL expression does not compile: 1:",
    )
    .await;
    assert_eq!(world.annotation("talos-status").await, "failed");
    assert_eq!(world.upgrade_calls(), Vec::<String>::new());

    // Without the checks, the run starts.
    world.remove_annotation("health-checks").await;
    assert_completed(&world).await;
}

#[tokio::test]
async fn a_check_failing_mid_run_holds_the_next_node_while_the_node_in_flight_finishes() {
    let world = World::start("health-midrun", small()).await;
    create_storage(&world, "ceph", "HEALTH_OK").await;
    let first = world.node("worker-1");
    // The first node stays down after its reboot until the fault is cleared: in flight for as long
    // as the test needs.
    world
        .sim
        .inject_fault(&first, Fault::NeverReturns)
        .expect("fault");
    start_with_storage_check(&world).await;
    wait_for_message(&world, &format!("node {first}")).await;

    // The storage system degrades while the first node is down; the node still finishes.
    set_storage(&world, "ceph", "HEALTH_WARN").await;
    world.wait_for_reconciles(3, PATIENCE).await;
    world.sim.clear_faults(&first).expect("clear");
    let expected = format!(
        "Waiting: health check \"storage\" failing: StorageHealth {}/ceph: object.status.health == \
         'HEALTH_OK' is false (1/3 done)",
        world.ns.name
    );
    world
        .wait_for_annotation_matching("talos-message", PATIENCE, &expected, |m| m == expected)
        .await;
    assert_eq!(world.annotation("talos-status").await, "in-progress");
    assert_eq!(world.upgrade_calls(), vec![first.clone()]);
    world.wait_for_reconciles(3, PATIENCE).await;
    assert_eq!(world.upgrade_calls(), vec![first]);

    set_storage(&world, "ceph", "HEALTH_OK").await;
    assert_completed(&world).await;
}

#[tokio::test]
async fn a_read_the_workload_credentials_may_not_make_holds_and_never_shows_them() {
    use k8s_openapi::api::core::v1::Secret;
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};

    let world = World::start("health-forbidden", small()).await;
    create_storage(&world, "ceph", "HEALTH_OK").await;
    let ns = world.ns.name.clone();
    let client = world.ns.client.clone();
    // The workload credentials become a user who may do what an upgrade needs (Nodes, Pods,
    // evictions) but may not read StorageHealths.
    let user = format!("{ns}-upgrader");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": user},
        "rules": [{"apiGroups": ["", "apps", "policy"], "resources": ["*"], "verbs": ["*"]}],
    }))
    .expect("a ClusterRole");
    Api::<ClusterRole>::all(client.clone())
        .create(&PostParams::default(), &role)
        .await
        .expect("create the ClusterRole");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))
    .expect("a ClusterRoleBinding");
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&PostParams::default(), &binding)
        .await
        .expect("create the ClusterRoleBinding");
    let kubeconfig = std::fs::read_to_string(world.ns.kubeconfig_as_user(&user, &[]))
        .expect("the user's kubeconfig");
    let token = kubeconfig
        .lines()
        .find_map(|line| line.trim().strip_prefix("token: "))
        .map(|token| token.trim_matches('"').to_string())
        .expect("the kubeconfig's token");
    Api::<Secret>::namespaced(client.clone(), &ns)
        .patch(
            &format!("{ns}-id"),
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"kube.config": kubeconfig}})),
        )
        .await
        .expect("the credentials Secret's kube.config");
    start_with_storage_check(&world).await;

    let message = assert_held(
        &world,
        &format!("health check \"storage\" cannot be evaluated: reading StorageHealth {ns}/ceph: "),
    )
    .await;
    assert!(
        message.contains(&format!(
            "User \"{user}\" cannot get resource \"storagehealths\""
        )) && message.contains("(403 Forbidden)"),
        "{message}"
    );
    let events = world.events().await;
    assert!(
        !message.contains(&token) && events.iter().all(|(_, m)| !m.contains(&token)),
        "the workload token is shown"
    );

    // Allowed to read them: the check passes and the run goes.
    let reader: Role = serde_json::from_value(json!({
        "metadata": {"name": "storage-reader"},
        "rules": [{"apiGroups": [GROUP], "resources": ["storagehealths"], "verbs": ["get", "list"]}],
    }))
    .expect("a Role");
    Api::<Role>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &reader)
        .await
        .expect("create the Role");
    let reading: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "storage-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "storage-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))
    .expect("a RoleBinding");
    Api::<RoleBinding>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &reading)
        .await
        .expect("create the RoleBinding");
    assert_completed(&world).await;
}
