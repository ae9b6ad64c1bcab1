//! Talos 1.14 clusters (issue 22): configs created on 1.14 put the install image in an
//! `UnattendedInstallConfig` document (machinery v1.14.1, `config/types/runtime/unattended_install.go`)
//! and have no `machine.install.image`; the upgrade takes the installer from there. The generic
//! installer has no 1.14 images, so nodes on it move to the Image Factory image of their platform;
//! installer failures are retried or not as their exit code says.

use talos_sim::{CallRecord, Fault};

use crate::world::{ConfigShape, World, WorldSpec};

/// The Image Factory's empty ("vanilla") schematic.
const EMPTY_SCHEMATIC: &str = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
/// An Image Factory installer for bare metal, with a schematic (the document's own example's shape).
const METAL_INSTALLER: &str = "factory.talos.dev/metal-installer/376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
/// A schematic of the cluster's own (extensions), not the empty one.
const OWN_SCHEMATIC: &str = "0f3e6bbf0aa3b4e4b6d4ce18ef7b2e5d8f7f4a1a0c9e8d7c6b5a493827160514";
const TARGET: &str = "1.14.1";

/// The images of the calls of `method` (`ImageService/Pull`'s `image_ref`, an upgrade's `image`),
/// per node, in order.
fn images(record: &[CallRecord], method: &str) -> Vec<(String, String)> {
    record
        .iter()
        .filter(|c| c.method.ends_with(method))
        .map(|c| {
            let image = c.params["image"]
                .as_str()
                .or_else(|| c.params["image_ref"].as_str())
                .unwrap_or_default();
            (c.node.clone(), image.to_string())
        })
        .collect()
}

