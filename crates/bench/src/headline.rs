//! The headline: issue #27's goals against what each size of the run measured, with a verdict each.
//! Printed before the details and written into the JSON (`headline`).

use serde::Serialize;

use crate::report::SizeResult;

/// Peak RSS at [`RSS_GOAL_NODES`] nodes, MiB.
pub const RSS_GOAL_MIB: f64 = 64.0;
pub const RSS_GOAL_NODES: usize = 1000;
/// At [`SCALE_NODES`] nodes (the 1,000-cluster run) the peak RSS may be this many times the
/// 1,000-node figure.
pub const SCALE_NODES: usize = 5000;
pub const SCALE_RSS_FACTOR: f64 = 5.0;
pub const TALOS_CALLS_PER_NODE: f64 = 12.0;
pub const KUBE_REQUESTS_PER_NODE: f64 = 10.0;
pub const CPU_MS_PER_NODE: f64 = 5.0;
/// Idle Kubernetes requests (beyond the watches) and Talos calls (beyond the followers' watches), each,
/// per cluster per 5 minutes.
pub const IDLE_PER_CLUSTER_PER_5MIN: f64 = 1.0;
pub const OVERHEAD_P99_SECONDS: f64 = 1.0;

/// One goal and how each size did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Goal {
    pub goal: String,
    pub target: String,
    pub sizes: Vec<Measured>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measured {
    pub clusters: usize,
    pub value: String,
    /// `pass`, `FAIL`, or `–` where the goal does not apply to this size (or none is set).
    pub verdict: String,
}

fn verdict(pass: bool) -> String {
    if pass { "pass" } else { "FAIL" }.to_string()
}

/// An idle figure against the idle goal; not judged when the window is shorter than the goal's period
/// (it then says nothing about the periodic refresh, which comes every few minutes).
fn idle_verdict(r: &SizeResult, per_cluster_per_5min: f64) -> String {
    if (r.idle_seconds as f64) < crate::counts::IDLE_PERIOD_SECONDS {
        "not judged: window < 5 min".to_string()
    } else {
        verdict(per_cluster_per_5min <= IDLE_PER_CLUSTER_PER_5MIN)
    }
}

fn none() -> String {
    "–".to_string()
}

/// The goals of issue #27 against `results` (one column per size; the 5,000-node RSS goal reads the
/// 1,000-node figure from `results` when that size ran too, and 5 × 64 MiB otherwise).
pub fn goals(results: &[SizeResult]) -> Vec<Goal> {
    let rss_at_goal_size = results
        .iter()
        .find(|r| r.nodes == RSS_GOAL_NODES)
        .map(|r| r.peak_rss_mib);
    let goal =
        |goal: &str, target: String, measure: &dyn Fn(&SizeResult) -> (String, String)| Goal {
            goal: goal.to_string(),
            target,
            sizes: results
                .iter()
                .map(|r| {
                    let (value, verdict) = measure(r);
                    Measured {
                        clusters: r.clusters,
                        value,
                        verdict,
                    }
                })
                .collect(),
        };
    vec![
        goal(
            "controller peak RSS, MiB",
            format!(
                "≤ {RSS_GOAL_MIB} at {RSS_GOAL_NODES} nodes; at {SCALE_NODES} ≤ {SCALE_RSS_FACTOR} × the \
                 {RSS_GOAL_NODES}-node figure"
            ),
            &|r| {
                let value = format!("{:.1}", r.peak_rss_mib);
                match r.nodes {
                    RSS_GOAL_NODES => (value, verdict(r.peak_rss_mib <= RSS_GOAL_MIB)),
                    SCALE_NODES => {
                        let (base, from) = match rss_at_goal_size {
                            Some(base) => (base, "this run's"),
                            None => (RSS_GOAL_MIB, "the goal's"),
                        };
                        let limit = SCALE_RSS_FACTOR * base;
                        (
                            format!(
                                "{value} (limit {limit:.1}: {SCALE_RSS_FACTOR} × {from} {base:.1})"
                            ),
                            verdict(r.peak_rss_mib <= limit),
                        )
                    }
                    _ => (value, none()),
                }
            },
        ),
        goal(
            "Talos API calls per node upgraded",
            format!("≤ {TALOS_CALLS_PER_NODE}"),
            &|r| {
                (
                    format!("{:.1}", r.talos_calls_per_node),
                    verdict(r.talos_calls_per_node <= TALOS_CALLS_PER_NODE),
                )
            },
        ),
        goal(
            "Kubernetes API requests per node upgraded (watches included)",
            format!("≤ {KUBE_REQUESTS_PER_NODE}"),
            &|r| {
                (
                    format!("{:.1}", r.kube_requests_per_node),
                    verdict(r.kube_requests_per_node <= KUBE_REQUESTS_PER_NODE),
                )
            },
        ),
        goal(
            "controller CPU per node upgraded, ms",
            format!("≤ {CPU_MS_PER_NODE}"),
            &|r| {
                (
                    format!("{:.1}", r.controller_cpu_ms_per_node),
                    verdict(r.controller_cpu_ms_per_node <= CPU_MS_PER_NODE),
                )
            },
        ),
        goal(
            "idle Kubernetes requests per cluster per 5 min, beyond the watches (+ watch requests)",
            format!("≤ {IDLE_PER_CLUSTER_PER_5MIN}"),
            &|r| {
                (
                    format!(
                        "{:.2} (+ {:.2}; {} s window)",
                        r.kube_idle_per_cluster_per_5min,
                        r.kube_idle_watches_per_cluster_per_5min,
                        r.idle_seconds
                    ),
                    idle_verdict(r, r.kube_idle_per_cluster_per_5min),
                )
            },
        ),
        goal(
            "idle Talos calls per cluster per 5 min, beyond the followers' watches (+ COSI Watch streams)",
            format!("≤ {IDLE_PER_CLUSTER_PER_5MIN}"),
            &|r| {
                (
                    format!(
                        "{:.2} (+ {:.2}; {} s window)",
                        r.talos_idle_per_cluster_per_5min,
                        r.talos_idle_streams_per_cluster_per_5min,
                        r.idle_seconds
                    ),
                    idle_verdict(r, r.talos_idle_per_cluster_per_5min),
                )
            },
        ),
        goal(
            "overhead per node, s (p50 / p99)",
            format!("p99 ≤ {OVERHEAD_P99_SECONDS} (set for the {SCALE_NODES}-node run)"),
            &|r| {
                (
                    format!(
                        "{:.3} / {:.3}",
                        r.overhead_seconds.p50, r.overhead_seconds.p99
                    ),
                    verdict(r.overhead_seconds.p99 <= OVERHEAD_P99_SECONDS),
                )
            },
        ),
        goal(
            "cluster wall time ÷ its nodes' own time (p50 / p99)",
            "measured".to_string(),
            &|r| {
                (
                    format!(
                        "{:.2} / {:.2}",
                        r.wall_over_physical.p50, r.wall_over_physical.p99
                    ),
                    none(),
                )
            },
        ),
        goal(
            "controller start → every cluster seen, s",
            "measured".to_string(),
            &|r| (format!("{:.1}", r.first_look_seconds), none()),
        ),
        goal(
            "controller CPU ÷ kube-apiserver CPU during the upgrade",
            "measured (the controller's share)".to_string(),
            &|r| (format!("{:.2}", r.controller_over_apiserver_cpu), none()),
        ),
        goal(
            "kube-apiserver CPU with the controller ÷ in the floor run (--with-floor)",
            "measured (the controller's share)".to_string(),
            &|r| {
                (
                    crate::report::apiserver_over_floor(r)
                        .map_or_else(|| "–".to_string(), |x| format!("{x:.1}")),
                    none(),
                )
            },
        ),
    ]
}

