//! The real `talosctl upgrade-k8s` (v1.14.1, built by scripts/build-talosctl.sh) against a simulated
//! cluster mirrored into an API server of its own, and the same cluster shape upgraded by the
//! controller: both must end in the same state, compared field by field (every field of every node's
//! machine config read through the Talos API, the configuration changes each node accepted, the
//! running components in the simulator's snapshot, the Nodes, the static pods' images, config versions
//! and status, the objects the bootstrap manifests made in kube-system). Differences on purpose are
//! asserted as such (docs/upgrades.md, "Compared with talosctl upgrade-k8s"); any other fails the test.
//! The clusters run Talos 1.14.0 (`final-` configs), 1.13.4 (server-side apply of the manifests, no
//! `final-` configs) or 1.12.0 (talosctl's legacy manifest sync); on 1.14.0 also with configs created
//! on 1.14 (every image in its `Kube*Config` document) and mixed (control planes in v1alpha1, workers
//! in documents).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams};
use talos_sim::ClientRole;
use testenv::AnonymousAccess;

use crate::world::{ConfigShape, World, WorldSpec};

const FROM: &str = "1.34.1";
const TO: &str = "1.35.0";
const APPLY: &str = "/machine.MachineService/ApplyConfiguration";

/// The real talosctl, built (or found in the cache) by scripts/build-talosctl.sh.
fn talosctl() -> &'static Path {
    static TALOSCTL: OnceLock<PathBuf> = OnceLock::new();
    TALOSCTL
        .get_or_init(|| testenv::script::binary(&testenv::script::path("build-talosctl.sh"), &[]))
}

/// Two identical clusters, each on an API server of its own; no controller yet. Configs whose images
/// are in the Talos 1.14 documents were created on 1.14, so they carry the install image in an
/// `UnattendedInstallConfig` too (as the `Mixed` shape's workers do).
async fn cluster(prefix: &str, talos: &'static str, shape: ConfigShape) -> World {
    let world = World::start(
        prefix,
        WorldSpec {
            talos,
            kubernetes: FROM,
            config_shape: shape,
            unattended_install: shape == ConfigShape::Documents,
            start_controller: false,
            own_control_plane: true,
            ..WorldSpec::default()
        },
    )
    .await;
    wait_for_ready_nodes(&world, FROM).await;
    world
}

/// Every simulated node registered Ready with kubelet `v<version>`.
async fn wait_for_ready_nodes(world: &World, version: &str) {
    let nodes: Api<Node> = Api::all(world.ns.client.clone());
    let expected = world.sim.nodes().len();
    let kubelet = format!("v{version}");
    world
        .poll(
            Duration::from_secs(120),
            "every node Ready on the expected kubelet",
            || {
                let nodes = nodes.clone();
                let kubelet = kubelet.clone();
                async move {
                    let Ok(list) = nodes.list(&ListParams::default()).await else {
                        return false;
                    };
                    let ready = list
                        .items
                        .iter()
                        .filter(|n| {
                            let info = n.status.as_ref().and_then(|s| s.node_info.as_ref());
                            info.is_some_and(|i| i.kubelet_version == kubelet)
                                && testenv::node_ready(n)
                        })
                        .count();
                    ready == expected
                }
            },
        )
        .await;
}

/// The kubeconfig Talos hands out has a client certificate (talosctl accepts no other kind); this API
/// server has no client CA, so its requests arrive as `system:anonymous`, which is made cluster-admin
/// on this world's own API server (and only there).
async fn serve_talos_kubeconfig(world: &World) {
    let api = world.ns.control_plane();
    api.allow_anonymous(AnonymousAccess::Admin)
        .await
        .expect("granting anonymous requests cluster-admin");
    world
        .sim
        .set_workload_kubeconfig(Some(&api.talos_shaped_kubeconfig(world.sim.cluster_name())))
        .expect("the workload kubeconfig");
}

/// A finished talosctl run.
struct Run {
    args: String,
    success: bool,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "$ talosctl {}\n--- stdout\n{}--- stderr\n{}---",
            self.args, self.stdout, self.stderr
        )
    }
}

