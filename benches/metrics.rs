//! The cost of computing every metric on a ledger whose trace holds a million
//! events (docs/design.md §12: "computing metrics over 1,000,000 trace events stays
//! fast"), against a plain scan of the trace for comparison.
//!
//! `cargo bench --bench metrics` (set-up writes the events once through the
//! real insert, so the rollup trigger does its work; `TOOLGATE_BENCH_EVENTS=N`
//! changes the count).

use std::path::Path;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use toolgate::engine::clock::ManualClock;
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{Engine, EngineOptions};
use toolgate::store::{StoreError, Sync, TraceRow};
use toolgate::telemetry::metrics::{snapshot, Slice, Window};
use toolgate::telemetry::prometheus;

/// 2026-01-02T00:00:00Z: the events span the day before.
const NOW: i64 = 1_767_312_000_000;

fn opts(clock: &ManualClock) -> EngineOptions {
    EngineOptions { clock: Arc::new(clock.clone()), sync: Sync::Normal, ..toolgate::tools::demo_options() }
}

/// One synthetic dispatch's events: the steps a fresh execution writes, or a
/// replay / conflict / refusal answered at the decision.
fn events_of(rng: &mut StdRng, at: i64, op: u64) -> Vec<TraceRow> {
    let tool = ["create_refund", "notify_customer", "get_order"][rng.gen_range(0..3)];
    let tenant = ["tenant_1a2b3c4d5e6f7a8b", "tenant_99aa88bb77cc66dd", "tenant_0f0e0d0c0b0a0908"][rng.gen_range(0..3)];
    // Log-uniform latency between 200 µs and 200 ms.
    let latency = (200.0 * 1000f64.powf(rng.gen::<f64>())) as i64;
    let row =
        |step: &str, answer: bool, code: Option<&str>, outcome: &str, delivery: Option<&str>, reason: &str| TraceRow {
            seq: 0,
            at,
            operation_id: Some(format!("op_{op:024x}")),
            step: step.to_string(),
            tool: Some(tool.to_string()),
            code: code.map(str::to_string),
            outcome: Some(outcome.to_string()),
            delivery: delivery.map(str::to_string),
            attempt: Some(1),
            duration_us: Some(latency / 2),
            fields: r#"{"request_sha256":"0000000000000000000000000000000000000000000000000000000000000000"}"#.into(),
            answer: answer.then(|| "dispatch".to_string()),
            latency_us: answer.then_some(latency),
            tenant_ref: Some(tenant.to_string()),
            tool_version: Some("1.1.1".to_string()),
            timeout_stage: None,
            reason: Some(reason.to_string()),
        };
    match rng.gen_range(0..10) {
        0..=5 => vec![
            row("accepted", false, None, "not_started", None, "accepted"),
            row("claimed", false, None, "not_started", None, "first_attempt"),
            row("sent", false, None, "not_started", None, "sent"),
            row("downstream_reply", false, None, "committed", None, "committed"),
            row("persisted", true, None, "committed", Some("fresh"), "committed"),
        ],
        6 | 7 => vec![row("idempotency", true, None, "committed", Some("local_replay"), "replay")],
        8 => vec![row("idempotency", true, Some("IDEMPOTENCY_CONFLICT"), "not_started", Some("fresh"), "conflict")],
        _ => vec![
            row("accepted", false, None, "not_started", None, "accepted"),
            row("claimed", false, None, "not_started", None, "first_attempt"),
            row("sent", false, None, "not_started", None, "sent"),
            row("downstream_reply", true, Some("OUTCOME_UNKNOWN"), "unknown", Some("fresh"), "parked_unknown"),
        ],
    }
}

/// A ledger with the demo world, a few hundred open unknowns, and `n` trace events
/// spread over one day.
fn ledger(dir: &Path, n: usize) -> Engine {
    let path = dir.join("metrics-bench.db");
    let clock = ManualClock::new(NOW - 86_400_000);
    let mut e = Engine::create(&path, opts(&clock)).expect("create");
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).expect("world")).expect("world");
    let mut rng = StdRng::seed_from_u64(7);
    let mut written = 0;
    let mut op = 0u64;
    let started = std::time::Instant::now();
    // The trace events are written straight into the store (the bench measures
    // reading them, not the engine writing them).
    let mut store = toolgate::store::Store::open(&path, toolgate::store::OpenOptions::default()).expect("store");
    while written < n {
        store
            .write(|tx| -> Result<(), StoreError> {
                let mut batch = 0;
                while batch < 50_000 && written < n {
                    let at = NOW - 86_400_000 + (written as i64 * 86_400_000 / n as i64);
                    for ev in events_of(&mut rng, at, op) {
                        tx.insert_trace(&ev)?;
                        batch += 1;
                        written += 1;
                    }
                    op += 1;
                }
                Ok(())
            })
            .expect("write");
    }
    eprintln!("wrote {written} trace events in {:.1?}", started.elapsed());
    clock.set(NOW);
    e
}

fn bench(c: &mut Criterion) {
    let n: usize = std::env::var("TOOLGATE_BENCH_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut engine = ledger(dir.path(), n);
    let mut g = c.benchmark_group(format!("metrics_over_{n}_trace_events"));
    g.sample_size(20);
    g.bench_function("snapshot_15min_window", |b| {
        b.iter(|| snapshot(&mut engine, Window::default(), &Slice::default()).expect("snapshot"));
    });
    g.bench_function("snapshot_and_prometheus_text", |b| {
        b.iter(|| prometheus::render(&snapshot(&mut engine, Window::default(), &Slice::default()).expect("snapshot")));
    });
    g.bench_function("snapshot_24h_window_sliced_by_tool", |b| {
        let slice = Slice { tool: Some("create_refund".into()), ..Slice::default() };
        b.iter(|| snapshot(&mut engine, Window::with_buckets(24 * 60, 60), &slice).expect("snapshot"));
    });
    // What the rollups save: one GROUP BY over the raw trace (bench-only SQL).
    let raw = rusqlite::Connection::open(dir.path().join("metrics-bench.db")).expect("open");
    g.bench_function("baseline_full_trace_scan", |b| {
        b.iter(|| {
            let mut st = raw
                .prepare_cached("SELECT answer, step, tool, tenant_ref, code, outcome, delivery, reason, count(*) FROM trace_events GROUP BY 1, 2, 3, 4, 5, 6, 7, 8")
                .expect("prepare");
            st.query_map([], |r| r.get::<_, i64>(8)).expect("query").count()
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
