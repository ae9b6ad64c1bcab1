//! The Helm chart (deploy/helm/talos-upgrade-controller) with the real helm v3.22.0, built from the Go
//! module proxy by scripts/build-helm.sh, against a real kube-apiserver: `helm lint`, the values schema,
//! `helm template` through a server-side dry run, `helm install` and `helm upgrade`, one Deployment per
//! shard (whose controllers, started with the Deployments' own arguments and the chart's ServiceAccount,
//! each hold a Lease of their own), and the chart against the kustomize base deploy/ (RBAC, CRD, alerts,
//! dashboard, pod hardening), so the two cannot drift apart.
//!
//! These tests run on an API server of their own: the `deploy` suite installs the kustomize base into the
//! shared one (ClusterRole `talos-upgrade-controller`, the CRD with its labels), and a release of the
//! chart would meet those cluster-scoped objects there.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{Value, json};
use testenv::{ControlPlane, TestNamespace};
use tokio::sync::OnceCell;

use crate::replica;

const CHART: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/helm/talos-upgrade-controller"
);
const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy");

const SERVICE_MONITOR_CRD: &str =
    include_str!("../fixtures/monitoring/monitoring.coreos.com_servicemonitors.yaml");
const PROMETHEUS_RULE_CRD: &str =
    include_str!("../fixtures/monitoring/monitoring.coreos.com_prometheusrules.yaml");

/// The real helm, built (or found in the cache) by scripts/build-helm.sh. A helm that cannot be built
/// fails the test, loudly.
fn helm_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| testenv::script::binary(&testenv::script::path("build-helm.sh"), &[]))
}

/// The API server of these tests, started once per test binary (see the module comment).
fn api_server() -> &'static ControlPlane {
    static API: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
    match API.get_or_init(|| ControlPlane::start_blocking().map_err(|e| e.to_string())) {
        Ok(api) => api,
        Err(e) => panic!("the helm tests' API server could not start: {e}"),
    }
}

/// A fresh namespace on the helm tests' API server, which has the prometheus-operator CRDs (the
/// ServiceMonitor and PrometheusRule the chart installs by default need them).
async fn namespace(prefix: &str) -> TestNamespace {
    static MONITORING_CRDS: OnceCell<()> = OnceCell::const_new();
    let ns = api_server().test_namespace(prefix).await;
    MONITORING_CRDS
        .get_or_init(|| async {
            ns.install_crd(SERVICE_MONITOR_CRD, "servicemonitors.monitoring.coreos.com")
                .await;
            ns.install_crd(PROMETHEUS_RULE_CRD, "prometheusrules.monitoring.coreos.com")
                .await;
        })
        .await;
    ns
}

/// What a helm invocation printed.
struct HelmOutput {
    success: bool,
    stdout: String,
    stderr: String,
}

/// Runs helm with `args`, talking to the API server of `kubeconfig` (`None`: no API server; helm gets a
/// kubeconfig that points nowhere). helm's cache, configuration and data directories are the API server's
/// temporary directory, never the home directory.
async fn helm(kubeconfig: Option<&Path>, args: &[&str]) -> HelmOutput {
    let home = api_server().dir().join("helm-home");
    let mut command = tokio::process::Command::new(helm_binary());
    command
        .args(args)
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env_remove("HELM_NAMESPACE")
        .env_remove("HELM_KUBECONTEXT")
        .env("KUBECONFIG", kubeconfig.unwrap_or(Path::new("/dev/null")))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = command
        .spawn()
        .unwrap_or_else(|e| panic!("running helm {args:?}: {e}"));
    let output = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("helm {args:?} did not finish within 180 s"))
        .unwrap_or_else(|e| panic!("waiting for helm {args:?}: {e}"));
    HelmOutput {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// Runs helm and panics with its output unless it succeeds; returns stdout.
async fn helm_ok(kubeconfig: Option<&Path>, args: &[&str]) -> String {
    let output = helm(kubeconfig, args).await;
    assert!(
        output.success,
        "helm {} failed:\nstdout: {}\nstderr: {}",
        args.join(" "),
        output.stdout,
        output.stderr
    );
    output.stdout
}

/// The objects of a multi-document YAML stream (helm template, kubectl kustomize), as JSON.
fn documents(yaml: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml::Deserializer::from_str(yaml)
        .map(|document| {
            Value::deserialize(document).unwrap_or_else(|e| panic!("parsing YAML: {e}\n{yaml}"))
        })
        .filter(|object| !object.is_null())
        .collect()
}

/// The one object of `kind` named `name` among `objects`.
fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{kind} {name}: {} found among {:?}",
        found.len(),
        kinds_and_names(objects)
    );
    found[0]
}

/// `Kind/name` of each object, sorted.
fn kinds_and_names(objects: &[Value]) -> Vec<String> {
    let mut names: Vec<String> = objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    names.sort();
    names
}

/// `kubectl get ... -o json`, parsed.
async fn get_json(ns: &TestNamespace, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let text = ns.kubectl_ok(&all).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}\n{text}"))
}

