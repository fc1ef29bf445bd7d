//! Resilience policies (docs/design.md §11): backoff with full jitter, Retry-After, the
//! per-tool retry budget, the per-downstream circuit breaker, deadlines, and
//! cancellation before and after send (with a late reply that must not flip it).
//! Time is a manual clock throughout; where a call must really be inside the
//! provider while the test acts, a gated clock parks it there.

use std::sync::Arc;

use serde_json::Value;
use toolgate::engine::clock::Clock;
use toolgate::engine::envelope::{Code, Delivery, Envelope, Outcome, Status};
use toolgate::engine::ids::Ids;
use toolgate::engine::policy::{backoff_ms, retry_delay_ms};
use toolgate::engine::{CancelRequest, Engine, QueryRequest};
use toolgate::store::{CircuitRow, RetryBudgetRow, TraceRow};

use crate::support::{dispatch_parked, dispatch_with, duplicates, effects, refund, Backend, Fixture, GateClock};

fn trace(e: &mut Engine, env: &Envelope) -> Vec<TraceRow> {
    let id = env.protected_audit.operation_id.clone().unwrap();
    e.read(|tx| tx.trace_for(&id)).unwrap()
}

fn field(t: &TraceRow, name: &str) -> Value {
    serde_json::from_str::<Value>(&t.fields).unwrap()[name].clone()
}

fn circuit(e: &mut Engine, downstream: &str) -> Option<CircuitRow> {
    e.read(|tx| tx.circuit(downstream)).unwrap()
}

fn budget(e: &mut Engine, tool: &str) -> Option<RetryBudgetRow> {
    let rows = e.read(|tx| tx.retry_budgets().map(|r| r.into_iter().find(|b| b.tool == tool)));
    rows.unwrap()
}

fn state_of(e: &mut Engine, env: &Envelope) -> String {
    let id = env.protected_audit.operation_id.clone().unwrap();
    e.operation_detail(&id).unwrap().unwrap().operation.state.to_string()
}

fn operations(e: &mut Engine) -> i64 {
    e.counts().unwrap().operations.values().sum()
}

fn backoff_is_full_jitter_within_its_bounds(backend: Backend) {
    let ids = Ids::seeded(42);
    for attempt in 1..=8u32 {
        let bound = (200u64 << (attempt - 1)).min(5_000);
        let samples: Vec<u64> = (0..400).map(|_| backoff_ms(&ids, 200, 5_000, attempt)).collect();
        assert!(samples.iter().all(|d| *d <= bound), "attempt {attempt}: above {bound}");
        // Full jitter: spread over the whole range, not clustered at the bound.
        let (lo, hi) = (samples.iter().min().unwrap(), samples.iter().max().unwrap());
        assert!(*lo < bound / 10 && *hi > bound * 9 / 10, "attempt {attempt}: {lo}..{hi} of {bound}");
    }
    // In a real retry, the wait between attempts is one such draw.
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("jitter-key-0001", 100), "unavailable,unavailable,ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    let waits: Vec<u64> = trace(&mut e, &env)
        .iter()
        .filter(|t| t.reason.as_deref() == Some("retry_scheduled"))
        .map(|t| field(t, "retry_after_ms").as_u64().unwrap())
        .collect();
    assert_eq!(waits.len(), 2);
    assert!(waits[0] <= 200 && waits[1] <= 400, "{waits:?}");
}

