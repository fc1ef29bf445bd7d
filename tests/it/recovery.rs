//! Recovery: explicit status queries, approvals, human review and the audit log.

use toolgate::engine::envelope::{Code, Delivery, Envelope, Status};
use toolgate::engine::{DispatchRequest, Engine, QueryRequest, Resolution, ResolveRequest};

use crate::support::{call, code, dispatch_with, effects, refund, refund_args, Backend, Fixture};

fn query_for(env: &Envelope) -> QueryRequest {
    QueryRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        status_ref: env.status_ref().unwrap().to_string(),
        expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap(),
        ..QueryRequest::default()
    }
}

fn state(e: &mut Engine, op: &str) -> String {
    e.operation_detail(op).unwrap().unwrap().operation.state.to_string()
}

fn unknown_then_query_reconciles_then_replays_with_one_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-recon-01", 500), "timeout_after_commit");
    assert_eq!(code(&u), Some(Code::OutcomeUnknown));
    let again = e.dispatch(&refund("refund-recon-01", 500)).unwrap();
    assert_eq!(again.status_ref(), u.status_ref());
    assert_eq!(code(&again), Some(Code::OutcomeUnknown));
    let q = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded);
    assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert!(q.model_result.data.as_ref().unwrap()["refund_id"].as_str().unwrap().starts_with("re_"));
    let r = e.dispatch(&refund("refund-recon-01", 500)).unwrap();
    assert_eq!(r.model_result.execution.delivery, Delivery::LocalReplay);
    assert_eq!(r.model_result.data, q.model_result.data);
    assert_eq!(effects(&mut e), 1);
    // The order reflects the reconciled refund exactly once.
    let o = toolgate::tools::demo::orders(&mut e).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
    assert_eq!(o.refunded_minor, 500);
    assert!(e.audit().unwrap().is_empty());
}

fn receipt_not_yet_available_stays_unknown_until_the_delay_passes(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-delay-01", 500), "receipt_delay(5000)");
    let q1 = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(code(&q1), Some(Code::OutcomeUnknown));
    let op = u.protected_audit.operation_id.clone().unwrap();
    let d = e.operation_detail(&op).unwrap().unwrap().operation;
    assert_eq!(d.last_query_result.as_deref(), Some("not_found"));
    fx.clock.advance(5_000);
    let q2 = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(q2.model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert_eq!(effects(&mut e), 1);
}

fn mismatching_receipt_is_a_status_conflict_and_needs_review(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-drift-01", 500), "mismatch_after_commit");
    let q = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(code(&q), Some(Code::StatusConflict));
    let op = u.protected_audit.operation_id.clone().unwrap();
    assert_eq!(state(&mut e, &op), "needs_review");
    // A repeat dispatch never executes it again.
    assert_eq!(e.dispatch(&refund("refund-drift-01", 500)).unwrap().model_result.status, Status::Unknown);
    assert_eq!(effects(&mut e), 1);
}

fn query_checks_digest_key_provider_and_status_ref_before_looking(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-qchk-01", 500), "timeout_after_commit");
    let base = query_for(&u);
    let wrong_digest = QueryRequest { expected_request_sha256: "0".repeat(64), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&wrong_digest).unwrap()), Some(Code::StatusConflict));
    let wrong_key = QueryRequest { idempotency_key: Some("refund-other-99".into()), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&wrong_key).unwrap()), Some(Code::StatusConflict));
    let other_provider = QueryRequest { call: Some(call("q1")), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&other_provider).unwrap()), Some(Code::StatusConflict));
    let malformed = QueryRequest { status_ref: "sr1_nope".into(), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&malformed).unwrap()), Some(Code::InvalidArguments));
    let mut forged = base.status_ref.clone().into_bytes();
    let last = forged.len() - 1;
    forged[last] = if forged[last] == b'a' { b'b' } else { b'a' };
    let forged = QueryRequest { status_ref: String::from_utf8(forged).unwrap(), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&forged).unwrap()), Some(Code::NotFound));
    let foreign = QueryRequest { tenant: "globex".into(), subject: "agent_gus".into(), ..base.clone() };
    assert_eq!(code(&e.query_operation_status(&foreign).unwrap()), Some(Code::NotFound));
    // None of these looked downstream or changed the operation.
    let op = u.protected_audit.operation_id.clone().unwrap();
    let d = e.operation_detail(&op).unwrap().unwrap().operation;
    assert_eq!((d.state.as_str(), d.last_query_at), ("unknown", None));
    // Revoked subject: refused, no data.
    e.revoke("acme", "agent_ana", "create_refund").unwrap();
    let q = e.query_operation_status(&base).unwrap();
    assert_eq!(code(&q), Some(Code::PolicyDenied));
    assert!(q.model_result.data.is_none());
}

