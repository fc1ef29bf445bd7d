//! Kill-at-random crash loop (sled style): the test re-runs its own binary as a
//! child that streams dispatches, approvals, workers, reaper passes and status
//! queries at one database; the parent SIGKILLs it at a random moment, restarts
//! it, and repeats. Then the parent recovers (reaper, the callers' retries,
//! workers, explicit status queries) and checks every invariant of
//! [`crate::invariants::check`].
//!
//! Seeded: `TOOLGATE_SEED=N` replays the same action stream, faults, kill delays
//! and clock jumps (where each kill lands in that stream still depends on the
//! machine's speed). `TOOLGATE_SOAK=N` sets the number of kills (20 by default,
//! as in CI).
//!
//! Clocks are manual: each child run starts its clock after the latest instant
//! stored in the database plus a seeded jump (a few ms: leases of the dead child
//! still live; seconds: leases expired; a minute: deadlines passed; twenty minutes:
//! approvals expired), so lease expiry is exercised without waiting for it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;
use toolgate::downstream::FaultPlan;
use toolgate::engine::clock::{Clock, ManualClock};
use toolgate::engine::envelope::{Code, Status};
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{DefensesOff, DispatchRequest, Engine, EngineOptions, QueryRequest};
use toolgate::store::Sync;

use crate::invariants::{check, Expect, Tally};
use crate::support::{Backend, PgDb, RawDb, T0};

mod api;

/// The child's entry point: a no-op unless the parent set this variable.
const CHILD_ENV: &str = "TOOLGATE_CRASH_CHILD";
/// The catalog of an HTTP loop's child.
const CATALOG_ENV: &str = "TOOLGATE_CRASH_CATALOG";

/// How a loop runs.
#[derive(Debug, Clone, Copy)]
struct LoopConfig {
    seed: u64,
    kills: u32,
    /// The control: the downstream key changes with every attempt.
    defense_off: bool,
    /// `create_refund` and `notify_customer` behind a real `toolgate provider
    /// serve` over HTTP (the provider outlives every killed dispatcher).
    http: bool,
    /// Where the ledger lives.
    backend: Backend,
    /// Each run starts two processes at once, a dispatcher (calls, approvals,
    /// status queries) and a worker (reaper and outbox), each killed at a
    /// moment of its own: several hosts' processes on one ledger.
    split: bool,
}

/// What a loop saw, for the report and the assertions.
#[derive(Debug, Default)]
struct LoopReport {
    killed: u32,
    self_crashed: u32,
    finished: u32,
    unknown_before_queries: usize,
    reconciled_by_query: usize,
    left_unknown: usize,
    left_for_review: usize,
    tally: Tally,
    violations: Vec<String>,
}

fn soak_kills() -> u32 {
    std::env::var("TOOLGATE_SOAK").ok().and_then(|s| s.parse().ok()).filter(|n| *n > 0).unwrap_or(20)
}

