//! The demo database (docs/design.md §16): generated deterministically, committed as
//! `demo.db`, and opened as a working copy whose timestamps are re-based to now.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::downstream::FaultPlan;
use crate::engine::canonical::CallIdentity;
use crate::engine::clock::{Clock, ManualClock};
use crate::engine::envelope::Envelope;
use crate::engine::world::World;
use crate::engine::{DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest, Resolution, ResolveRequest};
use crate::store::{Location, OpenOptions, Store, StoreError, Sync};
use crate::tools::demo::DEMO_WORLD;

/// The committed demo database.
pub const DEMO_DB: &[u8] = include_bytes!("../../../demo.db");

/// The generator's clock starts here: 2026-01-01T09:00:00Z.
pub const DEMO_T0: i64 = 1_767_258_000_000;

/// The default seed.
pub const DEMO_SEED: u64 = 20_260_101;

fn refund(tenant: &str, subject: &str, order: &str, amount: i64, currency: &str, key: &str) -> DispatchRequest {
    DispatchRequest {
        tenant: tenant.into(),
        subject: subject.into(),
        tool: "create_refund".into(),
        arguments: format!(
            r#"{{"order_ref":"{order}","amount_minor":{amount},"currency":"{currency}","reason":"damaged"}}"#
        )
        .into_bytes(),
        idempotency_key: Some(key.into()),
        call: None,
        approval_id: None,
        deadline_ms: None,
        token_id: None,
    }
}

fn with_call(mut r: DispatchRequest, n: u32) -> DispatchRequest {
    r.call = Some(CallIdentity {
        provider: "openai".into(),
        api_family: "responses".into(),
        response_id: format!("resp_demo_{n:03}"),
        call_id: format!("call_demo_{n:03}"),
        adapter_revision: "1".into(),
    });
    r
}

struct Gen {
    engine: Engine,
    clock: ManualClock,
    n: u32,
}

impl Gen {
    fn run(&mut self, req: DispatchRequest, faults: &str) -> Result<Envelope, EngineError> {
        self.n += 1;
        self.clock.advance(7_000);
        self.engine.set_faults(FaultPlan::parse(faults).unwrap_or_default());
        let env = self.engine.dispatch(&with_call(req, self.n))?;
        self.engine.set_faults(FaultPlan::none());
        Ok(env)
    }

    fn query(&mut self, env: &Envelope, tenant: &str, subject: &str) -> Result<Envelope, EngineError> {
        self.clock.advance(5_000);
        self.n += 1;
        let mut call =
            with_call(DispatchRequest::default(), self.n).call.unwrap_or_else(crate::engine::fresh_call_identity);
        call.call_id = format!("call_demo_q{:03}", self.n);
        self.engine.query_operation_status(&QueryRequest {
            tenant: tenant.into(),
            subject: subject.into(),
            status_ref: env.status_ref().unwrap_or_default().to_string(),
            expected_request_sha256: env.protected_audit.binding.request_sha256.clone().unwrap_or_default(),
            idempotency_key: None,
            call: Some(call),
            operator: None,
        })
    }
}

