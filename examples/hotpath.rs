//! A fixed number of fresh dispatches, replays or bare-loop writes, nothing
//! else: the workload to run under a profiler when working on the hot path.
//!
//! ```text
//! cargo build --release --example hotpath
//! valgrind --tool=callgrind target/release/examples/hotpath fresh 500
//! valgrind --tool=callgrind target/release/examples/hotpath fresh 1500
//! ```
//!
//! Modes: `fresh N`, `replay N` (one settled intent), `replay_many N` (cycling
//! over 2,000, or `HOTPATH_SETTLED`, like `toolgate bench`), `bare_write N`, `bare_replay N`, `bare_replay_many N`, `distinct8 N` (eight threads, an engine each, on
//! distinct intents); the ledger is
//! at `synchronous=NORMAL` (the engine's CPU, not the disk), or at `FULL` with
//! `HOTPATH_SYNC=full` (the replay's read-then-relaxed-write path). Instructions per
//! call are the difference of two whole-process totals divided by the
//! difference in N: the set-up cancels out, and so does nothing of the calls'
//! own work. (`--toggle-collect` on `*Engine*dispatch*` undercounts: every
//! nested function whose name matches toggles collection off again.)

use std::process::ExitCode;

use toolgate::engine::envelope::Delivery;
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{DispatchRequest, Engine, EngineOptions};
use toolgate::store::bench::{BareLedger, BarePayload};
use toolgate::store::{StoreError, Sync};

/// Settled intents `replay_many` cycles over.
const REPLAY_MANY: usize = 2_000;

/// How many settled intents the `*_many` modes cycle over.
fn settled_count() -> usize {
    std::env::var("HOTPATH_SETTLED").ok().and_then(|v| v.parse().ok()).unwrap_or(REPLAY_MANY)
}

fn refund(key: String) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        arguments: br#"{"order_ref":"ord_1002","amount_minor":1,"currency":"EUR","reason":"damaged"}"#.to_vec(),
        idempotency_key: Some(key),
        ..DispatchRequest::default()
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(mode), Some(n)) = (args.get(1), args.get(2).and_then(|n| n.parse::<u64>().ok())) else {
        eprintln!("usage: hotpath fresh|replay|replay_many|bare_write|bare_replay|bare_replay_many|distinct8 N");
        return ExitCode::from(2);
    };
    match run(mode, n) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hotpath: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(mode: &str, n: u64) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let sync = if std::env::var("HOTPATH_SYNC").is_ok_and(|v| v.eq_ignore_ascii_case("full")) {
        Sync::Full
    } else {
        Sync::Normal
    };
    let mut engine =
        Engine::create(&dir.path().join("ledger.db"), EngineOptions { sync, ..toolgate::tools::demo_options() })?;
    let mut world = World::parse(DEMO_WORLD.as_bytes())?;
    toolgate::tools::demo::raise_captures(&mut world, 1_000_000_000_000)?;
    engine.load_world(&world)?;
    let settled = engine.dispatch(&refund("hotpath-settled-0001".into()))?;
    let op_id = settled.protected_audit.operation_id.clone().unwrap_or_default();
    let mut started = std::time::Instant::now();
    match mode {
        "fresh" => {
            for i in 0..n {
                let env = engine.dispatch(&refund(format!("hotpath-fresh-{i:012}")))?;
                assert_eq!(env.model_result.execution.delivery, Delivery::Fresh);
            }
        }
        "replay" => {
            for _ in 0..n {
                let env = engine.dispatch(&refund("hotpath-settled-0001".into()))?;
                assert_eq!(env.model_result.execution.delivery, Delivery::LocalReplay);
            }
        }
        "replay_many" => {
            // Replays cycling over many settled intents, as `toolgate bench`
            // does: no row is the one the previous call read.
            let many = settled_count();
            let settled: Vec<String> = (0..many).map(|i| format!("hotpath-many-{i:012}")).collect();
            for key in &settled {
                engine.dispatch(&refund(key.clone()))?;
            }
            started = std::time::Instant::now();
            for i in 0..n as usize {
                let env = engine.dispatch(&refund(settled[i % settled.len()].clone()))?;
                assert_eq!(env.model_result.execution.delivery, Delivery::LocalReplay);
            }
        }
        "bare_write" | "bare_replay" | "bare_replay_many" => {
            let (op, trace) =
                engine.read(|tx| -> Result<_, StoreError> { Ok((tx.operation(&op_id)?, tx.trace_for(&op_id)?)) })?;
            let op = op.ok_or("the settled operation is not in the ledger")?;
            let payload = BarePayload {
                request_json: op.request_json.clone(),
                result_json: op.result_json.clone().unwrap_or_default(),
                trace_fields: trace.into_iter().map(|t| t.fields).collect(),
            };
            let mut bare = BareLedger::create(&dir.path().join("bare.db"), sync, payload)?;
            let now = 1_700_000_000_000;
            started = std::time::Instant::now();
            if mode == "bare_write" {
                for i in 0..n {
                    bare.write_one(i, now)?;
                }
            } else if mode == "bare_replay_many" {
                // `replay_many`'s floor: cycling over as many settled writes.
                let many = settled_count() as u64;
                for i in 0..many {
                    bare.write_one(i, now)?;
                }
                started = std::time::Instant::now();
                for i in 0..n {
                    bare.replay_one(i % many, i, now)?.ok_or("the bare replay found nothing")?;
                }
            } else {
                bare.write_one(0, now)?;
                for i in 0..n {
                    bare.replay_one(0, i, now)?.ok_or("the bare replay found nothing")?;
                }
            }
        }
        "distinct8" => {
            // Eight threads, each with its own engine on the same file, on
            // distinct intents: `toolgate bench`'s contention_distinct.
            let path = dir.path().join("ledger.db");
            let engines = (0..8)
                .map(|t| {
                    Engine::open(
                        &path,
                        EngineOptions { sync, worker_id: format!("hotpath-w{t}"), ..toolgate::tools::demo_options() },
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            started = std::time::Instant::now();
            std::thread::scope(|s| {
                for (t, mut engine) in engines.into_iter().enumerate() {
                    s.spawn(move || {
                        for i in 0..n / 8 {
                            let env = engine.dispatch(&refund(format!("hotpath-d{t}-{i:012}"))).expect("dispatch");
                            assert_eq!(env.model_result.execution.delivery, Delivery::Fresh);
                        }
                    });
                }
            });
        }
        other => return Err(format!("unknown mode {other}").into()),
    }
    // The loop's own wall time (set-up and settling not included), for
    // comparing two builds run in turn; the profilers count the whole process.
    if n > 0 {
        eprintln!("{mode}: {:.1} µs per call", started.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
    Ok(())
}

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
