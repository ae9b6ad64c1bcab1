//! The operator's gates before each node (issue #23): what may hold a run before it starts its next
//! node, beyond the preflight checks every node gets (nodes Ready, etcd healthy; see
//! [`crate::run::PreflightCheck`]).
//!
//! Two kinds of gate, one vocabulary:
//!
//! * gates decided here from the settings, the run record and the time alone (maintenance windows,
//!   soak, the canary's pause after N nodes): pure, table-tested;
//! * gates whose answer needs IO the shell makes before the decision (the alert gate asks Prometheus,
//!   the health checks read the workload cluster): the shell hands in an [`ExternalCheck`] per gate in
//!   a [`GateObservation`], and the decision here only reads it.
//!
//! A hold never stops a node in flight: it only keeps the next one from starting. Every hold names its
//! [`Gate`] and says, in one sentence, what the run waits for (and until when, where that is known).

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::time::Duration;

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// One gate a run may wait at before its next node. Closed: every gate is matched exhaustively where
/// holds are reported and counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Gate {
    /// Alerts that should stop an upgrade are firing (or Prometheus cannot tell).
    Alerts,
    /// Outside every maintenance window of the cluster.
    MaintenanceWindow,
    /// The pause after a node, or after the control-plane phase, has not ended.
    Soak,
    /// A health check on the workload cluster fails (or cannot be evaluated).
    HealthChecks,
    /// The canary's `pause after N nodes` was reached: a person looks, then unpauses.
    Canary,
}

impl Gate {
    pub const ALL: [Gate; 5] = [
        Gate::Alerts,
        Gate::MaintenanceWindow,
        Gate::Soak,
        Gate::HealthChecks,
        Gate::Canary,
    ];

    /// The gate's name in metrics labels and messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Gate::Alerts => "alerts",
            Gate::MaintenanceWindow => "maintenance-window",
            Gate::Soak => "soak",
            Gate::HealthChecks => "health-checks",
            Gate::Canary => "canary",
        }
    }
}

/// Why a gate holds, within the gate: the `reason` label of `talos_upgrade_holds_total`. Closed and
/// small, so the counter's series stay bounded (the message carries the details).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum HoldReason {
    /// The canary's pause after N nodes was reached.
    CanaryPause,
    /// Outside every maintenance window.
    OutsideWindow,
    /// The soak after the last node done.
    SoakAfterNode,
    /// The soak after the control-plane phase.
    SoakAfterControlPlanes,
    /// The external check answered, and its answer holds (alerts firing, a health check failing).
    CheckFailing,
    /// The external check could not be asked or answered (Prometheus unreachable, a health check
    /// that cannot be evaluated): it holds rather than count as clear.
    CheckUnknown,
}

impl HoldReason {
    pub const ALL: [HoldReason; 6] = [
        HoldReason::CanaryPause,
        HoldReason::OutsideWindow,
        HoldReason::SoakAfterNode,
        HoldReason::SoakAfterControlPlanes,
        HoldReason::CheckFailing,
        HoldReason::CheckUnknown,
    ];

    /// The reason's name in metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldReason::CanaryPause => "canary-pause",
            HoldReason::OutsideWindow => "outside-window",
            HoldReason::SoakAfterNode => "after-node",
            HoldReason::SoakAfterControlPlanes => "after-control-planes",
            HoldReason::CheckFailing => "failing",
            HoldReason::CheckUnknown => "unknown",
        }
    }
}

/// What the shell found for a gate that needs IO, this pass.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum ExternalCheck {
    /// The gate is not configured for this cluster: it never holds.
    #[default]
    NotConfigured,
    /// Asked, and nothing holds.
    Clear,
    /// Asked, and the answer holds the run: `message` names what (the alerts and since when, the
    /// failing check).
    Holding { message: String },
    /// Could not be asked or answered (Prometheus unreachable, a check that cannot be evaluated):
    /// holds, never counts as clear.
    Unknown { reason: String },
}

impl ExternalCheck {
    /// Why it holds, if it does.
    pub fn holding(&self) -> Option<&str> {
        self.hold().map(|(message, _)| message)
    }

