//! machined's sequences as the simulator plays them: upgrade (legacy, talos-api.md §3.1), reboot,
//! rollback, and the boot that follows every power cycle — with the events, stage changes, service
//! transitions and etcd effects a real node shows, and a real outage in between (the port closes).
//!
//! Sequences that span a reboot run as tasks tied to the simulator's lifetime; everything that belongs
//! to one boot (the boot sequence itself, config settling) is tied to that boot's token, so a power cut
//! stops it like a reboot would.

use std::future::Future;
use std::net::SocketAddrV4;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::cluster::Cluster;
use super::config::{Timings, bind_listener};
use super::machine_config;
use super::node::{BASE_SERVICES, CONTROL_PLANE_SERVICES, Node, WORKLOAD_SERVICES};
use super::node_resources::{
    APISERVER_CONFIG_TYPE, CONTROLLER_MANAGER_CONFIG_TYPE, CONTROLPLANE_NS, K8S_NS,
    KUBELET_SPEC_TYPE, SCHEDULER_CONFIG_TYPE,
};
use super::node_state::{MachineStage, RunningComponent, ServiceStatus, Slot, UnmetCondition};
use super::record::PowerKind;
use talos_api::proto::{common, machine};

use machine::sequence_event::Action as SeqAction;

/// Phases and their task of the 1.10–1.13 upgrade sequence.
const UPGRADE_PHASES: &[(&str, &str)] = &[
    ("drain", "cordonAndDrainNode"),
    ("cleanup", "stopAllPods"),
    ("dbus", "stopDBus"),
    ("stopServices", "stopServicesForUpgrade"),
    ("unmount", "unmountPodMounts"),
    ("unmountBind", "unmountSystemDiskBindMounts"),
    ("unmountSystem", "unmountEphemeralPartition"),
    ("volumeFinalize", "teardownLifecycle"),
    ("upgrade", "upgrade"),
    ("meta", "reloadMeta"),
    ("kexec", "kexecPrepare"),
    ("stopEverything", "stopAllServices"),
    ("reboot", "reboot"),
];

/// Phases and their task of the reboot sequence (no drain: a plain reboot does not cordon).
const REBOOT_PHASES: &[(&str, &str)] = &[
    ("cleanup", "stopAllPods"),
    ("dbus", "stopDBus"),
    ("stopEverything", "stopAllServices"),
    ("reboot", "reboot"),
];

/// How long apid may take to finish its streams at power-off before connections are dropped.
const GRACEFUL_STOP: Duration = Duration::from_secs(2);

/// Pause between the quick steps of a sequence, proportional to the configured install time so demos
/// with long timings show their phases at a readable pace.
fn step(t: &Timings) -> Duration {
    Duration::from_millis((t.install_ms / 40).clamp(1, 250))
}

/// Run `fut` in the background until it finishes or the simulator shuts down.
pub(crate) fn spawn_until_shutdown(
    cluster: &Arc<Cluster>,
    fut: impl Future<Output = ()> + Send + 'static,
) {
    let shutdown = cluster.shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = fut => {}
        }
    });
}

/// Run `fut` in the background until it finishes or the node's current boot ends.
pub(crate) fn spawn_in_boot(node: &Node, fut: impl Future<Output = ()> + Send + 'static) {
    let boot = node.boot_token();
    tokio::spawn(async move {
        tokio::select! {
            _ = boot.cancelled() => {}
            _ = fut => {}
        }
    });
}

pub(crate) fn emit_sequence(
    node: &Node,
    actor: &str,
    sequence: &str,
    action: SeqAction,
    error: Option<common::Error>,
) {
    node.events.emit(
        actor,
        &machine::SequenceEvent {
            sequence: sequence.to_string(),
            action: action as i32,
            error,
        },
    );
}

/// The event machined emits when another sequence holds the lock.
pub(crate) fn emit_locked(node: &Node, actor: &str, sequence: &str) {
    emit_sequence(
        node,
        actor,
        sequence,
        SeqAction::Noop,
        Some(common::Error {
            code: common::Code::Locked as i32,
            message: "locked".to_string(),
            details: Vec::new(),
        }),
    );
}

