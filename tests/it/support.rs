//! Shared fixtures: a fresh database with the demo world, a manual clock, and
//! small helpers to dispatch and read counts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tempfile::TempDir;
use toolgate::downstream::FaultPlan;
use toolgate::engine::canonical::CallIdentity;
use toolgate::engine::clock::ManualClock;
use toolgate::engine::envelope::{Code, Envelope};
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{DispatchRequest, Engine, EngineOptions};

/// 2026-01-01T00:00:00Z.
pub const T0: i64 = 1_767_225_600_000;

/// Which backend a test runs on (tests that touch the ledger run on both:
/// [`on_both_backends!`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The PostgreSQL server the tests use: `TOOLGATE_TEST_PG`, a URL of a
/// database on it that may create databases (`.ci/pg-start` prints one).
/// Unset: the PostgreSQL half is skipped, loudly; under CI it must be set.
pub fn pg_base() -> Option<String> {
    static SAID: std::sync::Once = std::sync::Once::new();
    match std::env::var("TOOLGATE_TEST_PG") {
        Ok(v) if !v.is_empty() => Some(v),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must run the PostgreSQL tests: TOOLGATE_TEST_PG is not set (.ci/run starts a server)"
            );
            SAID.call_once(|| {
                use std::io::Write as _;
                // Straight to the terminal: the test harness captures eprintln!.
                let _ = std::io::stderr().write_all(
                    b"\n*** PostgreSQL tests SKIPPED: TOOLGATE_TEST_PG is not set \
                      (start a server with `.ci/pg-start DIR` and export the URL it prints) ***\n\n",
                );
            });
            None
        }
    }
}

/// The backends a test that loops over them runs on: SQLite, and PostgreSQL
/// when the test server is there.
pub fn backends() -> Vec<Backend> {
    let mut b = vec![Backend::Sqlite];
    if pg_base().is_some() {
        b.push(Backend::Postgres);
    }
    b
}

/// A new, empty PostgreSQL database on the test server; dropped with the guard.
pub struct PgDb {
    base: String,
    name: String,
    pub url: String,
}

impl PgDb {
    pub fn new() -> Option<Self> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let base = pg_base()?;
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("tg_{}_{n}_{}", std::process::id(), rand_suffix());
        let mut admin = postgres::Client::connect(&base, postgres::NoTls).expect("TOOLGATE_TEST_PG: cannot connect");
        admin.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        let url = match base.rfind('/') {
            Some(i) if base[..i].contains("://") && !base[..i].ends_with('/') => format!("{}/{name}", &base[..i]),
            _ => format!("{}/{name}", base.trim_end_matches('/')),
        };
        Some(Self { base, name, url })
    }

    /// A raw client on this database (tests that tamper with rows).
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url, postgres::NoTls).unwrap()
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        if let Ok(mut admin) = postgres::Client::connect(&self.base, postgres::NoTls) {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
        }
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(u64::from(std::process::id()));
    h.finish() % 1_000_000
}

/// Runs each named `fn NAME(backend: Backend)` as two tests, `NAME::sqlite`
/// and `NAME::postgres` (the second skipped, loudly, without a server).
#[macro_export]
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn sqlite() {
                    super::$name($crate::support::Backend::Sqlite);
                }
                #[test]
                fn postgres() {
                    if $crate::support::pg_base().is_some() {
                        super::$name($crate::support::Backend::Postgres);
                    }
                }
            }
        )*
    };
}

/// A temporary database with the demo world loaded.
pub struct Fixture {
    /// Kept alive for the fixture's lifetime (the directory is removed on drop).
    pub dir: TempDir,
    /// The PostgreSQL database, when the fixture runs there.
    pub pg: Option<PgDb>,
    /// The `--db` value: a SQLite path or a PostgreSQL URL.
    pub path: PathBuf,
    pub clock: ManualClock,
}

impl Fixture {
    /// On SQLite.
    pub fn new() -> Self {
        Self::on(Backend::Sqlite)
    }