    /// Why it holds and the hold's reason, if it does.
    fn hold(&self) -> Option<(&str, HoldReason)> {
        match self {
            ExternalCheck::NotConfigured | ExternalCheck::Clear => None,
            ExternalCheck::Holding { message } => Some((message, HoldReason::CheckFailing)),
            ExternalCheck::Unknown { reason } => Some((reason, HoldReason::CheckUnknown)),
        }
    }
}

/// What the shell observed for the gates, handed to the decision with the rest of the observation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GateObservation {
    pub alerts: ExternalCheck,
    pub health_checks: ExternalCheck,
    /// Nodes whose Machine or Node is annotated to be held: the run skips them and says so.
    pub held_nodes: BTreeSet<String>,
}

/// Why a run is not starting its next node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub gate: Gate,
    /// Why, within the gate (the metric's `reason`).
    pub reason: HoldReason,
    /// One sentence: what the run waits for.
    pub message: String,
    /// When the hold ends by itself, where that is known (a window's opening, a soak's end): the
    /// shell looks again then.
    pub until: Option<Timestamp>,
}

/// The operator's and the user's gate settings of one run (annotations over flags). Nothing set: no
/// gate holds.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GateSettings {
    /// `maintenance-window` (or the operator's `--maintenance-window`); `None`: no window, any time.
    pub maintenance_window: Option<MaintenanceWindows>,
    /// `force-start: "true"` is set now: the run records it and ignores the windows from then on.
    pub force_start: bool,
    /// `soak-after-node`: how long after a node is done the next one waits.
    pub soak_after_node: Option<Duration>,
    /// `soak-after-control-planes`: how long after the last control plane is done the first node of
    /// the next phase waits.
    pub soak_after_control_planes: Option<Duration>,
    /// `pause-after-nodes`: the canary, how many nodes the run upgrades before it pauses once.
    pub pause_after_nodes: Option<NonZeroU32>,
    /// `resume: "true"` is set now (it releases a canary pause).
    pub resume: bool,
}

/// What the gates read of the run under way, as the decision hands it over: the gates know nothing
/// of a run's record beyond this.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunProgress {
    /// Nodes done and in all (`d/t`).
    pub done: usize,
    pub total: usize,
    /// Nodes this run upgraded (not those found on the target).
    pub upgraded: usize,
    /// The node this run finished last, and when.
    pub last_done: Option<(String, Timestamp)>,
    /// When the control-plane phase ended (its last control plane upgraded by this run), when the
    /// next node is the first of the phase after it.
    pub control_planes_done: Option<Timestamp>,
    /// What the run record keeps of its gates.
    pub gates: RunGates,
}

/// What a run record keeps of its gates between reconciles and across restarts.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RunGates {
    /// When `force-start` was taken in: the windows hold this run no more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_started_at: Option<Timestamp>,
    /// The canary's pause, once it began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// Nodes announced held in this run (`NodeHeld` once per node and run).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub held: BTreeSet<String>,
    /// Held nodes the completed run left out; taken in once no longer held.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub skipped: BTreeSet<String>,
    /// The installer pulled on every node before the first is disrupted ([`crate::prepull`]).
    #[serde(default, skip_serializing_if = "crate::prepull::PrePull::is_empty")]
    pub prepull: crate::prepull::PrePull,
    /// The etcd snapshot taken before the first control plane ([`crate::etcd_snapshot`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etcd_snapshot: Option<crate::etcd_snapshot::Snapshot>,
}

impl RunGates {
    pub fn is_empty(&self) -> bool {
        *self == RunGates::default()
    }
}

/// The canary's pause in a run: once per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    rename_all = "camelCase",
    rename_all_fields = "camelCase",
    tag = "state"
)]
pub enum Canary {
    /// Holding since `since`; `paused_seen`: the `paused` annotation was seen "true" since it began,
    /// so its removal (or "false") releases it.
    Holding {
        since: Timestamp,
        paused_seen: bool,
    },
    Released {
        at: Timestamp,
    },
}