fn seed() -> u64 {
    std::env::var("TOOLGATE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn crash_loop_kill_at_random_keeps_every_invariant(backend: Backend) {
    let cfg = LoopConfig { seed: seed(), kills: soak_kills(), defense_off: false, http: false, backend, split: false };
    eprintln!("crash loop: seed {} kills {}", cfg.seed, cfg.kills);
    let r = crash_loop(cfg);
    eprintln!("crash loop report (seed {}): {r:#?}", cfg.seed);
    assert!(
        r.violations.is_empty(),
        "crash loop broke invariants; reproduce with TOOLGATE_SEED={} TOOLGATE_SOAK={} cargo test crash_loop_kill\n{}",
        cfg.seed,
        cfg.kills,
        r.violations.join("\n")
    );
    assert_eq!(r.tally.duplicates, 0);
    assert!(r.killed + r.self_crashed > 0, "the loop crashed nothing: {r:?}");
    assert!(r.tally.effects > 0, "the loop did nothing: {r:?}");
}

/// Dispatchers and workers in separate processes at once, each SIGKILLed at
/// random (issue 16 §3: several hosts, simulated): 0 duplicates, nothing
/// stranded, every invariant.
fn crash_loop_with_dispatcher_and_worker_processes_at_once(backend: Backend) {
    let kills = soak_kills().div_ceil(2).max(2);
    let cfg = LoopConfig { seed: seed(), kills, defense_off: false, http: false, backend, split: true };
    eprintln!("split crash loop: seed {} runs {}", cfg.seed, cfg.kills);
    let r = crash_loop(cfg);
    eprintln!("split crash loop report (seed {}): {r:#?}", cfg.seed);
    assert!(
        r.violations.is_empty(),
        "split crash loop broke invariants; reproduce with TOOLGATE_SEED={} TOOLGATE_SOAK={}\n{}",
        cfg.seed,
        soak_kills(),
        r.violations.join("\n")
    );
    assert_eq!(r.tally.duplicates, 0);
    assert!(r.killed + r.self_crashed > 0, "the loop crashed nothing: {r:?}");
    assert!(r.tally.effects > 0, "the loop did nothing: {r:?}");
}

/// The checker is proven: with one defense off, the same loop reports duplicates.
fn crash_loop_control_with_a_defense_off_reports_duplicates(backend: Backend) {
    let cfg = LoopConfig { seed: seed(), kills: 6, defense_off: true, http: false, backend, split: false };
    let r = crash_loop(cfg);
    eprintln!("control report (seed {}): {r:#?}", cfg.seed);
    assert!(r.tally.duplicates > 0, "seed {}: the defense-off control produced no duplicate: {r:#?}", cfg.seed);
    assert!(
        r.violations.iter().any(|v| v.starts_with("duplicate:")),
        "seed {}: the checker did not report the duplicates: {:#?}",
        cfg.seed,
        r.violations
    );
}

/// The same loop with the providers behind HTTP: SIGKILLed dispatchers,
/// dropped connections and lost replies over real sockets, 0 duplicates.
#[test]
fn crash_loop_over_http_keeps_every_invariant() {
    let cfg = LoopConfig {
        seed: seed(),
        kills: soak_kills().div_ceil(2),
        defense_off: false,
        http: true,
        backend: Backend::Sqlite,
        split: false,
    };
    eprintln!("crash loop over http: seed {} kills {}", cfg.seed, cfg.kills);
    let r = crash_loop(cfg);
    eprintln!("crash loop over http report (seed {}): {r:#?}", cfg.seed);
    assert!(
        r.violations.is_empty(),
        "crash loop over http broke invariants; reproduce with TOOLGATE_SEED={} TOOLGATE_SOAK={} cargo test crash_loop_over_http\n{}",
        cfg.seed,
        cfg.kills * 2,
        r.violations.join("\n")
    );
    assert_eq!(r.tally.duplicates, 0);
    assert!(r.killed > 0, "the loop crashed nothing: {r:?}");
    assert!(r.tally.effects > 0, "the loop did nothing: {r:?}");
}

/// The latest instant the database holds (the next run's clock starts after it).
fn latest_instant(path: &Path) -> i64 {
    let rows = RawDb::open(path).rows(
        "SELECT max(m) FROM (SELECT max(at) AS m FROM trace_events
           UNION ALL SELECT max(updated_at) FROM operations
           UNION ALL SELECT max(committed_at) FROM provider_effects
           UNION ALL SELECT max(created_at) FROM approvals) AS t",
        &[],
    );
    match rows[0][0] {
        crate::support::Val::Int(v) => v.max(T0),
        _ => T0,
    }
}

fn engine_at(path: &Path, clock: &ManualClock, worker: &str, defense_off: bool, catalog: Option<&Path>) -> Engine {
    Engine::open(
        path,
        EngineOptions {
            clock: Arc::new(clock.clone()),
            worker_id: worker.to_string(),
            sync: Sync::Full,
            defenses_off: DefensesOff { unique_downstream_key_per_attempt: defense_off, ..DefensesOff::default() },
            ..EngineOptions::new(toolgate::tools::load_toolset(catalog).unwrap())
        },
    )
    .unwrap()
}

fn spawn_child(path: &Path, cfg: LoopConfig, run: u32, base: i64, catalog: Option<&Path>) -> Child {
    spawn_role(path, cfg, run, base, catalog, "mixed")
}