/// The strings of a JSON array.
fn strings(value: &Value) -> Vec<&str> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not an array: {value}"))
        .iter()
        .map(|v| v.as_str().unwrap_or_else(|| panic!("not a string: {v}")))
        .collect()
}

/// The value of the environment variable `name` of a container, if it has a plain value.
fn env_value<'a>(container: &'a Value, name: &str) -> Option<&'a str> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
}

/// The chart's objects' base name for `release` (the chart's tuc.fullname: the release name with
/// "-talos-upgrade-controller" added unless it already contains it).
fn fullname(release: &str) -> String {
    if release.contains("talos-upgrade-controller") {
        release.to_string()
    } else {
        format!("{release}-talos-upgrade-controller")
    }
}

/// helm's output for a refused value: the schema's (or a template's) message, with the chart's name.
async fn refused(args: &[&str]) -> String {
    let mut all = vec!["template", "refused", CHART];
    all.extend(args);
    let output = helm(None, &all).await;
    assert!(
        !output.success,
        "helm template {args:?} was accepted:\n{}",
        output.stdout
    );
    output.stderr
}

#[tokio::test]
async fn helm_lint_passes_strictly_and_the_values_schema_refuses_bad_values() {
    // The defaults, and every value set at once.
    let everything = [
        "--set",
        "shards[0].name=a,shards[0].labelSelector=upgrade.vitistack.io/shard=a",
        "--set",
        "shards[1].name=rest,shards[1].labelSelector=!upgrade.vitistack.io/shard",
        "--set",
        "releaseCatalog.replace=false,releaseCatalog.talos={1.12.1},releaseCatalog.kubernetes={v1.35.1}",
        "--set",
        "watchNamespace=team-a,replicas=3,extraArgs={--node-deadline=30m},extraEnv[0].name=RUST_LOG,extraEnv[0].value=debug",
        "--set",
        "serviceMonitor.labels.release=kube-prometheus-stack,prometheusRule.labels.release=kube-prometheus-stack",
        "--set",
        "leaderElection.leaseDuration=30s,leaderElection.leaseGrace=10s,image.tag=0.2.0,nodeSelector.role=infra",
        "--set-json",
        r#"alertGate={"prometheusUrl":"http://prometheus:9090","authSecret":"monitoring/reader","selector":"{team=\"storage\"}"}"#,
    ];
    for strict in [false, true] {
        for values in [&[][..], &everything[..]] {
            let mut args = vec!["lint", CHART];
            if strict {
                args.push("--strict");
            }
            args.extend(values);
            let stdout = helm_ok(None, &args).await;
            assert!(
                stdout.contains("1 chart(s) linted, 0 chart(s) failed"),
                "helm {args:?}:\n{stdout}"
            );
            assert!(!stdout.contains("[WARNING]"), "helm {args:?}:\n{stdout}");
        }
    }

    // A shard name is a DNS label: it names the shard's Deployment, Lease and PodDisruptionBudget.
    let bad_name = refused(&[
        "--set",
        "shards[0].name=Bad_Name,shards[0].labelSelector=upgrade.vitistack.io/shard=a",
    ])
    .await;
    assert!(
        bad_name.contains("values don't meet the specifications of the schema"),
        "{bad_name}"
    );
    assert!(
        bad_name.contains("talos-upgrade-controller:"),
        "names the chart: {bad_name}"
    );
    assert!(
        bad_name.contains("/shards/0/name") && bad_name.contains("Bad_Name"),
        "names the value: {bad_name}"
    );
    // The same refusal from `helm lint`, with the chart counted as failed.
    let lint = helm(
        None,
        &[
            "lint",
            CHART,
            "--set",
            "shards[0].name=Bad_Name,shards[0].labelSelector=a=b",
        ],
    )
    .await;
    assert!(!lint.success);
    assert!(
        lint.stdout.contains(
            "[ERROR] values.yaml: - at '/shards/0/name': 'Bad_Name' does not match pattern"
        ) && lint.stderr.contains("1 chart(s) linted, 1 chart(s) failed"),
        "{}\n{}",
        lint.stdout,
        lint.stderr
    );

    // A misspelt value is refused, not ignored.
    let unknown = refused(&["--set", "replica=3"]).await;
    assert!(
        unknown.contains("additional properties 'replica' not allowed"),
        "{unknown}"
    );
    let unknown_nested = refused(&["--set", "leaderElection.enable=false"]).await;
    assert!(
        unknown_nested.contains("/leaderElection")
            && unknown_nested.contains("additional properties 'enable' not allowed"),
        "{unknown_nested}"
    );
    // A shard needs its selector; a duration needs its unit; a catalog entry is a full release.
    let no_selector = refused(&["--set", "shards[0].name=a"]).await;
    assert!(
        no_selector.contains("/shards/0") && no_selector.contains("labelSelector"),
        "{no_selector}"
    );
    let no_unit = refused(&["--set", "leaderElection.leaseDuration=15"]).await;
    assert!(
        no_unit.contains("/leaderElection/leaseDuration"),
        "{no_unit}"
    );
    let release_line = refused(&["--set", "releaseCatalog.talos={1.12}"]).await;
    assert!(
        release_line.contains("/releaseCatalog") && release_line.contains("1.12"),
        "{release_line}"
    );
    let not_a_flag = refused(&["--set", "extraArgs={node-deadline=30m}"]).await;
    assert!(not_a_flag.contains("/extraArgs/0"), "{not_a_flag}");
    // The alert gate's URL has its scheme, its Secret is <namespace>/<name>, its selector braces.
    for (value, path) in [
        (
            "alertGate.prometheusUrl=prometheus:9090",
            "/alertGate/prometheusUrl",
        ),
        ("alertGate.authSecret=reader", "/alertGate/authSecret"),
        (
            "silences.alertmanagerUrl=alertmanager:9093",
            "/silences/alertmanagerUrl",
        ),
        ("silences.authSecret=writer", "/silences/authSecret"),
        ("silences.nodeLabel=node-name", "/silences/nodeLabel"),
        (
            "alertGate.selector=severity=critical",
            "/alertGate/selector",
        ),
    ] {
        let bad = refused(&["--set", value]).await;
        assert!(bad.contains(path), "{value}: {bad}");
    }

    // What the schema cannot say, the templates do.
    let twice = refused(&[
        "--set",
        "shards[0].name=a,shards[0].labelSelector=x=1,shards[1].name=a,shards[1].labelSelector=x=2",
    ])
    .await;
    assert!(
        twice.contains("shards: the name \"a\" is used twice"),
        "{twice}"
    );
    let unled = refused(&["--set", "leaderElection.enabled=false"]).await;
    assert!(
        unled.contains("replicas > 1 needs leaderElection.enabled"),
        "{unled}"
    );
    // A catalog file as it is (--set-file): its text is the ConfigMap's, comments and all.
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/release-catalog.yaml");
    let rendered = documents(
        &helm_ok(
            None,
            &[
                "template",
                "file",
                CHART,
                "--set-file",
                &format!("releaseCatalog={example}"),
            ],
        )
        .await,
    );
    let catalog = find(
        &rendered,
        "ConfigMap",
        "file-talos-upgrade-controller-release-catalog",
    );
    assert_eq!(
        catalog["data"]["releases.yaml"].as_str().map(str::trim_end),
        Some(
            std::fs::read_to_string(example)
                .expect("the example catalog")
                .trim_end()
        )
    );
    // One replica needs no Lease.
    helm_ok(
        None,
        &[
            "template",
            "one",
            CHART,
            "--set",
            "leaderElection.enabled=false,replicas=1",
        ],
    )
    .await;
}

