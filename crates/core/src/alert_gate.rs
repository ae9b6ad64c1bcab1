//! The alert gate (issue #23): before each node, and before a run starts, Prometheus is asked whether
//! alerts that should stop an upgrade are firing; the run holds while they are.
//!
//! Pure: what the per-cluster annotation `upgrade.vitistack.io/alert-gate` asks for ([`AlertGate`]),
//! the operator-wide selector ([`Selector`]), the PromQL the shell sends ([`query`]), and from
//! Prometheus's answer which alerts hold and the sentence that says so ([`verdict`]). The shell
//! (`src/holds/alerts.rs`) only sends the queries and hands the answers back.
//!
//! Alerts the upgrade itself causes never hold it ([`upgrade_nodes`], [`OWN_ALERTS`]): a node being
//! rebooted goes NotReady and its exporters go away, and holding the run on that would hold it forever
//! after the first node.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use jiff::Timestamp;

use crate::talos::{NodeStep, Run};

/// The operator-wide selector when `--alert-selector` is not given: only critical alerts stop an
/// upgrade. Warnings are too common in real clusters to hold every upgrade on them by default.
pub const DEFAULT_SELECTOR: &str = r#"{severity="critical"}"#;

/// How long after a node of this run is done the alerts that name it are still taken as the
/// upgrade's own. A rebooted node's alerts do not end the moment it is back: rules over `rate(...[5m])`
/// windows, `for:` durations being reset, `keep_firing_for`, and a scrape or two before the exporters
/// answer again. Ten minutes covers the common 5-minute windows twice; an alert on the node that is
/// still firing after that is not the reboot's any more, and holds.
pub const RECENT_NODE_GRACE: Duration = Duration::from_secs(10 * 60);

/// The alerts of the controller's own PrometheusRule (deploy/monitoring.yaml): they fire *because* of
/// an upgrade (failed, stuck, a slow node, the controller not scraped) and must never hold one — a
/// held run that fires "stuck" would otherwise hold itself. A test checks the list against the file.
pub const OWN_ALERTS: [&str; 4] = [
    "KubernetesClusterUpgradeFailed",
    "KubernetesClusterUpgradeStuck",
    "KubernetesClusterNodeUpgradeSlow",
    "TalosUpgradeControllerAbsent",
];

/// The labels through which an alert names a node: kube-state-metrics and node-exporter alerts
/// (`node`, `nodename`, `kubernetes_node`), relabelled ones (`exported_node`) and scrape targets
/// (`instance`, whose host part is compared, without the port).
pub const NODE_LABELS: [&str; 5] = [
    "node",
    "nodename",
    "kubernetes_node",
    "exported_node",
    "instance",
];

/// How many alert names a hold message lists before "and N more".
pub const LISTED: usize = 3;

/// What the annotation says the accepted forms are, in every error about it.
pub const FORMS: &str = "use off, alerts: <AlertName>, <AlertName>..., a label selector such as \
     {severity=~\"critical|warning\", team=\"storage\"}, or promql: <expression that must return nothing>";

/// A cluster's alert gate, from `upgrade.vitistack.io/alert-gate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AlertGate {
    /// `off`: this cluster is never held on alerts.
    Off,
    /// `alerts: NodeDown, EtcdNoLeader`: the operator-wide selector, narrowed to these alert names.
    Names(Vec<String>),
    /// `{severity=~"critical|warning", team="storage"}`: replaces the operator-wide selector.
    Selector(Selector),
    /// `promql: <expression>`: an instant query that must return nothing; every series it returns holds.
    Promql(String),
}

