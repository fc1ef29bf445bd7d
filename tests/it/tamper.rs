//! The tamper table: each hand edit of a stored fact, what `toolgate audit`
//! finds, and what a replay of the affected intent answers. A damaged row is
//! never blamed on the caller (IDEMPOTENCY_CONFLICT) and never executed again.

use toolgate::engine::envelope::{Code, Envelope};
use toolgate::engine::{DispatchRequest, Engine};

use crate::support::{call, code, dispatch_with, effects, refund, refund_args, Backend, Fixture};

struct World {
    fx: Fixture,
    replay: DispatchRequest,
    approval_id: String,
}

/// A ledger with a succeeded refund (key `tamper-ok-0001`), an unknown one that
/// an operator settled by a status query (audit rows), and a pending approval.
fn world(backend: Backend) -> World {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut ok = refund("tamper-ok-0001", 500);
    ok.call = Some(call("call_tamper_ok"));
    assert_eq!(code(&dispatch_with(&mut e, &ok, "ok")), None);
    let unknown = dispatch_with(&mut e, &refund("tamper-unknown-0001", 300), "timeout_after_commit");
    e.operator_query(unknown.protected_audit.operation_id.as_deref().unwrap(), "oncall-kim").unwrap();
    let mut big = refund("tamper-big-0001", 120_000);
    big.arguments = refund_args("ord_1002", 120_000).into_bytes();
    let asked = dispatch_with(&mut e, &big, "ok");
    assert_eq!(code(&asked), Some(Code::ApprovalRequired));
    let approval_id = asked.protected_audit.approval_id.clone().unwrap();
    assert!(e.audit().unwrap().is_empty(), "a clean ledger has no findings: {:?}", e.audit().unwrap());
    let mut replay = refund("tamper-ok-0001", 500);
    replay.call = Some(call("call_tamper_replay"));
    World { fx, replay, approval_id }
}

fn findings(e: &mut Engine) -> Vec<String> {
    e.audit().unwrap().into_iter().map(|f| format!("{} {} {}", f.check, f.reference, f.detail)).collect()
}

const OK: &str = "(SELECT id FROM operations WHERE idem_key = 'tamper-ok-0001')";

/// A tamper's SQL in the words of the backend (the same edit: PostgreSQL names
/// its one append-only trigger and its CHECK constraint differently).
fn in_dialect(backend: Backend, sql: &str) -> String {
    match backend {
        Backend::Sqlite => sql.to_string(),
        Backend::Postgres => sql
            .replace("DROP TRIGGER audit_log_no_delete;", "DROP TRIGGER audit_log_no_update ON audit_log;")
            .replace("DROP TRIGGER audit_log_no_update;", "DROP TRIGGER audit_log_no_update ON audit_log;")
            .replace(
                "PRAGMA ignore_check_constraints = ON;",
                "ALTER TABLE operations DROP CONSTRAINT operations_state_check;",
            ),
    }
}

