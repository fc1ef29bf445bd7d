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

/// A temporary database with the demo world loaded.
pub struct Fixture {
    /// Kept alive for the fixture's lifetime (the directory is removed on drop).
    pub _dir: TempDir,
    pub path: PathBuf,
    pub clock: ManualClock,
}

impl Fixture {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.db");
        let clock = ManualClock::new(T0);
        let mut e = Engine::create(&path, opts(&clock, "init")).unwrap();
        e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
        Self { _dir: dir, path, clock }
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
}

pub fn opts(clock: &ManualClock, worker: &str) -> EngineOptions {
    EngineOptions { clock: Arc::new(clock.clone()), worker_id: worker.to_string(), ..EngineOptions::default() }
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

/// A raw rusqlite connection for tests that tamper with or inspect rows.
pub fn raw(path: &Path) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(path).unwrap();
    c.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
    c
}

/// A snapshot of every business table, to prove a refused input changed nothing.
pub fn snapshot(path: &Path) -> Vec<String> {
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
