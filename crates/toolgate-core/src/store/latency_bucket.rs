//! The latency bucket of an answer event (migration 0006): computed once, here,
//! stored beside the latency, and read back by the rollups and by
//! `telemetry::histogram` (which re-exports [`bucket_upper`]).

/// The bucket a latency falls in: the latency rounded up to three significant
/// digits (exact below 1000 µs; negative values count as 0; above 10^9 µs the
/// step stays 10^7 µs).
pub fn bucket_upper(us: i64) -> i64 {
    if us < 1_000 {
        return us.max(0);
    }
    if us >= 1_000_000_000 {
        let v = us.min(999_000_000_000);
        return (v + 9_999_999) / 10_000_000 * 10_000_000;
    }
    let mut step = 10;
    let mut limit = 10_000;
    while us >= limit {
        step *= 10;
        limit *= 10;
    }
    (us + step - 1) / step * step
}