fn retry_after_beats_backoff_when_larger(backend: Backend) {
    for (backoff, after, expect) in [(150, Some(3_000), 3_000), (150, Some(20), 150), (150, None, 150)] {
        assert_eq!(retry_delay_ms(backoff, after), expect);
    }
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let t0 = fx.clock.now_ms();
    let env = dispatch_with(&mut e, &refund("retry-after-0001", 100), "rate_limit(3000),ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    let scheduled: Vec<u64> = trace(&mut e, &env)
        .iter()
        .filter(|t| t.reason.as_deref() == Some("retry_scheduled"))
        .map(|t| field(t, "retry_after_ms").as_u64().unwrap())
        .collect();
    // The first backoff is at most 200 ms: the provider's 3 s wins.
    assert_eq!(scheduled, vec![3_000]);
    assert_eq!(fx.clock.now_ms() - t0, 3_000, "the retry waited Retry-After");
    // A smaller Retry-After loses to the backoff (never below the provider's ask).
    let env = dispatch_with(&mut e, &refund("retry-after-0002", 100), "rate_limit(1),ok");
    let waited: Vec<u64> = trace(&mut e, &env)
        .iter()
        .filter(|t| t.reason.as_deref() == Some("retry_scheduled"))
        .map(|t| field(t, "retry_after_ms").as_u64().unwrap())
        .collect();
    assert!(waited.len() == 1 && (1..=200).contains(&waited[0]), "{waited:?}");
    assert_eq!((effects(&mut e), duplicates(&mut e)), (2, 0));
}

fn the_budget_stops_retries_when_exhausted_and_load_refills_it(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Model of the bucket: capacity 10 tokens, +0.2 per first attempt, -1 per retry
    // (create_refund's contract), in thousandths.
    let (cap, deposit, cost) = (10_000i64, 200i64, 1_000i64);
    let mut tokens: Option<i64> = None;
    let mut refused_at = None;
    for i in 0..30 {
        let env = dispatch_with(&mut e, &refund(&format!("budget-key-{i:04}"), 1), "unavailable,ok");
        if let Some(t) = tokens.as_mut() {
            *t = (*t + deposit).min(cap);
        }
        let t = tokens.get_or_insert(cap);
        if *t >= cost {
            *t -= cost;
            assert_eq!(env.model_result.status, Status::Succeeded, "retry {i} had a token");
        } else {
            // Refused: not sent, still retryable, with a hint when to come back.
            let err = env.model_result.error.clone().unwrap();
            assert_eq!((err.code, err.retryable), (Code::ToolUnavailable, true), "retry {i}");
            assert!(err.retry_after_ms.unwrap() > 0);
            assert_eq!(env.model_result.execution.outcome, Outcome::NotStarted);
            assert_eq!(state_of(&mut e, &env), "accepted");
            assert!(trace(&mut e, &env).iter().any(|t| t.reason.as_deref() == Some("budget_exhausted")));
            refused_at = Some((i, env));
            break;
        }
    }
    let (i, waiting) = refused_at.expect("the budget ran out");
    assert_eq!(i, 12, "10 tokens, 0.8 net cost per operation: the 13th retry is refused");
    let b = budget(&mut e, "create_refund").unwrap();
    assert_eq!((b.retries, b.refused), (12, 1));
    assert!(b.retries * cost <= cap + deposit * (i64::from(i) + 1), "retries stay within burst + ratio of load");
    // Fresh load deposits again; the waiting intent's retry then goes through once.
    for j in 0..5 {
        dispatch_with(&mut e, &refund(&format!("refill-key-{j:04}"), 1), "ok");
    }
    fx.clock.advance(10_000);
    let env = dispatch_with(&mut e, &refund(&format!("budget-key-{i:04}"), 1), "ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    assert_eq!(env.protected_audit.operation_id, waiting.protected_audit.operation_id);
    assert_eq!(duplicates(&mut e), 0);
}

fn nothing_is_retried_past_the_deadline(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Rate-limited for ever (each wait at least 400 ms): retries stop when the
    // next one would pass the 1 s deadline, whatever the jitter drew.
    let mut r = refund("deadline-key-0001", 100);
    r.deadline_ms = Some(1_000);
    let env = dispatch_with(&mut e, &r, &["rate_limit(400)"; 40].join(","));
    let err = env.model_result.error.clone().unwrap();
    assert_eq!((err.code, err.retryable), (Code::RateLimit, true));
    assert!(err.retry_after_ms.is_some());
    let id = env.protected_audit.operation_id.clone().unwrap();
    let d = e.operation_detail(&id).unwrap().unwrap();
    assert!(d.attempts.iter().all(|a| a.claimed_at < d.operation.deadline_at), "an attempt past the deadline");
    assert!(d.attempts.len() < 5, "the deadline, not the attempt cap, stopped it");
    assert!(d.trace.iter().any(|t| t.reason.as_deref() == Some("deadline_exhausted")));
    assert_eq!(d.operation.state, "accepted", "still retryable");

    // Retry-After beyond the deadline: not retried at all, the caller gets it.
    let mut r = refund("deadline-key-0002", 100);
    r.deadline_ms = Some(2_000);
    let env = dispatch_with(&mut e, &r, "rate_limit(5000)");
    let err = env.model_result.error.clone().unwrap();
    assert_eq!((err.code, err.retry_after_ms), (Code::RateLimit, Some(5_000)));
    let id = env.protected_audit.operation_id.clone().unwrap();
    assert_eq!(e.operation_detail(&id).unwrap().unwrap().attempts.len(), 1);

    // A deadline that has expired before the accept: TIMEOUT_BEFORE_EXECUTE,
    // refused before accept (issue 33 Medium 5): no operation, nothing sent.
    let mut r = refund("deadline-key-0003", 100);
    r.deadline_ms = Some(0);
    let env = dispatch_with(&mut e, &r, "ok");
    let err = env.model_result.error.clone().unwrap();
    assert_eq!((err.code, err.retryable), (Code::TimeoutBeforeExecute, true));
    assert_eq!(env.model_result.execution.outcome, Outcome::NotStarted);
    assert_eq!(env.protected_audit.operation_id, None, "not accepted");
    assert_eq!(effects(&mut e), 0);
    // It stays retryable: a retry with the same key and a live deadline runs once.
    let env = dispatch_with(&mut e, &refund("deadline-key-0003", 100), "ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    assert_eq!((effects(&mut e), duplicates(&mut e)), (1, 0));
}

/// Dispatches operations whose every attempt fails until the payments circuit opens.
fn open_payments(e: &mut Engine, prefix: &str) {
    for i in 0..30 {
        if circuit(e, "payments").is_some_and(|c| c.state == "open") {
            return;
        }
        dispatch_with(e, &refund(&format!("{prefix}-failing-{i:04}"), 1), &["unavailable"; 5].join(","));
    }
    panic!("the circuit never opened");
}

fn the_breaker_opens_half_opens_and_closes(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Operations whose every attempt fails, until ten failures in a row open it.
    open_payments(&mut e, "breaker-a");
    let c = circuit(&mut e, "payments").unwrap();
    assert_eq!((c.state.as_str(), c.opened_total, c.consecutive_failures), ("open", 1, 10));
    let open_until = c.open_until.unwrap();

    // Open: a new call is refused before accept; only its trace event is stored.
    let ops_before = operations(&mut e);
    let env = dispatch_with(&mut e, &refund("breaker-key-0100", 1), "ok");
    let err = env.model_result.error.clone().unwrap();
    assert_eq!((err.code, err.retryable), (Code::ToolUnavailable, true));
    assert_eq!(err.retry_after_ms, Some((open_until - fx.clock.now_ms()) as u64));
    assert_eq!(env.protected_audit.operation_id, None);
    assert_eq!(operations(&mut e), ops_before, "nothing accepted");
    let last = e.read(|tx| tx.trace_since(0, i64::MIN, 100_000)).unwrap().pop().unwrap();
    assert_eq!((last.step.as_str(), last.reason.as_deref()), ("circuit", Some("circuit_open")));
    // A replay of a finished intent never touches the downstream: still answered.
    assert_eq!(circuit(&mut e, "payments").unwrap().refused_total, 1);

    // After the cool-down one probe goes through (half-open); others wait for it.
    fx.clock.set(open_until);
    let clock = GateClock::new(&fx.clock);
    let probe = dispatch_parked(&fx, &clock, refund("breaker-key-0200", 1));
    let c = circuit(&mut e, "payments").unwrap();
    assert_eq!(c.state, "half_open");
    assert!(c.probe_operation.is_some());
    let env = dispatch_with(&mut e, &refund("breaker-key-0201", 1), "ok");
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "a second call while the probe is out");
    assert!(env.model_result.error.unwrap().retry_after_ms.unwrap() > 0);
    // The probe's healthy reply closes it.
    clock.open();
    let env = probe.join().unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded);
    let c = circuit(&mut e, "payments").unwrap();
    assert_eq!((c.state.as_str(), c.consecutive_failures), ("closed", 0));
    let env = dispatch_with(&mut e, &refund("breaker-key-0201", 1), "ok");
    assert_eq!(env.model_result.status, Status::Succeeded);

    // A failing probe opens it again, for another cool-down.
    open_payments(&mut e, "breaker-b");
    let open_until = circuit(&mut e, "payments").unwrap().open_until.unwrap();
    fx.clock.set(open_until);
    dispatch_with(&mut e, &refund("breaker-key-0400", 1), "connect_timeout");
    let c = circuit(&mut e, "payments").unwrap();
    assert_eq!((c.state.as_str(), c.opened_total), ("open", 3));
    // Notifications have their own circuit: untouched.
    assert!(circuit(&mut e, "notifications").is_none());
    assert_eq!(duplicates(&mut e), 0);
}

fn an_open_circuit_holds_accepted_operations_without_sending(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Accepted and waiting for its retry (a 429 beyond the deadline)...
    let mut r = refund("held-key-0001", 1);
    r.deadline_ms = Some(1_000);
    let waiting = dispatch_with(&mut e, &r, "rate_limit(2000)");
    assert_eq!(waiting.code(), Some(Code::RateLimit));
    // ...then the circuit opens.
    open_payments(&mut e, "held");
    assert_eq!(circuit(&mut e, "payments").unwrap().state, "open");
    fx.clock.advance(2_000);
    // The caller's retry is refused at the claim: not sent, still accepted.
    let env = dispatch_with(&mut e, &refund("held-key-0001", 1), "ok");
    assert_eq!(env.code(), Some(Code::ToolUnavailable));
    assert_eq!(env.protected_audit.operation_id, waiting.protected_audit.operation_id);
    assert_eq!(state_of(&mut e, &env), "accepted");
    let id = env.protected_audit.operation_id.clone().unwrap();
    assert_eq!(e.operation_detail(&id).unwrap().unwrap().attempts.len(), 1, "no second attempt");
    assert_eq!(effects(&mut e), 0);
}

fn cancel(e: &mut Engine, env: &Envelope, note: &str) -> toolgate::engine::OperatorOutcome {
    e.cancel(&CancelRequest {
        operation_id: env.protected_audit.operation_id.clone().unwrap(),
        operator: "oncall-kim".into(),
        note: note.into(),
        ..CancelRequest::default()
    })
    .unwrap()
}

fn cancelling_before_send_cancels_with_no_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut r = refund("cancel-key-0001", 100);
    r.deadline_ms = Some(1_000);
    let waiting = dispatch_with(&mut e, &r, "rate_limit(5000)");
    assert_eq!(state_of(&mut e, &waiting), "accepted");
    let out = cancel(&mut e, &waiting, "customer withdrew the request");
    assert!(out.applied, "{out:?}");
    assert_eq!(state_of(&mut e, &waiting), "failed");
    // Terminal: a retry of the intent replays the cancellation, nothing runs.
    fx.clock.advance(10_000);
    let env = dispatch_with(&mut e, &refund("cancel-key-0001", 100), "ok");
    assert_eq!(env.code(), Some(Code::Cancelled));
    assert_eq!((env.model_result.status, env.model_result.execution.delivery), (Status::Failed, Delivery::LocalReplay));
    assert_eq!(env.model_result.execution.outcome, Outcome::NotStarted);
    assert_eq!(e.work(100).unwrap(), 0);
    assert_eq!(effects(&mut e), 0);
    // Cancelling again is refused, and both attempts are in the operator log.
    let again = cancel(&mut e, &waiting, "again");
    assert_eq!((again.applied, again.code), (false, "NOT_CANCELLABLE"));
    let log = e.audit_log(10).unwrap();
    let mine: Vec<_> = log.iter().filter(|a| a.action == "cancel").map(|a| a.result.as_str()).collect();
    assert_eq!(mine, vec!["refused", "applied"]);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());

    // A worker that claimed but had not sent yet loses the race: its sent-marker is fenced.
    let mut r = refund("cancel-key-0002", 100);
    r.deadline_ms = Some(1_000);
    let env = dispatch_with(&mut e, &r, "rate_limit(5000)");
    let id = env.protected_audit.operation_id.clone().unwrap();
    let now = fx.clock.now_ms() + 6_000;
    fx.clock.set(now);
    // A zombie worker: its own connection, writing as a worker would.
    let mut zombie = toolgate::store::Store::open(fx.path(), toolgate::store::OpenOptions::default()).unwrap();
    let attempt = zombie.write(|tx| tx.claim(&id, "zombie", now, now + 6_000)).unwrap().unwrap();
    let out = cancel(&mut e, &env, "stop it");
    assert!(out.applied);
    assert!(!zombie.write(|tx| tx.mark_sent(&id, "zombie", attempt, now)).unwrap(), "the zombie cannot send");
    let d = e.operation_detail(&id).unwrap().unwrap();
    assert_eq!((d.operation.state.as_str(), d.operation.code.as_deref()), ("failed", Some("CANCELLED")));
    assert_eq!(d.attempts.last().unwrap().outcome, Some(toolgate::store::AttemptOutcome::NotSent));
    assert_eq!(effects(&mut e), 0);
}