/// The canary's next state, where a node would start: it begins once the run upgraded
/// `pause-after-nodes` nodes, and is released by `resume`, or by `paused` seen "true" since it began
/// and not "true" now (a pause and an unpause). `paused` is the annotation's reading now.
pub fn canary_step(
    settings: &GateSettings,
    state: Option<Canary>,
    upgraded: usize,
    paused: bool,
    now: Timestamp,
) -> Option<Canary> {
    match state {
        None => settings
            .pause_after_nodes
            .filter(|n| upgraded >= n.get() as usize)
            .map(|_| Canary::Holding {
                since: now,
                paused_seen: paused,
            }),
        Some(Canary::Holding { .. }) if settings.resume => Some(Canary::Released { at: now }),
        Some(Canary::Holding {
            paused_seen: true, ..
        }) if !paused => Some(Canary::Released { at: now }),
        Some(Canary::Holding { since, paused_seen }) => Some(Canary::Holding {
            since,
            paused_seen: paused_seen || paused,
        }),
        released @ Some(Canary::Released { .. }) => released,
    }
}

/// Why the next node may not start now, if a gate says so: canary, maintenance window, soak, alerts,
/// health checks, in that order (the first that holds is the one shown). A user's decision (the
/// canary) comes before the clock, the clock before what must be asked of the cluster. Called only
/// when a node would start: a node in flight is never held.
pub fn hold_before_next_node(
    settings: &GateSettings,
    observation: &GateObservation,
    progress: &RunProgress,
    now: Timestamp,
) -> Option<Hold> {
    let external = |gate: Gate, check: &ExternalCheck| {
        check.hold().map(|(message, reason)| Hold {
            gate,
            reason,
            message: message.to_string(),
            until: None,
        })
    };
    canary_hold(settings, progress)
        .or_else(|| window_hold(settings, progress, now))
        .or_else(|| soak_hold(settings, progress, now))
        .or_else(|| external(Gate::Alerts, &observation.alerts))
        .or_else(|| external(Gate::HealthChecks, &observation.health_checks))
}

fn canary_hold(settings: &GateSettings, progress: &RunProgress) -> Option<Hold> {
    let Some(Canary::Holding { .. }) = progress.gates.canary else {
        return None;
    };
    let upgraded = progress.upgraded;
    let limit = settings
        .pause_after_nodes
        .map_or(upgraded, |n| n.get() as usize);
    Some(Hold {
        gate: Gate::Canary,
        reason: HoldReason::CanaryPause,
        message: format!(
            "the canary pause after {limit} upgraded node{}: check the cluster, then set \
             upgrade.vitistack.io/resume to \"true\" (or set paused to \"true\" and remove it) to \
             go on",
            if limit == 1 { "" } else { "s" }
        ),
        until: None,
    })
}

fn window_hold(settings: &GateSettings, progress: &RunProgress, now: Timestamp) -> Option<Hold> {
    if progress.gates.force_started_at.is_some() {
        return None;
    }
    let windows = settings.maintenance_window.as_ref()?;
    let opening = windows.next_opening(now)?;
    Some(Hold {
        gate: Gate::MaintenanceWindow,
        reason: HoldReason::OutsideWindow,
        message: format!(
            "outside the maintenance window ({windows}); the next opens at {}",
            opening.describe()
        ),
        until: Some(opening.at),
    })
}

fn soak_hold(settings: &GateSettings, progress: &RunProgress, now: Timestamp) -> Option<Hold> {
    let after_node = settings
        .soak_after_node
        .zip(progress.last_done.as_ref())
        .map(|(soak, (node, at))| {
            (
                *at + soak,
                format!("node {node}"),
                HoldReason::SoakAfterNode,
            )
        });
    let after_control_planes = settings
        .soak_after_control_planes
        .zip(progress.control_planes_done)
        .map(|(soak, at)| {
            (
                at + soak,
                "the control planes".to_string(),
                HoldReason::SoakAfterControlPlanes,
            )
        });
    // The later of the two is what the next node waits for.
    let (until, what, reason) = [after_node, after_control_planes]
        .into_iter()
        .flatten()
        .max_by_key(|(until, _, _)| *until)?;
    (now < until).then(|| Hold {
        gate: Gate::Soak,
        reason,
        message: format!("soaking after {what} until {}", utc(until)),
        until: Some(until),
    })
}