fn emit_phase(node: &Node, actor: &str, phase: &str, start: bool) {
    use machine::phase_event::Action;
    node.events.emit(
        actor,
        &machine::PhaseEvent {
            phase: phase.to_string(),
            action: if start { Action::Start } else { Action::Stop } as i32,
        },
    );
}

fn emit_task(node: &Node, actor: &str, task: &str, start: bool) {
    use machine::task_event::Action;
    node.events.emit(
        actor,
        &machine::TaskEvent {
            task: task.to_string(),
            action: if start { Action::Start } else { Action::Stop } as i32,
        },
    );
}

/// Change the machine stage/readiness and emit the MachineStatusEvent (empty actor id).
pub(crate) fn set_stage(
    cluster: &Cluster,
    node: &Node,
    stage: MachineStage,
    ready: bool,
    unmet: Vec<UnmetCondition>,
) {
    let event = machine::MachineStatusEvent {
        stage: stage.to_event() as i32,
        status: Some(machine::machine_status_event::MachineStatus {
            ready,
            unmet_conditions: unmet
                .iter()
                .map(
                    |c| machine::machine_status_event::machine_status::UnmetCondition {
                        name: c.name.clone(),
                        reason: c.reason.clone(),
                    },
                )
                .collect(),
        }),
    };
    node.update(&cluster.etcd, |s| {
        s.stage = stage;
        s.ready = ready;
        s.unmet = unmet;
        // The cordon outlives the REBOOTING stage: it is lifted only once the node boots again.
        if stage.cordons() {
            s.cordoned = true;
        } else if matches!(stage, MachineStage::Booting | MachineStage::Running) {
            s.cordoned = false;
        }
    });
    node.events.emit("", &event);
}

/// Start or stop a Talos service: state, ServiceStateEvent(s), the Services resource, and for
/// etcd/kubelet the effects others see (etcd member health, kubelet running).
pub(crate) fn set_service(cluster: &Cluster, node: &Node, id: &str, running: bool) {
    use machine::service_state_event::Action;
    let exists = node.read(|s| s.services.get(id).is_some_and(|svc| svc.state == "Running"));
    if exists == running {
        return;
    }
    if !running {
        node.events.emit(
            "",
            &machine::ServiceStateEvent {
                service: id.to_string(),
                action: Action::Stopping as i32,
                message: "Stopping service".to_string(),
                health: None,
            },
        );
    }
    let now = std::time::SystemTime::now();
    node.update(&cluster.etcd, |s| {
        if running {
            s.services.insert(
                id.to_string(),
                ServiceStatus {
                    state: "Running",
                    healthy: true,
                    since: now,
                },
            );
        } else if let Some(svc) = s.services.get_mut(id) {
            svc.state = "Finished";
            svc.healthy = false;
            svc.since = now;
        }
        if id == "kubelet" {
            s.kubelet.running = running;
        }
    });
    let health = machine::ServiceHealth {
        unknown: false,
        healthy: running,
        last_message: if running {
            "Health check successful".to_string()
        } else {
            String::new()
        },
        last_change: Some(now.into()),
    };
    node.events.emit(
        "",
        &machine::ServiceStateEvent {
            service: id.to_string(),
            action: if running {
                Action::Running
            } else {
                Action::Finished
            } as i32,
            message: if running {
                "Health check successful".to_string()
            } else {
                "Service finished successfully".to_string()
            },
            health: Some(health),
        },
    );
    if id == "etcd" && node.role.is_control_plane() {
        cluster.etcd.set_running(&node.name, running);
        cluster.publish_control_planes();
    }
}

/// Take machined's sequencer lock. A running boot sequence can be taken over (reboot/upgrade during
/// boot); any other running sequence makes the request a no-op with a LOCKED event.
pub(crate) fn lock_sequence(
    cluster: &Cluster,
    node: &Node,
    name: &'static str,
) -> Result<(), &'static str> {
    node.update(&cluster.etcd, |s| match s.sequence {
        Some(running) if running != "boot" => Err(running),
        _ => {
            s.sequence = Some(name);
            Ok(())
        }
    })
}