fn cancelling_after_send_parks_it_and_a_late_receipt_settles_it_through_the_provider(backend: Backend) {
    let fx = Fixture::on(backend);
    let clock = GateClock::new(&fx.clock);
    let req = refund("cancel-key-0100", 100);
    // A worker is inside the provider: claimed, sent-marker committed.
    let worker = dispatch_parked(&fx, &clock, req.clone());
    let mut e = fx.engine();
    let id = e.list_operations(Some(toolgate::store::OpState::InFlight), 10).unwrap().pop().unwrap().id;
    let out = e
        .cancel(&CancelRequest {
            operation_id: id.clone(),
            operator: "oncall-kim".into(),
            note: "agent loop went wrong".into(),
            ..CancelRequest::default()
        })
        .unwrap();
    assert!(out.applied && out.message.contains("unknown queue"), "{out:?}");
    assert_eq!(e.operation_detail(&id).unwrap().unwrap().operation.state, "unknown");
    // Already in the unknown queue: cancelling again is refused, and says why.
    let again = e
        .cancel(&CancelRequest {
            operation_id: id.clone(),
            operator: "kim".into(),
            note: "x".into(),
            ..CancelRequest::default()
        })
        .unwrap();
    assert_eq!((again.applied, again.code), (false, "NOT_CANCELLABLE"));
    assert!(again.message.contains("unknown queue"), "{again:?}");
    // The provider commits and replies after the cancel. The reply does not
    // write the row (its fence fails): its caller is told what the row said,
    // and its receipt makes toolgate ask the provider, whose answer settles it.
    clock.open();
    let answered = worker.join().unwrap();
    assert_eq!(answered.code(), Some(Code::OutcomeUnknown));
    let d = e.operation_detail(&id).unwrap().unwrap();
    let late = d.trace.iter().find(|t| t.step == "late_reply").expect("the late reply is in the trace");
    assert!(field(late, "receipt_id").is_string(), "the receipt is kept as evidence");
    assert_eq!(d.operation.state, "succeeded", "settled by the provider's receipt, asked by key");
    assert_eq!(d.operation.last_query_result.as_deref(), Some("reconciled"));
    assert!(
        d.audit.iter().any(|a| a.action == "query" && a.actor == "toolgate-late-reply"),
        "the query the late reply caused is in the operator log: {:?}",
        d.audit
    );
    assert_eq!((effects(&mut e), duplicates(&mut e)), (1, 0));
    let retry = dispatch_with(&mut e, &req, "ok");
    assert_eq!(retry.model_result.status, Status::Succeeded);
    assert_eq!(retry.model_result.execution.delivery, Delivery::LocalReplay);
    let q = e
        .query_operation_status(&QueryRequest {
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            status_ref: retry.status_ref().unwrap().to_string(),
            expected_request_sha256: retry.protected_audit.binding.request_sha256.clone().unwrap(),
            ..QueryRequest::default()
        })
        .unwrap();
    assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert_eq!((effects(&mut e), duplicates(&mut e)), (1, 0));
    // Settled by the receipt, it is finished: nothing left to cancel.
    let done = e
        .cancel(&CancelRequest {
            operation_id: id,
            operator: "kim".into(),
            note: "x".into(),
            ..CancelRequest::default()
        })
        .unwrap();
    assert_eq!((done.applied, done.code), (false, "NOT_CANCELLABLE"));
}