    /// On the given backend (PostgreSQL: a new database on the test server).
    pub fn on(backend: Backend) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (pg, path) = match backend {
            Backend::Sqlite => (None, dir.path().join("ledger.db")),
            Backend::Postgres => {
                let db = PgDb::new().expect("TOOLGATE_TEST_PG is set");
                let url = PathBuf::from(&db.url);
                (Some(db), url)
            }
        };
        let clock = ManualClock::new(T0);
        let mut e = Engine::create(&path, opts(&clock, "init")).unwrap();
        e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
        Self { dir, pg, path, clock }
    }

    /// A new engine (its own connections) on the fixture's database.
    pub fn engine(&self) -> Engine {
        self.engine_named("w-test")
    }

    pub fn engine_named(&self, worker: &str) -> Engine {
        Engine::open(&self.path, opts(&self.clock, worker)).unwrap()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A scratch directory that lives as long as the fixture (on either backend).
    pub fn scratch(&self) -> &Path {
        self.dir.path()
    }

    /// Runs raw SQL (a tamper, a hand edit) on whichever backend holds the
    /// ledger; `?N` parameters, text values. Returns the rows changed.
    pub fn exec(&self, sql: &str, params: &[&str]) -> u64 {
        match &self.pg {
            None => {
                let p: Vec<&dyn rusqlite::ToSql> = params.iter().map(|p| p as &dyn rusqlite::ToSql).collect();
                raw(&self.path).execute(sql, p.as_slice()).unwrap() as u64
            }
            Some(db) => {
                let p: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn postgres::types::ToSql + Sync)).collect();
                db.client().execute(&sql.replace('?', "$"), &p).unwrap()
            }
        }
    }

    /// Runs several raw statements (no parameters) on either backend.
    pub fn exec_batch(&self, sql: &str) -> Result<(), String> {
        match &self.pg {
            None => raw(&self.path).execute_batch(sql).map_err(|e| e.to_string()),
            Some(db) => db.client().batch_execute(sql).map_err(|e| e.to_string()),
        }
    }

    /// Whether raw SQL (no parameters) is accepted on either backend.
    pub fn try_exec(&self, sql: &str) -> bool {
        match &self.pg {
            None => raw(&self.path).execute(sql, []).is_ok(),
            Some(db) => db.client().execute(sql, &[]).is_ok(),
        }
    }

    /// One optional text from raw SQL on either backend (`None`: no row).
    pub fn query_text(&self, sql: &str) -> Option<String> {
        match &self.pg {
            None => {
                use rusqlite::OptionalExtension as _;
                raw(&self.path).query_row(sql, [], |r| r.get(0)).optional().unwrap()
            }
            Some(db) => db.client().query_opt(sql, &[]).unwrap().map(|r| r.get(0)),
        }
    }

    /// One integer from raw SQL on either backend.
    pub fn query_i64(&self, sql: &str) -> i64 {
        match &self.pg {
            None => raw(&self.path).query_row(sql, [], |r| r.get(0)).unwrap(),
            Some(db) => db.client().query_one(sql, &[]).unwrap().get(0),
        }
    }
}

pub fn opts(clock: &ManualClock, worker: &str) -> EngineOptions {
    EngineOptions { clock: Arc::new(clock.clone()), worker_id: worker.to_string(), ..toolgate::tools::demo_options() }
}

