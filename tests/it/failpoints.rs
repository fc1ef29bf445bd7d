//! Failpoints: the real `toolgate` binary aborts (`TOOLGATE_FAILPOINT=NAME`) at
//! each step of the pipeline; a restarted engine then recovers (reaper past the
//! lease, workers, the caller's retry, explicit status queries, a human for what
//! no query can settle) and every invariant of [`crate::invariants::check`] holds.

use std::path::Path;
use std::process::Command;

use serde_json::Value;
use toolgate::engine::clock::{rfc3339, ManualClock};
use toolgate::engine::envelope::{Delivery, Status};
use toolgate::engine::{DispatchRequest, Engine, QueryRequest};

use crate::invariants::{check, Expect};
use crate::support::{opts, refund_args, T0};

const REFUND_KEY: &str = "refund-failpoint-01";
const NOTIFY_KEY: &str = "notify-failpoint-01";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    Refund,
    Notify,
}

/// What the operation must end as once recovery has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Succeeded (by a worker or a status query), one effect.
    Succeeded,
    /// Nothing reached the provider: a human resolves it as failed, no effect.
    ResolvedFailed,
}

fn toolgate(db: &Path, at: i64, failpoint: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_toolgate"));
    c.arg("--db").arg(db).args(["--now", &rfc3339(at)]).args(args);
    match failpoint {
        Some(f) => c.env("TOOLGATE_FAILPOINT", f),
        None => c.env_remove("TOOLGATE_FAILPOINT"),
    };
    c.output().unwrap()
}

