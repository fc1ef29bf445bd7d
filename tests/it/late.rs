//! "Failed" decided while the send is still running: a sender held inside the
//! downstream call (the gate clock of `support`, not a sleep) while an
//! operator cancels and then tries to resolve the operation as failed. The
//! decision is refused while the attempt may still land; the late reply's
//! receipt settles the operation through the provider's own word; a decision
//! made after the attempt's bound that the late receipt contradicts reopens
//! the operation as a contradiction, never silently.

use std::sync::Arc;
use toolgate::Coded;

use toolgate::engine::envelope::{Code, Delivery, Status};
use toolgate::engine::{CancelRequest, Engine, Resolution, ResolveRequest};
use toolgate::store::OpState;

use crate::support::{dispatch_parked, refund, Backend, Fixture, GateClock};

/// create_refund's attempt timeout in the demo catalog.
const ATTEMPT_TIMEOUT_MS: i64 = 5_000;

/// A refund whose sender is parked inside the provider call (claimed, its
/// sent-marker committed) on its own thread, until the test opens the gate.
fn parked_sender(
    fx: &Fixture,
    key: &str,
) -> (Arc<GateClock>, std::thread::JoinHandle<toolgate::engine::envelope::Envelope>, String) {
    let clock = GateClock::new(&fx.clock);
    let handle = dispatch_parked(fx, &clock, refund(key, 1_000));
    let mut e = fx.engine();
    let op = e.list_operations(None, 100).unwrap().into_iter().find(|o| o.idem_key == key).unwrap();
    assert_eq!(op.state, OpState::InFlight, "the sender is inside the call");
    (clock, handle, op.id)
}

fn row(e: &mut Engine, op: &str) -> toolgate::store::OperationRow {
    e.list_operations(None, 100).unwrap().into_iter().find(|o| o.id == op).unwrap()
}

fn cancel(e: &mut Engine, op: &str) {
    let out = e
        .cancel(&CancelRequest {
            operation_id: op.into(),
            operator: "alice".into(),
            note: "stop".into(),
            seen_version: None,
            action_id: None,
        })
        .unwrap();
    assert!(out.applied, "{out:?}");
}

fn resolve_failed(e: &mut Engine, op: &str) -> toolgate::engine::OperatorOutcome {
    e.resolve(&crate::support::failed_by(op, "bob", "no receipt")).unwrap()
}

