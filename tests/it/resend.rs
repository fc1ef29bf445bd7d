//! Issue 35 §2: a downstream that de-duplicates keys but cannot be asked by
//! key (most payment and messaging APIs) is asked by re-sending the very same
//! request under the same key; a worker does it by itself once the receipt
//! window has passed. Over real sockets: a `toolgate provider serve` child
//! whose lookup endpoint the catalog does not use (`http.lookup: null`).

use serde_json::{json, Value};
use toolgate::downstream::{FaultPlan, Reply};
use toolgate::engine::envelope::{Code, Envelope, Status};
use toolgate::engine::Engine;

use crate::http::HttpFixture;
use crate::support::{call, dispatch_with, Backend};

/// A day: what Stripe documents for its keys.
const DAY_MS: u64 = 86_400_000;
/// The receipt window of the tool below: 1 s attempt timeout + 2 s.
const WINDOW_MS: u64 = 3_000;

/// The shipped http catalog with create_refund asked by re-sending.
fn resend_fixture(key_retention_ms: u64) -> HttpFixture {
    resend_fixture_on(Backend::Sqlite, key_retention_ms)
}

fn resend_fixture_on(backend: Backend, key_retention_ms: u64) -> HttpFixture {
    HttpFixture::with_catalog_on(backend, &|v| {
        if v["name"] == "create_refund" {
            v["downstream"]["http"]["lookup"] = Value::Null;
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": key_retention_ms});
            v["downstream"]["receipt_visible_within_ms"] = json!(2_000);
        }
    })
}

fn refund(key: &str, amount: i64) -> toolgate::engine::DispatchRequest {
    toolgate::engine::DispatchRequest {
        call: Some(call(&format!("call-{key}"))),
        ..crate::support::refund(key, amount)
    }
}

fn op_of(e: &mut Engine, env: &Envelope) -> toolgate::engine::OperationDetail {
    let id = env.protected_audit.operation_id.clone().expect("an operation");
    e.operation_detail(&id).unwrap().unwrap()
}

crate::on_both_backends!(a_reply_lost_after_commit_is_settled_by_the_worker_with_one_effect_and_no_person);
fn a_reply_lost_after_commit_is_settled_by_the_worker_with_one_effect_and_no_person(backend: Backend) {
    let fx = resend_fixture_on(backend, DAY_MS);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("resend-lost-0001", 1500), "drop_after_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    // A re-send can ask: it waits in the unknown queue, not for a person.
    assert_eq!(op_of(&mut e, &env).operation.state.to_string(), "unknown");
    assert_eq!(fx.server.effects(), 1);
    // Inside the receipt window the worker does not ask yet.
    assert_eq!(e.settle_unknown(16).unwrap(), 0);
    fx.clock.advance(WINDOW_MS as i64 + 1);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    let d = op_of(&mut e, &env);
    assert_eq!(d.operation.state.to_string(), "succeeded", "{:?}", d.operation);
    assert_eq!(fx.server.effects(), 1, "the re-send was answered from the first execution");
    assert_eq!(fx.server.duplicates(), 0);
    // The agent's retry replays the reconciled result.
    let again = e.dispatch(&refund("resend-lost-0001", 1500)).unwrap();
    assert_eq!(again.model_result.status, Status::Succeeded, "{again:?}");
    // Logged as the worker's, not a person's; the trace says how it asked.
    let log = e.audit_log(20).unwrap();
    assert!(log.iter().any(|a| a.actor == "toolgate-settle" && a.action == "query"), "{log:?}");
    let q = d.trace.iter().rev().find(|t| t.step == "query").expect("a query event");
    assert_eq!(q.reason.as_deref(), Some("reconciled"));
    assert!(q.fields.contains("re-sending"), "{q:?}");
    // Settled, it is not asked again.
    fx.clock.advance(60_000);
    assert_eq!(e.settle_unknown(16).unwrap(), 0);
    assert_eq!(fx.server.effects(), 1);
    // The worker's query is not a person's act: the retention purge takes the
    // operation when its 30 days are over, as for any the caller settled.
    fx.clock.advance(30 * DAY_MS as i64);
    let p = e.purge_expired().unwrap();
    assert_eq!((p.purged, p.kept_for_audit), (1, 0), "{p:?}");
}

