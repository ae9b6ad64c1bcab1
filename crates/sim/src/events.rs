//! The node's runtime event log (what `MachineService.Events` streams, talos-api.md §1.6).
//!
//! Like machined, the log is an in-memory ring buffer that starts empty on every boot; ids are xids
//! (time ordered, 20 base32hex characters) and payloads travel as `google.protobuf.Any` with type URL
//! `talos/runtime/machine.<Message>`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;
use tokio::sync::broadcast;

use talos_api::proto::machine;

/// machined keeps about this many events; older ones fall off.
pub(crate) const BUFFER_CAPACITY: usize = 1000;

/// An event payload message and its protobuf full name (which goes into the Any type URL).
pub(crate) trait EventPayload: Message {
    const FULL_NAME: &'static str;
}

macro_rules! payload {
    ($ty:ty, $name:literal) => {
        impl EventPayload for $ty {
            const FULL_NAME: &'static str = $name;
        }
    };
}

payload!(machine::SequenceEvent, "machine.SequenceEvent");
payload!(machine::PhaseEvent, "machine.PhaseEvent");
payload!(machine::TaskEvent, "machine.TaskEvent");
payload!(machine::ServiceStateEvent, "machine.ServiceStateEvent");
payload!(machine::MachineStatusEvent, "machine.MachineStatusEvent");
payload!(
    machine::ConfigLoadErrorEvent,
    "machine.ConfigLoadErrorEvent"
);
payload!(machine::AddressEvent, "machine.AddressEvent");

/// The type URL prefix machined uses.
pub(crate) const TYPE_URL_PREFIX: &str = "talos/runtime/";

/// One buffered event.
#[derive(Debug, Clone)]
pub(crate) struct NodeEvent {
    /// Which boot's log the event belongs to (the log is cleared on every boot).
    pub epoch: u64,
    pub id: String,
    pub actor_id: String,
    pub time: SystemTime,
    pub data: prost_types::Any,
}

impl NodeEvent {
    pub(crate) fn to_proto(&self) -> machine::Event {
        machine::Event {
            metadata: None,
            data: Some(self.data.clone()),
            id: self.id.clone(),
            actor_id: self.actor_id.clone(),
        }
    }
}

#[derive(Debug)]
pub(crate) struct EventLog {
    buffer: Mutex<Buffer>,
    tx: broadcast::Sender<NodeEvent>,
}

#[derive(Debug, Default)]
struct Buffer {
    epoch: u64,
    events: VecDeque<NodeEvent>,
}