/// `2026-11-30 21:00:00 UTC`.
fn utc(at: Timestamp) -> String {
    at.strftime("%Y-%m-%d %H:%M:%S UTC").to_string()
}

// ----- durations -----

/// `30m`, `4h`, `1h30m`, `90s`: hours, minutes and seconds, each at most once and in that order. Not
/// zero.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0u64;
    // Units in order, each once: `1h30m`, not `30m1h` nor `1h1h`.
    let mut next_unit = 0;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit())?;
        if digits == 0 {
            return None;
        }
        let number: u64 = rest[..digits].parse().ok()?;
        let unit = rest[digits..].chars().next()?;
        let index = ['h', 'm', 's'].iter().position(|u| *u == unit)?;
        if index < next_unit {
            return None;
        }
        next_unit = index + 1;
        total = total.checked_add(number.checked_mul([3600, 60, 1][index])?)?;
        rest = &rest[digits + unit.len_utf8()..];
    }
    (total > 0).then(|| Duration::from_secs(total))
}

/// What a duration annotation accepts.
pub const DURATION_SYNTAX: &str =
    "use a duration such as 30s, 10m, 4h or 1h30m (hours, minutes, seconds), more than zero";

// ----- maintenance windows -----

/// What `maintenance-window` accepts, for messages.
pub const WINDOW_SYNTAX: &str = "use always, or one or more windows separated by ';', each \
    '<days> <HH:MM> <duration> <IANA time zone>' with days such as Mon-Fri, Sat,Sun, Mon,Wed-Fri \
    or daily and a duration such as 30m, 4h or 1h30m, e.g. 'Mon-Fri 22:00 4h Europe/Oslo; Sat,Sun \
    02:00 8h UTC'";

/// When nodes may start: always, or within one of the windows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MaintenanceWindows {
    /// `always`: no window (opts a cluster out of the operator's default).
    Always,
    Windows(Vec<Window>),
}

/// One window: on `days`, from `start` (local time in `zone`) for `duration`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Window {
    /// Monday first.
    pub days: [bool; 7],
    pub start: jiff::civil::Time,
    pub duration: Duration,
    pub zone: jiff::tz::TimeZone,
    /// As written (normalised spacing), for messages.
    text: String,
}

/// The next opening of a window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opening {
    pub at: Timestamp,
    /// The zone of the window that opens.
    pub zone: jiff::tz::TimeZone,
}

impl Opening {
    /// `2026-11-30 22:00 Europe/Oslo (2026-11-30 21:00:00 UTC)`.
    pub fn describe(&self) -> String {
        let local = self.at.to_zoned(self.zone.clone());
        let name = self.zone.iana_name().unwrap_or("UTC");
        format!(
            "{} {name} ({})",
            local.strftime("%a %Y-%m-%d %H:%M"),
            utc(self.at)
        )
    }
}

impl std::fmt::Display for MaintenanceWindows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaintenanceWindows::Always => f.write_str("always"),
            MaintenanceWindows::Windows(windows) => {
                let texts: Vec<&str> = windows.iter().map(|w| w.text.as_str()).collect();
                f.write_str(&texts.join("; "))
            }
        }
    }
}

impl MaintenanceWindows {
    /// Parses the annotation's (or flag's) value; `Err` is [`WINDOW_SYNTAX`] with what was wrong.
    pub fn parse(text: &str) -> Result<MaintenanceWindows, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("always") {
            return Ok(MaintenanceWindows::Always);
        }
        let windows = text
            .split(';')
            .map(str::trim)
            .filter(|part| !part.is_empty())
            .map(Window::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|what| format!("{what}; {WINDOW_SYNTAX}"))?;
        if windows.is_empty() {
            return Err(WINDOW_SYNTAX.to_string());
        }
        Ok(MaintenanceWindows::Windows(windows))
    }

    /// `None` when `now` is inside a window (or always); otherwise the next opening.
    pub fn next_opening(&self, now: Timestamp) -> Option<Opening> {
        let MaintenanceWindows::Windows(windows) = self else {
            return None;
        };
        let mut next: Option<Opening> = None;
        for window in windows {
            match window.around(now) {
                None => return None,
                Some(opening) if next.as_ref().is_none_or(|n| opening.at < n.at) => {
                    next = Some(opening);
                }
                Some(_) => {}
            }
        }
        next
    }
}

