//! A small HTTP API to watch and break a running simulator from outside its process (the demo, a
//! person with `curl`): node states, the call record, and fault injection.
//!
//! ```text
//! GET    /nodes                          every node's state (JSON)
//! GET    /record                         mutating calls received and power events (JSON)
//! POST   /nodes/{node}/faults/{fault}    inject a fault; `fail-next-calls?count=N`, `ready-delay?ms=N`,
//!                                        `installer-exits?code=N[&count=M]` (M absent or 0: until cleared)
//! DELETE /nodes/{node}/faults            clear every fault on a node
//! ```
//!
//! It listens on loopback only and carries no credentials: it is a test and demo tool.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};

use super::{Fault, Simulator};

/// Fault names as the control API and the docs spell them.
pub const FAULT_NAMES: &[&str] = &[
    "installer-pull-fails",
    "never-returns",
    "boots-old-version",
    "etcd-unhealthy",
    "fail-next-calls",
    "ready-delay",
    "apply-config-rejected",
    "reboot-lost",
    "install-unavailable",
    "installer-exits",
    "etcd-snapshot-fails",
    "etcd-snapshot-truncated",
    "no-one-to-many",
];

/// Parses a fault name and its query parameters (`count` for `fail-next-calls`, `ms` for `ready-delay`,
/// an optional `version` for `boots-old-version` (only that version's new system fails to boot),
/// `code` and an optional `count` for `installer-exits`).
pub fn parse_fault(name: &str, params: &HashMap<String, String>) -> Result<Fault, String> {
    let number = |key: &str| -> Result<u64, String> {
        let raw = params
            .get(key)
            .ok_or_else(|| format!("fault {name} needs ?{key}=<number>"))?;
        raw.parse()
            .map_err(|_| format!("fault {name}: {key}={raw:?} is not a whole number"))
    };
    Ok(match name {
        "installer-pull-fails" => Fault::InstallerPullFails,
        "never-returns" => Fault::NeverReturns,
        "boots-old-version" => match params.get("version") {
            Some(version) => Fault::BootsOldVersionOf(version.clone()),
            None => Fault::BootsOldVersion,
        },
        "etcd-unhealthy" => Fault::EtcdUnhealthy,
        "fail-next-calls" => Fault::FailNextCalls(
            u32::try_from(number("count")?).map_err(|_| "count is too large".to_string())?,
        ),
        "ready-delay" => Fault::ReadyDelay(Duration::from_millis(number("ms")?)),
        "apply-config-rejected" => Fault::ApplyConfigRejected,
        "reboot-lost" => Fault::RebootLost,
        "install-unavailable" => Fault::InstallUnavailable,
        "etcd-snapshot-fails" => Fault::EtcdSnapshotFails,
        "etcd-snapshot-truncated" => Fault::EtcdSnapshotTruncated,
        "no-one-to-many" => Fault::NoOneToMany,
        "installer-exits" => {
            let code = number("code")?;
            if !(1..=255).contains(&code) {
                return Err(format!(
                    "fault {name}: code={code} is not a failing exit code (1 to 255; Talos's are 1 to 7)"
                ));
            }
            let count = if params.contains_key("count") {
                u32::try_from(number("count")?).map_err(|_| "count is too large".to_string())?
            } else {
                0
            };
            Fault::InstallerExits {
                code: code as i32,
                count,
            }
        }
        other => {
            return Err(format!(
                "unknown fault {other:?}; known faults: {}",
                FAULT_NAMES.join(", ")
            ));
        }
    })
}

/// The control API's routes.
pub fn router(simulator: Arc<Simulator>) -> Router {
    Router::new()
        .route("/nodes", get(nodes))
        .route("/record", get(record))
        .route("/nodes/{node}/faults/{fault}", post(inject))
        .route("/nodes/{node}/faults", delete(clear))
        .with_state(simulator)
}

async fn nodes(State(sim): State<Arc<Simulator>>) -> Json<serde_json::Value> {
    Json(serde_json::json!(sim.snapshots()))
}

async fn record(State(sim): State<Arc<Simulator>>) -> Json<serde_json::Value> {
    Json(sim.record_json())
}

async fn inject(
    State(sim): State<Arc<Simulator>>,
    Path((node, fault)): Path<(String, String)>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    let fault = match parse_fault(&fault, &params) {
        Ok(fault) => fault,
        Err(message) => return (StatusCode::BAD_REQUEST, message).into_response(),
    };
    match sim.inject_fault(&node, fault.clone()) {
        Ok(()) => {
            tracing::info!(%node, ?fault, "fault injected");
            Json(serde_json::json!(sim.active_faults(&node).ok())).into_response()
        }
        Err(error) => (StatusCode::NOT_FOUND, error.to_string()).into_response(),
    }
}

async fn clear(State(sim): State<Arc<Simulator>>, Path(node): Path<String>) -> Response {
    match sim.clear_faults(&node) {
        Ok(()) => {
            tracing::info!(%node, "faults cleared");
            StatusCode::NO_CONTENT.into_response()
        }
        Err(error) => (StatusCode::NOT_FOUND, error.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_documented_fault_name_parses() {
        let with_args = params(&[("count", "3"), ("ms", "1500"), ("code", "4")]);
        for name in FAULT_NAMES {
            assert!(parse_fault(name, &with_args).is_ok(), "{name}");
        }
        assert_eq!(
            parse_fault("fail-next-calls", &with_args),
            Ok(Fault::FailNextCalls(3))
        );
        assert_eq!(
            parse_fault("ready-delay", &with_args),
            Ok(Fault::ReadyDelay(Duration::from_millis(1500)))
        );
        assert_eq!(
            parse_fault("installer-exits", &with_args),
            Ok(Fault::InstallerExits { code: 4, count: 3 })
        );
        assert_eq!(
            parse_fault("installer-exits", &params(&[("code", "2")])),
            Ok(Fault::InstallerExits { code: 2, count: 0 })
        );
    }

    #[test]
    fn bad_fault_requests_say_what_is_wrong() {
        let unknown = parse_fault("melt", &params(&[])).unwrap_err();
        assert!(unknown.contains("unknown fault \"melt\"") && unknown.contains("never-returns"));
        let missing = parse_fault("fail-next-calls", &params(&[])).unwrap_err();
        assert!(missing.contains("?count="), "{missing}");
        let bad = parse_fault("ready-delay", &params(&[("ms", "soon")])).unwrap_err();
        assert!(bad.contains("not a whole number"), "{bad}");
        let zero = parse_fault("installer-exits", &params(&[("code", "0")])).unwrap_err();
        assert!(zero.contains("not a failing exit code"), "{zero}");
        let missing = parse_fault("installer-exits", &params(&[("count", "1")])).unwrap_err();
        assert!(missing.contains("?code="), "{missing}");
    }
}