impl AlertGate {
    /// The annotation's value (trimmed, not empty). `Err` is the reason, for an [`crate::intent::InvalidOption`].
    pub fn parse(text: &str) -> Result<AlertGate, String> {
        let text = text.trim();
        if text.eq_ignore_ascii_case("off") {
            return Ok(AlertGate::Off);
        }
        if let Some(names) = strip_keyword(text, "alerts:") {
            let names: Vec<String> = names
                .split(',')
                .map(str::trim)
                .filter(|name| !name.is_empty())
                .map(str::to_string)
                .collect();
            if names.is_empty() {
                return Err(format!("alerts: lists no alert name; {FORMS}"));
            }
            if let Some(bad) = names.iter().find(|name| !is_alert_name(name)) {
                return Err(format!(
                    "{bad:?} is not an alert name (letters, digits, '_' and ':', not starting with a \
                     digit); {FORMS}"
                ));
            }
            let mut names = names;
            names.sort();
            names.dedup();
            return Ok(AlertGate::Names(names));
        }
        if let Some(expression) = strip_keyword(text, "promql:") {
            let expression = expression.trim();
            if expression.is_empty() {
                return Err(format!("promql: has no expression; {FORMS}"));
            }
            check_balanced(expression).map_err(|problem| format!("{problem}; {FORMS}"))?;
            return Ok(AlertGate::Promql(expression.to_string()));
        }
        if text.starts_with('{') {
            return Selector::parse(text)
                .map(AlertGate::Selector)
                .map_err(|problem| format!("{problem}; {FORMS}"));
        }
        Err(FORMS.to_string())
    }
}

/// `keyword` at the start of `text`, ASCII case-insensitively; the rest.
fn strip_keyword<'a>(text: &'a str, keyword: &str) -> Option<&'a str> {
    let head = text.get(..keyword.len())?;
    head.eq_ignore_ascii_case(keyword)
        .then(|| &text[keyword.len()..])
}

/// Prometheus's classic metric name syntax, which alert names follow. Also what keeps the names safe to
/// join into one regular expression: none of them has a character special to it.
fn is_alert_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// A PromQL label selector, `{name op "value", ...}`, checked and kept as its matchers (without the
/// braces), each written back as `name op value` with the value as quoted by the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    matchers: Vec<String>,
}

impl Selector {
    /// The operator-wide default, [`DEFAULT_SELECTOR`].
    pub fn default_selector() -> Selector {
        Selector::parse(DEFAULT_SELECTOR).expect("the default selector parses")
    }

    /// `{}` (every alert), or matchers `label op "value"` separated by commas; ops `=`, `!=`, `=~`,
    /// `!~`; values in double quotes (with backslash escapes), single quotes or backticks. Regular
    /// expressions are left to Prometheus, which says what is wrong with one.
    pub fn parse(text: &str) -> Result<Selector, String> {
        let text = text.trim();
        let inner = text
            .strip_prefix('{')
            .and_then(|rest| rest.strip_suffix('}'))
            .ok_or_else(|| format!("{text:?} is not a label selector in braces"))?;
        let mut matchers = Vec::new();
        let mut rest = inner.trim_start();
        while !rest.is_empty() {
            let name_end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..name_end];
            if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
                return Err(format!("expected a label name at {rest:?}"));
            }
            rest = rest[name_end..].trim_start();
            let op = ["=~", "!~", "!=", "="]
                .into_iter()
                .find(|op| rest.starts_with(op))
                .ok_or_else(|| format!("expected =, !=, =~ or !~ after {name:?}"))?;
            rest = rest[op.len()..].trim_start();
            let value_len = quoted_len(rest)
                .ok_or_else(|| format!("the value of {name:?} must be a quoted string"))?;
            matchers.push(format!("{name}{op}{}", &rest[..value_len]));
            rest = rest[value_len..].trim_start();
            match rest.strip_prefix(',') {
                Some(after) => rest = after.trim_start(),
                None if rest.is_empty() => {}
                None => return Err(format!("expected ',' or '}}' at {rest:?}")),
            }
        }
        Ok(Selector { matchers })
    }

    /// The matchers, comma-separated, without braces.
    fn inner(&self) -> String {
        self.matchers.join(",")
    }
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{{{}}}", self.inner())
    }
}

