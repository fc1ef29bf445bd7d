//! PostgreSQL only: the server itself dies mid-run (`pg_ctl stop -m
//! immediate`, the equivalent of a crash: no checkpoint, no goodbye to the
//! clients) while dispatchers are busy, and comes back. Callers get a clear
//! environment error (`DB_UNAVAILABLE`, `DB_OPEN_FAILED`) or an answer, never
//! a wrong one; a caller that retries with the same key gets the truth; and
//! recovery afterwards leaves every invariant intact with 0 duplicates.
//!
//! The test starts a cluster of its own (`.ci/pg-start`), since stopping the
//! shared test server would break the tests running beside it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use toolgate::Coded;

use toolgate::engine::clock::ManualClock;
use toolgate::engine::envelope::{Code, Status};
use toolgate::engine::{DispatchRequest, Engine, QueryRequest};

use crate::invariants::{check, Expect};
use crate::support::{opts, refund_args, T0};

const THREADS: usize = 3;
const INTENTS: usize = 24;

/// A cluster of this test's own, stopped and removed on drop.
struct OwnCluster {
    dir: tempfile::TempDir,
    url: String,
}

impl OwnCluster {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// With these environment variables for `.ci/pg-start` (`PG_SSL_CERT`, ...).
    fn start_with(env: &[(&str, &Path)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/pg-start"))
            .arg(dir.path().join("pg"))
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .output()
            .unwrap();
        assert!(out.status.success(), "pg-start: {}", String::from_utf8_lossy(&out.stderr));
        let url = String::from_utf8(out.stdout).unwrap().trim().to_string();
        Self { dir, url }
    }

    fn ctl(&self, args: &[&str]) {
        let data = self.dir.path().join("pg/data");
        let owner = std::fs::metadata(&data).map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap();
        let bin = pg_bin();
        let mut cmd = if owner == current_uid() {
            Command::new(bin.join("pg_ctl"))
        } else {
            let mut c = Command::new("runuser");
            c.args(["-u", &user_name(owner), "--"]).arg(bin.join("pg_ctl"));
            c
        };
        let out = cmd.arg("-D").arg(&data).args(args).output().unwrap();
        assert!(out.status.success(), "pg_ctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl OwnCluster {
    /// A database `ledger` on this cluster holding the demo world: its URL,
    /// and the same as a `--db` path.
    fn demo_ledger(&self) -> (String, PathBuf) {
        let db = self.url.replace("/postgres", "/ledger");
        postgres::Client::connect(&self.url, postgres::NoTls).unwrap().batch_execute("CREATE DATABASE ledger").unwrap();
        let path = PathBuf::from(&db);
        let mut e = Engine::create(&path, opts(&ManualClock::new(T0), "init")).unwrap();
        e.load_world(&toolgate::engine::world::World::parse(toolgate::engine::world::DEMO_WORLD.as_bytes()).unwrap())
            .unwrap();
        (db, path)
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ =
            Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/pg-stop")).arg(self.dir.path().join("pg")).status();
    }
}

fn pg_bin() -> PathBuf {
    ["15", "16", "17"]
        .iter()
        .map(|v| PathBuf::from(format!("/usr/lib/postgresql/{v}/bin")))
        .find(|p| p.join("pg_ctl").exists())
        .expect("PostgreSQL server binaries")
}

fn current_uid() -> u32 {
    std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m)).unwrap()
}

fn user_name(uid: u32) -> String {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    passwd
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 2 && f[2] == uid.to_string()).then(|| f[0].to_string())
        })
        .unwrap()
}

fn request(thread: usize, i: usize) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        arguments: refund_args("ord_1002", (100 + thread * 100 + i) as i64).into_bytes(),
        idempotency_key: Some(format!("pg-kill-{thread}-{i:03}")),
        ..DispatchRequest::default()
    }
}

/// What one caller saw for one intent, in order.
#[derive(Debug, Default, Clone)]
struct Seen {
    errors: Vec<String>,
    answers: Vec<(Status, Option<Code>, Option<serde_json::Value>)>,
}