#[test]
fn a_call_that_never_committed_is_executed_once_by_the_resend() {
    let fx = resend_fixture(DAY_MS);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("resend-none-0001", 700), "timeout_before_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(fx.server.effects(), 0, "received, never committed");
    fx.clock.advance(WINDOW_MS as i64 + 1);
    // The re-send is the same request under the same key: the provider runs it once.
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(op_of(&mut e, &env).operation.state.to_string(), "succeeded");
    assert_eq!(fx.server.effects(), 1);
    assert_eq!(fx.server.duplicates(), 0);
}

#[test]
fn another_request_under_the_key_is_status_conflict_for_a_person() {
    let fx = resend_fixture(DAY_MS);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("resend-conf-0001", 900), "timeout_before_commit");
    let d = op_of(&mut e, &env);
    // Meanwhile the provider committed another request under that very key.
    let mut ds = crate::http::adapter_for(&fx.catalog, "create_refund");
    let other = crate::http::request("ffff");
    assert!(matches!(ds.execute(&d.operation.downstream_key, &other).unwrap(), Reply::Committed(_)));
    fx.clock.advance(WINDOW_MS as i64 + 1);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    let d = op_of(&mut e, &env);
    assert_eq!(d.operation.state.to_string(), "needs_review");
    assert_eq!(d.operation.code.as_deref(), Some("STATUS_CONFLICT"));
    assert_eq!(fx.server.effects(), 1, "only the other request's effect");
    // Needs review is not asked again by the worker.
    fx.clock.advance(60_000);
    assert_eq!(e.settle_unknown(16).unwrap(), 0);
}

#[test]
fn a_refusal_of_the_resend_goes_to_a_person_and_a_busy_provider_is_asked_again() {
    let fx = resend_fixture(DAY_MS);
    let mut e = fx.engine();
    let busy = dispatch_with(&mut e, &refund("resend-busy-0001", 300), "timeout_before_commit");
    let refused = dispatch_with(&mut e, &refund("resend-refu-0001", 400), "timeout_before_commit");
    fx.clock.advance(WINDOW_MS as i64 + 1);
    // The provider is unavailable to the first re-send: still unknown, asked again later.
    e.set_faults(FaultPlan::parse("unavailable").unwrap());
    assert_eq!(e.settle_unknown(1).unwrap(), 1);
    e.set_faults(FaultPlan::none());
    let asked_busy = op_of(&mut e, &busy).operation.last_query_at.is_some();
    let (first, second) = if asked_busy { (&busy, &refused) } else { (&refused, &busy) };
    assert_eq!(op_of(&mut e, first).operation.state.to_string(), "unknown");
    // The other one is asked next (never asked comes first), and refused.
    e.set_faults(FaultPlan::parse("reject(card_declined)").unwrap());
    assert_eq!(e.settle_unknown(1).unwrap(), 1);
    e.set_faults(FaultPlan::none());
    let d = op_of(&mut e, second);
    assert_eq!(d.operation.state.to_string(), "needs_review", "{:?}", d.operation);
    // Within receipt_visible_within_ms of its last query the first is not asked again...
    assert_eq!(e.settle_unknown(16).unwrap(), 0);
    // ...after it, it is, and settles.
    fx.clock.advance(2_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(op_of(&mut e, first).operation.state.to_string(), "succeeded");
    assert_eq!(fx.server.effects(), 1);
}

#[test]
fn past_the_downstreams_key_memory_nothing_is_resent_and_a_person_decides() {
    let fx = resend_fixture(10_000);
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("resend-old-00001", 500), "timeout_before_commit");
    fx.clock.advance(10_000);
    // A re-send now could act a second time (the provider may have forgotten the key).
    let q = e.query_operation_status(&crate::support::query_req(&env, "q-old")).unwrap();
    assert_eq!(q.model_result.status, Status::Unknown, "{q:?}");
    let d = op_of(&mut e, &env);
    assert_eq!(d.operation.state.to_string(), "needs_review");
    let ev = d.trace.iter().rev().find(|t| t.step == "query").unwrap();
    assert!(ev.fields.contains("not re-sent"), "{ev:?}");
    assert_eq!(fx.server.effects(), 0, "nothing was sent");
}