fn a_query_call_identity_can_never_dispatch_and_the_reverse(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let mut d = refund("refund-purpose-1", 500);
    d.call = Some(call("call_dispatch"));
    let u = dispatch_with(&mut e, &d, "timeout_after_commit");
    // The dispatch's call identity used for a query: conflict.
    let mut q = query_for(&u);
    q.call = Some(call("call_dispatch"));
    assert_eq!(code(&e.query_operation_status(&q).unwrap()), Some(Code::CallIdConflict));
    // A query's call identity used for a dispatch: conflict.
    let mut q2 = query_for(&u);
    q2.call = Some(call("call_query"));
    let _ = e.query_operation_status(&q2).unwrap();
    let mut d2 = refund("refund-purpose-2", 100);
    d2.call = Some(call("call_query"));
    assert_eq!(code(&e.dispatch(&d2).unwrap()), Some(Code::CallIdConflict));
}

fn big_refund(key: &str) -> DispatchRequest {
    let mut r = refund(key, 60_000);
    r.arguments = refund_args("ord_1002", 60_000).into_bytes();
    r
}

fn approval_id(env: &Envelope) -> String {
    assert_eq!(code(env), Some(Code::ApprovalRequired), "{env:?}");
    env.protected_audit.approval_id.clone().unwrap()
}

fn approval_required_pending_approved_executes_once(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let a = e.dispatch(&big_refund("refund-big-0001")).unwrap();
    let id = approval_id(&a);
    assert_eq!(effects(&mut e), 0);
    assert_eq!(e.pending_approvals(10).unwrap().len(), 1);
    // While pending, a retry gets the same approval id.
    assert_eq!(approval_id(&e.dispatch(&big_refund("refund-big-0001")).unwrap()), id);
    let done = e.approve(&id, "bob").unwrap();
    assert_eq!(done.model_result.status, Status::Succeeded, "{done:?}");
    assert_eq!(done.protected_audit.approval_id.as_deref(), Some(id.as_str()));
    assert_eq!(effects(&mut e), 1);
    // A later dispatch of the same intent sees the operation: a replay, no approval.
    let r = e.dispatch(&big_refund("refund-big-0001")).unwrap();
    assert_eq!(r.model_result.execution.delivery, Delivery::LocalReplay);
    // The same approver again (issue 33: its reply was lost and it retried,
    // and got 403 "approval is approved"): the call it started answers, a
    // replay of the same refund; nothing runs twice.
    let again = e.approve(&id, "bob").unwrap();
    assert_eq!(again.model_result.status, Status::Succeeded, "{again:?}");
    assert_eq!(again.model_result.data, done.model_result.data);
    assert_eq!(effects(&mut e), 1);
    // Another approver: invalid, nothing runs.
    assert_eq!(code(&e.approve(&id, "alice").unwrap()), Some(Code::ApprovalInvalid));
    assert_eq!(effects(&mut e), 1);
}

fn approval_refusals_run_nothing(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Exclusive expiry: approving at exactly expires_at is too late.
    let id = approval_id(&e.dispatch(&big_refund("refund-big-0002")).unwrap());
    let exp = e.pending_approvals(10).unwrap()[0].expires_at;
    fx.clock.set(exp);
    assert_eq!(code(&e.approve(&id, "bob").unwrap()), Some(Code::ApprovalInvalid));
    // After expiry a new dispatch gets a new approval id, which then works once.
    let id2 = approval_id(&e.dispatch(&big_refund("refund-big-0002")).unwrap());
    assert_ne!(id, id2);
    // Not on the allowlist; the requester themself.
    assert_eq!(code(&e.approve(&id2, "mallory").unwrap()), Some(Code::ApprovalInvalid));
    let mut own = big_refund("refund-big-0003");
    own.subject = "alice".into();
    own.arguments = refund_args("ord_2002", 60_000).into_bytes();
    let own_id = approval_id(&e.dispatch(&own).unwrap());
    assert_eq!(code(&e.approve(&own_id, "alice").unwrap()), Some(Code::ApprovalInvalid));
    // A policy revision change invalidates a pending approval.
    e.bump_policy_revision("acme").unwrap();
    assert_eq!(code(&e.approve(&id2, "bob").unwrap()), Some(Code::ApprovalInvalid));
    assert_eq!(effects(&mut e), 0);
    let id3 = approval_id(&e.dispatch(&big_refund("refund-big-0002")).unwrap());
    assert_eq!(e.approve(&id3, "bob").unwrap().model_result.status, Status::Succeeded);
    assert_eq!(effects(&mut e), 1);
}