fn every_tamper_is_found_by_audit_and_never_replayed_as_new_work(backend: Backend) {
    // (tamper, SQL, a finding must contain, what a replay of the succeeded intent answers)
    let table: Vec<(&str, String, &str, Option<Code>)> = vec![
        (
            "tool changed",
            format!("UPDATE operations SET tool = 'notify_customer' WHERE id = {OK}"),
            "tool does not match the bound request",
            Some(Code::StatusConflict),
        ),
        (
            "key_sha256 shortened",
            format!("UPDATE operations SET key_sha256 = substr(key_sha256, 1, 8) WHERE id = {OK}"),
            "key_sha256 does not recompute",
            Some(Code::StatusConflict),
        ),
        (
            "key_sha256 changed",
            format!(
                "UPDATE operations SET key_sha256 = replace(key_sha256, substr(key_sha256, 1, 1), 'x') WHERE id = {OK}"
            ),
            "key_sha256 does not recompute",
            Some(Code::StatusConflict),
        ),
        (
            "tenant changed",
            format!("UPDATE operations SET tenant = 'globex' WHERE id = {OK}"),
            "tenant does not match",
            Some(Code::StatusConflict),
        ),
        (
            "subject changed",
            format!("UPDATE operations SET subject = 'agent_ben' WHERE id = {OK}"),
            "subject does not match",
            Some(Code::StatusConflict),
        ),
        (
            "input revision changed",
            format!("UPDATE operations SET input_rev = input_rev + 1 WHERE id = {OK}"),
            "contract revisions do not match",
            Some(Code::StatusConflict),
        ),
        (
            "approval amount changed",
            "UPDATE approvals SET amount_minor = 1".into(),
            "amount_minor does not match the bound request",
            None,
        ),
        (
            "receipt deleted",
            format!("DELETE FROM receipts WHERE operation_id = {OK}"),
            "receipt the operation names is not in receipts",
            None,
        ),
        (
            "order balance reset",
            "UPDATE orders SET refunded_minor = 0, status = 'paid' WHERE order_ref = 'ord_1001'".into(),
            "refunded_minor 0 is below",
            None,
        ),
        (
            "call identity deleted",
            format!("DELETE FROM call_identities WHERE operation_id = {OK}"),
            "call identity that created the operation is not bound",
            None,
        ),
        ("trace event deleted", "DELETE FROM trace_events WHERE seq = 3".into(), "events missing", None),
        (
            // Issue 33 (Low): a backward clock's events were not flagged.
            "trace event dated a day before its operation",
            format!("UPDATE trace_events SET at = at - 86400000 WHERE seq = (SELECT max(seq) FROM trace_events WHERE operation_id = {OK})"),
            "was created",
            None,
        ),
        (
            "trace fields unparseable",
            "UPDATE trace_events SET fields = '{not json' WHERE seq = 2".into(),
            "not valid JSON",
            None,
        ),
        (
            "whole trace of an operation deleted",
            format!("DELETE FROM trace_events WHERE operation_id = {OK}"),
            "no trace events",
            None,
        ),
        (
            "audit trigger dropped, a row deleted",
            "DROP TRIGGER audit_log_no_delete; DELETE FROM audit_log WHERE seq = (SELECT min(seq) FROM audit_log)"
                .into(),
            "audit_chain",
            None,
        ),
        (
            "audit trigger dropped, the newest row deleted",
            "DROP TRIGGER audit_log_no_delete; DELETE FROM audit_log WHERE seq = (SELECT max(seq) FROM audit_log)"
                .into(),
            "rows removed",
            None,
        ),
        (
            // Only status queries in the log, no decision: before the anchors
            // (migration 0017) an emptied log with its head gone was clean.
            "audit trigger dropped, the whole log and its head deleted",
            "DROP TRIGGER audit_log_no_delete; DELETE FROM audit_log; DELETE FROM meta WHERE key = 'audit_head'".into(),
            "the log no longer holds",
            None,
        ),
        (
            "audit trigger dropped, a reason rewritten",
            "DROP TRIGGER audit_log_no_update; UPDATE audit_log SET reason = 'applied by admin'".into(),
            "audit_chain",
            None,
        ),
        (
            "counts per state edited",
            "UPDATE state_counts SET n = n + 5 WHERE state = 'succeeded'".into(),
            "the header counts",
            None,
        ),
        (
            "nonsense state",
            format!("PRAGMA ignore_check_constraints = ON; UPDATE operations SET state = 'bogus' WHERE id = {OK}"),
            "is not a state operations allows",
            Some(Code::StatusConflict),
        ),
    ];
    let mut report = Vec::new();
    for (what, sql, finding, replay) in table {
        let w = world(backend);
        w.fx.exec_batch(&in_dialect(backend, &sql)).unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut e = w.fx.engine();
        let found = findings(&mut e);
        assert!(found.iter().any(|f| f.contains(finding)), "{what}: no finding with {finding:?} in {found:?}");
        let before = effects(&mut e);
        let env: Envelope = e.dispatch(&w.replay).unwrap();
        assert_ne!(code(&env), Some(Code::IdempotencyConflict), "{what}: a damaged row blames the caller");
        if let Some(expected) = replay {
            assert_eq!(code(&env), Some(expected), "{what}");
        }
        e.work(16).unwrap();
        assert_eq!(effects(&mut e), before, "{what}: the replay ran again");
        report.push(format!("{what}: {} / replay {:?}", found.len(), code(&env)));
    }
    eprintln!("{}", report.join("\n"));
}

fn an_approver_never_approves_an_amount_other_than_the_bound_one(backend: Backend) {
    let w = world(backend);
    w.fx.exec_batch("UPDATE approvals SET amount_minor = 1").unwrap();
    let mut e = w.fx.engine();
    let before = effects(&mut e);
    let pending = e.pending_approvals(10).unwrap();
    let shown = pending.iter().find(|a| a.id == w.approval_id).map(toolgate::engine::approval_amount);
    assert_eq!(shown, Some(None), "a damaged approval shows no amount rather than the copy");
    let env = e.approve(&w.approval_id, "alice").unwrap();
    assert_eq!(code(&env), Some(Code::ApprovalInvalid));
    e.work(16).unwrap();
    assert_eq!(effects(&mut e), before, "nothing ran");
}

