//! The crash loop over the API (issue 17 §2: "a SIGKILL loses nothing"):
//! `toolgate serve` is the process that dies. Driver threads send refunds
//! through HTTP with idempotency keys (fresh intents and retries of earlier
//! ones, some with a provider fault in `Toolgate-Fault` on the demo ledger,
//! `crash_after_commit` among them, which aborts the server right after the
//! provider commits); the test SIGKILLs the server at a random moment and
//! starts a new one on the same ledger, again and again.
//!
//! Then recovery, as operators and callers would do it: `toolgate reap`, a
//! server whose own worker and reaper take over the dead servers' leases,
//! every caller retrying its intents with the same key until the answer
//! settles, and a status query through the API for every operation still
//! unknown. The ledger must keep every invariant of
//! [`crate::invariants::check`], and every answer any caller got must agree
//! with it ([`inconsistent_answers`]).
//!
//! Seeded like the in-process loop (`TOOLGATE_SEED`); `TOOLGATE_SOAK=N` sets
//! the kills (half of N, so CI's 20 is 10 kills). The server runs on the
//! system clock: nothing here moves time, it only waits for leases (6 s) and
//! Retry-After as a real caller would.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use toolgate::engine::envelope::Code;

use crate::invariants::{check, Expect, Tally};
use crate::serve::{agent_token, bin, Answer, Client, Server};
use crate::support::{refund_args, Backend, Fixture, RawDb, T0};

/// Driver threads sending at once while the server is killed.
const DRIVERS: u64 = 2;
/// The longest receipt delay a driver asks for (real time).
const MAX_RECEIPT_DELAY_MS: u64 = 1_000;

/// One answer a caller got: the intent's key and the answer.
#[derive(Debug, Clone)]
struct Got {
    key: String,
    answer: Answer,
}

/// What the loop saw.
#[derive(Debug, Default)]
struct ApiLoopReport {
    killed: u32,
    self_aborted: u32,
    answers: usize,
    failed_exchanges: usize,
    retried_in_recovery: usize,
    unknown_before_queries: usize,
    reconciled_by_query: usize,
    tally: Tally,
}

fn key_of(i: u64) -> String {
    format!("api-crash-{i:05}")
}

/// Every intent always carries the same arguments: a retry never conflicts.
fn args_of(i: u64) -> String {
    refund_args("ord_1002", 1 + (i % 40) as i64)
}

