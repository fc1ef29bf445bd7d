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

/// Issue 33 (Low): a backward clock's trace events were not flagged. An event
/// dated before its operation was created is an audit warning (a host or a
/// fixed `--now` wrote it on a wrong clock): reported beside the findings,
/// not a damaged ledger (processes on fixed clocks write such events).
fn a_trace_event_dated_before_its_operation_is_a_warning(backend: Backend) {
    let w = world(backend);
    let mut e = w.fx.engine();
    assert!(e.audit_warnings().unwrap().is_empty());
    w.fx.exec_batch(&format!(
        "UPDATE trace_events SET at = at - 86400000 WHERE seq = (SELECT max(seq) FROM trace_events WHERE operation_id = {OK})"
    ))
    .unwrap();
    let warned = e.audit_warnings().unwrap();
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert!(
        warned[0].detail.contains("86400 s before its operation") && warned[0].detail.contains("wrong clock"),
        "{warned:?}"
    );
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// What a status query did before lookups were checked for their binding
/// (issue 32 §1.1): operation `b` took operation `a`'s receipt, request id and
/// result, became succeeded with a binding that recomputes, and its own refund
/// was applied to the order.
fn bind_receipt_twice(backend: Backend, fx: &Fixture, e: &mut Engine, a: &str, b: &str) {
    let ops = e.list_operations(None, 100).unwrap();
    let (oa, ob) = (ops.iter().find(|o| o.id == a).unwrap(), ops.iter().find(|o| o.id == b).unwrap());
    let call = toolgate::engine::canonical::CallIdentity {
        provider: ob.call_provider.clone(),
        api_family: ob.call_api_family.clone(),
        response_id: ob.call_response_id.clone(),
        call_id: ob.call_id.clone(),
        adapter_revision: ob.adapter_revision.clone(),
    };
    let binding = toolgate::engine::canonical::call_binding_sha256(&toolgate::engine::canonical::BindingInput {
        tenant: &ob.tenant,
        subject: &ob.subject,
        call: &call,
        operation_id: &ob.id,
        idempotency_key: &ob.idem_key,
        revisions: toolgate::engine::canonical::Revisions {
            input: ob.input_rev,
            output: ob.output_rev,
            effect: ob.effect_rev,
        },
        request_sha256: &ob.request_sha256,
        result_sha256: oa.result_sha256.as_deref(),
        downstream_request_id: oa.downstream_request_id.as_deref(),
        receipt_id: oa.receipt_id.as_deref(),
        status_ref: &ob.status_ref,
    });
    let q = |t: &Option<String>| t.as_deref().map_or("NULL".to_string(), |v| format!("'{}'", v.replace('\'', "''")));
    fx.exec_batch(&format!(
        "UPDATE operations SET state = 'succeeded', code = NULL, receipt_id = {}, downstream_request_id = {},
                result_json = {}, result_sha256 = {}, call_binding_sha256 = '{binding}', version = version + 1
          WHERE id = '{b}';
         UPDATE outbox SET state = 'done' WHERE operation_id = '{b}';
         UPDATE orders SET refunded_minor = refunded_minor + 300, status = 'partially_refunded' WHERE order_ref = 'ord_1001';",
        q(&oa.receipt_id),
        q(&oa.downstream_request_id),
        q(&oa.result_json),
        q(&oa.result_sha256),
    ))
    .unwrap();
    if backend == Backend::Sqlite {
        // SQLite's per-state counts are kept by the engine's writes (PostgreSQL's by triggers).
        fx.exec_batch(
            "UPDATE state_counts SET n = n - 1 WHERE state = 'unknown';
             UPDATE state_counts SET n = n + 1 WHERE state = 'succeeded';",
        )
        .unwrap();
    }
}

/// Issue 32 §1.1, the way out: a receipt bound to two operations (written
/// before lookups were checked for their binding) is found by the audit as
/// such, and a person can resolve the operation that took another's receipt
/// against its recorded success: the decision records the contradiction, the
/// refund the wrong receipt applied to the order is taken back, and the audit
/// is clean. Before: `resolve` refused NOT_RESOLVABLE on a succeeded operation.
fn a_receipt_bound_twice_is_found_and_resolved_against_its_recorded_success(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let a = dispatch_with(&mut e, &refund("bound-twice-a-01", 500), "ok");
    let a = a.protected_audit.operation_id.clone().unwrap();
    let b = dispatch_with(&mut e, &refund("bound-twice-b-01", 300), "timeout_before_commit");
    let b = b.protected_audit.operation_id.clone().unwrap();
    fx.clock.advance(70_000);
    bind_receipt_twice(backend, &fx, &mut e, &a, &b);
    let found = findings(&mut e);
    assert!(
        found.iter().any(|f| f.starts_with("receipt_bound_twice") && f.contains(&b) && f.contains(&a)),
        "{found:?}"
    );
    let decision =
        crate::support::failed_by(&b, "oncall-kim", "took a's receipt; the provider has nothing under b's key");
    let refused = e.resolve(&decision).unwrap();
    assert_eq!((refused.applied, refused.code), (false, "STATUS_CONFLICT"), "{refused:?}");
    let mut own = decision.clone();
    own.resolution = toolgate::engine::Resolution::Succeeded;
    own.evidence = fx.query_text(&format!("SELECT receipt_id FROM operations WHERE id = '{a}'"));
    let refused = e.resolve_against_evidence(&own).unwrap();
    assert_eq!((refused.applied, refused.code), (false, "EVIDENCE_REQUIRED"), "{refused:?}");
    let done = e.resolve_against_evidence(&decision).unwrap();
    assert!(done.applied, "{done:?}");
    assert_eq!(fx.query_text(&format!("SELECT state FROM operations WHERE id = '{b}'")).as_deref(), Some("resolved"));
    assert_eq!(fx.query_i64(&format!("SELECT count(*) FROM operations WHERE id = '{b}' AND receipt_id IS NULL")), 1);
    assert_eq!(
        fx.query_i64("SELECT refunded_minor FROM orders WHERE order_ref = 'ord_1001'"),
        500,
        "b's refund taken back"
    );
    let log = fx
        .query_text(&format!("SELECT evidence FROM audit_log WHERE operation_id = '{b}' AND result = 'applied'"))
        .unwrap();
    assert!(log.contains("contested_receipt") && log.contains(&a), "{log}");
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    assert_eq!(effects(&mut e), 1, "one refund was ever paid");
}

/// A person cannot bind one receipt to two operations either: resolving an
/// unknown operation as succeeded with a receipt the ledger recorded for
/// another operation is refused, even against the evidence, and changes
/// nothing. Before: applied (the console helper's review found it).
fn a_person_cannot_resolve_with_another_operations_receipt(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let a = dispatch_with(&mut e, &refund("other-receipt-a-01", 500), "ok");
    let a = a.protected_audit.operation_id.clone().unwrap();
    let b = dispatch_with(&mut e, &refund("other-receipt-b-01", 300), "timeout_before_commit");
    let b = b.protected_audit.operation_id.clone().unwrap();
    fx.clock.advance(70_000);
    let mut claim = crate::support::failed_by(&b, "oncall-kim", "the customer says it arrived");
    claim.resolution = toolgate::engine::Resolution::Succeeded;
    claim.evidence = fx.query_text(&format!("SELECT receipt_id FROM operations WHERE id = '{a}'"));
    for against in [false, true] {
        let out = if against { e.resolve_against_evidence(&claim) } else { e.resolve(&claim) }.unwrap();
        assert_eq!((out.applied, out.code), (false, "STATUS_CONFLICT"), "{out:?}");
        assert!(out.message.contains(&a), "{out:?}");
    }
    assert_eq!(fx.query_text(&format!("SELECT state FROM operations WHERE id = '{b}'")).as_deref(), Some("unknown"));
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

crate::on_both_backends!(
    a_person_cannot_resolve_with_another_operations_receipt,
    a_trace_event_dated_before_its_operation_is_a_warning,
    a_receipt_bound_twice_is_found_and_resolved_against_its_recorded_success,
    decisions_without_their_log_entries_are_found,
    a_success_flipped_to_failed_is_found_and_never_replayed_as_failed,
    a_hand_edited_state_leaves_the_counts_behind_and_audit_says_so,
    every_tamper_is_found_by_audit_and_never_replayed_as_new_work,
    an_approver_never_approves_an_amount_other_than_the_bound_one,
);