/// The length of the quoted string at the start of `text`, quotes included.
fn quoted_len(text: &str) -> Option<usize> {
    let quote = text
        .chars()
        .next()
        .filter(|c| matches!(c, '"' | '\'' | '`'))?;
    let mut escaped = false;
    for (at, c) in text.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            // Backticks are raw strings in PromQL: no escapes.
            '\\' if quote != '`' => escaped = true,
            c if c == quote => return Some(at + 1),
            _ => {}
        }
    }
    None
}

/// Brackets balanced and strings closed: a cheap check that catches a truncated or mistyped expression
/// at the annotation, where it is reported as the annotation's fault, instead of as a query error.
fn check_balanced(expression: &str) -> Result<(), String> {
    let mut open = Vec::new();
    let mut rest = expression;
    while let Some(c) = rest.chars().next() {
        if matches!(c, '"' | '\'' | '`') {
            let len = quoted_len(rest).ok_or("a string in the expression is not closed")?;
            rest = &rest[len..];
            continue;
        }
        match c {
            '(' | '[' | '{' => open.push(c),
            ')' | ']' | '}' => {
                let expected = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                if open.pop() != Some(expected) {
                    return Err(format!("the expression has an unmatched {c:?}"));
                }
            }
            _ => {}
        }
        rest = &rest[c.len_utf8()..];
    }
    match open.last() {
        Some(c) => Err(format!("the expression has an unclosed {c:?}")),
        None => Ok(()),
    }
}

/// What `{namespace}`, `{cluster}` and `{clusterId}` stand for in selectors and expressions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClusterNames<'a> {
    pub namespace: &'a str,
    pub cluster: &'a str,
    pub cluster_id: &'a str,
}

impl ClusterNames<'_> {
    /// `text` with the placeholders replaced. The values are escaped for a PromQL string (the
    /// placeholders stand inside quoted label values), so a cluster id with a quote in it cannot change
    /// the query's meaning.
    pub fn fill(&self, text: &str) -> String {
        let escape = |value: &str| value.replace('\\', "\\\\").replace('"', "\\\"");
        text.replace("{namespace}", &escape(self.namespace))
            .replace("{clusterId}", &escape(self.cluster_id))
            .replace("{cluster}", &escape(self.cluster))
    }
}

/// What to ask Prometheus for one cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Query {
    /// The alerts a selector picks: `firing` (the `ALERTS` series of firing alerts: what holds) and
    /// `since` (their `ALERTS_FOR_STATE` series, whose values are the times they became active: what
    /// the message says "since"). Two queries, because what holds must not depend on the second: an
    /// alert without its `ALERTS_FOR_STATE` (not restored yet, not federated) still holds, "since"
    /// unknown.
    Alerts { firing: String, since: String },
    /// `promql:`: the expression as given, placeholders filled.
    Promql(String),
}

/// The queries for a cluster's gate (`None` when its annotation says `off`). `annotation` is the
/// cluster's parsed `alert-gate` (`None`: not set), `default` the operator-wide selector.
pub fn query(
    annotation: Option<&AlertGate>,
    default: &Selector,
    cluster: &ClusterNames,
) -> Option<Query> {
    let matchers = match annotation {
        Some(AlertGate::Off) => return None,
        Some(AlertGate::Promql(expression)) => {
            return Some(Query::Promql(cluster.fill(expression)));
        }
        None => default.inner(),
        Some(AlertGate::Selector(selector)) => selector.inner(),
        // Alert names cannot hold regex metacharacters (see `is_alert_name`): joined as they are.
        Some(AlertGate::Names(names)) => {
            let names = format!("alertname=~\"{}\"", names.join("|"));
            match default.inner() {
                inner if inner.is_empty() => names,
                inner => format!("{inner},{names}"),
            }
        }
    };
    let matchers = cluster.fill(&matchers);
    let extra = if matchers.is_empty() {
        String::new()
    } else {
        format!(",{matchers}")
    };
    Some(Query::Alerts {
        firing: format!("ALERTS{{alertstate=\"firing\"{extra}}}"),
        since: format!("ALERTS_FOR_STATE{{{matchers}}}"),
    })
}

