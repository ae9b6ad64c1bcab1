//! A node's service logs and kernel log (`MachineService.Logs`, `LogsContainers`, `Dmesg`), rendered
//! from what the node really did this boot: its runtime event log.
//!
//! Talos keeps every service's log in an in-memory ring buffer that starts empty at boot (talos v1.14.1
//! `internal/app/machined/pkg/runtime/logging/circular.go`), as the simulator's event log does, so the
//! logs are derived from the events on the fly:
//!
//! - `machined`: the sequencer's and service runner's lines (`[talos] task … starting`,
//!   `[talos] service[etcd](Running): Health check successful`; `v1alpha1_controller.go`,
//!   `system/service_runner.go`); the phase/task progress counters Talos prints (`(3/7)`) are left out;
//! - every other service: its own start and stop lines, in the format of the program (kubelet's JSON
//!   lines, etcd's zap JSON, Go's `log` elsewhere); their wording is illustrative;
//! - the kernel log: a few boot lines, then machined's lines as machined writes them to `/dev/kmsg`
//!   (facility `user`, priority `warning`), each formatted as `Dmesg` does in `v1alpha1_server.go`:
//!   `<facility>: <priority>: [<RFC 3339 time>]: <message>`.
//!
//! Streams follow the proto: `tail_lines` (-1: everything), `follow` (then new lines until the client
//! goes away or the node's boot ends, which ends the stream with `Unavailable` like a dropped
//! connection); `Dmesg` `tail` (with `follow`) skips what is buffered.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use prost::Message;
use tokio::sync::{broadcast, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use super::events::NodeEvent;
use super::node::Node;
use super::routing::MessageStream;
use talos_api::proto::{common, machine};

/// A log to stream: a service's, or the kernel's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Source {
    Service(String),
    Kernel,
}

/// Where the stream starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    /// Everything buffered.
    All,
    /// The last n lines.
    Last(usize),
    /// Only what comes next.
    Now,
}

/// The service logs a node has registered this boot (`LogsContainers`): every service it runs.
pub(crate) fn registered(node: &Node) -> Vec<String> {
    node.read(|s| s.services.keys().cloned().collect())
}

