//! The production manifests (deploy/, a kustomize base) against a real kube-apiserver: `kubectl apply -k
//! deploy/` installs everything (with the real prometheus-operator CRDs for the ServiceMonitor and the
//! PrometheusRule), the pieces fit together (the Service finds the pods, the ServiceMonitor finds the
//! Service, the pods pass the `restricted` Pod Security admission of their namespace), the ServiceAccount
//! may do exactly what the controller does and nothing else, and a whole Talos upgrade runs with the
//! controller authenticated as that ServiceAccount.

use std::path::Path;
use std::time::Duration;

use crate::world::{World, WorldSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use serde_json::Value;
use talos_api::ConnectOptions;
use talos_upgrade_controller::admin::HealthState;
use talos_upgrade_controller::reconcile::{self, Settings};
use testenv::{ControlPlane, TestNamespace};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

/// Where `kubectl apply -k` puts the controller, and its ServiceAccount.
const NAMESPACE: &str = "talos-upgrade-controller";
const SERVICE_ACCOUNT: &str = "talos-upgrade-controller";

const SERVICE_MONITOR_CRD: &str =
    include_str!("../fixtures/monitoring/monitoring.coreos.com_servicemonitors.yaml");
const PROMETHEUS_RULE_CRD: &str =
    include_str!("../fixtures/monitoring/monitoring.coreos.com_prometheusrules.yaml");

fn deploy_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/deploy").to_string()
}

/// Installs the prometheus-operator CRDs, then `kubectl apply -k deploy/`, once per test binary (the
/// base holds cluster-scoped objects; two applies racing to create them would fail). Returns what the
/// apply printed.
async fn deploy(ns: &TestNamespace) -> &'static str {
    static APPLIED: OnceCell<String> = OnceCell::const_new();
    APPLIED
        .get_or_init(|| async {
            ns.install_crd(SERVICE_MONITOR_CRD, "servicemonitors.monitoring.coreos.com")
                .await;
            ns.install_crd(PROMETHEUS_RULE_CRD, "prometheusrules.monitoring.coreos.com")
                .await;
            ns.kubectl_ok(&["apply", "-k", &deploy_dir()]).await
        })
        .await
}

async fn get_json(ns: &TestNamespace, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let text = ns.kubectl_ok(&all).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}\n{text}"))
}

#[tokio::test]
async fn kubectl_apply_k_installs_every_object_and_the_live_objects_match_the_manifests() {
    let ns = ControlPlane::shared().test_namespace("deploy-apply").await;
    let first = deploy(&ns).await;
    for object in [
        "customresourcedefinition.apiextensions.k8s.io/kubernetesclusters.vitistack.io",
        "namespace/talos-upgrade-controller",
        "serviceaccount/talos-upgrade-controller",
        "clusterrole.rbac.authorization.k8s.io/talos-upgrade-controller",
        "clusterrolebinding.rbac.authorization.k8s.io/talos-upgrade-controller",
        "role.rbac.authorization.k8s.io/talos-upgrade-controller-leader-election",
        "rolebinding.rbac.authorization.k8s.io/talos-upgrade-controller-leader-election",
        "configmap/talos-upgrade-controller-dashboard",
        "service/talos-upgrade-controller",
        "deployment.apps/talos-upgrade-controller",
        "poddisruptionbudget.policy/talos-upgrade-controller",
        "servicemonitor.monitoring.coreos.com/talos-upgrade-controller",
        "prometheusrule.monitoring.coreos.com/talos-upgrade-controller",
    ] {
        assert!(first.contains(object), "{object} not applied:\n{first}");
    }

    // Applying again is how upgrades of the controller are rolled out: the live objects are exactly
    // the manifests (`kubectl diff` compares them after a server-side dry run). The KubernetesCluster
    // CRD is left out: other tests of this binary apply it too, without the base's labels.
    let again = ns.kubectl_ok(&["apply", "-k", &deploy_dir()]).await;
    assert_eq!(again.lines().count(), first.lines().count(), "{again}");
    let diff = ns.kubectl(&["diff", "-k", &deploy_dir()]).await;
    assert!(
        diff.stderr.trim().is_empty(),
        "kubectl diff failed: {}",
        diff.stderr
    );
    let differing: Vec<&str> = diff
        .stdout
        .lines()
        .filter(|l| l.starts_with("diff ") && !l.contains("CustomResourceDefinition"))
        .collect();
    assert!(differing.is_empty(), "{}", diff.stdout);
}

