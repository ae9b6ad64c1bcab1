//! Alertmanager silences during a Talos run (issue #23 item 2): the pure part. Which silences a
//! cluster wants now, how the controller recognises its own among everything Alertmanager holds, and
//! what to change (create, extend, expire) to get from what exists to what is wanted.
//!
//! The shell (`src/silences.rs`) lists Alertmanager's silences, hands the cluster's own to [`plan`]
//! with [`wanted`], and makes the changes. A silence is a courtesy: nothing here ever holds or fails a
//! run.
//!
//! - **What is silenced**: alerts whose node label (`--silence-node-label`, default `node`) names a
//!   node of the run, and that match the operator's extra matchers (`--silence-matchers`, e.g.
//!   `cluster="{clusterId}"`, to keep one cluster's silence off another cluster's node of the same
//!   name). Per cluster, `upgrade.vitistack.io/alert-silences` says how: `node` (one silence per node
//!   in flight, from the reconcile that starts it until it is done), `run` (one silence for all the
//!   run's nodes, from the run's start until its end), `off`.
//! - **How long**: each silence ends [`SILENCE_FOR`] after it was last written and is extended once
//!   less than [`EXTEND_BEFORE`] is left, so a controller that stops (or loses Alertmanager) leaves
//!   nothing silenced for longer than 15 minutes.
//! - **Whose**: `createdBy` is [`CREATED_BY`] and the comment ends with key=value words naming the
//!   cluster (namespace/name and uid), the run and the scope ([`SilenceKey`]); after a restart the
//!   controller finds its silences by them, reuses the ones it still wants and expires the others.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use jiff::Timestamp;

use crate::holds::Canary;
use crate::run::Outcome;
use crate::talos::{NodeStep, Run};

/// `createdBy` of every silence the controller makes.
pub const CREATED_BY: &str = "talos-upgrade-controller";
/// A silence ends this long after it was created or last extended.
pub const SILENCE_FOR: Duration = Duration::from_secs(15 * 60);
/// A silence with less than this left is extended (to [`SILENCE_FOR`] from now): a reconcile comes
/// at least every idle interval while a run goes on, and far more often while a node is in flight.
pub const EXTEND_BEFORE: Duration = Duration::from_secs(5 * 60);
/// The alert label that names a node when `--silence-node-label` is not given (kube-state-metrics'
/// and kube-prometheus' node alerts carry it).
pub const DEFAULT_NODE_LABEL: &str = "node";
/// What the annotation accepts, in every error about it.
pub const MODES: &str = "use off, node (one silence per node being upgraded) or run (one silence \
     for all the run's nodes while the run goes on)";

/// A cluster's silences, from `upgrade.vitistack.io/alert-silences` (absent: `node` when
/// `--alertmanager-url` is set, nothing otherwise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SilenceMode {
    Off,
    /// One silence per node in flight.
    Node,
    /// One silence for every node of the run while it goes on.
    Run,
}

impl SilenceMode {
    /// The annotation's value (trimmed, not empty); `Err` is the reason.
    pub fn parse(text: &str) -> Result<SilenceMode, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" => Ok(SilenceMode::Off),
            "node" => Ok(SilenceMode::Node),
            "run" => Ok(SilenceMode::Run),
            _ => Err(MODES.to_string()),
        }
    }

    /// The mode of a cluster whose annotation is `annotation` (`None`: absent): `node` by default.
    pub fn or_default(annotation: Option<SilenceMode>) -> SilenceMode {
        annotation.unwrap_or(SilenceMode::Node)
    }
}

/// One matcher of a silence, as Alertmanager's API v2 has it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Matcher {
    pub name: String,
    pub value: String,
    pub is_regex: bool,
    /// `false`: `!=` or `!~`.
    pub is_equal: bool,
}

impl Matcher {
    fn op(&self) -> &'static str {
        match (self.is_equal, self.is_regex) {
            (true, false) => "=",
            (false, false) => "!=",
            (true, true) => "=~",
            (false, true) => "!~",
        }
    }
}

impl fmt::Display for Matcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{:?}", self.name, self.op(), self.value)
    }
}

/// Matchers as `{a="x", b=~"y"}`, for Events and logs.
pub fn show(matchers: &[Matcher]) -> String {
    let inner: Vec<String> = matchers.iter().map(Matcher::to_string).collect();
    format!("{{{}}}", inner.join(", "))
}

/// What the placeholders of `--silence-matchers` are replaced by.
#[derive(Debug, Clone, Copy)]
pub struct ClusterNames<'a> {
    pub namespace: &'a str,
    pub cluster: &'a str,
    /// `spec.data.clusterId`, or the name without one.
    pub cluster_id: &'a str,
}