/// Values that turn on every optional part of the chart.
const EVERY_PART: [&str; 16] = [
    // A private CA bundle over the image's roots (docs/releases.md), as a platform team mounts one.
    "--set-json",
    r#"extraVolumes=[{"name":"ca","configMap":{"name":"corp-ca"}}],extraVolumeMounts=[{"name":"ca","mountPath":"/etc/ssl/certs/ca-certificates.crt","subPath":"ca.crt","readOnly":true}]"#,
    // As JSON: --set would read the selector's braces as a list.
    "--set-json",
    r#"alertGate={"prometheusUrl":"https://prometheus.monitoring.svc:9090","authSecret":"monitoring/prometheus-reader","selector":"{severity=~\"critical|warning\"}"}"#,
    "--set-json",
    r#"silences={"alertmanagerUrl":"https://alertmanager.monitoring.svc:9093","authSecret":"monitoring/alertmanager-writer","nodeLabel":"kubernetes_node","matchers":"cluster=\"{clusterId}\""}"#,
    "--set",
    "shards[0].name=a,shards[0].labelSelector=upgrade.vitistack.io/shard=a",
    "--set",
    "shards[1].name=rest,shards[1].labelSelector=!upgrade.vitistack.io/shard",
    "--set",
    "releaseCatalog.talos={1.12.1},releaseCatalog.kubernetes={1.35.1},watchNamespace=team-a",
    "--set",
    "extraArgs={--node-deadline=30m},extraEnv[0].name=RUST_LOG,extraEnv[0].value=debug,podLabels.team=platform",
    // The etcd snapshots on a volume (docs/upgrades.md, "etcd snapshot before the control planes").
    "--set",
    "etcdSnapshot.persistentVolumeClaim=etcd-snapshots,etcdSnapshot.keep=3",
];

