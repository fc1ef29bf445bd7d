//! Holds: a refund reserves what it grants from its order in the transaction
//! that accepts it, so agents refunding one order at once can never be paid
//! past its capture; the hold is released when the operation ends with no
//! effect, turned into the refund when it succeeds, and kept while the outcome
//! is unknown. The race runs on both backends, with a control: the lab toggle
//! that switches the reservation off (and the provider's own check removed)
//! pays money above the capture, and the audit and the referee see it.

use std::collections::HashSet;
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::time::{Duration, Instant};

use toolgate::engine::clock::{Clock, ManualClock};
use toolgate::engine::envelope::{Code, Status};
use toolgate::engine::{CancelRequest, DispatchRequest, Engine, EngineOptions, LabToggle, Resolution, ResolveRequest};

use crate::support::{dispatch_with, refund, refund_args, Backend, Fixture};

const ORDER: &str = "ord_1001";
/// ord_1001's capture in the demo world.
const CAPTURED: i64 = 12_000;
const THREADS: usize = 6;
const PER_THREAD: usize = 2;
/// 12 refunds of 3,000 against a capture of 12,000: at most 4 may be paid.
const AMOUNT: i64 = 3_000;

fn held(e: &mut Engine) -> i64 {
    e.holds().unwrap().iter().filter(|(_, r, _)| r == &format!("order:{ORDER}")).map(|h| h.2).sum()
}

fn order(e: &mut Engine) -> toolgate::tools::demo::OrderRow {
    toolgate::tools::demo::orders(e).unwrap().into_iter().find(|o| o.order_ref == ORDER).unwrap()
}

fn paid(e: &mut Engine) -> i64 {
    e.paid_by_order().unwrap().get(ORDER).copied().unwrap_or(0)
}

/// The fixture's manual clock with a gate: each caller's first wait inside
/// the provider (`latency`, after its re-check and sent-marker, before the
/// provider commits) parks until every racing caller is inside too, or until
/// a bound passes (callers refused at accept never arrive). So the race does
/// not depend on how threads happen to interleave: every call that got past
/// its rules is in flight at once, the window in which the old rule let each
/// of them see the same remaining amount.
struct GateClock {
    manual: ManualClock,
    arrived: Mutex<HashSet<std::thread::ThreadId>>,
    cv: Condvar,
}

impl Clock for GateClock {
    fn now_ms(&self) -> i64 {
        self.manual.now_ms()
    }

    fn sleep_ms(&self, ms: u64) {
        let mut arrived = self.arrived.lock().unwrap();
        if arrived.insert(std::thread::current().id()) {
            self.cv.notify_all();
            let bound = Instant::now() + Duration::from_secs(2);
            while arrived.len() < THREADS {
                let left = bound.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                arrived = self.cv.wait_timeout(arrived, left).unwrap().0;
            }
        }
        drop(arrived);
        self.manual.advance(ms as i64);
    }
}

/// What the watcher saw at one moment: (refunded, held, paid by the provider).
type Seen = (i64, i64, i64);

/// Six engines (own connections) refund one order at once; the first call of
/// each is held inside the provider until all are in flight (see
/// [`GateClock`]); a seventh engine watches the balance the whole time.
/// One caller's answer: its code and, for a refusal at accept, the rule.
type Answer = (Option<Code>, Option<String>);

fn race(fx: &Fixture) -> (Vec<Answer>, Vec<Seen>) {
    let gate = Arc::new(GateClock { manual: fx.clock.clone(), arrived: Mutex::default(), cv: Condvar::new() });
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..THREADS)
        .map(|t| {
            let o = EngineOptions {
                clock: gate.clone() as Arc<dyn Clock>,
                worker_id: format!("race-{t}"),
                ..toolgate::tools::demo_options()
            };
            let mut e = Engine::open(fx.path(), o).unwrap();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                (0..PER_THREAD)
                    .map(|i| {
                        code_of(&dispatch_with(&mut e, &refund_of(AMOUNT, &format!("hold-race-{t}-{i}")), "latency(5)"))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut watcher = fx.engine_named("watcher");
    barrier.wait();
    let watch = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let o = order(&mut watcher);
                seen.push((o.refunded_minor, held(&mut watcher), paid(&mut watcher)));
                std::thread::sleep(Duration::from_millis(2));
            }
            seen
        })
    };
    let codes: Vec<_> = callers.into_iter().flat_map(|c| c.join().unwrap()).collect();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    (codes, watch.join().unwrap())
}

