//! `toolgate bench`: the engine against bare SQLite loops, side by side, in one
//! process, on the same temporary disk and with the same pragmas.
//!
//! A durable ledger is bound by how many commits the disk can make, so the
//! numbers that matter are ratios within one run:
//!
//! - `bare_write` (three plain commits, [`crate::store::bench`]) against
//!   `fresh_dispatch` (the engine's whole write path: validation,
//!   authorization, digests, ledger, outbox, lease, sent-marker, a provider that
//!   answers at once, result persist, trace);
//! - `bare_lookup` (one indexed read) against `replay` (the engine's replay of a
//!   settled intent, authorization re-check included); and, because a replay
//!   must record its answer (a call-identity binding and a trace event) while a
//!   lookup writes nothing, `bare_replay`: the lookup plus that one commit;
//! - `query`: explicit status queries of settled operations;
//! - `contention`: 8 threads, each with its own [`Engine`], on 100 shared
//!   intents (exactly-once checked: effects, duplicates, busy errors) against 8
//!   threads on distinct intents, reported over one thread's `fresh_dispatch`;
//!   on PostgreSQL with the write transactions run again per call
//!   (serialization failures: what concurrent writers cost each other).
//!
//! - with `--http`, `http_fresh` and `http_replay`: the same calls through
//!   `toolgate serve`'s HTTP API (a server in this process on a loopback
//!   port, its own engine threads on the same ledger; a keep-alive client
//!   with an agent token), against the in-process `fresh_dispatch` and
//!   `replay` of the same round, at `synchronous=FULL`.
//!
//! The phases are interleaved in rounds (bare, engine, bare, engine, ...) so that
//! a machine whose speed drifts moves both sides of a ratio; each ratio is
//! reported as the median of its rounds with their spread. Both
//! `synchronous=FULL` (the default) and `NORMAL` are measured.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::engine::clock::{Clock, SystemClock};
use crate::engine::envelope::{Code, Delivery, Envelope, Status};
use crate::engine::world::{GrantSpec, SubjectSpec, TenantSpec, World};
use crate::engine::{DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest};
use crate::store::bench::{BareLedger, BarePayload};
use crate::store::{StoreError, Sync};
use crate::tools::demo::{set_orders, OrderSpec};

/// How to run the bench.
#[derive(Debug, Clone, Default)]
pub struct BenchOptions {
    /// A short run (one round, small phases): a smoke test, not a measurement.
    pub quick: bool,
    /// Where to make the temporary directory (the system's temp dir by default).
    /// It is removed at the end.
    pub dir: Option<PathBuf>,
    /// A PostgreSQL server (a `postgres://` URL of any database on it): the
    /// engine's and the bare loop's ledgers are databases made there for the
    /// run and dropped after it. SQLite files in `dir` when absent.
    pub postgres: Option<PathBuf>,
    /// Also measure the HTTP API (`http_fresh`, `http_replay`).
    pub http: bool,
}

/// Why the bench could not run, or found the engine misbehaving.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The bare loop's storage failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The temporary directory.
    #[error("bench directory: {0}")]
    Dir(String),
    /// A call answered something a correct engine never answers here.
    #[error("bench check failed: {0}")]
    Check(String),
}

impl crate::Coded for BenchError {
    /// Stable code for the CLI.
    fn code(&self) -> &'static str {
        match self {
            BenchError::Engine(e) => e.code(),
            BenchError::Store(e) => e.code(),
            BenchError::Dir(_) => "BENCH_DIR",
            BenchError::Check(_) => "BENCH_CHECK_FAILED",
        }
    }
}

/// Everything one `toolgate bench` measured.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// `--quick`.
    pub quick: bool,
    /// Rounds per durability mode.
    pub rounds: usize,
    /// Where the ledgers were: `sqlite` or `postgres`.
    pub backend: &'static str,
    /// One entry per `synchronous` mode, FULL first.
    pub modes: Vec<ModeReport>,
}

/// The numbers of one durability mode.
#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    /// `FULL` or `NORMAL`.
    pub synchronous: &'static str,
    /// Every phase, pooled over the rounds.
    pub phases: Vec<Phase>,
    /// The ratios, each the median of the rounds with the spread.
    pub ratios: Ratios,
    /// The contention check.
    pub contention: Contention,
    /// Commits that waited for the disk (SQLite: fsynced; PostgreSQL:
    /// `synchronous_commit` on), per call, ledger and provider together.
    pub synced_commits: SyncedCommits,
}