/// The legacy upgrade sequence after the RPC accepted the request: phases, install into the other
/// slot, kexec/reboot, then a boot (on the new version unless the A/B fallback fault is set).
pub(crate) fn spawn_legacy_upgrade(
    cluster: &Arc<Cluster>,
    node: &Arc<Node>,
    actor: String,
    target: Slot,
    powercycle: bool,
) {
    let (cluster2, node2) = (cluster.clone(), node.clone());
    spawn_until_shutdown(cluster, async move {
        let (cluster, node) = (cluster2, node2);
        let t = cluster.timings;
        emit_sequence(&node, &actor, "upgrade", SeqAction::Start, None);
        set_stage(&cluster, &node, MachineStage::Upgrading, false, Vec::new());
        for (phase, task) in UPGRADE_PHASES {
            if *phase == "kexec" && powercycle {
                continue;
            }
            emit_phase(&node, &actor, phase, true);
            if *phase == "kexec" || (*phase == "reboot" && powercycle) {
                set_stage(&cluster, &node, MachineStage::Rebooting, false, Vec::new());
            }
            emit_task(&node, &actor, task, true);
            match *phase {
                "stopServices" => stop_workload_services(&cluster, &node),
                "upgrade" => {
                    tokio::time::sleep(t.install()).await;
                    node.update(&cluster.etcd, |s| s.next_boot = Some(target.clone()));
                }
                "reboot" => {
                    // The machine goes away in the middle of this task: no STOP events follow.
                    power_cycle(&cluster, &node).await;
                    return;
                }
                _ => tokio::time::sleep(step(&t)).await,
            }
            emit_task(&node, &actor, task, false);
            emit_phase(&node, &actor, phase, false);
        }
    });
}

/// The reboot sequence (Reboot and Rollback): stage REBOOTING, stop everything, power cycle, boot.
pub(crate) fn spawn_reboot(cluster: &Arc<Cluster>, node: &Arc<Node>, actor: String) {
    let (cluster2, node2) = (cluster.clone(), node.clone());
    spawn_until_shutdown(cluster, async move {
        let (cluster, node) = (cluster2, node2);
        let t = cluster.timings;
        emit_sequence(&node, &actor, "reboot", SeqAction::Start, None);
        set_stage(&cluster, &node, MachineStage::Rebooting, false, Vec::new());
        for (phase, task) in REBOOT_PHASES {
            emit_phase(&node, &actor, phase, true);
            emit_task(&node, &actor, task, true);
            match *phase {
                "stopEverything" => stop_workload_services(&cluster, &node),
                "reboot" => {
                    power_cycle(&cluster, &node).await;
                    return;
                }
                _ => tokio::time::sleep(step(&t)).await,
            }
            emit_task(&node, &actor, task, false);
            emit_phase(&node, &actor, phase, false);
        }
    });
}

fn stop_workload_services(cluster: &Cluster, node: &Node) {
    for id in WORKLOAD_SERVICES {
        set_service(cluster, node, id, false);
    }
    node.update(&cluster.etcd, |s| {
        for pod in [
            &mut s.apiserver,
            &mut s.controller_manager,
            &mut s.scheduler,
        ] {
            pod.running = false;
        }
    });
}

/// Power off, stay off for `reboot_ms` (longer under `NeverReturns`), power on and boot.
async fn power_cycle(cluster: &Arc<Cluster>, node: &Arc<Node>) {
    power_off(cluster, node).await;
    tokio::time::sleep(cluster.timings.reboot()).await;
    let mut faults = node.faults.subscribe();
    while faults.borrow_and_update().never_returns {
        if faults.changed().await.is_err() {
            return;
        }
    }
    power_on(cluster, node).await;
}

/// The machine goes away: every connection and stream dies, the port refuses connections, the etcd
/// member stops answering. Once this returns (and the snapshot says `down`), connecting is refused.
pub(crate) async fn power_off(cluster: &Cluster, node: &Node) {
    let cut = node.cut_power();
    if let Some(mut server) = cut.server {
        // apid drains gracefully (streams deliver every event emitted so far, then end); a
        // connection that does not finish in time is dropped, like the machine going away.
        if tokio::time::timeout(GRACEFUL_STOP, &mut server)
            .await
            .is_err()
        {
            cut.kill.cancel();
            server.abort();
            let _ = server.await;
        }
    }
    let (version, boot_id) = node.update(&cluster.etcd, |s| {
        s.down = true;
        s.ready = false;
        for svc in s.services.values_mut() {
            svc.state = "Finished";
            svc.healthy = false;
        }
        s.kubelet.running = false;
        for pod in [
            &mut s.apiserver,
            &mut s.controller_manager,
            &mut s.scheduler,
        ] {
            pod.running = false;
        }
        (s.current.version.to_string(), s.boot_id.to_string())
    });
    if node.role.is_control_plane() {
        cluster.etcd.set_running(&node.name, false);
        cluster.publish_control_planes();
    }
    cluster
        .record
        .power(&node.name, node.role, PowerKind::Down, &version, &boot_id);
    tracing::debug!(node = %node.name, "simulated node powered off");
}

