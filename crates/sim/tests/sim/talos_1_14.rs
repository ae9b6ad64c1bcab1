//! What Talos 1.14 changed, as a client of the simulator sees it (talos-1.14.md §1–§4): the generic
//! installer is no longer published and the Image Factory serves the installers; nodes report their
//! platform and schematic; configs created on 1.14 carry their component images in Kube* documents,
//! which a node validates as Talos does; the installer exits with a code per failure category.

use crate::common::*;
use prost::Message;
use talos_api::proto::cosi::resource as cosi;
use talos_api::proto::cosi::resource::state_client::StateClient;
use talos_api::proto::machine;
use talos_api::proto::resource::config as cfg;
use talos_api::proto::talos::resource::definitions::extensions;
use talos_sim::{Fault, NodeConfig, SimConfig, Simulator, Timings};
use tokio_stream::StreamExt;
use tonic::Code;
use tonic::transport::Channel;

use machine::apply_configuration_request::Mode;

const EMPTY_SCHEMATIC: &str = "376567988ad370138ad8b2698212367b8edcb69b5fd68c80be1f2ec7d603b4ba";
const CUSTOM_SCHEMATIC: &str = "ce4c980550dd2ab1b17bbf2b08801c7eb59418eafe8f279833297925d67c7515";

async fn start(config: SimConfig) -> Simulator {
    init();
    Simulator::start(config.with_timings(Timings::fast()))
        .await
        .expect("simulator starts")
}

fn factory(name: &str, schematic: &str, tag: &str) -> String {
    format!("factory.talos.dev/{name}/{schematic}:{tag}")
}

/// `ImageService.Pull` to its end: the pulled name, or the status it failed with.
async fn pull(sim: &Simulator, node: &str, image: &str) -> Result<String, tonic::Status> {
    let mut client = images(sim, node).await;
    let mut stream = client
        .pull(machine::ImageServicePullRequest {
            containerd: None,
            image_ref: image.into(),
        })
        .await?
        .into_inner();
    let mut name = None;
    while let Some(msg) = stream.next().await {
        if let Some(machine::image_service_pull_response::Response::Name(n)) = msg?.response {
            name = Some(n);
        }
    }
    Ok(name.expect("the pull ends with the pulled name"))
}

/// `LifecycleService.Upgrade` to its end: the installer's output and its exit code.
async fn install(sim: &Simulator, node: &str, image: &str) -> (Vec<String>, i32) {
    let mut client = lifecycle(sim, node).await;
    let mut stream = client
        .upgrade(machine::LifecycleServiceUpgradeRequest {
            containerd: None,
            source: Some(machine::InstallArtifactsSource {
                image_name: image.into(),
            }),
        })
        .await
        .expect("the installer starts")
        .into_inner();
    let (mut lines, mut exit) = (Vec::new(), None);
    while let Some(msg) = stream.next().await {
        use machine::lifecycle_service_install_progress::Response;
        match msg
            .expect("the stream ends normally")
            .progress
            .and_then(|p| p.response)
        {
            Some(Response::Message(line)) => lines.push(line),
            Some(Response::ExitCode(code)) => exit = Some(code),
            None => {}
        }
    }
    (lines, exit.expect("the installer reports an exit code"))
}

async fn get(
    state: &mut StateClient<Channel>,
    namespace: &str,
    type_: &str,
    id: &str,
) -> Result<cosi::Resource, tonic::Status> {
    state
        .get(cosi::GetRequest {
            namespace: namespace.into(),
            r#type: type_.into(),
            id: id.into(),
            options: None,
        })
        .await
        .map(|r| r.into_inner().resource.expect("a resource"))
}

fn yaml_field(resource: &cosi::Resource, field: &str) -> String {
    let spec: serde_yaml::Value =
        serde_yaml::from_str(&resource.spec.as_ref().expect("a spec").yaml_spec).expect("YAML");
    spec[field].as_str().unwrap_or_default().to_string()
}