#[tokio::test]
async fn the_deployment_runs_two_hardened_replicas_with_probes_and_is_found_by_service_and_servicemonitor()
 {
    let ns = ControlPlane::shared().test_namespace("deploy-shape").await;
    deploy(&ns).await;

    let deployment = get_json(
        &ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "deployment",
            "talos-upgrade-controller",
        ],
    )
    .await;
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"], 2);
    let pod = &spec["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let container = &containers[0];
    assert_eq!(
        container["image"], "ghcr.io/vitistack/talos-upgrade-controller:0.1.0",
        "the tag comes from kustomization.yaml `images:`"
    );
    assert_eq!(container["args"][0], "run");
    assert!(
        container["args"]
            .as_array()
            .expect("args")
            .contains(&Value::from("--admin-listen=0.0.0.0:8080"))
    );
    let env = container["env"].as_array().expect("env");
    let pod_name = env
        .iter()
        .find(|e| e["name"] == "POD_NAME")
        .expect("POD_NAME");
    assert_eq!(
        pod_name["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.name"
    );
    let leader_elect = env
        .iter()
        .find(|e| e["name"] == "TUC_LEADER_ELECT")
        .expect("TUC_LEADER_ELECT");
    assert_eq!(
        leader_elect["value"], "true",
        "two replicas need leader election"
    );
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(container[probe]["httpGet"]["port"], "metrics", "{probe}");
    }
    assert_eq!(container["ports"][0]["name"], "metrics");
    assert_eq!(container["ports"][0]["containerPort"], 8080);
    let security = &container["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                container["resources"][kind][resource].is_string(),
                "resources.{kind}.{resource} is set"
            );
        }
    }

    // The Service selects the pods, on the port the ServiceMonitor scrapes.
    let pod_labels = spec["template"]["metadata"]["labels"]
        .as_object()
        .expect("pod labels");
    let service = get_json(
        &ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "service",
            "talos-upgrade-controller",
        ],
    )
    .await;
    for (key, value) in service["spec"]["selector"].as_object().expect("selector") {
        assert_eq!(pod_labels.get(key), Some(value), "pod label {key}");
    }
    assert_eq!(service["spec"]["ports"][0]["name"], "metrics");
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "metrics");
    let monitor = get_json(
        &ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "servicemonitor",
            "talos-upgrade-controller",
        ],
    )
    .await;
    let service_labels = service["metadata"]["labels"]
        .as_object()
        .expect("service labels");
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(service_labels.get(key), Some(value), "service label {key}");
    }
    assert_eq!(monitor["spec"]["endpoints"][0]["port"], "metrics");
    assert_eq!(monitor["spec"]["endpoints"][0]["path"], "/metrics");

    // The dashboard ConfigMap carries the Grafana sidecar's label and exactly the shipped JSON.
    let dashboard = get_json(
        &ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "configmap",
            "talos-upgrade-controller-dashboard",
        ],
    )
    .await;
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped = std::fs::read_to_string(
        Path::new(&deploy_dir()).join("grafana/talos-upgrade-controller.json"),
    )
    .expect("dashboard file");
    assert_eq!(
        dashboard["data"]["talos-upgrade-controller.json"],
        shipped.as_str()
    );
    let parsed: Value = serde_json::from_str(&shipped).expect("the dashboard is JSON");
    assert!(!parsed["panels"].as_array().expect("panels").is_empty());

    // The PrometheusRule was accepted by its CRD's schema with the four alerts.
    let rule = get_json(
        &ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "prometheusrule",
            "talos-upgrade-controller",
        ],
    )
    .await;
    let alerts: Vec<&str> = rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str())
        .collect();
    assert_eq!(
        alerts,
        [
            "KubernetesClusterUpgradeFailed",
            "KubernetesClusterUpgradeStuck",
            "KubernetesClusterNodeUpgradeSlow",
            "TalosUpgradeControllerAbsent"
        ]
    );
}