/// `talosctl --talosconfig … -e <cp-1> -n <cp-1> <args>` to its end.
async fn run_talosctl(world: &World, dir: &Path, args: &[&str]) -> Run {
    let talosconfig = dir.join("talosconfig");
    std::fs::write(&talosconfig, world.sim.talosconfig(ClientRole::Admin)).expect("talosconfig");
    let cp1 = node_ip(world, "cp-1");
    let mut command = tokio::process::Command::new(talosctl());
    command
        .arg("--talosconfig")
        .arg(&talosconfig)
        .args(["-e", &cp1, "-n", &cp1])
        .args(args)
        .env("HOME", dir)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(600), command.output())
        .await
        .unwrap_or_else(|_| panic!("talosctl {} did not finish", args.join(" ")))
        .expect("running talosctl");
    let run = Run {
        args: args.join(" "),
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    };
    println!("{run}");
    run
}

fn node_ip(world: &World, short: &str) -> String {
    let name = world.node(short);
    world
        .sim
        .nodes()
        .into_iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
        .address
        .to_string()
}

/// Everything compared, flattened to `what → value`, with the cluster's own names and addresses
/// replaced by placeholders (the two clusters differ in those from the start).
type State = BTreeMap<String, String>;

/// Flatten a JSON value into `prefix.path → scalar` entries.
fn flatten(prefix: &str, value: &serde_json::Value, out: &mut State) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                flatten(&format!("{prefix}.{key}"), value, out);
            }
        }
        serde_json::Value::Array(items) => {
            for (i, value) in items.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), value, out);
            }
        }
        scalar => {
            out.insert(prefix.to_string(), scalar.to_string());
        }
    }
}

/// The metadata a server or a run stamps (uids, times, resource versions, boot ids), never compared.
fn volatile(key: &str) -> bool {
    [
        ".uid",
        ".resourceVersion",
        ".creationTimestamp",
        ".generation",
        ".managedFields[",
        ".time",
        ".lastTransitionTime",
        ".lastHeartbeatTime",
        ".boot_id",
        ".startTime",
        ".podIP",
        "kubernetes.io/config.hash",
    ]
    .iter()
    .any(|v| key.contains(v))
}

/// Read everything compared from one world: per node the machine config (through the Talos API), the
/// simulator's snapshot, the Node and its static pods as the API server has them; the objects in
/// kube-system the bootstrap manifests are made of, and who manages their fields.
/// Each node's images as the simulator's ApplyConfiguration record names them, from its snapshot.
fn images_now(world: &World) -> BTreeMap<String, serde_json::Value> {
    world
        .sim
        .snapshots()
        .into_iter()
        .map(|n| {
            let mut images = serde_json::json!({"kubelet": n.kubelet.desired_image});
            if let Some(cp) = &n.control_plane {
                images["apiserver"] = cp.apiserver.desired_image.clone().into();
                images["controller_manager"] = cp.controller_manager.desired_image.clone().into();
                images["scheduler"] = cp.scheduler.desired_image.clone().into();
                images["proxy"] = cp.proxy_image.clone().into();
            }
            (n.name, images)
        })
        .collect()
}

/// Where one world's upgrade starts: the images each node had, and how many calls the simulator had
/// recorded (talosctl's dry run among them) before it.
struct Start {
    images: BTreeMap<String, serde_json::Value>,
    calls: usize,
}

impl Start {
    fn now(world: &World) -> Start {
        Start {
            images: images_now(world),
            calls: world.sim.record().len(),
        }
    }
}

/// Which images each configuration change in `calls` changed, per node: `field+field (mode)`.
fn config_changes(
    world: &World,
    start: &Start,
    calls: &[talos_sim::CallRecord],
) -> BTreeMap<String, Vec<String>> {
    let mut last = start.images.clone();
    let mut applied: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for call in calls {
        if call.method != APPLY || call.result != "ok" {
            continue;
        }
        let images = call.params["images"].clone();
        let before = last.get(&call.node).cloned().unwrap_or_default();
        // Worker configs carry no control-plane images (the record shows Talos's defaults there).
        let changed: Vec<String> = images
            .as_object()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|(field, image)| before.get(field).is_some_and(|b| b != image))
            .map(|(field, _)| field)
            .collect();
        let short = call
            .node
            .trim_start_matches(&format!("{}-", world.ns.name))
            .to_string();
        applied.entry(short).or_default().push(format!(
            "{} ({})",
            changed.join("+"),
            call.params["mode"]
        ));
        last.insert(call.node.clone(), images);
    }
    applied
}