fn a_contract_revision_change_invalidates_a_pending_approval(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let id = approval_id(&e.dispatch(&big_refund("refund-big-0004")).unwrap());
    let mut contracts = toolgate::tools::demo_catalog().unwrap();
    contracts.set_revisions("create_refund", toolgate::engine::canonical::Revisions { input: 1, output: 2, effect: 1 });
    e.set_contracts(std::sync::Arc::new(contracts));
    assert_eq!(code(&e.approve(&id, "bob").unwrap()), Some(Code::ApprovalInvalid));
    assert_eq!(effects(&mut e), 0);
}

fn a_denied_request_answers_approval_invalid_to_repeats(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let id = approval_id(&e.dispatch(&big_refund("refund-big-0005")).unwrap());
    let out = e.deny(&id, "bob", "amount too large for a damaged item").unwrap();
    assert!(out.applied);
    let again = e.dispatch(&big_refund("refund-big-0005")).unwrap();
    assert_eq!(code(&again), Some(Code::ApprovalInvalid));
    assert_eq!(code(&e.approve(&id, "alice").unwrap()), Some(Code::ApprovalInvalid));
    assert!(!e.deny(&id, "bob", "again").unwrap().applied);
    assert!(!e.deny("apr_missing", "bob", "").unwrap().applied);
    assert_eq!(effects(&mut e), 0);
}

fn human_resolution_needs_a_note_evidence_and_a_fresh_snapshot(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-human-01", 500), "timeout_before_commit");
    let op = u.protected_audit.operation_id.clone().unwrap();
    let seen = e.operation_detail(&op).unwrap().unwrap().operation.version;
    let req = |res, note: &str, evidence: Option<&str>, seen: Option<i64>| ResolveRequest {
        operation_id: op.clone(),
        resolution: res,
        operator: "oncall-kim".into(),
        note: note.into(),
        evidence: evidence.map(str::to_string),
        seen_version: seen,
        action_id: None,
        no_evidence: false,
    };
    assert_eq!(e.resolve(&req(Resolution::Failed, " ", None, Some(seen))).unwrap().code, "NOTE_REQUIRED");
    assert_eq!(e.resolve(&req(Resolution::Succeeded, "saw it", None, Some(seen))).unwrap().code, "EVIDENCE_REQUIRED");
    // The operation changes (a query records its attempt): the old snapshot is stale.
    let _ = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(
        e.resolve(&req(Resolution::Failed, "provider has no record", None, Some(seen))).unwrap().code,
        "STALE_VERSION"
    );
    let seen = e.operation_detail(&op).unwrap().unwrap().operation.version;
    // No record right after the send is not proof of absence: wait out the
    // receipt window (attempt timeout + receipt_visible_within_ms).
    let early = e.resolve(&req(Resolution::Failed, "provider has no record", None, Some(seen))).unwrap();
    assert_eq!(early.code, "RECEIPT_MAY_STILL_APPEAR", "{early:?}");
    // The refusal's log entry keeps what the operator wrote (issue 32 §2).
    let refusal = e
        .audit_log(100)
        .unwrap()
        .into_iter()
        .find(|a| a.result == "refused" && a.reason.contains("receipts can take"))
        .unwrap();
    let evidence: serde_json::Value = serde_json::from_str(&refusal.evidence).unwrap();
    assert_eq!(evidence["note"], "provider has no record", "{evidence}");
    fx.clock.advance(66_000);
    let ok = e.resolve(&req(Resolution::Failed, "provider has no record", None, Some(seen))).unwrap();
    assert!(ok.applied, "{ok:?}");
    let r = e.dispatch(&refund("refund-human-01", 500)).unwrap();
    assert_eq!(r.model_result.execution.delivery, Delivery::HumanResolved);
    assert_eq!(r.model_result.status, Status::Failed);
    // Resolving a resolved operation is refused and logged.
    assert_eq!(e.resolve(&req(Resolution::Succeeded, "x", Some("rcpt_1"), None)).unwrap().code, "NOT_RESOLVABLE");
    let log = e.audit_log(100).unwrap();
    assert_eq!(log.iter().filter(|r| r.action == "resolve" && r.result == "refused").count(), 5);
    assert_eq!(log.iter().filter(|r| r.action == "resolve" && r.result == "applied").count(), 1);
}