#[tokio::test]
async fn helm_template_renders_objects_the_api_server_accepts() {
    let ns = namespace("helm-template").await;
    for (label, values) in [("defaults", &[][..]), ("every part", &EVERY_PART[..])] {
        let release = format!("tpl-{}", if values.is_empty() { "a" } else { "b" });
        let mut args = vec![
            "template",
            release.as_str(),
            CHART,
            "--namespace",
            ns.name.as_str(),
            "--include-crds",
        ];
        args.extend(values);
        let rendered = helm_ok(None, &args).await;
        let objects = documents(&rendered);
        let mut expected = vec![
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "CustomResourceDefinition",
            "Deployment",
            "PodDisruptionBudget",
            "PrometheusRule",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ];
        if !values.is_empty() {
            // The second ConfigMap (the release catalog), a second Deployment and budget (shards).
            expected.extend(["ConfigMap", "Deployment", "PodDisruptionBudget"]);
        }
        expected.sort();
        let mut kinds: Vec<&str> = objects.iter().filter_map(|o| o["kind"].as_str()).collect();
        kinds.sort();
        assert_eq!(kinds, expected, "{label}: {:?}", kinds_and_names(&objects));

        // The alert gate's values become the controller's flags, in every shard's Deployment.
        let alert_flags = [
            "--prometheus-url=https://prometheus.monitoring.svc:9090",
            "--prometheus-auth-secret=monitoring/prometheus-reader",
            "--alert-selector={severity=~\"critical|warning\"}",
            // And the silences'.
            "--alertmanager-url=https://alertmanager.monitoring.svc:9093",
            "--alertmanager-auth-secret=monitoring/alertmanager-writer",
            "--silence-node-label=kubernetes_node",
            "--silence-matchers=cluster=\"{clusterId}\"",
            // And the etcd snapshots'.
            "--etcd-snapshot-dir=/var/lib/etcd-snapshots",
            "--etcd-snapshot-keep=3",
        ];
        for deployment in objects.iter().filter(|o| o["kind"] == "Deployment") {
            let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a.as_str())
                .collect();
            for flag in alert_flags {
                assert_eq!(
                    args.contains(&flag),
                    !values.is_empty(),
                    "{label}: {flag} in {args:?}"
                );
            }
        }

        // The extra volume and its mount, beside the release catalog's, in every Deployment.
        for deployment in objects.iter().filter(|o| o["kind"] == "Deployment") {
            let pod = &deployment["spec"]["template"]["spec"];
            let names = |list: &Value| -> Vec<String> {
                list.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v["name"].as_str().map(str::to_string))
                    .collect()
            };
            let expected: Vec<String> = if values.is_empty() {
                vec![]
            } else {
                vec![
                    "etcd-snapshots".into(),
                    "release-catalog".into(),
                    "ca".into(),
                ]
            };
            assert_eq!(names(&pod["volumes"]), expected, "{label}");
            assert_eq!(
                names(&pod["containers"][0]["volumeMounts"]),
                expected,
                "{label}"
            );
        }

        // The API server validates every object (schemas of the built-in kinds and of the CRDs,
        // admission) without storing anything.
        let applied = ns
            .kubectl_with(
                ns.kubeconfig(),
                &["apply", "--server-side", "--dry-run=server", "-f", "-"],
                Some(&rendered),
            )
            .await;
        assert!(
            applied.success,
            "{label}: the API server refused the rendered chart:\n{}\n{}",
            applied.stdout, applied.stderr
        );
        for object in &objects {
            let name = object["metadata"]["name"].as_str().expect("a name");
            let line = applied
                .stdout
                .lines()
                .find(|l| l.contains(&format!("/{name} ")))
                .unwrap_or_else(|| panic!("{label}: {name} not applied:\n{}", applied.stdout));
            assert!(
                line.ends_with("serverside-applied (server dry run)"),
                "{label}: {line}"
            );
        }
    }
}

/// The objects a release installs, as `kubectl get` names them (`kind/name`, namespaced in `ns`, or
/// cluster-wide).
fn release_objects(fullname: &str) -> Vec<(String, bool)> {
    [
        ("serviceaccount", "", true),
        ("clusterrole.rbac.authorization.k8s.io", "", false),
        ("clusterrolebinding.rbac.authorization.k8s.io", "", false),
        ("role.rbac.authorization.k8s.io", "-leader-election", true),
        (
            "rolebinding.rbac.authorization.k8s.io",
            "-leader-election",
            true,
        ),
        ("service", "", true),
        ("deployment.apps", "", true),
        ("poddisruptionbudget.policy", "", true),
        ("servicemonitor.monitoring.coreos.com", "", true),
        ("prometheusrule.monitoring.coreos.com", "", true),
        ("configmap", "-dashboard", true),
    ]
    .into_iter()
    .map(|(kind, suffix, namespaced)| (format!("{kind}/{fullname}{suffix}"), namespaced))
    .collect()
}

