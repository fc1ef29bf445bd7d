//! The load generator (docs/design.md §14): simulated agents that behave like real
//! harnesses, against a shared database. `toolgate load` runs a fixed number of
//! intents flat out and prints a table; `toolgate demo` runs a few paced agents
//! for ever while the console is open.
//!
//! Each agent talks to two dispatcher replicas (two [`Engine`]s with their own
//! connections, as behind a load balancer: any call may land on either), and one
//! background worker per run polls the outbox (due retries, the reaper). An
//! agent carries business intents through the way a careful harness does:
//! - one caller-generated idempotency key per intent, kept across every retry;
//! - `APPROVAL_REQUIRED` → a human on the tenant's allowlist approves at once;
//! - a `retry_after` code → wait `retry_after_ms`, retry with the same key;
//! - `OUTCOME_UNKNOWN` → wait, then `query_operation_status`, a few times;
//! - now and then the model replays a finished call (same key, new call id) or
//!   re-sends the key with another amount (a conflicting intent);
//! - now and then its dispatchers restart (new processes: nothing in memory).
//!
//! The agents read two controls from the database before every intent, so a
//! console (or another process) can change them live: the fault rate their
//! simulated providers inject, and, on a demo database, the lab toggle that
//! switches one defense off ([`LabToggle`]). With `error_codes_dropped` the
//! harness itself degrades: it only sees "error", retries blindly, then believes
//! the call failed.
//!
//! The referee counts what went wrong: duplicate effects per intent (the
//! ledger's own counter), and silently wrong results: a conflicting re-send
//! answered `succeeded`, a replay that returns another result than the first
//! call, an intent its harness believes failed while the provider has its effect.

mod http;

pub use http::HttpDoor;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toolgate_core::Coded;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::Value;

use crate::downstream::FaultPlan;
use crate::engine::canonical::CallIdentity;
use crate::engine::clock::{Clock, SystemClock};
use crate::engine::envelope::{Code, Envelope, Status};
use crate::engine::tool::Toolset;
use crate::engine::{DispatchRequest, Engine, EngineError, EngineOptions, LabToggle, QueryRequest};
use crate::store::Scope;
use crate::store::{ProviderStore, StoreError, Sync};

/// How to run the agents.
#[derive(Clone)]
pub struct LoadOptions {
    /// Agents (threads, each with its own dispatcher).
    pub agents: usize,
    /// Intents to carry out in total; 0 runs until stopped.
    pub ops: u64,
    /// Set the database's fault rate (basis points: 500 = 5%) for the run.
    pub fault_bp: Option<u32>,
    /// Seed of the agents' choices and faults.
    pub seed: u64,
    /// Switch this defense off for the run (demo databases only), back on after.
    pub lab: Option<LabToggle>,
    /// Who switched it (operator log).
    pub operator: String,
    /// The clock (a manual clock makes every wait instant).
    pub clock: Arc<dyn Clock>,
    /// Durability of the agents' dispatchers (FULL, as in production, by default).
    pub sync: Sync,
    /// Think time between an agent's intents, in ms (none: flat out).
    pub pace_ms: Option<(u64, u64)>,
    /// Percent of finished intents the model replays (same key, new call id).
    pub replay_percent: u32,
    /// Percent of refunds re-sent with the same key and another amount.
    pub conflict_percent: u32,
    /// Percent of intents after which the agent's dispatcher restarts.
    pub restart_percent: u32,
    /// Percent of intents that are customer notifications (the rest: refunds).
    pub notify_percent: u32,
    /// Before the referee's final count, run a worker's passes (the reaper,
    /// the outbox, the status queries of `auto_query` tools) every half second
    /// for this long (on the clock), so retries still queued and unknown
    /// outcomes whose query met a fault get their chance.
    pub settle_ms: u64,
    /// A background outbox worker (reaper + due retries) polls this often, in
    /// wall-clock ms, as a dispatcher deployment's worker loop does. None: no
    /// background worker (the final settle still runs the outbox).
    pub worker_interval_ms: Option<u64>,
    /// The tools (catalog, domains, adapters) the agents' dispatchers use.
    pub toolset: Arc<Toolset>,
    /// Where the referee counts effects when the providers run in another
    /// process (`toolgate provider serve --provider-db PATH`): that database,
    /// read-only. None: the simulated providers' tables beside the ledger.
    pub provider_db: Option<PathBuf>,
    /// `toolgate serve` replicas on the same ledger (`--url`, each call to
    /// one of them at random): the agents go through the HTTP API with
    /// tokens the run mints, instead of through dispatchers of their own.
    /// Empty: in-process dispatchers.
    pub urls: Vec<String>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("agents", &self.agents)
            .field("ops", &self.ops)
            .field("seed", &self.seed)
            .field("lab", &self.lab)
            .finish_non_exhaustive()
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            agents: 4,
            ops: 1_000,
            fault_bp: None,
            seed: 1,
            lab: None,
            operator: "loadgen".into(),
            clock: Arc::new(SystemClock),
            sync: Sync::Full,
            pace_ms: None,
            replay_percent: 15,
            conflict_percent: 3,
            restart_percent: 2,
            notify_percent: 10,
            settle_ms: 0,
            worker_interval_ms: Some(250),
            toolset: crate::tools::demo_toolset(),
            provider_db: None,
            urls: Vec::new(),
        }
    }
}