/// Generates the demo database at `out` (which must not exist): the demo world and
/// operations in every state. Deterministic for a given seed.
pub fn generate(out: &Path, seed: u64) -> Result<(), EngineError> {
    let postgres = Location::is_postgres(out);
    if postgres {
        // A PostgreSQL database is given, not made: it must hold no ledger yet.
        if Store::open_read_only(out).is_ok() {
            return Err(EngineError::invalid(
                "OUT_EXISTS",
                "the PostgreSQL database already holds a ledger; give an empty database",
            ));
        }
    } else if out.exists() {
        return Err(EngineError::invalid("OUT_EXISTS", "the output file already exists; remove it first"));
    }
    let clock = ManualClock::new(DEMO_T0);
    let opts = EngineOptions {
        clock: Arc::new(clock.clone()),
        worker_id: "demo-worker".into(),
        seed: Some(seed),
        ..crate::tools::demo_options()
    };
    let mut engine = Engine::create(out, opts)?;
    engine.load_world(&World::parse(DEMO_WORLD.as_bytes())?)?;
    let mut g = Gen { engine, clock, n: 0 };

    // succeeded, then a replay (same key, new call id), then a conflict (same key, other amount).
    g.run(refund("acme", "agent_ana", "ord_1001", 2500, "EUR", "demo-refund-0001"), "ok")?;
    g.run(refund("acme", "agent_ana", "ord_1001", 2500, "EUR", "demo-refund-0001"), "ok")?;
    g.run(refund("acme", "agent_ana", "ord_1001", 9900, "EUR", "demo-refund-0001"), "ok")?;
    g.run(refund("globex", "agent_gus", "ord_3001", 1200, "GBP", "demo-refund-0002"), "ok")?;
    // Retried after a 429 within the deadline: one effect.
    g.run(refund("acme", "agent_ben", "ord_2001", 900, "EUR", "demo-refund-0003"), "rate_limit(1500),ok")?;
    // Definitively refused downstream.
    g.run(refund("globex", "agent_gus", "ord_3002", 700, "GBP", "demo-refund-0004"), "reject(account_closed)")?;
    // Unknown, receipt available: a status query will reconcile it.
    g.run(refund("acme", "agent_ana", "ord_1004", 1000, "EUR", "demo-refund-0005"), "timeout_after_commit")?;
    // Unknown, receipt not yet available (the provider shows it an hour later).
    let delayed =
        g.run(refund("acme", "agent_ana", "ord_1001", 1500, "EUR", "demo-refund-0006"), "receipt_delay(3600000)")?;
    g.query(&delayed, "acme", "agent_ana")?;
    // Unknown, mismatching receipt (provider drift), not queried yet.
    g.run(refund("globex", "agent_gus", "ord_3001", 800, "GBP", "demo-refund-0007"), "mismatch_after_commit")?;
    // Needs review: a mismatching receipt that a query already found.
    let drift =
        g.run(refund("acme", "agent_ben", "ord_2001", 400, "EUR", "demo-refund-0008"), "mismatch_after_commit")?;
    g.query(&drift, "acme", "agent_ben")?;
    // Resolved by a human: no reply, no receipt, the provider confirmed nothing happened.
    let lost =
        g.run(refund("acme", "agent_ana", "ord_1004", 300, "EUR", "demo-refund-0009"), "timeout_before_commit")?;
    g.query(&lost, "acme", "agent_ana")?;
    // Past the receipt window (attempt timeout + receipt_visible_within_ms):
    // before it, "no record" proves nothing and failed is refused.
    g.clock.advance(66_000);
    if let Some(op) = lost.protected_audit.operation_id.clone() {
        let out = g.engine.resolve(&ResolveRequest {
            operation_id: op,
            resolution: Resolution::Failed,
            operator: "oncall-kim".into(),
            note: "provider support confirmed no refund was created".into(),
            evidence: None,
            seen_version: None,
            action_id: Some("demo-action-1".into()),
            no_evidence: false,
        })?;
        if !out.applied {
            return Err(EngineError::invalid("DEMO_STEP_REFUSED", format!("the demo's resolution: {}", out.message)));
        }
    }
    // Waiting to retry: Retry-After beyond the deadline.
    let mut waiting = refund("acme", "agent_ana", "ord_1001", 700, "EUR", "demo-refund-0010");
    waiting.deadline_ms = Some(2_000);
    g.run(waiting, "rate_limit(45000)")?;
    // A notification approved and sent, whose reply was lost (no de-duplication downstream).
    let note = DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "notify_customer".into(),
        arguments: br#"{"order_ref":"ord_1001","template":"refund_issued"}"#.to_vec(),
        idempotency_key: Some("demo-notify-0001".into()),
        ..DispatchRequest::default()
    };
    let asked = g.run(note, "ok")?;
    if let Some(id) = asked.protected_audit.approval_id.clone() {
        g.clock.advance(30_000);
        g.engine.set_faults(FaultPlan::parse("timeout_after_commit").unwrap_or_default());
        g.engine.approve(&id, "bob")?;
        g.engine.set_faults(FaultPlan::none());
    }
    // Pending approvals: a large refund and a notification, with live countdowns.
    g.run(refund("acme", "agent_ana", "ord_1002", 120_000, "EUR", "demo-refund-0011"), "ok")?;
    let note2 = DispatchRequest {
        tenant: "globex".into(),
        subject: "agent_gus".into(),
        tool: "notify_customer".into(),
        arguments: br#"{"order_ref":"ord_3001","template":"refund_delayed"}"#.to_vec(),
        idempotency_key: Some("demo-notify-0002".into()),
        ..DispatchRequest::default()
    };
    g.run(note2, "ok")?;
    // A denied approval.
    let denied = g.run(refund("acme", "agent_ana", "ord_1002", 90_000, "EUR", "demo-refund-0012"), "ok")?;
    if let Some(id) = denied.protected_audit.approval_id.clone() {
        g.clock.advance(20_000);
        g.engine.deny(&id, "alice", "amount does not match the damage report")?;
    }
    g.engine.mark_demo(g.clock.now_ms())?;
    drop(g);
    if !postgres {
        // Fold the WAL into the main file so the committed file is self-contained.
        let mut store = Store::open(out, OpenOptions { create: false, sync: Sync::Full })?;
        store.checkpoint()?;
    }
    Ok(())
}

/// Writes a working copy of the committed demo database into `dir`, with every
/// timestamp re-based so the newest event is `now_ms`. The committed file is
/// never opened for writing.
pub fn working_copy(dir: &Path, now_ms: i64) -> Result<PathBuf, EngineError> {
    working_copy_at(&dir.join("demo.db"), now_ms)
}

/// [`working_copy`] at a path of the caller's choosing (which must not exist).
/// On PostgreSQL (`path` is a URL of an empty database) the demo is generated
/// there with the committed file's seed: the same operations in every state.
pub fn working_copy_at(path: &Path, now_ms: i64) -> Result<PathBuf, EngineError> {
    let path = path.to_path_buf();
    if Location::is_postgres(&path) {
        generate(&path, DEMO_SEED)?;
    } else {
        if path.exists() {
            return Err(EngineError::invalid("OUT_EXISTS", "the output file already exists; remove it first"));
        }
        std::fs::write(&path, DEMO_DB).map_err(|e| {
            EngineError::invalid("DEMO_COPY_FAILED", format!("cannot write the working copy: {}", e.kind()))
        })?;
    }
    let mut store = Store::open(&path, OpenOptions { create: false, sync: Sync::Normal })?;
    store.write(|tx| -> Result<(), StoreError> {
        let until = tx.meta("demo_generated_until")?.and_then(|v| v.parse::<i64>().ok()).unwrap_or(DEMO_T0);
        tx.rebase_times(now_ms - until)?;
        tx.meta_set("working_copy", "1")
    })?;
    Ok(path)
}
