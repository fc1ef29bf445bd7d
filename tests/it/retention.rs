//! Retention: counted from the moment an operation became terminal, never
//! taking what a person acted on, leaving a tombstone, and never run by the
//! console's reaper.

use toolgate::engine::envelope::{Code, Delivery, Status};
use toolgate::engine::{Engine, EngineError, EngineOptions};

use crate::support::{call, code, dispatch_with, raw, refund, refund_args, Backend, Fixture};

const DAY: i64 = 86_400_000;

fn count(fx: &Fixture, sql: &str) -> i64 {
    fx.query_i64(sql)
}

fn an_old_unknown_operation_settled_by_an_operator_keeps_its_row_and_receipt(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("refund-old-unknown", 100), "timeout_after_commit");
    assert_eq!(code(&env), Some(Code::OutcomeUnknown));
    let op = env.protected_audit.operation_id.clone().unwrap();
    // It sits unknown for longer than its 30-day retention, then an operator settles it.
    fx.clock.advance(60 * DAY);
    let settled = e.operator_query(&op, "oncall-kim").unwrap();
    assert_eq!(settled.model_result.execution.delivery, Delivery::ReceiptReconciled);
    e.reap().unwrap();
    let p = e.purge_expired().unwrap();
    assert_eq!(p.purged, 0);
    assert!(e.operation_detail(&op).unwrap().is_some(), "the settled operation is still there");
    assert_eq!(count(&fx, &format!("SELECT count(*) FROM receipts WHERE operation_id = '{op}'")), 1);
    // A person acted on it: it stays as long as its audit entries (for good).
    fx.clock.advance(365 * DAY);
    let p = e.purge_expired().unwrap();
    assert_eq!((p.purged, p.kept_for_audit), (0, 1));
    assert!(e.operation_detail(&op).unwrap().is_some());
    assert_eq!(count(&fx, &format!("SELECT count(*) FROM receipts WHERE operation_id = '{op}'")), 1);
}

fn retention_counts_from_the_terminal_state_and_a_purge_leaves_a_tombstone(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut req = refund("refund-retention-1", 100);
    req.call = Some(call("call_ret_1"));
    let env = dispatch_with(&mut e, &req, "timeout_after_commit");
    let op = env.protected_audit.operation_id.clone().unwrap();
    fx.clock.advance(60 * DAY);
    // Settled by the caller's own status query (no person involved) on day 60.
    let q = e.query_operation_status(&crate::support::query_req(&env, "call_q_ret")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded);
    fx.clock.advance(29 * DAY);
    assert_eq!(e.purge_expired().unwrap().purged, 0, "29 days after it ended: kept");
    fx.clock.advance(DAY);
    assert_eq!(e.purge_expired().unwrap().purged, 1, "30 days after it ended: purged");
    assert_eq!(count(&fx, &format!("SELECT count(*) FROM operations WHERE id = '{op}'")), 0);
    assert_eq!(count(&fx, &format!("SELECT count(*) FROM receipts WHERE operation_id = '{op}'")), 0);
    // The tombstone answers for it; the trace still points at it.
    let t = e.tombstone(&op).unwrap().unwrap();
    assert_eq!(t.final_state, "succeeded");
    assert_eq!(t.result_sha256, q.protected_audit.binding.result_sha256);
    assert!(!t.scope_sha256.contains("refund-retention-1"));
    match e.operation_detail(&op) {
        Err(EngineError::Invalid { code, message }) => {
            assert_eq!(code, "OPERATION_PURGED");
            assert!(message.starts_with("purged on "), "{message}");
            assert!(message.contains("succeeded"), "{message}");
        }
        other => panic!("expected OPERATION_PURGED, got {other:?}"),
    }
    assert!(count(&fx, &format!("SELECT count(*) FROM trace_events WHERE operation_id = '{op}'")) > 0);
    // The key stays taken: the same call is told how the first one ended and
    // is never run again (no second refund), with the same body or another.
    let effects = e.counts().unwrap().downstream_effects;
    let again = dispatch_with(&mut e, &refund("refund-retention-1", 100), "ok");
    assert_eq!(code(&again), Some(Code::IdempotencyKeyExpired));
    let detail = again.model_result.error.as_ref().unwrap().detail.clone().unwrap();
    assert_eq!(detail["operation_id"], op.as_str());
    assert_eq!(detail["ended"], "succeeded");
    assert_eq!(detail["same_request"], true);
    let other = dispatch_with(&mut e, &refund("refund-retention-1", 250), "ok");
    assert_eq!(code(&other), Some(Code::IdempotencyKeyExpired));
    assert_eq!(other.model_result.error.as_ref().unwrap().detail.as_ref().unwrap()["same_request"], false);
    assert_eq!(e.counts().unwrap().downstream_effects, effects, "nothing was sent");
    assert_eq!(count(&fx, "SELECT count(*) FROM operations"), 0);
    assert_eq!(count(&fx, "SELECT count(*) FROM trace_events WHERE reason = 'key_expired'"), 2);
}

