//! Upgrade progress persisted in a real API server: created on first save, read back as written,
//! refused on a stale write, and keys the controller does not know are kept.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams};
use talos_upgrade_controller::progress_store::{
    Progress, ProgressStore, StoreError, configmap_name,
};
use talos_upgrade_core::run::NodeRole;
use talos_upgrade_core::talos::{NodeProgress, NodeStep, Run};
use testenv::ControlPlane;

fn run(step: NodeStep) -> Run {
    Run {
        requested: "1.12.0".into(),
        target: "1.12.0".into(),
        started_at: "2026-11-25T10:00:00Z".parse().expect("time"),
        outcome: None,
        gates: Default::default(),
        previous: Default::default(),
        rollback: None,
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
        install_unconfirmed: false,
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

/// Waits (bounded) until `done` holds; a watch delivers changes shortly after they are made.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..400 {
        if done() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("{what}: not within 10 s");
}

#[tokio::test]
async fn a_kept_record_is_reused_until_someone_else_changes_or_deletes_it() {
    use std::sync::Arc;
    use talos_upgrade_controller::progress_store::{ProgressCache, follow_progress};
    use talos_upgrade_controller::read_cache::Fingerprint;

    let ns = ControlPlane::shared().test_namespace("store-cache").await;
    let cache = Arc::new(ProgressCache::default());
    let watch = {
        let (cache, client, namespace) = (cache.clone(), ns.client.clone(), ns.name.clone());
        tokio::spawn(async move { follow_progress(&cache, client, Some(&namespace)).await })
    };
    let store = ProgressStore::new(ns.client.clone(), &ns.name).with_cache(cache.clone());
    let name = configmap_name("my-cluster");
    let key = (ns.name.clone(), name.clone());
    let configmaps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    // The watch has seen the record at exactly this ConfigMap's version.
    let seen_at = |configmap: &ConfigMap| {
        let version = configmap
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default();
        cache.seen.fingerprint(&key) == Some(Fingerprint::of([(name.as_str(), version)]))
    };

    until("the watch lists", || {
        cache.seen.fingerprint(&key) == Some(Fingerprint::none())
    })
    .await;
    let mut progress = store.load("my-cluster").await.expect("load nothing");
    progress.talos = Some(run(NodeStep::Pending));
    store
        .save("my-cluster", None, &mut progress)
        .await
        .expect("create");
    let written = configmaps.get(&name).await.expect("get");
    until("the watch sees the write", || seen_at(&written)).await;
    assert_eq!(
        store.load("my-cluster").await.expect("load").talos,
        Some(run(NodeStep::Pending)),
        "what was written is what is read"
    );

    // Someone else rewrites the record (another replica, a restore): the next load reads theirs.
    let theirs = run(NodeStep::Done {
        at: "2026-11-25T10:05:00Z".parse().expect("time"),
        started_at: None,
    });
    configmaps
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"data": {
                "talos.json": serde_json::to_string(&theirs).expect("json")
            }})),
        )
        .await
        .expect("patch");
    let patched = configmaps.get(&name).await.expect("get");
    until("the watch sees their write", || seen_at(&patched)).await;
    let reread = store.load("my-cluster").await.expect("load");
    assert_eq!(reread.talos, Some(theirs));
    // The copy loaded before their write is stale and must not overwrite it.
    assert!(matches!(
        store.save("my-cluster", None, &mut progress).await,
        Err(StoreError::Conflict { .. })
    ));

    // Deleted by hand (to start over): the next load finds nothing.
    configmaps
        .delete(&name, &Default::default())
        .await
        .expect("delete");
    until("the watch sees the deletion", || {
        cache.seen.fingerprint(&key) == Some(Fingerprint::none())
    })
    .await;
    assert_eq!(store.load("my-cluster").await.expect("load").talos, None);

    // Made again by hand, without the controller's labels (which the watch selects on): the absence
    // the last load found may still be what a load returns (for at most an hour:
    // `ProgressStore::remember`), but the record is never written over: the save of a record the
    // controller believes absent creates it, the API server refuses that, and the next load reads the
    // one made by hand.
    let restored = run(NodeStep::Pending);
    let unlabelled: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "data": {"talos.json": serde_json::to_string(&restored).expect("json")},
    }))
    .expect("configmap");
    configmaps
        .create(&Default::default(), &unlabelled)
        .await
        .expect("create by hand");
    let mut believed_absent = Progress::default();
    believed_absent.talos = Some(run(NodeStep::Done {
        at: "2026-11-25T10:30:00Z".parse().expect("time"),
        started_at: None,
    }));
    assert!(matches!(
        store.save("my-cluster", None, &mut believed_absent).await,
        Err(StoreError::Conflict { .. })
    ));
    assert_eq!(
        store.load("my-cluster").await.expect("load").talos,
        Some(restored.clone())
    );
    let kept = configmaps.get(&name).await.expect("get");
    assert_eq!(
        kept.data.unwrap_or_default().get("talos.json").cloned(),
        Some(serde_json::to_string(&restored).expect("json")),
        "the record made by hand is not written over"
    );
    watch.abort();
}