/// A pod made from the Deployment's template, as the ReplicaSet controller would create it.
async fn pod_from_template(ns: &TestNamespace, name: &str) -> Value {
    let deployment = get_json(
        ns,
        &[
            "-n",
            NAMESPACE,
            "get",
            "deployment",
            "talos-upgrade-controller",
        ],
    )
    .await;
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": deployment["spec"]["template"]["metadata"]["labels"]},
        "spec": deployment["spec"]["template"]["spec"],
    })
}

#[tokio::test]
async fn the_controller_pods_pass_the_restricted_pod_security_standard_of_their_namespace() {
    let ns = ControlPlane::shared().test_namespace("deploy-psa").await;
    deploy(&ns).await;
    let namespace = get_json(&ns, &["get", "namespace", NAMESPACE]).await;
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );

    // Server-side dry runs go through admission (PodSecurity included) without creating anything.
    let pod = pod_from_template(&ns, "from-template").await;
    let created = ns
        .kubectl_with(
            ns.kubeconfig(),
            &["create", "--dry-run=server", "-f", "-"],
            Some(&pod.to_string()),
        )
        .await;
    assert!(
        created.success,
        "the pod template is rejected: {}",
        created.stderr
    );

    // The namespace really enforces: the same pod, allowed to escalate, is refused.
    let mut escalating = pod_from_template(&ns, "escalating").await;
    escalating["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] =
        Value::Bool(true);
    let refused = ns
        .kubectl_with(
            ns.kubeconfig(),
            &["create", "--dry-run=server", "-f", "-"],
            Some(&escalating.to_string()),
        )
        .await;
    assert!(!refused.success, "an escalating pod was admitted");
    assert!(
        refused.stderr.contains("violates PodSecurity \"restricted"),
        "{}",
        refused.stderr
    );
}

/// One access check: may the caller `verb` `group`/`resource[/subresource]` in `namespace` ("" =
/// cluster-wide)?
struct Access {
    verb: &'static str,
    group: &'static str,
    resource: &'static str,
    namespace: &'static str,
}

fn access(verb: &'static str, resource: &'static str, namespace: &'static str) -> Access {
    let (group, resource) = match resource.split_once('.') {
        Some((resource, group)) => (group, resource),
        None => ("", resource),
    };
    Access {
        verb,
        group,
        resource,
        namespace,
    }
}

impl std::fmt::Display for Access {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let group = if self.group.is_empty() {
            "core"
        } else {
            self.group
        };
        let scope = if self.namespace.is_empty() {
            "cluster-wide"
        } else {
            self.namespace
        };
        write!(f, "{} {}/{} in {scope}", self.verb, group, self.resource)
    }
}

/// Asks the API server, as the caller of `client`, whether `access` is allowed (SelfSubjectAccessReview:
/// the authorizer's own answer for this identity).
async fn allowed(client: &kube::Client, access: &Access) -> bool {
    let (resource, subresource) = match access.resource.split_once('/') {
        Some((resource, sub)) => (resource, Some(sub.to_string())),
        None => (access.resource, None),
    };
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(access.verb.to_string()),
                group: Some(access.group.to_string()),
                resource: Some(resource.to_string()),
                subresource,
                namespace: (!access.namespace.is_empty()).then(|| access.namespace.to_string()),
                ..ResourceAttributes::default()
            }),
            ..SelfSubjectAccessReviewSpec::default()
        },
        ..SelfSubjectAccessReview::default()
    };
    let answer = Api::<SelfSubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .unwrap_or_else(|e| panic!("access review of {access}: {e}"));
    answer.status.expect("review status").allowed
}