/// SQLite's counts per state are kept by the store's own statements
/// (migration 0013), so a hand edit of a row's state leaves them behind, and
/// the audit says so; PostgreSQL's triggers still count every write.
fn a_hand_edited_state_leaves_the_counts_behind_and_audit_says_so(backend: Backend) {
    let w = world(backend);
    w.fx.exec_batch(&format!("UPDATE operations SET state = 'failed' WHERE id = {OK}")).unwrap();
    let mut e = w.fx.engine();
    let drift: Vec<String> = findings(&mut e).into_iter().filter(|f| f.starts_with("counts ")).collect();
    match backend {
        Backend::Sqlite => assert_eq!(
            drift,
            [
                "counts state_counts the header counts 0 failed, the ledger holds 1",
                "counts state_counts the header counts 2 succeeded, the ledger holds 1",
            ],
        ),
        Backend::Postgres => assert_eq!(drift, Vec::<String>::new()),
    }
}

/// A succeeded refund flipped to `failed` by hand (its receipt, result and the
/// provider's effect still there): the audit names the contradiction, and a
/// replay answers STATUS_CONFLICT, never "failed, not started", which would send
/// an agent to retry under a new key and pay twice.
fn a_success_flipped_to_failed_is_found_and_never_replayed_as_failed(backend: Backend) {
    let w = world(backend);
    w.fx.exec_batch(&format!(
        "UPDATE operations SET state = 'failed', code = 'BUSINESS_RULE_VIOLATION' WHERE id = {OK}"
    ))
    .unwrap();
    let mut e = w.fx.engine();
    let found = findings(&mut e);
    assert!(found.iter().any(|f| f.contains("state contradicts the row's own receipt")), "{found:#?}");
    let replay = e.dispatch(&w.replay).unwrap();
    assert_eq!(code(&replay), Some(Code::StatusConflict), "{replay:?}");
    assert_eq!(effects(&mut e), 2, "nothing executed again");
}

/// Issue 33 High 3: the whole operator log truncated (triggers disabled) and
/// its head deleted gave "no findings" while operations still carried human
/// decisions. Each decision on an operation must have its log entry.
fn decisions_without_their_log_entries_are_found(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let lost = dispatch_with(&mut e, &refund("tamper-resolved-01", 300), "timeout_before_commit");
    let op = lost.protected_audit.operation_id.clone().unwrap();
    fx.clock.advance(70_000);
    let out = e.resolve(&crate::support::failed_by(&op, "oncall-kim", "provider has no record")).unwrap();
    assert!(out.applied, "{out:?}");
    let mut big = refund("tamper-approved-01", 120_000);
    big.arguments = refund_args("ord_1002", 120_000).into_bytes();
    let asked = dispatch_with(&mut e, &big, "ok");
    let approved = e.approve(asked.protected_audit.approval_id.as_deref().unwrap(), "bob").unwrap();
    let approved_op = approved.protected_audit.operation_id.clone().unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    fx.exec_batch(&in_dialect(
        backend,
        "DROP TRIGGER audit_log_no_delete; DELETE FROM audit_log; DELETE FROM meta WHERE key = 'audit_head'",
    ))
    .unwrap();
    let found = findings(&mut e);
    assert!(found.iter().any(|f| f.starts_with("audit_log") && f.contains(&op) && f.contains("resolve")), "{found:?}");
    assert!(found.iter().any(|f| f.contains(&approved_op) && f.contains("approve")), "{found:?}");
}

/// A ledger written before the operator log's head was anchored on the rows
/// it touches (schema 16: demo.db of that commit) opens, migrates and audits
/// clean; the next operator action anchors its head, and emptying the log
/// then is found.
#[test]
fn a_version_16_ledger_migrates_and_its_next_operator_action_anchors_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v16.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v16.db"), &path).unwrap();
    let v: i64 = crate::support::raw(&path).query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 16);
    // A day after the demo's own times (an operator acts after them).
    let clock = toolgate::engine::clock::ManualClock::new(crate::support::T0 + 86_400_000);
    let mut e = Engine::open(&path, crate::support::opts(&clock, "migrate")).unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    let ops = e.list_operations(None, 100).unwrap();
    assert_eq!(ops.len(), 11, "every operation of the fixture is kept");
    let unknown = ops.iter().find(|o| o.state.is_unknown_queue()).expect("the demo has an unknown operation");
    e.operator_query(&unknown.id, "oncall-kim").unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    crate::support::raw(&path)
        .execute_batch(
            "DROP TRIGGER audit_log_no_delete; DELETE FROM audit_log; DELETE FROM meta WHERE key = 'audit_head'",
        )
        .unwrap();
    let found = findings(&mut e);
    assert!(found.iter().any(|f| f.contains(&unknown.id) && f.contains("no longer holds")), "{found:?}");
}

crate::on_both_backends!(
    decisions_without_their_log_entries_are_found,
    a_success_flipped_to_failed_is_found_and_never_replayed_as_failed,
    a_hand_edited_state_leaves_the_counts_behind_and_audit_says_so,
    every_tamper_is_found_by_audit_and_never_replayed_as_new_work,
    an_approver_never_approves_an_amount_other_than_the_bound_one,
);
