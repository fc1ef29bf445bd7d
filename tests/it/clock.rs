//! One clock for the ledger: a host whose wall clock is wrong (moved with
//! `faketime`, only the wall clock, as on a skewed host) must not purge live
//! keys, reap live calls or write instants from its own clock; a key stays
//! taken after its operation is purged; a lease written on a clock that ran
//! ahead does not hold its operation for days; the downstream key is the
//! scope's, so a ledger that forgot an operation reaches the downstream under
//! the same key.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use toolgate::engine::envelope::Code;
use toolgate::engine::Engine;

use crate::support::{dispatch_with, opts, refund, Backend, Fixture, GateClock};

const DAY_MS: i64 = 86_400_000;
const ARGS: &str = r#"{"order_ref":"ord_1001","amount_minor":1000,"currency":"EUR","reason":"damaged"}"#;

/// `faketime` moving only the wall clock, or `None` (with a message) where it
/// is not installed; `.ci/run` installs it, so CI never skips.
fn faketime(offset: &str) -> Option<Command> {
    let found = Command::new("faketime").arg("--version").output().is_ok_and(|o| o.status.success());
    if !found {
        assert!(std::env::var_os("CI").is_none(), "faketime is not installed: .ci/run installs it");
        eprintln!("*** clock tests SKIPPED: faketime is not installed (apt-get install faketime) ***");
        return None;
    }
    // The library itself when it is where Debian puts it: the `faketime`
    // program forks toolgate and waits, so killing it (a served replica's
    // Drop) would leave toolgate running, orphaned.
    let lib = ["x86_64-linux-gnu", "aarch64-linux-gnu", ""]
        .iter()
        .map(|arch| Path::new("/usr/lib").join(arch).join("faketime/libfaketime.so.1"))
        .find(|p| p.exists());
    let mut c = if let Some(lib) = lib {
        let mut c = Command::new(env!("CARGO_BIN_EXE_toolgate"));
        c.env("LD_PRELOAD", lib).env("FAKETIME", offset);
        c
    } else {
        let mut c = Command::new("faketime");
        c.args(["-f", offset, env!("CARGO_BIN_EXE_toolgate")]);
        c
    };
    c.env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    Some(c)
}

fn real() -> Command {
    Command::new(env!("CARGO_BIN_EXE_toolgate"))
}

/// Runs a command; (exit code, stdout as JSON).
fn json_of(c: &mut Command) -> (i32, Value) {
    let out = c.env_remove("RUST_BACKTRACE").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{e}: {text} / {}", String::from_utf8_lossy(&out.stderr)));
    (out.status.code().unwrap_or(-1), v)
}

fn dispatch_cmd(c: Command, db: &Path, key: &str) -> Command {
    dispatch_args(c, db, key, ARGS)
}