pub fn refund_args(order: &str, amount: i64) -> String {
    format!(r#"{{"order_ref":"{order}","amount_minor":{amount},"currency":"EUR","reason":"damaged"}}"#)
}

/// A create_refund for agent_ana in acme.
pub fn refund(key: &str, amount: i64) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_refund".into(),
        arguments: refund_args("ord_1001", amount).into_bytes(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

pub fn call(call_id: &str) -> CallIdentity {
    CallIdentity {
        provider: "openai".into(),
        api_family: "responses".into(),
        response_id: "resp_1".into(),
        call_id: call_id.into(),
        adapter_revision: "1".into(),
    }
}

pub fn dispatch_with(e: &mut Engine, req: &DispatchRequest, faults: &str) -> Envelope {
    e.set_faults(FaultPlan::parse(faults).unwrap());
    let env = e.dispatch(req).unwrap();
    e.set_faults(FaultPlan::none());
    env
}

pub fn code(env: &Envelope) -> Option<Code> {
    env.code()
}

pub fn effects(e: &mut Engine) -> i64 {
    e.counts().unwrap().downstream_effects
}

pub fn duplicates(e: &mut Engine) -> i64 {
    e.counts().unwrap().side_effect_duplicates
}

/// A value read by [`RawDb`].
#[derive(Debug, Clone, PartialEq)]
pub enum Val {
    Null,
    Int(i64),
    Text(String),
}

impl Val {
    pub fn s(&self) -> String {
        match self {
            Val::Text(t) => t.clone(),
            other => panic!("not text: {other:?}"),
        }
    }
    pub fn os(&self) -> Option<String> {
        match self {
            Val::Null => None,
            other => Some(other.s()),
        }
    }
    pub fn i(&self) -> i64 {
        match self {
            Val::Int(i) => *i,
            other => panic!("not an integer: {other:?}"),
        }
    }
}

/// A raw connection to either backend, for checkers that read rows at rest
/// (`?N` parameters, text values).
pub enum RawDb {
    Lite(rusqlite::Connection),
    Pg(std::cell::RefCell<postgres::Client>),
}

impl RawDb {
    pub fn open(path: &Path) -> Self {
        if toolgate::store::Location::is_postgres(path) {
            RawDb::Pg(std::cell::RefCell::new(
                postgres::Client::connect(path.to_str().unwrap(), postgres::NoTls).unwrap(),
            ))
        } else {
            RawDb::Lite(raw(path))
        }
    }

    pub fn rows(&self, sql: &str, params: &[&str]) -> Vec<Vec<Val>> {
        match self {
            RawDb::Lite(c) => {
                let mut st = c.prepare(sql).unwrap();
                let n = st.column_count();
                let p: Vec<&dyn rusqlite::ToSql> = params.iter().map(|p| p as &dyn rusqlite::ToSql).collect();
                st.query_map(p.as_slice(), |r| {
                    Ok((0..n)
                        .map(|i| match r.get::<_, rusqlite::types::Value>(i).unwrap() {
                            rusqlite::types::Value::Null => Val::Null,
                            rusqlite::types::Value::Integer(v) => Val::Int(v),
                            rusqlite::types::Value::Text(t) => Val::Text(t),
                            other => panic!("unexpected value {other:?}"),
                        })
                        .collect())
                })
                .unwrap()
                .map(Result::unwrap)
                .collect()
            }
            RawDb::Pg(c) => {
                let p: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p as &(dyn postgres::types::ToSql + Sync)).collect();
                let rows = c.borrow_mut().query(&sql.replace('?', "$"), &p).unwrap();
                rows.iter()
                    .map(|r| {
                        (0..r.len())
                            .map(|i| {
                                use postgres::types::Type;
                                let ty = r.columns()[i].type_().clone();
                                if ty == Type::INT8 {
                                    r.get::<_, Option<i64>>(i).map_or(Val::Null, Val::Int)
                                } else if ty == Type::INT4 {
                                    r.get::<_, Option<i32>>(i).map_or(Val::Null, |v| Val::Int(v.into()))
                                } else {
                                    r.get::<_, Option<String>>(i).map_or(Val::Null, Val::Text)
                                }
                            })
                            .collect()
                    })
                    .collect()
            }
        }
    }

    /// The first row, if any.
    pub fn row(&self, sql: &str, params: &[&str]) -> Option<Vec<Val>> {
        self.rows(sql, params).into_iter().next()
    }
}

/// A raw rusqlite connection for tests that tamper with or inspect rows.
pub fn raw(path: &Path) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).unwrap();
    c.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
    c
}

/// A snapshot of every business table, to prove a refused input changed nothing.
pub fn snapshot(path: &Path) -> Vec<String> {
    const TABLES: [&str; 10] = [
        "operations",
        "outbox",
        "attempts",
        "call_identities",
        "approvals",
        "orders",
        "grants",
        "provider_effects",
        "receipts",
        "audit_log",
    ];
    if toolgate::store::Location::is_postgres(path) {
        let mut c = postgres::Client::connect(path.to_str().unwrap(), postgres::NoTls).unwrap();
        let mut out = Vec::new();
        for t in TABLES {
            for r in c.query(&format!("SELECT x::text FROM {t} x ORDER BY 1"), &[]).unwrap() {
                out.push(format!("{t}:{}", r.get::<_, String>(0)));
            }
        }
        return out;
    }
    let c = raw(path);
    let mut out = Vec::new();
    for t in [
        "operations",
        "outbox",
        "attempts",
        "call_identities",
        "approvals",
        "orders",
        "grants",
        "provider_effects",
        "receipts",
        "audit_log",
    ] {
        let mut st = c.prepare(&format!("SELECT * FROM {t} ORDER BY 1")).unwrap();
        let n = st.column_count();
        let rows = st
            .query_map([], |r| {
                let mut s = String::new();
                for i in 0..n {
                    let v: rusqlite::types::Value = r.get(i)?;
                    write!(s, "{v:?}|").unwrap();
                }
                Ok(s)
            })
            .unwrap();
        for r in rows {
            out.push(format!("{t}:{}", r.unwrap()));
        }
    }
    out
}