impl EventLog {
    pub(crate) fn new() -> Self {
        EventLog {
            buffer: Mutex::new(Buffer {
                epoch: 0,
                events: VecDeque::with_capacity(BUFFER_CAPACITY),
            }),
            // As large as the buffer: a subscriber that falls this far behind has lost events anyway.
            tx: broadcast::Sender::new(BUFFER_CAPACITY),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Buffer> {
        // The buffer is only ever pushed/popped whole; a poisoned lock still holds a consistent deque.
        self.buffer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Append an event and broadcast it to live subscribers.
    pub(crate) fn emit<P: EventPayload>(&self, actor_id: &str, payload: &P) -> NodeEvent {
        let mut buffer = self.lock();
        let event = NodeEvent {
            epoch: buffer.epoch,
            id: new_xid(),
            actor_id: actor_id.to_string(),
            time: SystemTime::now(),
            data: prost_types::Any {
                type_url: format!("{TYPE_URL_PREFIX}{}", P::FULL_NAME),
                value: payload.encode_to_vec(),
            },
        };
        if buffer.events.len() == BUFFER_CAPACITY {
            buffer.events.pop_front();
        }
        buffer.events.push_back(event.clone());
        // Sent under the buffer lock so a subscriber sees each event exactly once: either in its
        // history snapshot or live. No receivers is fine.
        let _ = self.tx.send(event.clone());
        event
    }

    /// A fresh boot starts with an empty log, like machined after a restart.
    /// Starts a new epoch, so live subscribers of the previous boot can tell its events apart.
    pub(crate) fn clear(&self) {
        let mut buffer = self.lock();
        buffer.events.clear();
        buffer.epoch += 1;
    }

    /// The buffered history, a live receiver and the current epoch, taken atomically.
    pub(crate) fn subscribe(&self) -> (Vec<NodeEvent>, broadcast::Receiver<NodeEvent>, u64) {
        let buffer = self.lock();
        let rx = self.tx.subscribe();
        (buffer.events.iter().cloned().collect(), rx, buffer.epoch)
    }

    #[cfg(test)]
    pub(crate) fn history(&self) -> Vec<NodeEvent> {
        self.lock().events.iter().cloned().collect()
    }
}

/// Which buffered events a new `Events` stream replays (tail options are mutually exclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tail {
    /// Only live events (`tail_events = 0`, the default).
    None,
    /// The last N buffered events.
    Last(usize),
    /// Everything buffered (`tail_events = -1`).
    All,
    /// Events after this id.
    AfterId(String),
    /// Events of the last N seconds.
    Seconds(u64),
}

impl Tail {
    pub(crate) fn from_request(req: &machine::EventsRequest) -> Result<Tail, String> {
        let set = [
            req.tail_events != 0,
            !req.tail_id.is_empty(),
            req.tail_seconds != 0,
        ];
        if set.iter().filter(|s| **s).count() > 1 {
            return Err("tail_events, tail_id and tail_seconds are mutually exclusive".into());
        }
        Ok(if req.tail_events < 0 {
            Tail::All
        } else if req.tail_events > 0 {
            Tail::Last(req.tail_events as usize)
        } else if !req.tail_id.is_empty() {
            Tail::AfterId(req.tail_id.clone())
        } else if req.tail_seconds > 0 {
            Tail::Seconds(req.tail_seconds as u64)
        } else {
            Tail::None
        })
    }

    /// Select the replayed part of `history` (oldest first).
    pub(crate) fn select(&self, history: Vec<NodeEvent>) -> Vec<NodeEvent> {
        match self {
            Tail::None => Vec::new(),
            Tail::All => history,
            Tail::Last(n) => {
                let skip = history.len().saturating_sub(*n);
                history.into_iter().skip(skip).collect()
            }
            // xids sort in time order, so string comparison is id order.
            Tail::AfterId(id) => history.into_iter().filter(|e| e.id > *id).collect(),
            Tail::Seconds(secs) => {
                let since = SystemTime::now() - std::time::Duration::from_secs(*secs);
                history.into_iter().filter(|e| e.time >= since).collect()
            }
        }
    }
}

/// Process-wide xid counter; starts at a random value like rs/xid, below 2^23 so it cannot wrap
/// within a test run and break id ordering.
static XID_COUNTER: AtomicU32 = AtomicU32::new(0);
static XID_SEED: std::sync::OnceLock<(u32, [u8; 3])> = std::sync::OnceLock::new();

/// A new xid: 4 bytes of unix seconds, 3 bytes machine id, 2 bytes pid, 3 bytes counter, encoded as
/// lowercase base32hex without padding (20 characters). Later ids compare greater as strings.
pub(crate) fn new_xid() -> String {
    let (counter_base, machine) = *XID_SEED.get_or_init(|| {
        let random = uuid::Uuid::new_v4();
        let bytes = random.as_bytes();
        let base = u32::from_be_bytes([0, bytes[0] & 0x7f, bytes[1], bytes[2]]);
        (base, [bytes[3], bytes[4], bytes[5]])
    });
    let counter = counter_base.wrapping_add(XID_COUNTER.fetch_add(1, Ordering::Relaxed));
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as u32)
        .unwrap_or(0);
    let pid = std::process::id() as u16;
    let mut raw = [0u8; 12];
    raw[0..4].copy_from_slice(&secs.to_be_bytes());
    raw[4..7].copy_from_slice(&machine);
    raw[7..9].copy_from_slice(&pid.to_be_bytes());
    raw[9..12].copy_from_slice(&counter.to_be_bytes()[1..4]);
    encode_base32hex(&raw)
}

fn encode_base32hex(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"0123456789abcdefghijklmnopqrstuv";
    let mut out = String::with_capacity(bytes.len() * 8 / 5 + 1);
    let mut acc: u32 = 0;
    let mut bits = 0;
    for &b in bytes {
        acc = (acc << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xids_are_20_chars_and_ordered() {
        let a = new_xid();
        let b = new_xid();
        assert_eq!(a.len(), 20);
        assert!(
            a.chars()
                .all(|c| c.is_ascii_digit() || ('a'..='v').contains(&c))
        );
        assert!(b > a);
    }

    #[test]
    fn tail_selection() {
        let log = EventLog::new();
        for i in 0..5 {
            log.emit(
                &format!("actor-{i}"),
                &machine::TaskEvent {
                    task: format!("t{i}"),
                    action: 0,
                },
            );
        }
        let history = log.history();
        assert_eq!(Tail::None.select(history.clone()).len(), 0);
        assert_eq!(Tail::All.select(history.clone()).len(), 5);
        let last2 = Tail::Last(2).select(history.clone());
        assert_eq!(last2[0].actor_id, "actor-3");
        let after = Tail::AfterId(history[1].id.clone()).select(history.clone());
        assert_eq!(after.len(), 3);
        assert_eq!(history[0].data.type_url, "talos/runtime/machine.TaskEvent");
        let req = machine::EventsRequest {
            tail_events: 3,
            tail_seconds: 2,
            ..Default::default()
        };
        assert!(Tail::from_request(&req).is_err());
    }
}
