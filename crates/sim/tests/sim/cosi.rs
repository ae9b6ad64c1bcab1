//! COSI State Get/List/Watch with Talos's semantics, including a MachineStatus watch across a reboot.

use crate::common::*;
use prost::Message;
use talos_api::proto::cosi::resource as cosi;
use talos_api::proto::cosi::resource::state_client::StateClient;
use talos_api::proto::machine;
use talos_api::proto::resource::config as cfg;
use talos_api::proto::talos::resource::definitions::{enums, etcd, runtime};
use talos_sim::{SimConfig, Simulator, Timings};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

const MACHINE_STATUS: &str = "MachineStatuses.runtime.talos.dev";

async fn start(talos: &str, kubernetes: &str) -> Simulator {
    init();
    let config = SimConfig::uniform("cosi", 3, 1, talos, kubernetes).with_timings(Timings::fast());
    Simulator::start(config).await.expect("simulator starts")
}

fn get(ns: &str, ty: &str, id: &str) -> cosi::GetRequest {
    cosi::GetRequest {
        namespace: ns.into(),
        r#type: ty.into(),
        id: id.into(),
        options: None,
    }
}

fn watch(ns: &str, ty: &str, id: Option<&str>, bootstrap: bool) -> cosi::WatchRequest {
    cosi::WatchRequest {
        namespace: ns.into(),
        r#type: ty.into(),
        id: id.map(str::to_string),
        options: Some(cosi::WatchOptions {
            bootstrap_contents: bootstrap,
            ..Default::default()
        }),
        api_version: 1,
    }
}

fn with_node<T>(message: T, node: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(message);
    req.metadata_mut().insert("node", node.parse().unwrap());
    req
}

async fn next_event(stream: &mut Streaming<cosi::WatchResponse>) -> cosi::Event {
    let response = tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("watch stalled")
        .expect("watch ended")
        .expect("watch failed");
    assert_eq!(response.event.len(), 1, "{response:?}");
    response.event.into_iter().next().unwrap()
}

fn machine_status(resource: &cosi::Resource) -> runtime::MachineStatusSpec {
    runtime::MachineStatusSpec::decode(resource.spec.as_ref().unwrap().proto_spec.as_slice())
        .unwrap()
}

fn version(resource: &cosi::Resource) -> u64 {
    resource.metadata.as_ref().unwrap().version.parse().unwrap()
}

async fn open_watch(
    state: &mut StateClient<Channel>,
    req: tonic::Request<cosi::WatchRequest>,
) -> Streaming<cosi::WatchResponse> {
    let mut stream = state.watch(req).await.expect("Watch").into_inner();
    let first = stream.next().await.unwrap().unwrap();
    assert!(
        first.event.is_empty(),
        "the first response only says the watch is established"
    );
    stream
}

