//! The dispatch pipeline: replay, conflicts, races, atomicity, leases, timeouts,
//! call identities, tampering and hostile input.

use std::sync::{Arc, Barrier};
use toolgate::Coded;

use serde_json::Value;
use toolgate::engine::envelope::{Code, Delivery, Outcome, Recovery, Status};
use toolgate::engine::DispatchRequest;
use toolgate::store::{OpenOptions, Store, StoreError, Sync};

use crate::support::{call, code, dispatch_with, duplicates, effects, raw, refund, snapshot, Backend, Fixture};

fn first_success_then_replay_after_restart_and_from_another_connection(backend: Backend) {
    let fx = Fixture::on(backend);
    let first = {
        let mut e = fx.engine();
        let env = e.dispatch(&refund("refund-key-001", 1000)).unwrap();
        assert_eq!(env.model_result.status, Status::Succeeded);
        assert_eq!(env.model_result.execution.delivery, Delivery::Fresh);
        assert_eq!(effects(&mut e), 1);
        env
    };
    // A new engine = a restarted process with its own connections.
    let mut e2 = fx.engine_named("w-second");
    let mut replay = e2.dispatch(&refund("refund-key-001", 1000)).unwrap();
    assert_eq!(replay.model_result.execution.delivery, Delivery::LocalReplay);
    assert_eq!(replay.model_result.data, first.model_result.data);
    assert_eq!(replay.protected_audit.downstream.status_ref, first.protected_audit.downstream.status_ref);
    assert_eq!(effects(&mut e2), 1);
    // Mutating what a caller got back cannot change later replays.
    replay.model_result.data.as_mut().unwrap()["refund_id"] = Value::from("re_tampered");
    let again = e2.dispatch(&refund("refund-key-001", 1000)).unwrap();
    assert_eq!(again.model_result.data, first.model_result.data);
    let order =
        toolgate::tools::demo::orders(&mut e2).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
    assert_eq!((order.refunded_minor, order.status.as_str()), (1000, "partially_refunded"));
}

fn same_key_other_arguments_conflicts_in_every_state_and_scopes_are_independent(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    e.dispatch(&refund("refund-key-002", 1000)).unwrap();
    let c = e.dispatch(&refund("refund-key-002", 1500)).unwrap();
    assert_eq!(code(&c), Some(Code::IdempotencyConflict));
    assert!(!c.model_result.error.as_ref().unwrap().retryable);
    assert_eq!(c.model_result.error.as_ref().unwrap().recovery, Recovery::HumanReview);

    // While unknown.
    let u = dispatch_with(&mut e, &refund("refund-key-003", 700), "timeout_after_commit");
    assert_eq!(code(&u), Some(Code::OutcomeUnknown));
    assert_eq!(code(&e.dispatch(&refund("refund-key-003", 701)).unwrap()), Some(Code::IdempotencyConflict));

    // While accepted and waiting to retry (in the outbox).
    let mut waiting = refund("refund-key-004", 800);
    waiting.deadline_ms = Some(1000);
    let w = dispatch_with(&mut e, &waiting, "rate_limit(60000)");
    assert_eq!(code(&w), Some(Code::RateLimit));
    assert_eq!(code(&e.dispatch(&refund("refund-key-004", 801)).unwrap()), Some(Code::IdempotencyConflict));

    // Same key string under another subject or tenant: unrelated records.
    let mut ben = refund("refund-key-002", 500);
    ben.subject = "agent_ben".into();
    ben.arguments = crate::support::refund_args("ord_2001", 500).into_bytes();
    let b = e.dispatch(&ben).unwrap();
    assert_eq!(b.model_result.execution.delivery, Delivery::Fresh, "{b:?}");
    let mut gus = refund("refund-key-002", 500);
    gus.tenant = "globex".into();
    gus.subject = "agent_gus".into();
    gus.arguments = br#"{"order_ref":"ord_3001","amount_minor":500,"currency":"GBP","reason":"other"}"#.to_vec();
    assert_eq!(e.dispatch(&gus).unwrap().model_result.status, Status::Succeeded);
    assert_eq!(duplicates(&mut e), 0);
}