/// One series of an instant-vector answer: its labels (`__name__` included when Prometheus gives it)
/// and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// What Prometheus answered to a [`Query`].
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Alerts {
        firing: Vec<Series>,
        since: Vec<Series>,
    },
    Promql {
        expression: String,
        series: Vec<Series>,
    },
}

/// The nodes whose alerts are the upgrade's own now: the run's nodes in flight, and those it upgraded
/// that were done less than [`RECENT_NODE_GRACE`] ago. Nodes that were already on the target when the
/// run started were not touched by it, and are not among them.
pub fn upgrade_nodes(run: Option<&Run>, now: Timestamp) -> BTreeSet<String> {
    let Some(run) = run else {
        return BTreeSet::new();
    };
    let grace = jiff::SignedDuration::try_from(RECENT_NODE_GRACE).unwrap_or_default();
    run.nodes
        .iter()
        .filter(|node| match &node.step {
            NodeStep::Issued { .. } => true,
            NodeStep::Done {
                at,
                started_at: Some(_),
            } => now.duration_since(*at) < grace,
            NodeStep::Done {
                started_at: None, ..
            }
            | NodeStep::Pending
            | NodeStep::Failed { .. } => false,
        })
        .map(|node| node.name.clone())
        .collect()
}

/// Whether the series is the upgrade's own: one of the controller's alerts, or naming one of `nodes`.
fn caused_by_upgrade(labels: &BTreeMap<String, String>, nodes: &BTreeSet<String>) -> bool {
    if labels
        .get("alertname")
        .is_some_and(|name| OWN_ALERTS.contains(&name.as_str()))
    {
        return true;
    }
    NODE_LABELS.iter().any(|label| {
        labels.get(*label).is_some_and(|value| {
            let value = if *label == "instance" {
                instance_host(value)
            } else {
                value
            };
            nodes.contains(value)
        })
    })
}

/// The host of an `instance` label: `host:port`, `[v6]:port`, or a bare host.
fn instance_host(instance: &str) -> &str {
    if let Some(rest) = instance.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match instance.rsplit_once(':') {
        // One colon: host:port. More than one, unbracketed: an IPv6 address without a port.
        Some((host, port)) if !host.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            host
        }
        _ => instance,
    }
}

/// The hold message for `answer`, or `None` when nothing holds. `nodes` are the upgrade's own
/// ([`upgrade_nodes`]); their alerts, and the controller's own, are left out.
pub fn verdict(answer: &Answer, nodes: &BTreeSet<String>) -> Option<String> {
    match answer {
        Answer::Alerts { firing, since } => {
            // alert name -> the earliest activeAt among its series that hold (None: not known).
            let mut holding: BTreeMap<&str, Option<f64>> = BTreeMap::new();
            for series in firing
                .iter()
                .filter(|s| !caused_by_upgrade(&s.labels, nodes))
            {
                let name = series
                    .labels
                    .get("alertname")
                    .map_or("(unnamed alert)", String::as_str);
                let at = since
                    .iter()
                    .find(|s| same_alert(&s.labels, &series.labels))
                    .map(|s| s.value)
                    .filter(|at| at.is_finite() && *at > 0.0);
                let entry = holding.entry(name).or_insert(at);
                *entry = match (*entry, at) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (known, None) | (None, known) => known,
                };
            }
            let described: Vec<String> = holding
                .into_iter()
                .map(|(name, at)| match at.and_then(as_timestamp) {
                    Some(at) => format!("{name} (since {at})"),
                    None => format!("{name} (since an unknown time)"),
                })
                .collect();
            (!described.is_empty()).then(|| format!("alerts firing: {}", listed(described)))
        }
        Answer::Promql { expression, series } => {
            let described: BTreeSet<String> = series
                .iter()
                .filter(|s| !caused_by_upgrade(&s.labels, nodes))
                .map(|s| describe_series(&s.labels))
                .collect();
            (!described.is_empty()).then(|| {
                format!(
                    "the alert gate's query {expression:?} returns {}",
                    listed(described.into_iter().collect())
                )
            })
        }
    }
}

