//! The call record: what a controller under test asked the nodes to do, and when each node was down.
//!
//! Tests assert on it after the fact ("Upgrade was called once per node", "never two control planes
//! down at once"), so every entry carries both wall-clock time (for humans and JSON dumps) and the
//! time elapsed since the simulator started (for ordering and arithmetic).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use serde::{Serialize, Serializer};

use super::config::Role;

/// One mutating API call received by a node.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallRecord {
    /// Node the call acted on (the `node` header target, or the node dialled).
    pub node: String,
    /// Node whose port received the connection (differs from `node` when proxied with `node`).
    pub endpoint: String,
    /// Full gRPC method path, e.g. `/machine.MachineService/Upgrade`.
    pub method: String,
    /// Request parameters: image, preserve, mode, ...
    pub params: serde_json::Value,
    #[serde(serialize_with = "ser_system_time")]
    pub time: SystemTime,
    #[serde(serialize_with = "ser_duration_ms")]
    pub elapsed: Duration,
    /// `"ok"`, `"pending"` while the handler runs, or `"<gRPC code>: <message>"`.
    pub result: String,
}

/// Whether a node went down or came back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PowerKind {
    Down,
    Up,
}

/// A node going down (port closed) or coming back (listening again).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PowerEvent {
    pub node: String,
    pub role: Role,
    pub kind: PowerKind,
    /// Talos version the node runs after this event (for `Up`) or ran (for `Down`).
    pub talos_version: String,
    /// Boot id of the boot that ends (`Down`) or starts (`Up`).
    pub boot_id: String,
    #[serde(serialize_with = "ser_system_time")]
    pub time: SystemTime,
    #[serde(serialize_with = "ser_duration_ms")]
    pub elapsed: Duration,
}

fn ser_system_time<S: Serializer>(time: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    match jiff::Timestamp::try_from(*time) {
        Ok(ts) => s.serialize_str(&ts.to_string()),
        Err(_) => s.serialize_str("out of range"),
    }
}

fn ser_duration_ms<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1000.0)
}

/// Handle to a call entry whose result is filled in when the handler finishes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallId(usize);

#[derive(Debug)]
pub(crate) struct Recorder {
    started: Instant,
    started_wall: SystemTime,
    calls: Mutex<Vec<CallRecord>>,
    power: Mutex<Vec<PowerEvent>>,
}

/// Lock a mutex, recovering from poisoning: a panicking test thread must not hide the record from the
/// rest of the test, and the data (append-only lists) cannot be left half-updated.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Recorder {
    pub(crate) fn new() -> Self {
        Recorder {
            started: Instant::now(),
            started_wall: SystemTime::now(),
            calls: Mutex::new(Vec::new()),
            power: Mutex::new(Vec::new()),
        }
    }

    fn now(&self) -> (SystemTime, Duration) {
        let elapsed = self.started.elapsed();
        (self.started_wall + elapsed, elapsed)
    }

    /// Record a call as it arrives; its result is "pending" until [`Recorder::finish`].
    pub(crate) fn begin(
        &self,
        node: &str,
        endpoint: &str,
        method: &str,
        params: serde_json::Value,
    ) -> CallId {
        let (time, elapsed) = self.now();
        let mut calls = lock(&self.calls);
        calls.push(CallRecord {
            node: node.to_string(),
            endpoint: endpoint.to_string(),
            method: method.to_string(),
            params,
            time,
            elapsed,
            result: "pending".to_string(),
        });
        CallId(calls.len() - 1)
    }

    pub(crate) fn finish(&self, id: CallId, result: String) {
        if let Some(call) = lock(&self.calls).get_mut(id.0) {
            call.result = result;
        }
    }

    pub(crate) fn power(
        &self,
        node: &str,
        role: Role,
        kind: PowerKind,
        talos_version: &str,
        boot_id: &str,
    ) {
        let (time, elapsed) = self.now();
        lock(&self.power).push(PowerEvent {
            node: node.to_string(),
            role,
            kind,
            talos_version: talos_version.to_string(),
            boot_id: boot_id.to_string(),
            time,
            elapsed,
        });
    }

    pub(crate) fn calls(&self) -> Vec<CallRecord> {
        lock(&self.calls).clone()
    }

    pub(crate) fn power_events(&self) -> Vec<PowerEvent> {
        lock(&self.power).clone()
    }
}

/// The largest number of nodes matching `role` (all nodes if `None`) that were down at the same time.
pub fn max_concurrently_down(events: &[PowerEvent], role: Option<Role>) -> usize {
    let mut down = BTreeSet::new();
    let mut max = 0;
    // Events are appended in the order they happen, under one lock, so list order is time order.
    for event in events.iter().filter(|e| role.is_none_or(|r| e.role == r)) {
        match event.kind {
            PowerKind::Down => {
                down.insert(event.node.as_str());
            }
            PowerKind::Up => {
                down.remove(event.node.as_str());
            }
        }
        max = max.max(down.len());
    }
    max
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_serializes() {
        let r = Recorder::new();
        let id = r.begin(
            "cp-1",
            "cp-1",
            "/machine.MachineService/Upgrade",
            serde_json::json!({"image": "x"}),
        );
        r.finish(id, "ok".into());
        let calls = r.calls();
        assert_eq!(calls[0].result, "ok");
        let json = serde_json::to_value(&calls).unwrap();
        assert_eq!(json[0]["params"]["image"], "x");
        assert!(json[0]["time"].as_str().unwrap().contains('T'));
    }

    #[test]
    fn concurrency_of_downtime() {
        let r = Recorder::new();
        r.power("a", Role::ControlPlane, PowerKind::Down, "1", "x");
        r.power("w", Role::Worker, PowerKind::Down, "1", "x");
        r.power("a", Role::ControlPlane, PowerKind::Up, "1", "y");
        r.power("b", Role::ControlPlane, PowerKind::Down, "1", "x");
        r.power("b", Role::ControlPlane, PowerKind::Up, "1", "y");
        let events = r.power_events();
        assert_eq!(max_concurrently_down(&events, Some(Role::ControlPlane)), 1);
        assert_eq!(max_concurrently_down(&events, None), 2);
    }
}
