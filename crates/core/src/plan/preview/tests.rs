use super::*;
use crate::annotations::*;

fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn nodes() -> Vec<PreviewNode> {
    let node = |name: &str, role, held| PreviewNode {
        name: name.into(),
        role,
        held,
    };
    vec![
        node("cp-1", NodeRole::ControlPlane, false),
        node("w-2", NodeRole::Worker, false),
        node("w-1", NodeRole::Worker, false),
        node("w-3", NodeRole::Worker, true),
    ]
}

fn render(pairs: &[(&str, &str)], nodes: Result<&[PreviewNode], String>) -> Preview {
    let annotations = map(pairs);
    let intent = UpgradeIntent::from_annotations(&annotations);
    preview(&PreviewInputs {
        annotations: &annotations,
        intent: &intent,
        stored: None,
        catalog: &Catalog::builtin(),
        nodes,
        now: "2026-11-29T12:00:00Z".parse().unwrap(),
    })
}

#[test]
fn a_two_hop_talos_plan_with_its_nodes_gates_and_holds() {
    let nodes = nodes();
    let preview = render(
        &[
            (UPGRADE_PLAN, "multi-hop"),
            (PLAN_PREVIEW, "true"),
            (TALOS_TARGET, "1.14.1"),
            (TALOS_CURRENT, "1.11.6"),
            (KUBERNETES_CURRENT, "1.34.1"),
            (SOAK_AFTER_NODE, "10m"),
            (MAINTENANCE_WINDOW, "Sat 02:00 4h UTC"),
        ],
        Ok(&nodes),
    );
    assert_eq!(
        preview.lines,
        vec![
            "2 hops",
            "hop 1/2: Talos 1.11.6 → 1.13.9; nodes: w-1, w-2, then cp-1 (held, skipped: w-3)",
            "hop 2/2: Talos 1.13.9 → 1.14.1; nodes: w-1, w-2, then cp-1 (held, skipped: w-3)",
            "gates: Talos: workers-first, 1 worker at a time, every other node up and Ready before each node, etcd healthy and leadership moved off each control plane first, each node done within the node deadline, maintenance window Sat 02:00 4h UTC, soak 10m after each node",
            "would hold now: outside the maintenance window; it opens Sat 2026-12-05 02:00 UTC (2026-12-05 02:00:00 UTC)",
        ]
    );
    let message = preview.message();
    assert!(
        message.starts_with("Plan preview: 2 hops; hop 1/2: Talos 1.11.6 → 1.13.9; nodes: w-1"),
        "{message}"
    );
    assert_eq!(preview.text().lines().count(), 5);
}

#[test]
fn without_the_opt_in_the_preview_says_what_is_missing() {
    let nodes = nodes();
    let preview = render(
        &[
            (TALOS_TARGET, "1.14.1"),
            (KUBERNETES_TARGET, "1.35.0"),
            (TALOS_CURRENT, "1.11.6"),
            (KUBERNETES_CURRENT, "1.34.1"),
            (PAUSED, "true"),
        ],
        Ok(&nodes),
    );
    let last = preview.lines.last().unwrap();
    assert!(
        last.contains("set upgrade.vitistack.io/upgrade-plan=multi-hop"),
        "{last}"
    );
    assert!(last.ends_with("; paused"), "{last}");
    assert!(
        preview.lines[3].starts_with("hop 3/3: Kubernetes 1.34.1 → 1.35.0; steps: image pulls, control-plane components on cp-1, kube-proxy, kubelets on cp-1, w-1, w-2, w-3"),
        "{:?}",
        preview.lines
    );
}

#[test]
fn unreachable_unknown_and_unlisted() {
    let preview = render(
        &[
            (UPGRADE_PLAN, "multi-hop"),
            (TALOS_TARGET, "1.14.1"),
            (TALOS_CURRENT, "1.11.6"),
            (KUBERNETES_CURRENT, "1.29.0"),
        ],
        Err("no Machines".into()),
    );
    let last = preview.lines.last().unwrap();
    assert!(
        last.starts_with("would hold now: No upgrade plan reaches Talos 1.14.1"),
        "{last}"
    );
    assert!(
        last.ends_with("the nodes could not be listed: no Machines"),
        "{last}"
    );
    let preview = render(
        &[(UPGRADE_PLAN, "multi-hop"), (TALOS_TARGET, "1.14.1")],
        Ok(&[]),
    );
    assert!(
        preview
            .lines
            .last()
            .unwrap()
            .contains("the Talos version the cluster runs is not known yet")
    );
    let preview = render(&[], Ok(&[]));
    assert_eq!(
        preview.lines[0],
        "no target is set (talos-target, kubernetes-target): nothing to run"
    );
    assert_eq!(preview.lines.last().unwrap(), "nothing would hold it now");
}