#[test]
fn the_server_dies_mid_run_and_callers_never_get_a_wrong_answer() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let cluster = OwnCluster::start();
    let (db, path) = cluster.demo_ledger();
    let clock = ManualClock::new(T0);
    let seen: Arc<Mutex<BTreeMap<(usize, usize), Seen>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (path, clock, seen, done, stop) =
                (path.clone(), clock.clone(), seen.clone(), done.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut engine: Option<Engine> = None;
                for i in 0..INTENTS {
                    // A caller retries its intent with the same key until it gets an answer.
                    let started = Instant::now();
                    loop {
                        assert!(!stop.load(Ordering::Relaxed), "stopped");
                        assert!(started.elapsed() < Duration::from_secs(60), "no answer in 60 s");
                        let e = match engine.as_mut() {
                            Some(e) => e,
                            None => match Engine::open(&path, opts(&clock, &format!("pg-kill-{t}"))) {
                                Ok(e) => engine.insert(e),
                                Err(err) => {
                                    seen.lock().unwrap().entry((t, i)).or_default().errors.push(err.code().into());
                                    std::thread::sleep(Duration::from_millis(50));
                                    continue;
                                }
                            },
                        };
                        match e.dispatch(&request(t, i)) {
                            Ok(env) => {
                                seen.lock().unwrap().entry((t, i)).or_default().answers.push((
                                    env.model_result.status,
                                    env.code(),
                                    env.model_result.data.clone(),
                                ));
                                break;
                            }
                            Err(err) => {
                                seen.lock().unwrap().entry((t, i)).or_default().errors.push(err.code().into());
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Kill the server once the callers are well under way, then bring it back.
    while done.load(Ordering::Relaxed) < THREADS * INTENTS / 3 {
        std::thread::sleep(Duration::from_millis(5));
    }
    cluster.ctl(&["stop", "-m", "immediate", "-w"]);
    std::thread::sleep(Duration::from_millis(700));
    cluster.ctl(&["start", "-w", "-t", "60", "-l", &cluster.dir.path().join("pg/server2.log").to_string_lossy()]);
    let mut panicked = false;
    for c in callers {
        panicked |= c.join().is_err();
    }
    stop.store(true, Ordering::Relaxed);
    assert!(!panicked, "a caller failed: {:#?}", seen.lock().unwrap());
    let seen = seen.lock().unwrap().clone();

    // The kill was felt, and only as an environment error.
    let errors: Vec<&String> = seen.values().flat_map(|s| s.errors.iter()).collect();
    assert!(!errors.is_empty(), "the server's death went unnoticed");
    for code in &errors {
        assert!(matches!(code.as_str(), "DB_UNAVAILABLE" | "DB_OPEN_FAILED"), "not an environment error: {code}");
    }

    // Recovery as operators and callers do it: leases expire and are reaped,
    // workers run, every caller retries its intent once (same key: a provably
    // unsent one runs now), and every operation still unknown is asked about.
    clock.advance(3_600_000);
    let mut e = Engine::open(&path, opts(&clock, "recovery")).unwrap();
    e.reap().unwrap();
    e.work(usize::MAX).unwrap();
    for (t, i) in seen.keys() {
        let env = e.dispatch(&request(*t, *i)).unwrap();
        assert_ne!(env.code(), Some(Code::IdempotencyConflict), "{t}/{i}");
    }
    e.work(usize::MAX).unwrap();
    clock.advance(3_600_000);
    e.reap().unwrap();
    for op in e.list_operations(Some(toolgate::store::OpState::Unknown), i64::MAX).unwrap() {
        e.query_operation_status(&QueryRequest {
            tenant: op.tenant.clone(),
            subject: op.subject.clone(),
            status_ref: op.status_ref.clone(),
            expected_request_sha256: op.request_sha256.clone(),
            idempotency_key: Some(op.idem_key.clone()),
            ..QueryRequest::default()
        })
        .unwrap();
    }
    drop(e);
    let (v, tally) = check(Path::new(&db), Expect { settled: true, queried: true });
    assert!(v.is_empty(), "{v:#?}");
    assert_eq!(tally.duplicates, 0);

    // No wrong answer: what a caller was told agrees with where the intent ended.
    let mut e = Engine::open(&path, opts(&clock, "checker")).unwrap();
    for ((t, i), s) in &seen {
        let (status, code, data) = s.answers.last().unwrap();
        let now = e.dispatch(&request(*t, *i)).unwrap();
        match status {
            Status::Succeeded => {
                assert_eq!(
                    now.model_result.status,
                    Status::Succeeded,
                    "{t}/{i}: told succeeded, ledger says otherwise"
                );
                assert_eq!(&now.model_result.data, data, "{t}/{i}: another result than the caller got");
            }
            Status::Failed => assert_eq!(now.model_result.status, Status::Failed, "{t}/{i}: told failed: {code:?}"),
            Status::Unknown => {} // told to ask: any settled end is consistent with it
        }
    }
    eprintln!(
        "server kill: {} intents, {} environment errors seen by callers, {} effects, 0 duplicates",
        seen.len(),
        errors.len(),
        tally.effects
    );
}

fn tg(db: &str, args: &[&str]) -> (i32, serde_json::Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_toolgate"))
        .args(args)
        .args(["--db", db])
        .env_remove("TOOLGATE_DB")
        .env("TOOLGATE_LOG", "off")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(&stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), v, format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
}

/// Every command a person or a script uses, with `--db postgres://...`:
/// init, dispatch (fresh, replay, lost reply), query, approvals, approve,
/// resolve, ops list/show, counts, orders, metrics, trace, audit, reap,
/// grant/revoke, read-only refusals; and a password in the URL is never echoed.
#[test]
fn every_cli_command_works_on_a_postgres_url() {
    let Some(db) = crate::support::PgDb::new() else { return };
    let url = db.url.as_str();
    let refund = r#"{"order_ref":"ord_1001","amount_minor":1500,"currency":"EUR","reason":"damaged"}"#;
    let who = ["--tenant", "acme", "--subject", "agent_ana"];
    let (rc, v, all) = tg(url, &["init", "--json"]);
    assert_eq!((rc, v["initialized"].as_bool()), (0, Some(true)), "{all}");
    let dispatch = |key: &str, call: &str, extra: &[&str]| {
        let mut a =
            vec!["dispatch", "--json", "--tool", "create_refund", "--key", key, "--call-id", call, "--args", refund];
        a.extend(who);
        a.extend(extra);
        tg(url, &a)
    };
    let (rc, v, all) = dispatch("pg-cli-0001", "c1", &[]);
    assert_eq!((rc, v["model_result"]["execution"]["delivery"].as_str()), (0, Some("fresh")), "{all}");
    let (rc, v, all) = dispatch("pg-cli-0001", "c2", &[]);
    assert_eq!((rc, v["model_result"]["execution"]["delivery"].as_str()), (0, Some("local_replay")), "{all}");
    // A lost reply: unknown, then the explicit query reconciles it.
    let (rc, lost, all) = dispatch("pg-cli-0002", "c3", &["--fault", "timeout_after_commit"]);
    assert_eq!((rc, lost["model_result"]["error"]["code"].as_str()), (1, Some("OUTCOME_UNKNOWN")), "{all}");
    let sr = lost["protected_audit"]["downstream"]["status_ref"].as_str().unwrap();
    let sha = lost["protected_audit"]["binding"]["request_sha256"].as_str().unwrap();
    let mut q = vec!["query", "--json", "--status-ref", sr, "--expect-sha256", sha, "--call-id", "q1"];
    q.extend(who);
    let (rc, v, all) = tg(url, &q);
    assert_eq!((rc, v["model_result"]["execution"]["delivery"].as_str()), (0, Some("receipt_reconciled")), "{all}");
    // Approvals: a big refund waits; an allowed approver runs it.
    let big = r#"{"order_ref":"ord_1002","amount_minor":120000,"currency":"EUR","reason":"damaged"}"#;
    let mut a =
        vec!["dispatch", "--json", "--tool", "create_refund", "--key", "pg-cli-big1", "--call-id", "c4", "--args", big];
    a.extend(who);
    let (rc, v, all) = tg(url, &a);
    assert_eq!((rc, v["model_result"]["error"]["code"].as_str()), (1, Some("APPROVAL_REQUIRED")), "{all}");
    let apr = v["protected_audit"]["approval_id"].as_str().unwrap().to_string();
    let (rc, v, all) = tg(url, &["approvals", "--json"]);
    assert_eq!(rc, 0, "{all}");
    assert!(v.to_string().contains(&apr), "{all}");
    let (rc, v, all) = tg(url, &["approve", &apr, "--approver", "alice", "--json"]);
    assert_eq!((rc, v["model_result"]["status"].as_str()), (0, Some("succeeded")), "{all}");
    // A human decision on an unknown one.
    let (_, lost2, _) = dispatch("pg-cli-0003", "c5", &["--fault", "timeout_before_commit"]);
    let op = lost2["protected_audit"]["operation_id"].as_str().unwrap().to_string();
    let failed = ["resolve", &op, "--as", "failed", "--note", "provider confirms nothing", "--operator", "kim"];
    let (rc, _, all) = tg(url, &failed);
    assert_eq!(rc, 1, "a receipt may still appear: {all}");
    assert!(all.contains("RECEIPT_MAY_STILL_APPEAR"), "{all}");
    let (rc, _, all) = tg(url, &[&failed[..], &["--against-evidence"]].concat());
    assert_eq!(rc, 0, "{all}");
    let (rc, v, all) = tg(url, &["ops", "show", &op, "--json"]);
    assert_eq!(rc, 0, "{all}");
    assert!(v.to_string().contains("resolved"), "{all}");
    for cmd in [&["ops", "list", "--json"][..], &["counts", "--json"], &["orders", "--json"], &["reap", "--json"]] {
        let (rc, _, all) = tg(url, cmd);
        assert_eq!(rc, 0, "{cmd:?}: {all}");
    }
    let (rc, _, all) = tg(url, &["metrics"]);
    assert!(rc == 0 && all.contains("toolgate_dispatches_total"), "{all}");
    let (rc, _, all) = tg(url, &["trace"]);
    assert!(rc == 0 && all.contains("persisted"), "{all}");
    let (rc, _, all) = tg(url, &["revoke", "--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund"]);
    assert_eq!(rc, 0, "{all}");
    let (rc, v, all) = dispatch("pg-cli-0001", "c6", &[]);
    assert_eq!((rc, v["model_result"]["error"]["code"].as_str()), (1, Some("POLICY_DENIED")), "{all}");
    let (rc, _, all) = tg(url, &["audit"]);
    assert_eq!(rc, 0, "a clean ledger audits clean: {all}");
    // Read-only refuses writes with a stable code.
    let (rc, _, all) = tg(url, &["--read-only", "reap"]);
    assert_eq!(rc, 2, "{all}");
    // A password in the URL is never printed back, whatever fails.
    let secret = url.replacen("toolgate@", "toolgate:hunter2-canary@", 1).replace("/tg_", "/no_such_db_");
    let (rc, _, all) = tg(&secret, &["counts"]);
    assert_eq!(rc, 2, "{all}");
    assert!(all.contains("error[DB_OPEN_FAILED]") && !all.contains("hunter2-canary"), "{all}");
}

/// Several engines (connections) dispatching distinct intents at once: each
/// writing connection holds a slot of its own (migration pg/0004), so they
/// split the counters and rollups between them, and every reader still adds up
/// to the rows themselves: operations per state, trace events per series,
/// answered calls per latency bucket, provider effects; the audit finds no
/// gap in the trace although rolled-back inserts leave gaps in `seq`.
#[test]
fn concurrent_writers_on_their_own_slots_leave_exact_totals() {
    if crate::support::pg_base().is_none() {
        return;
    }
    const WRITERS: usize = 4;
    const CALLS: usize = 10;
    let fx = crate::support::Fixture::on(crate::support::Backend::Postgres);
    let barrier = std::sync::Barrier::new(WRITERS);
    std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (fx, barrier) = (&fx, &barrier);
            s.spawn(move || {
                let mut e = fx.engine_named(&format!("w-slot-{t}"));
                barrier.wait();
                for i in 0..CALLS {
                    let req = crate::support::refund(&format!("pg-slots-{t}-{i:02}"), 10);
                    // Every fourth reply is lost: some operations stay unknown.
                    let fault = if i % 4 == 3 { "timeout_after_commit" } else { "ok" };
                    crate::support::dispatch_with(&mut e, &req, fault);
                }
            });
        }
    });
    let slots = fx.query_i64("SELECT count(DISTINCT slot) FROM trace_events WHERE slot IS NOT NULL");
    assert!(slots >= WRITERS as i64, "each writer wrote to its own slot: {slots} slots");

    let mut e = fx.engine();
    let counts = e.counts().unwrap();
    let mut real = BTreeMap::new();
    let rows =
        fx.pg.as_ref().unwrap().client().query("SELECT state, count(*) FROM operations GROUP BY state", &[]).unwrap();
    for r in rows {
        real.insert(r.get::<_, String>(0), r.get::<_, i64>(1));
    }
    assert_eq!(counts.operations, real, "state counts");
    assert!(real.get("unknown").copied().unwrap_or(0) > 0 && real.get("succeeded").copied().unwrap_or(0) > 0);
    let effects = fx.query_i64("SELECT count(*) FROM provider_effects");
    assert_eq!((counts.downstream_effects, counts.side_effect_duplicates), (effects, 0), "effect counts");

    let (totals, minutes, latency) = e
        .read(|tx| -> Result<_, toolgate::store::StoreError> {
            Ok((tx.metric_totals()?, tx.metric_minutes(i64::MIN, i64::MAX)?, tx.latency_totals()?))
        })
        .unwrap();
    let events = fx.query_i64("SELECT count(*) FROM trace_events");
    assert_eq!(totals.iter().map(|m| m.events).sum::<i64>(), events, "metric totals");
    assert_eq!(minutes.iter().map(|m| m.events).sum::<i64>(), events, "metric minutes");
    // One row per series, whatever the slots.
    let series = fx.query_i64(
        "SELECT count(*) FROM (SELECT DISTINCT coalesce(answer, ''), step, coalesce(tool, ''), coalesce(tenant_ref, ''),
           coalesce(tool_version, ''), coalesce(code, ''), coalesce(outcome, ''), coalesce(delivery, ''),
           coalesce(timeout_stage, ''), coalesce(reason, '') FROM trace_events) AS s",
    );
    assert_eq!(totals.len() as i64, series, "series");
    let dispatches = fx.query_i64("SELECT count(*) FROM trace_events WHERE answer = 'dispatch'");
    let answered: i64 = latency.iter().filter(|l| l.answer == "dispatch").map(|l| l.count).sum();
    assert_eq!(answered, dispatches, "latency buckets");
    assert_eq!(dispatches, (WRITERS * CALLS) as i64);

    let findings: Vec<String> = e.audit().unwrap().into_iter().map(|f| format!("{} {}", f.check, f.detail)).collect();
    assert!(!findings.iter().any(|f| f.starts_with("trace")), "{findings:?}");
    // A deleted event is still found, in whichever slot it was.
    fx.exec_batch(
        "DELETE FROM trace_events WHERE seq = (SELECT min(seq) + 5 FROM trace_events WHERE slot IS NOT NULL)",
    )
    .unwrap();
    let findings: Vec<String> = e.audit().unwrap().into_iter().map(|f| format!("{} {}", f.check, f.detail)).collect();
    assert!(findings.iter().any(|f| f.contains("events missing")), "{findings:?}");
}