async fn extensions_of(sim: &Simulator, node: &str) -> Vec<extensions::Layer> {
    let mut state = state(sim, node).await;
    let mut stream = state
        .list(cosi::ListRequest {
            namespace: "runtime".into(),
            r#type: "ExtensionStatuses.runtime.talos.dev".into(),
            options: None,
        })
        .await
        .expect("list")
        .into_inner();
    let mut out = Vec::new();
    while let Some(item) = stream.next().await {
        let resource = item.expect("item").resource.expect("resource");
        out.push(
            extensions::Layer::decode(resource.spec.expect("spec").proto_spec.as_slice())
                .expect("a Layer"),
        );
    }
    out
}

async fn machine_config(sim: &Simulator, node: &str) -> String {
    let mut state = state(sim, node).await;
    let resource = get(
        &mut state,
        "config",
        "MachineConfigs.config.talos.dev",
        "v1alpha1",
    )
    .await
    .expect("the machine config");
    let spec = cfg::MachineConfigSpec::decode(resource.spec.expect("spec").proto_spec.as_slice())
        .expect("MachineConfigSpec");
    String::from_utf8(spec.yaml_marshalled).expect("UTF-8")
}

async fn apply(sim: &Simulator, node: &str, config: String) -> Result<(), tonic::Status> {
    admin(sim, node)
        .await
        .apply_configuration(machine::ApplyConfigurationRequest {
            data: config.into_bytes(),
            mode: Mode::NoReboot as i32,
            ..Default::default()
        })
        .await
        .map(|_| ())
}

#[tokio::test]
async fn the_generic_installer_has_no_1_14_release() {
    let sim = start(SimConfig::uniform("t114-generic", 1, 1, "1.13.0", "1.35.0")).await;
    let missing = "ghcr.io/siderolabs/installer:v1.14.1";
    let status = pull(&sim, "worker-1", missing).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains(&format!("{missing}: not found")),
        "{status:?}"
    );
    let there = "ghcr.io/siderolabs/installer:v1.13.5";
    assert_eq!(pull(&sim, "worker-1", there).await.unwrap(), there);

    // The legacy Upgrade pulls first, and fails the RPC on the same miss.
    let mut client = admin(&sim, "worker-1").await;
    let status = client
        .upgrade(machine::UpgradeRequest {
            image: missing.into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        status
            .message()
            .contains("error validating installer image")
            && status.message().contains("not found"),
        "{status:?}"
    );
    let record = sim.record();
    let pulls: Vec<&str> = record
        .iter()
        .filter(|c| c.method.ends_with("ImageService/Pull"))
        .map(|c| c.result.as_str())
        .collect();
    assert!(pulls[0].starts_with("NotFound"), "{pulls:?}");
    assert_eq!(pulls[1], "ok");
}

#[tokio::test]
async fn the_factory_serves_installers_of_known_platforms_and_schematics() {
    let sim = start(SimConfig::uniform("t114-factory", 1, 1, "1.13.0", "1.35.0")).await;
    for image in [
        factory("metal-installer", EMPTY_SCHEMATIC, "v1.14.1"),
        factory("aws-installer", CUSTOM_SCHEMATIC, "v1.14.1"),
        factory("azure-installer-secureboot", CUSTOM_SCHEMATIC, "v1.14.1"),
        factory("installer", CUSTOM_SCHEMATIC, "v1.13.5"),
        factory("installer-secureboot", EMPTY_SCHEMATIC, "v1.14.0"),
        // A private mirror of the generic installer holds whatever was pushed to it.
        "registry.local:5000/siderolabs/installer:v1.14.1".to_string(),
    ] {
        assert_eq!(pull(&sim, "worker-1", &image).await.unwrap(), image);
    }
    for image in [
        factory("mars-installer", EMPTY_SCHEMATIC, "v1.14.1"),
        factory("metal-installer", "not-a-schematic", "v1.14.1"),
        factory(
            "metal-installer",
            &CUSTOM_SCHEMATIC.to_uppercase(),
            "v1.14.1",
        ),
    ] {
        let status = pull(&sim, "worker-1", &image).await.unwrap_err();
        assert_eq!(status.code(), Code::NotFound, "{image}: {status:?}");
    }
}