/// The operator's settings of the silences (flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SilenceConfig {
    /// The alert label that names a node (`--silence-node-label`).
    pub node_label: String,
    /// Matchers added to every silence (`--silence-matchers`), with `{namespace}`, `{cluster}` and
    /// `{clusterId}` placeholders in their values.
    pub extra: Vec<Matcher>,
}

impl Default for SilenceConfig {
    fn default() -> Self {
        SilenceConfig {
            node_label: DEFAULT_NODE_LABEL.to_string(),
            extra: Vec::new(),
        }
    }
}

impl SilenceConfig {
    /// `--silence-node-label`: a Prometheus label name.
    pub fn parse_node_label(text: &str) -> Result<String, String> {
        let text = text.trim();
        if is_label_name(text) {
            Ok(text.to_string())
        } else {
            Err(format!(
                "{text:?} is not a label name (letters, digits and '_', not starting with a digit)"
            ))
        }
    }

    /// `--silence-matchers`: `name op "value"` separated by commas, optionally in braces; ops `=`,
    /// `!=`, `=~`, `!~`; values in double quotes with `\"` and `\\` escapes. Empty: none.
    pub fn parse_matchers(text: &str) -> Result<Vec<Matcher>, String> {
        let text = text.trim();
        let inner = match text.strip_prefix('{') {
            Some(rest) => rest
                .strip_suffix('}')
                .ok_or_else(|| format!("{text:?} opens a brace it does not close"))?,
            None => text,
        };
        let mut matchers = Vec::new();
        let mut rest = inner.trim_start();
        while !rest.is_empty() {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            if !is_label_name(name) {
                return Err(format!("expected a label name at {rest:?}"));
            }
            rest = rest[end..].trim_start();
            let (op, is_equal, is_regex) = [
                ("=~", true, true),
                ("!~", false, true),
                ("!=", false, false),
                ("=", true, false),
            ]
            .into_iter()
            .find(|(op, ..)| rest.starts_with(op))
            .ok_or_else(|| format!("expected =, !=, =~ or !~ after {name:?}"))?;
            rest = rest[op.len()..].trim_start();
            let (value, after) = quoted(rest)
                .ok_or_else(|| format!("the value of {name:?} must be a double-quoted string"))?;
            matchers.push(Matcher {
                name: name.to_string(),
                value,
                is_regex,
                is_equal,
            });
            rest = after.trim_start();
            match rest.strip_prefix(',') {
                Some(after) => rest = after.trim_start(),
                None if rest.is_empty() => {}
                None => return Err(format!("expected ',' at {rest:?}")),
            }
        }
        Ok(matchers)
    }

    /// The matchers of a silence of `nodes` (sorted, not empty) on `cluster`.
    fn matchers(&self, nodes: &BTreeSet<&str>, cluster: &ClusterNames<'_>) -> Vec<Matcher> {
        let node = if nodes.len() == 1 {
            Matcher {
                name: self.node_label.clone(),
                value: nodes
                    .iter()
                    .next()
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
                is_regex: false,
                is_equal: true,
            }
        } else {
            // Alertmanager anchors a regular expression at both ends.
            let alternatives: Vec<String> = nodes.iter().map(|n| regex_escape(n)).collect();
            Matcher {
                name: self.node_label.clone(),
                value: alternatives.join("|"),
                is_regex: true,
                is_equal: true,
            }
        };
        let mut matchers = vec![node];
        matchers.extend(self.extra.iter().map(|extra| {
            let fill = |text: &str| {
                if extra.is_regex {
                    regex_escape(text)
                } else {
                    text.to_string()
                }
            };
            Matcher {
                value: extra
                    .value
                    .replace("{namespace}", &fill(cluster.namespace))
                    .replace("{clusterId}", &fill(cluster.cluster_id))
                    .replace("{cluster}", &fill(cluster.cluster)),
                ..extra.clone()
            }
        }));
        matchers
    }
}

fn is_label_name(text: &str) -> bool {
    !text.is_empty()
        && !text.starts_with(|c: char| c.is_ascii_digit())
        && text.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A double-quoted string at the start of `text`: its value and what follows.
fn quoted(text: &str) -> Option<(String, &str)> {
    let body = text.strip_prefix('"')?;
    let mut value = String::new();
    let mut escaped = false;
    for (at, c) in body.char_indices() {
        match c {
            _ if escaped => {
                value.push(c);
                escaped = false;
            }
            '\\' => escaped = true,
            '"' => return Some((value, &body[at + 1..])),
            c => value.push(c),
        }
    }
    None
}

/// `text` as a regular expression matching exactly it (RE2 syntax, Alertmanager's).
fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// What a silence covers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    /// One node in flight (`node` mode).
    Node(String),
    /// Every node of the run (`run` mode).
    Run,
}

