//! Simulated agents: threads that dispatch refunds the way a real harness does
//! (a stable key per intent, a retry with the same key after `retry_after`, an
//! explicit status query after `OUTCOME_UNKNOWN`, now and then a conflicting
//! re-send), against a shared database, with a few injected faults.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::downstream::FaultPlan;
use crate::engine::envelope::{Code, Envelope};
use crate::engine::{DispatchRequest, Engine, EngineOptions, QueryRequest};

/// Running agents.
pub struct Agents {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Calls made so far.
    pub calls: Arc<AtomicU64>,
}

impl Agents {
    /// Stops the agents and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// The demo world's refundable orders: (tenant, subject, order, currency).
const ORDERS: [(&str, &str, &str, &str); 4] = [
    ("acme", "agent_ana", "ord_1002", "EUR"),
    ("acme", "agent_ana", "ord_1004", "EUR"),
    ("acme", "agent_ben", "ord_2001", "EUR"),
    ("globex", "agent_gus", "ord_3001", "GBP"),
];

/// Starts `n` agents on the database, pacing roughly one call per agent a second.
pub fn spawn_agents(path: &Path, n: usize) -> Agents {
    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let threads = (0..n)
        .map(|i| {
            let path = path.to_path_buf();
            let stop = stop.clone();
            let calls = calls.clone();
            std::thread::spawn(move || {
                let Ok(mut engine) =
                    Engine::open(&path, EngineOptions { worker_id: format!("agent-{i}"), ..EngineOptions::default() })
                else {
                    return;
                };
                let mut rng = StdRng::from_entropy();
                while !stop.load(Ordering::SeqCst) {
                    one_intent(&mut engine, &mut rng, i, &stop);
                    calls.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(rng.gen_range(600..1600)));
                }
            })
        })
        .collect();
    Agents { stop, threads, calls }
}

fn one_intent(engine: &mut Engine, rng: &mut StdRng, agent: usize, stop: &AtomicBool) {
    let (tenant, subject, order, currency) = ORDERS[rng.gen_range(0..ORDERS.len())];
    let amount = rng.gen_range(1..=30) * 10;
    let key = format!("agent{agent}-{}", hex::encode(rng.gen::<[u8; 6]>()));
    let req = DispatchRequest {
        tenant: tenant.into(),
        subject: subject.into(),
        tool: "create_refund".into(),
        arguments: format!(
            r#"{{"order_ref":"{order}","amount_minor":{amount},"currency":"{currency}","reason":"duplicate"}}"#
        )
        .into_bytes(),
        idempotency_key: Some(key),
        ..DispatchRequest::default()
    };
    let fault = match rng.gen_range(0..100) {
        0..=3 => "timeout_after_commit",
        4..=6 => "rate_limit(800),ok",
        7 => "connect_timeout,ok",
        8 => "receipt_delay(20000)",
        _ => "ok",
    };
    engine.set_faults(FaultPlan::parse(fault).unwrap_or_default());
    let Ok(env) = engine.dispatch(&req) else { return };
    engine.set_faults(FaultPlan::none());
    // A model that retries with the same key (a new call id): a replay, never a second effect.
    if rng.gen_bool(0.3) {
        let _ = engine.dispatch(&req);
    }
    // Now and then a confused model re-sends the key with another amount: a conflict.
    if rng.gen_bool(0.05) {
        let mut other = req.clone();
        other.arguments =
            String::from_utf8_lossy(&req.arguments).replace("amount_minor\":", "amount_minor\":1").into_bytes();
        let _ = engine.dispatch(&other);
    }
    if env.code() == Some(Code::OutcomeUnknown) && rng.gen_bool(0.5) && !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(rng.gen_range(2000..5000)));
        let _ = query(engine, &req, &env);
    }
}

fn query(engine: &mut Engine, req: &DispatchRequest, env: &Envelope) -> Option<Envelope> {
    engine
        .query_operation_status(&QueryRequest {
            tenant: req.tenant.clone(),
            subject: req.subject.clone(),
            status_ref: env.status_ref()?.to_string(),
            expected_request_sha256: env.protected_audit.binding.request_sha256.clone()?,
            ..QueryRequest::default()
        })
        .ok()
}