#[tokio::test]
async fn helm_install_then_helm_upgrade_changes_the_deployment_as_the_values_say() {
    let ns = namespace("helm-install").await;
    let release = ns.name.clone();
    let name = fullname(&release);
    let kubeconfig = Some(ns.kubeconfig());
    // The CRD is there before the release, as where vitistack's operator or the kustomize base
    // installed it: helm install leaves it alone instead of failing on it.
    let project_crd =
        std::fs::read_to_string(Path::new(DEPLOY).join("crd.yaml")).expect("crd.yaml");
    ns.install_crd(&project_crd, "kubernetesclusters.vitistack.io")
        .await;
    let installed = helm_ok(
        kubeconfig,
        &["install", &release, CHART, "--namespace", &ns.name],
    )
    .await;
    assert!(installed.contains("STATUS: deployed"), "{installed}");
    assert!(installed.contains("REVISION: 1"), "{installed}");
    // The notes tell the operator what to run next.
    for next in [
        format!(
            "kubectl -n {} get pods -l app.kubernetes.io/instance={release},app.kubernetes.io/component=controller",
            ns.name
        ),
        format!("kubectl -n {} rollout status deployment/{name}", ns.name),
        format!("kubectl -n {} get lease {name}", ns.name),
        format!(
            "kubectl label namespace {} pod-security.kubernetes.io/enforce=restricted",
            ns.name
        ),
        "kubectl annotate kubernetescluster my-cluster upgrade.vitistack.io/talos-target=\"1.12.0\""
            .to_string(),
        "kubectl wait kubernetescluster my-cluster \\\n    --for=jsonpath='{.metadata.annotations.upgrade\\.vitistack\\.io/talos-status}'=completed --timeout=30m".to_string(),
        "upgrade.vitistack.io/kubernetes-target=\"1.35.0\"".to_string(),
    ] {
        assert!(installed.contains(&next), "NOTES lack {next:?}:\n{installed}");
    }

    // Every object is there, and the CRD is established.
    for (object, namespaced) in release_objects(&name) {
        let mut args = vec!["get", object.as_str()];
        if namespaced {
            args.extend(["-n", ns.name.as_str()]);
        }
        ns.kubectl_ok(&args).await;
    }
    ns.wait_crd_established("kubernetesclusters.vitistack.io")
        .await;

    let deployment = get_json(&ns, &["-n", &ns.name, "get", "deployment", &name]).await;
    assert_eq!(deployment["spec"]["replicas"], 2);
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        container["image"],
        format!(
            "ghcr.io/vitistack/talos-upgrade-controller:{}",
            env!("CARGO_PKG_VERSION")
        ),
        "the tag defaults to the chart's appVersion, the crate version"
    );
    let lease = format!("--leader-election-lease={name}");
    assert_eq!(
        strings(&container["args"]),
        [
            "run",
            "--admin-listen=0.0.0.0:8080",
            lease.as_str(),
            "--lease-duration=15s",
            "--lease-grace=5s"
        ]
    );
    assert_eq!(env_value(container, "TUC_LEADER_ELECT"), Some("true"));
    assert_eq!(
        deployment["spec"]["template"]["spec"]["serviceAccountName"],
        name.as_str()
    );
    assert!(container["volumeMounts"].is_null(), "no catalog, no mount");

    // The upgrade: more replicas, a flag, a longer Lease, a release catalog, an environment variable.
    let upgraded = helm_ok(
        kubeconfig,
        &[
            "upgrade",
            &release,
            CHART,
            "--namespace",
            &ns.name,
            "--reuse-values",
            "--set",
            "replicas=3,extraArgs={--node-deadline=30m},leaderElection.leaseDuration=20s",
            "--set",
            "releaseCatalog.talos={1.12.1},extraEnv[0].name=RUST_LOG,extraEnv[0].value=debug",
        ],
    )
    .await;
    assert!(upgraded.contains("REVISION: 2"), "{upgraded}");

    let deployment = get_json(&ns, &["-n", &ns.name, "get", "deployment", &name]).await;
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(deployment["metadata"]["generation"], 2);
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(
        strings(&container["args"]),
        [
            "run",
            "--admin-listen=0.0.0.0:8080",
            lease.as_str(),
            "--lease-duration=20s",
            "--lease-grace=5s",
            "--release-catalog=/etc/talos-upgrade-controller/releases.yaml",
            "--node-deadline=30m"
        ]
    );
    assert_eq!(env_value(container, "RUST_LOG"), Some("debug"));
    assert_eq!(env_value(container, "TUC_LEADER_ELECT"), Some("true"));
    // The catalog: a ConfigMap, mounted read-only where --release-catalog points.
    assert_eq!(
        container["volumeMounts"],
        json!([{"name": "release-catalog", "mountPath": "/etc/talos-upgrade-controller", "readOnly": true}])
    );
    assert_eq!(
        pod["volumes"][0]["configMap"]["name"],
        format!("{name}-release-catalog")
    );
    let catalog = get_json(
        &ns,
        &[
            "-n",
            &ns.name,
            "get",
            "configmap",
            &format!("{name}-release-catalog"),
        ],
    )
    .await;
    let file: Value = serde_yaml::from_str(
        catalog["data"]["releases.yaml"]
            .as_str()
            .expect("releases.yaml"),
    )
    .expect("the catalog is YAML");
    assert_eq!(file, json!({"talos": ["1.12.1"]}));
    // A changed catalog rolls the pods.
    assert!(
        deployment["spec"]["template"]["metadata"]["annotations"]["checksum/release-catalog"]
            .is_string()
    );

    let status: Value = serde_json::from_str(
        &helm_ok(
            kubeconfig,
            &["status", &release, "--namespace", &ns.name, "-o", "json"],
        )
        .await,
    )
    .expect("helm status -o json");
    assert_eq!(status["info"]["status"], "deployed");
    assert_eq!(status["version"], 2);
    let history: Value = serde_json::from_str(
        &helm_ok(
            kubeconfig,
            &["history", &release, "--namespace", &ns.name, "-o", "json"],
        )
        .await,
    )
    .expect("helm history -o json");
    let revisions: Vec<(i64, &str)> = history
        .as_array()
        .expect("revisions")
        .iter()
        .map(|r| {
            (
                r["revision"].as_i64().expect("revision"),
                r["status"].as_str().expect("status"),
            )
        })
        .collect();
    assert_eq!(revisions, [(1, "superseded"), (2, "deployed")]);
}