/// The answer's code, and for a refusal at accept the rule that refused it
/// (a refusal by the provider carries none).
fn code_of(env: &toolgate::engine::envelope::Envelope) -> Answer {
    assert_ne!(env.model_result.status, Status::Unknown, "no fault leaves an outcome unknown here: {env:?}");
    let rule = env.model_result.error.as_ref().and_then(|e| e.detail.as_ref()).and_then(|d| d["rule"].as_str());
    (env.code(), rule.map(str::to_string))
}

fn concurrent_refunds_of_one_order_are_never_paid_past_its_capture(backend: Backend) {
    let fx = Fixture::on(backend);
    let (codes, seen) = race(&fx);
    let succeeded = codes.iter().filter(|(c, _)| c.is_none()).count() as i64;
    // Every refusal is the accept's, before anything is sent (not the provider's).
    let refused = codes
        .iter()
        .filter(|(c, rule)| {
            *c == Some(Code::BusinessRuleViolation)
                && matches!(rule.as_deref(), Some("amount_exceeds_remaining" | "order_not_refundable"))
        })
        .count() as i64;
    assert_eq!(succeeded + refused, (THREADS * PER_THREAD) as i64, "{codes:?}");
    assert_eq!(succeeded, CAPTURED / AMOUNT, "exactly what the capture covers is paid: {codes:?}");
    // At every moment the watcher looked: refunded + held <= captured, and the
    // provider never paid more than the capture.
    assert!(!seen.is_empty());
    for &(refunded, on_hold, out) in &seen {
        assert!(refunded + on_hold <= CAPTURED, "refunded {refunded} + held {on_hold} > {CAPTURED}");
        assert!(out <= CAPTURED, "paid {out} > {CAPTURED}");
    }
    let mut e = fx.engine();
    let o = order(&mut e);
    assert_eq!(o.refunded_minor, CAPTURED);
    assert_eq!(o.over_refunded_minor, 0);
    assert_eq!(paid(&mut e), CAPTURED);
    assert_eq!(held(&mut e), 0, "every hold converted or released at the end");
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

fn mark_demo(fx: &Fixture) {
    fx.exec("UPDATE meta SET value = '1' WHERE key = 'demo'", &[]);
    fx.exec(
        "INSERT INTO meta (key, value) SELECT 'demo', '1' WHERE NOT EXISTS (SELECT 1 FROM meta WHERE key = 'demo')",
        &[],
    );
}

/// The control: the same race with the reservation switched off (lab) and the
/// provider's charges removed (a provider that pays whatever it is sent) pays
/// money above the capture, and the audit says so. This is what the test above
/// would see if the holds did nothing.
fn without_the_reservation_the_same_race_pays_past_the_capture(backend: Backend) {
    let fx = Fixture::on(backend);
    mark_demo(&fx);
    fx.exec("DELETE FROM provider_charges", &[]);
    fx.engine().set_lab_toggle(Some(LabToggle::BalanceNotReserved), "teacher").unwrap();
    let (_, _) = race(&fx);
    let mut e = fx.engine();
    let o = order(&mut e);
    let out = paid(&mut e);
    // All six first calls were in flight at once, each past a rule that saw 12,000 left.
    assert!(out >= THREADS as i64 * AMOUNT, "the control must pay past the capture, paid {out}");
    assert_eq!(o.refunded_minor, CAPTURED);
    assert_eq!(o.over_refunded_minor, out - CAPTURED, "nothing clipped: the excess is kept");
    let findings = e.audit().unwrap();
    assert!(findings.iter().any(|f| f.detail.contains("over_captured")), "{findings:?}");
}

/// With the reservation off but the provider's own check on, the provider
/// refuses what the charge no longer covers: no money moves past the capture.
fn the_provider_refuses_a_refund_its_charge_does_not_cover(backend: Backend) {
    let fx = Fixture::on(backend);
    mark_demo(&fx);
    fx.engine().set_lab_toggle(Some(LabToggle::BalanceNotReserved), "teacher").unwrap();
    let (codes, _) = race(&fx);
    let mut e = fx.engine();
    assert_eq!(paid(&mut e), CAPTURED, "{codes:?}");
    assert_eq!(order(&mut e).over_refunded_minor, 0);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

fn refund_of(amount: i64, key: &str) -> DispatchRequest {
    DispatchRequest { arguments: refund_args(ORDER, amount).into_bytes(), ..refund(key, amount) }
}

/// Where each hold goes: kept while unknown (a second refund of the rest is
/// refused), converted by a status query that finds the receipt, released by
/// a definitive refusal, a cancel before send and a person's "failed".
fn each_hold_is_kept_converted_or_released_where_it_must(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Unknown: the reply was lost after the provider committed 8,000.
    let lost = dispatch_with(&mut e, &refund_of(8_000, "hold-lost-0001"), "timeout_after_commit");
    assert_eq!(lost.code(), Some(Code::OutcomeUnknown));
    assert_eq!(held(&mut e), 8_000, "an unknown outcome keeps its hold: the money may be gone");
    assert_eq!(order(&mut e).refunded_minor, 0);
    // 4,001 would fit what the order shows as refunded, but not what is held.
    let over = e.dispatch(&refund_of(4_001, "hold-over-0001")).unwrap();
    assert_eq!(over.code(), Some(Code::BusinessRuleViolation));
    assert_eq!(
        over.model_result.error.as_ref().and_then(|e| e.detail.clone()).unwrap()["rule"],
        "amount_exceeds_remaining"
    );
    // A definitive refusal releases its hold.
    let rejected = dispatch_with(&mut e, &refund_of(1_000, "hold-rejected-01"), "reject(card_declined)");
    assert_eq!(rejected.model_result.status, Status::Failed);
    assert_eq!(held(&mut e), 8_000);
    // A person's "failed" releases it; a status query's receipt converts it.
    let op = lost.protected_audit.operation_id.clone().unwrap();
    let q = e.operator_query(&op, "alice").unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded);
    assert_eq!(held(&mut e), 0);
    assert_eq!(order(&mut e).refunded_minor, 8_000);
    // Unknown again, then resolved as failed by a person (against no receipt).
    let second = dispatch_with(&mut e, &refund_of(3_000, "hold-lost-0002"), "timeout_before_commit");
    assert_eq!(second.code(), Some(Code::OutcomeUnknown));
    assert_eq!(held(&mut e), 3_000);
    let op2 = second.protected_audit.operation_id.clone().unwrap();
    // "No record" is proof of nothing until the receipt window passed.
    fx.clock.advance(66_000);
    let out = e.resolve(&crate::support::failed_by(&op2, "alice", "provider has no such refund")).unwrap();
    assert!(out.applied, "{out:?}");
    assert_eq!(held(&mut e), 0, "a person's failed releases the hold");
    // Cancelled before send: accepted with a retry pending (429), then cancelled.
    let limited = dispatch_with(&mut e, &refund_of(2_000, "hold-cancel-001"), "rate_limit(600000)");
    assert_eq!(limited.code(), Some(Code::RateLimit));
    assert_eq!(held(&mut e), 2_000, "a call waiting to be retried keeps its hold");
    let out = e
        .cancel(&CancelRequest {
            operation_id: limited.protected_audit.operation_id.clone().unwrap(),
            operator: "alice".into(),
            note: "customer withdrew".into(),
            seen_version: None,
            action_id: None,
        })
        .unwrap();
    assert!(out.applied, "{out:?}");
    assert_eq!(held(&mut e), 0, "cancelled before send: released");
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

crate::on_both_backends!(
    concurrent_refunds_of_one_order_are_never_paid_past_its_capture,
    without_the_reservation_the_same_race_pays_past_the_capture,
    the_provider_refuses_a_refund_its_charge_does_not_cover,
    each_hold_is_kept_converted_or_released_where_it_must,
);

/// A ledger written before holds existed (the demo database as committed at
/// schema version 13) opens, migrates, and holds what its refunds that may
/// still take effect reserve; the audit is clean.
#[test]
fn a_version_13_ledger_migrates_with_holds_for_its_open_refunds() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v13.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v13.db"), &path).unwrap();
    let c = crate::support::raw(&path);
    let v: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 13);
    let open: i64 = c
        .query_row(
            "SELECT coalesce(sum(json_extract(request_json, '$.arguments.amount_minor')), 0) FROM operations
             WHERE tool = 'create_refund' AND state NOT IN ('succeeded', 'failed', 'resolved')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(open > 0, "the fixture holds refunds whose outcome is open");
    drop(c);
    let clock = ManualClock::new(crate::support::T0);
    let mut e = Engine::open(&path, crate::support::opts(&clock, "migrate")).unwrap();
    let held: i64 = e.holds().unwrap().iter().map(|h| h.2).sum();
    assert_eq!(held, open);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// Money where the ledger says "no effect": a refund whose receipt the provider
/// shows only later is resolved as failed by a person while the lookup still
/// says "not found" (receipts lag); once the receipt is visible, the audit
/// reports the money (before, it looked up only succeeded operations and said
/// "no findings" while the refund had been paid).
fn the_audit_finds_money_paid_for_an_operation_resolved_as_failed(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund_of(2_500, "late-receipt-0001"), "receipt_delay(60000)");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown));
    let op = env.protected_audit.operation_id.clone().unwrap();
    let q = e.operator_query(&op, "alice").unwrap();
    assert_eq!(q.code(), Some(Code::OutcomeUnknown), "no receipt yet");
    // Inside the receipt window "failed" is refused; a person who insists
    // decides against the evidence (as the operator log records).
    let out = e
        .resolve_against_evidence(&ResolveRequest {
            operation_id: op.clone(),
            resolution: Resolution::Failed,
            operator: "alice".into(),
            note: "provider shows no refund".into(),
            evidence: None,
            seen_version: None,
            action_id: None,
            no_evidence: false,
        })
        .unwrap();
    assert!(out.applied, "{out:?}");
    assert!(e.audit().unwrap().is_empty(), "nothing visible yet: {:?}", e.audit().unwrap());
    fx.clock.advance(61_000);
    let findings = e.audit().unwrap();
    assert!(
        findings.iter().any(|f| f.check == "money" && f.reference == op),
        "the paid refund of an operation resolved as failed is found: {findings:?}"
    );
}