#[tokio::test]
async fn get_and_list_resources() {
    let sim = start("1.11.6", "1.34.1").await;
    let mut state = state(&sim, "cp-1").await;

    let resource = state
        .get(get("runtime", MACHINE_STATUS, "machine"))
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let md = resource.metadata.as_ref().unwrap();
    assert_eq!(
        (md.namespace.as_str(), md.r#type.as_str(), md.id.as_str()),
        ("runtime", MACHINE_STATUS, "machine")
    );
    assert!(version(&resource) >= 1);
    let spec = machine_status(&resource);
    assert_eq!(
        spec.stage,
        enums::RuntimeMachineStage::MachineStageRunning as i32
    );
    assert!(spec.status.unwrap().ready);
    assert!(resource.spec.unwrap().yaml_spec.contains("stage: running"));

    let v = state
        .get(get("runtime", "Versions.runtime.talos.dev", "version"))
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let v = runtime::VersionSpec::decode(v.spec.unwrap().proto_spec.as_slice()).unwrap();
    assert_eq!((v.version.as_str(), v.name.as_str()), ("v1.11.6", "Talos"));

    let mt = state
        .get(get(
            "config",
            "MachineTypes.config.talos.dev",
            "machine-type",
        ))
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let mt = cfg::MachineTypeSpec::decode(mt.spec.unwrap().proto_spec.as_slice()).unwrap();
    assert_eq!(mt.machine_type, cfg::MachineType::ControlPlane as i32);

    let member = state
        .get(get("etcd", "EtcdMembers.etcd.talos.dev", "local"))
        .await
        .unwrap()
        .into_inner()
        .resource
        .unwrap();
    let member = etcd::MemberSpec::decode(member.spec.unwrap().proto_spec.as_slice()).unwrap();
    assert_eq!(member.member_id.len(), 16);
    assert_eq!(
        member.member_id,
        sim.node_snapshot("cp-1").unwrap().etcd.unwrap().member_id
    );

    // Errors: missing id, unknown type, wrong namespace.
    let status = state
        .get(get("runtime", MACHINE_STATUS, "nope"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let status = state
        .get(get("runtime", "Bogus.talos.dev", "x"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    let status = state
        .get(get("config", MACHINE_STATUS, "machine"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);

    // Lists.
    let ids = |items: Vec<cosi::ListResponse>| -> Vec<String> {
        items
            .into_iter()
            .map(|r| r.resource.unwrap().metadata.unwrap().id)
            .collect()
    };
    let list = |ns: &str, ty: &str| cosi::ListRequest {
        namespace: ns.into(),
        r#type: ty.into(),
        options: None,
    };
    let services: Vec<_> = state
        .list(list("runtime", "Services.v1alpha1.talos.dev"))
        .await
        .unwrap()
        .into_inner()
        .collect::<Result<Vec<_>, _>>()
        .await
        .unwrap();
    let services = ids(services);
    for id in ["apid", "etcd", "kubelet", "machined", "trustd"] {
        assert!(services.contains(&id.to_string()), "{services:?}");
    }
    let pods = ids(state
        .list(list("k8s", "StaticPodStatuses.kubernetes.talos.dev"))
        .await
        .unwrap()
        .into_inner()
        .collect::<Result<Vec<_>, _>>()
        .await
        .unwrap());
    assert_eq!(
        pods,
        [
            "kube-system/kube-apiserver-cp-1",
            "kube-system/kube-controller-manager-cp-1",
            "kube-system/kube-scheduler-cp-1"
        ]
    );
    let manifests = ids(state
        .list(list("controlplane", "Manifests.kubernetes.talos.dev"))
        .await
        .unwrap()
        .into_inner()
        .collect::<Result<Vec<_>, _>>()
        .await
        .unwrap());
    assert!(manifests.contains(&"10-kube-proxy".to_string()));

    // Control-plane-only resources do not exist on workers.
    let mut worker = crate::common::state(&sim, "worker-1").await;
    let status = worker
        .get(get(
            "controlplane",
            "APIServerConfigs.kubernetes.talos.dev",
            "kube-apiserver",
        ))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
}

#[tokio::test]
async fn version_resource_needs_talos_1_10() {
    let sim = start("1.9.5", "1.32.4").await;
    let mut state = state(&sim, "cp-1").await;
    let status = state
        .get(get("runtime", "Versions.runtime.talos.dev", "version"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
}

#[tokio::test]
async fn kind_watch_bootstraps_and_tombstones() {
    let sim = start("1.11.6", "1.34.1").await;
    let mut state = state(&sim, "cp-1").await;

    let mut stream = open_watch(
        &mut state,
        tonic::Request::new(watch("runtime", "Services.v1alpha1.talos.dev", None, true)),
    )
    .await;
    let mut created = 0;
    loop {
        let event = next_event(&mut stream).await;
        match cosi::EventType::try_from(event.event_type).unwrap() {
            cosi::EventType::Created => created += 1,
            cosi::EventType::Bootstrapped => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(created >= 8, "{created}");

    let mut stream = open_watch(
        &mut state,
        tonic::Request::new(watch("runtime", MACHINE_STATUS, Some("missing"), false)),
    )
    .await;
    let event = next_event(&mut stream).await;
    assert_eq!(event.event_type, cosi::EventType::Destroyed as i32);
    let tombstone = event.resource.unwrap();
    assert_eq!(tombstone.metadata.unwrap().version, "undefined");
    // An empty spec, as the COSI runtime marshals a tombstone (its client refuses none).
    assert_eq!(tombstone.spec, Some(Default::default()));

    let status = state
        .watch(watch("runtime", MACHINE_STATUS, Some("machine"), true))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented);
}

#[tokio::test]
async fn machine_status_watch_across_a_reboot() {
    let sim = start("1.11.6", "1.34.1").await;
    let before = sim.node_snapshot("cp-2").unwrap();

    // Watch cp-2 through cp-1 with the node header, like a controller using one endpoint.
    let mut state = state(&sim, "cp-1").await;
    let mut stream = open_watch(
        &mut state,
        with_node(
            watch("runtime", MACHINE_STATUS, Some("machine"), false),
            "cp-2",
        ),
    )
    .await;
    let created = next_event(&mut stream).await;
    assert_eq!(created.event_type, cosi::EventType::Created as i32);
    let running = created.resource.unwrap();
    assert!(machine_status(&running).status.unwrap().ready);

    let mut client = admin(&sim, "cp-1").await;
    client
        .reboot(with_node(machine::RebootRequest::default(), "cp-2"))
        .await
        .expect("Reboot via proxy");

    // UPDATED to rebooting (with the previous version as `old`), then the stream ends.
    let updated = next_event(&mut stream).await;
    assert_eq!(updated.event_type, cosi::EventType::Updated as i32);
    let new = updated.resource.unwrap();
    assert_eq!(
        machine_status(&new).stage,
        enums::RuntimeMachineStage::MachineStageRebooting as i32
    );
    assert_eq!(version(updated.old.as_ref().unwrap()), version(&running));
    assert_eq!(version(&new), version(&running) + 1);
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            match stream.next().await {
                Some(Ok(_)) => continue,
                Some(Err(status)) => return Some(status.code()),
                None => return None,
            }
        }
    })
    .await
    .expect("the watch ends when the node goes down");
    assert!(matches!(ended, Some(Code::Unavailable) | None), "{ended:?}");

    // While down, the proxy answers Unavailable.
    wait_snapshot(&sim, "cp-2", "down", |s| s.down).await;
    let status = state
        .get(with_node(get("runtime", MACHINE_STATUS, "machine"), "cp-2"))
        .await;
    if !sim.node_snapshot("cp-2").unwrap().down {
        // Came back in between: nothing to assert about the outage.
    } else if let Err(status) = status {
        assert_eq!(status.code(), Code::Unavailable);
    }

    // After the reboot: a fresh watch sees the new boot reach running + ready.
    wait_snapshot(&sim, "cp-2", "back", |s| {
        !s.down && s.boot_id != before.boot_id
    })
    .await;
    let mut stream = open_watch(
        &mut state,
        with_node(
            watch("runtime", MACHINE_STATUS, Some("machine"), false),
            "cp-2",
        ),
    )
    .await;
    let mut event = next_event(&mut stream).await;
    assert_eq!(event.event_type, cosi::EventType::Created as i32);
    loop {
        let spec = machine_status(event.resource.as_ref().unwrap());
        if spec.stage == enums::RuntimeMachineStage::MachineStageRunning as i32
            && spec.status.is_some_and(|s| s.ready)
        {
            break;
        }
        event = next_event(&mut stream).await;
    }
}