#[tokio::test]
async fn nodes_report_their_platform_and_their_schematic() {
    let mut aws = NodeConfig::worker("aws-1", "1.14.1", "1.37.0").with_platform("aws");
    aws.installer_image = Some(factory("aws-installer", CUSTOM_SCHEMATIC, "v1.14.1"));
    let mut old = NodeConfig::worker("old-1", "1.13.0", "1.35.0").with_platform("hcloud");
    old.installer_image = Some(factory("hcloud-installer", CUSTOM_SCHEMATIC, "v1.13.0"));
    let config = SimConfig::new("t114-platform")
        .with_node(NodeConfig::control_plane("cp-1", "1.13.0", "1.35.0"))
        .with_node(aws)
        .with_node(old)
        .with_node(NodeConfig::worker("box-1", "1.13.0", "1.35.0").with_platform("container"));
    let sim = start(config).await;

    for (node, platform, mode) in [
        ("cp-1", "metal", "metal"),
        ("aws-1", "aws", "cloud"),
        ("old-1", "hcloud", "cloud"),
        ("box-1", "container", "container"),
    ] {
        let version = admin(&sim, node).await.version(()).await.unwrap();
        let reported = version.into_inner().messages[0].platform.clone().unwrap();
        assert_eq!(
            (reported.name.as_str(), reported.mode.as_str()),
            (platform, mode)
        );
        let mut state = state(&sim, node).await;
        let metadata = get(
            &mut state,
            "runtime",
            "PlatformMetadatas.talos.dev",
            "platformmetadata",
        )
        .await
        .unwrap();
        assert_eq!(yaml_field(&metadata, "platform"), platform);
        assert_eq!(yaml_field(&metadata, "hostname"), node);
        assert_eq!(sim.node_snapshot(node).unwrap().platform, platform);
    }

    // Factory-built nodes carry the schematic extension; 1.14 also derives ImageFactorySchematic.
    for node in ["aws-1", "old-1"] {
        let layers = extensions_of(&sim, node).await;
        let schematic = layers
            .iter()
            .filter_map(|l| l.metadata.as_ref())
            .find(|m| m.name == "schematic")
            .map(|m| m.version.clone());
        assert_eq!(schematic.as_deref(), Some(CUSTOM_SCHEMATIC), "{node}");
    }
    let mut state_aws = state(&sim, "aws-1").await;
    let derived = get(
        &mut state_aws,
        "runtime",
        "ImageFactorySchematics.runtime.talos.dev",
        "image-factory-schematic",
    )
    .await
    .unwrap();
    assert_eq!(yaml_field(&derived, "schematicId"), CUSTOM_SCHEMATIC);
    // A 1.13 node does not know the type at all.
    let mut state_old = state(&sim, "old-1").await;
    let status = get(
        &mut state_old,
        "runtime",
        "ImageFactorySchematics.runtime.talos.dev",
        "image-factory-schematic",
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");

    // A node installed from the generic installer has no schematic, and a Get says NotFound.
    assert!(extensions_of(&sim, "cp-1").await.is_empty());
    let mut state_cp = state(&sim, "cp-1").await;
    let status = get(
        &mut state_cp,
        "runtime",
        "ExtensionStatuses.runtime.talos.dev",
        "0",
    )
    .await
    .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
}

#[tokio::test]
async fn a_config_created_on_1_14_upgrades_its_components_through_its_documents() {
    let config = SimConfig::new("t114-docs")
        .with_node(NodeConfig::control_plane("cp-1", "1.14.1", "1.37.0").created_on_1_14())
        .with_node(NodeConfig::worker("worker-1", "1.14.1", "1.37.0").created_on_1_14());
    let sim = start(config).await;
    let text = machine_config(&sim, "cp-1").await;
    assert!(text.contains("kind: KubeAPIServerConfig"), "{text}");
    assert!(!text.contains("    apiServer:"), "{text}");

    // Patch the documents, as talosctl upgrade-k8s 1.14 does for a node whose config has them.
    let patched = text
        .replace(
            "image: registry.k8s.io/kube-apiserver:v1.37.0",
            "image: registry.k8s.io/kube-apiserver:v1.37.1",
        )
        .replace(
            "image: ghcr.io/siderolabs/kubelet:v1.37.0",
            "image: ghcr.io/siderolabs/kubelet:v1.37.1",
        );
    apply(&sim, "cp-1", patched).await.expect("accepted");
    let snapshot = wait_snapshot(&sim, "cp-1", "kube-apiserver and kubelet on 1.37.1", |s| {
        s.kubelet.running
            && s.kubelet.version == "1.37.1"
            && s.control_plane
                .as_ref()
                .is_some_and(|c| c.apiserver.running && c.apiserver.version == "1.37.1")
    })
    .await;
    let cp = snapshot.control_plane.unwrap();
    assert_eq!(cp.scheduler.version, "1.37.0");
    let applies: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method.ends_with("ApplyConfiguration"))
        .collect();
    assert_eq!(
        applies[0].params["kube_documents"],
        serde_json::json!([
            "KubeletConfig",
            "KubeAPIServerConfig",
            "KubeControllerManagerConfig",
            "KubeSchedulerConfig",
            "KubeProxyConfig"
        ])
    );

    // A 1.13-era tool writes the v1alpha1 field next to the document: refused whole, in Talos's words.
    let current = machine_config(&sim, "cp-1").await;
    let both = current.replacen(
        "cluster:\n",
        "cluster:\n    apiServer:\n        image: registry.k8s.io/kube-apiserver:v1.37.2\n",
        1,
    );
    let status = apply(&sim, "cp-1", both).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains(
            "kube-apiserver config is already set in v1alpha1 config (.cluster.apiServer)"
        ),
        "{status:?}"
    );
    assert_eq!(machine_config(&sim, "cp-1").await, current);

    // Control-plane documents have no place in a worker's config.
    let worker = machine_config(&sim, "worker-1").await;
    let with_scheduler = format!(
        "{worker}---\napiVersion: v1alpha1\nkind: KubeSchedulerConfig\nimage: registry.k8s.io/kube-scheduler:v1.37.0\n"
    );
    let status = apply(&sim, "worker-1", with_scheduler).await.unwrap_err();
    assert!(
        status.message().contains(
            "the following document kinds are only allowed on control plane machines: [KubeSchedulerConfig]"
        ),
        "{status:?}"
    );
    // An image outside 1.14's Kubernetes range.
    let too_new = worker.replace(
        "image: ghcr.io/siderolabs/kubelet:v1.37.0",
        "image: ghcr.io/siderolabs/kubelet:v1.38.0",
    );
    let status = apply(&sim, "worker-1", too_new).await.unwrap_err();
    assert!(
        status.message().contains(
            "KubeletConfig: kubelet image is not valid: version of Kubernetes 1.38.0 is too new to be used with Talos 1.14.1"
        ),
        "{status:?}"
    );
}

