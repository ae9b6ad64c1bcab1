//! Calls and requests broken down by what they were: the controller's Talos calls by gRPC method (from
//! its `talos_upgrade_talos_api_calls_total`), the simulators' record of the mutating ones as a
//! cross-check, and the Kubernetes requests by scope, verb and resource (from the counting proxy), each
//! over the upgrade window (per node upgraded) and the idle window (per cluster per 5 minutes, the unit
//! of issue #27's idle goal).

use std::collections::BTreeMap;

use serde::Serialize;

/// The controller's counter of Talos calls; labels `method` and `code` (src/metrics.rs).
pub const TALOS_CALLS_FAMILY: &str = "talos_upgrade_talos_api_calls_total";

/// The Talos methods that are streams the controller keeps open to be told of changes (its
/// followers' machine-status watches, src/followers.rs), the Talos counterpart of a Kubernetes
/// watch: issue #27's idle goal counts what the controller asks beyond them.
pub const TALOS_STREAMS: &[&str] = &["COSI Watch"];

/// The Kubernetes verb of a watch request (the proxy's [`crate::proxy::Key::verb`]).
pub const WATCH_VERB: &str = "watch";

/// The idle goal's period: requests and calls per cluster per this many seconds.
pub const IDLE_PERIOD_SECONDS: f64 = 300.0;

/// Every sample of `family` in a Prometheus text exposition, by its labels (name → value); samples
/// of other families (including `family_created` and the like) are left out.
pub fn samples(text: &str, family: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let rest = line.strip_prefix(family)?;
            let (labels, value) = if let Some(inner) = rest.strip_prefix('{') {
                let close = closing_brace(inner)?;
                (parse_labels(&inner[..close])?, &inner[close + 1..])
            } else if rest.starts_with(' ') {
                (BTreeMap::new(), rest)
            } else {
                return None;
            };
            // The value, then optionally a timestamp.
            let value = value.split_whitespace().next()?.parse::<f64>().ok()?;
            Some((labels, value))
        })
        .collect()
}

/// The index of the `}` that closes a label set, skipping quoted values (which may hold `}`).
fn closing_brace(inner: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in inner.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// `a="x",b="y\"z"` → {a: x, b: y"z}.
fn parse_labels(text: &str) -> Option<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let (name, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let mut value = String::new();
        let mut escaped = false;
        let mut end = None;
        for (i, c) in after.char_indices() {
            match c {
                _ if escaped => {
                    value.push(match c {
                        'n' => '\n',
                        other => other,
                    });
                    escaped = false;
                }
                '\\' => escaped = true,
                '"' => {
                    end = Some(i);
                    break;
                }
                other => value.push(other),
            }
        }
        labels.insert(name.trim().to_string(), value);
        rest = after[end? + 1..].trim_start_matches(',').trim();
    }
    Some(labels)
}

/// The controller's Talos calls so far, as one scrape of its metrics saw them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TalosCalls {
    /// (method, gRPC code) → calls.
    pub by_method_and_code: BTreeMap<(String, String), f64>,
}

impl TalosCalls {
    /// From the text of the controller's `/metrics`.
    pub fn from_metrics(text: &str) -> TalosCalls {
        let mut by_method_and_code = BTreeMap::new();
        for (labels, value) in samples(text, TALOS_CALLS_FAMILY) {
            let method = labels.get("method").cloned().unwrap_or_default();
            let code = labels.get("code").cloned().unwrap_or_default();
            *by_method_and_code.entry((method, code)).or_insert(0.0) += value;
        }
        TalosCalls { by_method_and_code }
    }

    pub fn total(&self) -> f64 {
        sum(self.by_method_and_code.values().copied())
    }

    /// `self - earlier`, key by key (keys that did not grow are left out).
    pub fn since(&self, earlier: &TalosCalls) -> TalosCalls {
        TalosCalls {
            by_method_and_code: minus(&self.by_method_and_code, &earlier.by_method_and_code),
        }
    }

    /// Method → calls, all codes.
    pub fn by_method(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for ((method, _), calls) in &self.by_method_and_code {
            *out.entry(method.clone()).or_insert(0.0) += calls;
        }
        out
    }

    /// Method → calls that did not end `OK`.
    pub fn failed_by_method(&self) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for ((method, code), calls) in &self.by_method_and_code {
            if code != "OK" {
                *out.entry(method.clone()).or_insert(0.0) += calls;
            }
        }
        out
    }

    /// The calls that are the followers' streams ([`TALOS_STREAMS`]) and all the others.
    pub fn streams_and_others(&self) -> (f64, f64) {
        self.by_method()
            .into_iter()
            .fold((0.0, 0.0), |(streams, others), (method, calls)| {
                if TALOS_STREAMS.contains(&method.as_str()) {
                    (streams + calls, others)
                } else {
                    (streams, others + calls)
                }
            })
    }
}