fn cancel_requires_an_operator_a_note_and_the_version_seen(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut r = refund("cancel-key-0200", 100);
    r.deadline_ms = Some(1_000);
    let env = dispatch_with(&mut e, &r, "rate_limit(5000)");
    let id = env.protected_audit.operation_id.clone().unwrap();
    let version = e.operation_detail(&id).unwrap().unwrap().operation.version;
    for (operator, note, seen, code) in [
        ("", "n", None, "OPERATOR_REQUIRED"),
        ("kim", " ", None, "NOTE_REQUIRED"),
        ("kim", "n", Some(version - 1), "STALE_VERSION"),
    ] {
        let out = e
            .cancel(&CancelRequest {
                operation_id: id.clone(),
                operator: operator.into(),
                note: note.into(),
                seen_version: seen,
                action_id: None,
            })
            .unwrap();
        assert_eq!((out.applied, out.code), (false, code));
    }
    let ok = CancelRequest {
        operation_id: id.clone(),
        operator: "kim".into(),
        note: "n".into(),
        seen_version: Some(version),
        action_id: Some("act-cancel-1".into()),
    };
    assert!(e.cancel(&ok).unwrap().applied);
    // The same action again is the same outcome, not a second row.
    let again = e.cancel(&ok).unwrap();
    assert!(again.applied && again.message.contains("already recorded"));
    let applied = e.audit_log(20).unwrap().iter().filter(|a| a.action == "cancel" && a.result == "applied").count();
    assert_eq!(applied, 1);
    assert_eq!(e.operation_detail(&id).unwrap().unwrap().operation.state, "failed");
}