/// Stream `source` of `node` from `start`, then live lines if `follow`.
pub(crate) fn stream(
    node: &Node,
    source: Source,
    start: Start,
    follow: bool,
) -> MessageStream<common::Data> {
    let (history, mut live, epoch) = node.events.subscribe();
    let boot = node.boot_token();
    let mut renderer = Renderer::new(node, source);
    let mut lines = renderer.boot_lines(history.first().map(|e| e.time));
    for event in &history {
        lines.extend(renderer.render(event));
    }
    let replay = match start {
        Start::All => lines,
        Start::Last(n) => lines.split_off(lines.len().saturating_sub(n)),
        Start::Now => Vec::new(),
    };
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(async move {
        let data = |line: String| {
            Ok(common::Data {
                metadata: None,
                bytes: format!("{line}\n").into_bytes(),
            })
        };
        for line in replay {
            if tx.send(data(line)).await.is_err() {
                return;
            }
        }
        if !follow {
            return;
        }
        loop {
            tokio::select! {
                biased;
                _ = boot.cancelled() => {
                    let _ = tx.send(Err(Status::unavailable("node is rebooting"))).await;
                    return;
                }
                _ = tx.closed() => return,
                received = live.recv() => match received {
                    Ok(event) if event.epoch != epoch => {}
                    Ok(event) => {
                        for line in renderer.render(&event) {
                            if tx.send(data(line)).await.is_err() {
                                return;
                            }
                        }
                    }
                    // Lines were lost; a log reader carries on with what comes next.
                    Err(broadcast::error::RecvError::Lagged(_)) => {}
                    Err(broadcast::error::RecvError::Closed) => return,
                },
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Turns events into the lines of one log, remembering when things started to print durations.
struct Renderer {
    source: Source,
    node_name: String,
    platform: String,
    talos_version: String,
    started: HashMap<String, SystemTime>,
}

impl Renderer {
    fn new(node: &Node, source: Source) -> Self {
        Renderer {
            source,
            node_name: node.name.clone(),
            platform: node.platform.clone(),
            talos_version: node.version().to_string(),
            started: HashMap::new(),
        }
    }

    /// Lines that precede every event of the boot (the kernel's own boot messages).
    fn boot_lines(&self, first_event: Option<SystemTime>) -> Vec<String> {
        if self.source != Source::Kernel {
            return Vec::new();
        }
        let at = first_event.unwrap_or_else(SystemTime::now);
        [
            ("kern", "notice", "Linux version 6.12.0-talos (simulated by talos-sim)".to_string()),
            (
                "kern",
                "info",
                format!(
                    "Command line: talos.platform={} console=ttyS0 init_on_alloc=1 slab_nomerge pti=on",
                    self.platform
                ),
            ),
            (
                "user",
                "warning",
                format!("[talos] [initramfs] booting Talos v{}", self.talos_version),
            ),
        ]
        .into_iter()
        .map(|(facility, priority, message)| kmsg_line(facility, priority, at, &message))
        .collect()
    }

    fn render(&mut self, event: &NodeEvent) -> Vec<String> {
        match &self.source {
            Source::Kernel => self
                .machined_message(event)
                .map(|m| kmsg_line("user", "warning", event.time, &format!("[talos] {m}")))
                .into_iter()
                .collect(),
            Source::Service(id) if id == "machined" => self
                .machined_message(event)
                .map(|m| format!("[talos] {m}"))
                .into_iter()
                .collect(),
            Source::Service(id) => {
                let id = id.clone();
                service_transition(event)
                    .filter(|(service, _, _)| *service == id)
                    .map(|(_, state, _)| self.service_lines(&id, state, event.time))
                    .unwrap_or_default()
            }
        }
    }

    /// What machined logs for an event, without its `[talos] ` prefix.
    fn machined_message(&mut self, event: &NodeEvent) -> Option<String> {
        let value = event.data.value.as_slice();
        let kind = event.data.type_url.rsplit('.').next().unwrap_or_default();
        match kind {
            "SequenceEvent" => {
                let e = machine::SequenceEvent::decode(value).ok()?;
                let key = format!("sequence/{}", e.sequence);
                match e.action {
                    1 => {
                        self.started.insert(key, event.time);
                        Some(format!("{} sequence: started", e.sequence))
                    }
                    2 if e.error.is_some() => Some(format!("{} sequence: failed", e.sequence)),
                    2 => Some(format!(
                        "{} sequence: done: {}",
                        e.sequence,
                        self.elapsed(&key, event.time)
                    )),
                    _ => None,
                }
            }
            "PhaseEvent" => {
                let e = machine::PhaseEvent::decode(value).ok()?;
                let key = format!("phase/{}", e.phase);
                if e.action == 0 {
                    self.started.insert(key, event.time);
                    Some(format!("phase {}: started", e.phase))
                } else {
                    Some(format!(
                        "phase {}: done, {}",
                        e.phase,
                        self.elapsed(&key, event.time)
                    ))
                }
            }
            "TaskEvent" => {
                let e = machine::TaskEvent::decode(value).ok()?;
                let key = format!("task/{}", e.task);
                if e.action == 0 {
                    self.started.insert(key, event.time);
                    Some(format!("task {}: starting", e.task))
                } else {
                    Some(format!(
                        "task {}: done, {}",
                        e.task,
                        self.elapsed(&key, event.time)
                    ))
                }
            }
            "ServiceStateEvent" => {
                let (service, state, message) = service_transition(event)?;
                Some(format!("service[{service}]({state}): {message}"))
            }
            "ConfigLoadErrorEvent" => {
                let e = machine::ConfigLoadErrorEvent::decode(value).ok()?;
                Some(format!("failed to load config: {}", e.error))
            }
            _ => None,
        }
    }

    fn elapsed(&mut self, key: &str, now: SystemTime) -> String {
        self.started
            .remove(key)
            .and_then(|start| now.duration_since(start).ok())
            .map(go_duration)
            .unwrap_or_else(|| "0s".to_string())
    }

    /// A service's own lines for a state it entered.
    fn service_lines(&self, id: &str, state: &str, at: SystemTime) -> Vec<String> {
        let messages: &[&str] = match (id, state) {
            ("kubelet", "Running") => &["Started kubelet", "Successfully registered node"],
            ("kubelet", "Stopping") => &["Shutting down kubelet"],
            ("etcd", "Running") => &[
                "serving client traffic securely",
                "ready to serve client requests",
            ],
            ("etcd", "Stopping") => &["closing etcd server"],
            ("apid", "Running") => &["serving the Talos API on [::]:50000"],
            ("trustd", "Running") => &["serving on [::]:50001"],
            (_, "Running") => &["started"],
            (_, "Stopping") => &["stopping"],
            _ => &[],
        };
        messages
            .iter()
            .map(|message| match id {
                "kubelet" => {
                    let ms = at
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64()
                        * 1000.0;
                    let node = if message.ends_with("node") {
                        format!(",\"node\":\"{}\"", self.node_name)
                    } else {
                        String::new()
                    };
                    format!("{{\"ts\":{ms:.3},\"msg\":\"{message}\"{node},\"v\":0}}")
                }
                "etcd" => format!(
                    "{{\"level\":\"info\",\"ts\":\"{}\",\"msg\":\"{message}\"}}",
                    rfc3339(at, 6)
                ),
                _ => format!("{} {id}: {message}", go_log_time(at)),
            })
            .collect()
    }
}

/// The (service, state, message) of a `ServiceStateEvent`.
fn service_transition(event: &NodeEvent) -> Option<(String, &'static str, String)> {
    if !event.data.type_url.ends_with(".ServiceStateEvent") {
        return None;
    }
    let e = machine::ServiceStateEvent::decode(event.data.value.as_slice()).ok()?;
    let state = match e.action {
        0 => "Initialized",
        1 => "Preparing",
        2 => "Waiting",
        3 => "Running",
        4 => "Stopping",
        5 => "Finished",
        6 => "Failed",
        7 => "Skipped",
        8 => "Starting",
        _ => "Unknown",
    };
    Some((e.service, state, e.message))
}

/// `Dmesg`'s line format: `"%s: %7s: [%s]: %s"` with the time as Go's `time.RFC3339Nano` prints it
/// (trailing zeros of the fraction dropped).
fn kmsg_line(facility: &str, priority: &str, at: SystemTime, message: &str) -> String {
    let time = rfc3339(at, 9);
    let time = match time.strip_suffix('Z') {
        Some(t) if t.contains('.') => format!("{}Z", t.trim_end_matches('0').trim_end_matches('.')),
        _ => time,
    };
    format!("{facility}: {priority:>7}: [{time}]: {message}")
}

fn rfc3339(at: SystemTime, digits: u8) -> String {
    jiff::Timestamp::try_from(at)
        .map(|ts| {
            let format = format!("%Y-%m-%dT%H:%M:%S%.{digits}fZ");
            ts.strftime(&format).to_string()
        })
        .unwrap_or_default()
}

/// Go's `log` timestamp (`2009/01/23 01:23:23`).
fn go_log_time(at: SystemTime) -> String {
    jiff::Timestamp::try_from(at)
        .map(|ts| ts.strftime("%Y/%m/%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

/// A duration as Go's `time.Duration.String` prints it (`150ms`, `1.5s`, `2m3.5s`).
pub(crate) fn go_duration(d: Duration) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    let nanos = d.as_nanos();
    if nanos == 0 {
        "0s".to_string()
    } else if nanos < 1_000 {
        format!("{nanos}ns")
    } else if nanos < 1_000_000 {
        format!("{}µs", trim(format!("{:.3}", nanos as f64 / 1e3)))
    } else if nanos < 1_000_000_000 {
        format!("{}ms", trim(format!("{:.6}", nanos as f64 / 1e6)))
    } else {
        let secs = d.as_secs();
        let fraction = trim(format!("{:.9}", f64::from(d.subsec_nanos()) / 1e9));
        let fraction = fraction.trim_start_matches('0');
        let (hours, minutes, seconds) = (secs / 3600, secs / 60 % 60, secs % 60);
        let seconds = format!("{seconds}{fraction}s");
        match (hours, minutes) {
            (0, 0) => seconds,
            (0, m) => format!("{m}m{seconds}"),
            (h, m) => format!("{h}h{m}m{seconds}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_prints_them() {
        assert_eq!(go_duration(Duration::from_millis(150)), "150ms");
        assert_eq!(go_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(go_duration(Duration::from_millis(123_500)), "2m3.5s");
        assert_eq!(go_duration(Duration::from_secs(2)), "2s");
        assert_eq!(go_duration(Duration::ZERO), "0s");
    }

    #[test]
    fn kernel_lines_are_formatted_as_dmesg_sends_them() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_120);
        assert_eq!(
            kmsg_line("user", "warning", at, "[talos] hi"),
            "user: warning: [2023-11-14T22:13:20.12Z]: [talos] hi"
        );
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            kmsg_line("kern", "info", at, "hello"),
            "kern:    info: [2023-11-14T22:13:20Z]: hello"
        );
    }
}