/// A 1.13 cluster of five nodes (Kubernetes 1.36, which 1.14 supports), with `spec`'s installer.
async fn cluster_on_1_13(prefix: &str, spec: WorldSpec) -> World {
    let world = World::start(
        prefix,
        WorldSpec {
            talos: "1.13.5",
            kubernetes: "1.36.2",
            ..spec
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.13.5", "60s")
        .await;
    world
}

/// Every pull and install carried `expected` (and nothing else): five installs, one per node.
fn assert_installed_with(world: &World, expected: &str) {
    let record = world.sim.record();
    let installs = images(&record, "LifecycleService/Upgrade");
    assert_eq!(installs.len(), 5, "{installs:?}");
    let pulls = images(&record, "ImageService/Pull");
    for (node, image) in installs.iter().chain(&pulls) {
        assert_eq!(image, expected, "a call to {node}");
    }
}

/// A cluster created on Talos 1.14.0 (its install image only in `UnattendedInstallConfig`) is upgraded
/// to 1.14.1 with the same factory repository and schematic: every install call (`LifecycleService`)
/// carries it, and no node is touched on any other image.
#[tokio::test]
async fn a_cluster_created_on_1_14_is_upgraded_with_the_installer_of_its_unattended_install_config()
{
    let world = World::start(
        "t114-unattended",
        WorldSpec {
            talos: "1.14.0",
            kubernetes: "1.37.0",
            installer_repository: Some(METAL_INSTALLER),
            unattended_install: true,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("talos-current", "1.14.0", "60s")
        .await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;

    let expected = format!("{METAL_INSTALLER}:v{TARGET}");
    let record = world.sim.record();
    let installs: Vec<(String, String)> = record
        .iter()
        .filter(|c| c.method.ends_with("LifecycleService/Upgrade"))
        .map(|c| {
            (
                c.node.clone(),
                c.params["image"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(installs.len(), 5, "{installs:?}");
    for (node, image) in &installs {
        assert_eq!(image, &expected, "the install on {node}");
    }
    let pulls: Vec<String> = record
        .iter()
        .filter(|c| c.method.ends_with("ImageService/Pull"))
        .map(|c| {
            c.params["image_ref"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    assert!(
        pulls.iter().all(|image| *image == expected),
        "every pull is of {expected}: {pulls:?}"
    );
    assert_eq!(
        world.annotation("talos-message").await,
        format!("Talos upgrade completed: now running {TARGET}")
    );
}

/// A vanilla 1.13 cluster (every node on the generic installer `ghcr.io/siderolabs/installer`, which
/// has no 1.14 images) upgraded to 1.14.1: each node gets the Image Factory installer of the platform
/// it reports (here `hcloud`, read from the node, not guessed `metal`) with the empty schematic. No node
/// is asked to pull or install the generic image; the Event names the image per node.
#[tokio::test]
async fn a_vanilla_cluster_moves_from_the_generic_installer_to_its_platforms_factory_image() {
    let world = cluster_on_1_13(
        "t114-vanilla",
        WorldSpec {
            platform: Some("hcloud"),
            ..WorldSpec::default()
        },
    )
    .await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    let expected = format!("factory.talos.dev/hcloud-installer/{EMPTY_SCHEMATIC}:v{TARGET}");
    assert_installed_with(&world, &expected);
    let started = world.event_messages("NodeUpgradeStarted").await;
    assert_eq!(started.len(), 5, "{started:?}");
    assert!(
        started
            .iter()
            .all(|m| m.ends_with(&format!("from Talos 1.13.5 to {TARGET} with {expected}"))),
        "{started:?}"
    );
}

/// A cluster installed from the Image Factory with a schematic of its own (its extensions) keeps it
/// across 1.13 → 1.14: only the tag changes.
#[tokio::test]
async fn a_factory_schematic_cluster_keeps_its_schematic_to_1_14() {
    let own = format!("factory.talos.dev/metal-installer/{OWN_SCHEMATIC}");
    let world = cluster_on_1_13(
        "t114-schematic",
        WorldSpec {
            installer_repository: Some(Box::leak(own.clone().into_boxed_str())),
            ..WorldSpec::default()
        },
    )
    .await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    assert_installed_with(&world, &format!("{own}:v{TARGET}"));
}

/// The `talos-schematic` annotation names the installer of every node: the factory image of each
/// node's platform with that schematic, instead of the one derived from the node's own image.
#[tokio::test]
async fn the_schematic_annotation_names_every_nodes_installer() {
    let world = cluster_on_1_13("t114-override", WorldSpec::default()).await;
    world.annotate("talos-schematic", OWN_SCHEMATIC).await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    assert_installed_with(
        &world,
        &format!("factory.talos.dev/metal-installer/{OWN_SCHEMATIC}:v{TARGET}"),
    );
}

/// Nodes whose platform the Image Factory builds no installer for cannot be given a 1.14 installer in
/// place of the generic one: the run fails before any call to any node, naming every such node and
/// saying which annotation to set; no node pulls, installs or reboots.
#[tokio::test]
async fn a_platform_the_factory_does_not_serve_fails_before_any_call() {
    let world = cluster_on_1_13(
        "t114-platform",
        WorldSpec {
            platform: Some("container"),
            ..WorldSpec::default()
        },
    )
    .await;
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let message = world.annotation("talos-message").await;
    let order = ["worker-1", "worker-2", "cp-1", "cp-2", "cp-3"].map(|short| world.node(short));
    let each = order
        .iter()
        .map(|node| {
            format!(
                "node {node} has an installer image the upgrade cannot be derived from: the \
                 node's platform \"container\" is not one the Image Factory builds installers for \
                 (needed for its installer ghcr.io/siderolabs/installer, which has no Talos \
                 {TARGET} images): set the annotation upgrade.vitistack.io/talos-installer-image to \
                 the installer repository to use (for example \
                 factory.talos.dev/metal-installer/<schematic>; the target's tag is added)"
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    assert_eq!(message, format!("Talos upgrade failed: {each}"));
    let mut failed: Vec<String> = world
        .annotation("failed-nodes")
        .await
        .split(',')
        .map(String::from)
        .collect();
    failed.sort();
    let mut expected = order.to_vec();
    expected.sort();
    assert_eq!(failed, expected);
    let touched: Vec<CallRecord> = world
        .sim
        .record()
        .into_iter()
        .filter(|c| {
            c.method.ends_with("ImageService/Pull")
                || c.method.ends_with("/Upgrade")
                || c.method.ends_with("/Reboot")
        })
        .collect();
    assert!(touched.is_empty(), "no node touched: {touched:?}");

    // Naming the installer lets the same run go on from the node that failed.
    world
        .annotate(
            "talos-installer-image",
            "registry.example.corp/talos/installer",
        )
        .await;
    world.annotate("resume", "true").await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    assert_installed_with(
        &world,
        &format!("registry.example.corp/talos/installer:v{TARGET}"),
    );
}

/// An installer that fails in a way worth retrying (exit code 5, a dependency) succeeds on its second
/// run: the node is installed twice (the failed run installed nothing), rebooted once, and a
/// `NodeInstallRetried` event names it and the installer's reason. The run completes.
#[tokio::test]
async fn a_retryable_installer_failure_succeeds_on_retry() {
    let world = cluster_on_1_13("t114-retry", WorldSpec::default()).await;
    let worker = world.node("worker-1");
    world
        .sim
        .inject_fault(&worker, Fault::InstallerExits { code: 5, count: 1 })
        .expect("fault");
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "completed", "180s")
        .await;
    world.assert_talos_run_kept_its_promises(TARGET).await;
    let installs = images(&world.sim.record(), "LifecycleService/Upgrade");
    let on_worker = installs.iter().filter(|(node, _)| *node == worker).count();
    assert_eq!(on_worker, 2, "{installs:?}");
    assert_eq!(
        installs.len(),
        6,
        "one install per other node: {installs:?}"
    );
    let retried = world.event_messages("NodeInstallRetried").await;
    assert_eq!(retried.len(), 1, "{retried:?}");
    assert!(
        retried[0].starts_with(&format!(
            "Node {worker}: the installer exited with code 5 (an external dependency failed, such as \
             an image pull)"
        )) && retried[0].contains("trying again (attempt 2"),
        "{}",
        retried[0]
    );
}

/// An installer that fails for good (exit code 2, invalid input) fails the run at that node with the
/// installer's own reason; the node is not rebooted, not cordoned, and no other node is touched.
#[tokio::test]
async fn a_permanent_installer_failure_fails_naming_the_node() {
    let world = cluster_on_1_13("t114-permanent", WorldSpec::default()).await;
    let worker = world.node("worker-1");
    world
        .sim
        .inject_fault(&worker, Fault::InstallerExits { code: 2, count: 0 })
        .expect("fault");
    world.annotate("talos-target", TARGET).await;
    world
        .wait_for_annotation("talos-status", "failed", "120s")
        .await;
    let message = world.annotation("talos-message").await;
    assert!(
        message.starts_with(&format!(
            "Talos upgrade failed: node {worker} refused the installation: the installer exited \
             with code 2 (invalid input)"
        )),
        "{message}"
    );
    assert_eq!(world.annotation("failed-nodes").await, worker);
    let record = world.sim.record();
    let installs = images(&record, "LifecycleService/Upgrade");
    assert_eq!(
        installs.len(),
        1,
        "one install, never retried: {installs:?}"
    );
    assert!(
        record.iter().all(|c| !c.method.ends_with("/Reboot")),
        "nothing rebooted"
    );
    assert!(
        crate::talos_drain::unschedulable_nodes(&world)
            .await
            .is_empty()
    );
    assert_eq!(world.event_count("NodeInstallRetried").await, 0);
}

/// Where node `short`'s config keeps the image of each Kubernetes component (`kind` of its 1.14
/// document, v1alpha1 path): the image in the document, the image in the v1alpha1 field.
fn component_images(config: &str) -> Vec<(&'static str, Option<String>, Option<String>)> {
    use serde::Deserialize as _;
    let documents: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(config)
        .map(|document| serde_yaml::Value::deserialize(document).expect("YAML"))
        .collect();
    let v1alpha1 = documents
        .iter()
        .find(|d| d.get("version").and_then(|v| v.as_str()) == Some("v1alpha1"))
        .expect("a v1alpha1 document");
    let text = |value: Option<&serde_yaml::Value>| value.and_then(|v| v.as_str()).map(String::from);
    [
        ("KubeAPIServerConfig", ["cluster", "apiServer"]),
        (
            "KubeControllerManagerConfig",
            ["cluster", "controllerManager"],
        ),
        ("KubeSchedulerConfig", ["cluster", "scheduler"]),
        ("KubeProxyConfig", ["cluster", "proxy"]),
        ("KubeletConfig", ["machine", "kubelet"]),
    ]
    .into_iter()
    .map(|(kind, [section, component])| {
        let document = documents
            .iter()
            .find(|d| d.get("kind").and_then(|k| k.as_str()) == Some(kind))
            .map(|d| text(d.get("image")));
        let field = v1alpha1
            .get(section)
            .and_then(|s| s.get(component))
            .map(|c| text(c.get("image")));
        (kind, document.flatten(), field.flatten())
    })
    .collect()
}

/// Kubernetes 1.36 → 1.37 on Talos 1.14, with the nodes' configs in `shape`: each component's image
/// is patched where the node's config keeps it (its 1.14 document, or its v1alpha1 field), never both,
/// and the run completes with every kubelet and static pod on 1.37.0.
async fn kubernetes_1_37_on(prefix: &str, shape: ConfigShape) {
    let world = World::start(
        prefix,
        WorldSpec {
            talos: TARGET,
            kubernetes: "1.36.2",
            unattended_install: shape == ConfigShape::Documents,
            config_shape: shape,
            ..WorldSpec::default()
        },
    )
    .await;
    world
        .wait_for_annotation("kubernetes-current", "1.36.2", "60s")
        .await;
    world.annotate("kubernetes-target", "1.37.0").await;
    world
        .wait_for_annotation("kubernetes-status", "completed", "240s")
        .await;
    assert_eq!(world.annotation("kubernetes-current").await, "1.37.0");
    assert_eq!(
        world.annotation("kubernetes-message").await,
        "Kubernetes upgrade completed: now running 1.37.0"
    );
    for node in ["cp-1", "cp-2", "cp-3", "worker-1", "worker-2"] {
        let in_documents = match shape {
            ConfigShape::Documents => true,
            ConfigShape::V1alpha1 => false,
            ConfigShape::Mixed => node.starts_with("worker"),
        };
        let config = world.machine_config(node).await;
        for (kind, document, field) in component_images(&config) {
            // Workers run no control-plane component: only their kubelet is configured.
            if node.starts_with("worker") && kind != "KubeletConfig" {
                assert_eq!((&document, &field), (&None, &None), "{node} {kind}");
                continue;
            }
            let (patched, untouched) = if in_documents {
                (document, field)
            } else {
                (field, document)
            };
            let patched = patched.unwrap_or_else(|| panic!("{node}: no {kind} image"));
            assert!(patched.ends_with(":v1.37.0"), "{node} {kind}: {patched}");
            assert_eq!(untouched, None, "{node} {kind}: one place only");
        }
        let snapshot = world.sim.node_snapshot(&world.node(node)).expect("node");
        assert_eq!(snapshot.kubelet.version, "1.37.0", "{node}");
    }
}

#[tokio::test]
async fn kubernetes_1_37_on_a_cluster_created_on_1_14_patches_its_documents() {
    kubernetes_1_37_on("t114-k8s-docs", ConfigShape::Documents).await;
}

#[tokio::test]
async fn kubernetes_1_37_on_a_mixed_cluster_patches_each_node_where_its_config_keeps_the_image() {
    kubernetes_1_37_on("t114-k8s-mixed", ConfigShape::Mixed).await;
}