/// Which silence of the controller's this is: the cluster (namespace, name, uid), the run and the
/// scope, written at the end of its comment as `cluster=<ns>/<name> uid=<uid> run=<id> scope=<...>`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SilenceKey {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// [`run_id`] of the run it was made for.
    pub run: String,
    pub scope: Scope,
}

impl SilenceKey {
    /// The silence's comment: a sentence for a person, then the words the controller finds it by.
    pub fn comment(&self) -> String {
        let (what, scope) = match &self.scope {
            Scope::Node(node) => (format!("node {node}"), format!("node:{node}")),
            Scope::Run => ("its nodes".to_string(), "run".to_string()),
        };
        format!(
            "Talos upgrade of {what} of cluster {}/{} by {CREATED_BY}; expired when it is done. \
             cluster={}/{} uid={} run={} scope={scope}",
            self.namespace, self.name, self.namespace, self.name, self.uid, self.run
        )
    }

    /// The key in a silence's comment, if the controller wrote it (with `created_by` =
    /// [`CREATED_BY`]).
    pub fn parse(created_by: &str, comment: &str) -> Option<SilenceKey> {
        if created_by != CREATED_BY {
            return None;
        }
        let word = |key: &str| {
            comment
                .split_whitespace()
                .rev()
                .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))
        };
        let (namespace, name) = word("cluster")?.split_once('/')?;
        let scope = match word("scope")? {
            "run" => Scope::Run,
            other => Scope::Node(other.strip_prefix("node:")?.to_string()),
        };
        Some(SilenceKey {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: word("uid")?.to_string(),
            run: word("run")?.to_string(),
            scope,
        })
    }
}

/// A run's identity in its silences: its target and when it started (`1.12.0@2026-11-28T12:00:00Z`).
pub fn run_id(run: &Run) -> String {
    format!("{}@{}", run.target, run.started_at)
}

/// The cluster as its silences name it.
#[derive(Debug, Clone, Copy)]
pub struct ClusterIdentity<'a> {
    pub names: ClusterNames<'a>,
    pub uid: &'a str,
}

/// What the silences of a cluster are decided from, as the reconcile left it.
#[derive(Debug, Clone, Copy)]
pub struct RunView<'a> {
    /// The cluster's Talos run record (`None`: no run, or it was forgotten: reset, target removed).
    pub run: Option<&'a Run>,
    /// The Talos target annotation, trimmed (`None`: absent).
    pub requested: Option<&'a str>,
    /// The `paused` annotation.
    pub paused: bool,
}

/// One silence the cluster wants now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    pub key: SilenceKey,
    pub matchers: Vec<Matcher>,
}

/// The silences `cluster` wants now in `mode`:
///
/// - `node`: one per node in flight of a run without an outcome (a run being stopped, paused or
///   resumed included: its nodes in flight still reboot);
/// - `run`: one for every node of a run that goes on (no outcome, its target still asked for, and not
///   waiting for a person: paused, or the canary holding, with no node in flight); a run that stops
///   with nodes in flight keeps one silence per node in flight until they are done;
/// - `off`: none.
pub fn wanted(
    mode: SilenceMode,
    config: &SilenceConfig,
    cluster: &ClusterIdentity<'_>,
    view: &RunView<'_>,
) -> Vec<Wanted> {
    let Some(run) = view.run.filter(|run| run.outcome.is_none()) else {
        return Vec::new();
    };
    let key = |scope| SilenceKey {
        namespace: cluster.names.namespace.to_string(),
        name: cluster.names.cluster.to_string(),
        uid: cluster.uid.to_string(),
        run: run_id(run),
        scope,
    };
    let in_flight: BTreeSet<&str> = run
        .nodes
        .iter()
        .filter(|node| matches!(node.step, NodeStep::Issued { .. }))
        .map(|node| node.name.as_str())
        .collect();
    let per_node = || {
        in_flight
            .iter()
            .map(|node| Wanted {
                key: key(Scope::Node(node.to_string())),
                matchers: config.matchers(&BTreeSet::from([*node]), &cluster.names),
            })
            .collect()
    };
    match mode {
        SilenceMode::Off => Vec::new(),
        SilenceMode::Node => per_node(),
        SilenceMode::Run => {
            let asked = view.requested == Some(run.requested.as_str());
            let waits_for_a_person = in_flight.is_empty()
                && (view.paused || matches!(run.gates.canary, Some(Canary::Holding { .. })));
            if asked && !waits_for_a_person {
                let nodes: BTreeSet<&str> = run.nodes.iter().map(|n| n.name.as_str()).collect();
                if nodes.is_empty() {
                    return Vec::new();
                }
                vec![Wanted {
                    key: key(Scope::Run),
                    matchers: config.matchers(&nodes, &cluster.names),
                }]
            } else {
                per_node()
            }
        }
    }
}