/// The goals as a markdown table, one column per size.
pub fn table(goals: &[Goal], results: &[SizeResult]) -> String {
    let mut out = String::from("| goal (issue #27) | target |");
    for r in results {
        out.push_str(&format!(" {} |", crate::report::size_heading(r)));
    }
    out.push_str("\n|---|---|");
    for _ in results {
        out.push_str("---|");
    }
    out.push('\n');
    for goal in goals {
        out.push_str(&format!("| {} | {} |", goal.goal, goal.target));
        for measured in &goal.sizes {
            if measured.verdict == "–" {
                out.push_str(&format!(" {} |", measured.value));
            } else {
                out.push_str(&format!(" {} ({}) |", measured.value, measured.verdict));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(clusters: usize, peak_rss_mib: f64) -> SizeResult {
        SizeResult {
            clusters,
            nodes: 5 * clusters,
            peak_rss_mib,
            talos_calls_per_node: 12.0,
            kube_requests_per_node: 10.5,
            controller_cpu_ms_per_node: 4.0,
            kube_idle_per_cluster_per_5min: 0.5,
            kube_idle_watches_per_cluster_per_5min: 2.0,
            talos_idle_per_cluster_per_5min: 1.5,
            idle_seconds: 605,
            ..SizeResult::default()
        }
    }

    fn verdicts(goals: &[Goal], name: &str) -> Vec<String> {
        goals
            .iter()
            .find(|g| g.goal.starts_with(name))
            .unwrap_or_else(|| panic!("no goal {name}"))
            .sizes
            .iter()
            .map(|m| m.verdict.clone())
            .collect()
    }

    #[test]
    fn judges_each_size_against_the_goals() {
        let results = [size(1, 30.0), size(200, 60.0), size(1000, 310.0)];
        let goals = goals(&results);
        // RSS: no goal at 5 nodes; 60 ≤ 64 at 1,000; 310 > 5 × 60 at 5,000.
        assert_eq!(
            verdicts(&goals, "controller peak RSS"),
            ["–", "pass", "FAIL"]
        );
        assert_eq!(verdicts(&goals, "Talos API calls"), ["pass"; 3]);
        assert_eq!(verdicts(&goals, "Kubernetes API requests"), ["FAIL"; 3]);
        assert_eq!(verdicts(&goals, "controller CPU per node"), ["pass"; 3]);
        // The watches are beside the idle goal, not in it.
        assert_eq!(verdicts(&goals, "idle Kubernetes"), ["pass"; 3]);
        assert_eq!(verdicts(&goals, "idle Talos"), ["FAIL"; 3]);
        assert_eq!(verdicts(&goals, "controller start"), ["–"; 3]);

        let table = table(&goals, &results);
        assert!(
            table.contains("| 310.0 (limit 300.0: 5 × this run's 60.0) (FAIL) |"),
            "{table}"
        );
        assert!(
            table.contains("| 0.50 (+ 2.00; 605 s window) (pass) |"),
            "{table}"
        );
    }

    #[test]
    fn a_short_idle_window_is_not_judged() {
        let short = SizeResult {
            idle_seconds: 5,
            ..size(1, 30.0)
        };
        assert_eq!(
            verdicts(&goals(&[short]), "idle Talos"),
            ["not judged: window < 5 min"]
        );
    }

    #[test]
    fn the_scale_goal_falls_back_to_five_times_the_goal() {
        let results = [size(1000, 310.0)];
        assert_eq!(verdicts(&goals(&results), "controller peak RSS"), ["pass"]);
    }
}