fn an_approved_operation_is_never_purged(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Above acme's threshold: needs approval.
    let mut big = refund("refund-retention-big", 120_000);
    big.arguments = refund_args("ord_1002", 120_000).into_bytes();
    let asked = dispatch_with(&mut e, &big, "ok");
    assert_eq!(code(&asked), Some(Code::ApprovalRequired));
    let approved = e.approve(asked.protected_audit.approval_id.as_deref().unwrap(), "alice").unwrap();
    assert_eq!(approved.model_result.status, Status::Succeeded);
    let op = approved.protected_audit.operation_id.clone().unwrap();
    fx.clock.advance(400 * DAY);
    assert_eq!(e.purge_expired().unwrap().purged, 0);
    assert!(e.operation_detail(&op).unwrap().is_some());
    assert_eq!(count(&fx, "SELECT count(*) FROM operations"), 1);
}

#[test]
fn the_consoles_reaper_on_a_plain_copy_of_demo_db_deletes_nothing() {
    // A user copies demo.db by hand (no re-basing: its times are months old)
    // and opens the console on it: the console's background pass is reap + work.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("copy.db");
    std::fs::write(&path, toolgate::demo::DEMO_DB).unwrap();
    let before: i64 = raw(&path).query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).unwrap();
    assert!(before >= 10);
    let mut e =
        Engine::open(&path, EngineOptions { worker_id: "console".into(), ..toolgate::tools::demo_options() }).unwrap();
    for _ in 0..3 {
        e.reap().unwrap();
        e.work(64).unwrap();
    }
    drop(e);
    let c = raw(&path);
    let after: i64 = c.query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).unwrap();
    assert_eq!(after, before);
    let receipts: i64 = c.query_row("SELECT count(*) FROM receipts", [], |r| r.get(0)).unwrap();
    assert!(receipts > 0);
}

#[test]
fn a_version_4_ledger_migrates_with_retention_counted_from_its_last_change() {
    // The demo database as committed before migration 0005 (schema version 4).
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v4.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v4.db"), &path).unwrap();
    let v: i64 = raw(&path).query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 4);
    let ops: i64 = raw(&path).query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).unwrap();
    drop(Engine::open(&path, toolgate::tools::demo_options()).unwrap());
    let c = raw(&path);
    let v: i64 = c.query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, toolgate::store::SCHEMA_VERSION);
    let after: i64 = c.query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).unwrap();
    assert_eq!(after, ops, "a migration deletes nothing");
    let wrong: i64 = c
        .query_row(
            "SELECT count(*) FROM operations WHERE
               (state IN ('succeeded', 'failed', 'resolved')) != (terminal_at IS NOT NULL)
               OR (terminal_at IS NOT NULL AND (terminal_at != updated_at OR expires_at != updated_at + retention_ms))
               OR retention_ms != 2592000000",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(wrong, 0);
}

crate::on_both_backends!(
    an_old_unknown_operation_settled_by_an_operator_keeps_its_row_and_receipt,
    retention_counts_from_the_terminal_state_and_a_purge_leaves_a_tombstone,
    an_approved_operation_is_never_purged,
);

