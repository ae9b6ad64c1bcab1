//! Upgrade progress persisted in a real API server: created on first save, read back as written,
//! refused on a stale write, and keys the controller does not know are kept.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use talos_upgrade_controller::rollout::progress::{NodeProgress, NodeRole, NodeStep, Run};
use talos_upgrade_controller::store::{ProgressStore, StoreError, configmap_name};
use testenv::ControlPlane;

fn run(step: NodeStep) -> Run {
    Run {
        requested: "1.12.0".into(),
        target: "1.12.0".into(),
        started_at: "2026-11-25T10:00:00Z".parse().expect("time"),
        outcome: None,
        nodes: vec![NodeProgress {
            name: "worker-1".into(),
            role: NodeRole::Worker,
            step,
        }],
    }
}

#[tokio::test]
async fn progress_round_trips_and_stale_writes_are_refused() {
    let ns = ControlPlane::shared().test_namespace("store").await;
    let store = ProgressStore::new(ns.client.clone(), &ns.name);

    let mut progress = store.load("my-cluster").await.expect("load nothing");
    assert_eq!(progress.talos, None);
    progress.talos = Some(run(NodeStep::Pending));
    store
        .save("my-cluster", None, &mut progress)
        .await
        .expect("create");

    // Someone adds a key of their own (a newer controller, an operator's note).
    let configmaps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    configmaps
        .patch(
            &configmap_name("my-cluster"),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {"note.txt": "hands off"}})),
        )
        .await
        .expect("patch");

    let mut fresh = store.load("my-cluster").await.expect("load");
    assert_eq!(fresh.talos, Some(run(NodeStep::Pending)));
    let issued = NodeStep::Issued {
        at: "2026-11-25T10:01:00Z".parse().expect("time"),
        boot_id: "b1".into(),
        from_version: "1.11.6".into(),
        installer_image: "ghcr.io/siderolabs/installer:v1.12.0".into(),
        lifecycle: None,
        unanswered: false,
    };
    fresh.talos = Some(run(issued.clone()));
    store
        .save("my-cluster", None, &mut fresh)
        .await
        .expect("update");
    // Saving the same progress again works: it knows the version it wrote.
    store
        .save("my-cluster", None, &mut fresh)
        .await
        .expect("save again");

    // The first copy is stale now: writing it must not clobber the issued step.
    let stale = store.save("my-cluster", None, &mut progress).await;
    assert!(
        matches!(stale, Err(StoreError::Conflict { .. })),
        "{stale:?}"
    );

    let stored = configmaps
        .get(&configmap_name("my-cluster"))
        .await
        .expect("get");
    let data = stored.data.unwrap_or_default();
    assert_eq!(data.get("note.txt").map(String::as_str), Some("hands off"));
    assert_eq!(
        store.load("my-cluster").await.expect("load").talos,
        Some(run(issued))
    );
    assert_eq!(
        stored
            .metadata
            .labels
            .unwrap_or_default()
            .get("upgrade.vitistack.io/cluster")
            .map(String::as_str),
        Some("my-cluster")
    );
}