fn an_attempt_never_waits_past_the_operation_deadline_whatever_the_downstream_does(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut req = refund("refund-deadline-holds", 100);
    req.deadline_ms = Some(2_000);
    req.call = Some(crate::support::call("call_deadline"));
    let t0 = fx.clock.now_ms();
    // The provider takes 8 s; the operation has 2 s.
    let env = dispatch_with(&mut e, &req, "latency(8000)");
    let waited = fx.clock.now_ms() - t0;
    assert!(waited <= 2_000, "the call waited {waited} ms on the engine's clock");
    // Sent, no reply in time: unknown, never a blind retry.
    assert_eq!(env.code(), Some(Code::OutcomeUnknown));
    // The provider's effect lands 8 s after the request: a lookup before then finds nothing.
    let q = |e: &mut toolgate::engine::Engine, id: &str| {
        e.query_operation_status(&toolgate::engine::QueryRequest {
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            status_ref: env.status_ref().unwrap().to_string(),
            expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap(),
            idempotency_key: None,
            call: Some(crate::support::call(id)),
            operator: None,
        })
        .unwrap()
    };
    assert_eq!(q(&mut e, "call_q_early").code(), Some(Code::OutcomeUnknown));
    fx.clock.advance(7_000);
    assert_eq!(q(&mut e, "call_q_late").model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert_eq!(effects(&mut e), 1);
}

#[test]
fn fault_durations_are_bounded_inputs() {
    use toolgate::downstream::FaultPlan;
    for bad in
        ["latency(18446744073709551615)", "latency(3600001)", "rate_limit(99999999999)", "receipt_delay(999999999999)"]
    {
        assert!(FaultPlan::parse(bad).is_err(), "{bad} was accepted");
    }
    for ok in ["latency(3600000)", "rate_limit(1500)", "receipt_delay(3600000)"] {
        assert!(FaultPlan::parse(ok).is_ok(), "{ok} was refused");
    }
}

#[test]
#[allow(clippy::float_cmp)] // gauges of small whole numbers: exact in f64
fn the_retry_budget_and_the_breaker_are_exported() {
    use toolgate::telemetry::metrics::{snapshot, Slice, Window};
    let fx = Fixture::new();
    let mut e = fx.engine();
    let labels = |tool: &str, state: &str| [("tool", tool.to_string()), ("state", state.to_string())];
    let value = |snap: &toolgate::telemetry::metrics::MetricsSnapshot, name: &str, l: &[(&str, String)]| {
        let l: Vec<(&str, &str)> = l.iter().map(|(k, v)| (*k, v.as_str())).collect();
        snap.total(name, &l)
    };
    let snap = snapshot(&mut e, Window::default(), &Slice::default()).unwrap();
    assert!(snap.not_tracked.is_empty());
    assert_eq!(value(&snap, "toolgate_circuit_state", &labels("create_refund", "closed")), 1.0);
    let full = value(&snap, "toolgate_retry_budget_tokens", &[("tool", "create_refund".into())]);
    assert_eq!(full, value(&snap, "toolgate_retry_budget_capacity", &[("tool", "create_refund".into())]));
    assert!(full > 0.0);
    open_payments(&mut e, "export-a");
    let c = circuit(&mut e, "payments").unwrap();
    let snap = snapshot(&mut e, Window::default(), &Slice::default()).unwrap();
    assert_eq!(value(&snap, "toolgate_circuit_state", &labels("create_refund", "open")), 1.0);
    assert_eq!(value(&snap, "toolgate_circuit_state", &labels("create_refund", "closed")), 0.0);
    let since = value(&snap, "toolgate_circuit_open_since_seconds", &[("tool", "create_refund".into())]);
    assert!(since > 0.0 && since * 1000.0 < c.open_until.unwrap() as f64, "{since}");
    let left = value(&snap, "toolgate_retry_budget_tokens", &[("tool", "create_refund".into())]);
    let b = budget(&mut e, "create_refund").unwrap();
    assert!((left - b.tokens_milli as f64 / 1000.0).abs() < 1e-9, "{left} vs {b:?}");
    // And the Prometheus text parses with them in it.
    let text = toolgate::telemetry::prometheus::render(&snap);
    assert!(text.contains("toolgate_circuit_state{"), "{text}");
    let lines = text.lines().map(|l| Ok(l.to_string()));
    prometheus_parse::Scrape::parse(lines).unwrap();
}

/// Six dispatchers, each with its own engine and connections (hosts, on
/// PostgreSQL), call the downstream at once right after its circuit cooled
/// down: exactly one of them becomes the half-open probe and sends; every
/// other call is refused without sending (the probe fails, so the circuit
/// opens again and nothing else gets through).
fn concurrent_callers_never_both_become_the_half_open_probe(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    open_payments(&mut e, "probe-race");
    let open_until = circuit(&mut e, "payments").unwrap().open_until.unwrap();
    fx.clock.set(open_until);
    let hosts = 6;
    let barrier = Arc::new(std::sync::Barrier::new(hosts));
    let threads: Vec<_> = (0..hosts)
        .map(|i| {
            let mut host = fx.engine();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                dispatch_with(&mut host, &refund(&format!("probe-race-call-{i:04}"), 1), "unavailable")
            })
        })
        .collect();
    let answers: Vec<Envelope> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    for env in &answers {
        assert_eq!(env.code(), Some(Code::ToolUnavailable), "{:?}", env.model_result);
    }
    let sent = fx.query_i64(
        "SELECT count(*) FROM attempts a JOIN operations o ON o.id = a.operation_id
         WHERE o.idem_key LIKE 'probe-race-call-%' AND a.sent_at IS NOT NULL",
    );
    assert_eq!(sent, 1, "exactly one probe was sent");
    let c = circuit(&mut e, "payments").unwrap();
    assert_eq!(c.state, "open", "the failed probe opened it again");
    assert_eq!(duplicates(&mut e), 0);
}

crate::on_both_backends!(
    concurrent_callers_never_both_become_the_half_open_probe,
    backoff_is_full_jitter_within_its_bounds,
    retry_after_beats_backoff_when_larger,
    the_budget_stops_retries_when_exhausted_and_load_refills_it,
    nothing_is_retried_past_the_deadline,
    the_breaker_opens_half_opens_and_closes,
    an_open_circuit_holds_accepted_operations_without_sending,
    cancelling_before_send_cancels_with_no_effect,
    cancelling_after_send_parks_it_and_a_late_receipt_settles_it_through_the_provider,
    cancel_requires_an_operator_a_note_and_the_version_seen,
    an_attempt_never_waits_past_the_operation_deadline_whatever_the_downstream_does,
);