impl Window {
    fn parse(text: &str) -> Result<Window, String> {
        let parts: Vec<&str> = text.split_whitespace().collect();
        let [days, start, duration, zone] = parts[..] else {
            return Err(format!(
                "{text:?} is not '<days> <HH:MM> <duration> <time zone>'"
            ));
        };
        let days = parse_days(days).ok_or_else(|| format!("{days:?} are not days"))?;
        let start = parse_time(start).ok_or_else(|| format!("{start:?} is not a time HH:MM"))?;
        let duration =
            parse_duration(duration).ok_or_else(|| format!("{duration:?} is not a duration"))?;
        let zone = jiff::tz::TimeZone::get(zone)
            .map_err(|_| format!("{zone:?} is not an IANA time zone"))?;
        Ok(Window {
            days,
            start,
            duration,
            zone,
            text: parts.join(" "),
        })
    }

    /// `None` when `now` is inside this window, otherwise its next opening.
    fn around(&self, now: Timestamp) -> Option<Opening> {
        let today = now.to_zoned(self.zone.clone()).date();
        // Yesterday's window may still be open (one crossing midnight); a week and a day ahead
        // finds the next opening of any set of days.
        let mut next = None;
        for offset in -1i32..=8 {
            let Ok(date) = today.checked_add(jiff::Span::new().days(offset)) else {
                continue;
            };
            let weekday = date.weekday().to_monday_zero_offset() as usize;
            if !self.days[weekday] {
                continue;
            }
            // A start inside a DST gap moves forward, one in a fold takes the first: jiff's
            // compatible disambiguation, as cron-like schedules do.
            let Ok(opens) = date.to_datetime(self.start).to_zoned(self.zone.clone()) else {
                continue;
            };
            let opens = opens.timestamp();
            let Ok(closes) = opens.checked_add(self.duration) else {
                continue;
            };
            if opens <= now && now < closes {
                return None;
            }
            if opens > now && next.is_none() {
                next = Some(Opening {
                    at: opens,
                    zone: self.zone.clone(),
                });
            }
        }
        // Every window has a day, so there is always a next one.
        next
    }
}

fn parse_time(text: &str) -> Option<jiff::civil::Time> {
    let (hour, minute) = text.split_once(':')?;
    if hour.is_empty() || hour.len() > 2 || minute.len() != 2 {
        return None;
    }
    let hour: i8 = hour.parse().ok()?;
    let minute: i8 = minute.parse().ok()?;
    jiff::civil::Time::new(hour, minute, 0, 0).ok()
}

const DAYS: [&str; 7] = ["mon", "tue", "wed", "thu", "fri", "sat", "sun"];