/// A kubeconfig that authenticates with a real token of the ServiceAccount `namespace/name`.
async fn service_account_kubeconfig(ns: &TestNamespace, namespace: &str, name: &str) -> PathBuf {
    let token = ns
        .control_plane()
        .service_account_token(namespace, name)
        .await
        .expect("a token of the chart's ServiceAccount");
    let admin = std::fs::read_to_string(ns.kubeconfig()).expect("the namespace's kubeconfig");
    let replaced: Vec<String> = admin
        .lines()
        .map(|line| {
            if line.trim_start().starts_with("token:") {
                format!("    token: {}", json!(token))
            } else {
                line.to_string()
            }
        })
        .collect();
    assert!(replaced.iter().any(|l| l.contains(&token)));
    let path = ns
        .control_plane()
        .dir()
        .join(format!("{namespace}-{name}.kubeconfig"));
    std::fs::write(&path, replaced.join("\n") + "\n").expect("writing the kubeconfig");
    path
}

#[tokio::test]
async fn helm_install_with_two_shards_runs_one_deployment_and_one_lease_per_shard() {
    let ns = namespace("helm-shards").await;
    let release = ns.name.clone();
    let name = fullname(&release);
    let installed = helm_ok(
        Some(ns.kubeconfig()),
        &[
            "install",
            &release,
            CHART,
            "--namespace",
            &ns.name,
            "--set",
            "replicas=1",
            "--set",
            "shards[0].name=a,shards[0].labelSelector=upgrade.vitistack.io/shard=a",
            "--set",
            "shards[1].name=rest,shards[1].labelSelector=!upgrade.vitistack.io/shard",
        ],
    )
    .await;
    // The notes name the shards, and the commands that check each.
    for line in [
        format!("{name}-a: the KubernetesClusters matching upgrade.vitistack.io/shard=a"),
        format!("{name}-rest: the KubernetesClusters matching !upgrade.vitistack.io/shard"),
        format!("kubectl -n {} rollout status deployment/{name}-a", ns.name),
        format!(
            "kubectl -n {} rollout status deployment/{name}-rest",
            ns.name
        ),
        format!("kubectl -n {} get lease {name}-a {name}-rest", ns.name),
    ] {
        assert!(
            installed.contains(&line),
            "NOTES lack {line:?}:\n{installed}"
        );
    }

    let deployments = get_json(
        &ns,
        &[
            "-n",
            &ns.name,
            "get",
            "deployments",
            "-l",
            &format!("app.kubernetes.io/instance={release}"),
        ],
    )
    .await;
    let deployments = deployments["items"].as_array().expect("items").clone();
    let names: Vec<&str> = deployments
        .iter()
        .map(|d| d["metadata"]["name"].as_str().expect("name"))
        .collect();
    let (shard_a, shard_rest) = (format!("{name}-a"), format!("{name}-rest"));
    assert_eq!(
        names,
        [shard_a.as_str(), shard_rest.as_str()],
        "one Deployment per shard, and none watching every cluster"
    );
    let shards = [
        (&shard_a, "a", "upgrade.vitistack.io/shard=a"),
        (&shard_rest, "rest", "!upgrade.vitistack.io/shard"),
    ];
    for ((deployment_name, shard, selector), deployment) in shards.iter().zip(&deployments) {
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        let args = strings(&container["args"]);
        assert!(
            args.contains(&format!("--watch-label-selector={selector}").as_str()),
            "{deployment_name}: {args:?}"
        );
        assert!(
            args.contains(&format!("--leader-election-lease={deployment_name}").as_str()),
            "{deployment_name}: {args:?}"
        );
        assert_eq!(env_value(container, "TUC_LEADER_ELECT"), Some("true"));
        // Each Deployment owns its shard's pods only.
        assert_eq!(
            deployment["spec"]["selector"]["matchLabels"]["talos-upgrade-controller/shard"],
            *shard
        );
        assert_eq!(
            deployment["spec"]["template"]["metadata"]["labels"]["talos-upgrade-controller/shard"],
            *shard
        );
        // And a PodDisruptionBudget of its own, selecting the same pods.
        let budget = get_json(
            &ns,
            &[
                "-n",
                &ns.name,
                "get",
                "poddisruptionbudget",
                deployment_name,
            ],
        )
        .await;
        assert_eq!(
            budget["spec"]["selector"]["matchLabels"],
            deployment["spec"]["selector"]["matchLabels"]
        );
    }

    // One Service, whose selector matches the pods of both shards, for one ServiceMonitor.
    let services = get_json(
        &ns,
        &[
            "-n",
            &ns.name,
            "get",
            "services",
            "-l",
            &format!("app.kubernetes.io/instance={release}"),
        ],
    )
    .await;
    let services = services["items"].as_array().expect("items");
    assert_eq!(services.len(), 1, "{services:?}");
    let selector = services[0]["spec"]["selector"]
        .as_object()
        .expect("selector");
    for deployment in &deployments {
        let labels = &deployment["spec"]["template"]["metadata"]["labels"];
        for (key, value) in selector {
            assert_eq!(&labels[key], value, "pod label {key}");
        }
    }
    let monitor = get_json(&ns, &["-n", &ns.name, "get", "servicemonitor", &name]).await;
    for (key, value) in monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels")
    {
        assert_eq!(
            &services[0]["metadata"]["labels"][key], value,
            "service label {key}"
        );
    }

    // Each shard's controller, started as its Deployment would start it (its arguments and
    // environment, the chart's ServiceAccount), takes the Lease of its shard: the two shards act side by
    // side instead of one standing by for the other.
    let kubeconfig = service_account_kubeconfig(&ns, &ns.name, &name).await;
    let mut controllers = Vec::new();
    for deployment in &deployments {
        let deployment_name = deployment["metadata"]["name"].as_str().expect("name");
        let container = &deployment["spec"]["template"]["spec"]["containers"][0];
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let admin = format!("--admin-listen={}", listener.local_addr().expect("address"));
        drop(listener);
        let args: Vec<String> = strings(&container["args"])
            .into_iter()
            .map(|arg| {
                if arg.starts_with("--admin-listen=") {
                    admin.clone()
                } else {
                    arg.to_string()
                }
            })
            .collect();
        let mut command =
            tokio::process::Command::new(env!("CARGO_BIN_EXE_talos-upgrade-controller"));
        command
            .args(&args)
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAME", format!("{deployment_name}-pod"))
            .env("POD_NAMESPACE", &ns.name)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        for variable in container["env"].as_array().expect("env") {
            if let Some(value) = variable["value"].as_str() {
                command.env(variable["name"].as_str().expect("name"), value);
            }
        }
        controllers.push(command.spawn().expect("starting the controller binary"));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for (deployment_name, _, _) in &shards {
        let pod = format!("{deployment_name}-pod");
        loop {
            if replica::holder(&ns.client, &ns.name, deployment_name).await == Some(pod.clone()) {
                break;
            }
            for controller in &mut controllers {
                if let Some(status) = controller.try_wait().expect("controller status") {
                    panic!("a shard's controller exited with {status}");
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the Lease {deployment_name} was not taken by {pod} within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // No Lease for the whole fleet: no Deployment watches every cluster.
    assert_eq!(replica::holder(&ns.client, &ns.name, &name).await, None);
}

/// A rule of a Role or ClusterRole with its lists sorted, and the rules sorted: a reordering is not a
/// difference, anything else is.
fn normalised_rules(role: &Value) -> Vec<Value> {
    let mut rules: Vec<Value> = role["rules"]
        .as_array()
        .unwrap_or_else(|| panic!("rules: {role}"))
        .iter()
        .map(|rule| {
            let mut rule = rule.as_object().expect("a rule").clone();
            for list in rule.values_mut() {
                if let Some(items) = list.as_array_mut() {
                    items.sort_by_key(|v| v.to_string());
                }
            }
            Value::Object(rule)
        })
        .collect();
    rules.sort_by_key(|r| r.to_string());
    rules
}

#[tokio::test]
async fn the_chart_and_the_kustomize_base_install_the_same_rbac_crd_alerts_dashboard_and_pods() {
    // The release name and namespace the kustomize base uses, so names can be compared too.
    let base = "talos-upgrade-controller";
    let kubectl = api_server().binaries().kubectl();
    let output = tokio::process::Command::new(&kubectl)
        .args(["kustomize", DEPLOY])
        .output()
        .await
        .expect("running kubectl kustomize");
    assert!(
        output.status.success(),
        "kubectl kustomize deploy/: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let kustomize = documents(&String::from_utf8_lossy(&output.stdout));
    let chart = documents(
        &helm_ok(
            None,
            &[
                "template",
                base,
                CHART,
                "--namespace",
                base,
                "--include-crds",
            ],
        )
        .await,
    );

    // The same objects under the same names, but the Namespace: the chart installs into the release's
    // (helm install --create-namespace), and leaves its Pod Security label to the operator.
    let mut from_kustomize = kinds_and_names(&kustomize);
    from_kustomize.retain(|o| o != "Namespace/talos-upgrade-controller");
    assert_eq!(kinds_and_names(&chart), from_kustomize);

    // Chart.yaml's appVersion is the crate's version, and so the image tag of both.
    let chart_yaml: Value = serde_yaml::from_str(
        &std::fs::read_to_string(Path::new(CHART).join("Chart.yaml")).expect("Chart.yaml"),
    )
    .expect("Chart.yaml is YAML");
    assert_eq!(chart_yaml["appVersion"], env!("CARGO_PKG_VERSION"));

    // RBAC: the same rules, bound to the same ServiceAccount.
    for kind in ["ClusterRole", "Role"] {
        let name = if kind == "Role" {
            "talos-upgrade-controller-leader-election"
        } else {
            base
        };
        assert_eq!(
            normalised_rules(find(&chart, kind, name)),
            normalised_rules(find(&kustomize, kind, name)),
            "{kind} {name}: the chart's rules differ from deploy/rbac.yaml's"
        );
    }
    for (kind, name) in [
        ("ClusterRoleBinding", base),
        ("RoleBinding", "talos-upgrade-controller-leader-election"),
    ] {
        for field in ["roleRef", "subjects"] {
            assert_eq!(
                find(&chart, kind, name)[field],
                find(&kustomize, kind, name)[field],
                "{kind} {name}: {field}"
            );
        }
    }

    // The CRD: the same object, field by field, but the labels kustomize adds to everything.
    let crd_name = "kubernetesclusters.vitistack.io";
    let without_labels = |crd: &Value| {
        let mut crd = crd.clone();
        crd["metadata"]
            .as_object_mut()
            .expect("metadata")
            .remove("labels");
        crd
    };
    let (chart_crd, base_crd) = (
        without_labels(find(&chart, "CustomResourceDefinition", crd_name)),
        without_labels(find(&kustomize, "CustomResourceDefinition", crd_name)),
    );
    for field in ["apiVersion", "kind", "metadata", "spec"] {
        assert_eq!(
            chart_crd[field], base_crd[field],
            "the CRD's {field}: the chart's crds/ is not deploy/crd.yaml; copy it there (below the header)"
        );
    }
    assert_eq!(chart_crd, base_crd);

    // The alerts and the dashboard: the same.
    assert_eq!(
        find(&chart, "PrometheusRule", base)["spec"],
        find(&kustomize, "PrometheusRule", base)["spec"],
        "the chart's files/prometheus-rules.yaml is not the spec of deploy/monitoring.yaml's PrometheusRule"
    );
    let dashboard = format!("{base}-dashboard");
    for side in [&chart, &kustomize] {
        assert_eq!(
            find(side, "ConfigMap", &dashboard)["metadata"]["labels"]["grafana_dashboard"],
            "1"
        );
    }
    assert_eq!(
        find(&chart, "ConfigMap", &dashboard)["data"],
        find(&kustomize, "ConfigMap", &dashboard)["data"],
        "the chart's files/grafana-dashboard.json is not deploy/grafana/talos-upgrade-controller.json; copy it"
    );
    assert_eq!(
        find(&chart, "ServiceMonitor", base)["spec"]["endpoints"],
        find(&kustomize, "ServiceMonitor", base)["spec"]["endpoints"]
    );

    // The pods: the same replicas, image, hardening, probes, ports and resources; the base's arguments
    // and environment, which the chart extends (the Lease's name and timings).
    let (chart_deployment, base_deployment) = (
        find(&chart, "Deployment", base),
        find(&kustomize, "Deployment", base),
    );
    assert_eq!(
        chart_deployment["spec"]["replicas"],
        base_deployment["spec"]["replicas"]
    );
    let (chart_pod, base_pod) = (
        &chart_deployment["spec"]["template"]["spec"],
        &base_deployment["spec"]["template"]["spec"],
    );
    for field in ["securityContext", "serviceAccountName"] {
        assert_eq!(chart_pod[field], base_pod[field], "pod {field}");
    }
    let (chart_container, base_container) =
        (&chart_pod["containers"][0], &base_pod["containers"][0]);
    for field in [
        "name",
        "image",
        "imagePullPolicy",
        "command",
        "ports",
        "livenessProbe",
        "readinessProbe",
        "resources",
        "securityContext",
    ] {
        assert_eq!(
            chart_container[field], base_container[field],
            "container {field}"
        );
    }
    let chart_args = strings(&chart_container["args"]);
    let base_args = strings(&base_container["args"]);
    assert_eq!(chart_args[..base_args.len()], base_args[..]);
    assert_eq!(
        chart_args[base_args.len()..],
        [
            "--leader-election-lease=talos-upgrade-controller",
            "--lease-duration=15s",
            "--lease-grace=5s"
        ],
        "the controller's defaults, spelt out"
    );
    assert_eq!(chart_container["env"], base_container["env"]);
    assert_eq!(
        find(&chart, "PodDisruptionBudget", base)["spec"]["maxUnavailable"],
        find(&kustomize, "PodDisruptionBudget", base)["spec"]["maxUnavailable"]
    );
    assert_eq!(
        find(&chart, "Service", base)["spec"]["ports"],
        find(&kustomize, "Service", base)["spec"]["ports"]
    );
}