/// Synced commits per call of a single-threaded phase, and in the distinct
/// contention phase (where group commit shares them).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct SyncedCommits {
    /// Per fresh dispatch.
    pub per_fresh: f64,
    /// Per replay.
    pub per_replay: f64,
    /// Per call of the 8-thread distinct phase.
    pub per_distinct_call: f64,
}

/// One measured phase.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// `bare_write`, `fresh_dispatch`, `bare_lookup`, `bare_replay`, `replay`, `query`,
    /// `contention_shared`, `contention_distinct`.
    pub name: &'static str,
    /// Operations measured.
    pub ops: usize,
    /// Seconds spent.
    pub seconds: f64,
    /// Operations per second (for the contention phases: calls of all threads
    /// per wall-clock second).
    pub ops_per_s: f64,
    /// Median latency of one operation, microseconds.
    pub p50_us: u64,
    /// 99th percentile latency, microseconds.
    pub p99_us: u64,
}

/// A ratio of throughputs: the median of the per-round ratios, and their range.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratio {
    /// Median over the rounds.
    pub median: f64,
    /// Smallest round.
    pub min: f64,
    /// Largest round.
    pub max: f64,
}

/// The ratios the targets are stated in.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Ratios {
    /// `fresh_dispatch` ops/s over `bare_write` ops/s.
    pub fresh_over_bare: Ratio,
    /// `replay` ops/s over `bare_lookup` ops/s.
    pub replay_over_lookup: Ratio,
    /// `replay` ops/s over `bare_replay` ops/s (the same commit, no engine).
    pub replay_over_bare_replay: Ratio,
    /// Calls/s of 8 threads on shared intents over 8 threads on distinct ones.
    pub shared_over_distinct: f64,
    /// Calls/s of 8 threads on distinct intents over one thread's
    /// `fresh_dispatch` (pooled over the rounds): what concurrent writers gain.
    pub distinct_over_fresh: f64,
    /// `http_fresh` ops/s over `fresh_dispatch` ops/s (with `--http`).
    pub http_fresh_over_fresh: Option<Ratio>,
    /// `http_replay` ops/s over `replay` ops/s (with `--http`).
    pub http_replay_over_replay: Option<Ratio>,
}

/// What the contention phases checked.
#[derive(Debug, Clone, Serialize)]
pub struct Contention {
    /// Threads, each with its own engine (own connections).
    pub threads: usize,
    /// Shared intents.
    pub shared_intents: usize,
    /// Downstream effects the shared phase committed (must equal the intents).
    pub shared_effects: i64,
    /// Calls answered `fresh` in the shared phase (one per intent).
    pub shared_fresh: usize,
    /// Calls answered from the ledger in the shared phase.
    pub shared_replayed: usize,
    /// Calls answered `OUTCOME_UNKNOWN` because the intent was in flight in another thread.
    pub shared_in_flight: usize,
    /// Distinct intents (each executed once).
    pub distinct_intents: usize,
    /// Effects the distinct phase committed.
    pub distinct_effects: i64,
    /// Intents with more than one effect, in the whole database (must be 0).
    pub duplicates: i64,
    /// SQLite busy / locked errors that reached a caller (must be 0).
    pub busy_errors: usize,
    /// Write transactions run again after a serialization failure, deadlock
    /// or unique violation (PostgreSQL), per call of the shared phase.
    pub shared_retries_per_call: f64,
    /// The same, per call of the distinct phase.
    pub distinct_retries_per_call: f64,
}

/// The world of the bench database: one tenant with a threshold no refund
/// reaches, one agent per thread, each with a large order of its own.
fn world(agents: usize) -> World {
    let mut world = World {
        tenants: vec![TenantSpec {
            id: "bench".into(),
            approvers: vec!["bench_approver".into()],
            approval_threshold_minor: i64::MAX / 4,
        }],
        subjects: (0..agents).map(|i| SubjectSpec { id: agent(i), tenant: "bench".into() }).collect(),
        grants: (0..agents)
            .map(|i| GrantSpec { tenant: "bench".into(), subject: agent(i), tool: "create_refund".into() })
            .collect(),
        sections: std::collections::BTreeMap::new(),
    };
    let orders: Vec<OrderSpec> = (0..agents)
        .map(|i| OrderSpec {
            order_ref: order(i),
            tenant: "bench".into(),
            owner: agent(i),
            currency: "EUR".into(),
            captured_minor: 1_000_000_000_000_000,
            refunded_minor: 0,
            status: "paid".into(),
        })
        .collect();
    set_orders(&mut world, &orders);
    world
}

