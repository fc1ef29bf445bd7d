//! Latency histograms. A bucket is a latency rounded *up* to three significant
//! digits (exact below 1 ms): percentiles read from it are within 1% of the
//! true ones, and the Prometheus `le` bounds ([`PROMETHEUS_BOUNDS_US`]) fall on
//! bucket edges, so the exported cumulative counts are exact.
//!
//! The rollup trigger of migration 0002 buckets in SQL; [`bucket_upper`] (kept
//! in the store, which computes each answer's bucket) is the same rule in Rust
//! (a test checks they agree).

use std::collections::BTreeMap;

/// The Prometheus `le` bounds, in microseconds (a 1-2.5-5 series from 250 µs
/// to a minute); `+Inf` is implied.
pub const PROMETHEUS_BOUNDS_US: [i64; 17] = [
    250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000,
    10_000_000, 30_000_000, 60_000_000,
];

/// The one rounding rule, kept in the ledger (which stores each answer's
/// bucket beside its latency) and re-exported here for the histograms.
pub use crate::store::latency_bucket::bucket_upper;

/// Counts per bucket (bucket upper bound in µs → count).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Histogram {
    buckets: BTreeMap<i64, u64>,
}

impl Histogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one latency.
    pub fn record(&mut self, us: i64) {
        self.add_bucket(bucket_upper(us), 1);
    }

    /// Adds `count` observations to a bucket (as read from the rollups).
    pub fn add_bucket(&mut self, bucket_us: i64, count: u64) {
        *self.buckets.entry(bucket_us).or_default() += count;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.buckets.values().sum()
    }

    /// Observations at or below `bound_us` (exact when `bound_us` has at most
    /// three significant digits, as every Prometheus bound here has).
    pub fn count_le(&self, bound_us: i64) -> u64 {
        self.buckets.range(..=bound_us).map(|(_, c)| c).sum()
    }

    /// The nearest-rank `q` quantile (`0 < q <= 1`): the bucket of the smallest
    /// observation with at least `ceil(q·n)` observations at or below it. `None`
    /// when empty.
    pub fn quantile(&self, q: f64) -> Option<i64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0;
        for (b, c) in &self.buckets {
            seen += c;
            if seen >= rank {
                return Some(*b);
            }
        }
        self.buckets.keys().next_back().copied()
    }

    /// p50, p95 and p99.
    pub fn percentiles(&self) -> Option<Percentiles> {
        Some(Percentiles { p50_us: self.quantile(0.50)?, p95_us: self.quantile(0.95)?, p99_us: self.quantile(0.99)? })
    }
}

/// p50 / p95 / p99 in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50_us: i64,
    /// 95th percentile.
    pub p95_us: i64,
    /// 99th percentile.
    pub p99_us: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact nearest-rank percentiles of `values`, rounded to their bucket: what
    /// the histogram must answer.
    fn exact(values: &[i64], q: f64) -> i64 {
        let mut v = values.to_vec();
        v.sort_unstable();
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        bucket_upper(v[rank - 1])
    }

    #[allow(clippy::needless_pass_by_value)]
    fn check(values: Vec<i64>, expect: Option<(i64, i64, i64)>) {
        let mut h = Histogram::new();
        for v in &values {
            h.record(*v);
        }
        let got = h.percentiles().map(|p| (p.p50_us, p.p95_us, p.p99_us));
        assert_eq!(got, expect, "values {:?}..", &values[..values.len().min(5)]);
        if let Some((p50, p95, p99)) = got {
            assert_eq!((exact(&values, 0.5), exact(&values, 0.95), exact(&values, 0.99)), (p50, p95, p99));
        }
    }

    #[test]
    fn percentiles_of_known_distributions() {
        check(vec![], None);
        check(vec![7], Some((7, 7, 7)));
        // 1..=100 µs: nearest rank, exact below 1 ms.
        check((1..=100).collect(), Some((50, 95, 99)));
        // 1..=1000 µs, shuffled order does not matter.
        check((1..=1000).rev().collect(), Some((500, 950, 990)));
        // 1 ms .. 10 ms in 1 µs steps: p50 = 5500 µs, p95 = 9550, p99 = 9910.
        check((1_000..10_000).collect(), Some((5_500, 9_550, 9_910)));
        // A long tail: 98 fast calls and 2 slow ones: p99 lands in the tail.
        let mut tail = vec![200; 98];
        tail.extend([1_234_567, 2_000_000]);
        check(tail, Some((200, 200, 1_240_000)));
        // Bimodal: half at 300 µs, half at 40 ms.
        let mut bi = vec![300; 500];
        bi.extend(vec![40_000; 500]);
        check(bi, Some((300, 40_000, 40_000)));
    }

    #[test]
    fn quantile_is_within_one_percent_of_the_true_value() {
        let values: Vec<i64> = (0..5_000).map(|i| 1_000 + i * 7_919 % 3_000_000).collect();
        let mut h = Histogram::new();
        let mut sorted = values.clone();
        sorted.sort_unstable();
        for v in &values {
            h.record(*v);
        }
        for q in [0.5, 0.9, 0.95, 0.99, 0.999] {
            let truth = sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
            let got = h.quantile(q).unwrap_or(0);
            assert!(got >= truth && (got - truth) as f64 <= truth as f64 * 0.01, "q {q}: {got} vs {truth}");
        }
    }

    #[test]
    fn buckets_round_up_to_three_significant_digits() {
        for (us, expect) in [
            (-5, 0),
            (0, 0),
            (999, 999),
            (1_000, 1_000),
            (1_001, 1_010),
            (9_991, 10_000),
            (12_345, 12_400),
            (250_000, 250_000),
            (250_001, 251_000),
            (999_999_999, 1_000_000_000),
            (1_234_567_890, 1_240_000_000),
            (i64::MAX, 999_000_000_000),
        ] {
            assert_eq!(bucket_upper(us), expect, "{us}");
        }
        // Every Prometheus bound is its own bucket edge: counts at the bound are exact.
        for b in PROMETHEUS_BOUNDS_US {
            assert_eq!(bucket_upper(b), b);
            assert!(bucket_upper(b + 1) > b);
        }
    }

    #[test]
    fn count_le_is_cumulative() {
        let mut h = Histogram::new();
        for v in [100, 250, 251, 500, 900, 5_000, 70_000_000] {
            h.record(v);
        }
        let counts: Vec<u64> = PROMETHEUS_BOUNDS_US.iter().map(|b| h.count_le(*b)).collect();
        assert_eq!(&counts[..5], &[2, 4, 5, 5, 6]);
        assert_eq!(counts[16], 6);
        assert_eq!(h.count(), 7);
    }
}