/// The issue's reproduction: cancel while the sender is inside the call, then
/// "failed". Refused while the attempt may still land; the sender's late reply
/// then settles the operation as succeeded from the provider's receipt.
fn failed_is_refused_while_the_send_may_still_land(backend: Backend) {
    let fx = Fixture::on(backend);
    let (gate, sender, op) = parked_sender(&fx, "late-send-00001");
    let mut e = fx.engine();
    cancel(&mut e, &op);
    let out = resolve_failed(&mut e, &op);
    assert!(!out.applied, "{out:?}");
    assert_eq!(out.code, "SEND_MAY_STILL_LAND", "{out:?}");
    assert!(out.message.contains("may still land until"), "{}", out.message);
    // The sender comes back with the provider's receipt.
    gate.open();
    let late = sender.join().unwrap();
    assert_ne!(late.model_result.status, Status::Succeeded, "the sender's caller is told what the row said");
    let now = row(&mut e, &op);
    assert_eq!(now.state, OpState::Succeeded, "the late receipt settled it through a status query");
    let replay = e.dispatch(&refund("late-send-00001", 1_000)).unwrap();
    assert_eq!(replay.model_result.status, Status::Succeeded);
    assert_eq!(replay.model_result.execution.delivery, Delivery::LocalReplay);
    let order = toolgate::tools::demo::orders(&mut e).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
    assert_eq!(order.refunded_minor, 1_000, "the refund is on the order once");
    assert!(e.holds().unwrap().is_empty());
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// A sender stalled past its own bound (as a SIGSTOP would): a person may then
/// decide "failed" (the attempt's bound has passed, and the provider shows no
/// receipt yet). When the stalled sender's reply lands after all, the receipt
/// reopens the decision as a contradiction, never silently, and the audit
/// sees the money.
fn a_late_receipt_reopens_a_failed_decision_as_a_contradiction(backend: Backend) {
    let fx = Fixture::on(backend);
    let (gate, sender, op) = parked_sender(&fx, "late-send-00002");
    let mut e = fx.engine();
    cancel(&mut e, &op);
    fx.clock.advance(ATTEMPT_TIMEOUT_MS + 1);
    let early = resolve_failed(&mut e, &op);
    assert_eq!(early.code, "RECEIPT_MAY_STILL_APPEAR", "a receipt may still appear: {early:?}");
    fx.clock.advance(toolgate::engine::contracts::DEFAULT_RECEIPT_VISIBLE_WITHIN_MS as i64);
    let out = resolve_failed(&mut e, &op);
    assert!(out.applied, "past the attempt's bound and the receipt window: {out:?}");
    gate.open();
    sender.join().unwrap();
    let reopened = row(&mut e, &op);
    assert_eq!(reopened.state, OpState::NeedsReview, "reopened, not left as failed");
    assert_eq!(reopened.code.as_deref(), Some(Code::StatusConflict.as_str()));
    assert_eq!(reopened.resolution.as_deref(), Some("failed"), "the person's decision is kept beside the receipt");
    assert_eq!(reopened.resolved_by.as_deref(), Some("bob"));
    let held: i64 = e.holds().unwrap().iter().filter(|h| h.0 == op).map(|h| h.2).sum();
    assert_eq!(held, 1_000, "under review again, it holds what it was granted (the money is gone)");
    let log = e.audit_log(10).unwrap();
    assert!(
        log.iter().any(|a| a.action == "contradiction" && a.operation_id.as_deref() == Some(op.as_str())),
        "{log:?}"
    );
    // A person decides again, with the receipt: the refund lands on the order.
    let receipt = e.audit_log(10).unwrap().iter().find(|a| a.action == "contradiction").unwrap().evidence.clone();
    let receipt: serde_json::Value = serde_json::from_str(&receipt).unwrap();
    let again = e
        .resolve(&ResolveRequest {
            operation_id: op.clone(),
            resolution: Resolution::Succeeded,
            operator: "bob".into(),
            note: "the provider paid it".into(),
            evidence: receipt["receipt_id"].as_str().map(str::to_string),
            seen_version: None,
            action_id: None,
            no_evidence: false,
        })
        .unwrap();
    assert!(again.applied, "{again:?}");
    let order = toolgate::tools::demo::orders(&mut e).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
    assert_eq!(order.refunded_minor, 1_000);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

crate::on_both_backends!(
    failed_is_refused_while_the_send_may_still_land,
    a_late_receipt_reopens_a_failed_decision_as_a_contradiction,
);

/// The issue's reproduction across processes, as an operator would type it: a
/// `dispatch` process whose provider call takes 3 s, a `cancel` and a
/// `resolve --as failed` from other processes while it is inside the call.
/// The resolution is refused; when the sender's reply lands, the operation is
/// settled from the provider's receipt, and the audit finds nothing wrong.
fn across_processes_failed_is_refused_while_the_dispatch_is_inside_the_call(backend: Backend) {
    let fx = Fixture::on(backend);
    let db = fx.path().to_path_buf();
    let tg = || std::process::Command::new(env!("CARGO_BIN_EXE_toolgate"));
    let args = r#"{"order_ref":"ord_1001","amount_minor":1000,"currency":"EUR","reason":"damaged"}"#;
    let sender = tg()
        .args(["dispatch", "--db"])
        .arg(&db)
        .args(["--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--args", args])
        .args(["--key", "refund-t1-0001", "--fault", "latency(3000)", "--json"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait (bounded) until the dispatch is inside the call.
    let mut op = None;
    for _ in 0..400 {
        let out =
            tg().args(["ops", "list", "--db"]).arg(&db).args(["--state", "in_flight", "--json"]).output().unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if let Some(id) = v["operations"][0]["id"].as_str() {
            op = Some(id.to_string());
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let op = op.expect("the dispatch never got inside the call");
    let cancel =
        tg().args(["cancel", "--db"]).arg(&db).args(["--operator", "alice", "--note", "stop", &op]).output().unwrap();
    assert!(cancel.status.success(), "{}", String::from_utf8_lossy(&cancel.stderr));
    let resolve = tg()
        .args(["resolve", "--db"])
        .arg(&db)
        .args(["--operator", "bob", "--as", "failed", "--note", "no receipt", &op])
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&resolve.stdout), String::from_utf8_lossy(&resolve.stderr));
    assert_eq!(resolve.status.code(), Some(1), "{said}");
    assert!(said.contains("SEND_MAY_STILL_LAND"), "{said}");
    assert!(sender.wait_with_output().unwrap().status.code().is_some());
    let show = tg().args(["ops", "show", "--db"]).arg(&db).args([&op, "--json"]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["operation"]["state"], "succeeded", "{v}");
    let audit = tg().args(["audit", "--db"]).arg(&db).output().unwrap();
    assert!(audit.status.success(), "{}", String::from_utf8_lossy(&audit.stdout));
}

crate::on_both_backends!(across_processes_failed_is_refused_while_the_dispatch_is_inside_the_call);

/// The engine itself never decides "failed" while a send may land: a re-queued
/// attempt (the reaper took the lease from a sender still inside the call)
/// whose re-check now refuses (the grant was revoked) parks the operation as
/// unknown, keeping its hold, instead of failing it.
fn a_refused_recheck_after_a_detached_send_is_unknown_not_failed(backend: Backend) {
    let fx = Fixture::on(backend);
    let (gate, sender, op) = parked_sender(&fx, "late-send-00003");
    let mut e = fx.engine();
    // Past the lease (attempt timeout + 1 s), within the deadline: re-queued under the same key.
    fx.clock.advance(ATTEMPT_TIMEOUT_MS + 1_500);
    let reaped = e.reap().unwrap();
    assert_eq!(reaped.requeued_same_key, 1, "{reaped:?}");
    assert!(e.revoke("acme", "agent_ana", "create_refund").unwrap());
    e.work(10).unwrap();
    let parked = row(&mut e, &op);
    assert_eq!(parked.state, OpState::Unknown, "attempt 1 may still land: not failed");
    let held: i64 = e.holds().unwrap().iter().filter(|h| h.0 == op).map(|h| h.2).sum();
    assert_eq!(held, 1_000);
    gate.open();
    sender.join().unwrap();
}

crate::on_both_backends!(a_refused_recheck_after_a_detached_send_is_unknown_not_failed);

/// A token revoked between a request's authentication and its accept: the
/// accepting transaction reads the token again, so the call is refused
/// (`TOKEN_REVOKED`) and nothing is accepted.
fn a_token_revoked_before_the_accept_commits_refuses_the_call(backend: Backend) {
    use toolgate::engine::tokens::{Principal, TokenFor};
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    let t =
        e.create_token(&TokenFor::Subject { tenant: "acme".into(), subject: "agent_ana".into() }, None, None).unwrap();
    let header = format!("Bearer {}", t.token);
    let Ok(Principal::Subject { token_id, .. }) = e.authenticate(Some(header.as_bytes())).unwrap() else {
        panic!("the token authenticates")
    };
    // The revocation commits after the authentication, before the accept.
    assert!(fx.engine().revoke_token(&token_id).unwrap());
    let req = toolgate::engine::DispatchRequest { token_id: Some(token_id), ..refund("revoked-token-01", 500) };
    let err = e.dispatch(&req).unwrap_err();
    assert_eq!(err.code(), "TOKEN_REVOKED", "{err}");
    assert!(e.list_operations(None, 10).unwrap().is_empty(), "nothing accepted");
    assert!(e.holds().unwrap().is_empty());
}

crate::on_both_backends!(a_token_revoked_before_the_accept_commits_refuses_the_call);