#[tokio::test]
async fn the_service_account_may_do_what_the_controller_does_and_nothing_else() {
    let ns = ControlPlane::shared().test_namespace("deploy-rbac").await;
    deploy(&ns).await;
    let client = ns
        .control_plane()
        .client_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
        .await
        .expect("a token of the deployed ServiceAccount");

    // Clusters live in any namespace; "team-a" stands for one of them.
    let team = "team-a";
    let needed = [
        access("get", "kubernetesclusters.vitistack.io", team),
        access("list", "kubernetesclusters.vitistack.io", ""),
        access("watch", "kubernetesclusters.vitistack.io", ""),
        access("patch", "kubernetesclusters.vitistack.io", team),
        access("patch", "kubernetesclusters/status.vitistack.io", team),
        access("list", "machines.vitistack.io", team),
        access("list", "machines.vitistack.io", ""),
        access("watch", "machines.vitistack.io", ""),
        access("get", "secrets", team),
        access("get", "configmaps", team),
        access("list", "configmaps", ""),
        access("watch", "configmaps", ""),
        access("create", "configmaps", team),
        access("update", "configmaps", team),
        access("create", "events.events.k8s.io", team),
        access("patch", "events.events.k8s.io", team),
        access("get", "leases.coordination.k8s.io", NAMESPACE),
        access("create", "leases.coordination.k8s.io", NAMESPACE),
        access("patch", "leases.coordination.k8s.io", NAMESPACE),
    ];
    let forbidden = [
        // Secrets: only `get` by name; nothing that enumerates or changes them.
        access("list", "secrets", ""),
        access("list", "secrets", "kube-system"),
        access("watch", "secrets", team),
        access("create", "secrets", team),
        access("update", "secrets", team),
        access("delete", "secrets", team),
        // The clusters belong to their owners and the provisioning operator.
        access("create", "kubernetesclusters.vitistack.io", team),
        access("update", "kubernetesclusters.vitistack.io", team),
        access("delete", "kubernetesclusters.vitistack.io", team),
        access("deletecollection", "kubernetesclusters.vitistack.io", team),
        access("update", "kubernetesclusters/status.vitistack.io", team),
        access("get", "machines.vitistack.io", team),
        access("patch", "machines.vitistack.io", team),
        access("delete", "machines.vitistack.io", team),
        access("delete", "configmaps", team),
        access("patch", "configmaps", team),
        // Workload clusters are reached with their own kubeconfig, never with this account.
        access("patch", "nodes", ""),
        access("list", "nodes", ""),
        access("create", "pods", team),
        access("list", "pods", ""),
        access("create", "pods/eviction", team),
        access("delete", "pods", team),
        // Events go through events.k8s.io only.
        access("create", "events", team),
        access("delete", "events.events.k8s.io", team),
        // Leader election happens in the controller's own namespace only.
        access("get", "leases.coordination.k8s.io", "kube-system"),
        access("update", "leases.coordination.k8s.io", "kube-system"),
        access("patch", "leases.coordination.k8s.io", "kube-system"),
        access("update", "leases.coordination.k8s.io", NAMESPACE),
        access("delete", "leases.coordination.k8s.io", NAMESPACE),
        access("list", "leases.coordination.k8s.io", NAMESPACE),
        // No way to grant itself more.
        access("create", "serviceaccounts/token", NAMESPACE),
        access("bind", "clusterroles.rbac.authorization.k8s.io", ""),
        access("escalate", "clusterroles.rbac.authorization.k8s.io", ""),
        access("update", "clusterroles.rbac.authorization.k8s.io", ""),
        access(
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            NAMESPACE,
        ),
        access("impersonate", "serviceaccounts", ""),
        access(
            "update",
            "customresourcedefinitions.apiextensions.k8s.io",
            "",
        ),
        access("delete", "deployments.apps", NAMESPACE),
    ];

    let mut wrong = Vec::new();
    for check in &needed {
        if !allowed(&client, check).await {
            wrong.push(format!("denied but needed: {check}"));
        }
    }
    for check in &forbidden {
        if allowed(&client, check).await {
            wrong.push(format!("allowed but not needed: {check}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // The documented trade-off (deploy/README.md): a ClusterRole's `get` on Secrets reaches every
    // namespace, kube-system included, because clusters and their credentials live in any namespace.
    assert!(allowed(&client, &access("get", "secrets", "kube-system")).await);

    // kubectl agrees, through a real token of the account (not impersonation).
    let token = ns
        .control_plane()
        .service_account_token(NAMESPACE, SERVICE_ACCOUNT)
        .await
        .expect("token");
    let can_i = |verb: &str, resource: &str| {
        let args = [
            "auth".to_string(),
            "can-i".to_string(),
            verb.to_string(),
            resource.to_string(),
            "-n".to_string(),
            team.to_string(),
            // The admin kubeconfig gives the server and its CA; --token replaces the identity.
            format!("--token={token}"),
        ];
        let ns = &ns;
        async move {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            ns.kubectl(&refs).await
        }
    };
    let yes = can_i("patch", "kubernetesclusters.vitistack.io").await;
    assert_eq!(yes.stdout.trim(), "yes", "{}", yes.stderr);
    let no = can_i("delete", "kubernetesclusters.vitistack.io").await;
    assert_eq!(no.stdout.trim(), "no", "{}", no.stderr);
}

/// The settings `World` gives its own controller (tests/e2e/world.rs), for a controller started here.
fn world_settings(world: &World) -> Settings {
    Settings {
        limits: talos_upgrade_core::lifecycle::Limits {
            node_deadline: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(60),
            ..Default::default()
        },
        poll_interval: Duration::from_millis(100),
        talos: ConnectOptions {
            port: world.sim.config().port,
            connect_timeout: Duration::from_secs(2),
            ..ConnectOptions::default()
        },
        ..Settings::default()
    }
}

/// Stops the controller started by the test when the test ends, passing or not.
struct StopOnDrop(CancellationToken);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

#[tokio::test]
async fn a_talos_upgrade_runs_end_to_end_with_the_controller_authenticated_as_the_service_account()
{
    let setup = ControlPlane::shared()
        .test_namespace("deploy-e2e-setup")
        .await;
    deploy(&setup).await;
    let world = World::start("deploy-e2e", WorldSpec::default()).await;
    // World starts a controller with an admin client; replace it, before any target is set, with one
    // that holds nothing but a token of the deployed ServiceAccount and watches every namespace, as
    // the Deployment's does. Every namespace, but only this world's cluster (a label selector, as a
    // shard's): the tests beside it have clusters of their own, and a controller configured as this
    // one is (no etcd snapshot destination, no gates) would act on them too; it once failed another
    // test's run with its own view of the options.
    world.kill_controller().await;
    let instance = format!("sa-{}", world.ns.name);
    let only_this_world = format!("e2e.vitistack.io/controller={instance}");
    world
        .ns
        .kubectl_ok(&[
            "label",
            "kubernetescluster",
            &world.cluster,
            &only_this_world,
        ])
        .await;
    let client = world
        .ns
        .control_plane()
        .client_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
        .await
        .expect("a token of the deployed ServiceAccount");
    let stop = CancellationToken::new();
    let _stop = StopOnDrop(stop.clone());
    tokio::spawn(reconcile::run(
        client,
        None,
        world.metrics.clone(),
        Settings {
            watch_label_selector: Some(only_this_world),
            ..world_settings(&world)
        },
        HealthState::default(),
        instance.clone(),
        stop.clone().cancelled_owned(),
    ));
    // Its first reconcile (as the ServiceAccount) is in: the watch and its list were allowed.
    world.wait_for_reconciles(1, Duration::from_secs(60)).await;

    world
        .annotate_raw("upgrade.vitistack.io/talos-target=1.12.0")
        .await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;

    assert_eq!(world.annotation("talos-current").await, "1.12.0");
    assert_eq!(world.annotation("talos-progress").await, "5/5");
    assert_eq!(world.jsonpath("{.status.phase}").await, "Ready");
    assert_eq!(
        world
            .jsonpath("{.status.conditions[?(@.type==\"TalosUpgrade\")].reason}")
            .await,
        "Completed"
    );
    for snapshot in world.sim.snapshots() {
        assert_eq!(snapshot.talos_version, "1.12.0", "{}", snapshot.name);
    }
    let mut calls = world.upgrade_calls();
    calls.sort();
    let mut nodes: Vec<String> = world.sim.nodes().iter().map(|n| n.name.clone()).collect();
    nodes.sort();
    assert_eq!(calls, nodes, "every node upgraded exactly once");

    // The progress ConfigMap was written by this controller, and its Events carry its instance name.
    let progress = get_json(&world.ns, &["get", "configmap", "talos-upgrade-my-cluster"]).await;
    assert!(progress["data"]["talos.json"].is_string(), "{progress}");
    let events = get_json(&world.ns, &["get", "events.events.k8s.io"]).await;
    let completed: Vec<&Value> = events["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["reason"] == "UpgradeCompleted")
        .collect();
    assert_eq!(completed.len(), 1, "{events}");
    assert_eq!(completed[0]["reportingInstance"], instance.as_str());
    assert_eq!(
        completed[0]["reportingController"],
        "talos-upgrade-controller"
    );

    // No request of the controller was refused: a denied read or write would have ended a reconcile in
    // a `progress_store` or `report` error.
    let metrics = world.metrics.encode();
    for denied in ["progress_store", "report"] {
        assert!(
            !metrics.contains(&format!(
                "talos_upgrade_reconcile_errors_total{{category=\"{denied}\"}}"
            )),
            "reconcile errors:\n{metrics}"
        );
    }
}

/// The Deployment's readinessProbe asks `/readyz`, which answers 200 once the controller's initial
/// list of KubernetesClusters completed. A controller that never says so would never get a Ready pod,
/// and a rolling update of the Deployment would stall.
#[tokio::test]
async fn the_controller_becomes_ready_once_its_initial_list_completed() {
    let setup = ControlPlane::shared()
        .test_namespace("deploy-ready-setup")
        .await;
    deploy(&setup).await;
    let world = World::start("deploy-ready", WorldSpec::default()).await;
    world.kill_controller().await;
    let client = world
        .ns
        .control_plane()
        .client_for_service_account(NAMESPACE, SERVICE_ACCOUNT)
        .await
        .expect("a token of the deployed ServiceAccount");
    let stop = CancellationToken::new();
    let _stop = StopOnDrop(stop.clone());
    let health = HealthState::default();
    assert!(!health.is_ready());
    tokio::spawn(reconcile::run(
        client,
        Some(world.ns.name.clone()),
        world.metrics.clone(),
        world_settings(&world),
        health.clone(),
        format!("ready-{}", world.ns.name),
        stop.clone().cancelled_owned(),
    ));
    // Reconciles only start after the initial list, so after one the controller must say it is ready.
    world.wait_for_reconciles(1, Duration::from_secs(60)).await;
    world
        .poll(Duration::from_secs(30), "/readyz to turn ready", || {
            let health = health.clone();
            async move { health.is_ready() }
        })
        .await;
}