async fn observe(world: &World, start: &Start) -> State {
    let mut raw = State::new();
    let client = world.ns.client.clone();
    let prefix_ip = {
        let ip = node_ip(world, "cp-1");
        ip.rsplit_once('.')
            .map(|(p, _)| format!("{p}."))
            .unwrap_or(ip)
    };
    for node in world.sim.nodes() {
        let short = node
            .name
            .trim_start_matches(&format!("{}-", world.ns.name))
            .to_string();
        // Each document under its kind (`v1alpha1` for the v1alpha1 one), so that a document added,
        // dropped or moved shows as such rather than as every later document's fields differing; the
        // order is compared on its own.
        let config = world.machine_config(&short).await;
        let mut kinds = Vec::new();
        for document in serde_yaml::Deserializer::from_str(&config) {
            let value: serde_json::Value =
                serde::Deserialize::deserialize(document).expect("a YAML document");
            if value.is_null() {
                continue;
            }
            let kind = if value["version"] == "v1alpha1" {
                "v1alpha1".to_string()
            } else {
                match (value["kind"].as_str(), value["name"].as_str()) {
                    (Some(kind), Some(name)) => format!("{kind}/{name}"),
                    (Some(kind), None) => kind.to_string(),
                    (None, _) => "<no kind>".to_string(),
                }
            };
            flatten(&format!("{short} config[{kind}]"), &value, &mut raw);
            kinds.push(kind);
        }
        raw.insert(format!("{short} config documents"), kinds.join(", "));
        let snapshot = world.sim.node_snapshot(&node.name).expect("snapshot");
        let snapshot = serde_json::to_value(&snapshot).expect("snapshot as JSON");
        for part in [
            "kubelet",
            "control_plane",
            "machine_config_version",
            "talos_version",
        ] {
            flatten(
                &format!("{short} snapshot.{part}"),
                &snapshot[part],
                &mut raw,
            );
        }
    }
    // The configuration changes each node accepted since the start, in order.
    let calls = world.sim.record();
    for (short, changes) in config_changes(world, start, &calls[start.calls.min(calls.len())..]) {
        raw.insert(format!("{short} applied"), changes.join(", "));
    }
    let nodes: Api<Node> = Api::all(client.clone());
    for node in nodes
        .list(&ListParams::default())
        .await
        .expect("nodes")
        .items
    {
        let name = node.metadata.name.clone().unwrap_or_default();
        let short = name
            .trim_start_matches(&format!("{}-", world.ns.name))
            .to_string();
        let status = serde_json::to_value(node.status.unwrap_or_default()).expect("status");
        flatten(
            &format!("{short} Node.nodeInfo"),
            &status["nodeInfo"],
            &mut raw,
        );
        flatten(
            &format!("{short} Node.conditions"),
            &status["conditions"],
            &mut raw,
        );
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    for pod in pods.list(&ListParams::default()).await.expect("pods").items {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let value = serde_json::to_value(&pod).expect("pod");
        flatten(
            &format!("Pod {name}.annotations"),
            &value["metadata"]["annotations"],
            &mut raw,
        );
        flatten(
            &format!("Pod {name}.labels"),
            &value["metadata"]["labels"],
            &mut raw,
        );
        flatten(
            &format!("Pod {name}.spec"),
            &value["spec"]["containers"],
            &mut raw,
        );
        flatten(&format!("Pod {name}.status"), &value["status"], &mut raw);
    }
    // The bootstrap manifests' objects: every ServiceAccount, ConfigMap, DaemonSet and Deployment in
    // kube-system (whatever a sync created), and the field managers that own them.
    let mut objects = Vec::new();
    for list in [
        serde_json::to_value(
            Api::<DaemonSet>::namespaced(client.clone(), "kube-system")
                .list(&ListParams::default())
                .await
                .expect("daemonsets")
                .items,
        ),
        serde_json::to_value(
            Api::<Deployment>::namespaced(client.clone(), "kube-system")
                .list(&ListParams::default())
                .await
                .expect("deployments")
                .items,
        ),
        serde_json::to_value(
            Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(
                client.clone(),
                "kube-system",
            )
            .list(&ListParams::default())
            .await
            .expect("service accounts")
            .items,
        ),
        serde_json::to_value(
            Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), "kube-system")
                .list(&ListParams::default())
                .await
                .expect("config maps")
                .items,
        ),
    ] {
        objects.extend(
            list.expect("objects as JSON")
                .as_array()
                .cloned()
                .unwrap_or_default(),
        );
    }
    for object in objects {
        let kind = object["kind"].as_str().unwrap_or("object").to_string();
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        // Service accounts and config maps the API server makes itself are not the manifests'.
        if name == "default"
            || name == "kube-root-ca.crt"
            || name.starts_with("extension-apiserver")
        {
            continue;
        }
        let key = format!("kube-system {kind} {name}");
        flatten(
            &format!("{key}.labels"),
            &object["metadata"]["labels"],
            &mut raw,
        );
        flatten(
            &format!("{key}.annotations"),
            &object["metadata"]["annotations"],
            &mut raw,
        );
        flatten(&format!("{key}.spec"), &object["spec"], &mut raw);
        flatten(&format!("{key}.data"), &object["data"], &mut raw);
        let managers: Vec<String> = object["metadata"]["managedFields"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            // A status writer (the rollouts the test plays) is not the sync.
            .filter(|f| f["subresource"].is_null())
            .map(|f| {
                format!(
                    "{}/{}",
                    f["manager"].as_str().unwrap_or_default(),
                    f["operation"].as_str().unwrap_or_default()
                )
            })
            .collect();
        raw.insert(format!("{key} managers"), managers.join(","));
    }
    raw.into_iter()
        .filter(|(key, _)| !volatile(key))
        .map(|(key, value)| {
            let normalize = |text: &str| {
                text.replace(&world.ns.name, "<cluster>")
                    .replace(&prefix_ip, "<net>.")
            };
            (normalize(&key), normalize(&value))
        })
        .collect()
}