/// `dispatch --json` of a refund with these arguments.
fn dispatch_args(mut c: Command, db: &Path, key: &str, args: &str) -> Command {
    c.arg("--db").arg(db).args([
        "dispatch",
        "--tenant",
        "acme",
        "--subject",
        "agent_ana",
        "--tool",
        "create_refund",
        "--key",
        key,
        "--args",
        args,
        "--json",
    ]);
    c
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// `reap` on a host 31 days ahead (past the demo's 30-day retention), then the
/// agent retries the same key. Before: the operation that ended seconds ago was
/// purged and the retry ran a second refund. Now: on SQLite the reap sees the
/// jump against the ledger's anchor and pauses; on PostgreSQL its instants
/// are the database server's, so nothing is past retention. The retry replays.
fn a_reap_on_a_host_ahead_purges_nothing_and_the_retry_replays(backend: Backend) {
    let fx = Fixture::on(backend);
    let db = fx.path();
    let Some(mut ahead) = faketime("+31d") else { return };
    let (rc, first) = json_of(&mut dispatch_cmd(real(), db, "clock-refund-0001"));
    assert_eq!((rc, first["model_result"]["status"].as_str()), (0, Some("succeeded")), "{first}");
    let (rc, reaped) = json_of(ahead.arg("--db").arg(db).args(["reap", "--json"]));
    assert_eq!(reaped["purged"], 0, "{reaped}");
    match backend {
        Backend::Sqlite => {
            assert_eq!(rc, 1, "a paused pass is not a success: {reaped}");
            assert!(reaped["clock_paused"].as_str().unwrap().contains("31 d 0 h ahead of"), "{reaped}");
        }
        Backend::Postgres => assert_eq!((rc, &reaped["clock_paused"]), (0, &Value::Null), "{reaped}"),
    }
    let (rc, again) = json_of(&mut dispatch_cmd(real(), db, "clock-refund-0001"));
    assert_eq!(rc, 0, "{again}");
    assert_eq!(again["model_result"]["execution"]["delivery"], "local_replay", "{again}");
    let mut e = fx.engine();
    assert_eq!(e.counts().unwrap().downstream_effects, 1, "one refund");
    // What the skewed host reports about itself.
    let Some(mut ahead) = faketime("+31d") else { return };
    let (_, counts) = json_of(ahead.arg("--db").arg(db).args(["counts", "--json"]));
    let offset = counts["clock"]["offset_ms"].as_i64().unwrap();
    assert!((offset - 31 * DAY_MS).abs() < 60_000, "{counts}");
    let source = if backend == Backend::Sqlite { "anchor" } else { "database" };
    assert_eq!(counts["clock"]["source"], source);
}

/// A writer 2 days behind (and one 2 days ahead) writes ledger time: the
/// operation's instants are today's, so a correct reap later neither purges it
/// early nor keeps it for days; its deadline and lease are not off by days.
fn a_writer_with_a_wrong_clock_writes_ledger_time(backend: Backend) {
    let fx = Fixture::on(backend);
    let db = fx.path();
    // A process with a correct clock has written to the ledger (on SQLite it
    // made the anchor; the first writer of a boot does: `init` in real life).
    assert!(real().arg("--db").arg(db).args(["reap", "--json"]).output().unwrap().status.success());
    for (offset, key) in [("-2d", "clock-behind-0001"), ("+2d", "clock-ahead-0001")] {
        let Some(c) = faketime(offset) else { return };
        let before = now_ms();
        let (rc, env) = json_of(&mut dispatch_cmd(c, db, key));
        let after = now_ms();
        assert_eq!(rc, 0, "{env}");
        let op = env["protected_audit"]["operation_id"].as_str().unwrap().to_string();
        let (_, shown) = json_of(real().arg("--db").arg(db).args(["ops", "show", &op, "--json"]));
        let row = &shown["operation"];
        for field in ["created_at", "terminal_at"] {
            let at = row[field].as_i64().unwrap_or_else(|| panic!("{field}: {shown}"));
            assert!(at >= before - 5_000 && at <= after + 5_000, "{offset}: {field} {at} is not ledger time: {shown}");
        }
    }
}

/// An approver whose clock is 20 minutes ahead approves a request made a
/// moment ago (approvals expire after 15 minutes). Before: the expiry was
/// judged on the approver's clock (expired; and one behind approved an expired
/// request). Now on ledger time: approved, decided at ledger time.
fn an_approver_with_a_wrong_clock_judges_expiry_on_ledger_time(backend: Backend) {
    let fx = Fixture::on(backend);
    let db = fx.path();
    assert!(real().arg("--db").arg(db).args(["reap", "--json"]).output().unwrap().status.success());
    let big = r#"{"order_ref":"ord_1002","amount_minor":120000,"currency":"EUR","reason":"damaged"}"#;
    let mut ask = dispatch_args(real(), db, "clock-approval-0001", big);
    let (_, asked) = json_of(&mut ask);
    assert_eq!(asked["model_result"]["error"]["code"], "APPROVAL_REQUIRED", "{asked}");
    let id = asked["protected_audit"]["approval_id"].as_str().unwrap().to_string();
    let Some(mut ahead) = faketime("+20m") else { return };
    let before = now_ms();
    let (rc, approved) = json_of(ahead.arg("--db").arg(db).args(["approve", &id, "--approver", "alice", "--json"]));
    assert_eq!((rc, approved["model_result"]["status"].as_str()), (0, Some("succeeded")), "{approved}");
    let decided = fx.query_i64(&format!("SELECT decided_at FROM approvals WHERE id = '{id}'"));
    assert!((decided - before).abs() < 60_000, "decided at ledger time, not 20 minutes ahead: {decided} vs {before}");
    // An approver 5 minutes behind (checking before the request's creation on
    // its own clock): before, "expired"; now approved on ledger time, and the
    // audit finds no event dated before its operation.
    let second = r#"{"order_ref":"ord_1002","amount_minor":110000,"currency":"EUR","reason":"damaged"}"#;
    let mut ask = dispatch_args(real(), db, "clock-approval-0002", second);
    let (_, asked) = json_of(&mut ask);
    let id = asked["protected_audit"]["approval_id"].as_str().unwrap().to_string();
    let Some(mut behind) = faketime("-5m") else { return };
    let (rc, approved) = json_of(behind.arg("--db").arg(db).args(["approve", &id, "--approver", "alice", "--json"]));
    assert_eq!((rc, approved["model_result"]["status"].as_str()), (0, Some("succeeded")), "{approved}");
    let (_, audit) = json_of(real().arg("--db").arg(db).args(["audit", "--json"]));
    assert_eq!(audit["findings"], serde_json::json!([]), "{audit}");
    assert_eq!(audit["warnings"], serde_json::json!([]), "no event dated before its operation: {audit}");
}

/// A process crashed holding a lease written while its clock was 2 days ahead;
/// the clock is corrected. Before: the lease held the operation for 48 hours
/// and neither `reap` nor a status query settled it. Now a lease that ends
/// further ahead than any lease is long is treated as expired.
fn a_lease_further_ahead_than_its_length_is_treated_as_expired(backend: Backend) {
    let fx = Fixture::on(backend);
    let clock = GateClock::new(&fx.clock);
    let parked = crate::support::dispatch_parked(&fx, &clock, refund("clock-lease-0001", 1_000));
    let op = fx.query_text("SELECT operation_id FROM outbox WHERE state = 'leased'").unwrap();
    assert!(fx.try_exec(&format!(
        "UPDATE outbox SET lease_until = lease_until + {} WHERE operation_id = '{op}'",
        2 * DAY_MS
    )));
    let mut e = fx.engine();
    let r = e.reap().unwrap();
    assert_eq!(r.requeued_same_key + r.parked_unknown, 1, "{r:?}");
    clock.open();
    parked.join().unwrap();
    // The parked worker lost its lease; whatever settles the row, one refund.
    assert_eq!(crate::support::effects(&mut e), 1);
    assert_eq!(crate::support::duplicates(&mut e), 0);
}

/// The downstream key is derived from the scope under the ledger's salt: a
/// ledger restored from a copy taken before the call, retried with the same
/// key, reaches the downstream under the key the first call used; another
/// ledger's key for the same names differs.
#[test]
fn the_downstream_key_is_the_scopes_and_survives_a_restored_copy() {
    let fx = Fixture::new();
    let copy = fx.dir.path().join("copy.db");
    crate::support::raw(fx.path()).execute(&format!("VACUUM INTO '{}'", copy.display()), []).unwrap();
    let key_of = |path: &Path| -> String {
        crate::support::raw(path).query_row("SELECT downstream_key FROM operations", [], |r| r.get(0)).unwrap()
    };
    let mut e = fx.engine();
    assert_eq!(dispatch_with(&mut e, &refund("clock-dk-0001", 500), "ok").code(), None);
    let original = key_of(fx.path());
    assert!(original.starts_with("dk3_"), "{original}");
    let mut restored = Engine::open(&copy, opts(&fx.clock, "restored")).unwrap();
    dispatch_with(&mut restored, &refund("clock-dk-0001", 500), "ok");
    assert_eq!(key_of(&copy), original);
    let other = Fixture::new();
    let mut o = other.engine();
    dispatch_with(&mut o, &refund("clock-dk-0001", 500), "ok");
    assert_ne!(key_of(other.path()), original, "another ledger's salt");
    assert!(e.audit().unwrap().is_empty() && restored.audit().unwrap().is_empty());
}

/// A ledger written before scope-derived keys (the demo database as committed
/// at schema version 14: `dk2_` keys) migrates and audits clean; a new row's
/// key is `dk3_`, and a new row given a key of the old shape is a finding.
#[test]
fn a_version_14_ledger_migrates_and_keeps_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v14.db");
    std::fs::copy(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/ledger-v14.db"), &path).unwrap();
    let v: i64 = crate::support::raw(&path).query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
    assert_eq!(v, 14);
    let clock = toolgate::engine::clock::ManualClock::new(crate::support::T0 + 400 * DAY_MS);
    let mut e = Engine::open(&path, opts(&clock, "migrate")).unwrap();
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    let env = dispatch_with(&mut e, &refund("clock-v14-0001", 100), "ok");
    let op = env.protected_audit.operation_id.clone().unwrap();
    let c = crate::support::raw(&path);
    let old: i64 =
        c.query_row("SELECT count(*) FROM operations WHERE downstream_key LIKE 'dk2%'", [], |r| r.get(0)).unwrap();
    assert!(old >= 10, "the fixture's rows keep their keys");
    let key: String = c.query_row("SELECT downstream_key FROM operations WHERE id = ?1", [&op], |r| r.get(0)).unwrap();
    assert!(key.starts_with("dk3_"), "{key}");
    c.execute("UPDATE operations SET downstream_key = 'dk2_0000' WHERE id = ?1", [&op]).unwrap();
    let findings = e.audit().unwrap();
    assert!(findings.iter().any(|f| f.reference == op && f.detail.contains("downstream_key")), "{findings:?}");
    assert_eq!(env.code(), None::<Code>);
}

/// `toolgate serve` on `db`, run by `c` (under `faketime`).
fn serve_under(mut c: Command, db: &Path) -> crate::serve::Server {
    c.arg("--db").arg(db).args(["serve", "--listen", "127.0.0.1:0", "--threads", "2"]);
    crate::serve::Server::from_command(c)
}

/// Table row "a replica ahead reaps the others' live leases". Before: with one
/// `serve` replica 10 s to 5 min ahead, 20 of 20 in-flight calls of another
/// replica were answered OUTCOME_UNKNOWN (its reaper judged their 6 s leases
/// on its own clock). Now five calls of 3 s each, made while a replica 5
/// minutes ahead runs its reaper every 250 ms, all succeed, once each.
fn a_replica_ahead_does_not_reap_live_calls(backend: Backend) {
    let fx = Fixture::on(backend);
    // Faults come in a request header only on a database marked as a demo.
    fx.engine().mark_demo(crate::support::T0).unwrap();
    let db = fx.path();
    let ana = crate::serve::agent_token(db, "acme", "agent_ana");
    let server = crate::serve::Server::start(db, &[]);
    let Some(ahead) = faketime("+5m") else { return };
    let replica = serve_under(ahead, db);
    let c = std::sync::Arc::new(crate::serve::Client::new(&server));
    let calls: Vec<_> = (0..5)
        .map(|i| {
            let (c, ana) = (c.clone(), ana.clone());
            std::thread::spawn(move || {
                c.try_call(
                    &ana,
                    "create_refund",
                    Some(&format!("clock-replica-{i:04}")),
                    &crate::support::refund_args("ord_1001", 100),
                    &[("toolgate-fault", "latency(3000)")],
                )
                .unwrap()
            })
        })
        .collect();
    let answers: Vec<_> = calls.into_iter().map(|h| h.join().unwrap()).collect();
    drop(replica);
    for a in &answers {
        assert_eq!((a.status, a.body["model_result"]["status"].as_str()), (200, Some("succeeded")), "{:#}", a.body);
    }
    let mut e = fx.engine();
    assert_eq!(crate::support::effects(&mut e), 5);
    assert_eq!(crate::support::duplicates(&mut e), 0);
}

/// Table row "a worker host behind runs a queued retry". Before: a worker
/// 60 s behind sent a refund with a 5 s deadline 59 s late (the ledger said
/// "953 ms left"). Now: a call rate-limited on each of its attempts leaves
/// its retry queued; once its 4 s deadline has passed, a worker 60 s behind
/// judges the deadline on ledger time and sends nothing.
fn a_worker_behind_never_sends_a_queued_retry_past_its_deadline(backend: Backend) {
    let fx = Fixture::on(backend);
    let db = fx.path();
    let mut first = dispatch_cmd(real(), db, "clock-late-0001");
    // Five attempts a call (the demo's max_attempts), each rate-limited.
    first.args([
        "--deadline-ms",
        "4000",
        "--fault",
        "rate_limit(300),rate_limit(300),rate_limit(300),rate_limit(300),rate_limit(300),ok",
    ]);
    let started = std::time::Instant::now();
    let (_, answered) = json_of(&mut first);
    assert_eq!(answered["model_result"]["execution"]["outcome"], "not_started", "{answered}");
    let queued = fx.query_i64("SELECT count(*) FROM outbox WHERE state = 'pending'");
    assert_eq!(queued, 1, "the retry is queued for a worker: {answered}");
    std::thread::sleep(Duration::from_secs(5).saturating_sub(started.elapsed()));
    let Some(mut behind) = faketime("-60s") else { return };
    let (_, worked) = json_of(behind.arg("--db").arg(db).args(["work", "--json"]));
    let mut e = fx.engine();
    assert_eq!(crate::support::effects(&mut e), 0, "sent past its deadline by a worker behind: {worked}");
    let state = fx.query_text("SELECT state FROM operations").unwrap();
    assert_ne!(state, "succeeded", "{worked}");
}

/// Where libfaketime's library is (the `faketime` package), if installed.
fn libfaketime() -> Option<&'static str> {
    ["/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

/// Table row "a step back during a Retry-After wait". Before: the wall clock
/// stepped back 90 s while a call waited out a Retry-After; the caller was
/// told TOOL_UNAVAILABLE ("nothing was done") and `serve` sent the call 64 s
/// past its 30 s deadline. Now a `serve` whose wall clock steps back 90 s one
/// second into a 3 s Retry-After wait sends once, within the 6 s deadline,
/// and answers succeeded.
fn a_step_back_during_a_retry_after_wait_moves_no_deadline(backend: Backend) {
    let fx = Fixture::on(backend);
    fx.engine().mark_demo(crate::support::T0).unwrap();
    let db = fx.path();
    let ana = crate::serve::agent_token(db, "acme", "agent_ana");
    if faketime("+0").is_none() {
        return;
    }
    let lib = libfaketime().expect("the faketime package installs libfaketime");
    let spec = fx.dir.path().join("faketime.spec");
    std::fs::write(&spec, "+0\n").unwrap();
    let mut c = real();
    c.env("LD_PRELOAD", lib)
        .env("FAKETIME_TIMESTAMP_FILE", &spec)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    let server = serve_under(c, db);
    let url = server.url.clone();
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let call = {
        let url = url.clone();
        std::thread::spawn(move || {
            let mut r = agent
                .post(&format!("{url}/v1/tools/create_refund/calls"))
                .header("authorization", &format!("Bearer {ana}"))
                .header("content-type", "application/json")
                .header("idempotency-key", "clock-step-0001")
                .header("toolgate-deadline-ms", "6000")
                .header("toolgate-fault", "rate_limit(3000),ok")
                .send(crate::support::refund_args("ord_1001", 700).as_bytes())
                .unwrap();
            (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    std::fs::write(&spec, "-90s\n").unwrap();
    let (status, body) = call.join().unwrap();
    drop(server);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["model_result"]["status"].as_str()), (200, Some("succeeded")), "{v:#}");
    let mut e = fx.engine();
    assert_eq!(crate::support::effects(&mut e), 1);
    let recorded = fx.query_i64("SELECT recorded_at FROM receipts");
    let deadline = fx.query_i64("SELECT deadline_at FROM operations");
    assert!(recorded <= deadline, "sent {} ms past its deadline", recorded - deadline);
}

crate::on_both_backends!(
    a_replica_ahead_does_not_reap_live_calls,
    a_worker_behind_never_sends_a_queued_retry_past_its_deadline,
    a_step_back_during_a_retry_after_wait_moves_no_deadline,
);

crate::on_both_backends!(
    a_reap_on_a_host_ahead_purges_nothing_and_the_retry_replays,
    a_writer_with_a_wrong_clock_writes_ledger_time,
    an_approver_with_a_wrong_clock_judges_expiry_on_ledger_time,
    a_lease_further_ahead_than_its_length_is_treated_as_expired,
);
