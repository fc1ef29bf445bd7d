//! Multi-process race: 4 OS processes × 2 threads (each thread its own engine
//! and connections) dispatch the same 50 intents, and 10 conflicting ones, at one
//! database at once. Exactly 50 effects, every conflict answered
//! IDEMPOTENCY_CONFLICT, and no caller ever sees an error ("database is locked"
//! or any other).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{json, Value};
use toolgate::engine::clock::ManualClock;
use toolgate::engine::envelope::Delivery;
use toolgate::engine::{DispatchRequest, Engine};

use crate::invariants::{check, Expect};
use crate::support::{opts, refund_args, Backend, T0};

const CHILD_ENV: &str = "TOOLGATE_RACE_CHILD";
const PROCESSES: usize = 4;
const THREADS: usize = 2;
const INTENTS: usize = 50;
const CONFLICTING: usize = 10;

fn key(i: usize) -> String {
    format!("race-intent-{i:03}")
}

/// Intent `i` refunds 100 + i; its conflicting twin reuses the key for 1100 + i.
fn request(i: usize, conflicting: bool) -> DispatchRequest {
    let amount = if conflicting { 1_100 + i } else { 100 + i };
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        arguments: refund_args("ord_1002", amount as i64).into_bytes(),
        idempotency_key: Some(key(i)),
        ..DispatchRequest::default()
    }
}

/// Starts `PROCESSES` copies of this test binary running the child test
/// `child` on the fixture's database, releases them together, and returns
/// each one's JSON lines (a child that failed, or that met a lock error,
/// fails the race).
fn run_children(fx: &crate::support::Fixture, child: &str, child_env: &str) -> Vec<Value> {
    let go = fx.scratch().join(format!("go-{child}"));
    let children: Vec<_> = (0..PROCESSES)
        .map(|p| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", child, "--nocapture", "--test-threads=1", "-q"])
                .env(child_env, fx.path())
                .env("TOOLGATE_RACE_GO", &go)
                .env("TOOLGATE_RACE_PROCESS", p.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Every process has opened its engines and waits on this file: start together.
    std::fs::write(&go, b"go").unwrap();
    let mut results = Vec::new();
    for c in children {
        let out = c.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "a racing process failed ({}):\n{stdout}\n{stderr}", out.status);
        assert!(!stderr.contains("locked") && !stdout.contains("locked"), "{stdout}\n{stderr}");
        results
            .extend(stdout.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str::<Value>(l).unwrap()));
    }
    results
}

fn four_processes_two_threads_each_make_exactly_one_effect_per_intent(backend: Backend) {
    let fx = crate::support::Fixture::on(backend);
    let results = run_children(&fx, "race::race_child", CHILD_ENV);
    let per_caller = INTENTS + CONFLICTING;
    assert_eq!(results.len(), PROCESSES * THREADS * per_caller, "every call answered");
    let errors: Vec<&Value> = results.iter().filter(|r| r["error"].is_string()).collect();
    assert!(errors.is_empty(), "errors surfaced to callers: {errors:#?}");
    let mut fresh: BTreeMap<String, usize> = BTreeMap::new();
    for r in &results {
        let code = r["code"].as_str();
        if r["conflicting"] == true {
            assert_eq!(code, Some("IDEMPOTENCY_CONFLICT"), "{r}");
            continue;
        }
        // The intent itself: executed here, replayed, or seen in flight elsewhere.
        assert!(
            (r["status"] == "succeeded" && code.is_none())
                // Seen in flight: IN_PROGRESS from a thread of the same process
                // (known to be running), OUTCOME_UNKNOWN from another process.
                || (r["status"] == "unknown" && matches!(code, Some("OUTCOME_UNKNOWN" | "IN_PROGRESS"))),
            "{r}"
        );
        if r["delivery"] == json!(Delivery::Fresh) && r["status"] == "succeeded" {
            *fresh.entry(r["key"].as_str().unwrap().to_string()).or_default() += 1;
        }
    }
    assert_eq!(fresh.len(), INTENTS, "every intent executed by some caller");
    assert!(fresh.values().all(|n| *n == 1), "one fresh execution per intent: {fresh:?}");
    let mut e = fx.engine();
    let counts = e.counts().unwrap();
    assert_eq!(counts.downstream_effects, INTENTS as i64);
    assert_eq!(counts.side_effect_duplicates, 0);
    assert_eq!(counts.operations.get("succeeded"), Some(&(INTENTS as i64)));
    let (v, _) = check(fx.path(), Expect { settled: true, queried: true });
    assert!(v.is_empty(), "{v:#?}");
    for i in 0..INTENTS {
        let env = e.dispatch(&request(i, false)).unwrap();
        assert_eq!(env.model_result.execution.delivery, Delivery::LocalReplay, "{i}");
    }
}

