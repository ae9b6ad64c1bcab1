//! ApplyConfiguration as `talosctl upgrade-k8s` uses it: config resources bump, components follow,
//! kubelet restarts, and the Talos ↔ Kubernetes support matrix is enforced.

use crate::common::*;
use prost::Message;
use talos_api::proto::cosi::resource as cosi;
use talos_api::proto::cosi::resource::state_client::StateClient;
use talos_api::proto::machine;
use talos_api::proto::resource::config as cfg;
use talos_api::proto::talos::resource::definitions::k8s;
use talos_sim::{SimConfig, Simulator, Timings};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use machine::apply_configuration_request::Mode;

async fn start() -> Simulator {
    init();
    let config =
        SimConfig::uniform("apply", 1, 1, "1.11.6", "1.34.1").with_timings(Timings::fast());
    Simulator::start(config).await.expect("simulator starts")
}

async fn machine_config(state: &mut StateClient<Channel>) -> (String, u64) {
    let resource = state
        .get(cosi::GetRequest {
            namespace: "config".into(),
            r#type: "MachineConfigs.config.talos.dev".into(),
            id: "v1alpha1".into(),
            options: None,
        })
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let version = resource.metadata.unwrap().version.parse().unwrap();
    let spec =
        cfg::MachineConfigSpec::decode(resource.spec.unwrap().proto_spec.as_slice()).unwrap();
    (String::from_utf8(spec.yaml_marshalled).unwrap(), version)
}

fn apply(data: &str, mode: Mode) -> machine::ApplyConfigurationRequest {
    machine::ApplyConfigurationRequest {
        data: data.as_bytes().to_vec(),
        mode: mode as i32,
        ..Default::default()
    }
}

async fn open_watch(
    state: &mut StateClient<Channel>,
    ns: &str,
    ty: &str,
    id: &str,
) -> Streaming<cosi::WatchResponse> {
    let mut stream = state
        .watch(cosi::WatchRequest {
            namespace: ns.into(),
            r#type: ty.into(),
            id: Some(id.into()),
            options: None,
            api_version: 1,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(stream.next().await.unwrap().unwrap().event.is_empty());
    stream
}

async fn next_event(stream: &mut Streaming<cosi::WatchResponse>) -> cosi::Event {
    let response = tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("watch stalled")
        .unwrap()
        .unwrap();
    response.event.into_iter().next().unwrap()
}

fn version_of(event: &cosi::Event) -> u64 {
    event
        .resource
        .as_ref()
        .unwrap()
        .metadata
        .as_ref()
        .unwrap()
        .version
        .parse()
        .unwrap()
}

#[tokio::test]
async fn apiserver_image_change_bumps_its_config_and_rolls_the_pod() {
    let sim = start().await;
    let mut state = state(&sim, "cp-1").await;
    let mut client = admin(&sim, "cp-1").await;

    // As upgrade-k8s: watch the config resource first and remember its version.
    let mut watch = open_watch(
        &mut state,
        "controlplane",
        "APIServerConfigs.kubernetes.talos.dev",
        "kube-apiserver",
    )
    .await;
    let created = next_event(&mut watch).await;
    assert_eq!(created.event_type, cosi::EventType::Created as i32);
    let v0 = version_of(&created);
    assert_eq!(
        sim.node_snapshot("cp-1")
            .unwrap()
            .control_plane
            .unwrap()
            .apiserver
            .config_version,
        v0
    );

    let (config, mc_version) = machine_config(&mut state).await;
    let patched = config.replace(
        "registry.k8s.io/kube-apiserver:v1.34.1",
        "registry.k8s.io/kube-apiserver:v1.34.2",
    );
    assert_ne!(patched, config);
    let reply = client
        .apply_configuration(apply(&patched, Mode::NoReboot))
        .await
        .expect("apply")
        .into_inner();
    assert_eq!(reply.messages[0].mode, Mode::NoReboot as i32);

    let updated = next_event(&mut watch).await;
    assert_eq!(updated.event_type, cosi::EventType::Updated as i32);
    assert_eq!(version_of(&updated), v0 + 1);
    let spec = k8s::ApiServerConfigSpec::decode(
        updated
            .resource
            .unwrap()
            .spec
            .unwrap()
            .proto_spec
            .as_slice(),
    )
    .unwrap();
    assert_eq!(spec.image, "registry.k8s.io/kube-apiserver:v1.34.2");

    // The static pod follows with the new config version (the talos.dev/config-version annotation).
    let snapshot = wait_snapshot(&sim, "cp-1", "apiserver rolled", |s| {
        let api = &s.control_plane.as_ref().unwrap().apiserver;
        api.version == "1.34.2" && api.config_version == v0 + 1
    })
    .await;
    let cp = snapshot.control_plane.unwrap();
    assert_eq!(cp.scheduler.version, "1.34.1", "untouched components stay");
    assert!(snapshot.machine_config_version > mc_version);
    let (stored, _) = machine_config(&mut state).await;
    assert_eq!(stored, patched, "stored byte-exact");

    // Out of Talos 1.11's range (1.29–1.34) and tagless images are refused.
    let too_new = patched.replace("kube-apiserver:v1.34.2", "kube-apiserver:v1.36.0");
    let status = client
        .apply_configuration(apply(&too_new, Mode::NoReboot))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("1.36.0"), "{status:?}");
    let tagless = patched.replace("kube-scheduler:v1.34.1", "kube-scheduler");
    let status = client
        .apply_configuration(apply(&tagless, Mode::NoReboot))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    let status = client
        .apply_configuration(apply("machine: [", Mode::NoReboot))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);

    let calls: Vec<_> = sim
        .record()
        .into_iter()
        .filter(|c| c.method == "/machine.MachineService/ApplyConfiguration")
        .collect();
    assert_eq!(calls.len(), 4);
    assert_eq!(calls[0].params["mode"], "NO_REBOOT");
    assert_eq!(
        calls[0].params["images"]["apiserver"],
        "registry.k8s.io/kube-apiserver:v1.34.2"
    );
    assert_eq!(calls[0].result, "ok");
    assert!(
        calls[1].result.starts_with("InvalidArgument"),
        "{:?}",
        calls[1]
    );
}

