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

/// The eviction API in front of a PodDisruptionBudget, as the controller's drain meets it: the test control
/// plane runs the disruption controller, so a budget's status is real and evictions are refused (429) while
/// it allows no disruption, and granted once it does.
#[tokio::test]
async fn evictions_respect_pod_disruption_budgets_computed_by_the_disruption_controller() {
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::api::policy::v1::PodDisruptionBudget;
    use kube::api::{EvictParams, Patch, PatchParams};

    let ns = ControlPlane::shared().test_namespace("pdb").await;
    // kube's default client retries 429 answers for minutes; a refused eviction must come back at once.
    let kubeconfig = kube::config::Kubeconfig::read_from(ns.kubeconfig()).expect("kubeconfig");
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    config.default_retry = false;
    let client = kube::Client::try_from(config).expect("client");
    let pods: Api<Pod> = Api::namespaced(client, &ns.name);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(ns.client.clone(), &ns.name);
    let ready_pod = |name: &str| -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"app": "web"}},
            // Bound to a node that has no kubelet: the test plays the kubelet and reports the pod Ready.
            "spec": {"nodeName": "no-such-node", "containers": [{"name": "web", "image": "web:1"}]},
        }))
        .expect("pod")
    };
    let make_ready = |name: String| {
        let pods = pods.clone();
        async move {
            pods.create(&PostParams::default(), &ready_pod(&name))
                .await
                .expect("create pod");
            pods.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"status": {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}],
                }})),
            )
            .await
            .expect("pod status");
        }
    };
    make_ready("web-1".into()).await;
    let budget: PodDisruptionBudget = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    }))
    .expect("budget");
    budgets
        .create(&PostParams::default(), &budget)
        .await
        .expect("create budget");

    let control_plane = ns.control_plane();
    let wait_for_allowed = |allowed: i32| {
        let budgets = budgets.clone();
        async move {
            for _ in 0..300 {
                let status = budgets.get("web").await.expect("get budget").status;
                if let Some(status) = status
                    && status.observed_generation == Some(1)
                    && status.disruptions_allowed == allowed
                {
                    return;
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            panic!(
                "the disruption controller never set disruptionsAllowed={allowed} on the budget: {}",
                control_plane.failure_report()
            );
        }
    };
    wait_for_allowed(0).await;
    let refused = pods
        .evict("web-1", &EvictParams::default())
        .await
        .expect_err("eviction must be refused while the budget allows no disruption");
    match refused {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 429, "{status:?}");
            assert!(
                status.message.contains("disruption budget"),
                "{}",
                status.message
            );
        }
        other => panic!("unexpected error: {other}"),
    }

    make_ready("web-2".into()).await;
    wait_for_allowed(1).await;
    pods.evict("web-1", &EvictParams::default())
        .await
        .expect("eviction allowed once a second pod is healthy");
    let evicted = pods.get("web-1").await.expect("web-1");
    assert!(
        evicted.metadata.deletion_timestamp.is_some(),
        "an evicted pod is being deleted"
    );
}

/// The controller's API client (`api_client`, what the binary uses) negotiates HTTP/2 with the API
/// server, and more requests at once than the server allows streams on one connection (kube-apiserver:
/// 100 by default) all get their answers: the excess waits its turn on the client instead of failing.
#[tokio::test]
async fn the_controllers_api_client_speaks_http2_and_carries_more_requests_than_one_connections_streams()
 {
    let ns = ControlPlane::shared().test_namespace("api-client").await;
    let config = talos_upgrade_controller::api_client::config_from_file(ns.kubeconfig())
        .await
        .expect("config");
    let client = talos_upgrade_controller::api_client::client(config).expect("client");

    let path = format!("/api/v1/namespaces/{}/configmaps", ns.name);
    let request = || {
        http::Request::get(path.as_str())
            .body(kube::client::Body::empty())
            .expect("request")
    };
    let first = client.send(request()).await.expect("list configmaps");
    assert_eq!(first.status(), http::StatusCode::OK);
    assert_eq!(first.version(), http::Version::HTTP_2);

    const AT_ONCE: usize = 250;
    let answers = futures::future::join_all((0..AT_ONCE).map(|_| client.send(request()))).await;
    let statuses: Vec<String> = answers
        .iter()
        .map(|answer| match answer {
            Ok(response) => format!("{:?} {}", response.version(), response.status()),
            Err(error) => format!("error: {error}"),
        })
        .collect();
    assert!(
        statuses.iter().all(|s| s == "HTTP/2.0 200 OK"),
        "{statuses:?}"
    );
    assert_eq!(statuses.len(), AT_ONCE);
}
