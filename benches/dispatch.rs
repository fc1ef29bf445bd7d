//! One whole call through the engine: a fresh `create_refund` (three commits,
//! a provider that answers at once) and a replay of a settled one, at
//! `synchronous=NORMAL` so that the engine's own cost shows rather than the
//! disk's fsync (`toolgate bench` measures both modes against bare loops).
//!
//! `cargo bench --bench dispatch`

use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, Criterion};
use toolgate::engine::envelope::Delivery;
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{DispatchRequest, Engine, EngineOptions, QueryRequest};
use toolgate::store::Sync;

fn refund(key: String) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        // One cent: ord_1002's capture lasts for every iteration criterion runs.
        arguments: br#"{"order_ref":"ord_1002","amount_minor":1,"currency":"EUR","reason":"damaged"}"#.to_vec(),
        idempotency_key: Some(key),
        ..DispatchRequest::default()
    }
}

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ledger.db");
    let mut engine =
        Engine::create(&path, EngineOptions { sync: Sync::Normal, ..toolgate::tools::demo_options() }).expect("engine");
    let mut world = World::parse(DEMO_WORLD.as_bytes()).expect("world");
    toolgate::tools::demo::raise_captures(&mut world, 1_000_000_000_000).expect("orders");
    engine.load_world(&world).expect("world");
    let n = AtomicU64::new(0);
    c.bench_function("dispatch_fresh", |b| {
        b.iter(|| {
            let key = format!("bench-fresh-{:012}", n.fetch_add(1, Ordering::Relaxed));
            let env = engine.dispatch(&refund(key)).expect("dispatch");
            assert_eq!(env.model_result.execution.delivery, Delivery::Fresh);
        });
    });
    let settled = engine.dispatch(&refund("bench-settled-0001".into())).expect("dispatch");
    c.bench_function("dispatch_replay", |b| {
        b.iter(|| {
            let env = engine.dispatch(&refund("bench-settled-0001".into())).expect("replay");
            assert_eq!(env.model_result.execution.delivery, Delivery::LocalReplay);
        });
    });
    let audit = &settled.protected_audit;
    let query = QueryRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        status_ref: audit.downstream.status_ref.clone().expect("status_ref"),
        expected_request_sha256: audit.binding.request_sha256.clone().expect("digest"),
        ..QueryRequest::default()
    };
    c.bench_function("query_settled", |b| {
        b.iter(|| {
            let env = engine.query_operation_status(&query).expect("query");
            assert_eq!(env.model_result.execution.delivery, Delivery::LocalReplay);
        });
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