#[test]
fn the_catalog_refuses_a_resend_that_would_be_a_blind_retry() {
    let dir = tempfile::tempdir().unwrap();
    type Edit<'a> = &'a dyn Fn(&mut Value);
    let cases: [(&str, Edit); 3] = [
        ("dedupes_keys must be true", &|v| {
            v["effect"] = json!("external");
            v["downstream"]["dedupes_keys"] = json!(false);
            v["downstream"]["http"]["lookup"] = Value::Null;
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": DAY_MS});
        }),
        ("longer than the receipt window", &|v| {
            v["downstream"]["http"]["lookup"] = Value::Null;
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": 2_000});
        }),
        ("re-sends to ask", &|v| {
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": DAY_MS});
        }),
    ];
    for (i, (why, edit)) in cases.into_iter().enumerate() {
        let sub = dir.path().join(format!("c{i}"));
        std::fs::create_dir_all(&sub).unwrap();
        let catalog = crate::http::write_catalog_edited(&sub, "http://127.0.0.1:9", &|v| {
            if v["name"] == "create_refund" {
                edit(v);
            }
        });
        let err = toolgate::tools::load_toolset(Some(&catalog)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// Issue 35 §5: the load generator against a served provider that loses one
/// reply in three (and refuses, rate-limits, stalls), its create_refund asked
/// by re-sending and its notifications by key, both settled by the workers:
/// no duplicate, nothing silently wrong, no unknown left, every operation
/// parked for a person with its reason.
#[test]
fn a_load_run_on_a_resend_service_under_faults_leaves_no_unknown_and_no_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let server = crate::http::ProviderServer::start(dir.path(), &["--faults", "random(0.3,seed=3)"]);
    let catalog = crate::http::write_catalog_edited(dir.path(), &server.url(), &|v| {
        if v["name"] == "create_refund" {
            v["downstream"]["http"]["lookup"] = Value::Null;
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": DAY_MS});
        }
        if v["name"] != "get_order" {
            v["downstream"]["auto_query"] = json!(true);
            v["downstream"]["receipt_visible_within_ms"] = json!(1_000);
            v["retry"]["attempt_timeout_ms"] = json!(1_000);
        }
    });
    let ledger = dir.path().join("ledger.db");
    let toolgate = |args: &[&str]| {
        std::process::Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(&ledger)
            .arg("--catalog")
            .arg(&catalog)
            .args(args)
            .output()
            .unwrap()
    };
    assert_eq!(toolgate(&["init"]).status.code(), Some(0));
    let db = server.db.to_string_lossy().into_owned();
    let out = toolgate(&[
        "load",
        "--agents",
        "2",
        "--ops",
        "40",
        "--seed",
        "4",
        "--settle-ms",
        "5000",
        "--json",
        "--provider-db",
        &db,
    ]);
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!((report["duplicates"].as_i64(), report["silently_wrong"].as_i64()), (Some(0), Some(0)), "{report}");
    assert_eq!(report["effects"].as_i64().unwrap(), server.effects(), "{report}");
    let states = report["final_states"].as_object().unwrap();
    // The re-sent tool's unknown outcomes are all settled by the workers; a
    // notification the provider has no receipt of stays for a person (never
    // "no effect" by itself), asked, with what the provider said.
    for why in report["unknown_reasons"].as_object().unwrap().keys() {
        assert!(why.starts_with("notify_customer ") && !why.ends_with("never asked"), "{why}: {report}");
    }
    assert!(states.get("succeeded").and_then(Value::as_i64).unwrap_or(0) > 0, "{report}");
    // Parked ones carry the code that says why.
    let parked: i64 = report["review_reasons"].as_object().unwrap().values().filter_map(Value::as_i64).sum();
    assert_eq!(parked, states.get("needs_review").and_then(Value::as_i64).unwrap_or(0), "{report}");
    // The faults did lose replies, and the workers settled them.
    assert!(report["answers"]["OUTCOME_UNKNOWN"].as_u64().unwrap_or(0) > 0, "{report}");
}