/// Issue 40: the purge's batch selection and its deletes go by index, so a
/// batch's write transaction does not grow with the ledger (at 100k
/// operations one batch held the write lock ~85 s). The plans, on SQLite:
/// no full scan of the operator log, the receipts or the call identities.
/// A schema 17 ledger (demo.db of that commit) migrates and audits clean.
#[test]
fn the_purge_chooses_and_deletes_by_index_and_a_version_17_ledger_migrates() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v17.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v17.db"), &path).unwrap();
    let v: i64 = raw(&path).query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 17);
    let clock = toolgate::engine::clock::ManualClock::new(crate::support::T0 + 86_400_000);
    let mut e = Engine::open(&path, crate::support::opts(&clock, "migrate")).unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    assert_eq!(e.list_operations(None, 100).unwrap().len(), 11, "every operation of the fixture is kept");
    drop(e);
    let c = raw(&path);
    let plan = |sql: &str| -> String {
        let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows: Vec<String> = st.query_map([], |r| r.get::<_, String>(3)).unwrap().map(Result::unwrap).collect();
        rows.join(" | ")
    };
    // What a person acted on is found by the operator log's index, per candidate.
    let choose = plan(
        "SELECT o.id FROM operations o
         WHERE o.terminal_at IS NOT NULL AND o.expires_at <= 1
           AND o.state IN ('succeeded', 'failed', 'resolved') AND o.approval_id IS NULL
           AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND a.actor <> 'x')
         ORDER BY o.expires_at, o.id LIMIT 256",
    );
    assert!(choose.contains("audit_log_operation"), "{choose}");
    assert!(!choose.contains("SCAN a") && !choose.contains("SCAN audit_log"), "{choose}");
    for (table, index) in [("receipts", "receipts_operation"), ("call_identities", "call_identities_operation")] {
        let p = plan(&format!("DELETE FROM {table} WHERE operation_id = 'op_x'"));
        assert!(p.contains(index), "{table}: {p}");
    }
}

/// Issue 40: a purge asked to stop (Ctrl-C in `toolgate reap`) stops between
/// batches, says so, and leaves what it did not reach for the next pass.
#[test]
fn a_purge_told_to_stop_stops_between_batches() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    let env = e.dispatch(&refund("stop-purge-0001", 100)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded);
    fx.clock.advance(40 * 86_400_000);
    let stop = std::sync::atomic::AtomicBool::new(true);
    let r = e.purge_expired_until(&stop).unwrap();
    assert!(r.interrupted && r.purged == 0, "{r:?}");
    assert_eq!(count(&fx, "SELECT count(*) FROM operations"), 1);
    let r = e.purge_expired().unwrap();
    assert!(!r.interrupted && r.purged == 1, "{r:?}");
}

/// Issue 40: space comes back. A new SQLite ledger gives free pages back in
/// short steps after each purge (incremental auto-vacuum); `vacuum` sets a
/// ledger made before that (schema 17) to it once; PostgreSQL refuses
/// `vacuum` with DB_UNSUPPORTED (its autovacuum does this).
#[test]
fn a_purge_gives_space_back_and_vacuum_converts_an_older_ledger() {
    let fx = Fixture::new();
    let mut e = fx.engine();
    for i in 0..60 {
        let env = e.dispatch(&refund(&format!("space-back-{i:05}"), 1)).unwrap();
        assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    }
    assert_eq!(count(&fx, "PRAGMA auto_vacuum"), 2, "a new ledger is incremental");
    fx.clock.advance(40 * 86_400_000);
    let r = e.purge_expired().unwrap();
    assert_eq!(r.purged, 60, "{r:?}");
    assert!(r.bytes_reclaimed > 0, "{r:?}");
    assert_eq!(count(&fx, "PRAGMA freelist_count"), 0);
    assert!(e.audit().unwrap().is_empty());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v17.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v17.db"), &path).unwrap();
    let clock = toolgate::engine::clock::ManualClock::new(crate::support::T0 + 86_400_000);
    let mut old = Engine::open(&path, crate::support::opts(&clock, "vacuum")).unwrap();
    let av = |p: &std::path::Path| -> i64 { raw(p).query_row("PRAGMA auto_vacuum", [], |r| r.get(0)).unwrap() };
    assert_eq!(av(&path), 0, "made before schema 18");
    // (A ledger this small has nothing to give back; incremental mode adds
    // its pointer-map pages, so it may even grow by one.)
    let (before, after) = old.vacuum().unwrap();
    assert!(after <= before + 8192, "{before} -> {after}");
    assert_eq!(av(&path), 2);
    assert!(old.audit().unwrap().is_empty());
    assert_eq!(old.list_operations(None, 100).unwrap().len(), 11);
}

crate::on_both_backends!(vacuum_on_each_backend);
fn vacuum_on_each_backend(backend: Backend) {
    let fx = Fixture::on(backend);
    let r = fx.engine().vacuum();
    match backend {
        Backend::Sqlite => assert!(r.is_ok()),
        Backend::Postgres => {
            assert_eq!(r.err().map(|e| toolgate::Coded::code(&e).to_string()).as_deref(), Some("DB_UNSUPPORTED"));
        }
    }
}