/// A status query by acme/agent_ana for the operation an envelope names, under
/// the call identity `call_id`.
pub fn query_req(env: &Envelope, call_id: &str) -> toolgate::engine::QueryRequest {
    toolgate::engine::QueryRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        status_ref: env.status_ref().unwrap().to_string(),
        expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap(),
        idempotency_key: None,
        call: Some(call(call_id)),
        operator: None,
    }
}

/// A manual clock whose gate parks one registered thread in its first wait, so
/// that its call sits inside the provider (claimed, sent-marker committed) while
/// the test acts.
pub struct GateClock {
    manual: ManualClock,
    gate: std::sync::Mutex<Gate>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
pub struct Gate {
    holder: Option<std::thread::ThreadId>,
    parked: bool,
    open: bool,
}

impl GateClock {
    pub fn new(manual: &ManualClock) -> Arc<Self> {
        Arc::new(Self {
            manual: manual.clone(),
            gate: std::sync::Mutex::new(Gate::default()),
            cv: std::sync::Condvar::new(),
        })
    }

    pub fn hold_current_thread(&self) {
        self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner).holder = Some(std::thread::current().id());
    }

    /// Waits until the held thread is parked (a guard against a hang, not a timing assertion).
    pub fn wait_parked(&self) {
        let g = self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (g, _) = self.cv.wait_timeout_while(g, std::time::Duration::from_secs(60), |g| !g.parked).unwrap();
        assert!(g.parked, "the held call never reached the provider");
    }

    pub fn open(&self) {
        self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner).open = true;
        self.cv.notify_all();
    }
}

impl toolgate::engine::clock::Clock for GateClock {
    fn now_ms(&self) -> i64 {
        self.manual.now_ms()
    }

    fn sleep_ms(&self, ms: u64) {
        let mut g = self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if g.holder == Some(std::thread::current().id()) && !g.open {
            g.parked = true;
            self.cv.notify_all();
            g = self.cv.wait_while(g, |g| !g.open).unwrap_or_else(std::sync::PoisonError::into_inner);
            g.parked = false;
        }
        drop(g);
        self.manual.advance(ms as i64);
    }
}

pub fn gated_engine(fx: &Fixture, clock: &Arc<GateClock>, worker: &str) -> Engine {
    let opts = EngineOptions { clock: clock.clone(), worker_id: worker.into(), ..toolgate::tools::demo_options() };
    Engine::open(fx.path(), opts).unwrap()
}

/// Dispatches `req` on its own engine in a thread that parks inside the provider.
pub fn dispatch_parked(
    fx: &Fixture,
    clock: &Arc<GateClock>,
    req: DispatchRequest,
) -> std::thread::JoinHandle<Envelope> {
    let mut e = gated_engine(fx, clock, "w-parked");
    let c = clock.clone();
    let h = std::thread::spawn(move || {
        c.hold_current_thread();
        dispatch_with(&mut e, &req, "latency(10)")
    });
    clock.wait_parked();
    h
}

/// A person's "failed, no effect" decision on an operation, with a note (no
/// receipt, no version check, no action id).
pub fn failed_by(op: &str, operator: &str, note: &str) -> toolgate::engine::ResolveRequest {
    toolgate::engine::ResolveRequest {
        operation_id: op.into(),
        resolution: toolgate::engine::Resolution::Failed,
        operator: operator.into(),
        note: note.into(),
        evidence: None,
        seen_version: None,
        action_id: None,
        no_evidence: false,
    }
}
