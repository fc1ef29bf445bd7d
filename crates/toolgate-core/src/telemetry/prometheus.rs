//! The Prometheus text exposition format (version 0.0.4) of a
//! [`MetricsSnapshot`]: `# HELP` / `# TYPE` per family, counters ending in
//! `_total`, histograms as `_bucket{le=…}` / `_sum` / `_count`.

use std::fmt::Write as _;

use super::metrics::{Kind, MetricsSnapshot, Sample};

/// The `Content-Type` of this format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders a snapshot. Families with no sample still get their HELP and TYPE
/// lines, so a scraper sees every metric name from the first scrape on.
pub fn render(s: &MetricsSnapshot) -> String {
    let mut out = String::new();
    for f in &s.families {
        let kind = match f.kind {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        };
        let _ = writeln!(out, "# HELP {} {}", f.name, escape_help(f.help));
        let _ = writeln!(out, "# TYPE {} {kind}", f.name);
        for sample in &f.samples {
            match &sample.histogram {
                Some(h) => {
                    for (le, count) in &h.buckets {
                        let le = if le.is_infinite() { "+Inf".to_string() } else { number(*le) };
                        let _ = writeln!(out, "{}_bucket{} {count}", f.name, labels(sample, Some(&le)));
                    }
                    let _ = writeln!(out, "{}_sum{} {}", f.name, labels(sample, None), number(h.sum_seconds));
                    let _ = writeln!(out, "{}_count{} {}", f.name, labels(sample, None), h.count);
                }
                None => {
                    let _ = writeln!(out, "{}{} {}", f.name, labels(sample, None), number(sample.value));
                }
            }
        }
    }
    for n in &s.not_tracked {
        let _ = writeln!(out, "# toolgate: {} is not exported: {}", n.metric, escape_help(n.why));
    }
    out
}

fn labels(s: &Sample, le: Option<&str>) -> String {
    if s.labels.is_empty() && le.is_none() {
        return String::new();
    }
    let mut parts: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape_label(v))).collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    format!("{{{}}}", parts.join(","))
}

/// A sample value: integers without a fraction, others in plain decimal.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::super::metrics::{Family, HistogramSample, WindowInfo};
    use super::*;

    fn check(families: Vec<Family>, expect: &str) {
        let s = MetricsSnapshot {
            generated_at_ms: 0,
            window: WindowInfo { start_ms: 0, end_ms: 60_000, bucket_ms: 60_000 },
            families,
            rates: vec![],
            latency_window: vec![],
            latency_all_time: vec![],
            outcome_unknown: 0,
            oldest_unknown_age_ms: None,
            side_effect_duplicates: 0,
            resilience: vec![],
            not_tracked: vec![],
        };
        assert_eq!(render(&s), expect);
    }

    #[test]
    fn renders_counters_gauges_and_histograms() {
        let labels = BTreeMap::from([("tool", "create_refund".to_string()), ("odd", "a\"b\\c\nd".to_string())]);
        check(
            vec![
                Family {
                    name: "toolgate_x_total",
                    help: "X.",
                    kind: Kind::Counter,
                    samples: vec![Sample { labels: labels.clone(), value: 3.0, histogram: None }],
                },
                Family { name: "toolgate_empty", help: "Nothing yet.", kind: Kind::Gauge, samples: vec![] },
                Family {
                    name: "toolgate_d_seconds",
                    help: "D.",
                    kind: Kind::Histogram,
                    samples: vec![Sample {
                        labels: BTreeMap::from([("tool", "t".to_string())]),
                        value: 2.0,
                        histogram: Some(HistogramSample {
                            buckets: vec![(0.00025, 1), (2.5, 2), (f64::INFINITY, 2)],
                            sum_seconds: 1.2345,
                            count: 2,
                        }),
                    }],
                },
            ],
            "# HELP toolgate_x_total X.\n\
             # TYPE toolgate_x_total counter\n\
             toolgate_x_total{odd=\"a\\\"b\\\\c\\nd\",tool=\"create_refund\"} 3\n\
             # HELP toolgate_empty Nothing yet.\n\
             # TYPE toolgate_empty gauge\n\
             # HELP toolgate_d_seconds D.\n\
             # TYPE toolgate_d_seconds histogram\n\
             toolgate_d_seconds_bucket{tool=\"t\",le=\"0.00025\"} 1\n\
             toolgate_d_seconds_bucket{tool=\"t\",le=\"2.5\"} 2\n\
             toolgate_d_seconds_bucket{tool=\"t\",le=\"+Inf\"} 2\n\
             toolgate_d_seconds_sum{tool=\"t\"} 1.2345\n\
             toolgate_d_seconds_count{tool=\"t\"} 2\n",
        );
    }
}