/// `key → (talosctl's value, the controller's)` for every key whose values differ.
fn differences(by_talosctl: &State, by_controller: &State) -> BTreeMap<String, (String, String)> {
    let keys: std::collections::BTreeSet<&String> =
        by_talosctl.keys().chain(by_controller.keys()).collect();
    keys.into_iter()
        .filter_map(|key| {
            let a = by_talosctl
                .get(key)
                .cloned()
                .unwrap_or_else(|| "<absent>".into());
            let b = by_controller
                .get(key)
                .cloned()
                .unwrap_or_else(|| "<absent>".into());
            (a != b).then(|| (key.clone(), (a, b)))
        })
        .collect()
}

fn show(diff: &BTreeMap<String, (String, String)>) -> String {
    diff.iter()
        .map(|(k, (a, b))| format!("  {k}\n    talosctl:   {a}\n    controller: {b}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Why a difference between talosctl's result and the controller's is on purpose (docs/upgrades.md,
/// "Compared with talosctl upgrade-k8s"), or `None`: a difference that fails the test.
fn on_purpose(key: &str, talosctl: &str, controller: &str) -> Option<&'static str> {
    const INVENTORY: &str = "talosctl records what it applied in an inventory ConfigMap (to prune what \
        a newer Talos stops rendering); the controller does not prune";
    if key.starts_with("kube-system ConfigMap talos-bootstrap-manifests-inventory")
        && controller == "<absent>"
    {
        return Some(INVENTORY);
    }
    if key.ends_with(".annotations.config.k8s.io/owning-inventory")
        && talosctl == "\"talos-bootstrap-manifests-inventory\""
        && controller == "<absent>"
    {
        return Some(INVENTORY);
    }
    // The same annotation, on an object that has no other: the controller's has none at all.
    if key.ends_with(".annotations") && talosctl == "<absent>" && controller == "null" {
        return Some(INVENTORY);
    }
    // The annotation is the one field talos applies to the ServiceAccount; without it server-side
    // apply records no manager.
    if key == "kube-system ServiceAccount kube-proxy managers"
        && talosctl == "talos/Apply"
        && controller.is_empty()
    {
        return Some(INVENTORY);
    }
    // Before Talos 1.13 both sides create and update the objects (no server-side apply). talosctl's
    // writes name no field manager, so the API server takes one from its Go client's User-Agent;
    // the controller's name its own (src/kubernetes_upgrade/manifests.rs, `LEGACY_FIELD_MANAGER`).
    if key.ends_with(" managers")
        && talosctl == "Go-http-client/Update"
        && controller == "talos-upgrade-controller/Update"
    {
        return Some(
            "talosctl's legacy sync names no field manager; the controller's writes name its own",
        );
    }
    if key.starts_with("worker-")
        && key.ends_with(".machine.ca.key")
        && talosctl == "\"\""
        && controller == "<absent>"
    {
        return Some(
            "talosctl re-encodes the whole config through Talos's encoder, which writes the \
            worker's empty CA key; the controller changes only the image field and keeps the rest",
        );
    }
    None
}

/// Plays the DaemonSet and Deployment controllers the test API server does not run, for the objects
/// in kube-system: each is marked rolled out at its generation, so that the legacy manifest sync's
/// rollout wait (go-kubernetes v0.2.41 `kubernetes/manifests/rollout.go`) ends. Runs until aborted.
async fn play_rollouts(client: kube::Client) {
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    let deployments: Api<Deployment> = Api::namespaced(client, "kube-system");
    let params = kube::api::PatchParams::default();
    loop {
        if let Ok(list) = daemonsets.list(&ListParams::default()).await {
            for ds in list.items {
                let generation = ds.metadata.generation.unwrap_or_default();
                if ds.status.as_ref().map(|s| s.observed_generation) == Some(Some(generation)) {
                    continue;
                }
                let status = serde_json::json!({"status": {
                    "observedGeneration": generation,
                    "desiredNumberScheduled": 5,
                    "currentNumberScheduled": 5,
                    "updatedNumberScheduled": 5,
                    "numberAvailable": 5,
                    "numberReady": 5,
                    "numberMisscheduled": 0,
                }});
                let name = ds.metadata.name.unwrap_or_default();
                let _ = daemonsets
                    .patch_status(&name, &params, &kube::api::Patch::Merge(&status))
                    .await;
            }
        }
        if let Ok(list) = deployments.list(&ListParams::default()).await {
            for deployment in list.items {
                let generation = deployment.metadata.generation.unwrap_or_default();
                if deployment.status.as_ref().map(|s| s.observed_generation)
                    == Some(Some(generation))
                {
                    continue;
                }
                let replicas = deployment
                    .spec
                    .as_ref()
                    .and_then(|s| s.replicas)
                    .unwrap_or(1);
                let status = serde_json::json!({"status": {
                    "observedGeneration": generation,
                    "replicas": replicas,
                    "updatedReplicas": replicas,
                    "readyReplicas": replicas,
                    "availableReplicas": replicas,
                }});
                let name = deployment.metadata.name.unwrap_or_default();
                let _ = deployments
                    .patch_status(&name, &params, &kube::api::Patch::Merge(&status))
                    .await;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Talos 1.13 and later: talosctl syncs the manifests with server-side apply and an inventory.
#[tokio::test]
async fn talosctl_upgrade_k8s_and_the_controller_end_in_the_same_state() {
    compare("1.13.4", ConfigShape::V1alpha1, true).await;
}

/// Talos 1.12: talosctl's legacy manifest sync (get, create or update, then a rollout wait).
#[tokio::test]
async fn talosctl_upgrade_k8s_and_the_controller_end_in_the_same_state_before_talos_1_13() {
    compare("1.12.0", ConfigShape::V1alpha1, false).await;
}

/// Talos 1.14: the static pods are rendered from the `final-` configs, which talosctl 1.14.1 waits on.
#[tokio::test]
async fn talosctl_upgrade_k8s_and_the_controller_end_in_the_same_state_on_talos_1_14() {
    compare("1.14.0", ConfigShape::V1alpha1, true).await;
}

/// Talos 1.14 with configs created on 1.14: every image in its `Kube*Config` document, none in the
/// v1alpha1 document; talosctl 1.14.1 patches the document where the config has one (machinery v1.14.1
/// `config/generate/stdpatches/guess.go`).
#[tokio::test]
async fn talosctl_upgrade_k8s_and_the_controller_end_in_the_same_state_on_talos_1_14_documents() {
    compare("1.14.0", ConfigShape::Documents, true).await;
}

/// Talos 1.14, control planes upgraded from 1.13 (images in v1alpha1), workers created on 1.14 (the
/// kubelet image in a `KubeletConfig` document): each node is patched where its config keeps it.
#[tokio::test]
async fn talosctl_upgrade_k8s_and_the_controller_end_in_the_same_state_on_talos_1_14_mixed() {
    compare("1.14.0", ConfigShape::Mixed, true).await;
}

async fn compare(talos: &'static str, shape: ConfigShape, server_side_apply: bool) {
    let by_talosctl = cluster("k8s-cmp-talosctl", talos, shape).await;
    let by_controller = cluster("k8s-cmp-controller", talos, shape).await;
    serve_talos_kubeconfig(&by_talosctl).await;
    // What differs between the two clusters before either is upgraded is not the upgrades' doing.
    let initial = Start::now(&by_talosctl);
    let before = differences(
        &observe(&by_talosctl, &initial).await,
        &observe(&by_controller, &Start::now(&by_controller)).await,
    );

    // One per test: the tests run side by side in one process, each with its own talosconfig.
    let dir = std::env::temp_dir().join(format!(
        "tuc-upgrade-k8s-{talos}-{shape:?}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let dry = run_talosctl(
        &by_talosctl,
        &dir,
        &["upgrade-k8s", "--to", TO, "--dry-run"],
    )
    .await;
    assert!(dry.success, "the dry run failed:\n{dry}");
    for text in [
        "checking for removed Kubernetes component flags",
        "checking for removed Kubernetes API resource versions",
        &format!("update kube-apiserver: {FROM} -> {TO}"),
        &format!("update kubelet: {FROM} -> {TO}"),
        if server_side_apply {
            "updating manifests (dry run)"
        } else {
            "dry run, change skipped"
        },
        if server_side_apply {
            "created DaemonSet/kube-system/kube-proxy"
        } else {
            "processing manifest apps/v1.DaemonSet/kube-system/kube-proxy"
        },
    ] {
        assert!(
            dry.stdout.contains(text),
            "the dry run does not show {text:?}:\n{dry}"
        );
    }
    // The dry run changes no image, but its kube-proxy step still sends each control plane its
    // config, unchanged (talos v1.14.1 pkg/cluster/kubernetes/talos_managed.go: `patchKubeProxy`
    // returns no patch under --dry-run and `patchNodeConfig` applies the result all the same).
    let after_dry = Start::now(&by_talosctl);
    let dry_changes = config_changes(
        &by_talosctl,
        &initial,
        &by_talosctl.sim.record()[initial.calls..after_dry.calls],
    );
    let expected: BTreeMap<String, Vec<String>> = ["cp-1", "cp-2", "cp-3"]
        .into_iter()
        .map(|cp| (cp.to_string(), vec![" (\"NO_REBOOT\")".to_string()]))
        .collect();
    assert_eq!(dry_changes, expected, "what the dry run applied");
    assert_eq!(
        after_dry.images, initial.images,
        "the dry run changed an image"
    );

    // The test API server runs no DaemonSet or Deployment controller, so a rollout never completes:
    // talosctl is told not to wait for one (`--manifests-reconcile-timeout 0`); the controller never
    // waits for one.
    // Before Talos 1.13 the wait cannot be skipped: the test plays the rollouts.
    let rollouts = tokio::spawn(play_rollouts(by_talosctl.ns.client.clone()));
    let real = run_talosctl(
        &by_talosctl,
        &dir,
        &[
            "upgrade-k8s",
            "--to",
            TO,
            "--manifests-reconcile-timeout",
            "0",
        ],
    )
    .await;
    rollouts.abort();
    assert!(real.success, "upgrade-k8s failed:\n{real}");
    let _ = std::fs::remove_dir_all(&dir);

    let controller_start = Start::now(&by_controller);
    by_controller.start_controller();
    by_controller
        .wait_for_annotation("kubernetes-current", FROM, "60s")
        .await;
    by_controller.annotate("kubernetes-target", TO).await;
    by_controller
        .wait_for_annotation("kubernetes-status", "completed", "300s")
        .await;
    wait_for_ready_nodes(&by_talosctl, TO).await;
    wait_for_ready_nodes(&by_controller, TO).await;

    let talosctl_state = observe(&by_talosctl, &after_dry).await;
    let controller_state = observe(&by_controller, &controller_start).await;
    // The upgrade itself: every control plane's static pods, kube-proxy, then kubelet, one change at
    // a time, each node's kubelet after the control planes; the same on both sides.
    for cp in ["cp-1", "cp-2", "cp-3"] {
        assert_eq!(
            talosctl_state[&format!("{cp} applied")],
            "apiserver (\"NO_REBOOT\"), controller_manager (\"NO_REBOOT\"), scheduler (\"NO_REBOOT\"), \
             proxy (\"NO_REBOOT\"), kubelet (\"NO_REBOOT\")",
            "{cp}"
        );
        // The dry run's apply is one more config version on talosctl's side.
        let version = |state: &State| -> u64 {
            state[&format!("{cp} snapshot.machine_config_version")]
                .parse()
                .expect("a number")
        };
        assert_eq!(
            version(&talosctl_state),
            version(&controller_state) + 1,
            "{cp}"
        );
    }
    // Where each node's config keeps its images: its 1.14 documents, or the v1alpha1 fields.
    let (controller_manager_image, worker_kubelet_image) = match shape {
        ConfigShape::V1alpha1 => (
            "cp-2 config[v1alpha1].cluster.controllerManager.image",
            "worker-2 config[v1alpha1].machine.kubelet.image",
        ),
        ConfigShape::Documents => (
            "cp-2 config[KubeControllerManagerConfig].image",
            "worker-2 config[KubeletConfig].image",
        ),
        ConfigShape::Mixed => (
            "cp-2 config[v1alpha1].cluster.controllerManager.image",
            "worker-2 config[KubeletConfig].image",
        ),
    };
    // The documents each config has, in order, on both sides (talosctl's re-encoding adds none, drops
    // none and keeps their order).
    const CONTROL_PLANE_DOCUMENTS: &str = "v1alpha1, TimeSyncConfig, KubeletConfig, \
        KubeAPIServerConfig, KubeControllerManagerConfig, KubeSchedulerConfig, KubeProxyConfig, \
        UnattendedInstallConfig";
    let (control_plane_documents, worker_documents) = match shape {
        ConfigShape::V1alpha1 => ("v1alpha1, TimeSyncConfig", "v1alpha1, TimeSyncConfig"),
        ConfigShape::Documents => (
            CONTROL_PLANE_DOCUMENTS,
            "v1alpha1, TimeSyncConfig, KubeletConfig, UnattendedInstallConfig",
        ),
        ConfigShape::Mixed => (
            "v1alpha1, TimeSyncConfig",
            "v1alpha1, TimeSyncConfig, KubeletConfig, UnattendedInstallConfig",
        ),
    };
    for state in [&talosctl_state, &controller_state] {
        assert_eq!(state["cp-1 config documents"], control_plane_documents);
        assert_eq!(state["worker-1 config documents"], worker_documents);
        // Never in both places (Talos refuses a config with a document and its v1alpha1 field).
        let other_places: &[&str] = match shape {
            ConfigShape::V1alpha1 => &[
                "cp-2 config[KubeControllerManagerConfig].image",
                "worker-2 config[KubeletConfig].image",
            ],
            ConfigShape::Documents => &[
                "cp-2 config[v1alpha1].cluster.controllerManager.image",
                "worker-2 config[v1alpha1].machine.kubelet.image",
            ],
            ConfigShape::Mixed => &[
                "cp-2 config[KubeControllerManagerConfig].image",
                "worker-2 config[v1alpha1].machine.kubelet.image",
            ],
        };
        for key in other_places {
            assert_eq!(state.get(*key), None, "{key}");
        }
        // What the comparison covers is there on both sides.
        for (key, value) in [
            ("cp-1 Node.nodeInfo.kubeletVersion", format!("\"v{TO}\"")),
            (
                "worker-1 Node.nodeInfo.kubeletVersion",
                format!("\"v{TO}\""),
            ),
            ("worker-1 snapshot.kubelet.version", format!("\"{TO}\"")),
            (
                controller_manager_image,
                format!("\"registry.k8s.io/kube-controller-manager:v{TO}\""),
            ),
            (
                worker_kubelet_image,
                format!("\"ghcr.io/siderolabs/kubelet:v{TO}\""),
            ),
            (
                "Pod kube-scheduler-<cluster>-cp-3.spec[0].image",
                format!("\"registry.k8s.io/kube-scheduler:v{TO}\""),
            ),
            (
                "Pod kube-apiserver-<cluster>-cp-1.annotations.talos.dev/config-version",
                "\"2\"".to_string(),
            ),
            (
                "kube-system DaemonSet kube-proxy.spec.template.spec.containers[0].image",
                format!("\"registry.k8s.io/kube-proxy:v{TO}\""),
            ),
            (
                "kube-system Deployment coredns.spec.template.spec.containers[0].image",
                "\"registry.k8s.io/coredns/coredns:v1.12.1\"".to_string(),
            ),
        ] {
            assert_eq!(state.get(key), Some(&value), "{key}");
        }
        if server_side_apply {
            assert_eq!(
                state["kube-system DaemonSet kube-proxy managers"],
                "talos/Apply"
            );
        }
        for (key, image) in [
            (
                "cp-1 snapshot.control_plane.apiserver.image",
                "registry.k8s.io/kube-apiserver",
            ),
            (
                "cp-2 snapshot.control_plane.scheduler.image",
                "registry.k8s.io/kube-scheduler",
            ),
            (
                "cp-3 snapshot.control_plane.proxy_image",
                "registry.k8s.io/kube-proxy",
            ),
            (
                "worker-2 snapshot.kubelet.image",
                "ghcr.io/siderolabs/kubelet",
            ),
        ] {
            assert_eq!(state[key], format!("\"{image}:v{TO}\""), "{key}");
        }
    }

    let after = differences(&talosctl_state, &controller_state);
    let (explained, unexplained): (Vec<_>, Vec<_>) = after
        .into_iter()
        .filter(|(key, values)| before.get(key) != Some(values))
        .filter(|(key, _)| !key.ends_with("snapshot.machine_config_version"))
        .partition(|(key, (a, b))| on_purpose(key, a, b).is_some());
    let explained: BTreeMap<_, _> = explained.into_iter().collect();
    let unexplained: BTreeMap<_, _> = unexplained.into_iter().collect();
    println!("differences on purpose:\n{}", show(&explained));
    assert!(
        unexplained.is_empty(),
        "unexpected differences:\n{}",
        show(&unexplained)
    );
    // Each difference on purpose is there (the comparison sees what it should).
    let expected: &[&str] = if server_side_apply {
        &[
            "kube-system ConfigMap talos-bootstrap-manifests-inventory managers",
            "kube-system DaemonSet kube-proxy.annotations.config.k8s.io/owning-inventory",
            "kube-system ServiceAccount kube-proxy managers",
            "worker-1 config[v1alpha1].machine.ca.key",
        ]
    } else {
        &[
            "kube-system DaemonSet kube-proxy managers",
            "kube-system Deployment coredns managers",
            "worker-1 config[v1alpha1].machine.ca.key",
        ]
    };
    for &key in expected {
        assert!(
            explained.contains_key(key),
            "no difference at {key}:\n{}",
            show(&explained)
        );
    }
}