fn parse_days(text: &str) -> Option<[bool; 7]> {
    if text.eq_ignore_ascii_case("daily") {
        return Some([true; 7]);
    }
    let day = |name: &str| {
        DAYS.iter()
            .position(|d| d.eq_ignore_ascii_case(name.trim()))
    };
    let mut days = [false; 7];
    for part in text.split(',') {
        match part.split_once('-') {
            Some((from, to)) => {
                let (from, to) = (day(from)?, day(to)?);
                // `Fri-Mon` wraps over the weekend.
                let mut d = from;
                loop {
                    days[d] = true;
                    if d == to {
                        break;
                    }
                    d = (d + 1) % 7;
                }
            }
            None => days[day(part)?] = true,
        }
    }
    Some(days)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clear_or_unconfigured_check_lets_the_run_go_on() {
        assert_eq!(ExternalCheck::NotConfigured.holding(), None);
        assert_eq!(ExternalCheck::Clear.holding(), None);
        let firing = ExternalCheck::Holding {
            message: "alert NodeDown is firing".to_string(),
        };
        assert_eq!(firing.holding(), Some("alert NodeDown is firing"));
        let unknown = ExternalCheck::Unknown {
            reason: "Prometheus at http://127.0.0.1:9090 did not answer".to_string(),
        };
        assert_eq!(
            unknown.holding(),
            Some("Prometheus at http://127.0.0.1:9090 did not answer")
        );
    }

    fn at(text: &str) -> Timestamp {
        text.parse().expect("timestamp")
    }

    #[test]
    fn durations() {
        let cases = [
            ("30m", Some(1800)),
            ("4h", Some(14_400)),
            ("1h30m", Some(5400)),
            ("2s", Some(2)),
            ("1h0m5s", Some(3605)),
            (" 90s ", Some(90)),
            ("0m", None),
            ("30", None),
            ("m", None),
            ("30m1h", None),
            ("1h1h", None),
            ("1d", None),
            ("-5m", None),
            ("", None),
        ];
        for (text, seconds) in cases {
            assert_eq!(
                parse_duration(text),
                seconds.map(Duration::from_secs),
                "{text:?}"
            );
        }
    }

    #[test]
    fn window_syntax() {
        let valid = [
            "always",
            "ALWAYS",
            "Mon-Fri 22:00 4h Europe/Oslo",
            "Mon-Fri 22:00 4h Europe/Oslo; Sat,Sun 02:00 8h UTC",
            "mon,wed-fri 9:30 1h30m America/New_York;",
            "daily 00:00 30m UTC",
            "Fri-Mon 23:00 2h UTC",
        ];
        for text in valid {
            assert!(MaintenanceWindows::parse(text).is_ok(), "{text:?}");
        }
        let invalid = [
            ("", "use always"),
            (
                "Mon-Fri 22:00 4h",
                "is not '<days> <HH:MM> <duration> <time zone>'",
            ),
            ("Mon-Fry 22:00 4h UTC", "\"Mon-Fry\" are not days"),
            ("Mon 25:00 4h UTC", "\"25:00\" is not a time HH:MM"),
            ("Mon 22:00 4 UTC", "\"4\" is not a duration"),
            (
                "Mon 22:00 4h Mars/Olympus",
                "\"Mars/Olympus\" is not an IANA time zone",
            ),
        ];
        for (text, why) in invalid {
            let error = MaintenanceWindows::parse(text).expect_err(text);
            assert!(error.contains(why), "{text:?}: {error}");
            assert!(
                error.contains("use always, or one or more windows"),
                "{error}"
            );
        }
    }

    /// Inside or not, and the next opening: windows crossing midnight, several windows, DST.
    #[test]
    fn next_opening() {
        let cases = [
            // 2026-11-30 is a Monday. Oslo is UTC+1 in winter.
            (
                "Mon-Fri 22:00 4h Europe/Oslo",
                "2026-11-30T20:59:00Z",
                Some("2026-11-30T21:00:00Z"),
            ),
            ("Mon-Fri 22:00 4h Europe/Oslo", "2026-11-30T21:00:00Z", None),
            // Friday's window crosses into Saturday 02:00 local.
            ("Mon-Fri 22:00 4h Europe/Oslo", "2026-12-05T00:59:00Z", None),
            (
                "Mon-Fri 22:00 4h Europe/Oslo",
                "2026-12-05T01:00:00Z",
                Some("2026-12-07T21:00:00Z"),
            ),
            // The earlier of two windows.
            (
                "Mon-Fri 22:00 4h Europe/Oslo; Sat,Sun 02:00 8h UTC",
                "2026-12-05T01:00:00Z",
                Some("2026-12-05T02:00:00Z"),
            ),
            ("daily 00:00 30m UTC", "2026-11-30T00:29:59Z", None),
            (
                "daily 00:00 30m UTC",
                "2026-11-30T00:30:00Z",
                Some("2026-12-01T00:00:00Z"),
            ),
            // Summer time: Oslo is UTC+2 on 2026-06-01 (a Monday).
            (
                "Mon 22:00 1h Europe/Oslo",
                "2026-06-01T19:00:00Z",
                Some("2026-06-01T20:00:00Z"),
            ),
            // DST starts 2026-03-29 in Oslo: 02:30 does not exist and moves forward to 03:30
            // (UTC+2), 01:30 UTC.
            (
                "Sun 02:30 1h Europe/Oslo",
                "2026-03-29T00:00:00Z",
                Some("2026-03-29T01:30:00Z"),
            ),
            ("always", "2026-03-29T00:00:00Z", None),
        ];
        for (windows, now, next) in cases {
            let windows = MaintenanceWindows::parse(windows).expect(windows);
            assert_eq!(
                windows.next_opening(at(now)).map(|o| o.at),
                next.map(at),
                "{windows} at {now}"
            );
        }
    }

    fn settings() -> GateSettings {
        GateSettings {
            maintenance_window: Some(
                MaintenanceWindows::parse("Mon-Fri 22:00 4h Europe/Oslo").expect("windows"),
            ),
            soak_after_node: Some(Duration::from_secs(600)),
            soak_after_control_planes: Some(Duration::from_secs(1800)),
            pause_after_nodes: NonZeroU32::new(1),
            ..GateSettings::default()
        }
    }

    /// The first gate that holds is shown: canary, window, soak, alerts, health checks.
    #[test]
    fn gates_hold_in_order() {
        let inside = at("2026-11-30T21:30:00Z");
        let outside = at("2026-11-30T12:00:00Z");
        let done = at("2026-11-30T21:25:00Z");
        let holding = RunGates {
            canary: Some(Canary::Holding {
                since: done,
                paused_seen: false,
            }),
            ..RunGates::default()
        };
        let progress = |gates: RunGates| RunProgress {
            done: 1,
            total: 5,
            upgraded: 1,
            last_done: Some(("worker-1".to_string(), done)),
            control_planes_done: None,
            gates,
        };
        let firing = GateObservation {
            alerts: ExternalCheck::Holding {
                message: "alert NodeDown is firing".into(),
            },
            health_checks: ExternalCheck::Unknown {
                reason: "the check cannot be evaluated".into(),
            },
            ..GateObservation::default()
        };
        let unhealthy = GateObservation {
            health_checks: firing.health_checks.clone(),
            ..GateObservation::default()
        };
        let forced = RunGates {
            force_started_at: Some(outside),
            ..RunGates::default()
        };
        let released = RunGates {
            canary: Some(Canary::Released { at: done }),
            ..RunGates::default()
        };
        let later = at("2026-11-30T21:36:00Z");
        let cases = [
            (
                holding.clone(),
                outside,
                &firing,
                Some((Gate::Canary, HoldReason::CanaryPause)),
                None,
            ),
            (
                released.clone(),
                outside,
                &firing,
                Some((Gate::MaintenanceWindow, HoldReason::OutsideWindow)),
                Some("2026-11-30T21:00:00Z"),
            ),
            // Forced: the window holds no more; the soak still does.
            (
                forced,
                outside,
                &firing,
                Some((Gate::Soak, HoldReason::SoakAfterNode)),
                Some("2026-11-30T21:35:00Z"),
            ),
            (
                released.clone(),
                inside,
                &firing,
                Some((Gate::Soak, HoldReason::SoakAfterNode)),
                Some("2026-11-30T21:35:00Z"),
            ),
            (
                released.clone(),
                later,
                &firing,
                Some((Gate::Alerts, HoldReason::CheckFailing)),
                None,
            ),
            (
                released.clone(),
                later,
                &unhealthy,
                Some((Gate::HealthChecks, HoldReason::CheckUnknown)),
                None,
            ),
            (released, later, &GateObservation::default(), None, None),
        ];
        for (i, (gates, now, observation, gate, until)) in cases.into_iter().enumerate() {
            let hold = hold_before_next_node(&settings(), observation, &progress(gates), now);
            assert_eq!(
                hold.as_ref().map(|h| (h.gate, h.reason)),
                gate,
                "case {i}: {hold:?}"
            );
            assert_eq!(hold.and_then(|h| h.until), until.map(at), "case {i}");
        }
    }

    #[test]
    fn hold_messages() {
        let now = at("2026-11-30T12:00:00Z");
        let window = window_hold(&settings(), &RunProgress::default(), now).expect("outside");
        assert_eq!(
            window.message,
            "outside the maintenance window (Mon-Fri 22:00 4h Europe/Oslo); the next opens at Mon \
             2026-11-30 22:00 Europe/Oslo (2026-11-30 21:00:00 UTC)"
        );
        let progress = RunProgress {
            last_done: Some(("worker-1".into(), now)),
            ..RunProgress::default()
        };
        let soak = soak_hold(&settings(), &progress, now).expect("soaking");
        assert_eq!(
            soak.message,
            "soaking after node worker-1 until 2026-11-30 12:10:00 UTC"
        );
        // After the control planes, the longer soak of the two is waited for.
        let progress = RunProgress {
            control_planes_done: Some(now),
            ..progress
        };
        let soak = soak_hold(&settings(), &progress, now).expect("soaking");
        assert_eq!(
            soak.message,
            "soaking after the control planes until 2026-11-30 12:30:00 UTC"
        );
        let canary = canary_hold(
            &settings(),
            &RunProgress {
                gates: RunGates {
                    canary: Some(Canary::Holding {
                        since: now,
                        paused_seen: false,
                    }),
                    ..RunGates::default()
                },
                ..RunProgress::default()
            },
        )
        .expect("canary");
        assert_eq!(
            canary.message,
            "the canary pause after 1 upgraded node: check the cluster, then set \
             upgrade.vitistack.io/resume to \"true\" (or set paused to \"true\" and remove it) to go on"
        );
    }

    /// The canary begins once, after N upgraded nodes; resume, or a pause seen and then lifted,
    /// releases it; released stays released.
    #[test]
    fn canary_steps() {
        let now = at("2026-11-30T12:00:00Z");
        let earlier = at("2026-11-30T11:00:00Z");
        let holding = |paused_seen| {
            Some(Canary::Holding {
                since: earlier,
                paused_seen,
            })
        };
        let released = Some(Canary::Released { at: now });
        let resume = GateSettings {
            resume: true,
            ..settings()
        };
        let none = GateSettings::default();
        // (settings, state, upgraded, paused now, next)
        let cases = [
            (&none, None, 3, false, None),
            (&settings(), None, 0, false, None),
            (
                &settings(),
                None,
                1,
                false,
                Some(Canary::Holding {
                    since: now,
                    paused_seen: false,
                }),
            ),
            // Paused when it begins: unpausing releases it.
            (
                &settings(),
                None,
                1,
                true,
                Some(Canary::Holding {
                    since: now,
                    paused_seen: true,
                }),
            ),
            (&settings(), holding(false), 1, false, holding(false)),
            (&settings(), holding(false), 1, true, holding(true)),
            (&settings(), holding(true), 1, true, holding(true)),
            (&settings(), holding(true), 1, false, released),
            (&resume, holding(false), 1, false, released),
            (&settings(), released, 4, false, released),
        ];
        for (i, (settings, state, upgraded, paused, next)) in cases.into_iter().enumerate() {
            assert_eq!(
                canary_step(settings, state, upgraded, paused, now),
                next,
                "case {i}"
            );
        }
    }

    #[test]
    fn run_gates_round_trip_and_stay_out_of_old_records() {
        assert_eq!(
            serde_json::to_value(RunGates::default()).expect("json"),
            serde_json::json!({})
        );
        let gates = RunGates {
            force_started_at: Some(at("2026-11-30T12:00:00Z")),
            canary: Some(Canary::Holding {
                since: at("2026-11-30T12:00:00Z"),
                paused_seen: true,
            }),
            held: ["worker-2".to_string()].into(),
            skipped: ["worker-2".to_string()].into(),
            prepull: Default::default(),
            etcd_snapshot: None,
        };
        let json = serde_json::to_value(&gates).expect("json");
        assert_eq!(json["canary"]["state"], "holding");
        assert_eq!(json["canary"]["pausedSeen"], true);
        assert_eq!(
            serde_json::from_value::<RunGates>(json).expect("back"),
            gates
        );
    }

    #[test]
    fn every_gate_has_its_own_name() {
        let names: BTreeSet<&str> = Gate::ALL.iter().map(|gate| gate.as_str()).collect();
        assert_eq!(names.len(), Gate::ALL.len());
    }
}