fn json_of(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!("{e}: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    })
}

fn assert_aborted(out: &std::process::Output, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(6),
        "{what}: expected an abort at the failpoint, got {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn request(tool: Tool) -> DispatchRequest {
    match tool {
        Tool::Refund => crate::support::refund(REFUND_KEY, 1_000),
        Tool::Notify => DispatchRequest {
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            tool: "notify_customer".into(),
            arguments: br#"{"order_ref":"ord_1001","template":"refund_issued"}"#.to_vec(),
            idempotency_key: Some(NOTIFY_KEY.into()),
            ..DispatchRequest::default()
        },
    }
}

fn dispatch_args(tool: Tool) -> Vec<String> {
    let (name, args, key) = match tool {
        Tool::Refund => ("create_refund", refund_args("ord_1001", 1_000), REFUND_KEY),
        Tool::Notify => {
            ("notify_customer", r#"{"order_ref":"ord_1001","template":"refund_issued"}"#.into(), NOTIFY_KEY)
        }
    };
    ["dispatch", "--tenant", "acme", "--subject", "agent_ana", "--tool", name, "--args", &args, "--key", key, "--json"]
        .iter()
        .map(ToString::to_string)
        .collect()
}

/// Runs the call that reaches `failpoint` in a child `toolgate` process and
/// checks that it really aborted there.
fn crash_at(db: &Path, failpoint: &str, tool: Tool) {
    let args = dispatch_args(tool);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    if failpoint == "inside_reconcile" {
        // First an unknown outcome (the reply is lost after the commit), then the
        // status query that crashes inside its backfill transaction.
        let mut with_fault = args.clone();
        with_fault.extend(["--fault", "timeout_after_commit"]);
        let env = json_of(&toolgate(db, T0, None, &with_fault));
        let env = match tool {
            Tool::Refund => env,
            Tool::Notify => approve(db, &env, None, &["--fault", "timeout_after_commit"]),
        };
        assert_eq!(env["model_result"]["error"]["code"], "OUTCOME_UNKNOWN", "{env}");
        let a = &env["protected_audit"];
        let out = toolgate(
            db,
            T0 + 1_000,
            Some(failpoint),
            &[
                "query",
                "--tenant",
                "acme",
                "--subject",
                "agent_ana",
                "--status-ref",
                a["downstream"]["status_ref"].as_str().unwrap(),
                "--expect-sha256",
                a["binding"]["request_sha256"].as_str().unwrap(),
                "--json",
            ],
        );
        assert_aborted(&out, failpoint);
        return;
    }
    match tool {
        Tool::Refund => assert_aborted(&toolgate(db, T0, Some(failpoint), &args), failpoint),
        Tool::Notify => {
            let env = json_of(&toolgate(db, T0, None, &args));
            assert_eq!(env["model_result"]["error"]["code"], "APPROVAL_REQUIRED", "{env}");
            approve(db, &env, Some(failpoint), &[]);
        }
    }
}

/// Approves the request an APPROVAL_REQUIRED envelope names (alice is on acme's
/// allowlist), optionally crashing at a failpoint; returns the envelope when the
/// process did not crash.
fn approve(db: &Path, env: &Value, failpoint: Option<&str>, extra: &[&str]) -> Value {
    let id = env["protected_audit"]["approval_id"].as_str().unwrap();
    if !extra.is_empty() {
        // The CLI's approve takes no fault: run it in-process with the fault instead.
        let clock = ManualClock::new(T0);
        let mut e = Engine::open(db, opts(&clock, "approver")).unwrap();
        e.set_faults(toolgate::downstream::FaultPlan::parse(extra[1]).unwrap());
        return serde_json::to_value(e.approve(id, "alice").unwrap()).unwrap();
    }
    let out = toolgate(db, T0, failpoint, &["approve", id, "--approver", "alice", "--json"]);
    match failpoint {
        Some(f) => {
            assert_aborted(&out, f);
            Value::Null
        }
        None => json_of(&out),
    }
}

/// Restart and recovery: reaper once the dead process's lease has expired,
/// workers, the caller's retry, explicit status queries, and an operator for an
/// operation no query can settle. Returns the final answer to the caller.
fn recover(db: &Path, tool: Tool) -> toolgate::engine::envelope::Envelope {
    // Past the 6 s lease, within the 30 s deadline: re-queues happen and run.
    let clock = ManualClock::new(T0 + 7_000);
    let mut e = Engine::open(db, opts(&clock, "restarted")).unwrap();
    e.reap().unwrap();
    e.work(100).unwrap();
    let retry = e.dispatch(&request(tool)).unwrap();
    if retry.model_result.status == Status::Unknown {
        let a = &retry.protected_audit;
        let q = e
            .query_operation_status(&QueryRequest {
                tenant: "acme".into(),
                subject: "agent_ana".into(),
                status_ref: a.downstream.status_ref.clone().unwrap(),
                expected_request_sha256: a.binding.request_sha256.clone().unwrap(),
                ..QueryRequest::default()
            })
            .unwrap();
        if q.model_result.status == Status::Unknown {
            // Nothing downstream under its key: only a human can close it.
            let (v, _) = check(db, Expect { settled: true, queried: true });
            assert!(v.is_empty(), "before the resolution: {v:#?}");
            // "No record" is proof of nothing until the receipt window passed.
            clock.advance(66_000);
            let out = e
                .resolve(&crate::support::failed_by(
                    a.operation_id.as_deref().unwrap(),
                    "oncall",
                    "provider has no record of the request",
                ))
                .unwrap();
            assert!(out.applied, "{out:?}");
        }
    }
    e.dispatch(&request(tool)).unwrap()
}

/// On every backend the tests have (one definition, a backend each).
fn check_failpoint(failpoint: &str, tool: Tool, end: End) {
    for backend in crate::support::backends() {
        check_failpoint_on(backend, failpoint, tool, end);
    }
}

fn check_failpoint_on(backend: crate::support::Backend, failpoint: &str, tool: Tool, end: End) {
    let fx = crate::support::Fixture::on(backend);
    crash_at(fx.path(), failpoint, tool);
    if tool == Tool::Refund {
        // Killed between accept and apply: the refund's hold survives with its
        // operation (the money may be on its way), and only then.
        let mut e = fx.engine();
        let open = e.list_operations(None, 10).unwrap().iter().any(|o| !o.state.is_terminal());
        let held: i64 = e.holds().unwrap().iter().map(|h| h.2).sum();
        assert_eq!(held, if open { 1_000 } else { 0 }, "{failpoint}: the hold after the crash");
    }
    let last = recover(fx.path(), tool);
    let (v, tally) = check(fx.path(), Expect { settled: true, queried: true });
    assert!(v.is_empty(), "{failpoint} / {tool:?}: {v:#?}");
    if tool == Tool::Refund {
        // Settled: converted into the refund, or released by the human's "failed".
        let mut e = fx.engine();
        assert!(e.holds().unwrap().is_empty(), "{failpoint}: a hold outlived its operation");
        let order =
            toolgate::tools::demo::orders(&mut e).unwrap().into_iter().find(|o| o.order_ref == "ord_1001").unwrap();
        let refunded = if end == End::Succeeded { 1_000 } else { 0 };
        assert_eq!(order.refunded_minor, refunded, "{failpoint}");
    }
    match end {
        End::Succeeded => {
            assert_eq!(last.model_result.status, Status::Succeeded, "{failpoint} / {tool:?}: {last:?}");
            assert_eq!(last.model_result.execution.delivery, Delivery::LocalReplay, "{failpoint} / {tool:?}");
            assert_eq!((tally.effects, tally.states.get("succeeded").copied()), (1, Some(1)), "{failpoint} / {tool:?}");
        }
        End::ResolvedFailed => {
            assert_eq!(last.model_result.execution.delivery, Delivery::HumanResolved, "{failpoint} / {tool:?}");
            assert_eq!(tally.effects, 0, "{failpoint} / {tool:?}");
        }
    }
}

#[test]
fn failpoint_inside_accept_leaves_nothing_and_the_retry_runs_once() {
    check_failpoint("inside_accept", Tool::Refund, End::Succeeded);
}

#[test]
fn failpoint_after_claim_is_requeued_as_never_sent() {
    check_failpoint("after_claim", Tool::Refund, End::Succeeded);
    check_failpoint("after_claim", Tool::Notify, End::Succeeded);
}

#[test]
fn failpoint_after_sent_marker_resends_with_the_same_key_or_parks_unknown() {
    // Payments honours keys: re-sent under the same key, one effect.
    check_failpoint("after_sent", Tool::Refund, End::Succeeded);
    // Notifications do not: parked unknown; the query finds nothing; a human closes it.
    check_failpoint("after_sent", Tool::Notify, End::ResolvedFailed);
}

#[test]
fn failpoint_after_provider_commit_finds_the_one_effect() {
    // Payments answers the re-send with the original effect; notifications are
    // parked and the explicit query reconciles the receipt.
    check_failpoint("after_provider_commit", Tool::Refund, End::Succeeded);
    check_failpoint("after_provider_commit", Tool::Notify, End::Succeeded);
}

#[test]
fn failpoint_before_persist_finds_the_one_effect() {
    check_failpoint("before_persist", Tool::Refund, End::Succeeded);
    check_failpoint("before_persist", Tool::Notify, End::Succeeded);
}

#[test]
fn failpoint_inside_reconcile_rolls_back_and_the_next_query_reconciles() {
    check_failpoint("inside_reconcile", Tool::Refund, End::Succeeded);
    check_failpoint("inside_reconcile", Tool::Notify, End::Succeeded);
}