/// The sum of `values`, 0 (not the -0 of `Iterator::sum`, printed `-0`) when there are none.
pub fn sum(values: impl IntoIterator<Item = f64>) -> f64 {
    values.into_iter().fold(0.0, |total, value| total + value)
}

/// `after - before`, key by key, keeping only keys that grew: counter samples (`f64`) and the
/// proxy's request counts (`u64`, where a key that did not grow must not underflow) alike.
pub fn minus<K: Ord + Clone, V: Copy + Default + PartialOrd + std::ops::Sub<Output = V>>(
    after: &BTreeMap<K, V>,
    before: &BTreeMap<K, V>,
) -> BTreeMap<K, V> {
    after
        .iter()
        .filter_map(|(key, &value)| {
            let earlier = before.get(key).copied().unwrap_or_default();
            (value > earlier).then(|| (key.clone(), value - earlier))
        })
        .collect()
}

/// The name the controller's metric gives the gRPC method the simulator records by its full path:
/// `MachineService`'s methods by their own name (`/machine.MachineService/Upgrade` → `Upgrade`), COSI's
/// as `COSI <method>`, other services' as `<Service>.<method>` (`/machine.LifecycleService/Upgrade` →
/// `LifecycleService.Upgrade`), as talos-api's client names them (crates/talos-api/src/client.rs).
pub fn metric_method_name(path: &str) -> String {
    let path = path.trim_start_matches('/');
    let Some((service, method)) = path.split_once('/') else {
        return path.to_string();
    };
    let service = service.rsplit('.').next().unwrap_or(service);
    match service {
        "MachineService" => method.to_string(),
        "State" => format!("COSI {method}"),
        other => format!("{other}.{method}"),
    }
}

/// How many nodes were upgraded, how many clusters sat idle and for how long: the denominators.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub nodes: usize,
    pub clusters: usize,
    pub idle_seconds: f64,
}

impl Scale {
    pub fn per_node(&self, count: f64) -> f64 {
        count / self.nodes.max(1) as f64
    }

    /// `count` seen over the idle window, per cluster per [`IDLE_PERIOD_SECONDS`].
    pub fn per_cluster_per_period(&self, count: f64) -> f64 {
        if self.idle_seconds <= 0.0 {
            return 0.0;
        }
        count / self.clusters.max(1) as f64 * IDLE_PERIOD_SECONDS / self.idle_seconds
    }
}

/// One line of a by-method or by-request table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CountRow {
    /// The Talos method, or `scope verb resource` of a Kubernetes request.
    pub what: String,
    /// Over the upgrade window (first annotation → last `completed`).
    pub upgrade: f64,
    pub per_node: f64,
    /// Over the idle window.
    pub idle: f64,
    pub idle_per_cluster_per_5min: f64,
    /// Talos: of the upgrade window's calls, those that did not end `OK`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<f64>,
    /// Talos: what the simulators recorded of this method over the upgrade window (they record only
    /// mutating calls; `None` for the others).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub simulators: Option<f64>,
}