fn crash_loop_over_the_api_keeps_every_invariant(backend: Backend) {
    let seed = super::seed();
    let kills = super::soak_kills().div_ceil(2);
    eprintln!("crash loop over the API: seed {seed} kills {kills}");
    let f = Fixture::on(backend);
    f.engine().mark_demo(T0).unwrap();
    let token = agent_token(f.path(), "acme", "agent_ana");
    let intents = 10 * u64::from(kills) + 20;
    let got: Arc<Mutex<Vec<Got>>> = Arc::default();
    let sent: Arc<Mutex<BTreeSet<u64>>> = Arc::default();
    let failed_exchanges = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut rng = StdRng::seed_from_u64(seed);
    let mut report = ApiLoopReport::default();

    for run in 0..kills {
        let mut server = Server::start(f.path(), &[]);
        let client = Arc::new(Client::new(&server));
        let stop = Arc::new(AtomicBool::new(false));
        let drivers: Vec<_> = (0..DRIVERS)
            .map(|d| {
                let (client, stop, token) = (client.clone(), stop.clone(), token.clone());
                let (got, sent, failed) = (got.clone(), sent.clone(), failed_exchanges.clone());
                let mut rng =
                    StdRng::seed_from_u64(seed ^ (u64::from(run) * DRIVERS + d + 1).wrapping_mul(0x9e37_79b9));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let i = rng.gen_range(0..intents);
                        let fault = pick_fault(&mut rng);
                        let headers: Vec<(&str, &str)> = fault.iter().map(|f| ("toolgate-fault", f.as_str())).collect();
                        sent.lock().unwrap().insert(i);
                        let key = key_of(i);
                        if let Ok(answer) = client.try_call(&token, "create_refund", Some(&key), &args_of(i), &headers)
                        {
                            got.lock().unwrap().push(Got { key, answer });
                        } else {
                            // The server is dead (or dying): nothing to learn
                            // here; the intent is retried in recovery.
                            failed.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(10));
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(rng.gen_range(50..700)));
        let status = server.kill();
        stop.store(true, Ordering::Relaxed);
        for d in drivers {
            d.join().unwrap();
        }
        use std::os::unix::process::ExitStatusExt;
        match status.signal() {
            Some(9) => report.killed += 1,
            // SIGABRT: a `crash_after_commit` fault aborted the server first.
            Some(6) => report.self_aborted += 1,
            _ => panic!("seed {seed}: server run {run} ended otherwise: {status}"),
        }
    }
    report.failed_exchanges = failed_exchanges.load(Ordering::Relaxed);

    let sent: Vec<u64> = sent.lock().unwrap().iter().copied().collect();
    recover(&f, &token, &sent, &got, &mut report);
    let got = std::mem::take(&mut *got.lock().unwrap());
    report.answers = got.len();

    let (mut violations, tally) = check(f.path(), Expect { settled: true, queried: true });
    let db = RawDb::open(f.path());
    violations.extend(inconsistent_answers(&db, &got));
    report.tally = tally;
    eprintln!("crash loop over the API report (seed {seed}): {report:#?}");
    assert!(
        violations.is_empty(),
        "crash loop over the API broke invariants; reproduce with TOOLGATE_SEED={seed} TOOLGATE_SOAK={} \
         cargo test crash_loop_over_the_api\n{}",
        kills * 2,
        violations.join("\n")
    );
    assert_eq!(report.tally.duplicates, 0);
    assert!(report.killed + report.self_aborted == kills, "{report:#?}");
    assert!(report.killed > 0, "no server was killed: {report:#?}");
    assert!(report.tally.effects > 0 && report.answers > 0, "the loop did nothing: {report:#?}");

    // The answer checker is proven: a success answer with another refund,
    // or one turned into a definitive failure, is reported.
    let success = got.iter().find(|g| g.answer.body["model_result"]["status"] == "succeeded").unwrap();
    let mut forged = success.clone();
    forged.answer.body["model_result"]["data"]["refund_id"] = json!("re_0000000000000000");
    let mut denied = success.clone();
    denied.answer.status = 502;
    denied.answer.body["model_result"] = json!({
        "status": "failed", "data": null,
        "error": {"code": "TOOL_ERROR", "retryable": false, "recovery": "none"},
        "execution": {"outcome": "not_started", "delivery": "fresh"},
    });
    for (what, g) in [("another refund id", forged), ("a failure for a success", denied)] {
        assert!(!inconsistent_answers(&db, &[g]).is_empty(), "the answer checker missed {what}");
    }
}

/// Mostly no fault; otherwise one of the provider's failure modes, in real
/// time (short delays: recovery waits for them), `crash_after_commit` rarely.
fn pick_fault(rng: &mut StdRng) -> Option<String> {
    if rng.gen_bool(0.6) {
        return None;
    }
    Some(match rng.gen_range(0..20) {
        0..=3 => "timeout_after_commit".to_string(),
        4..=5 => format!("receipt_delay({})", rng.gen_range(100..MAX_RECEIPT_DELAY_MS)),
        6 => "connect_timeout".to_string(),
        7..=8 => format!("rate_limit({})", rng.gen_range(100..1_500)),
        9 => "unavailable".to_string(),
        10..=11 => "timeout_before_commit".to_string(),
        12 => "malformed_response".to_string(),
        13 => "mismatch_after_commit".to_string(),
        14 => "reject(card_declined)".to_string(),
        15 => format!("latency({})", rng.gen_range(10..300)),
        16 => "drop_after_commit".to_string(),
        17 => "crash_after_commit".to_string(),
        _ => "connect_timeout,timeout_after_commit".to_string(),
    })
}

/// A status the callers come back from later with the same key: in flight
/// (409), rate-limited (429), not sent yet or at capacity (503).
fn comes_back(a: &Answer) -> bool {
    matches!(a.status, 409 | 429 | 503)
}

/// Recovery: `toolgate reap`, a server of its own (whose worker and reaper
/// take over what the dead ones leased once the leases expire), every intent
/// retried until its answer settles, then a status query through the API for
/// each operation still unknown. Every answer is kept for the consistency check.
fn recover(f: &Fixture, token: &str, sent: &[u64], got: &Mutex<Vec<Got>>, report: &mut ApiLoopReport) {
    let reap = std::process::Command::new(bin()).arg("--db").arg(f.path()).args(["reap", "--json"]).output().unwrap();
    assert!(reap.status.success(), "toolgate reap: {}", String::from_utf8_lossy(&reap.stderr));
    let mut server = Server::start(f.path(), &[]);
    let c = Client::new(&server);
    let db = RawDb::open(f.path());
    // A generous bound, never an assertion on time: the dead servers' leases
    // run out in 6 s and the retries wait Retry-After (at most a few seconds).
    let give_up = Instant::now() + Duration::from_secs(180);
    let mut pending: Vec<u64> = sent.to_vec();
    while !pending.is_empty() {
        assert!(Instant::now() < give_up, "intents still not settled after retries: {pending:?}");
        let mut again = Vec::new();
        for &i in &pending {
            let a = c.try_call(token, "create_refund", Some(&key_of(i)), &args_of(i), &[]).unwrap();
            report.retried_in_recovery += 1;
            if comes_back(&a) {
                again.push(i);
            }
            got.lock().unwrap().push(Got { key: key_of(i), answer: a });
        }
        pending = again;
        if !pending.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    // Receipts delayed by a fault become visible once their delay has passed:
    // every delayed commit happened during the loop, before this.
    std::thread::sleep(Duration::from_millis(MAX_RECEIPT_DELAY_MS));
    let unknown =
        db.rows("SELECT idem_key, status_ref, request_sha256 FROM operations WHERE state = 'unknown' ORDER BY id", &[]);
    report.unknown_before_queries = unknown.len();
    for row in unknown {
        let (key, status_ref, sha) = (row[0].s(), row[1].s(), row[2].s());
        let a = c.post_json(
            token,
            "/v1/status-queries",
            &json!({"status_ref": status_ref, "expected_request_sha256": sha, "idempotency_key": key}),
        );
        if a.body["model_result"]["status"] == "succeeded" {
            report.reconciled_by_query += 1;
        }
        got.lock().unwrap().push(Got { key, answer: a });
    }
    let health = c.try_send("GET", "/healthz", None, &[], None).unwrap();
    assert_eq!(health.status, 200, "the server stopped answering");
    assert_eq!(server.terminate().code(), Some(0), "SIGTERM after recovery exits 0");
}

/// Every answer a caller got, against the ledger at rest. Returns one line
/// per disagreement:
/// - the HTTP status is the one the README's table gives the envelope;
/// - an answer naming an operation or a status_ref names the intent's own;
/// - a success is backed by the ledger: the intent succeeded (or was resolved
///   as succeeded) with exactly the data the caller was given;
/// - a definitive failure (nothing done, not retryable) is never
///   contradicted: the intent has no success in the ledger and no effect at
///   the provider;
/// - no answer says the caller misused a key (the driver never does).
fn inconsistent_answers(db: &RawDb, got: &[Got]) -> Vec<String> {
    use toolgate::api::status;
    let mut v = Vec::new();
    for Got { key, answer: a } in got {
        let mr = &a.body["model_result"];
        let said = mr["status"].as_str().unwrap_or("?");
        let code = mr["error"]["code"].as_str();
        let what = format!("{key}: HTTP {} {said} {code:?}", a.status);
        let op = db.row(
            "SELECT id, state, status_ref, result_json, resolution FROM operations
             WHERE tenant = 'acme' AND subject = 'agent_ana' AND tool = 'create_refund' AND idem_key = ?1",
            &[key],
        );
        let intent = crate::invariants::intent("acme", "agent_ana", "create_refund", key);
        let effects = db.rows("SELECT count(*) FROM provider_effects WHERE intent = ?1", &[&intent])[0][0].i();

        // The status the README's table gives this envelope.
        let expected: Vec<u16> = match (said, code) {
            ("succeeded", _) => vec![200],
            (_, Some("OUTCOME_UNKNOWN")) => vec![409, 504],
            (_, Some(c)) => match Code::parse(c) {
                Some(c) => vec![status::of_code(c, None).as_u16()],
                None => status::ALL
                    .iter()
                    .filter(|s| s.code == c)
                    .map(|s| s.status.as_u16())
                    .chain(c.starts_with("DB_").then_some(503))
                    .collect(),
            },
            _ => vec![],
        };
        if !expected.contains(&a.status) {
            v.push(format!("status: {what}, the table says {expected:?}"));
        }
        if matches!(code, Some("IDEMPOTENCY_CONFLICT" | "CALL_ID_CONFLICT" | "INVALID_ARGUMENTS" | "INTERNAL")) {
            v.push(format!("misuse: {what} although every retry carried the same arguments"));
        }
        let named_op = a.body["protected_audit"]["operation_id"].as_str();
        let named_ref = a.body["protected_audit"]["downstream"]["status_ref"].as_str();
        if let Some(id) = named_op {
            if op.as_ref().map(|o| o[0].s()).as_deref() != Some(id) {
                v.push(format!("identity: {what} names operation {id}, not the intent's"));
            }
        }
        if let Some(r) = named_ref {
            if op.as_ref().map(|o| o[2].s()).as_deref() != Some(r) {
                v.push(format!("identity: {what} names a status_ref that is not the intent's"));
            }
        }
        let ledger_success = op.as_ref().is_some_and(|o| {
            o[1].s() == "succeeded" || (o[1].s() == "resolved" && o[4].os().as_deref() == Some("succeeded"))
        });
        if said == "succeeded" {
            let stored = op.as_ref().and_then(|o| o[3].os()).and_then(|r| serde_json::from_str::<Value>(&r).ok());
            if !ledger_success {
                let state = op.as_ref().map_or("absent".to_string(), |o| o[1].s());
                v.push(format!("contradicted: {what}, but the ledger's operation is {state}"));
            } else if stored.as_ref() != Some(&mr["data"]) {
                v.push(format!("contradicted: {what} with data {} the ledger does not hold", mr["data"]));
            }
        }
        let definitive =
            said == "failed" && mr["execution"]["outcome"] == "not_started" && mr["error"]["retryable"] == false;
        if definitive && (ledger_success || effects > 0) {
            v.push(format!("contradicted: {what} is definitive, but the intent has {effects} effect(s) downstream"));
        }
    }
    v
}

crate::on_both_backends!(crash_loop_over_the_api_keeps_every_invariant);
