//! `MachineService.Events`: the node's runtime event stream, decoded.
//!
//! Every event carries a `google.protobuf.Any` whose type URL is `talos/runtime/machine.<Message>`.
//! [`decode_event`] turns the known payloads into [`EventPayload`] variants and keeps unknown ones as
//! [`EventPayload::Unknown`] so that newer Talos versions do not break the stream. The first event on
//! every stream is an empty "hello" that [`EventStream`] swallows.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use prost::Message as _;

use super::error::TalosError;
use crate::proto::machine;

/// The prefix Talos puts before the full protobuf message name in event type URLs.
pub const EVENT_TYPE_URL_PREFIX: &str = "talos/runtime/";

/// Options for [`TalosClient::events`](super::TalosClient::events).
///
/// `tail_events`, `tail_id` and `tail_seconds` are mutually exclusive on the server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventsOptions {
    /// Number of buffered past events to send before live ones; 0 = none, -1 = all buffered.
    pub tail_events: i32,
    /// Send only events after this event id (resume after a reconnect).
    pub tail_id: Option<String>,
    /// Send the buffered events of the last this many seconds before live ones (by the node's clock).
    pub tail_seconds: Option<u32>,
    /// Only events of this actor (the id returned by upgrade/reboot). Boot events after a reboot have
    /// an empty actor id, so a reconnect after a reboot must drop the filter.
    pub actor_id: Option<String>,
}

/// One decoded runtime event.
#[derive(Debug, Clone, PartialEq)]
pub struct TalosEvent {
    /// Event id (xid: 20 characters, time ordered); usable as [`EventsOptions::tail_id`].
    pub id: String,
    /// Actor id of the API call that caused the event; empty for boot-time and status events.
    pub actor_id: String,
    pub payload: EventPayload,
}

/// The payload of a runtime event. The protobuf messages are the generated ones; their enum fields
/// have typed accessors (for example `SequenceEvent::action()`).
#[derive(Debug, Clone, PartialEq)]
pub enum EventPayload {
    Sequence(machine::SequenceEvent),
    Phase(machine::PhaseEvent),
    Task(machine::TaskEvent),
    ServiceState(machine::ServiceStateEvent),
    MachineStatus(machine::MachineStatusEvent),
    Restart(machine::RestartEvent),
    ConfigLoadError(machine::ConfigLoadErrorEvent),
    ConfigValidationError(machine::ConfigValidationErrorEvent),
    Address(machine::AddressEvent),
    /// A payload this client does not know (newer Talos); skip it.
    Unknown {
        type_url: String,
    },
}

impl EventPayload {
    /// True for `MachineStatusEvent { stage: RUNNING, status.ready: true }`: the node finished booting
    /// and every readiness check passes (what `talosctl upgrade --wait` waits for).
    pub fn is_running_and_ready(&self) -> bool {
        match self {
            EventPayload::MachineStatus(ms) => {
                ms.stage() == machine::machine_status_event::MachineStage::Running
                    && ms.status.as_ref().is_some_and(|s| s.ready)
            }
            _ => false,
        }
    }
}

/// Decode a raw event. `Ok(None)` for an event without payload (the "hello" event that opens every
/// stream). An unknown type URL decodes to [`EventPayload::Unknown`]; a known type URL whose bytes do
/// not decode is an error.
pub fn decode_event(event: machine::Event) -> Result<Option<TalosEvent>, prost::DecodeError> {
    let Some(any) = event.data.filter(|a| !a.type_url.is_empty()) else {
        return Ok(None);
    };
    // Match on the full message name after the last '/', so both `talos/runtime/machine.X` and a
    // standard `type.googleapis.com/machine.X` decode.
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    let bytes = any.value.as_slice();
    let payload = match name {
        "machine.SequenceEvent" => EventPayload::Sequence(machine::SequenceEvent::decode(bytes)?),
        "machine.PhaseEvent" => EventPayload::Phase(machine::PhaseEvent::decode(bytes)?),
        "machine.TaskEvent" => EventPayload::Task(machine::TaskEvent::decode(bytes)?),
        "machine.ServiceStateEvent" => {
            EventPayload::ServiceState(machine::ServiceStateEvent::decode(bytes)?)
        }
        "machine.MachineStatusEvent" => {
            EventPayload::MachineStatus(machine::MachineStatusEvent::decode(bytes)?)
        }
        "machine.RestartEvent" => EventPayload::Restart(machine::RestartEvent::decode(bytes)?),
        "machine.ConfigLoadErrorEvent" => {
            EventPayload::ConfigLoadError(machine::ConfigLoadErrorEvent::decode(bytes)?)
        }
        "machine.ConfigValidationErrorEvent" => {
            EventPayload::ConfigValidationError(machine::ConfigValidationErrorEvent::decode(bytes)?)
        }
        "machine.AddressEvent" => EventPayload::Address(machine::AddressEvent::decode(bytes)?),
        _ => EventPayload::Unknown {
            type_url: any.type_url.clone(),
        },
    };
    Ok(Some(TalosEvent {
        id: event.id,
        actor_id: event.actor_id,
        payload,
    }))
}

