//! The controller's Events in a real API server: a repeat within the series window counts up the
//! first Event's series (as kube's recorder does), a different message or reason is an Event of its
//! own, and a Warning is kept apart from a Normal with the same reason.

use k8s_openapi::api::core::v1::{ConfigMap, ObjectReference};
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::{Resource, ResourceExt};
use talos_upgrade_controller::event_recorder::EventRecorder;
use testenv::ControlPlane;

fn event(type_: EventType, reason: &str, action: &str, note: &str) -> Event {
    Event {
        type_,
        reason: reason.into(),
        note: Some(note.into()),
        action: action.into(),
        secondary: None,
    }
}

#[tokio::test]
async fn repeats_count_up_one_series_and_other_events_are_their_own() {
    let ns = ControlPlane::shared().test_namespace("events").await;
    // Any object to be about: a ConfigMap stands in for a KubernetesCluster.
    let configmaps: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut object = ConfigMap::default();
    object.metadata.name = Some("my-cluster".into());
    let object = configmaps
        .create(&PostParams::default(), &object)
        .await
        .expect("create the object");
    let regarding: ObjectReference = object.object_ref(&());

    let recorder = EventRecorder::new(ns.client.clone(), "tuc-test", Some("pod-1".into()));
    let started = event(
        EventType::Normal,
        "NodeUpgradeStarted",
        "Upgrade-1",
        "Upgrading w-1",
    );
    recorder.publish(&started, &regarding).await.expect("first");
    recorder
        .publish(&started, &regarding)
        .await
        .expect("repeat");
    recorder
        .publish(&started, &regarding)
        .await
        .expect("repeat");
    recorder
        .publish(
            &event(
                EventType::Normal,
                "NodeUpgradeStarted",
                "Upgrade-2",
                "Upgrading w-2",
            ),
            &regarding,
        )
        .await
        .expect("another message");
    recorder
        .publish(
            &event(
                EventType::Warning,
                "NodeUpgradeStarted",
                "Upgrade-1",
                "Upgrading w-1",
            ),
            &regarding,
        )
        .await
        .expect("a warning");
    assert_eq!(recorder.series_kept(), 3);

    let events: Api<K8sEvent> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut listed: Vec<(String, String, Option<i32>)> = events
        .list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .map(|event| {
            assert_eq!(event.reporting_controller.as_deref(), Some("tuc-test"));
            assert_eq!(event.reporting_instance.as_deref(), Some("pod-1"));
            assert_eq!(
                event.regarding.as_ref().and_then(|r| r.uid.clone()),
                object.uid(),
                "about the object"
            );
            assert!(
                event.name_any().starts_with("my-cluster."),
                "{}",
                event.name_any()
            );
            (
                event.type_.unwrap_or_default(),
                event.note.unwrap_or_default(),
                event.series.map(|series| series.count),
            )
        })
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        [
            ("Normal".to_string(), "Upgrading w-1".to_string(), Some(3)),
            ("Normal".to_string(), "Upgrading w-2".to_string(), None),
            ("Warning".to_string(), "Upgrading w-1".to_string(), None),
        ]
    );
}