/// A ledger at PostgreSQL schema 3 (counters and rollups one row per series,
/// the trace numbered max + 1) migrates: what was counted moves to slot 0,
/// reads the same, and counting goes on from there.
#[test]
fn a_schema_3_ledger_keeps_its_counts_through_the_slot_migration() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let db = crate::support::PgDb::new().unwrap();
    let mut c = db.client();
    for sql in [
        include_str!("../../crates/toolgate-core/src/store/pg/0001_ledger.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0002_api_tokens.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0003_sort_indexes.sql"),
    ] {
        c.batch_execute(sql).unwrap();
    }
    c.batch_execute("INSERT INTO meta (key, value) VALUES ('schema_version', '3')").unwrap();
    // What schema 3's writers left: gapless seq, rollups by its triggers.
    for seq in 1..=5 {
        c.execute(
            "INSERT INTO trace_events (seq, at, step, tool, answer, latency_us, latency_bucket_us, fields)
             VALUES ($1, $2, 'answered', 'create_refund', 'dispatch', 1000, 1000, '{}')",
            &[&i64::from(seq), &crate::support::T0],
        )
        .unwrap();
    }
    drop(c);
    let path = PathBuf::from(&db.url);
    let clock = ManualClock::new(crate::support::T0);
    let mut e = Engine::open(&path, opts(&clock, "migrated")).unwrap();
    e.load_world(&toolgate::engine::world::World::parse(toolgate::engine::world::DEMO_WORLD.as_bytes()).unwrap())
        .unwrap();
    let mut c = db.client();
    let slot0: i64 =
        c.query_one("SELECT CAST(sum(events) AS BIGINT) FROM metric_totals WHERE slot = 0", &[]).unwrap().get(0);
    assert_eq!(slot0, 5, "the old totals are slot 0's");
    let events_read = |e: &mut Engine| {
        e.read(|tx| tx.metric_totals().map(|rows| rows.iter().map(|m| m.events).sum::<i64>())).unwrap()
    };
    assert_eq!(events_read(&mut e), 5);
    let env = crate::support::dispatch_with(&mut e, &crate::support::refund("pg-migrated-0001", 10), "ok");
    assert_eq!(env.model_result.status, Status::Succeeded);
    let events: i64 = c.query_one("SELECT count(*) FROM trace_events", &[]).unwrap().get(0);
    assert_eq!(events_read(&mut e), events);
    let first_new: i64 = c.query_one("SELECT min(seq) FROM trace_events WHERE slot IS NOT NULL", &[]).unwrap().get(0);
    assert_eq!(first_new, 6, "the trace goes on after the last old event");
    assert_eq!(e.counts().unwrap().operations.get("succeeded"), Some(&1));
    let findings: Vec<String> = e.audit().unwrap().into_iter().map(|f| format!("{} {}", f.check, f.detail)).collect();
    assert!(!findings.iter().any(|f| f.starts_with("trace")), "{findings:?}");
}