/// Live counters, shared with whoever watches (the console's lab panel).
#[derive(Debug, Default)]
pub struct LoadStats {
    /// Intents finished.
    pub intents: AtomicU64,
    /// Calls made (dispatch, query, approve).
    pub calls: AtomicU64,
    /// Conflicting re-sends answered `succeeded` (the second request silently dropped).
    pub masked_conflicts: AtomicU64,
    /// Replays whose result differs from the first call's.
    pub replay_mismatches: AtomicU64,
    /// Intents believed failed while their effect exists (checked when given up).
    pub wrong_beliefs: AtomicU64,
    /// Dispatcher restarts.
    pub restarts: AtomicU64,
    /// Calls that met the environment (a replica or the database gone) and
    /// were made again with the same key.
    pub transport_errors: AtomicU64,
}

impl LoadStats {
    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Silently wrong results so far.
    pub fn silently_wrong(&self) -> u64 {
        self.masked_conflicts.load(Ordering::Relaxed)
            + self.replay_mismatches.load(Ordering::Relaxed)
            + self.wrong_beliefs.load(Ordering::Relaxed)
    }
}

/// Where a run stands (for a progress bar).
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Intents finished.
    pub done: u64,
    /// Intents in the run.
    pub total: u64,
    /// Calls made.
    pub calls: u64,
    /// Wall time so far.
    pub elapsed: Duration,
}

/// Latency percentiles of the dispatch calls, in microseconds (wall time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Latency {
    /// Median.
    pub p50_us: u64,
    /// 95th percentile.
    pub p95_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Slowest.
    pub max_us: u64,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LoadReport {
    /// Agents.
    pub agents: usize,
    /// Intents carried out.
    pub ops: u64,
    /// Calls made (dispatch, query, approve).
    pub calls: u64,
    /// Every call's answer: `succeeded`, or its code.
    pub answers: BTreeMap<String, u64>,
    /// What each intent's harness ended up believing.
    pub beliefs: BTreeMap<String, u64>,
    /// Downstream effects committed during the run.
    pub effects: i64,
    /// Intents that got a second effect during the run (must be 0 with every defense on).
    pub duplicates: i64,
    /// Conflicting re-sends answered `succeeded`.
    pub masked_conflicts: u64,
    /// Replays that returned another result than the first call.
    pub replay_mismatches: u64,
    /// Intents believed failed whose effect exists (after the final settle).
    pub wrong_beliefs: u64,
    /// Orders the payments provider paid above their capture during the run.
    pub over_captured_orders: u64,
    /// Money paid above capture during the run, minor units (0 when all is well).
    pub over_captured: i64,
    /// The same, per order.
    pub over_captured_by_order: BTreeMap<String, i64>,
    /// The above: results that are wrong and look right (each order paid
    /// above its capture counts once).
    pub silently_wrong: u64,
    /// The run's operations by state at the end (after the settle): every
    /// `unknown` left is one nobody asked yet.
    pub final_states: BTreeMap<String, i64>,
    /// The run's operations parked for a person (`needs_review`), by tool
    /// and the code that says why (`create_refund STATUS_CONFLICT`).
    pub review_reasons: BTreeMap<String, u64>,
    /// The run's operations still `unknown` at the end, by tool and what
    /// their last status query answered (`notify_customer not_found`: the
    /// downstream has no receipt, which toolgate never takes for "no effect"
    /// by itself: a person resolves it), or `never asked`.
    pub unknown_reasons: BTreeMap<String, u64>,
    /// Dispatcher restarts.
    pub restarts: u64,
    /// Calls that could not reach their target (a killed replica, a
    /// restarting database) and were made again with the same key.
    pub transport_errors: u64,
    /// Dispatch latency.
    pub latency: Latency,
    /// Wall time of the run, ms.
    pub elapsed_ms: u64,
    /// Fault rate in force at the end, basis points.
    pub fault_bp: u32,
    /// The defense that was off, if any.
    pub lab: Option<LabToggle>,
    /// Seed.
    pub seed: u64,
}

/// Running agents (the console demo).
pub struct Agents {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<Result<Tally, EngineError>>>,
    worker: Option<std::thread::JoinHandle<Result<(), EngineError>>>,
    /// Live counters.
    pub stats: Arc<LoadStats>,
}

impl Agents {
    /// Stops the agents and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            let _ = t.join();
        }
        if let Some(w) = self.worker {
            let _ = w.join();
        }
    }
}

/// A principal the agents act for: (tenant, subject, approver, orders, currency,
/// may notify). All from the demo world.
struct Principal {
    tenant: &'static str,
    subject: &'static str,
    approver: &'static str,
    orders: &'static [&'static str],
    currency: &'static str,
    notify: bool,
}

const PRINCIPALS: [Principal; 3] = [
    Principal {
        tenant: "acme",
        subject: "agent_ana",
        approver: "alice",
        orders: &["ord_1001", "ord_1002", "ord_1004"],
        currency: "EUR",
        notify: true,
    },
    Principal {
        tenant: "acme",
        subject: "agent_ben",
        approver: "bob",
        orders: &["ord_2001"],
        currency: "EUR",
        notify: false,
    },
    Principal {
        tenant: "globex",
        subject: "agent_gus",
        approver: "gina",
        orders: &["ord_3001", "ord_3002"],
        currency: "GBP",
        notify: true,
    },
];

const TEMPLATES: [&str; 3] = ["refund_issued", "refund_delayed", "order_update"];

/// What an intent's harness ends up believing.
#[derive(Debug, Clone, PartialEq)]
enum Belief {
    Succeeded,
    Failed,
    Unknown,
    Pending,
    Review,
}

impl Belief {
    fn label(&self) -> &'static str {
        match self {
            Belief::Succeeded => "succeeded",
            Belief::Failed => "failed",
            Belief::Unknown => "unknown (left for an operator)",
            Belief::Pending => "pending retry",
            Belief::Review => "needs review",
        }
    }
}

