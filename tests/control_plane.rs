//! Proves the test control plane: a real kube-apiserver v1.34 + etcd, the real `kubectl`, CRDs,
//! annotations, `kubectl wait`, and RBAC that actually denies.

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, PostParams};
use testenv::ControlPlane;

const WIDGET_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.testenv.example
spec:
  group: smoke.testenv.example
  scope: Namespaced
  names: {plural: widgets, singular: widget, kind: Widget}
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
"#;

fn widget_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("smoke.testenv.example", "v1", "Widget"),
        "widgets",
    )
}

async fn install_widget_crd(ns: &testenv::TestNamespace) {
    ns.install_crd(WIDGET_CRD, "widgets.smoke.testenv.example")
        .await;
}

fn is_forbidden(result: &Result<impl std::fmt::Debug, kube::Error>) -> bool {
    matches!(result, Err(kube::Error::Api(status)) if status.code == 403)
}

#[tokio::test]
async fn kube_apiserver_is_v1_34_and_kubectl_matches() {
    let ns = ControlPlane::shared().test_namespace("version").await;
    let version = ns.client.apiserver_version().await.expect("GET /version");
    assert_eq!(
        (version.major.as_str(), version.minor.as_str()),
        ("1", "34")
    );
    assert!(
        version.git_version.starts_with("v1.34."),
        "gitVersion {}",
        version.git_version
    );
    let client_version = ns.kubectl_ok(&["version", "--client", "-o", "json"]).await;
    let parsed: serde_json::Value = serde_json::from_str(&client_version).expect("kubectl JSON");
    let kubectl_git = parsed["clientVersion"]["gitVersion"].as_str().unwrap_or("");
    assert!(kubectl_git.starts_with("v1.34."), "kubectl {kubectl_git}");
}

#[tokio::test]
async fn kubectl_annotate_and_wait_on_a_custom_resource() {
    let ns = ControlPlane::shared().test_namespace("annotate").await;
    install_widget_crd(&ns).await;

    let widgets: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &widget_resource());
    let mut widget = DynamicObject::new("w1", &widget_resource());
    widget.data = serde_json::json!({"spec": {"size": 3}});
    widgets
        .create(&PostParams::default(), &widget)
        .await
        .expect("create widget");

    ns.kubectl_ok(&["annotate", "widget", "w1", "x=y"]).await;
    let waited = ns
        .kubectl_ok(&[
            "wait",
            "--for=jsonpath={.metadata.annotations.x}=y",
            "widget/w1",
            "--timeout=30s",
        ])
        .await;
    assert!(
        waited.contains("condition met"),
        "kubectl wait said: {waited}"
    );

    // The annotation is visible through the Rust client too, and the spec is untouched.
    let stored = widgets.get("w1").await.expect("get widget");
    assert_eq!(
        stored.metadata.annotations.unwrap_or_default().get("x"),
        Some(&"y".to_string())
    );
    assert_eq!(stored.data["spec"]["size"], 3);

    // Structural schemas prune unknown fields, as they will for the controller's CRD.
    let mut extra = DynamicObject::new("w2", &widget_resource());
    extra.data = serde_json::json!({"spec": {"size": 1, "colour": "red"}});
    let created = widgets
        .create(&PostParams::default(), &extra)
        .await
        .expect("create widget with an unknown field");
    assert!(created.data["spec"].get("colour").is_none());
}

#[tokio::test]
async fn rbac_denies_users_and_service_accounts_without_rights() {
    let ns = ControlPlane::shared().test_namespace("rbac").await;
    install_widget_crd(&ns).await;
    let control_plane = ns.control_plane();

    // An impersonated user with no bindings is refused with 403, by the Rust client and by kubectl.
    let alice = control_plane
        .client_as_user("alice", &["smoke-testers"])
        .await
        .expect("client as alice");
    let secrets: Api<Secret> = Api::namespaced(alice.clone(), &ns.name);
    let denied = secrets.list(&ListParams::default()).await;
    assert!(is_forbidden(&denied), "expected 403, got {denied:?}");

    let alice_kubeconfig = ns.kubeconfig_as_user("alice", &["smoke-testers"]);
    let refused = ns
        .kubectl_with(&alice_kubeconfig, &["get", "widgets"], None)
        .await;
    assert!(!refused.success, "alice listed widgets: {}", refused.stdout);
    assert!(
        refused.stderr.contains("Forbidden") && refused.stderr.contains("\"alice\""),
        "stderr: {}",
        refused.stderr
    );

    // A Role bound to her group grants exactly what it says, and nothing more.
    ns.kubectl_apply(&format!(
        r#"
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: widget-reader, namespace: {ns}}}
rules:
- apiGroups: [smoke.testenv.example]
  resources: [widgets]
  verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: widget-readers, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: widget-reader}}
subjects:
- {{apiGroup: rbac.authorization.k8s.io, kind: Group, name: smoke-testers}}
"#,
        ns = ns.name
    ))
    .await;
    let allowed = ns
        .kubectl_with(&alice_kubeconfig, &["get", "widgets"], None)
        .await;
    assert!(allowed.success, "alice still refused: {}", allowed.stderr);
    let still_denied = secrets.list(&ListParams::default()).await;
    assert!(is_forbidden(&still_denied), "secrets: {still_denied:?}");

    // A real ServiceAccount token (TokenRequest API, verified by the apiserver's signing key) is subject to
    // RBAC too.
    let robot = control_plane
        .client_for_service_account(&ns.name, "robot")
        .await
        .expect("service account client");
    let robot_widgets: Api<DynamicObject> =
        Api::namespaced_with(robot, &ns.name, &widget_resource());
    let robot_denied = robot_widgets.list(&ListParams::default()).await;
    assert!(
        is_forbidden(&robot_denied),
        "expected 403, got {robot_denied:?}"
    );
}