/// An event payload message and its full protobuf name (the generated code carries no type names).
pub trait EventMessage: prost::Message {
    /// Full protobuf name, for example `machine.SequenceEvent`.
    const FULL_NAME: &'static str;
}

macro_rules! event_messages {
    ($($ty:ident),* $(,)?) => {
        $(impl EventMessage for machine::$ty {
            const FULL_NAME: &'static str = concat!("machine.", stringify!($ty));
        })*
    };
}

event_messages!(
    SequenceEvent,
    PhaseEvent,
    TaskEvent,
    ServiceStateEvent,
    MachineStatusEvent,
    RestartEvent,
    ConfigLoadErrorEvent,
    ConfigValidationErrorEvent,
    AddressEvent,
);

/// Build the `Any` for an event payload the way Talos does (`talos/runtime/machine.<Message>`).
/// Useful for servers and tests that emit events.
pub fn event_any<M: EventMessage>(payload: &M) -> prost_types::Any {
    prost_types::Any {
        type_url: format!("{EVENT_TYPE_URL_PREFIX}{}", M::FULL_NAME),
        value: payload.encode_to_vec(),
    }
}

/// A live stream of decoded events, opened by [`TalosClient::events`](super::TalosClient::events).
///
/// Yields `Ok(event)` per event. It ends (`None`) when the node closes the stream, and yields one
/// `Err` (usually [`TalosError::Unreachable`]) when the connection drops, for example because the node
/// rebooted; after an error it ends. Reconnect with a new stream (`tail_events: -1` or `tail_id`) to
/// continue. Not subject to the request timeout.
pub struct EventStream {
    inner: tonic::Streaming<machine::Event>,
    endpoint: Arc<str>,
    /// An event that arrived instead of the hello; yielded first.
    pending: Option<TalosEvent>,
    done: bool,
}

impl EventStream {
    pub(crate) fn new(
        inner: tonic::Streaming<machine::Event>,
        endpoint: Arc<str>,
        pending: Option<TalosEvent>,
    ) -> Self {
        EventStream {
            inner,
            endpoint,
            pending,
            done: false,
        }
    }