/// How the harness reads an envelope.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Succeeded(Option<Value>),
    Approval(String),
    Retry(u64),
    Unknown {
        status_ref: String,
        sha: String,
    },
    Review,
    Failed,
    /// Lab `error_codes_dropped`: an error, and nothing else.
    Error,
}

fn seen(env: &Envelope, codes_dropped: bool) -> Seen {
    let m = &env.model_result;
    if m.status == Status::Succeeded {
        return Seen::Succeeded(m.data.clone());
    }
    if codes_dropped {
        return Seen::Error;
    }
    let Some(err) = &m.error else { return Seen::Failed };
    match err.code {
        Code::ApprovalRequired => env.protected_audit.approval_id.clone().map_or(Seen::Failed, Seen::Approval),
        c if c.retryable() => Seen::Retry(err.retry_after_ms.unwrap_or(100)),
        Code::OutcomeUnknown => match (env.status_ref(), &env.protected_audit.binding.request_sha256) {
            (Some(r), Some(s)) => Seen::Unknown { status_ref: r.to_string(), sha: s.clone() },
            _ => Seen::Review,
        },
        Code::StatusConflict | Code::OutputContractViolation => Seen::Review,
        _ if m.status == Status::Unknown => Seen::Review,
        _ => Seen::Failed,
    }
}

/// One agent's own numbers, merged at the end.
#[derive(Debug, Default)]
struct Tally {
    answers: BTreeMap<String, u64>,
    beliefs: BTreeMap<String, u64>,
    latencies_us: Vec<u64>,
    /// Intents believed failed: (tenant, subject, tool, key), re-checked after the settle.
    believed_failed: Vec<(String, String, String, String)>,
}

struct Shared {
    path: PathBuf,
    opts: LoadOptions,
    /// The API replicas and the run's tokens (`--url`), or in-process dispatchers.
    door: Option<http::HttpDoor>,
    tokens: Option<http::RunTokens>,
    run_id: String,
    next: AtomicU64,
    stop: Arc<AtomicBool>,
    stats: Arc<LoadStats>,
}

/// Dispatcher replicas per agent.
const REPLICAS: usize = 2;

struct Agent<'a> {
    shared: &'a Shared,
    n: usize,
    generation: u64,
    /// The dispatcher replicas; each call goes to one of them.
    replicas: Vec<Engine>,
    rng: StdRng,
    fault_bp: Option<u32>,
    codes_dropped: bool,
    calls: u64,
    tally: Tally,
}