#[tokio::test]
async fn a_node_below_1_14_cannot_decode_a_config_with_the_new_documents() {
    let sim = start(SimConfig::uniform("t114-decode", 1, 1, "1.13.0", "1.36.0")).await;
    let text = machine_config(&sim, "worker-1").await;
    let kubelet_section = "    kubelet:\n        image: ghcr.io/siderolabs/kubelet:v1.36.0\n        defaultRuntimeSeccompProfileEnabled: true\n";
    assert!(text.contains(kubelet_section), "{text}");
    let moved = format!(
        "{}---\napiVersion: v1alpha1\nkind: KubeletConfig\nimage: ghcr.io/siderolabs/kubelet:v1.36.0\n",
        text.replace(kubelet_section, "")
    );
    let line = moved.lines().count() - 2;
    let status = apply(&sim, "worker-1", moved).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(
        status.message(),
        format!(
            "error decoding document v1alpha1/KubeletConfig/ (line {line}): \"KubeletConfig\" \"v1alpha1\": not registered"
        )
    );
}

#[tokio::test]
async fn the_installer_exits_fault_counts_down_and_an_old_installer_reports_1() {
    let sim = start(SimConfig::uniform("t114-exits", 1, 2, "1.13.0", "1.35.0")).await;
    let new_installer = factory("metal-installer", EMPTY_SCHEMATIC, "v1.14.1");
    sim.inject_fault("worker-1", Fault::InstallerExits { code: 2, count: 2 })
        .unwrap();
    for _ in 0..2 {
        let (lines, code) = install(&sim, "worker-1", &new_installer).await;
        assert_eq!(code, 2, "{lines:?}");
        assert!(
            lines.iter().any(|l| l.contains("invalid input")),
            "{lines:?}"
        );
    }
    assert_eq!(sim.active_faults("worker-1").unwrap().installer_exits, None);
    let (lines, code) = install(&sim, "worker-1", &new_installer).await;
    assert_eq!(code, 0, "{lines:?}");
    assert_eq!(
        sim.node_snapshot("worker-1")
            .unwrap()
            .installed_version
            .as_deref(),
        Some("1.14.1")
    );

    // An installer older than 1.14 knows no categories: 1, every time until the fault is cleared.
    sim.inject_fault("worker-2", Fault::InstallerExits { code: 3, count: 0 })
        .unwrap();
    let old_installer = "ghcr.io/siderolabs/installer:v1.13.5";
    for _ in 0..2 {
        let (lines, code) = install(&sim, "worker-2", old_installer).await;
        assert_eq!(code, 1, "{lines:?}");
    }
    sim.clear_faults("worker-2").unwrap();
    assert_eq!(install(&sim, "worker-2", old_installer).await.1, 0);

    let results: Vec<String> = sim
        .record()
        .into_iter()
        .filter(|c| c.method.ends_with("LifecycleService/Upgrade"))
        .map(|c| c.result)
        .collect();
    assert!(results[0].starts_with("exit code 2: "), "{results:?}");
    assert!(results[3].starts_with("exit code 1: "), "{results:?}");
    assert_eq!(
        results.iter().filter(|r| *r == "ok").count(),
        2,
        "{results:?}"
    );
}