/// The rows of both windows, most frequent first (upgrade window, then idle, then by name).
pub fn count_rows(
    upgrade: &BTreeMap<String, f64>,
    idle: &BTreeMap<String, f64>,
    scale: Scale,
) -> Vec<CountRow> {
    let mut keys: Vec<&String> = upgrade.keys().chain(idle.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut rows: Vec<CountRow> = keys
        .into_iter()
        .map(|key| {
            let up = upgrade.get(key).copied().unwrap_or(0.0);
            let still = idle.get(key).copied().unwrap_or(0.0);
            CountRow {
                what: key.clone(),
                upgrade: up,
                per_node: scale.per_node(up),
                idle: still,
                idle_per_cluster_per_5min: scale.per_cluster_per_period(still),
                failed: None,
                simulators: None,
            }
        })
        .collect();
    rows.sort_by(|a, b| {
        b.upgrade
            .total_cmp(&a.upgrade)
            .then(b.idle.total_cmp(&a.idle))
            .then(a.what.cmp(&b.what))
    });
    rows
}

/// The Talos table's rows: [`count_rows`] with the failed calls and the simulators' count of each method
/// filled in (a method the simulators recorded but the controller's metric did not count gets a row too,
/// so a disagreement shows).
pub fn talos_rows(
    upgrade: &TalosCalls,
    idle: &TalosCalls,
    simulators: &BTreeMap<String, f64>,
    scale: Scale,
) -> Vec<CountRow> {
    let mut upgrade_by_method = upgrade.by_method();
    for method in simulators.keys() {
        upgrade_by_method.entry(method.clone()).or_insert(0.0);
    }
    let failed = upgrade.failed_by_method();
    let mut rows = count_rows(&upgrade_by_method, &idle.by_method(), scale);
    for row in &mut rows {
        row.failed = Some(failed.get(&row.what).copied().unwrap_or(0.0));
        row.simulators = simulators.get(&row.what).copied();
    }
    rows
}

/// A markdown table of `rows` under a total line. `what` names the first column; `talos` adds the
/// failed and simulators columns.
pub fn render(rows: &[CountRow], what: &str, talos: bool, idle_seconds: u64) -> String {
    let mut out = format!(
        "| {what} | upgrade: count | per node upgraded |{} idle ({idle_seconds} s): count | per cluster per 5 min |\n",
        if talos {
            " of which not OK | simulators recorded |"
        } else {
            ""
        }
    );
    out.push_str(if talos {
        "|---|---:|---:|---:|---:|---:|---:|\n"
    } else {
        "|---|---:|---:|---:|---:|\n"
    });
    let total = |f: fn(&CountRow) -> f64| sum(rows.iter().map(f));
    let line = |what: &str,
                upgrade: f64,
                per_node: f64,
                failed: Option<f64>,
                simulators: Option<f64>,
                idle: f64,
                per_period: f64| {
        let talos_columns = if talos {
            format!(
                " {} | {} |",
                failed.map_or("–".to_string(), |f| format!("{f:.0}")),
                simulators.map_or("–".to_string(), |s| format!("{s:.0}"))
            )
        } else {
            String::new()
        };
        format!(
            "| {what} | {upgrade:.0} | {per_node:.2} |{talos_columns} {idle:.0} | {per_period:.2} |\n"
        )
    };
    let simulated: Vec<f64> = rows.iter().filter_map(|r| r.simulators).collect();
    out.push_str(&line(
        "**total**",
        total(|r| r.upgrade),
        total(|r| r.per_node),
        Some(total(|r| r.failed.unwrap_or(0.0))),
        (!simulated.is_empty()).then(|| sum(simulated.iter().copied())),
        total(|r| r.idle),
        total(|r| r.idle_per_cluster_per_5min),
    ));
    for r in rows {
        out.push_str(&line(
            &r.what,
            r.upgrade,
            r.per_node,
            r.failed,
            r.simulators,
            r.idle,
            r.idle_per_cluster_per_5min,
        ));
    }
    out
}

/// `management 7.40 per node, 0.00 idle; workload ...`: the rows' per-node and idle figures summed by
/// the first word of `what` (a Kubernetes request's scope).
pub fn by_first_word(rows: &[CountRow]) -> String {
    let mut sums: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for row in rows {
        let word = row.what.split(' ').next().unwrap_or_default();
        let sum = sums.entry(word).or_insert((0.0, 0.0));
        sum.0 += row.per_node;
        sum.1 += row.idle_per_cluster_per_5min;
    }
    sums.into_iter()
        .map(|(word, (per_node, idle))| {
            format!("{word} {per_node:.2} per node upgraded, {idle:.2} per cluster per 5 min idle")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = r#"# HELP talos_upgrade_talos_api_calls Talos API calls.
# TYPE talos_upgrade_talos_api_calls counter
talos_upgrade_talos_api_calls_total{method="Version",code="OK"} 40
talos_upgrade_talos_api_calls_total{method="Version",code="Unavailable"} 3
talos_upgrade_talos_api_calls_total{method="COSI List",code="OK"} 7
talos_upgrade_talos_api_calls_total{method="COSI Watch",code="OK"} 5
talos_upgrade_talos_api_calls_total_created{method="COSI Watch",code="OK"} 1700000000.0
talos_upgrade_talos_api_calls_totally 99
talos_upgrade_reconcile_duration_seconds_count 12
"#;

    #[test]
    fn parses_the_samples_of_one_family_only() {
        let calls = TalosCalls::from_metrics(METRICS);
        assert_eq!(calls.total(), 55.0);
        assert_eq!(
            calls.by_method(),
            BTreeMap::from([
                ("COSI List".to_string(), 7.0),
                ("COSI Watch".to_string(), 5.0),
                ("Version".to_string(), 43.0)
            ])
        );
        assert_eq!(
            calls.failed_by_method(),
            BTreeMap::from([("Version".to_string(), 3.0)])
        );
        assert_eq!(calls.streams_and_others(), (5.0, 50.0));
    }

    #[test]
    fn parses_quoted_label_values() {
        let text = "x_total{a=\"b}\\\"c\",d=\"\"} 2 1700000000\nx_total 3\n";
        let samples = samples(text, "x_total");
        assert_eq!(samples.len(), 2);
        assert_eq!(samples[0].0["a"], "b}\"c");
        assert_eq!(samples[0].0["d"], "");
        assert_eq!(samples[0].1, 2.0);
        assert!(samples[1].0.is_empty());
        assert_eq!(samples[1].1, 3.0);
    }

    #[test]
    fn subtracts_scrapes() {
        let before = TalosCalls::from_metrics(
            "talos_upgrade_talos_api_calls_total{method=\"Version\",code=\"OK\"} 10\n\
             talos_upgrade_talos_api_calls_total{method=\"COSI Watch\",code=\"OK\"} 5\n",
        );
        let after = TalosCalls::from_metrics(METRICS);
        assert_eq!(format!("{}", after.since(&after).total()), "0");
        let window = after.since(&before);
        assert_eq!(window.total(), 40.0);
        assert_eq!(window.by_method().get("COSI Watch"), None);
        assert_eq!(window.by_method()["Version"], 33.0);
    }

    #[test]
    fn sums_by_scope() {
        let scale = Scale {
            nodes: 5,
            clusters: 1,
            idle_seconds: 300.0,
        };
        let upgrade = BTreeMap::from([
            ("management patch kubernetesclusters".to_string(), 5.0),
            ("management create events".to_string(), 5.0),
            ("workload list nodes".to_string(), 5.0),
        ]);
        let idle = BTreeMap::from([("workload watch nodes".to_string(), 1.0)]);
        assert_eq!(
            by_first_word(&count_rows(&upgrade, &idle, scale)),
            "management 2.00 per node upgraded, 0.00 per cluster per 5 min idle; \
             workload 1.00 per node upgraded, 1.00 per cluster per 5 min idle"
        );
    }

    #[test]
    fn names_simulator_paths_as_the_metric_does() {
        for (path, name) in [
            ("/machine.MachineService/Upgrade", "Upgrade"),
            (
                "/machine.LifecycleService/Upgrade",
                "LifecycleService.Upgrade",
            ),
            ("/machine.ImageService/Pull", "ImageService.Pull"),
            ("/cosi.resource.State/List", "COSI List"),
            ("/machine.MachineService/EtcdSnapshot", "EtcdSnapshot"),
        ] {
            assert_eq!(metric_method_name(path), name, "{path}");
        }
    }

    #[test]
    fn scales_per_node_and_per_cluster_per_five_minutes() {
        let scale = Scale {
            nodes: 10,
            clusters: 2,
            idle_seconds: 600.0,
        };
        assert_eq!(scale.per_node(25.0), 2.5);
        // 4 requests over 10 minutes from 2 clusters: 1 per cluster per 5 minutes.
        assert_eq!(scale.per_cluster_per_period(4.0), 1.0);
        let no_window = Scale {
            idle_seconds: 0.0,
            ..scale
        };
        assert_eq!(no_window.per_cluster_per_period(4.0), 0.0);
    }

    #[test]
    fn rows_come_most_frequent_first_with_the_simulators_count() {
        let scale = Scale {
            nodes: 5,
            clusters: 1,
            idle_seconds: 300.0,
        };
        let upgrade = TalosCalls::from_metrics(METRICS);
        let idle = TalosCalls::from_metrics(
            "talos_upgrade_talos_api_calls_total{method=\"Version\",code=\"OK\"} 1\n",
        );
        let simulators = BTreeMap::from([("Upgrade".to_string(), 5.0)]);
        let rows = talos_rows(&upgrade, &idle, &simulators, scale);
        let order: Vec<&str> = rows.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(order, ["Version", "COSI List", "COSI Watch", "Upgrade"]);
        assert_eq!(rows[0].per_node, 8.6);
        assert_eq!(rows[0].failed, Some(3.0));
        assert_eq!(rows[0].idle_per_cluster_per_5min, 1.0);
        assert_eq!(rows[0].simulators, None);
        assert_eq!(rows[3].upgrade, 0.0);
        assert_eq!(rows[3].simulators, Some(5.0));

        let table = render(&rows, "method", true, 300);
        assert!(
            table.contains("| **total** | 55 | 11.00 | 3 | 5 | 1 | 1.00 |"),
            "{table}"
        );
        assert!(
            table.contains("| Upgrade | 0 | 0.00 | 0 | 5 | 0 | 0.00 |"),
            "{table}"
        );
    }
}