#[tokio::test]
async fn kubelet_image_change_restarts_kubelet() {
    let sim = start().await;
    let mut state = state(&sim, "worker-1").await;
    let mut client = admin(&sim, "worker-1").await;
    let mut watch = open_watch(
        &mut state,
        "runtime",
        "Services.v1alpha1.talos.dev",
        "kubelet",
    )
    .await;
    assert_eq!(
        next_event(&mut watch).await.event_type,
        cosi::EventType::Created as i32
    );

    let (config, _) = machine_config(&mut state).await;
    let patched = config.replace(
        "ghcr.io/siderolabs/kubelet:v1.34.1",
        "ghcr.io/siderolabs/kubelet:v1.34.2",
    );
    client
        .apply_configuration(apply(&patched, Mode::Auto))
        .await
        .expect("apply");
    assert_eq!(
        next_event(&mut watch).await.event_type,
        cosi::EventType::Destroyed as i32
    );
    assert_eq!(
        next_event(&mut watch).await.event_type,
        cosi::EventType::Created as i32
    );
    let snapshot = wait_snapshot(&sim, "worker-1", "kubelet upgraded", |s| {
        s.kubelet.version == "1.34.2" && s.kubelet.running
    })
    .await;
    assert_eq!(snapshot.kubelet.image, "ghcr.io/siderolabs/kubelet:v1.34.2");

    let spec = state
        .get(cosi::GetRequest {
            namespace: "k8s".into(),
            r#type: "KubeletSpecs.kubernetes.talos.dev".into(),
            id: "kubelet".into(),
            options: None,
        })
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let spec = k8s::KubeletSpecSpec::decode(spec.spec.unwrap().proto_spec.as_slice()).unwrap();
    assert_eq!(spec.image, "ghcr.io/siderolabs/kubelet:v1.34.2");
}

#[tokio::test]
async fn staged_config_applies_at_the_next_boot() {
    let sim = start().await;
    let mut state = state(&sim, "worker-1").await;
    let mut client = admin(&sim, "worker-1").await;
    let (config, _) = machine_config(&mut state).await;
    let patched = config.replace("kubelet:v1.34.1", "kubelet:v1.34.3");
    let reply = client
        .apply_configuration(apply(&patched, Mode::Staged))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.messages[0].mode, Mode::Staged as i32);
    let before = sim.node_snapshot("worker-1").unwrap();
    assert_eq!(before.kubelet.version, "1.34.1");
    client
        .reboot(machine::RebootRequest::default())
        .await
        .unwrap();
    let after = wait_snapshot(&sim, "worker-1", "rebooted", |s| {
        s.boot_id != before.boot_id && s.ready
    })
    .await;
    assert_eq!(after.kubelet.version, "1.34.3");
}