/// An `ALERTS_FOR_STATE` series belongs to an `ALERTS` one when their labels agree but for the name
/// and `alertstate`.
fn same_alert(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> bool {
    let own = |labels: &BTreeMap<String, String>| -> BTreeMap<String, String> {
        labels
            .iter()
            .filter(|(name, _)| !matches!(name.as_str(), "__name__" | "alertstate"))
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect()
    };
    own(a) == own(b)
}

/// Seconds since the epoch as a whole-second UTC time.
fn as_timestamp(seconds: f64) -> Option<Timestamp> {
    Timestamp::from_second(seconds.floor() as i64).ok()
}

/// A series of a `promql:` answer in a message: its alert name if it has one, else its metric name
/// and labels as PromQL writes them.
fn describe_series(labels: &BTreeMap<String, String>) -> String {
    if let Some(name) = labels.get("alertname") {
        return name.clone();
    }
    let name = labels.get("__name__").map_or("", String::as_str);
    let rest: Vec<String> = labels
        .iter()
        .filter(|(label, _)| label.as_str() != "__name__")
        .map(|(label, value)| format!("{label}={value:?}"))
        .collect();
    format!("{name}{{{}}}", rest.join(","))
}

/// `a, b, c and 2 more` (sorted as given).
fn listed(items: Vec<String>) -> String {
    let more = items.len().saturating_sub(LISTED);
    let shown = items
        .into_iter()
        .take(LISTED)
        .collect::<Vec<_>>()
        .join(", ");
    if more == 0 {
        shown
    } else {
        format!("{shown} and {more} more")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::NodeRole;
    use crate::talos::NodeProgress;

    const CLUSTER: ClusterNames = ClusterNames {
        namespace: "team-a",
        cluster: "prod",
        cluster_id: "prod-id",
    };

    #[test]
    fn annotation_forms() {
        let selector = |text: &str| AlertGate::Selector(Selector::parse(text).expect(text));
        // (value, the gate or words of the error)
        let cases: Vec<(&str, Result<AlertGate, &str>)> = vec![
            ("off", Ok(AlertGate::Off)),
            (" OFF ", Ok(AlertGate::Off)),
            (
                "alerts: NodeDown, EtcdNoLeader",
                Ok(AlertGate::Names(vec![
                    "EtcdNoLeader".into(),
                    "NodeDown".into(),
                ])),
            ),
            (
                "Alerts:NodeDown,NodeDown,",
                Ok(AlertGate::Names(vec!["NodeDown".into()])),
            ),
            (
                "alerts: job:up:ratio",
                Ok(AlertGate::Names(vec!["job:up:ratio".into()])),
            ),
            (
                r#"{severity=~"critical|warning", team="storage"}"#,
                Ok(selector(r#"{severity=~"critical|warning",team="storage"}"#)),
            ),
            (
                r#"{ a != 'x' , b !~ `y\` , }"#,
                Ok(selector(r#"{a!='x',b!~`y\`}"#)),
            ),
            (
                r#"{cluster="{clusterId}"}"#,
                Ok(selector(r#"{cluster="{clusterId}"}"#)),
            ),
            ("{}", Ok(selector("{}"))),
            (
                "promql: sum(kube_pod_status_phase{phase=\"Pending\"}) > 10",
                Ok(AlertGate::Promql(
                    "sum(kube_pod_status_phase{phase=\"Pending\"}) > 10".into(),
                )),
            ),
            ("alerts:", Err("lists no alert name")),
            (
                "alerts: Node-Down",
                Err("\"Node-Down\" is not an alert name"),
            ),
            ("alerts: 1Up", Err("is not an alert name")),
            ("alerts: a|b", Err("is not an alert name")),
            ("promql:   ", Err("has no expression")),
            ("promql: sum(up", Err("unclosed '('")),
            ("promql: up{job=\"x}", Err("not closed")),
            ("promql: up)", Err("unmatched ')'")),
            ("{severity=critical}", Err("must be a quoted string")),
            ("{severity}", Err("expected =, !=, =~ or !~")),
            ("{=\"x\"}", Err("expected a label name")),
            ("{a=\"x\" b=\"y\"}", Err("expected ','")),
            ("{a=\"x\"", Err("not a label selector in braces")),
            ("NodeDown", Err("use off, alerts:")),
            ("on", Err("use off, alerts:")),
        ];
        for (text, expected) in cases {
            match (AlertGate::parse(text), expected) {
                (Ok(gate), Ok(expected)) => assert_eq!(gate, expected, "{text:?}"),
                (Err(reason), Err(words)) => {
                    assert!(reason.contains(words), "{text:?}: {reason}");
                    assert!(reason.contains("use off, alerts:"), "{text:?}: {reason}");
                }
                (got, expected) => panic!("{text:?}: got {got:?}, expected {expected:?}"),
            }
        }
    }

    #[test]
    fn queries() {
        let default = Selector::parse(r#"{severity="critical",cluster="{clusterId}"}"#).unwrap();
        let gate = |text: &str| AlertGate::parse(text).unwrap();
        let alerts = |firing: &str, since: &str| {
            Some(Query::Alerts {
                firing: firing.to_string(),
                since: since.to_string(),
            })
        };
        let cases: Vec<(Option<AlertGate>, Option<Query>)> = vec![
            (
                None,
                alerts(
                    r#"ALERTS{alertstate="firing",severity="critical",cluster="prod-id"}"#,
                    r#"ALERTS_FOR_STATE{severity="critical",cluster="prod-id"}"#,
                ),
            ),
            (Some(gate("off")), None),
            (
                Some(gate("alerts: NodeDown, EtcdNoLeader")),
                alerts(
                    r#"ALERTS{alertstate="firing",severity="critical",cluster="prod-id",alertname=~"EtcdNoLeader|NodeDown"}"#,
                    r#"ALERTS_FOR_STATE{severity="critical",cluster="prod-id",alertname=~"EtcdNoLeader|NodeDown"}"#,
                ),
            ),
            (
                Some(gate(
                    r#"{team="storage", namespace="{namespace}", c="{cluster}"}"#,
                )),
                alerts(
                    r#"ALERTS{alertstate="firing",team="storage",namespace="team-a",c="prod"}"#,
                    r#"ALERTS_FOR_STATE{team="storage",namespace="team-a",c="prod"}"#,
                ),
            ),
            (
                Some(gate("{}")),
                alerts(r#"ALERTS{alertstate="firing"}"#, "ALERTS_FOR_STATE{}"),
            ),
            (
                Some(gate(r#"promql: up{cluster="{clusterId}"} == 0"#)),
                Some(Query::Promql(r#"up{cluster="prod-id"} == 0"#.into())),
            ),
        ];
        for (annotation, expected) in cases {
            assert_eq!(
                query(annotation.as_ref(), &default, &CLUSTER),
                expected,
                "{annotation:?}"
            );
        }
        // Names over an empty default selector.
        assert_eq!(
            query(
                Some(&gate("alerts: A")),
                &Selector::parse("{}").unwrap(),
                &CLUSTER
            ),
            alerts(
                r#"ALERTS{alertstate="firing",alertname=~"A"}"#,
                r#"ALERTS_FOR_STATE{alertname=~"A"}"#
            ),
        );
        assert_eq!(
            Selector::default_selector().to_string(),
            r#"{severity="critical"}"#
        );
    }

    #[test]
    fn placeholders_cannot_break_out_of_a_string() {
        let cluster = ClusterNames {
            namespace: "ns",
            cluster: "c",
            cluster_id: r#"x",evil="1\"#,
        };
        assert_eq!(
            cluster.fill(r#"{id="{clusterId}"}"#),
            r#"{id="x\",evil=\"1\\"}"#
        );
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn firing(pairs: &[(&str, &str)]) -> Series {
        let mut labels = labels(pairs);
        labels.insert("__name__".into(), "ALERTS".into());
        labels.insert("alertstate".into(), "firing".into());
        Series { labels, value: 1.0 }
    }

    fn since(pairs: &[(&str, &str)], at: &str) -> Series {
        let mut labels = labels(pairs);
        labels.insert("__name__".into(), "ALERTS_FOR_STATE".into());
        let at: Timestamp = at.parse().unwrap();
        Series {
            labels,
            value: at.as_second() as f64,
        }
    }

    #[test]
    fn which_alerts_hold_and_what_the_message_says() {
        let nodes: BTreeSet<String> = ["worker-1".to_string(), "10.0.0.7".to_string()].into();
        let fs = [
            ("alertname", "NodeFilesystemAlmostFull"),
            ("instance", "db-1:9100"),
        ];
        let fs2 = [
            ("alertname", "NodeFilesystemAlmostFull"),
            ("instance", "db-2:9100"),
        ];
        let fsync = [("alertname", "EtcdHighFsyncDurations")];
        let cases: Vec<(&str, Answer, Option<&str>)> = vec![
            (
                "nothing firing",
                Answer::Alerts {
                    firing: vec![],
                    since: vec![],
                },
                None,
            ),
            (
                "two alerts, sorted, the earliest since of a name's series",
                Answer::Alerts {
                    firing: vec![firing(&fs), firing(&fs2), firing(&fsync)],
                    since: vec![
                        since(&fs, "2026-11-28T05:01:02Z"),
                        since(&fs2, "2026-11-28T04:00:00Z"),
                        since(&fsync, "2026-11-28T06:00:00.75Z"),
                    ],
                },
                Some(
                    "alerts firing: EtcdHighFsyncDurations (since 2026-11-28T06:00:00Z), \
                     NodeFilesystemAlmostFull (since 2026-11-28T04:00:00Z)",
                ),
            ),
            (
                "since unknown when ALERTS_FOR_STATE is missing: still holds",
                Answer::Alerts {
                    firing: vec![firing(&fsync)],
                    since: vec![],
                },
                Some("alerts firing: EtcdHighFsyncDurations (since an unknown time)"),
            ),
            (
                "a pending alert's ALERTS_FOR_STATE alone does not hold",
                Answer::Alerts {
                    firing: vec![],
                    since: vec![since(&fsync, "2026-11-28T06:00:00Z")],
                },
                None,
            ),
            (
                "alerts naming the node in flight (every node label) and the controller's own do not hold",
                Answer::Alerts {
                    firing: vec![
                        firing(&[("alertname", "KubeNodeNotReady"), ("node", "worker-1")]),
                        firing(&[("alertname", "NodeDown"), ("nodename", "worker-1")]),
                        firing(&[("alertname", "X"), ("kubernetes_node", "worker-1")]),
                        firing(&[("alertname", "Y"), ("exported_node", "worker-1")]),
                        firing(&[("alertname", "TargetDown"), ("instance", "worker-1:9100")]),
                        firing(&[("alertname", "TargetDown"), ("instance", "10.0.0.7:9100")]),
                        firing(&[("alertname", "TargetDown"), ("instance", "worker-1")]),
                        firing(&[("alertname", "KubernetesClusterUpgradeFailed")]),
                        firing(&[("alertname", "TalosUpgradeControllerAbsent")]),
                    ],
                    since: vec![],
                },
                None,
            ),
            (
                "an alert on another node still holds; a longer name is not the node",
                Answer::Alerts {
                    firing: vec![
                        firing(&[("alertname", "KubeNodeNotReady"), ("node", "worker-10")]),
                        firing(&[("alertname", "TargetDown"), ("instance", "[fd00::1]:9100")]),
                    ],
                    since: vec![],
                },
                Some(
                    "alerts firing: KubeNodeNotReady (since an unknown time), TargetDown (since an \
                     unknown time)",
                ),
            ),
            (
                "at most three names, then how many more",
                Answer::Alerts {
                    firing: ["E", "D", "C", "B", "A"]
                        .iter()
                        .map(|name| firing(&[("alertname", name)]))
                        .collect(),
                    since: ["A", "B", "C", "D", "E"]
                        .iter()
                        .map(|name| since(&[("alertname", name)], "2026-11-28T05:01:02Z"))
                        .collect(),
                },
                Some(
                    "alerts firing: A (since 2026-11-28T05:01:02Z), B (since 2026-11-28T05:01:02Z), \
                     C (since 2026-11-28T05:01:02Z) and 2 more",
                ),
            ),
            (
                "promql: nothing returned",
                Answer::Promql {
                    expression: "up == 0".into(),
                    series: vec![],
                },
                None,
            ),
            (
                "promql: every series holds but the upgrade's own",
                Answer::Promql {
                    expression: "up == 0".into(),
                    series: vec![
                        Series {
                            labels: labels(&[
                                ("__name__", "up"),
                                ("job", "x"),
                                ("instance", "db-1:9100"),
                            ]),
                            value: 0.0,
                        },
                        Series {
                            labels: labels(&[
                                ("__name__", "up"),
                                ("job", "x"),
                                ("instance", "worker-1:9100"),
                            ]),
                            value: 0.0,
                        },
                        Series {
                            labels: labels(&[("alertname", "NodeDown"), ("severity", "page")]),
                            value: 1.0,
                        },
                    ],
                },
                Some(
                    r#"the alert gate's query "up == 0" returns NodeDown, up{instance="db-1:9100",job="x"}"#,
                ),
            ),
        ];
        for (what, answer, expected) in cases {
            assert_eq!(verdict(&answer, &nodes).as_deref(), expected, "{what}");
        }
    }

    #[test]
    fn the_upgrades_own_nodes_are_those_in_flight_and_recently_done() {
        let now: Timestamp = "2026-11-28T06:00:00Z".parse().unwrap();
        let ago = |minutes: i64| now - jiff::SignedDuration::from_mins(minutes);
        let node = |name: &str, step: NodeStep| NodeProgress {
            name: name.to_string(),
            role: NodeRole::Worker,
            step,
        };
        let run = Run {
            requested: "1.12.0".into(),
            target: "1.12.0".into(),
            started_at: ago(60),
            outcome: None,
            gates: Default::default(),
            previous: Default::default(),
            rollback: None,
            nodes: vec![
                node(
                    "already",
                    NodeStep::Done {
                        at: ago(1),
                        started_at: None,
                    },
                ),
                node(
                    "long-ago",
                    NodeStep::Done {
                        at: ago(11),
                        started_at: Some(ago(15)),
                    },
                ),
                node(
                    "just-done",
                    NodeStep::Done {
                        at: ago(9),
                        started_at: Some(ago(12)),
                    },
                ),
                node(
                    "in-flight",
                    NodeStep::Issued {
                        at: ago(1),
                        boot_id: "b".into(),
                        from_version: "1.11.6".into(),
                        installer_image: "i".into(),
                        lifecycle: None,
                        unanswered: false,
                        install_unconfirmed: false,
                    },
                ),
                node("next", NodeStep::Pending),
            ],
        };
        assert_eq!(
            upgrade_nodes(Some(&run), now),
            ["in-flight".to_string(), "just-done".to_string()].into()
        );
        assert!(upgrade_nodes(None, now).is_empty());
    }

    #[test]
    fn instance_hosts() {
        for (instance, host) in [
            ("worker-1:9100", "worker-1"),
            ("worker-1", "worker-1"),
            ("10.0.0.1:9100", "10.0.0.1"),
            ("[fd00::1]:9100", "fd00::1"),
            ("fd00::1", "fd00::1"),
            ("host:metrics", "host:metrics"),
        ] {
            assert_eq!(instance_host(instance), host, "{instance}");
        }
    }

    /// The controller's own alerts are exactly those of the shipped PrometheusRule.
    #[test]
    fn own_alerts_are_the_shipped_rules() {
        let rules = include_str!("../../../deploy/monitoring.yaml");
        let shipped: BTreeSet<&str> = rules
            .lines()
            .filter_map(|line| line.trim().strip_prefix("- alert:"))
            .map(str::trim)
            .collect();
        assert_eq!(shipped, OWN_ALERTS.into_iter().collect());
    }
}