fn agent(i: usize) -> String {
    format!("agent_{i}")
}

fn order(i: usize) -> String {
    format!("ord_bench{i}")
}

/// A `create_refund` of 1.00 EUR by agent `i` under `key`.
fn refund(i: usize, key: String) -> DispatchRequest {
    DispatchRequest {
        tenant: "bench".into(),
        subject: agent(i),
        tool: "create_refund".into(),
        arguments: format!(r#"{{"order_ref":"{}","amount_minor":100,"currency":"EUR","reason":"damaged"}}"#, order(i))
            .into_bytes(),
        idempotency_key: Some(key),
        ..DispatchRequest::default()
    }
}

const THREADS: usize = 8;
const SHARED_INTENTS: usize = 100;

/// The sizes of one run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    rounds: usize,
    /// Time box of one phase in one round (it stops at `max_ops` sooner).
    phase_budget: Duration,
    /// At least this many operations per phase and round, whatever the time.
    min_ops: usize,
    /// At most this many.
    max_ops: usize,
    /// Calls per thread on distinct intents.
    distinct_per_thread: usize,
}

impl Plan {
    fn new(quick: bool, sync: Sync) -> Self {
        match (quick, sync) {
            (true, _) => Self {
                rounds: 1,
                phase_budget: Duration::from_millis(150),
                min_ops: 3,
                max_ops: 400,
                distinct_per_thread: 4,
            },
            (false, Sync::Full) => Self {
                rounds: 5,
                phase_budget: Duration::from_millis(1500),
                min_ops: 20,
                max_ops: 20_000,
                distinct_per_thread: 25,
            },
            (false, Sync::Normal) => Self {
                rounds: 5,
                phase_budget: Duration::from_secs(1),
                min_ops: 50,
                max_ops: 50_000,
                distinct_per_thread: 100,
            },
        }
    }
}