fn operator_actions_are_idempotent_by_action_id(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // The provider shows nothing (yet): the operator's evidence is not contradicted.
    let u = dispatch_with(&mut e, &refund("refund-human-02", 500), "timeout_before_commit");
    let op = u.protected_audit.operation_id.clone().unwrap();
    let r = ResolveRequest {
        operation_id: op.clone(),
        resolution: Resolution::Succeeded,
        operator: "oncall-kim".into(),
        note: "provider dashboard shows the refund".into(),
        evidence: Some("rcpt_from_dashboard".into()),
        seen_version: None,
        action_id: Some("act-1".into()),
        no_evidence: false,
    };
    assert!(e.resolve(&r).unwrap().applied);
    let again = e.resolve(&r).unwrap();
    assert!(again.applied && again.message.starts_with("action already recorded"));
    assert_eq!(e.audit_log(100).unwrap().iter().filter(|a| a.action == "resolve").count(), 1);
    let got = e.dispatch(&refund("refund-human-02", 500)).unwrap();
    assert_eq!(
        (got.model_result.status, got.model_result.execution.delivery),
        (Status::Succeeded, Delivery::HumanResolved)
    );
}

fn the_audit_log_is_append_only_and_counts_every_operator_state_change(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let id = approval_id(&e.dispatch(&big_refund("refund-big-0006")).unwrap());
    e.approve(&id, "bob").unwrap(); // applied
    let id2 = approval_id(&e.dispatch(&big_refund("refund-big-0007")).unwrap());
    e.deny(&id2, "bob", "no").unwrap(); // applied
    let u = dispatch_with(&mut e, &refund("refund-audit-01", 100), "timeout_after_commit");
    e.query_operation_status(&query_for(&u)).unwrap(); // applied (reconciled)
    e.approve("apr_missing", "bob").unwrap(); // refused
    let log = e.audit_log(100).unwrap();
    let count = |action: &str, result: &str| log.iter().filter(|r| r.action == action && r.result == result).count();
    assert_eq!(
        (count("approve", "applied"), count("deny", "applied"), count("query", "applied"), count("approve", "refused")),
        (1, 1, 1, 1)
    );
    assert!(!fx.try_exec("UPDATE audit_log SET reason = 'x'"));
    assert!(!fx.try_exec("DELETE FROM audit_log"));
    assert_eq!(e.audit_log(100).unwrap().len(), 4);
}

fn audit_finds_an_orphan_receipt_and_a_zeroed_digest_without_naming_anyone(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    e.dispatch(&refund("refund-secret-key-XYZ", 100)).unwrap();
    assert!(e.audit().unwrap().is_empty());
    fx.exec(
        "INSERT INTO receipts (receipt_id, operation_id, request_id, body_sha256, result_sha256, source, recorded_at)
         VALUES ('rcpt_orphan', 'op_nowhere', 'dreq_x', 'x', 'x', 'reply', 0)",
        &[],
    );
    fx.exec(&format!("UPDATE operations SET result_sha256 = '{}'", "0".repeat(64)), &[]);
    let findings = e.audit().unwrap();
    let text = serde_json::to_string(&findings).unwrap();
    assert!(findings.iter().any(|f| f.check == "orphan_receipt"), "{text}");
    assert!(findings.iter().any(|f| f.check == "digest"), "{text}");
    for secret in ["acme", "agent_ana", "refund-secret-key-XYZ", "ord_1001"] {
        assert!(!text.contains(secret), "audit output names {secret}: {text}");
    }
}