/// Issue 32 §1.4: after a server restart the connections of a running
/// process are stale, and their first statement fails. Before: the simulated
/// provider's next commit failed at its BEGIN (nothing ran) and the call was
/// parked OUTCOME_UNKNOWN, "may have committed", blamed on a lost reply (or
/// the ledger's own write answered DB_UNAVAILABLE). A connection that can be
/// replaced before its transaction begins is replaced.
#[test]
fn connections_a_restart_dropped_are_replaced_before_a_transaction_begins() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let cluster = OwnCluster::start();
    let (_, path) = cluster.demo_ledger();
    let clock = ManualClock::new(T0);
    let mut e = Engine::open(&path, opts(&clock, "w-restart")).unwrap();
    let first = e.dispatch(&crate::support::refund("pg-stale-conn-01", 100)).unwrap();
    assert_eq!(first.model_result.status, Status::Succeeded, "{first:?}");
    cluster.ctl(&[
        "restart",
        "-m",
        "immediate",
        "-w",
        "-t",
        "60",
        "-l",
        &cluster.dir.path().join("pg/server2.log").to_string_lossy(),
    ]);
    let next = e.dispatch(&crate::support::refund("pg-stale-conn-02", 100)).unwrap();
    assert_eq!(next.model_result.status, Status::Succeeded, "{next:?}");
    assert_eq!(e.counts().unwrap().downstream_effects, 2);
    assert!(e.list_operations(Some(toolgate::store::OpState::Unknown), 10).unwrap().is_empty());
}