#[test]
fn race_child() {
    // Not a test by itself: the entry point the race re-executes.
    in_child(CHILD_ENV, "race", |mut e, process, t| {
        let mut order: Vec<usize> = (0..INTENTS).collect();
        order.shuffle(&mut StdRng::seed_from_u64((process * THREADS + t) as u64));
        let mut lines = Vec::new();
        for i in order {
            // The conflicting twin goes right after this caller's own dispatch of
            // the intent, so the ledger holds the original: it must conflict.
            let twins: &[bool] = if i < CONFLICTING { &[false, true] } else { &[false] };
            for &conflicting in twins {
                let line = match e.dispatch(&request(i, conflicting)) {
                    Ok(env) => json!({
                        "key": key(i), "conflicting": conflicting,
                        "status": env.model_result.status, "code": env.code().map(toolgate::engine::envelope::Code::as_str),
                        "delivery": env.model_result.execution.delivery,
                    }),
                    Err(err) => json!({"key": key(i), "conflicting": conflicting, "error": err.to_string()}),
                };
                lines.push(line.to_string());
            }
        }
        lines
    });
}

/// The child side of [`run_children`]: when `child_env` names a database,
/// `THREADS` threads (each its own engine, opened first) wait for the go file,
/// start together, run `each(engine, process, thread)` and the lines they
/// return are printed for the parent. Without it, nothing happens.
fn in_child(child_env: &str, worker: &str, each: fn(Engine, usize, usize) -> Vec<String>) {
    let Some(path) = std::env::var_os(child_env) else { return };
    let go = std::env::var_os("TOOLGATE_RACE_GO").unwrap();
    let process: usize = std::env::var("TOOLGATE_RACE_PROCESS").unwrap().parse().unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let clock = ManualClock::new(T0);
            let e = Engine::open(Path::new(&path), opts(&clock, &format!("{worker}-p{process}-t{t}"))).unwrap();
            let (go, barrier) = (go.clone(), barrier.clone());
            std::thread::spawn(move || {
                while !Path::new(&go).exists() {
                    std::thread::sleep(Duration::from_millis(1));
                }
                barrier.wait();
                each(e, process, t)
            })
        })
        .collect();
    for h in handles {
        for l in h.join().unwrap() {
            println!("{l}");
        }
    }
}

const HOLD_CHILD_ENV: &str = "TOOLGATE_RACE_HOLDS_CHILD";
/// Refunds of 1,000 each caller makes against ord_1001 (captured 12,000):
/// 4 processes × 2 threads × 3 = 24,000 asked, 12,000 payable.
const HOLD_REFUNDS: usize = 3;

/// Four processes of two threads each refund one order at once, far past its
/// capture: exactly the capture is paid, every refusal is the accept's rule
/// (never the provider's), and no hold outlives its operation. The holds are
/// rows in the ledger written in the accepting transaction, so they hold
/// across processes as they do across threads.
fn four_processes_refunding_one_order_are_never_paid_past_its_capture(backend: Backend) {
    let fx = crate::support::Fixture::on(backend);
    let results = run_children(&fx, "race::race_holds_child", HOLD_CHILD_ENV);
    assert_eq!(results.len(), PROCESSES * THREADS * HOLD_REFUNDS, "every call answered");
    let paid = results.iter().filter(|r| r["status"] == "succeeded").count();
    assert_eq!(paid, 12, "{results:#?}");
    for r in results.iter().filter(|r| r["status"] != "succeeded") {
        assert!(
            r["code"] == "BUSINESS_RULE_VIOLATION"
                && (r["rule"] == "amount_exceeds_remaining" || r["rule"] == "order_not_refundable"),
            "refused by the accept's rule only: {r}"
        );
    }
    let mut e = fx.engine();
    let order = toolgate::tools::demo::orders(&mut e).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
    assert_eq!((order.refunded_minor, order.over_refunded_minor), (12_000, 0));
    assert_eq!(e.paid_by_order().unwrap().get("ord_1001").copied(), Some(12_000));
    assert!(e.holds().unwrap().is_empty());
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

#[test]
fn race_holds_child() {
    // Not a test by itself: the entry point the holds race re-executes.
    in_child(HOLD_CHILD_ENV, "holds", |mut e, process, t| {
        (0..HOLD_REFUNDS)
            .map(|i| {
                let req = crate::support::refund(&format!("holds-race-{process}-{t}-{i}"), 1_000);
                let env = e.dispatch(&req).unwrap();
                let rule = env.model_result.error.as_ref().and_then(|x| x.detail.as_ref()).map(|d| d["rule"].clone());
                json!({
                    "status": env.model_result.status, "code": env.code().map(toolgate::engine::envelope::Code::as_str),
                    "rule": rule,
                })
                .to_string()
            })
            .collect()
    });
}

crate::on_both_backends!(
    four_processes_two_threads_each_make_exactly_one_effect_per_intent,
    four_processes_refunding_one_order_are_never_paid_past_its_capture,
);