crate::on_both_backends!(the_audit_finds_money_paid_for_an_operation_resolved_as_failed);

/// The money check asks the provider about operations that had no effect; a
/// person's "failed" that names a receipt id (as evidence of nothing) is still
/// an operation with no effect, not a succeeded one (a case the state-machine
/// property found: timeout_before_commit, then resolved as failed).
#[test]
fn a_failed_resolution_with_evidence_is_checked_as_no_effect() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund_of(700, "no-effect-00001"), "timeout_before_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown));
    fx.clock.advance(66_000);
    let out = e
        .resolve(&ResolveRequest {
            operation_id: env.protected_audit.operation_id.clone().unwrap(),
            resolution: Resolution::Failed,
            operator: "alice".into(),
            note: "never reached the provider".into(),
            evidence: Some("rcpt_from_operator".into()),
            seen_version: None,
            action_id: None,
            no_evidence: false,
        })
        .unwrap();
    assert!(out.applied, "{out:?}");
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// An amount written with a zero fraction (`12000.0`, an integer to the
/// schema and `12000` in the canonical form) is held and counted like `12000`.
#[test]
fn an_amount_with_a_zero_fraction_is_held_and_counted() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    let whole = |amount: &str, key: &str| DispatchRequest {
        arguments: format!(r#"{{"order_ref":"ord_1001","amount_minor":{amount},"currency":"EUR","reason":"damaged"}}"#)
            .into_bytes(),
        ..refund(key, 1)
    };
    let lost = dispatch_with(&mut e, &whole("11000.0", "zero-fraction-01"), "timeout_after_commit");
    assert_eq!(lost.code(), Some(Code::OutcomeUnknown));
    assert_eq!(held(&mut e), 11_000);
    let over = e.dispatch(&whole("1001.0", "zero-fraction-02")).unwrap();
    assert_eq!(over.code(), Some(Code::BusinessRuleViolation), "{over:?}");
    let fits = e.dispatch(&whole("1000.0", "zero-fraction-03")).unwrap();
    assert_eq!(fits.model_result.status, Status::Succeeded, "{fits:?}");
    assert_eq!(held(&mut e), 11_000);
    assert_eq!(order(&mut e).refunded_minor, 1_000);
}