/// Issue 36 §3: TLS to PostgreSQL with libpq's words in the URL, against a
/// cluster of this test's own with `ssl = on` and a certificate from a
/// throwaway CA, for `localhost` only.
#[test]
fn tls_verify_full_accepts_the_right_server_and_refuses_a_wrong_name_or_ca() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (ca, _ca_key, leaf_pem, leaf_key_pem) = crate::http::ca_and_leaf(&["localhost"]);
    let (other_ca, _, _, _) = crate::http::ca_and_leaf(&["localhost"]);
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (cert, key) = (write("server.crt", &leaf_pem), write("server.key", &leaf_key_pem));
    let (ca_file, other_file) = (write("ca.pem", &ca.pem()), write("other.pem", &other_ca.pem()));
    let cluster = OwnCluster::start_with(&[("PG_SSL_CERT", &cert), ("PG_SSL_KEY", &key)]);
    postgres::Client::connect(&cluster.url, postgres::NoTls).unwrap().batch_execute("CREATE DATABASE ledger").unwrap();
    let port = cluster.url.rsplit_once(':').unwrap().1.split('/').next().unwrap().to_string();
    let url = |host: &str, query: &str| format!("postgres://toolgate@{host}:{port}/ledger?{query}");
    let root = |p: &Path| format!("sslrootcert={}", p.display());
    // How the server sees toolgate's connections (application_name toolgate).
    let encrypted = || -> Vec<bool> {
        let mut admin = postgres::Client::connect(&cluster.url, postgres::NoTls).unwrap();
        admin
            .query(
                "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = 'toolgate'",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let open = |u: &str| Engine::create(Path::new(u), opts(&ManualClock::new(T0), "tls"));

    // verify-full with the right CA and name: the ledger works, encrypted.
    let good = url("localhost", &format!("sslmode=verify-full&{}", root(&ca_file)));
    let mut e = open(&good).unwrap_or_else(|e| panic!("{e}"));
    e.load_world(&toolgate::engine::world::World::parse(toolgate::engine::world::DEMO_WORLD.as_bytes()).unwrap())
        .unwrap();
    let env = e.dispatch(&crate::support::refund("tls-refund-0001", 300)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    let seen = encrypted();
    assert!(!seen.is_empty() && seen.iter().all(|s| *s), "{seen:?}");
    assert!(toolgate::store::Location::of(Path::new(&good)).label().ends_with("(TLS verify-full)"));
    drop(e);

    // The same CA, another name than the certificate's: refused by verify-full, taken by verify-ca.
    let wrong_name = url("127.0.0.1", &format!("sslmode=verify-full&{}", root(&ca_file)));
    let Err(err) = open(&wrong_name) else { panic!("a name the certificate does not carry was taken") };
    let err = err.to_string();
    assert!(!err.contains(&ca_file.display().to_string()), "no path in {err}");
    assert!(open(&url("127.0.0.1", &format!("sslmode=verify-ca&{}", root(&ca_file)))).is_ok());
    // Another CA: refused by verify-full and verify-ca (and by require with a root, as libpq).
    for mode in ["verify-full", "verify-ca", "require"] {
        let u = url("localhost", &format!("sslmode={mode}&{}", root(&other_file)));
        assert!(open(&u).is_err(), "{mode} with another CA must be refused");
    }
    // A bare require encrypts without checking; no sslmode is a plain connection.
    let e = open(&url("127.0.0.1", "sslmode=require")).unwrap();
    assert!(encrypted().iter().all(|s| *s));
    drop(e);
    let e = open(&url("127.0.0.1", "application_name=x")).unwrap();
    assert!(encrypted().iter().any(|s| !*s), "a URL without sslmode stays plain");
    drop(e);
    // A root file that is missing or not PEM is a clear error naming the field.
    let missing =
        open(&url("localhost", "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")).err().unwrap().to_string();
    assert!(missing.contains("sslrootcert") && !missing.contains("/nonexistent"), "{missing}");
}

/// Issue 36 §2: a host that hangs inside the accept transaction (stopped:
/// its socket open, the scope's row locks held) loses its locks when the
/// server ends its session (`idle_in_transaction_session_timeout`, here 2 s
/// through the URL's options, 60 s by default); another host with the same
/// key proceeds, and when the hung host wakes its commit fails: one effect.
#[test]
fn a_host_that_hangs_holding_row_locks_loses_them_and_the_others_proceed() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let fx = crate::support::Fixture::on(crate::support::Backend::Postgres);
    let url = fx.path().to_str().unwrap().to_string();
    let short = format!("{url}?options=-c%20idle_in_transaction_session_timeout%3D2s");
    let key = "hang-refund-0001";
    let hung = Command::new(env!("CARGO_BIN_EXE_toolgate"))
        .args(["--db", &short, "dispatch", "--json", "--tenant", "acme", "--subject", "agent_ana"])
        .args(["--tool", "create_refund", "--key", key, "--args", &refund_args("ord_1001", 400)])
        .env("TOOLGATE_FAILPOINT", "inside_accept:stop")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until it is stopped inside the transaction.
    let stat = format!("/proc/{}/stat", hung.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&stat).is_ok_and(|s| s.split_whitespace().nth(2) == Some("T")) {
        assert!(Instant::now() < deadline, "the dispatcher never reached inside_accept");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Another host, the same intent: it waits on the hung host's uncommitted
    // row only until the server ends that session, then accepts it itself.
    let mut e = fx.engine();
    let started = Instant::now();
    let env = e.dispatch(&crate::support::refund(key, 400)).unwrap();
    let waited = started.elapsed();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert!(waited < Duration::from_secs(60), "blocked {waited:?} behind a hung host");
    // The hung host wakes: its transaction is gone, nothing of it commits.
    let _ = Command::new("kill").args(["-CONT", &hung.id().to_string()]).status();
    let out = hung.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_ne!(out.status.code(), Some(0), "the hung host's accept must not succeed: {text}");
    assert!(text.contains("DB_UNAVAILABLE") || text.contains("DB_BUSY"), "{text}");
    assert_eq!(crate::support::effects(&mut e), 1);
    assert_eq!(crate::support::duplicates(&mut e), 0);
    // Its retry with the same key is the other host's answer.
    let again = e.dispatch(&crate::support::refund(key, 400)).unwrap();
    assert_eq!(again.model_result.data, env.model_result.data);
}

/// Issue 36 §2: a call blocked by a lock nobody releases is answered within
/// `lock_timeout` (`DB_BUSY`: retry with the same key, nothing happened), not
/// held for ever; once the lock is gone the same key runs once.
#[test]
fn a_call_behind_a_stuck_lock_is_answered_db_busy_not_held() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let fx = crate::support::Fixture::on(crate::support::Backend::Postgres);
    let mut holder = postgres::Client::connect(fx.path().to_str().unwrap(), postgres::NoTls).unwrap();
    holder.batch_execute("BEGIN; LOCK TABLE operations IN ACCESS EXCLUSIVE MODE").unwrap();
    let mut e = fx.engine();
    let started = Instant::now();
    let err = e.dispatch(&crate::support::refund("stuck-refund-0001", 250)).err().map(|e| e.code().to_string());
    let waited = started.elapsed();
    assert_eq!(err.as_deref(), Some("DB_BUSY"), "after {waited:?}");
    assert!(waited < Duration::from_secs(60), "held {waited:?}");
    holder.batch_execute("ROLLBACK").unwrap();
    let env = e.dispatch(&crate::support::refund("stuck-refund-0001", 250)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert_eq!(crate::support::effects(&mut e), 1);
}

/// Issue 40: a PostgreSQL ledger at schema 8 migrates to 9 (the purge's
/// indexes), takes calls and audits clean.
#[test]
fn a_schema_8_ledger_migrates_to_the_purge_indexes() {
    if crate::support::pg_base().is_none() {
        return;
    }
    let db = crate::support::PgDb::new().unwrap();
    let mut c = db.client();
    for sql in [
        include_str!("../../crates/toolgate-core/src/store/pg/0001_ledger.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0002_api_tokens.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0003_sort_indexes.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0004_rollup_slots.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0005_holds.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0006_scope_downstream_key.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0007_operator_token_tenants.sql"),
        include_str!("../../crates/toolgate-core/src/store/pg/0008_audit_anchor.sql"),
    ] {
        c.batch_execute(sql).unwrap();
    }
    c.batch_execute("INSERT INTO meta (key, value) VALUES ('schema_version', '8')").unwrap();
    drop(c);
    let path = PathBuf::from(&db.url);
    let clock = ManualClock::new(crate::support::T0);
    let mut e = Engine::open(&path, opts(&clock, "migrated")).unwrap();
    e.load_world(&toolgate::engine::world::World::parse(toolgate::engine::world::DEMO_WORLD.as_bytes()).unwrap())
        .unwrap();
    let env = e.dispatch(&crate::support::refund("pg9-refund-0001", 100)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
    let mut c = db.client();
    for index in ["audit_log_operation", "receipts_operation", "call_identities_operation"] {
        let found: bool = c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&index]).unwrap().get(0);
        assert!(found, "{index}");
    }
    let v: String = c.query_one("SELECT value FROM meta WHERE key = 'schema_version'", &[]).unwrap().get(0);
    assert_eq!(v, "9");
}