fn spawn_role(path: &Path, cfg: LoopConfig, run: u32, base: i64, catalog: Option<&Path>, role: &str) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env("TOOLGATE_CRASH_ROLE", role);
    if let Some(c) = catalog {
        cmd.env(CATALOG_ENV, c);
    }
    cmd.args(["--exact", "crash::crash_child", "--nocapture", "--test-threads=1", "-q"])
        .env(CHILD_ENV, path)
        .env("TOOLGATE_CRASH_SEED", cfg.seed.to_string())
        .env("TOOLGATE_CRASH_RUN", run.to_string())
        .env("TOOLGATE_CRASH_KILLS", cfg.kills.to_string())
        .env("TOOLGATE_CRASH_BASE", base.to_string())
        .env("TOOLGATE_CRASH_DEFENSE_OFF", if cfg.defense_off { "1" } else { "0" })
        .env_remove("TOOLGATE_FAILPOINT")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn crash_loop(cfg: LoopConfig) -> LoopReport {
    let dir = tempfile::tempdir().unwrap();
    let pg = (cfg.backend == Backend::Postgres).then(|| PgDb::new().expect("TOOLGATE_TEST_PG is set"));
    let path = pg.as_ref().map_or_else(|| dir.path().join("crash.db"), |db| PathBuf::from(&db.url));
    {
        let clock = ManualClock::new(T0);
        let mut e = Engine::create(&path, crate::support::opts(&clock, "init")).unwrap();
        e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    }
    // Over HTTP: one provider process for the whole loop, outliving every child.
    let server = cfg.http.then(|| crate::http::ProviderServer::start(dir.path(), &[]));
    let catalog = server.as_ref().map(|s| crate::http::write_catalog(dir.path(), &s.url(), None));
    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut report = LoopReport::default();
    for run in 0..cfg.kills {
        let jump = if cfg.defense_off {
            // Past the dead child's lease, within the operation's deadline: the
            // reaper re-queues the possibly-sent attempt and the next worker re-sends.
            7_000
        } else {
            match rng.gen_range(0..10) {
                0..=4 => rng.gen_range(1..500),
                5..=7 => rng.gen_range(6_000..9_000),
                8 => rng.gen_range(30_000..60_000),
                _ => 20 * 60_000,
            }
        };
        let base = latest_instant(&path) + jump;
        let delay = if cfg.defense_off { rng.gen_range(150..600) } else { rng.gen_range(20..500) };
        let mut children = if cfg.split {
            // Two processes at once, each killed at a moment of its own.
            let worker_delay = rng.gen_range(20..500);
            vec![
                (spawn_role(&path, cfg, 2 * run, base, catalog.as_deref(), "dispatcher"), delay),
                (spawn_role(&path, cfg, 2 * run + 1, base, catalog.as_deref(), "worker"), worker_delay),
            ]
        } else {
            vec![(spawn_child(&path, cfg, run, base, catalog.as_deref()), delay)]
        };
        children.sort_by_key(|(_, d)| *d);
        let started = std::time::Instant::now();
        for (child, d) in &mut children {
            std::thread::sleep(Duration::from_millis(*d).saturating_sub(started.elapsed()));
            let _ = child.kill();
        }
        for (child, _) in children {
            let out = child.wait_with_output().unwrap();
            use std::os::unix::process::ExitStatusExt;
            match (out.status.code(), out.status.signal()) {
                (Some(0), _) => report.finished += 1,
                (_, Some(9)) => report.killed += 1,
                // SIGABRT: the child's own crash_after_commit fault.
                (_, Some(6)) => report.self_crashed += 1,
                _ => panic!(
                    "seed {}: child run {run} failed ({}):\n{}",
                    cfg.seed,
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        }
    }
    recover(&path, cfg, &mut report, catalog.as_deref());
    let expect = Expect { settled: true, queried: true };
    let (violations, tally) = match &server {
        None => check(&path, expect),
        Some(s) => {
            let mut e = engine_at(&path, &ManualClock::new(0), "checker", false, catalog.as_deref());
            crate::invariants::check_effects_at(&path, &s.db, expect, &mut e)
        }
    };
    report.violations = violations;
    report.tally = tally;
    if std::env::var_os("TOOLGATE_CRASH_KEEP").is_some() {
        // Debugging aid: keep the ledger for `toolgate ops show`.
        eprintln!("crash loop ledger kept at {}", dir.keep().join("crash.db").display());
    }
    report
}

/// Recovery as operators and callers would do it: reaper, workers, every
/// caller retries its intent once (same key, same arguments), workers again, then
/// an explicit status query for every operation still unknown.
fn recover(path: &Path, cfg: LoopConfig, report: &mut LoopReport, catalog: Option<&Path>) {
    let clock = ManualClock::new(latest_instant(path) + 3_600_000);
    let mut e = engine_at(path, &clock, "recovery", cfg.defense_off, catalog);
    e.reap().unwrap();
    e.work(usize::MAX).unwrap();
    for op in e.list_operations(None, i64::MAX).unwrap() {
        if op.state == "accepted" || op.state == "in_flight" {
            let args: Value = serde_json::from_str::<Value>(&op.request_json).unwrap()["arguments"].clone();
            let env = e
                .dispatch(&DispatchRequest {
                    tenant: op.tenant.clone(),
                    subject: op.subject.clone(),
                    tool: op.tool.clone(),
                    arguments: serde_json::to_vec(&args).unwrap(),
                    idempotency_key: Some(op.idem_key.clone()),
                    ..DispatchRequest::default()
                })
                .unwrap();
            assert_ne!(env.code(), Some(Code::IdempotencyConflict), "a retry with the stored arguments conflicts");
        }
    }
    e.work(usize::MAX).unwrap();
    clock.advance(3_600_000);
    e.reap().unwrap();
    e.work(usize::MAX).unwrap();
    if catalog.is_some() {
        // A provider over HTTP finishes in real time what a lost reply left
        // running (a slow commit, a delayed receipt): let it land before asking.
        std::thread::sleep(Duration::from_secs(3));
    }
    let unknown = e.list_operations(Some(toolgate::store::OpState::Unknown), i64::MAX).unwrap();
    report.unknown_before_queries = unknown.len();
    for op in unknown {
        let env = e
            .query_operation_status(&QueryRequest {
                tenant: op.tenant.clone(),
                subject: op.subject.clone(),
                status_ref: op.status_ref.clone(),
                expected_request_sha256: op.request_sha256.clone(),
                idempotency_key: Some(op.idem_key.clone()),
                ..QueryRequest::default()
            })
            .unwrap();
        if env.model_result.status == Status::Succeeded {
            report.reconciled_by_query += 1;
        }
    }
    let counts = e.counts().unwrap();
    report.left_unknown = counts.operations.get("unknown").copied().unwrap_or(0) as usize;
    report.left_for_review = counts.operations.get("needs_review").copied().unwrap_or(0) as usize;
}

// ------------------------------------------------------------------ the child

#[test]
fn crash_child() {
    // Not a test by itself: the entry point the crash loop re-executes.
    let Some(path) = std::env::var_os(CHILD_ENV) else { return };
    let var = |k: &str| std::env::var(k).unwrap().parse::<i64>().unwrap();
    let seed: u64 = std::env::var("TOOLGATE_CRASH_SEED").unwrap().parse().unwrap();
    let (run, kills, base) =
        (var("TOOLGATE_CRASH_RUN") as u64, var("TOOLGATE_CRASH_KILLS") as u64, var("TOOLGATE_CRASH_BASE"));
    let defense_off = var("TOOLGATE_CRASH_DEFENSE_OFF") == 1;
    let catalog = std::env::var_os(CATALOG_ENV).map(std::path::PathBuf::from);
    child_main(Path::new(&path), seed, run, kills, base, defense_off, catalog.as_deref());
}

const TEMPLATES: [&str; 3] = ["refund_issued", "refund_delayed", "order_update"];

/// The child: a stream of dispatches with same-key retries, approvals, workers,
/// reaper passes, status queries and clock steps, until it is killed.
fn child_main(path: &Path, seed: u64, run: u64, kills: u64, base: i64, defense_off: bool, catalog: Option<&Path>) {
    let http = catalog.is_some();
    let clock = ManualClock::new(base);
    let mut e = engine_at(path, &clock, &format!("crash-run-{run}"), defense_off, catalog);
    let mut rng = StdRng::seed_from_u64(seed ^ (run + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let role = std::env::var("TOOLGATE_CRASH_ROLE").unwrap_or_default();
    if role == "worker" {
        // A worker process only: the reaper and the outbox, until killed.
        loop {
            if clock.now_ms() > base + 40 * 60_000 {
                return;
            }
            e.reap().unwrap();
            e.work(4).unwrap();
            clock.advance(rng.gen_range(1..400));
            std::thread::sleep(Duration::from_millis(rng.gen_range(0..5)));
        }
    }
    let dispatcher_only = role == "dispatcher";
    // A restarted worker process reaps and works first.
    if !dispatcher_only {
        e.reap().unwrap();
        e.work(50).unwrap();
    }
    // Intent pools grow with the loop so that every intent is retried a few times.
    let refunds = 10 * kills + 20;
    let notifies = 4 * kills + 8;
    let mut seen: BTreeMap<String, (String, String)> = BTreeMap::new();
    for step in 0..100_000u64 {
        if clock.now_ms() > base + 40 * 60_000 {
            return;
        }
        clock.advance(rng.gen_range(1..400));
        let roll = rng.gen_range(0..100);
        if defense_off && step == 0 {
            // The control's first action: a fresh refund whose reply is lost in a crash.
            let req = refund_request(&format!("crash-ctl-{run:04}"), 1 + run as i64 % 40);
            e.set_faults(FaultPlan::parse("crash_after_commit").unwrap());
            e.dispatch(&req).unwrap();
            unreachable!("crash_after_commit aborts the process");
        }
        match roll {
            0..=49 => {
                let i = rng.gen_range(0..refunds);
                let req = refund_request(&format!("crash-refund-{i:05}"), 1 + (i as i64 % 40));
                e.set_faults(pick_fault(&mut rng, http));
                let env = e.dispatch(&req).unwrap();
                e.set_faults(FaultPlan::none());
                remember(&mut seen, &req, &env);
            }
            50..=69 => {
                let i = rng.gen_range(0..notifies);
                let req = notify_request(&format!("crash-notify-{i:05}"), TEMPLATES[i as usize % 3]);
                let env = e.dispatch(&req).unwrap();
                remember(&mut seen, &req, &env);
                if env.code() == Some(Code::ApprovalRequired) && rng.gen_bool(0.8) {
                    let id = env.protected_audit.approval_id.clone().unwrap();
                    let approver = if rng.gen_bool(0.5) { "alice" } else { "bob" };
                    e.set_faults(pick_fault(&mut rng, http));
                    let env = e.approve(&id, approver).unwrap();
                    e.set_faults(FaultPlan::none());
                    remember(&mut seen, &req, &env);
                }
            }
            70..=84 if dispatcher_only => clock.advance(rng.gen_range(1..400)),
            70..=79 => {
                e.work(4).unwrap();
            }
            80..=84 => {
                e.reap().unwrap();
            }
            85..=94 => {
                if seen.is_empty() {
                    continue;
                }
                let k = rng.gen_range(0..seen.len());
                let (key, (sr, sha)) = seen.iter().nth(k).unwrap();
                e.query_operation_status(&QueryRequest {
                    tenant: "acme".into(),
                    subject: "agent_ana".into(),
                    status_ref: sr.clone(),
                    expected_request_sha256: sha.clone(),
                    idempotency_key: Some(key.clone()),
                    ..QueryRequest::default()
                })
                .unwrap();
            }
            _ => clock.advance(rng.gen_range(1_000..8_000)),
        }
    }
}

fn remember(
    seen: &mut BTreeMap<String, (String, String)>,
    req: &DispatchRequest,
    env: &toolgate::engine::envelope::Envelope,
) {
    if let (Some(sr), Some(sha)) = (env.status_ref(), env.protected_audit.binding.request_sha256.as_deref()) {
        seen.insert(req.idempotency_key.clone().unwrap(), (sr.to_string(), sha.to_string()));
    }
}

fn refund_request(key: &str, amount: i64) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        arguments: crate::support::refund_args("ord_1002", amount).into_bytes(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

fn notify_request(key: &str, template: &str) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "notify_customer".into(),
        arguments: format!(r#"{{"order_ref":"ord_1001","template":"{template}"}}"#).into_bytes(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

/// Mostly no fault; otherwise one of the provider's failure modes for this call.
/// Over HTTP a `crash_after_commit` would abort the provider process, not the
/// dispatcher: it becomes a connection dropped after the commit.
fn pick_fault(rng: &mut StdRng, http: bool) -> FaultPlan {
    if rng.gen_bool(0.6) {
        return FaultPlan::none();
    }
    let spec = match rng.gen_range(0..20) {
        0..=3 => "timeout_after_commit".to_string(),
        // Over HTTP the delays are real time: short enough for the recovery to see them land.
        4..=5 if http => format!("receipt_delay({})", rng.gen_range(100..2_000)),
        4..=5 => format!("receipt_delay({})", rng.gen_range(500..20_000)),
        6..=7 => "connect_timeout".to_string(),
        8..=9 => format!("rate_limit({})", rng.gen_range(100..3_000)),
        10 => "unavailable".to_string(),
        11..=12 => "timeout_before_commit".to_string(),
        13 => "malformed_response".to_string(),
        14 => "mismatch_after_commit".to_string(),
        15 => "reject(card_declined)".to_string(),
        16 if http => format!("latency({})", rng.gen_range(10..2_500)),
        16 => format!("latency({})", rng.gen_range(10..8_000)),
        // A crash right after the provider commits: the window a random kill rarely hits.
        17 if http => "drop_after_commit".to_string(),
        17 => "crash_after_commit".to_string(),
        _ => "connect_timeout,timeout_after_commit".to_string(),
    };
    FaultPlan::parse(&spec).unwrap()
}

// ------------------------------------------------- regressions the loop found

/// A refund whose attempts were all refused before the provider received them
/// (the attempt cap was reached), waiting in the outbox; then a worker claims it,
/// records the sent-marker and dies.
fn sent_then_died(fx: &crate::support::Fixture, key: &str) -> String {
    use toolgate::store::{OpenOptions, Store};
    let mut e = fx.engine();
    let r = crate::support::refund(key, 600);
    let env = crate::support::dispatch_with(&mut e, &r, &["connect_timeout"; 5].join(","));
    assert_eq!(env.code(), Some(Code::TimeoutBeforeExecute), "{env:?}");
    let op = env.protected_audit.operation_id.unwrap();
    let mut store = Store::open(fx.path(), OpenOptions::default()).unwrap();
    fx.clock.advance(5_000);
    let now = fx.clock.now_ms();
    let attempt = store.write(|tx| tx.claim(&op, "dead-worker", now, now + 6_000)).unwrap().unwrap();
    assert!(store.write(|tx| tx.mark_sent(&op, "dead-worker", attempt, now)).unwrap());
    op
}

fn state_of(e: &mut Engine, op: &str) -> String {
    e.operation_detail(op).unwrap().unwrap().operation.state.to_string()
}

/// Found by the crash loop: the reaper re-queued a possibly-sent payments
/// attempt after the operation's deadline had passed; no worker picks up an
/// overdue row and a retry only answers OUTCOME_UNKNOWN, so the operation sat
/// `in_flight` for ever (a status query could not settle it, nor could a human:
/// `resolve` takes only unknown / needs_review). Now it is parked as `unknown`.
#[test]
fn a_possibly_sent_attempt_reaped_after_the_deadline_is_parked_unknown_not_stuck() {
    let fx = crate::support::Fixture::new();
    let op = sent_then_died(&fx, "refund-overdue-1");
    fx.clock.advance(60_000);
    let mut e = fx.engine();
    let rep = e.reap().unwrap();
    assert_eq!((rep.requeued_same_key, rep.parked_unknown), (0, 1), "{rep:?}");
    assert_eq!(state_of(&mut e, &op), "unknown");
    let (v, _) = check(fx.path(), Expect { settled: true, queried: false });
    assert!(v.is_empty(), "{v:#?}");
}

/// The same, when the re-queue happened in time but the deadline passed before
/// any worker re-sent it.
#[test]
fn a_requeued_attempt_whose_deadline_passes_before_a_worker_runs_it_is_parked_unknown() {
    let fx = crate::support::Fixture::new();
    let op = sent_then_died(&fx, "refund-overdue-2");
    fx.clock.advance(7_000);
    let mut e = fx.engine();
    assert_eq!(e.reap().unwrap().requeued_same_key, 1);
    assert_eq!(state_of(&mut e, &op), "in_flight");
    fx.clock.advance(60_000);
    assert_eq!(e.work(10).unwrap(), 0, "an overdue row is not sent again");
    assert_eq!(e.reap().unwrap().parked_unknown, 1);
    assert_eq!(state_of(&mut e, &op), "unknown");
    // The explicit query settles it: nothing was committed downstream.
    let d = e.operation_detail(&op).unwrap().unwrap().operation;
    let env = e
        .query_operation_status(&QueryRequest {
            tenant: d.tenant,
            subject: d.subject,
            status_ref: d.status_ref,
            expected_request_sha256: d.request_sha256,
            ..QueryRequest::default()
        })
        .unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown));
    assert_eq!(crate::support::effects(&mut e), 0);
}

/// Found while fixing the above: a re-queued possibly-sent attempt that the
/// provider then refused (429) put the operation back to `accepted`, whose
/// answer is "not started, retryable", although the first attempt may have
/// committed. It stays `in_flight`, answered as OUTCOME_UNKNOWN.
#[test]
fn a_refusal_after_a_possibly_sent_attempt_does_not_claim_nothing_was_sent() {
    let fx = crate::support::Fixture::new();
    let op = sent_then_died(&fx, "refund-refused-1");
    fx.clock.advance(7_000);
    let mut e = fx.engine();
    assert_eq!(e.reap().unwrap().requeued_same_key, 1);
    e.set_faults(FaultPlan::parse("rate_limit(60000)").unwrap());
    e.work(1).unwrap();
    e.set_faults(FaultPlan::none());
    assert_eq!(state_of(&mut e, &op), "in_flight");
    let env = e.dispatch(&crate::support::refund("refund-refused-1", 600)).unwrap();
    assert_eq!(env.model_result.status, Status::Unknown, "{env:?}");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown));
    assert_eq!(crate::support::effects(&mut e), 0);
}

/// Found by the 300-kill soak: a worker claimed a re-queued possibly-sent
/// operation and died before sending; the reaper put it back to `accepted`
/// ("nothing sent") although the first attempt may have committed, and once its
/// deadline passed nothing could move it. It stays `in_flight`, then is parked.
#[test]
fn an_unsent_attempt_after_a_possibly_sent_one_does_not_reset_to_accepted() {
    use toolgate::store::{OpenOptions, Store};
    let fx = crate::support::Fixture::new();
    let op = sent_then_died(&fx, "refund-unsent-01");
    fx.clock.advance(7_000);
    let mut e = fx.engine();
    assert_eq!(e.reap().unwrap().requeued_same_key, 1);
    let now = fx.clock.now_ms();
    let mut store = Store::open(fx.path(), OpenOptions::default()).unwrap();
    assert!(store.write(|tx| tx.claim(&op, "dies-before-send", now, now + 6_000)).unwrap().is_some());
    fx.clock.advance(7_000);
    assert_eq!(e.reap().unwrap().requeued_unsent, 1);
    assert_eq!(state_of(&mut e, &op), "in_flight", "an earlier attempt may have committed");
    fx.clock.advance(60_000);
    e.reap().unwrap();
    assert_eq!(state_of(&mut e, &op), "unknown");
    let (v, _) = check(fx.path(), Expect { settled: true, queried: false });
    assert!(v.is_empty(), "{v:#?}");
}

/// Found by the 300-kill soak: a re-send after a possibly-sent attempt that the
/// provider refused was recorded as a definitive failure ("no effect") although
/// the provider held an effect under the key (it had drifted). It is unknown
/// now, and the status query finds the mismatch for review.
#[test]
fn a_refused_re_send_after_a_possibly_sent_attempt_is_not_a_definitive_failure() {
    let fx = crate::support::Fixture::new();
    let op = sent_then_died(&fx, "refund-drift-01");
    fx.clock.advance(7_000);
    let mut e = fx.engine();
    assert_eq!(e.reap().unwrap().requeued_same_key, 1);
    e.set_faults(FaultPlan::parse("reject(idempotency_key_reused)").unwrap());
    e.work(1).unwrap();
    e.set_faults(FaultPlan::none());
    assert_eq!(state_of(&mut e, &op), "unknown");
    let env = e.dispatch(&crate::support::refund("refund-drift-01", 600)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    let (v, _) = check(fx.path(), Expect { settled: true, queried: false });
    assert!(v.is_empty(), "{v:#?}");
}

crate::on_both_backends!(
    crash_loop_with_dispatcher_and_worker_processes_at_once,
    crash_loop_kill_at_random_keeps_every_invariant,
    crash_loop_control_with_a_defense_off_reports_duplicates
);