#[tokio::test]
async fn a_refused_host_version_exits_4_on_a_1_14_installer_and_1_on_an_older_one() {
    let config = SimConfig::new("t114-preflight")
        .with_node(NodeConfig::control_plane("cp-1", "1.14.1", "1.37.0"))
        .with_node(NodeConfig::worker("ahead-1", "1.16.0", "1.37.0"))
        .with_node(NodeConfig::worker("new-1", "1.14.1", "1.37.0"));
    let sim = start(config).await;
    // A 1.14 installer refuses hosts from 1.16.0 on (machinery compatibility/talos114).
    let (lines, code) = install(
        &sim,
        "ahead-1",
        &factory("metal-installer", EMPTY_SCHEMATIC, "v1.14.1"),
    )
    .await;
    assert_eq!(code, 4, "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("host version 1.16.0 is too new to downgrade to Talos 1.14.1")),
        "{lines:?}"
    );
    // A 1.12 installer refuses a 1.14 host too, but exits 1.
    let (lines, code) = install(&sim, "new-1", "ghcr.io/siderolabs/installer:v1.12.5").await;
    assert_eq!(code, 1, "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("host version 1.14.1 is too new to downgrade to Talos 1.12.5")),
        "{lines:?}"
    );
    // A pull that fails inside the installer is a dependency failure: 5 on a 1.14 installer.
    let (lines, code) = install(&sim, "new-1", "ghcr.io/siderolabs/installer:v1.14.1").await;
    assert_eq!(code, 5, "{lines:?}");
    assert!(lines.iter().any(|l| l.contains("not found")), "{lines:?}");
    for node in ["ahead-1", "new-1"] {
        assert_eq!(sim.node_snapshot(node).unwrap().installed_version, None);
    }
}