fn crash_after_commit_really_aborts_and_recovery_finds_one_effect(backend: Backend) {
    let fx = Fixture::on(backend);
    let bin = env!("CARGO_BIN_EXE_toolgate");
    let out = std::process::Command::new(bin)
        .args(["dispatch", "--db"])
        .arg(fx.path())
        .args([
            "--now",
            "2026-01-01T00:00:00Z",
            "--tenant",
            "acme",
            "--subject",
            "agent_ana",
            "--tool",
            "create_refund",
        ])
        .args(["--key", "refund-crash-001", "--fault", "crash_after_commit", "--args", &refund_args("ord_1001", 700)])
        .output()
        .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(out.status.signal(), Some(6), "died by SIGABRT: {out:?}");
    }
    assert!(!out.status.success());
    let mut e = fx.engine();
    assert_eq!(effects(&mut e), 1);
    let ops = e.list_operations(None, 10).unwrap();
    assert_eq!(ops.len(), 1);
    assert_eq!(ops[0].state, "in_flight");
    // The retry after restart: unknown, same status_ref, no second effect.
    let r = e.dispatch(&refund("refund-crash-001", 700)).unwrap();
    assert_eq!(code(&r), Some(Code::OutcomeUnknown));
    assert_eq!(r.status_ref(), Some(ops[0].status_ref.as_str()));
    let q = e.query_operation_status(&query_for(&r)).unwrap();
    assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled);
    assert_eq!(effects(&mut e), 1);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

fn resolve_req(op: &str, resolution: Resolution, evidence: Option<&str>, action: &str) -> ResolveRequest {
    ResolveRequest {
        operation_id: op.into(),
        resolution,
        operator: "oncall-kim".into(),
        note: "checked by hand".into(),
        evidence: evidence.map(str::to_string),
        seen_version: None,
        action_id: Some(action.into()),
        no_evidence: false,
    }
}

fn a_human_decision_that_contradicts_the_providers_evidence_is_refused_unless_overridden(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // The provider committed the refund; the reply was lost.
    let u = dispatch_with(&mut e, &refund("refund-evidence-1", 700), "timeout_after_commit");
    let op = u.protected_audit.operation_id.clone().unwrap();
    // "failed" (no effect) against the provider's receipt: refused, with the evidence.
    let out = e.resolve(&resolve_req(&op, Resolution::Failed, None, "ev-1")).unwrap();
    assert!(!out.applied);
    assert_eq!(out.code, "STATUS_CONFLICT");
    assert!(out.message.contains("the provider holds receipt"), "{}", out.message);
    // "succeeded" with a receipt id the provider does not hold: refused too.
    let out = e.resolve(&resolve_req(&op, Resolution::Succeeded, Some("rcpt_made_up"), "ev-2")).unwrap();
    assert_eq!((out.applied, out.code), (false, "STATUS_CONFLICT"), "{}", out.message);
    let detail = e.operation_detail(&op).unwrap().unwrap();
    assert_eq!(detail.operation.state, "unknown", "nothing changed");
    // An explicit override applies, and the audit entry says it was made against the evidence.
    let out = e.resolve_against_evidence(&resolve_req(&op, Resolution::Failed, None, "ev-3")).unwrap();
    assert!(out.applied, "{}", out.message);
    let entry = e.audit_log(10).unwrap().into_iter().find(|a| a.action_id.as_deref() == Some("ev-3")).unwrap();
    let evidence: serde_json::Value = serde_json::from_str(&entry.evidence).unwrap();
    assert!(evidence["against_evidence"].as_str().unwrap().contains("the provider holds receipt"), "{evidence}");
    assert_eq!(evidence["provider_evidence"]["lookup"], "found");
}

fn a_human_decision_the_evidence_supports_is_applied_and_records_what_the_provider_said(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    // Nothing reached the provider: "failed" agrees with the lookup.
    let u = dispatch_with(&mut e, &refund("refund-evidence-2", 700), "timeout_before_commit");
    let op = u.protected_audit.operation_id.clone().unwrap();
    // Past the window in which a receipt of the send could still appear.
    fx.clock.advance(66_000);
    let out = e.resolve(&resolve_req(&op, Resolution::Failed, None, "ev-4")).unwrap();
    assert!(out.applied, "{}", out.message);
    let entry = e.audit_log(10).unwrap().into_iter().find(|a| a.action_id.as_deref() == Some("ev-4")).unwrap();
    let evidence: serde_json::Value = serde_json::from_str(&entry.evidence).unwrap();
    assert_eq!(evidence["provider_evidence"]["lookup"], "not_found");
    assert!(evidence["against_evidence"].is_null());
}