fn mix(parts: &[u64]) -> u64 {
    // splitmix64 over the parts: distinct, well-spread seeds per agent and restart.
    parts.iter().fold(0x9E37_79B9_7F4A_7C15u64, |acc, p| {
        let mut z = acc ^ p.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

fn open_replicas(shared: &Shared, n: usize, generation: u64) -> Result<Vec<Engine>, EngineError> {
    // Over HTTP the replicas are the servers; one engine reads the controls and referees.
    let replicas = if shared.door.is_some() { 1 } else { REPLICAS };
    (0..replicas)
        .map(|r| {
            let seed = mix(&[shared.opts.seed, shared.opts.clock.now_ms() as u64, n as u64, generation, r as u64]);
            Engine::open(
                &shared.path,
                EngineOptions {
                    clock: shared.opts.clock.clone(),
                    worker_id: format!("agent-{n}-{generation}-r{r}"),
                    seed: Some(seed),
                    sync: shared.opts.sync,
                    ..EngineOptions::new(shared.opts.toolset.clone())
                },
            )
        })
        .collect()
}

impl Agent<'_> {
    fn run(mut self) -> Result<Tally, EngineError> {
        let ops = self.shared.opts.ops;
        while !self.shared.stop.load(Ordering::SeqCst) {
            let i = self.shared.next.fetch_add(1, Ordering::SeqCst);
            if ops > 0 && i >= ops {
                break;
            }
            self.controls()?;
            self.intent(i)?;
            LoadStats::bump(&self.shared.stats.intents);
            if let Some((lo, hi)) = self.shared.opts.pace_ms {
                self.shared.opts.clock.sleep_ms(self.rng.gen_range(lo..=hi.max(lo)));
            }
        }
        Ok(self.tally)
    }

    /// Reads the live controls: the fault rate and the lab toggle.
    fn controls(&mut self) -> Result<(), EngineError> {
        let (toggle, bp) = self.replicas[0].lab_controls()?;
        self.codes_dropped = toggle == Some(LabToggle::ErrorCodesDropped);
        if self.shared.door.is_some() {
            // Over HTTP each call carries its own fault (see `fault_header`).
            self.fault_bp = Some(bp);
            return Ok(());
        }
        if self.fault_bp != Some(bp) {
            for (r, e) in self.replicas.iter().enumerate() {
                let seed = mix(&[self.shared.opts.seed, self.n as u64, self.generation, u64::from(bp), r as u64, 7]);
                let plan = if bp == 0 {
                    FaultPlan::none()
                } else {
                    FaultPlan::parse(&format!("random({},seed={seed})", f64::from(bp.min(10_000)) / 10_000.0))
                        .unwrap_or_default()
                };
                e.set_faults(plan);
            }
            self.fault_bp = Some(bp);
        }
        Ok(())
    }

    /// The replica the next call goes to (the load balancer's pick).
    fn engine(&mut self) -> &mut Engine {
        let at = self.rng.gen_range(0..self.replicas.len());
        &mut self.replicas[at]
    }

    fn restart(&mut self) -> Result<(), EngineError> {
        self.generation += 1;
        self.replicas = open_replicas(self.shared, self.n, self.generation)?;
        self.fault_bp = None;
        LoadStats::bump(&self.shared.stats.restarts);
        self.controls()
    }

    fn call_identity(&mut self) -> CallIdentity {
        self.calls += 1;
        CallIdentity {
            provider: "loadgen".into(),
            api_family: "agents".into(),
            response_id: format!("resp_{}_{}_{}", self.shared.run_id, self.n, self.calls),
            call_id: format!("call_{}_{}_{}", self.shared.run_id, self.n, self.calls),
            adapter_revision: "1".into(),
        }
    }

    fn count(&mut self, env: &Envelope) {
        LoadStats::bump(&self.shared.stats.calls);
        let label = env.code().map_or_else(|| "succeeded".to_string(), |c| c.as_str().to_string());
        *self.tally.answers.entry(label).or_default() += 1;
    }

    /// Over HTTP: this call's fault, drawn at the run's rate with a seed of
    /// its own (a demo database honours `Toolgate-Fault`).
    fn fault_header(&mut self) -> Option<String> {
        let bp = self.fault_bp.filter(|bp| *bp > 0)?;
        let seed = mix(&[self.shared.opts.seed, self.n as u64, self.generation, self.calls, 13]);
        Some(format!("random({},seed={seed})", f64::from(bp.min(10_000)) / 10_000.0))
    }

    /// Over HTTP: the replica the next call goes to (the load balancer's pick).
    fn replica(&mut self) -> usize {
        let n = self.shared.opts.urls.len().max(1);
        self.rng.gen_range(0..n)
    }

    fn dispatch(&mut self, req: &DispatchRequest) -> Result<Seen, EngineError> {
        let mut req = req.clone();
        req.call = Some(self.call_identity());
        let t0 = Instant::now();
        let env = if self.shared.door.is_some() {
            let (at, fault) = (self.replica(), self.fault_header());
            self.shared.door.as_ref().map_or_else(|| Err(http_missing()), |d| d.dispatch(at, &req, fault))?
        } else {
            self.engine().dispatch(&req)?
        };
        self.tally.latencies_us.push(t0.elapsed().as_micros() as u64);
        self.count(&env);
        Ok(seen(&env, self.codes_dropped))
    }

    fn approve(&mut self, approval_id: &str, approver: &str) -> Result<Seen, EngineError> {
        let env = if self.shared.door.is_some() {
            let at = self.replica();
            self.shared.door.as_ref().map_or_else(|| Err(http_missing()), |d| d.approve(at, approval_id, approver))?
        } else {
            self.engine().approve(approval_id, approver)?
        };
        self.count(&env);
        Ok(seen(&env, self.codes_dropped))
    }

    fn query(&mut self, p: &Principal, status_ref: &str, sha: &str) -> Result<Seen, EngineError> {
        let call = self.call_identity();
        let q = QueryRequest {
            tenant: p.tenant.into(),
            subject: p.subject.into(),
            status_ref: status_ref.into(),
            expected_request_sha256: sha.into(),
            call: Some(call),
            ..QueryRequest::default()
        };
        let env = if self.shared.door.is_some() {
            let at = self.replica();
            self.shared.door.as_ref().map_or_else(|| Err(http_missing()), |d| d.query(at, &q))?
        } else {
            self.engine().query_operation_status(&q)?
        };
        self.count(&env);
        Ok(seen(&env, self.codes_dropped))
    }

    fn sleep(&self, ms: u64) {
        self.shared.opts.clock.sleep_ms(ms);
    }

    /// Carries one intent through, like a careful harness (or, with
    /// `error_codes_dropped`, like one that only sees "error").
    /// A careful harness survives its target's faults: a call that could not
    /// reach a replica or the database is made again, with the same key, until
    /// it gets through (bounded: [`SURVIVE_FOR`]); the report counts them.
    fn survive<T>(&mut self, mut call: impl FnMut(&mut Self) -> Result<T, EngineError>) -> Result<T, EngineError> {
        let started = Instant::now();
        loop {
            match call(self) {
                Err(e) if is_transport(&e) && started.elapsed() < SURVIVE_FOR => {
                    LoadStats::bump(&self.shared.stats.transport_errors);
                    // Real time, whatever the run's clock: the target has to come back.
                    std::thread::sleep(Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }

    fn drive(&mut self, p: &Principal, req: &DispatchRequest) -> Result<(Belief, Option<Value>), EngineError> {
        let mut answer = self.survive(|s| s.dispatch(req))?;
        let (mut retries, mut queries, mut approved) = (0u32, 0u32, false);
        loop {
            answer = match answer {
                Seen::Succeeded(data) => return Ok((Belief::Succeeded, data)),
                Seen::Approval(id) if !approved => {
                    // A human on the tenant's allowlist approves at once.
                    approved = true;
                    self.survive(|s| s.approve(&id, p.approver))?
                }
                Seen::Retry(ms) if retries < 6 => {
                    retries += 1;
                    self.sleep(ms.max(10));
                    self.survive(|s| s.dispatch(req))?
                }
                // Still queued: the outbox (or a later call) runs it.
                Seen::Retry(_) => return Ok((Belief::Pending, None)),
                Seen::Unknown { status_ref, sha } if queries < 3 => {
                    self.sleep(500 << queries);
                    queries += 1;
                    self.survive(|s| s.query(p, &status_ref, &sha))?
                }
                Seen::Unknown { .. } => return Ok((Belief::Unknown, None)),
                Seen::Review => return Ok((Belief::Review, None)),
                // No code: the harness cannot know whether to wait, query or stop,
                // so it retries blindly a few times, then believes it failed.
                Seen::Error if retries < 3 => {
                    retries += 1;
                    self.sleep(100);
                    self.survive(|s| s.dispatch(req))?
                }
                Seen::Approval(_) | Seen::Failed | Seen::Error => return Ok((Belief::Failed, None)),
            };
        }
    }

    fn intent(&mut self, i: u64) -> Result<(), EngineError> {
        let opts = &self.shared.opts;
        let p = &PRINCIPALS[self.rng.gen_range(0..PRINCIPALS.len())];
        let order = p.orders[self.rng.gen_range(0..p.orders.len())];
        let notify = p.notify && self.rng.gen_ratio(opts.notify_percent.min(100), 100);
        let key = format!("load-{}-{i:06}", self.shared.run_id);
        let (tool, args) = if notify {
            let template = TEMPLATES[self.rng.gen_range(0..TEMPLATES.len())];
            ("notify_customer", format!(r#"{{"order_ref":"{order}","template":"{template}"}}"#))
        } else {
            // Small amounts: thousands of refunds fit in the demo world's orders.
            let amount = self.rng.gen_range(1..=5);
            let args = format!(
                r#"{{"order_ref":"{order}","amount_minor":{amount},"currency":"{}","reason":"duplicate"}}"#,
                p.currency
            );
            ("create_refund", args)
        };
        let req = DispatchRequest {
            tenant: p.tenant.into(),
            subject: p.subject.into(),
            tool: tool.into(),
            arguments: args.clone().into_bytes(),
            idempotency_key: Some(key.clone()),
            ..DispatchRequest::default()
        };
        let (belief, data) = self.drive(p, &req)?;
        *self.tally.beliefs.entry(belief.label().to_string()).or_default() += 1;
        if belief == Belief::Failed {
            // The referee peeks: did the provider do it anyway?
            let provider_db = self.shared.opts.provider_db.clone();
            let found = self.survive(|s| {
                effects_for_intent(
                    &mut s.replicas[0],
                    provider_db.as_deref(),
                    Scope::new(p.tenant, p.subject, tool, &key),
                )
            })?;
            if found > 0 {
                LoadStats::bump(&self.shared.stats.wrong_beliefs);
            }
            self.tally.believed_failed.push((p.tenant.into(), p.subject.into(), tool.into(), key.clone()));
        }
        let (replay, conflict, restart) = {
            let o = &self.shared.opts;
            (o.replay_percent.min(100), o.conflict_percent.min(100), o.restart_percent.min(100))
        };
        if self.rng.gen_ratio(restart, 100) {
            self.survive(Self::restart)?;
        }
        // The model replays the finished call: same key, same arguments, new call id.
        if belief == Belief::Succeeded && self.rng.gen_ratio(replay, 100) {
            if let Seen::Succeeded(again) = self.survive(|s| s.dispatch(&req))? {
                if again != data {
                    LoadStats::bump(&self.shared.stats.replay_mismatches);
                }
            }
        }
        // A confused model re-sends the key with another amount.
        if tool == "create_refund" && self.rng.gen_ratio(conflict, 100) {
            let mut other = req.clone();
            other.arguments = args.replacen("\"amount_minor\":", "\"amount_minor\":1", 1).into_bytes();
            if let Seen::Succeeded(d) = self.survive(|s| s.dispatch(&other))? {
                let asked = serde_json::from_str::<Value>(&String::from_utf8_lossy(&other.arguments))
                    .ok()
                    .and_then(|v| v.get("amount_minor").cloned());
                if d.as_ref().and_then(|d| d.get("amount_minor")).cloned() != asked {
                    LoadStats::bump(&self.shared.stats.masked_conflicts);
                }
            }
        }
        Ok(())
    }
}

/// How long a harness keeps making a call again while its target is away.
const SURVIVE_FOR: Duration = Duration::from_secs(60);

/// The target could not be reached (a killed replica, a restarting database):
/// the call may be made again with the same key.
fn is_transport(e: &EngineError) -> bool {
    matches!(e.code(), "LOAD_HTTP" | "DB_UNAVAILABLE" | "DB_OPEN_FAILED")
}

fn start(path: &Path, opts: &LoadOptions, stats: Arc<LoadStats>) -> Result<Arc<Shared>, EngineError> {
    let mut control = Engine::open(path, engine_options(opts))?;
    if let Some(toggle) = opts.lab {
        control.set_lab_toggle(Some(toggle), &opts.operator)?;
    }
    if let Some(bp) = opts.fault_bp {
        control.set_load_fault_rate(bp)?;
    }
    let run_id = format!("{:x}", mix(&[opts.seed, opts.clock.now_ms() as u64]) & 0xff_ffff_ffff);
    let (door, tokens) = if opts.urls.is_empty() {
        (None, None)
    } else {
        let who: Vec<(&str, &str, &str)> = PRINCIPALS.iter().map(|p| (p.tenant, p.subject, p.approver)).collect();
        let tokens = http::RunTokens::mint(&mut control, &who, &run_id)?;
        (Some(http::HttpDoor::new(&opts.urls, tokens.tokens.clone())), Some(tokens))
    };
    Ok(Arc::new(Shared {
        path: path.to_path_buf(),
        opts: opts.clone(),
        door,
        tokens,
        run_id,
        next: AtomicU64::new(0),
        stop: Arc::new(AtomicBool::new(false)),
        stats,
    }))
}

fn spawn_threads(
    shared: &Arc<Shared>,
) -> Result<Vec<std::thread::JoinHandle<Result<Tally, EngineError>>>, EngineError> {
    let mut threads = Vec::new();
    for n in 0..shared.opts.agents.max(1) {
        let replicas = open_replicas(shared, n, 0)?;
        let s = shared.clone();
        threads.push(std::thread::spawn(move || {
            let agent = Agent {
                shared: &s,
                n,
                generation: 0,
                replicas,
                rng: StdRng::seed_from_u64(mix(&[s.opts.seed, n as u64, 3])),
                fault_bp: None,
                codes_dropped: false,
                calls: 0,
                tally: Tally::default(),
            };
            agent.run()
        }));
    }
    Ok(threads)
}

/// The background outbox worker: reaps expired leases and runs due retries every
/// `interval`, with the agents' fault rate. It polls (like a deployment's worker
/// loop) rather than running after every call: a worker that runs constantly
/// claims operations their own dispatcher was about to send, and the caller then
/// sees them in flight (`OUTCOME_UNKNOWN`) for no reason.
fn spawn_worker(shared: &Arc<Shared>) -> Result<Option<std::thread::JoinHandle<Result<(), EngineError>>>, EngineError> {
    let Some(interval) = shared.opts.worker_interval_ms else { return Ok(None) };
    // Over HTTP the servers run their own outbox workers and reapers.
    if shared.door.is_some() {
        return Ok(None);
    }
    let mut engine = Engine::open(
        &shared.path,
        EngineOptions {
            clock: shared.opts.clock.clone(),
            worker_id: format!("loadgen-worker-{}", shared.run_id),
            sync: shared.opts.sync,
            ..EngineOptions::new(shared.opts.toolset.clone())
        },
    )?;
    let s = shared.clone();
    Ok(Some(std::thread::spawn(move || {
        let mut fault_bp = None;
        while !s.stop.load(Ordering::SeqCst) {
            let bp = engine.lab_controls()?.1;
            if fault_bp != Some(bp) {
                let seed = mix(&[s.opts.seed, u64::from(bp), 11]);
                let spec = format!("random({},seed={seed})", f64::from(bp.min(10_000)) / 10_000.0);
                engine.set_faults(if bp == 0 {
                    FaultPlan::none()
                } else {
                    FaultPlan::parse(&spec).unwrap_or_default()
                });
                fault_bp = Some(bp);
            }
            engine.reap()?;
            engine.work_background(256)?;
            // As `serve`'s worker: unknown outcomes of a downstream asked by
            // re-sending are settled without a person (downstream.auto_query).
            engine.settle_unknown(64)?;
            std::thread::sleep(Duration::from_millis(interval));
        }
        Ok(())
    })))
}

/// Starts `n` paced agents on the database for the console demo (about one
/// intent per agent a second, until stopped). A fault rate of 5% is set unless
/// one is already there.
pub fn spawn_agents(path: &Path, n: usize) -> Result<Agents, EngineError> {
    let opts = LoadOptions {
        agents: n,
        ops: 0,
        pace_ms: Some((600, 1600)),
        worker_interval_ms: Some(500),
        ..LoadOptions::default()
    };
    let mut control = Engine::open(path, crate::tools::demo_options())?;
    if control.lab_controls()?.1 == 0 {
        control.set_load_fault_rate(500)?;
    }
    let stats = Arc::new(LoadStats::default());
    let shared = start(path, &opts, stats.clone())?;
    let threads = spawn_threads(&shared)?;
    let worker = spawn_worker(&shared)?;
    Ok(Agents { stop: shared.stop.clone(), threads, worker, stats })
}

fn engine_options(opts: &LoadOptions) -> EngineOptions {
    EngineOptions { clock: opts.clock.clone(), sync: opts.sync, ..EngineOptions::new(opts.toolset.clone()) }
}

/// The referee's count: (effects, intents with more than one effect), where
/// the providers keep them.
fn effect_counts(referee: &mut Engine, provider_db: Option<&Path>) -> Result<(i64, i64), EngineError> {
    match provider_db {
        None => {
            let c = referee.counts()?;
            Ok((c.downstream_effects, c.side_effect_duplicates))
        }
        Some(p) => Ok(ProviderStore::open_read_only(p)?
            .read(|tx| -> Result<_, StoreError> { Ok((tx.count_effects()?, tx.side_effect_duplicates()?)) })?),
    }
}

/// Each order's capture and what was refunded of it when the run started,
/// beside what the payments provider has paid out for it so far.
struct Money {
    orders: BTreeMap<String, (i64, i64)>,
    paid: BTreeMap<String, i64>,
}

fn money(referee: &mut Engine, provider_db: Option<&Path>) -> Result<Money, EngineError> {
    let orders = crate::tools::demo::orders(referee)?
        .into_iter()
        .map(|o| (o.order_ref, (o.captured_minor, o.refunded_minor + o.over_refunded_minor)))
        .collect();
    let paid = match provider_db {
        None => referee.paid_by_order()?,
        Some(p) => ProviderStore::open_read_only(p)?.read(|tx| tx.paid_by_order("payments"))?,
    };
    Ok(Money { orders, paid })
}

/// The referee's money check: per order, what the provider paid during the
/// run beyond what the order had left when it started (minor units; only
/// orders paid above their capture are listed).
fn over_captured(before: &Money, after: &Money) -> BTreeMap<String, i64> {
    let mut over = BTreeMap::new();
    for (order, &(captured, refunded)) in &before.orders {
        let paid = after.paid.get(order).copied().unwrap_or(0) - before.paid.get(order).copied().unwrap_or(0);
        let above = refunded + paid - captured;
        if paid > 0 && above > 0 {
            over.insert(order.clone(), above.min(paid));
        }
    }
    over
}

/// Effects one intent has at its provider.
fn effects_for_intent(e: &mut Engine, provider_db: Option<&Path>, scope: Scope<'_>) -> Result<i64, EngineError> {
    match provider_db {
        None => e.effects_for_intent(scope),
        Some(p) => {
            let intent = crate::engine::intent_of(scope);
            Ok(ProviderStore::open_read_only(p)?.read(|tx| tx.count_effects_for_intent(&intent))?)
        }
    }
}

fn http_missing() -> EngineError {
    EngineError::invalid("LOAD_HTTP", "no API replicas configured")
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Runs `opts.ops` intents and reports. `progress` is called about ten times a
/// second while the agents run (and once at the end).
pub fn run(path: &Path, opts: &LoadOptions, progress: &mut dyn FnMut(Progress)) -> Result<LoadReport, EngineError> {
    let started = Instant::now();
    let mut referee = Engine::open(path, engine_options(opts))?;
    let states_before = referee.counts()?.operations;
    let run_started_at = opts.clock.now_ms();
    let before = effect_counts(&mut referee, opts.provider_db.as_deref())?;
    let money_before = money(&mut referee, opts.provider_db.as_deref())?;
    let stats = Arc::new(LoadStats::default());
    let shared = start(path, opts, stats.clone())?;
    let threads = spawn_threads(&shared)?;
    let worker = spawn_worker(&shared)?;
    let report = |done: u64| Progress {
        done,
        total: opts.ops,
        calls: stats.calls.load(Ordering::Relaxed),
        elapsed: started.elapsed(),
    };
    while !threads.iter().all(std::thread::JoinHandle::is_finished) {
        progress(report(stats.intents.load(Ordering::Relaxed)));
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut total = Tally::default();
    let mut first_error = None;
    for t in threads {
        match t.join() {
            Ok(Ok(tally)) => {
                for (k, v) in tally.answers {
                    *total.answers.entry(k).or_default() += v;
                }
                for (k, v) in tally.beliefs {
                    *total.beliefs.entry(k).or_default() += v;
                }
                total.latencies_us.extend(tally.latencies_us);
                total.believed_failed.extend(tally.believed_failed);
            }
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(EngineError::invalid("LOAD_AGENT_PANICKED", "a load agent panicked"));
            }
        }
    }
    progress(report(stats.intents.load(Ordering::Relaxed)));
    shared.stop.store(true, Ordering::SeqCst);
    if let Some(w) = worker {
        match w.join() {
            Ok(Err(e)) => {
                first_error.get_or_insert(e);
            }
            Err(_) => {
                first_error.get_or_insert(EngineError::invalid("LOAD_AGENT_PANICKED", "the load worker panicked"));
            }
            Ok(Ok(())) => {}
        }
    }
    // Settle: let queued retries run, then count.
    // A worker's passes for settle_ms (every half second, and one at its end):
    // an unknown outcome whose status query met a fault is asked again.
    if opts.settle_ms > 0 {
        let until = opts.clock.now_ms().saturating_add(opts.settle_ms as i64);
        loop {
            let left = until - opts.clock.now_ms();
            opts.clock.sleep_ms(u64::try_from(left.clamp(0, 500)).unwrap_or(0));
            referee.reap()?;
            referee.work(100_000)?;
            referee.settle_unknown(100_000)?;
            if opts.clock.now_ms() >= until {
                break;
            }
        }
    }
    let mut wrong_beliefs = 0;
    for (tenant, subject, tool, key) in &total.believed_failed {
        if effects_for_intent(&mut referee, opts.provider_db.as_deref(), Scope::new(tenant, subject, tool, key))? > 0 {
            wrong_beliefs += 1;
        }
    }
    let after = effect_counts(&mut referee, opts.provider_db.as_deref())?;
    let mut final_states = referee.counts()?.operations;
    for (state, n) in &states_before {
        *final_states.entry(state.clone()).or_default() -= n;
    }
    final_states.retain(|_, n| *n != 0);
    let mut review_reasons = BTreeMap::new();
    for op in referee.list_operations(Some(crate::store::OpState::NeedsReview), 1_000_000)? {
        if op.created_at >= run_started_at {
            let why = op.code.unwrap_or_else(|| "-".into());
            *review_reasons.entry(format!("{} {why}", op.tool)).or_default() += 1;
        }
    }
    let mut unknown_reasons = BTreeMap::new();
    for op in referee.list_operations(Some(crate::store::OpState::Unknown), 1_000_000)? {
        if op.created_at >= run_started_at {
            let why = op.last_query_result.unwrap_or_else(|| "never asked".into());
            *unknown_reasons.entry(format!("{} {why}", op.tool)).or_default() += 1;
        }
    }
    let over_captured = over_captured(&money_before, &money(&mut referee, opts.provider_db.as_deref())?);
    let fault_bp = referee.lab_controls()?.1;
    if let Some(t) = &shared.tokens {
        t.revoke(&mut referee)?;
    }
    if opts.lab.is_some() {
        referee.set_lab_toggle(None, &opts.operator)?;
    }
    if let Some(e) = first_error {
        return Err(e);
    }
    total.latencies_us.sort_unstable();
    let l = &total.latencies_us;
    let masked = stats.masked_conflicts.load(Ordering::Relaxed);
    let mismatches = stats.replay_mismatches.load(Ordering::Relaxed);
    Ok(LoadReport {
        agents: opts.agents.max(1),
        ops: stats.intents.load(Ordering::Relaxed),
        calls: stats.calls.load(Ordering::Relaxed),
        answers: total.answers,
        beliefs: total.beliefs,
        effects: after.0 - before.0,
        duplicates: after.1 - before.1,
        masked_conflicts: masked,
        replay_mismatches: mismatches,
        wrong_beliefs,
        over_captured_orders: over_captured.len() as u64,
        over_captured: over_captured.values().sum(),
        silently_wrong: masked + mismatches + wrong_beliefs + over_captured.len() as u64,
        over_captured_by_order: over_captured,
        final_states,
        review_reasons,
        unknown_reasons,
        restarts: stats.restarts.load(Ordering::Relaxed),
        transport_errors: stats.transport_errors.load(Ordering::Relaxed),
        latency: Latency {
            p50_us: percentile(l, 50.0),
            p95_us: percentile(l, 95.0),
            p99_us: percentile(l, 99.0),
            max_us: l.last().copied().unwrap_or(0),
        },
        elapsed_ms: started.elapsed().as_millis() as u64,
        fault_bp,
        lab: opts.lab,
        seed: opts.seed,
    })
}

fn ms(us: u64) -> String {
    if us >= 10_000 {
        format!("{:.0} ms", us as f64 / 1000.0)
    } else {
        format!("{:.1} ms", us as f64 / 1000.0)
    }
}

/// The final table, for people.
pub fn render(r: &LoadReport) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let secs = (r.elapsed_ms as f64 / 1000.0).max(0.001);
    let _ = writeln!(
        s,
        "toolgate load: {} agents, {} ops, faults {:.1}%, seed {}{}",
        r.agents,
        r.ops,
        f64::from(r.fault_bp) / 100.0,
        r.seed,
        r.lab.map_or(String::new(), |t| format!(", LAB: {} (defense off)", t.as_str()))
    );
    let _ = writeln!(s, "  {:.1} s, {:.0} ops/s, {} calls\n", secs, r.ops as f64 / secs, r.calls);
    let _ = writeln!(s, "  {:<34} {:>8}", "answers (every call)", "count");
    for (k, v) in &r.answers {
        let _ = writeln!(s, "  {k:<34} {v:>8}");
    }
    let _ = writeln!(s, "\n  {:<34} {:>8}", "intents: what the harness believes", "count");
    for (k, v) in &r.beliefs {
        let _ = writeln!(s, "  {k:<34} {v:>8}");
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "  {:<34} {:>8}", "effects", r.effects);
    let _ = writeln!(s, "  {:<34} {:>8}", "duplicate effects", r.duplicates);
    let _ = writeln!(
        s,
        "  {:<34} {:>8}   (masked conflicts {}, replay mismatches {}, wrong beliefs {}, orders over capture {})",
        "silently wrong results",
        r.silently_wrong,
        r.masked_conflicts,
        r.replay_mismatches,
        r.wrong_beliefs,
        r.over_captured_orders
    );
    let _ = writeln!(
        s,
        "  {:<34} {:>8}   ({} orders paid above their capture)",
        "money paid above capture", r.over_captured, r.over_captured_orders
    );
    for (order, above) in &r.over_captured_by_order {
        let _ = writeln!(s, "    {order:<32} {above:>8}");
    }
    if !r.final_states.is_empty() {
        let _ = writeln!(s, "\n  {:<34} {:>8}", "operations at the end, by state", "count");
        for (k, v) in &r.final_states {
            let _ = writeln!(s, "  {k:<34} {v:>8}");
        }
        for (k, v) in &r.review_reasons {
            let _ = writeln!(s, "    {:<32} {v:>8}", format!("needs_review: {k}"));
        }
        for (k, v) in &r.unknown_reasons {
            let _ = writeln!(s, "    {:<32} {v:>8}", format!("unknown, last asked: {k}"));
        }
        let _ = writeln!(s);
    }
    let _ = writeln!(s, "  {:<34} {:>8}", "dispatcher restarts", r.restarts);
    let _ = writeln!(s, "  {:<34} {:>8}", "calls made again after a transport error", r.transport_errors);
    let _ = writeln!(
        s,
        "  {:<34} p50 {}  p95 {}  p99 {}  max {}",
        "dispatch latency",
        ms(r.latency.p50_us),
        ms(r.latency.p95_us),
        ms(r.latency.p99_us),
        ms(r.latency.max_us)
    );
    s
}

/// The progress bar line (no newline).
pub fn progress_line(p: &Progress) -> String {
    let width = 30usize;
    let frac = if p.total == 0 { 0.0 } else { (p.done as f64 / p.total as f64).min(1.0) };
    let filled = (frac * width as f64).round() as usize;
    let secs = p.elapsed.as_secs_f64().max(0.001);
    format!(
        "[{}{}] {}/{} ops  {:.0} ops/s  {} calls",
        "#".repeat(filled),
        ".".repeat(width - filled),
        p.done,
        p.total,
        p.done as f64 / secs,
        p.calls
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!((percentile(&v, 50.0), percentile(&v, 95.0), percentile(&v, 99.0)), (50, 95, 99));
        assert_eq!(percentile(&[], 50.0), 0);
        assert_eq!(percentile(&[7], 99.0), 7);
    }

    #[test]
    fn seeds_differ_per_agent_and_restart() {
        let a = mix(&[1, 0, 0]);
        assert_ne!(a, mix(&[1, 1, 0]));
        assert_ne!(a, mix(&[1, 0, 1]));
        assert_eq!(a, mix(&[1, 0, 0]));
    }

    #[test]
    fn the_harness_reads_codes_or_nothing() {
        let mut env =
            crate::engine::error_envelope(Code::RateLimit, crate::engine::envelope::ProtectedAudit::default());
        env = crate::engine::with_retry_after(env, 700);
        assert_eq!(seen(&env, false), Seen::Retry(700));
        assert_eq!(seen(&env, true), Seen::Error);
        let conflict = crate::engine::error_envelope(
            Code::IdempotencyConflict,
            crate::engine::envelope::ProtectedAudit::default(),
        );
        assert_eq!(seen(&conflict, false), Seen::Failed);
    }
}