fn eight_threads_racing_one_intent_make_one_operation_and_one_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let barrier = Arc::new(Barrier::new(8));
    let results: Vec<_> = (0..8)
        .map(|i| {
            let mut e = fx.engine_named(&format!("w{i}"));
            let b = barrier.clone();
            std::thread::spawn(move || {
                b.wait();
                e.dispatch(&refund("refund-race-01", 900)).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let fresh = results.iter().filter(|r| r.model_result.execution.delivery == Delivery::Fresh).count();
    assert_eq!(fresh, 1, "exactly one caller executed");
    for r in &results {
        // Everyone else saw it in flight (unknown) or replayed it; nobody failed.
        assert!(matches!(r.model_result.status, Status::Succeeded | Status::Unknown), "{r:?}");
    }
    let mut e = fx.engine();
    let c = e.counts().unwrap();
    assert_eq!(c.operations.values().sum::<i64>(), 1);
    assert_eq!(c.outbox.values().sum::<i64>(), 1);
    assert_eq!(c.downstream_effects, 1);
}

fn two_different_intents_racing_on_one_key_one_wins_one_conflicts(backend: Backend) {
    let fx = Fixture::on(backend);
    let barrier = Arc::new(Barrier::new(2));
    let results: Vec<_> = [1000, 2000]
        .into_iter()
        .enumerate()
        .map(|(i, amount)| {
            let mut e = fx.engine_named(&format!("w{i}"));
            let b = barrier.clone();
            std::thread::spawn(move || {
                b.wait();
                e.dispatch(&refund("refund-race-02", amount)).unwrap()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    let codes: Vec<_> = results.iter().map(code).collect();
    assert_eq!(codes.iter().filter(|c| c.is_none()).count(), 1, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == Some(Code::IdempotencyConflict)).count(), 1, "{codes:?}");
    assert_eq!(effects(&mut fx.engine()), 1);
}

/// An operation accepted but waiting in the outbox (its only attempt was refused).
fn parked_in_outbox(fx: &Fixture, key: &str) -> String {
    let mut e = fx.engine();
    let mut r = refund(key, 600);
    r.deadline_ms = Some(5_000);
    let env = dispatch_with(&mut e, &r, "rate_limit(60000)");
    assert_eq!(code(&env), Some(Code::RateLimit));
    assert_eq!(env.model_result.error.as_ref().unwrap().retry_after_ms, Some(60_000));
    env.protected_audit.operation_id.unwrap()
}

fn eight_workers_racing_one_outbox_row_make_one_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let op = parked_in_outbox(&fx, "refund-outbox-1");
    // The retry is due; the deadline is refreshed by nobody, so widen it by a new call's worth.
    fx.clock.advance(60_000);
    fx.exec("UPDATE operations SET deadline_at = deadline_at + 600000 WHERE id = ?1", &[&op]);
    let barrier = Arc::new(Barrier::new(8));
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let mut e = fx.engine_named(&format!("worker-{i}"));
            let b = barrier.clone();
            std::thread::spawn(move || {
                b.wait();
                e.work(100).unwrap()
            })
        })
        .collect();
    let ran: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(ran >= 1);
    let mut e = fx.engine();
    assert_eq!(effects(&mut e), 1);
    assert_eq!(e.operation_detail(&op).unwrap().unwrap().operation.state, "succeeded");
}

fn a_failing_outbox_insert_rolls_back_the_operation(backend: Backend) {
    let fx = Fixture::on(backend);
    match &fx.pg {
        None => raw(fx.path())
            .execute_batch("CREATE TRIGGER boom BEFORE INSERT ON outbox BEGIN SELECT RAISE(ABORT, 'boom'); END;")
            .unwrap(),
        Some(db) => db
            .client()
            .batch_execute(
                "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'boom'; END $$;
                 CREATE TRIGGER boom BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION boom();",
            )
            .unwrap(),
    }
    let before = snapshot(fx.path());
    let mut e = fx.engine();
    assert!(e.dispatch(&refund("refund-atomic-1", 100)).is_err());
    assert_eq!(snapshot(fx.path()), before, "nothing half-made");
    assert_eq!(effects(&mut e), 0);
}

fn leases_are_exclusive_reclaimable_at_expiry_and_fence_zombies(backend: Backend) {
    let fx = Fixture::on(backend);
    let op = parked_in_outbox(&fx, "refund-lease-01");
    let mut store = Store::open(fx.path(), OpenOptions { create: false, sync: Sync::Full }).unwrap();
    let t = fx.clock.clone();
    use toolgate::engine::clock::Clock;
    let now = t.now_ms() + 60_000;
    let a1 = store.write(|tx| tx.claim(&op, "zombie", now, now + 10_000)).unwrap();
    assert_eq!(a1, Some(2), "attempt count increments (attempt 1 was refused)");
    // Exclusive before expiry.
    let other = store.write(|tx| tx.claim(&op, "other", now + 9_999, now + 20_000)).unwrap();
    assert_eq!(other, None);
    // At until <= now the reaper takes it back (never sent → accepted).
    fx.clock.set(now + 10_000);
    let mut e = fx.engine();
    let rep = e.reap().unwrap();
    assert_eq!(rep.requeued_unsent, 1);
    let a2 = store.write(|tx| tx.claim(&op, "fresh", now + 10_000, now + 20_000)).unwrap();
    assert_eq!(a2, Some(3));
    // The zombie wakes up: its sent-marker and its result are refused by the fence.
    let sent = store.write(|tx| tx.mark_sent(&op, "zombie", 2, now + 10_001)).unwrap();
    assert!(!sent);
    assert!(!store.write(|tx| tx.holds_lease(&op, "zombie", 2)).unwrap());
    assert!(store.write(|tx| tx.holds_lease(&op, "fresh", 3)).unwrap());
    let _: Result<(), StoreError> = Ok(());
}

fn timeout_before_execute_only_when_nothing_left(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // connect_timeout: provably not received; the retry within the deadline succeeds.
    let env = dispatch_with(&mut e, &refund("refund-tbe-001", 300), "connect_timeout,ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    assert_eq!(effects(&mut e), 1);
    // connect_timeout with no time left: TIMEOUT_BEFORE_EXECUTE, retryable, nothing done.
    let mut r = refund("refund-tbe-002", 300);
    r.deadline_ms = Some(1);
    // Every attempt meets the fault: a backoff drawn as 0 ms fits the 1 ms
    // deadline and retries at once (about one run in 200 drew it).
    let env = dispatch_with(&mut e, &r, &["connect_timeout"; 8].join(","));
    assert_eq!(code(&env), Some(Code::TimeoutBeforeExecute));
    assert_eq!(env.model_result.execution.outcome, Outcome::NotStarted);
    assert!(env.model_result.error.as_ref().unwrap().retryable);
    assert_eq!(effects(&mut e), 1);
    // A response timeout is never TIMEOUT_BEFORE_EXECUTE, even with no effect.
    let env = dispatch_with(&mut e, &refund("refund-tbe-003", 300), "timeout_before_commit");
    assert_eq!(code(&env), Some(Code::OutcomeUnknown));
}

fn lost_reply_is_unknown_and_a_retry_stays_unknown_with_one_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-lost-01", 400), "timeout_after_commit");
    assert_eq!(u.model_result.status, Status::Unknown);
    assert_eq!(u.model_result.error.as_ref().unwrap().recovery, Recovery::QueryStatus);
    let sr = u.status_ref().unwrap().to_string();
    for _ in 0..3 {
        let again = e.dispatch(&refund("refund-lost-01", 400)).unwrap();
        assert_eq!(code(&again), Some(Code::OutcomeUnknown));
        assert_eq!(again.status_ref(), Some(sr.as_str()));
    }
    assert_eq!(effects(&mut e), 1);
}

fn handler_panic_and_malformed_reply_are_unknown_and_never_replayed(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let p = dispatch_with(&mut e, &refund("refund-panic-1", 100), "panic_after_commit");
    assert_eq!(p.model_result.status, Status::Unknown);
    let m = dispatch_with(&mut e, &refund("refund-malf-01", 100), "malformed_response");
    assert_eq!(code(&m), Some(Code::OutputContractViolation));
    assert_eq!(m.model_result.execution.outcome, Outcome::Unknown);
    for key in ["refund-panic-1", "refund-malf-01"] {
        let again = e.dispatch(&refund(key, 100)).unwrap();
        assert_eq!(again.model_result.status, Status::Unknown, "{key}");
        assert!(again.model_result.data.is_none());
    }
    assert_eq!(effects(&mut e), 2);
}

fn a_call_identity_reused_for_another_request_conflicts(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut a = refund("refund-callid-1", 100);
    a.call = Some(call("call_abc"));
    e.dispatch(&a).unwrap();
    // Same call identity re-delivered with the same request: a replay.
    assert_eq!(e.dispatch(&a).unwrap().model_result.execution.delivery, Delivery::LocalReplay);
    let mut b = refund("refund-callid-2", 200);
    b.call = Some(call("call_abc"));
    let env = e.dispatch(&b).unwrap();
    assert_eq!(code(&env), Some(Code::CallIdConflict));
    assert_eq!(effects(&mut e), 1);
}

fn tampered_rows_are_refused_before_any_effect(backend: Backend) {
    for (what, sql) in [
        (
            "zeroed digest",
            "UPDATE operations SET request_sha256 = '0000000000000000000000000000000000000000000000000000000000000000'",
        ),
        ("non-canonical json", "UPDATE operations SET request_json = ' ' || request_json"),
        ("swapped receipt", "UPDATE operations SET receipt_id = 'rcpt_other'"),
    ] {
        let fx = Fixture::on(backend);
        let mut e = fx.engine();
        e.dispatch(&refund("refund-tamper-1", 100)).unwrap();
        // A replay first: the row this engine verified is remembered, and the
        // tamper below must still be found.
        let replay = e.dispatch(&refund("refund-tamper-1", 100)).unwrap();
        assert_eq!(replay.model_result.execution.delivery, Delivery::LocalReplay, "{what}");
        fx.exec(sql, &[]);
        let env = e.dispatch(&refund("refund-tamper-1", 100)).unwrap();
        // A damaged row is the ledger's fault, never the caller's: STATUS_CONFLICT,
        // not IDEMPOTENCY_CONFLICT, even where the stored digest no longer matches.
        assert_eq!(code(&env), Some(Code::StatusConflict), "{what}");
        assert!(env.model_result.data.is_none(), "{what}: no data from a tampered row");
        assert_eq!(effects(&mut e), 1, "{what}");
        assert!(!e.audit().unwrap().is_empty(), "{what}: audit reports it");
    }
}

fn tampered_pending_row_is_refused_by_the_worker_before_sending(backend: Backend) {
    let fx = Fixture::on(backend);
    let op = parked_in_outbox(&fx, "refund-tamper-2");
    fx.exec("UPDATE operations SET request_json = replace(request_json, '600', '60000')", &[]);
    fx.clock.advance(60_000);
    let mut e = fx.engine();
    fx.exec("UPDATE operations SET deadline_at = deadline_at + 600000 WHERE id = ?1", &[&op]);
    e.work(10).unwrap();
    assert_eq!(effects(&mut e), 0);
}

fn rate_limit_is_retried_after_max_of_retry_after_and_backoff_within_the_deadline(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    use toolgate::engine::clock::Clock;
    let start = fx.clock.now_ms();
    let env = dispatch_with(&mut e, &refund("refund-429-001", 100), "rate_limit(2000),ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    assert!(fx.clock.now_ms() - start >= 2000, "waited at least Retry-After");
    assert_eq!(effects(&mut e), 1);
}

fn retry_after_beyond_the_deadline_answers_rate_limit_then_a_later_retry_runs_once(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut r = refund("refund-429-002", 100);
    r.deadline_ms = Some(3_000);
    let env = dispatch_with(&mut e, &r, "rate_limit(10000)");
    assert_eq!(code(&env), Some(Code::RateLimit));
    assert_eq!(env.model_result.error.as_ref().unwrap().retry_after_ms, Some(10_000));
    assert_eq!(effects(&mut e), 0);
    // Too early: still waiting, nothing sent.
    let early = e.dispatch(&r).unwrap();
    assert_eq!(code(&early), Some(Code::RateLimit));
    assert_eq!(effects(&mut e), 0);
    fx.clock.advance(10_000);
    let later = e.dispatch(&r).unwrap();
    assert_eq!(later.model_result.status, Status::Succeeded, "{later:?}");
    assert_eq!(effects(&mut e), 1);
    assert_eq!(e.dispatch(&r).unwrap().model_result.execution.delivery, Delivery::LocalReplay);
}

fn downstream_rejection_is_a_definitive_failure_that_replays(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("refund-reject-1", 100), "reject(card_closed)");
    assert_eq!(code(&env), Some(Code::BusinessRuleViolation));
    assert_eq!(env.model_result.execution.outcome, Outcome::NotStarted);
    let again = e.dispatch(&refund("refund-reject-1", 100)).unwrap();
    assert_eq!(code(&again), Some(Code::BusinessRuleViolation));
    assert_eq!(again.model_result.execution.delivery, Delivery::LocalReplay);
    assert_eq!(effects(&mut e), 0);
}

fn authorization_is_rechecked_on_replay_and_leaks_nothing(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    e.dispatch(&refund("refund-revoke-1", 100)).unwrap();
    e.revoke("acme", "agent_ana", "create_refund").unwrap();
    let env = e.dispatch(&refund("refund-revoke-1", 100)).unwrap();
    assert_eq!(code(&env), Some(Code::PolicyDenied));
    assert!(env.model_result.data.is_none());
    assert!(env.protected_audit.operation_id.is_none());
    // Another subject's order, another tenant's order and a missing order look the same.
    let mut ben = refund("refund-notmine-1", 100);
    ben.subject = "agent_ben".into();
    let mut other = refund("refund-notmine-2", 100);
    other.arguments = crate::support::refund_args("ord_9999", 100).into_bytes();
    e.grant("acme", "agent_ana", "create_refund").unwrap();
    let mut foreign = refund("refund-notmine-3", 100);
    foreign.arguments = br#"{"order_ref":"ord_3001","amount_minor":100,"currency":"EUR","reason":"other"}"#.to_vec();
    for r in [ben, other, foreign] {
        let env = e.dispatch(&r).unwrap();
        assert_eq!(code(&env), Some(Code::NotFound));
        assert_eq!(serde_json::to_value(&env.model_result.error).unwrap()["message"], "The resource was not found.");
    }
}

fn business_rules_are_checked_before_acceptance(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    for (args, rule) in [
        (
            r#"{"order_ref":"ord_1001","amount_minor":12001,"currency":"EUR","reason":"other"}"#,
            "amount_exceeds_remaining",
        ),
        (r#"{"order_ref":"ord_1001","amount_minor":100,"currency":"USD","reason":"other"}"#, "currency_mismatch"),
        (r#"{"order_ref":"ord_1003","amount_minor":100,"currency":"USD","reason":"other"}"#, "order_not_refundable"),
    ] {
        let mut r = refund("refund-rules-01", 1);
        r.arguments = args.as_bytes().to_vec();
        let env = e.dispatch(&r).unwrap();
        assert_eq!(code(&env), Some(Code::BusinessRuleViolation), "{rule}");
        assert_eq!(env.model_result.error.unwrap().detail.unwrap()["rule"], rule);
    }
    assert_eq!(e.counts().unwrap().operations.values().sum::<i64>(), 0);
}

fn get_order_reads_without_a_key_and_fails_closed(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let r = DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "get_order".into(),
        arguments: br#"{"order_ref":"ord_1002"}"#.to_vec(),
        ..DispatchRequest::default()
    };
    let env = e.dispatch(&r).unwrap();
    assert_eq!(env.model_result.data.unwrap()["captured_minor"], 250_000);
    let mut gus = r.clone();
    gus.tenant = "globex".into();
    gus.subject = "agent_gus".into();
    assert_eq!(code(&e.dispatch(&gus).unwrap()), Some(Code::NotFound));
}

#[test]
fn a_database_from_a_newer_schema_is_refused_and_left_unchanged() {
    let fx = Fixture::new();
    raw(fx.path()).execute_batch("PRAGMA user_version = 999").unwrap();
    let before = std::fs::read(fx.path()).unwrap();
    let err = Store::open(fx.path(), OpenOptions::default()).unwrap_err();
    assert!(matches!(err, StoreError::SchemaTooNew { found: 999, .. }), "{err}");
    assert_eq!(err.code(), "DB_SCHEMA_TOO_NEW");
    assert_eq!(std::fs::read(fx.path()).unwrap(), before);
}

#[test]
fn a_database_path_under_a_file_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let err = Store::open(&file.join("ledger.db"), OpenOptions { create: true, sync: Sync::Full }).unwrap_err();
    assert_eq!(err.code(), "DB_OPEN_FAILED");
    assert!(!err.to_string().contains(dir.path().to_str().unwrap()), "no local path in {err}");
}

fn get_order(order: &str, call_id: &str) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "get_order".into(),
        arguments: format!(r#"{{"order_ref":"{order}"}}"#).into_bytes(),
        call: Some(call(call_id)),
        ..DispatchRequest::default()
    }
}

fn a_read_binds_its_call_identity_on_first_use(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let first = e.dispatch(&get_order("ord_1001", "call_read_1")).unwrap();
    assert_eq!(first.model_result.status, Status::Succeeded);
    // The same identity re-delivered with the same arguments reads again.
    assert_eq!(e.dispatch(&get_order("ord_1001", "call_read_1")).unwrap().model_result.status, Status::Succeeded);
    // The same identity with other arguments: CALL_ID_CONFLICT, and nothing changes.
    let before = snapshot(fx.path());
    let other = e.dispatch(&get_order("ord_1002", "call_read_1")).unwrap();
    assert_eq!(code(&other), Some(Code::CallIdConflict));
    assert!(other.model_result.data.is_none(), "a conflict carries no data");
    assert_eq!(snapshot(fx.path()), before);
    // A write that reuses the read's identity conflicts too (another request, another key).
    let mut w = refund("refund-after-read", 100);
    w.call = Some(call("call_read_1"));
    assert_eq!(code(&e.dispatch(&w).unwrap()), Some(Code::CallIdConflict));
    assert_eq!(effects(&mut e), 0);
}

fn a_status_query_identity_is_bound_to_its_purpose_and_its_status_ref(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut a = refund("refund-q-bind-1", 100);
    a.call = Some(call("call_write_a"));
    let env_a = dispatch_with(&mut e, &a, "timeout_after_commit");
    let mut b = refund("refund-q-bind-2", 200);
    b.call = Some(call("call_write_b"));
    let env_b = dispatch_with(&mut e, &b, "timeout_after_commit");
    assert_eq!(code(&env_a), Some(Code::OutcomeUnknown));
    // A query under the dispatch's own identity: another purpose.
    assert_eq!(
        code(&e.query_operation_status(&crate::support::query_req(&env_a, "call_write_a")).unwrap()),
        Some(Code::CallIdConflict)
    );
    // A query identity first used for operation A, reused for B's status_ref.
    let q = e.query_operation_status(&crate::support::query_req(&env_a, "call_query_1")).unwrap();
    assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert_eq!(
        code(&e.query_operation_status(&crate::support::query_req(&env_b, "call_query_1")).unwrap()),
        Some(Code::CallIdConflict)
    );
    // The same query retried under the same identity is answered again.
    let again = e.query_operation_status(&crate::support::query_req(&env_a, "call_query_1")).unwrap();
    assert_eq!(again.model_result.status, Status::Succeeded);
}

/// The neutral change token the console follows (SQLite's `data_version`,
/// PostgreSQL's WAL position): another connection's commit moves it; on
/// SQLite a read does not (PostgreSQL's position is the whole cluster's, so
/// any activity there may move it too: a spurious refetch, never a missed
/// one). And `TOOLGATE_DB` names the ledger where `--db` is not given.
fn the_change_token_moves_with_another_connections_commit(backend: Backend) {
    let f = Fixture::on(backend);
    let mut watcher = f.engine();
    let mut writer = f.engine();
    let before = watcher.data_version().unwrap();
    let _ = writer.counts().unwrap();
    if backend == Backend::Sqlite {
        assert_eq!(watcher.data_version().unwrap(), before, "a read moves nothing");
    }
    let env = writer.dispatch(&refund("change-token-0001", 100)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded);
    assert_ne!(watcher.data_version().unwrap(), before, "another connection's commit moves it");
    let out = std::process::Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
        .args(["ops", "list", "--json"])
        .env("TOOLGATE_DB", f.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(env.protected_audit.operation_id.as_deref().unwrap()));
}

crate::on_both_backends!(
    the_change_token_moves_with_another_connections_commit,
    a_failing_outbox_insert_rolls_back_the_operation,
    eight_workers_racing_one_outbox_row_make_one_effect,
    tampered_rows_are_refused_before_any_effect,
    tampered_pending_row_is_refused_by_the_worker_before_sending,
    a_read_binds_its_call_identity_on_first_use,
    first_success_then_replay_after_restart_and_from_another_connection,
    same_key_other_arguments_conflicts_in_every_state_and_scopes_are_independent,
    eight_threads_racing_one_intent_make_one_operation_and_one_effect,
    two_different_intents_racing_on_one_key_one_wins_one_conflicts,
    leases_are_exclusive_reclaimable_at_expiry_and_fence_zombies,
    timeout_before_execute_only_when_nothing_left,
    lost_reply_is_unknown_and_a_retry_stays_unknown_with_one_effect,
    handler_panic_and_malformed_reply_are_unknown_and_never_replayed,
    a_call_identity_reused_for_another_request_conflicts,
    rate_limit_is_retried_after_max_of_retry_after_and_backoff_within_the_deadline,
    retry_after_beyond_the_deadline_answers_rate_limit_then_a_later_retry_runs_once,
    downstream_rejection_is_a_definitive_failure_that_replays,
    authorization_is_rechecked_on_replay_and_leaks_nothing,
    business_rules_are_checked_before_acceptance,
    get_order_reads_without_a_key_and_fails_closed,
    a_status_query_identity_is_bound_to_its_purpose_and_its_status_ref,
);