/// Runs the whole bench. The temporary directory is removed at the end.
pub fn run(opts: &BenchOptions) -> Result<BenchReport, BenchError> {
    let parent = opts.dir.clone().unwrap_or_else(std::env::temp_dir);
    let dir = parent.join(format!("toolgate-bench-{}-{}", std::process::id(), hex::encode(rand::random::<[u8; 4]>())));
    std::fs::create_dir_all(&dir).map_err(|e| BenchError::Dir(format!("cannot create it: {}", e.kind())))?;
    let out = run_in(&dir, opts.quick, opts.postgres.as_deref(), opts.http);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn run_in(dir: &Path, quick: bool, postgres: Option<&Path>, http: bool) -> Result<BenchReport, BenchError> {
    let mut modes = Vec::new();
    let mut rounds = 0;
    for (sync, name) in [(Sync::Full, "FULL"), (Sync::Normal, "NORMAL")] {
        let plan = Plan::new(quick, sync);
        rounds = plan.rounds;
        let sub = dir.join(name.to_lowercase());
        std::fs::create_dir_all(&sub).map_err(|e| BenchError::Dir(format!("cannot create it: {}", e.kind())))?;
        let ledgers = Ledgers::new(&sub, postgres)?;
        modes.push(mode(&ledgers, sync, name, plan, http && sync == Sync::Full)?);
    }
    let backend = if postgres.is_some() { "postgres" } else { "sqlite" };
    Ok(BenchReport { quick, rounds, backend, modes })
}

fn options(sync: Sync, worker: &str) -> EngineOptions {
    EngineOptions {
        clock: Arc::new(SystemClock) as Arc<dyn Clock>,
        sync,
        worker_id: worker.to_string(),
        ..crate::tools::demo_options()
    }
}

/// Latencies of one phase, pooled over rounds.
#[derive(Default)]
struct Samples {
    us: Vec<u64>,
    elapsed: Duration,
}

impl Samples {
    fn ops_per_s(&self) -> f64 {
        self.us.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn phase(&mut self, name: &'static str) -> Phase {
        self.us.sort_unstable();
        Phase {
            name,
            ops: self.us.len(),
            seconds: self.elapsed.as_secs_f64(),
            ops_per_s: self.ops_per_s(),
            p50_us: percentile(&self.us, 50.0),
            p99_us: percentile(&self.us, 99.0),
        }
    }
}

/// Nearest-rank percentile of sorted samples.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Runs `op(i)` for i = 0.. until the plan's time box (at least `min_ops`, at
/// most `max_ops`), adding each latency to `s`. Returns the round's ops/s.
fn timed(s: &mut Samples, plan: Plan, mut op: impl FnMut(usize) -> Result<(), BenchError>) -> Result<f64, BenchError> {
    let start = Instant::now();
    let mut n = 0;
    while n < plan.max_ops && (n < plan.min_ops || start.elapsed() < plan.phase_budget) {
        let t = Instant::now();
        op(n)?;
        s.us.push(t.elapsed().as_micros() as u64);
        n += 1;
    }
    let elapsed = start.elapsed();
    s.elapsed += elapsed;
    Ok(n as f64 / elapsed.as_secs_f64().max(1e-9))
}

fn ratio(mut per_round: Vec<f64>) -> Ratio {
    per_round.sort_by(f64::total_cmp);
    let n = per_round.len();
    if n == 0 {
        return Ratio { median: 0.0, min: 0.0, max: 0.0 };
    }
    let median = if n % 2 == 1 { per_round[n / 2] } else { f64::midpoint(per_round[n / 2 - 1], per_round[n / 2]) };
    Ratio { median, min: per_round[0], max: per_round[n - 1] }
}

fn check(env: &Envelope, status: Status, delivery: Delivery, what: &str) -> Result<(), BenchError> {
    let got = (env.model_result.status, env.model_result.execution.delivery);
    if got == (status, delivery) {
        Ok(())
    } else {
        Err(BenchError::Check(format!(
            "{what}: expected {status:?}/{delivery:?}, got {:?}/{:?} ({})",
            got.0,
            got.1,
            env.code().map_or("-", Code::as_str)
        )))
    }
}

/// Where one mode's two ledgers live: files in a directory, or databases made
/// for the run on a PostgreSQL server (dropped with this).
struct Ledgers {
    engine: PathBuf,
    bare: PathBuf,
    _scratch: Vec<crate::store::ScratchDatabase>,
}

impl Ledgers {
    fn new(dir: &Path, postgres: Option<&Path>) -> Result<Self, BenchError> {
        match postgres {
            None => Ok(Self { engine: dir.join("engine.db"), bare: dir.join("bare.db"), _scratch: Vec::new() }),
            Some(server) => {
                let server = server.to_string_lossy();
                let engine = crate::store::ScratchDatabase::create(&server, "bench")?;
                let bare = crate::store::ScratchDatabase::create(&server, "bench_bare")?;
                Ok(Self { engine: engine.url(), bare: bare.url(), _scratch: vec![engine, bare] })
            }
        }
    }
}

/// `toolgate serve` inside the bench: its engine threads on the bench's
/// ledger, a loopback port, stopped when dropped. Called the way the load
/// generator's agents call it ([`crate::load::HttpDoor`]).
struct HttpServer {
    door: crate::load::HttpDoor,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpServer {
    fn start(ledger: &Path, sync: Sync, token: String) -> Result<Self, BenchError> {
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let (ready, addr) = std::sync::mpsc::channel();
        let db = ledger.to_path_buf();
        let thread = std::thread::spawn(move || {
            let opts = crate::api::ServeOptions {
                listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                public: false,
                threads: 1,
                toolset: crate::tools::demo_toolset(),
                sync,
                worker: false,
                clock: Arc::new(crate::engine::clock::SystemClock),
                max_connections: crate::api::MAX_CONNECTIONS,
                max_connections_per_client: crate::api::MAX_CONNECTIONS_PER_CLIENT,
            };
            let failed = ready.clone();
            if let Err(e) = crate::api::serve_until(&db, &opts, |a| drop(ready.send(Ok(a))), Some(stopped)) {
                let _ = failed.send(Err(e.to_string()));
            }
        });
        let addr = addr
            .recv_timeout(Duration::from_secs(60))
            .map_err(|_| BenchError::Check("the HTTP server did not start".into()))?
            .map_err(|e| BenchError::Check(format!("the HTTP server did not start: {e}")))?;
        let tokens = std::collections::HashMap::from([(format!("bench/{}", agent(0)), token)]);
        let door = crate::load::HttpDoor::new(&[format!("http://{addr}")], tokens);
        Ok(Self { door, stop: Some(stop), thread: Some(thread) })
    }

    /// One `create_refund` through the API; the envelope's status and delivery checked.
    fn call(&self, key: &str, delivery: Delivery) -> Result<(), BenchError> {
        let env = self.door.dispatch(0, &refund(0, key.to_string()), None)?;
        check(&env, Status::Succeeded, delivery, "HTTP call")
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[allow(clippy::too_many_lines)]
fn mode(ledgers: &Ledgers, sync: Sync, name: &'static str, plan: Plan, http: bool) -> Result<ModeReport, BenchError> {
    let path = ledgers.engine.clone();
    let mut engine = Engine::create(&path, options(sync, "bench-main"))?;
    engine.load_world(&world(THREADS))?;
    // Warm-up, and the texts the bare loop stores (the engine's own).
    let env = engine.dispatch(&refund(0, "bench-warmup-0001".into()))?;
    check(&env, Status::Succeeded, Delivery::Fresh, "warm-up dispatch")?;
    let op_id = env.protected_audit.operation_id.clone().unwrap_or_default();
    let (op, trace) =
        engine.read(|tx| -> Result<_, StoreError> { Ok((tx.operation(&op_id)?, tx.trace_for(&op_id)?)) })?;
    let op = op.ok_or_else(|| BenchError::Check("the warm-up operation is not in the ledger".into()))?;
    let payload = BarePayload {
        request_json: op.request_json.clone(),
        result_json: op.result_json.clone().unwrap_or_default(),
        trace_fields: trace.into_iter().map(|t| t.fields).collect(),
    };
    let mut bare = BareLedger::create(&ledgers.bare, sync, payload)?;
    let clock = SystemClock;
    let server = if http {
        let who = crate::engine::tokens::TokenFor::Subject { tenant: "bench".into(), subject: agent(0) };
        let token = engine.create_token(&who, Some("bench"), None)?.token;
        let server = HttpServer::start(&path, sync, token)?;
        server.call("bench-http-warmup-0001", Delivery::Fresh)?;
        Some(server)
    } else {
        None
    };
    let (mut hf, mut hr) = (Samples::default(), Samples::default());
    let (mut http_fresh_ratios, mut http_replay_ratios) = (Vec::new(), Vec::new());
    let mut http_settled: Vec<String> = Vec::new();
    let (mut fresh_synced, mut fresh_calls, mut replay_synced, mut replay_calls) = (0u64, 0usize, 0u64, 0usize);

    let (mut bw, mut fd, mut bl, mut br, mut rp, mut qy) = (
        Samples::default(),
        Samples::default(),
        Samples::default(),
        Samples::default(),
        Samples::default(),
        Samples::default(),
    );
    let (mut write_ratios, mut replay_ratios, mut bare_replay_ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut bare_written: u64 = 0;
    let mut bare_calls: u64 = 0;
    // Settled operations to replay and query: (key, status_ref, request digest).
    let mut settled: Vec<(String, String, String)> = Vec::new();
    for round in 0..plan.rounds {
        let bare_rate = timed(&mut bw, plan, |_| {
            bare.write_one(bare_written, clock.now_ms())?;
            bare_written += 1;
            Ok(())
        })?;
        let synced_before = engine.synced_commits();
        let fresh_before = fd.us.len();
        let fresh_rate = timed(&mut fd, plan, |i| {
            let key = format!("bench-fresh-{round:02}-{i:08}");
            let env = engine.dispatch(&refund(0, key.clone()))?;
            check(&env, Status::Succeeded, Delivery::Fresh, "fresh dispatch")?;
            let a = &env.protected_audit;
            settled.push((
                key,
                a.downstream.status_ref.clone().unwrap_or_default(),
                a.binding.request_sha256.clone().unwrap_or_default(),
            ));
            Ok(())
        })?;
        write_ratios.push(fresh_rate / bare_rate);
        fresh_synced += engine.synced_commits() - synced_before;
        fresh_calls += fd.us.len() - fresh_before;
        let written = bare_written.max(1);
        let lookup_rate = timed(&mut bl, plan, |i| {
            let n = i as u64 % written;
            match bare.lookup(n)? {
                Some(_) => Ok(()),
                None => Err(BenchError::Check(format!("bare lookup {n} found nothing"))),
            }
        })?;
        let bare_replay_rate = timed(&mut br, plan, |i| {
            let n = i as u64 % written;
            bare_calls += 1;
            match bare.replay_one(n, bare_calls, clock.now_ms())? {
                Some(_) => Ok(()),
                None => Err(BenchError::Check(format!("bare replay {n} found nothing"))),
            }
        })?;
        let synced_before = engine.synced_commits();
        let replay_before = rp.us.len();
        let replay_rate = timed(&mut rp, plan, |i| {
            let key = settled[i % settled.len()].0.clone();
            let env = engine.dispatch(&refund(0, key))?;
            check(&env, Status::Succeeded, Delivery::LocalReplay, "replay")
        })?;
        replay_synced += engine.synced_commits() - synced_before;
        replay_calls += rp.us.len() - replay_before;
        replay_ratios.push(replay_rate / lookup_rate);
        bare_replay_ratios.push(replay_rate / bare_replay_rate);
        if let Some(server) = &server {
            let http_fresh_rate = timed(&mut hf, plan, |i| {
                let key = format!("bench-http-{round:02}-{i:08}");
                server.call(&key, Delivery::Fresh)?;
                http_settled.push(key);
                Ok(())
            })?;
            http_fresh_ratios.push(http_fresh_rate / fresh_rate);
            let http_replay_rate =
                timed(&mut hr, plan, |i| server.call(&http_settled[i % http_settled.len()], Delivery::LocalReplay))?;
            http_replay_ratios.push(http_replay_rate / replay_rate);
        }
        timed(&mut qy, plan, |i| {
            let (_, status_ref, digest) = &settled[i % settled.len()];
            let env = engine.query_operation_status(&QueryRequest {
                tenant: "bench".into(),
                subject: agent(0),
                status_ref: status_ref.clone(),
                expected_request_sha256: digest.clone(),
                ..QueryRequest::default()
            })?;
            check(&env, Status::Succeeded, Delivery::LocalReplay, "status query")
        })?;
    }
    drop(engine);
    drop(server);
    let (shared, distinct, contention, per_distinct_call) = contention(&path, sync, plan)?;
    let synced_commits = SyncedCommits {
        per_fresh: fresh_synced as f64 / fresh_calls.max(1) as f64,
        per_replay: replay_synced as f64 / replay_calls.max(1) as f64,
        per_distinct_call,
    };
    let mut ratios = Ratios {
        fresh_over_bare: ratio(write_ratios),
        replay_over_lookup: ratio(replay_ratios),
        replay_over_bare_replay: ratio(bare_replay_ratios),
        shared_over_distinct: shared.ops_per_s / distinct.ops_per_s.max(1e-9),
        distinct_over_fresh: 0.0,
        http_fresh_over_fresh: http.then(|| ratio(http_fresh_ratios)),
        http_replay_over_replay: http.then(|| ratio(http_replay_ratios)),
    };
    let fresh = fd.phase("fresh_dispatch");
    ratios.distinct_over_fresh = distinct.ops_per_s / fresh.ops_per_s.max(1e-9);
    let mut phases = vec![
        bw.phase("bare_write"),
        fresh,
        bl.phase("bare_lookup"),
        br.phase("bare_replay"),
        rp.phase("replay"),
        qy.phase("query"),
    ];
    if http {
        phases.extend([hf.phase("http_fresh"), hr.phase("http_replay")]);
    }
    phases.extend([shared, distinct]);
    Ok(ModeReport { synchronous: name, phases, ratios, contention, synced_commits })
}

/// What one contention thread saw.
#[derive(Default)]
struct ThreadTally {
    us: Vec<u64>,
    fresh: usize,
    replayed: usize,
    in_flight: usize,
    busy: usize,
}

fn is_busy(e: &EngineError) -> bool {
    matches!(
        e,
        EngineError::Store(StoreError::Busy)
            | EngineError::Downstream(crate::downstream::DownstreamError::Store(StoreError::Busy))
    )
}

/// `THREADS` threads, each with its own engine, dispatching `keys(thread)` in
/// order. Returns the phase and the per-thread tallies.
fn threads(
    path: &Path,
    sync: Sync,
    name: &'static str,
    keys: impl Fn(usize) -> Vec<(usize, String)> + std::marker::Sync,
) -> Result<(Phase, Vec<ThreadTally>), BenchError> {
    let mut engines = Vec::new();
    for t in 0..THREADS {
        engines.push(Engine::open(path, options(sync, &format!("bench-w{t}")))?);
    }
    let barrier = std::sync::Barrier::new(THREADS);
    let start = Instant::now();
    let results: Vec<Result<ThreadTally, BenchError>> = std::thread::scope(|s| {
        let handles: Vec<_> = engines
            .into_iter()
            .enumerate()
            .map(|(t, mut engine)| {
                let (keys, barrier) = (&keys, &barrier);
                s.spawn(move || -> Result<ThreadTally, BenchError> {
                    let mut tally = ThreadTally::default();
                    let calls = keys(t);
                    barrier.wait();
                    for (agent, key) in calls {
                        let t0 = Instant::now();
                        let env = match engine.dispatch(&refund(agent, key)) {
                            Ok(env) => env,
                            Err(e) if is_busy(&e) => {
                                tally.busy += 1;
                                continue;
                            }
                            Err(e) => return Err(e.into()),
                        };
                        tally.us.push(t0.elapsed().as_micros() as u64);
                        match (env.model_result.execution.delivery, env.code()) {
                            (Delivery::Fresh, None) => tally.fresh += 1,
                            (Delivery::LocalReplay, None) => tally.replayed += 1,
                            (_, Some(Code::OutcomeUnknown | Code::InProgress)) => tally.in_flight += 1,
                            (d, c) => {
                                return Err(BenchError::Check(format!(
                                    "contention: unexpected answer {d:?} / {}",
                                    c.map_or("-", Code::as_str)
                                )))
                            }
                        }
                    }
                    Ok(tally)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(BenchError::Check("a bench thread panicked".into()))))
            .collect()
    });
    let elapsed = start.elapsed();
    let tallies = results.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut s = Samples { us: tallies.iter().flat_map(|t| t.us.iter().copied()).collect(), elapsed };
    Ok((s.phase(name), tallies))
}

fn contention(path: &Path, sync: Sync, plan: Plan) -> Result<(Phase, Phase, Contention, f64), BenchError> {
    let mut probe = Engine::open(path, options(sync, "bench-probe"))?;
    let before = probe.counts()?.downstream_effects;
    // Every thread dispatches the same intents in the same order: the worst case.
    let shared_key = |i: usize| format!("bench-shared-{i:04}");
    let retries_before = probe.write_retries();
    let (shared, st) =
        threads(path, sync, "contention_shared", |_| (0..SHARED_INTENTS).map(|i| (0, shared_key(i))).collect())?;
    let shared_retries = probe.write_retries() - retries_before;
    let mid = probe.counts()?.downstream_effects;
    // Every intent settled exactly once: a later dispatch of each replays.
    for i in 0..SHARED_INTENTS {
        let env = probe.dispatch(&refund(0, shared_key(i)))?;
        check(&env, Status::Succeeded, Delivery::LocalReplay, "dispatch after the shared phase")?;
    }
    let per = plan.distinct_per_thread;
    let synced_before = probe.synced_commits();
    let retries_before = probe.write_retries();
    let (distinct, dt) = threads(path, sync, "contention_distinct", |t| {
        (0..per).map(|i| (t, format!("bench-distinct-{t}-{i:04}"))).collect()
    })?;
    let synced_per_call = (probe.synced_commits() - synced_before) as f64 / (THREADS * per).max(1) as f64;
    let distinct_retries = probe.write_retries() - retries_before;
    let counts = probe.counts()?;
    let c = Contention {
        threads: THREADS,
        shared_intents: SHARED_INTENTS,
        shared_effects: mid - before,
        shared_fresh: st.iter().map(|t| t.fresh).sum(),
        shared_replayed: st.iter().map(|t| t.replayed).sum(),
        shared_in_flight: st.iter().map(|t| t.in_flight).sum(),
        distinct_intents: THREADS * per,
        distinct_effects: counts.downstream_effects - mid,
        duplicates: counts.side_effect_duplicates,
        busy_errors: st.iter().chain(dt.iter()).map(|t| t.busy).sum(),
        shared_retries_per_call: shared_retries as f64 / (THREADS * SHARED_INTENTS).max(1) as f64,
        distinct_retries_per_call: distinct_retries as f64 / (THREADS * per).max(1) as f64,
    };
    if c.shared_effects != SHARED_INTENTS as i64 || c.duplicates != 0 || c.shared_fresh != SHARED_INTENTS {
        return Err(BenchError::Check(format!(
            "contention: {} effects and {} fresh answers for {} shared intents, {} duplicates",
            c.shared_effects, c.shared_fresh, SHARED_INTENTS, c.duplicates
        )));
    }
    Ok((shared, distinct, c, synced_per_call))
}

/// The report as a table, for people.
pub fn table(r: &BenchReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "toolgate bench{} on {}: {} round(s) per mode, phases interleaved; ratios are the median of the rounds [min–max]",
        if r.quick { " --quick (a smoke run, not a measurement)" } else { "" },
        r.backend,
        r.rounds
    );
    for m in &r.modes {
        let _ = writeln!(out, "\nsynchronous={}", m.synchronous);
        let _ = writeln!(out, "  {:<20} {:>7} {:>10} {:>9} {:>9}", "phase", "ops", "ops/s", "p50 µs", "p99 µs");
        for p in &m.phases {
            let _ =
                writeln!(out, "  {:<20} {:>7} {:>10.1} {:>9} {:>9}", p.name, p.ops, p.ops_per_s, p.p50_us, p.p99_us);
        }
        let (fresh, lookup, bare) =
            (m.ratios.fresh_over_bare, m.ratios.replay_over_lookup, m.ratios.replay_over_bare_replay);
        let _ = writeln!(
            out,
            "  fresh/bare {:.3} [{:.3}–{:.3}]   replay/lookup {:.3} [{:.3}–{:.3}]   replay/bare_replay {:.3} \
             [{:.3}–{:.3}]   shared/distinct {:.2}   8-thread distinct/fresh {:.2}",
            fresh.median,
            fresh.min,
            fresh.max,
            lookup.median,
            lookup.min,
            lookup.max,
            bare.median,
            bare.min,
            bare.max,
            m.ratios.shared_over_distinct,
            m.ratios.distinct_over_fresh
        );
        let sc = m.synced_commits;
        let _ = writeln!(
            out,
            "  synced commits per call: fresh {:.2}   replay {:.2}   8-thread distinct {:.2}",
            sc.per_fresh, sc.per_replay, sc.per_distinct_call
        );
        if let (Some(f), Some(r)) = (m.ratios.http_fresh_over_fresh, m.ratios.http_replay_over_replay) {
            let _ = writeln!(
                out,
                "  http_fresh/fresh {:.3} [{:.3}–{:.3}]   http_replay/replay {:.3} [{:.3}–{:.3}]",
                f.median, f.min, f.max, r.median, r.min, r.max
            );
        }
        let c = &m.contention;
        let _ = writeln!(
            out,
            "  contention: {} threads; {} shared intents → {} effects ({} fresh, {} replayed, {} in flight elsewhere); \
             {} distinct → {} effects; {} duplicates, {} busy errors; write retries per call: shared {:.2}, distinct {:.2}",
            c.threads,
            c.shared_intents,
            c.shared_effects,
            c.shared_fresh,
            c.shared_replayed,
            c.shared_in_flight,
            c.distinct_intents,
            c.distinct_effects,
            c.duplicates,
            c.busy_errors,
            c.shared_retries_per_call,
            c.distinct_retries_per_call
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }

    #[test]
    fn ratio_is_the_median_of_rounds() {
        let r = ratio(vec![0.9, 0.5, 0.7]);
        assert!((r.median - 0.7).abs() < 1e-9 && (r.min - 0.5).abs() < 1e-9 && (r.max - 0.9).abs() < 1e-9);
        let r = ratio(vec![1.0, 2.0]);
        assert!((r.median - 1.5).abs() < 1e-9);
    }
}