/// One of the cluster's silences as Alertmanager holds it (active or pending, never expired).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Existing {
    pub id: String,
    pub key: SilenceKey,
    pub matchers: Vec<Matcher>,
    pub starts_at: Timestamp,
    pub ends_at: Timestamp,
}

/// A change to make in Alertmanager.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Create {
        wanted: Wanted,
        starts_at: Timestamp,
        ends_at: Timestamp,
    },
    /// Written again under its id with its own `startsAt` (Alertmanager updates an active silence in
    /// place only when its matchers and `startsAt` are unchanged).
    Extend {
        id: String,
        wanted: Wanted,
        starts_at: Timestamp,
        ends_at: Timestamp,
    },
    Expire {
        existing: Existing,
    },
}

/// What to change so that Alertmanager holds exactly `wanted` of the cluster's silences: an existing
/// silence with a wanted key and the same matchers is kept (extended once less than
/// [`EXTEND_BEFORE`] is left), the first of duplicates only; every other one is expired; a wanted
/// silence without one is created. Expiries come first.
pub fn plan(wanted: &[Wanted], existing: &[Existing], now: Timestamp) -> Vec<Change> {
    let until = now + signed(SILENCE_FOR);
    let mut taken = vec![false; wanted.len()];
    let mut expire = Vec::new();
    let mut extend = Vec::new();
    let mut sorted: Vec<&Existing> = existing.iter().collect();
    // The one kept among duplicates: the one that lasts longest, then by id (stable).
    sorted.sort_by(|a, b| b.ends_at.cmp(&a.ends_at).then_with(|| a.id.cmp(&b.id)));
    for silence in sorted {
        let matching = wanted
            .iter()
            .enumerate()
            .find(|(at, w)| !taken[*at] && w.key == silence.key && w.matchers == silence.matchers);
        match matching {
            Some((at, w)) => {
                taken[at] = true;
                if silence.ends_at.duration_since(now) < signed(EXTEND_BEFORE) {
                    extend.push(Change::Extend {
                        id: silence.id.clone(),
                        wanted: w.clone(),
                        starts_at: silence.starts_at,
                        ends_at: until,
                    });
                }
            }
            None => expire.push(Change::Expire {
                existing: silence.clone(),
            }),
        }
    }
    let create = wanted
        .iter()
        .zip(taken)
        .filter(|(_, taken)| !taken)
        .map(|(w, _)| Change::Create {
            wanted: w.clone(),
            starts_at: now,
            ends_at: until,
        });
    expire.into_iter().chain(extend).chain(create).collect()
}

fn signed(duration: Duration) -> jiff::SignedDuration {
    jiff::SignedDuration::try_from(duration).unwrap_or(jiff::SignedDuration::MAX)
}

/// Why a silence is expired, as the end of the `SilenceExpired` Event's sentence.
pub fn why_expired(key: &SilenceKey, mode: SilenceMode, uid: &str, view: &RunView<'_>) -> String {
    if key.uid != uid {
        return "it belongs to an earlier cluster of the same name".to_string();
    }
    let Some(run) = view.run.filter(|run| run_id(run) == key.run) else {
        return "its run ended (reset, target removed or replaced by another run)".to_string();
    };
    match &run.outcome {
        Some(Outcome::Completed { .. }) => return "the run completed".to_string(),
        Some(Outcome::Failed { .. }) => return "the run failed".to_string(),
        None => {}
    }
    if mode == SilenceMode::Off {
        return "the cluster's alert-silences annotation is off".to_string();
    }
    match &key.scope {
        Scope::Node(node) => match run.node(node).map(|n| &n.step) {
            Some(NodeStep::Done { .. }) => format!("node {node} is upgraded"),
            Some(NodeStep::Failed { .. }) => format!("node {node} failed"),
            _ => format!("node {node} is no longer being upgraded"),
        },
        Scope::Run if view.requested != Some(run.requested.as_str()) => {
            "the run's target was removed or changed".to_string()
        }
        Scope::Run if view.paused => "the run is paused".to_string(),
        Scope::Run => "the run waits for a person or its nodes changed".to_string(),
    }
}

#[cfg(test)]
mod tests;