    fn decode_error(&self, e: &prost::DecodeError) -> TalosError {
        TalosError::Decode {
            endpoint: self.endpoint.to_string(),
            message: format!("event: {e}"),
        }
    }
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

/// Check `metadata.error`, which apid sets only when proxying to several nodes at once; we never do,
/// but a proxy that does must not have its error read as an empty event.
pub(crate) fn metadata_error(
    endpoint: &str,
    metadata: Option<&crate::proto::common::Metadata>,
) -> Option<TalosError> {
    let md = metadata?;
    if md.error.is_empty() {
        return None;
    }
    let code = md
        .status
        .as_ref()
        .map(|s| tonic::Code::from_i32(s.code))
        .filter(|c| *c != tonic::Code::Ok)
        .unwrap_or(tonic::Code::Unknown);
    Some(TalosError::from_code(endpoint, code, &md.error))
}

impl Stream for EventStream {
    type Item = Result<TalosEvent, TalosError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if let Some(ev) = this.pending.take() {
            return Poll::Ready(Some(Ok(ev)));
        }
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            let raw = match Pin::new(&mut this.inner).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(status))) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(TalosError::from_stream_status(
                        &this.endpoint,
                        &status,
                    ))));
                }
                Poll::Ready(Some(Ok(raw))) => raw,
            };
            if let Some(err) = metadata_error(&this.endpoint, raw.metadata.as_ref()) {
                return Poll::Ready(Some(Err(err)));
            }
            match decode_event(raw) {
                // Payload-less events after the hello carry nothing; skip them.
                Ok(None) => continue,
                Ok(Some(ev)) => return Poll::Ready(Some(Ok(ev))),
                Err(e) => return Poll::Ready(Some(Err(this.decode_error(&e)))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::common;

    fn raw(any: Option<prost_types::Any>, id: &str, actor: &str) -> machine::Event {
        machine::Event {
            metadata: None,
            data: any,
            id: id.into(),
            actor_id: actor.into(),
        }
    }

    #[test]
    fn decodes_sequence_event() {
        let seq = machine::SequenceEvent {
            sequence: "upgrade".into(),
            action: machine::sequence_event::Action::Start as i32,
            error: Some(common::Error {
                code: common::Code::Locked as i32,
                message: "locked".into(),
                details: vec![],
            }),
        };
        let any = prost_types::Any {
            type_url: "talos/runtime/machine.SequenceEvent".into(),
            value: seq.encode_to_vec(),
        };
        let ev = decode_event(raw(Some(any), "d1f0", "actor-1"))
            .unwrap()
            .unwrap();
        assert_eq!(ev.id, "d1f0");
        assert_eq!(ev.actor_id, "actor-1");
        match ev.payload {
            EventPayload::Sequence(s) => {
                assert_eq!(s.sequence, "upgrade");
                assert_eq!(s.action(), machine::sequence_event::Action::Start);
                assert_eq!(s.error.unwrap().code(), common::Code::Locked);
            }
            other => panic!("unexpected payload {other:?}"),
        }
    }

    #[test]
    fn event_any_uses_talos_type_url() {
        let any = event_any(&machine::TaskEvent {
            task: "reboot".into(),
            action: 0,
        });
        assert_eq!(any.type_url, "talos/runtime/machine.TaskEvent");
        let ev = decode_event(raw(Some(any), "x", "")).unwrap().unwrap();
        assert!(matches!(ev.payload, EventPayload::Task(t) if t.task == "reboot"));
    }

    #[test]
    fn decodes_machine_status_and_readiness() {
        use machine::machine_status_event::{MachineStage, MachineStatus};
        let ms = machine::MachineStatusEvent {
            stage: MachineStage::Running as i32,
            status: Some(MachineStatus {
                ready: true,
                unmet_conditions: vec![],
            }),
        };
        let ev = decode_event(raw(Some(event_any(&ms)), "y", ""))
            .unwrap()
            .unwrap();
        assert!(ev.payload.is_running_and_ready());

        let booting = machine::MachineStatusEvent {
            stage: MachineStage::Booting as i32,
            ..ms
        };
        let ev = decode_event(raw(Some(event_any(&booting)), "z", ""))
            .unwrap()
            .unwrap();
        assert!(!ev.payload.is_running_and_ready());
    }

    #[test]
    fn unknown_type_url_is_kept_as_unknown() {
        let any = prost_types::Any {
            type_url: "talos/runtime/machine.FancyNewEvent".into(),
            value: vec![1, 2, 3],
        };
        let ev = decode_event(raw(Some(any), "a", "")).unwrap().unwrap();
        assert_eq!(
            ev.payload,
            EventPayload::Unknown {
                type_url: "talos/runtime/machine.FancyNewEvent".into()
            }
        );
    }

    #[test]
    fn hello_event_decodes_to_none() {
        assert_eq!(decode_event(raw(None, "h", "")).unwrap(), None);
        let empty = prost_types::Any {
            type_url: String::new(),
            value: vec![],
        };
        assert_eq!(decode_event(raw(Some(empty), "h", "")).unwrap(), None);
    }

    #[test]
    fn corrupt_known_payload_is_an_error() {
        let any = prost_types::Any {
            type_url: "talos/runtime/machine.PhaseEvent".into(),
            value: vec![0x0a, 0xff], // string field with a length running past the end
        };
        assert!(decode_event(raw(Some(any), "b", "")).is_err());
    }

    #[test]
    fn metadata_error_uses_status_code() {
        let md = common::Metadata {
            hostname: "n1".into(),
            error: "rpc error: node down".into(),
            status: Some(crate::proto::google::rpc::Status {
                code: tonic::Code::Unavailable as i32,
                message: "node down".into(),
                details: vec![],
            }),
        };
        assert!(metadata_error("ep", Some(&md)).unwrap().is_unreachable());
        let md = common::Metadata { status: None, ..md };
        assert!(matches!(
            metadata_error("ep", Some(&md)),
            Some(TalosError::Status {
                code: tonic::Code::Unknown,
                ..
            })
        ));
        assert!(metadata_error("ep", Some(&common::Metadata::default())).is_none());
    }
}