/// Issue 32 §1.3: a receipt can appear late (replication lag). Before: a
/// `not_found` right after the send read "needs a human decision", `failed`
/// was applied, and the refund that happened stayed recorded as no effect.
fn no_receipt_inside_the_visibility_window_is_not_proof_of_absence(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let u = dispatch_with(&mut e, &refund("refund-lagging-1", 700), "receipt_delay(40000)");
    let op = u.protected_audit.operation_id.clone().unwrap();
    let q = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(code(&q), Some(Code::OutcomeUnknown));
    let err = q.model_result.error.as_ref().unwrap();
    assert!(err.retry_after_ms.is_some_and(|ms| ms > 40_000), "query again after the window: {err:?}");
    assert!(err.detail.as_ref().unwrap()["query_again_after"].is_string(), "{err:?}");
    let detail = e.operation_detail(&op).unwrap().unwrap();
    assert!(detail.receipt_window_until.is_some());
    // failed is refused while the window is open...
    let out = e.resolve(&resolve_req(&op, Resolution::Failed, None, "lag-1")).unwrap();
    assert_eq!((out.applied, out.code), (false, "RECEIPT_MAY_STILL_APPEAR"), "{}", out.message);
    assert_eq!(state(&mut e, &op), "unknown");
    // ...and the receipt does appear: the query settles it.
    fx.clock.advance(40_000);
    let q = e.query_operation_status(&query_for(&u)).unwrap();
    assert_eq!(q.model_result.execution.delivery, Delivery::ReceiptReconciled, "{q:?}");
    assert_eq!(effects(&mut e), 1);

    // Decided against the evidence inside the window: applied, recorded as
    // such, and the audit later finds the receipt that appeared.
    let u = dispatch_with(&mut e, &refund("refund-lagging-2", 300), "receipt_delay(40000)");
    let op = u.protected_audit.operation_id.clone().unwrap();
    let out = e.resolve_against_evidence(&resolve_req(&op, Resolution::Failed, None, "lag-2")).unwrap();
    assert!(out.applied, "{}", out.message);
    let entry = e.audit_log(10).unwrap().into_iter().find(|a| a.action_id.as_deref() == Some("lag-2")).unwrap();
    let evidence: serde_json::Value = serde_json::from_str(&entry.evidence).unwrap();
    assert!(evidence["receipt_window_open_until"].is_i64(), "{evidence}");
    fx.clock.advance(70_000);
    let findings = e.audit().unwrap();
    assert!(
        findings.iter().any(|f| f.check == "money" && f.reference == op),
        "the receipt that appeared after a failed decision is reported: {findings:?}"
    );
}

crate::on_both_backends!(
    no_receipt_inside_the_visibility_window_is_not_proof_of_absence,
    the_audit_log_is_append_only_and_counts_every_operator_state_change,
    audit_finds_an_orphan_receipt_and_a_zeroed_digest_without_naming_anyone,
    unknown_then_query_reconciles_then_replays_with_one_effect,
    receipt_not_yet_available_stays_unknown_until_the_delay_passes,
    mismatching_receipt_is_a_status_conflict_and_needs_review,
    query_checks_digest_key_provider_and_status_ref_before_looking,
    a_query_call_identity_can_never_dispatch_and_the_reverse,
    approval_required_pending_approved_executes_once,
    approval_refusals_run_nothing,
    a_contract_revision_change_invalidates_a_pending_approval,
    a_denied_request_answers_approval_invalid_to_repeats,
    human_resolution_needs_a_note_evidence_and_a_fresh_snapshot,
    operator_actions_are_idempotent_by_action_id,
    crash_after_commit_really_aborts_and_recovery_finds_one_effect,
    a_human_decision_that_contradicts_the_providers_evidence_is_refused_unless_overridden,
    a_human_decision_the_evidence_supports_is_applied_and_records_what_the_provider_said,
);