/// Boot: listen again, pick the A/B slot, new boot id, fresh event log and resources, then run the
/// boot sequence in the background. The port is bound before the snapshot stops saying `down`, and
/// the new state is in place before the first connection is served.
pub(crate) async fn power_on(cluster: &Arc<Cluster>, node: &Arc<Node>) {
    let addr = SocketAddrV4::new(node.address, cluster.port);
    let listener = loop {
        match bind_listener(addr) {
            Ok(listener) => break listener,
            Err(e) => {
                tracing::debug!(node = %node.name, error = %e, "re-listen failed, retrying");
                tokio::select! {
                    _ = cluster.shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
        }
    };
    let faults = node.faults.current();
    let defaults = node.default_images();
    node.events.clear();
    node.store.clear();
    let (version, boot_id) = node.update(&cluster.etcd, |s| {
        // Under a fallback fault the bootloader falls back to the current slot and nothing changes.
        let falls_back = |next: &Slot| {
            faults.boots_old_version
                || faults.boots_old_version_of.as_deref()
                    == Some(next.version.to_string().trim_start_matches('v'))
        };
        if let Some(next) = s.next_boot.take()
            && next != s.current
            && !falls_back(&next)
        {
            // The new slot boots; the old one becomes the rollback target.
            s.previous = Some(std::mem::replace(&mut s.current, next));
        }
        if let Some(staged) = s.staged_config.take()
            && let Ok(parsed) = machine_config::parse(&staged, &defaults)
        {
            s.config = staged;
            s.parsed = parsed;
        }
        s.boot_id = Uuid::new_v4();
        s.down = false;
        s.sequence = Some("boot");
        s.installing = false;
        s.services.clear();
        (s.current.version.to_string(), s.boot_id.to_string())
    });
    emit_sequence(node, "", "boot", SeqAction::Start, None);
    set_stage(
        cluster,
        node,
        MachineStage::Booting,
        false,
        booting_unmet(node),
    );
    cluster.start_apid(node, listener);
    cluster
        .record
        .power(&node.name, node.role, PowerKind::Up, &version, &boot_id);
    tracing::debug!(node = %node.name, %version, "simulated node powered on");

    let (cluster2, node2) = (cluster.clone(), node.clone());
    spawn_in_boot(node, async move {
        boot_sequence(&cluster2, &node2, Pace::Timed).await;
    });
}

fn booting_unmet(node: &Node) -> Vec<UnmetCondition> {
    let mut unmet = vec![UnmetCondition::new(
        "services",
        "service \"kubelet\" not running",
    )];
    if node.role.is_control_plane() {
        unmet.push(UnmetCondition::new(
            "staticPods",
            "static pod \"kube-apiserver\" is not ready",
        ));
    }
    unmet.push(UnmetCondition::new("nodeReady", "node is not ready"));
    unmet
}

fn running_unmet(node: &Node) -> Vec<UnmetCondition> {
    let _ = node;
    vec![UnmetCondition::new("nodeReady", "node is not ready")]
}

/// How fast the boot sequence runs: instantly for the simulator's first start, per timings after a
/// reboot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pace {
    Instant,
    Timed,
}

/// Services come up, the sequence ends (RUNNING), and after `ready_ms` (plus any injected delay) the
/// node is ready.
pub(crate) async fn boot_sequence(cluster: &Arc<Cluster>, node: &Arc<Node>, pace: Pace) {
    let t = cluster.timings;
    let mut services: Vec<&str> = vec!["machined", "udevd", "apid", "containerd", "cri", "syslogd"];
    if node.role.is_control_plane() {
        services.extend(CONTROL_PLANE_SERVICES);
    }
    services.push("kubelet");
    debug_assert!(BASE_SERVICES.iter().all(|s| services.contains(s)));
    let per_service = t.boot() / (services.len() as u32 + 1);
    for id in services {
        if pace == Pace::Timed {
            tokio::time::sleep(per_service).await;
        }
        set_service(cluster, node, id, true);
    }
    if pace == Pace::Timed {
        tokio::time::sleep(per_service).await;
    }
    settle_components(cluster, node, true, true);
    emit_sequence(node, "", "boot", SeqAction::Stop, None);
    node.update(&cluster.etcd, |s| {
        if s.sequence == Some("boot") {
            s.sequence = None;
        }
    });
    if pace == Pace::Instant {
        set_stage(cluster, node, MachineStage::Running, true, Vec::new());
        return;
    }
    set_stage(
        cluster,
        node,
        MachineStage::Running,
        false,
        running_unmet(node),
    );
    wait_ready(cluster, node).await;
    set_stage(cluster, node, MachineStage::Running, true, Vec::new());
}

/// `ready_ms`, then as long as a `ReadyDelay` fault asks (re-read whenever faults change, so clearing
/// the fault makes the node ready at once).
async fn wait_ready(cluster: &Cluster, node: &Node) {
    tokio::time::sleep(cluster.timings.ready()).await;
    let start = Instant::now();
    let mut faults = node.faults.subscribe();
    loop {
        let Some(delay) = faults.borrow_and_update().ready_delay else {
            return;
        };
        let Some(left) = delay.checked_sub(start.elapsed()) else {
            return;
        };
        tokio::select! {
            _ = tokio::time::sleep(left) => return,
            changed = faults.changed() => if changed.is_err() { return },
        }
    }
}

/// Make the running components match the config: static pods re-rendered from the current
/// *Config resources (so their config version is the resource version), kubelet from KubeletSpec.
pub(crate) fn settle_components(cluster: &Cluster, node: &Node, static_pods: bool, kubelet: bool) {
    let version = |type_: &str, id: &str, ns: &str| node.store.version_of(ns, type_, id);
    // Talos 1.14 renders the static pods from `final-<id>` and stamps its version (talos v1.14.1
    // `controllers/k8s/control_plane_static_pod.go`); older Talos from `<id>`.
    let config =
        |type_: &str, id: &str| match version(type_, &format!("final-{id}"), CONTROLPLANE_NS) {
            0 => version(type_, id, CONTROLPLANE_NS),
            v => v,
        };
    let api = config(APISERVER_CONFIG_TYPE, "kube-apiserver");
    let cm = config(CONTROLLER_MANAGER_CONFIG_TYPE, "kube-controller-manager");
    let sched = config(SCHEDULER_CONFIG_TYPE, "kube-scheduler");
    let kubelet_spec = version(KUBELET_SPEC_TYPE, "kubelet", K8S_NS);
    node.update(&cluster.etcd, |s| {
        let images = s.parsed.images.clone();
        if static_pods && node.role.is_control_plane() {
            let pod = |image: String, config_version| RunningComponent {
                image,
                config_version,
                running: true,
            };
            s.apiserver = pod(images.apiserver, api);
            s.controller_manager = pod(images.controller_manager, cm);
            s.scheduler = pod(images.scheduler, sched);
        }
        if kubelet {
            s.kubelet.image = images.kubelet;
            s.kubelet.config_version = kubelet_spec;
        }
    });
}

/// After an applied config changed component images: kubelet restarts at once (its Services resource
/// is destroyed) and comes back on the new image after `apply_ms`; static pods switch after `apply_ms`.
pub(crate) fn apply_effects(
    cluster: &Arc<Cluster>,
    node: &Arc<Node>,
    kubelet_changed: bool,
    static_pods_changed: bool,
) {
    if kubelet_changed {
        set_service(cluster, node, "kubelet", false);
    }
    if !kubelet_changed && !static_pods_changed {
        return;
    }
    let (cluster2, node2) = (cluster.clone(), node.clone());
    spawn_in_boot(node, async move {
        tokio::time::sleep(cluster2.timings.apply()).await;
        settle_components(&cluster2, &node2, static_pods_changed, kubelet_changed);
        if kubelet_changed {
            set_service(&cluster2, &node2, "kubelet", true);
        }
    });
}
