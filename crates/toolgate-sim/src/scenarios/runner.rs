//! The stepper: runs a [`Script`] against a fresh database, one step per call,
//! and reports what each step showed next to what the script expected.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use toolgate_core::Coded;

use serde::Serialize;
use serde_json::Value;

use super::gate::{ScenarioClock, Waited};
use super::script::{Action, Call, Evidence, Expectation, Relation, Script, Step, Transition};
use super::ScenarioError;
use crate::downstream::FaultPlan;
use crate::engine::canonical::CallIdentity;
use crate::engine::clock::{rfc3339, Clock};
use crate::engine::contracts::Contracts;
use crate::engine::envelope::{Code, Delivery, Envelope, Outcome, Recovery, Status};
use crate::engine::{DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest, ReapReport, ResolveRequest};
use crate::store::{OpenOptions, OperationRow, ProviderStore, Store, StoreError, Sync};

/// How long a background call or a crashing child may take before the step fails.
const WAIT_LIMIT: Duration = Duration::from_secs(30);

/// How a crash step crashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CrashMode {
    /// A real abort: this `toolgate` binary runs the call as `toolgate dispatch
    /// ... --fault crash_after_commit` and dies by SIGABRT after the provider
    /// committed (the CLI and the tests).
    ChildProcess(PathBuf),
    /// A simulation for the console, which cannot abort itself: the call runs
    /// with `timeout_after_commit` (committed, reply lost), its reply is dropped
    /// and the engine is closed. The ledger then says `unknown` where a real crash
    /// leaves `in_flight`; scripts state the difference in `in_process`.
    InProcess,
}

/// Options of one run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// How crash steps crash.
    pub crash_mode: CrashMode,
    /// Create the database here and leave it (it must not exist); a temporary
    /// directory, removed at the end, when absent.
    pub keep_db: Option<PathBuf>,
    /// The providers' tools behind a served provider instead of in process.
    pub http: Option<HttpProviders>,
}

/// A run whose downstream tools go over HTTP to `toolgate provider serve`:
/// the catalog that points there and the provider's database (where the
/// runner counts effects). A crash step then kills the child dispatcher after
/// the provider's reply arrived (failpoint `before_persist`), since
/// `crash_after_commit` would kill the provider.
#[derive(Debug, Clone)]
pub struct HttpProviders {
    /// A catalog directory (e.g. `assets/catalog-http` pointed at the server).
    pub catalog: PathBuf,
    /// The served provider's database.
    pub provider_db: PathBuf,
}

/// Which crash ran, for the screen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CrashKind {
    /// A child process really aborted.
    ChildProcess,
    /// Simulated inside this process.
    InProcess,
}

/// What a crash step did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CrashReport {
    /// Which mode ran.
    pub mode: CrashKind,
    /// For a child process: it died by SIGABRT (anything else fails the step).
    pub aborted: bool,
    /// One line for people.
    pub detail: String,
}

/// A field whose observed value differs from the script.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    /// The expectation field (`delivery`, `transition`...), or `action` when the
    /// step could not run.
    pub field: String,
    /// What the script says.
    pub expected: String,
    /// What happened.
    pub actual: String,
}

/// Everything one step showed, and whether it matched the script.
#[derive(Debug, Clone, Serialize)]
pub struct StepObservation {
    /// 1-based step number.
    pub step: usize,
    /// The action (`dispatch`, `query`...).
    pub action: &'static str,
    /// The action column's text.
    pub label: String,
    /// The script's sentence for the learner.
    pub explain: Option<String>,
    /// Clock offset from the scenario start after the step, in ms.
    pub at_ms: i64,
    /// The followed operation's state before → after.
    pub transition: Transition,
    /// The followed operation.
    pub operation_id: Option<String>,
    /// Error code, when the step returned an error.
    pub code: Option<Code>,
    /// Status the model sees.
    pub status: Option<Status>,
    /// Execution outcome.
    pub outcome: Option<Outcome>,
    /// Delivery.
    pub delivery: Option<Delivery>,
    /// Recovery.
    pub recovery: Option<Recovery>,
    /// Retryable.
    pub retryable: Option<bool>,
    /// Retry-after, when given.
    pub retry_after_ms: Option<u64>,
    /// The catalog message the model sees, for errors.
    pub message: Option<String>,
    /// What the user sees, as one short line.
    pub sees: String,
    /// Committed downstream effects in the database after the step.
    pub effects: i64,
    /// Effects this step added.
    pub new_effects: i64,
    /// Intents with more than one effect (must stay 0).
    pub duplicates: i64,
    /// Attempts recorded for the followed operation.
    pub attempts: Option<i64>,
    /// Trace events this step added to the followed operation.
    pub trace: Vec<String>,
    /// For deny and resolve: whether it was applied.
    pub applied: Option<bool>,
    /// For crash steps: which crash ran.
    pub crash: Option<CrashReport>,
    /// The whole envelope, when the step returned one.
    pub envelope: Option<Envelope>,
    /// Fields that differ from the script.
    pub failures: Vec<Mismatch>,
    /// No failures.
    pub passed: bool,
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioReport {
    /// Scenario number.
    pub id: u32,
    /// Slug.
    pub slug: String,
    /// Title.
    pub title: String,
    /// What it teaches.
    pub summary: String,
    /// Which crash mode was in force.
    pub crash_mode: CrashKind,
    /// The kept database, if any.
    pub kept_db: Option<PathBuf>,
    /// Steps in the script.
    pub total_steps: usize,
    /// One observation per step that ran.
    pub steps: Vec<StepObservation>,
    /// Every step ran and passed.
    pub passed: bool,
}

/// The idempotency scope an operation lives under.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Scope {
    tenant: String,
    subject: String,
    tool: String,
    key: String,
}

impl Scope {
    fn of(op: &OperationRow) -> Self {
        Self { tenant: op.tenant.clone(), subject: op.subject.clone(), tool: op.tool.clone(), key: op.idem_key.clone() }
    }
}

/// Why a step could not run (it then fails with `field` and stops the run).
#[derive(Debug)]
struct StepError {
    field: &'static str,
    message: String,
}

impl StepError {
    fn new(field: &'static str, message: impl Into<String>) -> Self {
        Self { field, message: message.into() }
    }
}

impl From<EngineError> for StepError {
    fn from(e: EngineError) -> Self {
        Self::new("engine", format!("{}: {e}", e.code()))
    }
}

impl From<StoreError> for StepError {
    fn from(e: StoreError) -> Self {
        Self::new("engine", format!("{}: {e}", e.code()))
    }
}

/// What executing an action produced.
#[derive(Default)]
struct Exec {
    envelope: Option<Envelope>,
    /// The line the user sees, when there is no envelope.
    sees: Option<String>,
    applied: Option<bool>,
    crash: Option<CrashReport>,
}

/// Where the database lives.
enum Home {
    /// A temporary directory, removed on drop.
    Temp(PathBuf),
    /// A path the caller keeps.
    Kept,
}

impl Drop for Home {
    fn drop(&mut self) {
        if let Home::Temp(dir) = self {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A background call in progress.
struct Background {
    step: usize,
    scope: Option<Scope>,
    handle: JoinHandle<()>,
}

/// One scenario being run, step by step.
pub struct ScenarioRun {
    script: Script,
    crash_mode: CrashMode,
    clock: Arc<ScenarioClock>,
    contracts: Arc<Contracts>,
    toolset: Arc<crate::engine::tool::Toolset>,
    http: Option<HttpProviders>,
    /// The served provider's database, read-only, when the tools go over HTTP.
    /// The providers' storage (theirs, never the ledger's): beside the ledger,
    /// or the served provider's database when the tools go over HTTP.
    effects: ProviderStore,
    path: PathBuf,
    kept: Option<PathBuf>,
    engine: Option<Engine>,
    /// A separate connection that only reads: the runner's own eyes, which stay
    /// open while the dispatcher is down.
    observer: Store,
    observations: Vec<StepObservation>,
    scopes: Vec<Option<Scope>>,
    focus: Option<Scope>,
    generation: u32,
    background: Option<Background>,
    halted: bool,
    // Last: the directory goes after every connection to it is closed.
    _home: Home,
}

impl std::fmt::Debug for ScenarioRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScenarioRun")
            .field("scenario", &self.script.id)
            .field("next_step", &(self.observations.len() + 1))
            .finish_non_exhaustive()
    }
}

impl Drop for ScenarioRun {
    fn drop(&mut self) {
        if let Some(bg) = self.background.take() {
            self.clock.release();
            let _ = bg.handle.join();
        }
    }
}

fn io_error(what: &str, e: &std::io::Error) -> ScenarioError {
    ScenarioError::Db(format!("{what}: {}", e.kind()))
}

impl ScenarioRun {
    /// A fresh database with the script's world, at the script's start time.
    pub fn new(script: &Script, opts: RunOptions) -> Result<Self, ScenarioError> {
        let (home, path, kept) = if let Some(p) = &opts.keep_db {
            if p.exists() {
                return Err(ScenarioError::Db("the --keep-db path already exists; choose a new one".into()));
            }
            (Home::Kept, p.clone(), Some(p.clone()))
        } else {
            let dir = std::env::temp_dir().join(format!(
                "toolgate-scenario-{}-{}",
                std::process::id(),
                hex::encode(rand::random::<[u8; 6]>())
            ));
            std::fs::create_dir(&dir).map_err(|e| io_error("cannot create a temporary directory", &e))?;
            let path = dir.join("scenario.db");
            (Home::Temp(dir), path, None)
        };
        let clock = Arc::new(ScenarioClock::new(script.start_ms));
        let toolset =
            crate::tools::load_toolset(opts.http.as_ref().map(|h| h.catalog.as_path())).map_err(EngineError::from)?;
        let contracts = toolset.catalog().clone();
        let mut engine =
            Engine::create(&path, engine_options(&clock, &contracts, &toolset, "scenario-w1", seed(script.id, 1)))?;
        engine.load_world(&script.world)?;
        let observer = Store::open(&path, OpenOptions { create: false, sync: Sync::Normal })?;
        let effects = match &opts.http {
            Some(h) => ProviderStore::open_read_only(&h.provider_db)?,
            None => ProviderStore::open_read_only(&path)?,
        };
        Ok(Self {
            script: script.clone(),
            crash_mode: opts.crash_mode,
            clock,
            contracts,
            toolset,
            http: opts.http,
            effects,
            path,
            kept,
            engine: Some(engine),
            observer,
            observations: Vec::new(),
            scopes: Vec::new(),
            focus: None,
            generation: 1,
            background: None,
            halted: false,
            _home: home,
        })
    }

    /// Runs a whole script and returns its report.
    pub fn run(script: &Script, opts: RunOptions) -> Result<ScenarioReport, ScenarioError> {
        let mut run = Self::new(script, opts)?;
        while run.step().is_some() {}
        Ok(run.report())
    }

    /// Runs the next step; `None` when the script is done (or stopped at a step
    /// that could not run).
    pub fn step(&mut self) -> Option<StepObservation> {
        if self.halted || self.observations.len() >= self.script.steps.len() {
            return None;
        }
        let step = self.script.steps[self.observations.len()].clone();
        let before_effects = self.counts().map_or(0, |c| c.0);
        let obs = match self.run_step(&step) {
            Ok(o) => o,
            Err(e) => {
                self.halted = true;
                self.scopes.push(None);
                let (effects, duplicates) = self.counts().unwrap_or((0, 0));
                let mut o = self.blank(&step, effects, before_effects, duplicates);
                o.sees = format!("could not run: {}", e.message);
                o.failures.push(Mismatch {
                    field: e.field.to_string(),
                    expected: "the step runs".into(),
                    actual: e.message,
                });
                o.passed = false;
                o
            }
        };
        self.observations.push(obs.clone());
        Some(obs)
    }

    /// The script being run.
    pub fn script(&self) -> &Script {
        &self.script
    }

    /// The database file (a console can open it read-only alongside).
    pub fn db_path(&self) -> &Path {
        &self.path
    }

    /// The scenario's own clock now (ms): the instant its ledger is at, which
    /// a console showing its database measures ages and deadlines against.
    pub fn now_ms(&self) -> i64 {
        self.clock.now_ms()
    }

    /// The crash mode in force.
    pub fn crash_kind(&self) -> CrashKind {
        match self.crash_mode {
            CrashMode::ChildProcess(_) => CrashKind::ChildProcess,
            CrashMode::InProcess => CrashKind::InProcess,
        }
    }

    /// The steps run so far.
    pub fn observations(&self) -> &[StepObservation] {
        &self.observations
    }

    /// The next step to run, if any.
    pub fn next_step(&self) -> Option<&Step> {
        if self.halted {
            return None;
        }
        self.script.steps.get(self.observations.len())
    }

    /// Whether no step is left to run.
    pub fn is_finished(&self) -> bool {
        self.next_step().is_none()
    }

    /// The report so far.
    pub fn report(&self) -> ScenarioReport {
        let passed = self.observations.len() == self.script.steps.len() && self.observations.iter().all(|o| o.passed);
        ScenarioReport {
            id: self.script.id,
            slug: self.script.slug.clone(),
            title: self.script.title.clone(),
            summary: self.script.summary.clone(),
            crash_mode: self.crash_kind(),
            kept_db: self.kept.clone(),
            total_steps: self.script.steps.len(),
            steps: self.observations.clone(),
            passed,
        }
    }

    // ------------------------------------------------------------ internals

    fn engine(&mut self) -> Result<&mut Engine, StepError> {
        self.engine.as_mut().ok_or_else(|| StepError::new("action", "the dispatcher is down (no restart step)"))
    }

    fn now(&self) -> i64 {
        self.clock.now_ms()
    }

    /// (effects, duplicates) in the whole database.
    fn counts(&mut self) -> Result<(i64, i64), StoreError> {
        self.effects.read(|tx| Ok::<_, StoreError>((tx.count_effects()?, tx.side_effect_duplicates()?)))
    }

    fn op_of(&mut self, scope: Option<&Scope>) -> Result<Option<OperationRow>, StoreError> {
        let Some(s) = scope else { return Ok(None) };
        self.observer.read(|tx| tx.operation_by_scope(crate::store::Scope::new(&s.tenant, &s.subject, &s.tool, &s.key)))
    }

    fn prior(&self, k: usize) -> Result<&StepObservation, StepError> {
        self.observations.get(k - 1).ok_or_else(|| StepError::new("action", format!("step {k} has not run")))
    }

    fn envelope_of(&self, k: usize, field: &'static str) -> Result<&Envelope, StepError> {
        self.prior(k)?.envelope.as_ref().ok_or_else(|| StepError::new(field, format!("step {k} returned no envelope")))
    }

    fn approval_id_of(&self, k: usize) -> Result<String, StepError> {
        approval_id(self.envelope_of(k, "approval_from")?)
            .ok_or_else(|| StepError::new("approval_from", format!("step {k} returned no approval id")))
    }

    /// The call identity of step `n`: a fresh one per step, as a model's retry
    /// carries, unless the script names a call id.
    fn call_identity(n: usize, call_id: Option<&str>) -> CallIdentity {
        let call_id = call_id.map_or_else(|| format!("call_s{n}"), str::to_string);
        CallIdentity {
            provider: "scenario".into(),
            api_family: "responses".into(),
            response_id: format!("resp_{call_id}"),
            call_id,
            adapter_revision: "1".into(),
        }
    }

    fn request(&self, n: usize, c: &Call) -> Result<DispatchRequest, StepError> {
        Ok(DispatchRequest {
            tenant: c.tenant.clone(),
            subject: c.subject.clone(),
            tool: c.tool.clone(),
            arguments: c.args.to_string().into_bytes(),
            idempotency_key: c.key.clone(),
            call: Some(Self::call_identity(n, c.call_id.as_deref())),
            approval_id: c.approval_from.map(|k| self.approval_id_of(k)).transpose()?,
            deadline_ms: c.deadline_ms,
            token_id: None,
        })
    }

    /// The operation a step is about: its own scope when it names one, otherwise
    /// the one the scenario is following.
    fn target(&mut self, step: &Step) -> Result<Option<Scope>, StepError> {
        let scope_of_call = |c: &Call| {
            c.key.as_ref().map(|k| Scope {
                tenant: c.tenant.clone(),
                subject: c.subject.clone(),
                tool: c.tool.clone(),
                key: k.clone(),
            })
        };
        Ok(match &step.action {
            Action::Dispatch(c) | Action::Crash(c) => scope_of_call(c),
            Action::Query { status_ref_from, .. } => {
                let sr = self
                    .envelope_of(*status_ref_from, "status_ref_from")?
                    .status_ref()
                    .ok_or_else(|| {
                        StepError::new("status_ref_from", format!("step {status_ref_from} returned no status_ref"))
                    })?
                    .to_string();
                self.observer.read(|tx| tx.operation_by_status_ref(&sr))?.as_ref().map(Scope::of)
            }
            Action::Approve { approval_from, .. } | Action::Deny { approval_from, .. } => {
                let id = self.approval_id_of(*approval_from)?;
                self.observer.read(|tx| tx.approval(&id))?.map(|a| Scope {
                    tenant: a.tenant,
                    subject: a.subject,
                    tool: a.tool,
                    key: a.idem_key,
                })
            }
            Action::Resolve { operation_from, .. } => {
                let id = self.operation_id_of(*operation_from, "operation_from")?;
                self.observer.read(|tx| tx.operation(&id))?.as_ref().map(Scope::of)
            }
            Action::Await { from } => {
                self.background.as_ref().filter(|b| b.step == *from).and_then(|b| b.scope.clone())
            }
            _ => self.focus.clone(),
        })
    }

    fn operation_id_of(&self, k: usize, field: &'static str) -> Result<String, StepError> {
        self.prior(k)?
            .operation_id
            .clone()
            .ok_or_else(|| StepError::new(field, format!("step {k} followed no operation")))
    }

    fn blank(&self, step: &Step, effects: i64, before_effects: i64, duplicates: i64) -> StepObservation {
        StepObservation {
            step: step.number,
            action: step.action.name(),
            label: step.display_label(),
            explain: step.explain.clone(),
            at_ms: self.now() - self.script.start_ms,
            transition: Transition { from: "none".into(), to: "none".into() },
            operation_id: None,
            code: None,
            status: None,
            outcome: None,
            delivery: None,
            recovery: None,
            retryable: None,
            retry_after_ms: None,
            message: None,
            sees: String::new(),
            effects,
            new_effects: effects - before_effects,
            duplicates,
            attempts: None,
            trace: Vec::new(),
            applied: None,
            crash: None,
            envelope: None,
            failures: Vec::new(),
            passed: true,
        }
    }

    fn run_step(&mut self, step: &Step) -> Result<StepObservation, StepError> {
        let target = self.target(step)?;
        let before = self.op_of(target.as_ref())?;
        let (effects_before, _) = self.counts()?;
        let seq_before = match &before {
            Some(op) => self.observer.read(|tx| tx.trace_for(&op.id))?.iter().map(|t| t.seq).max().unwrap_or(0),
            None => 0,
        };
        let exec = self.execute(step, target.as_ref())?;
        let after = self.op_of(target.as_ref())?;
        let (effects, duplicates) = self.counts()?;
        let mut obs = self.blank(step, effects, effects_before, duplicates);
        let state = |op: &Option<OperationRow>| op.as_ref().map_or_else(|| "none".to_string(), |o| o.state.to_string());
        obs.transition = Transition { from: state(&before), to: state(&after) };
        if let Some(op) = &after {
            obs.operation_id = Some(op.id.clone());
            let (attempts, trace) =
                self.observer.read(|tx| Ok::<_, StoreError>((tx.attempts(&op.id)?, tx.trace_for(&op.id)?)))?;
            obs.attempts = Some(attempts.len() as i64);
            obs.trace = trace.into_iter().filter(|t| t.seq > seq_before).map(|t| t.step).collect();
        }
        if let Some(env) = &exec.envelope {
            let m = &env.model_result;
            obs.status = Some(m.status);
            obs.outcome = Some(m.execution.outcome);
            obs.delivery = Some(m.execution.delivery);
            if let Some(e) = &m.error {
                obs.code = Some(e.code);
                obs.recovery = Some(e.recovery);
                obs.retryable = Some(e.retryable);
                obs.retry_after_ms = e.retry_after_ms;
                obs.message = Some(e.message.clone());
            }
            obs.sees = sees(env);
        }
        if let Some(s) = exec.sees {
            obs.sees = s;
        }
        obs.envelope = exec.envelope;
        obs.applied = exec.applied;
        obs.crash = exec.crash;
        let expect = if self.crash_mode == CrashMode::InProcess { &step.expect_in_process } else { &step.expect };
        obs.failures = check(expect, &obs, &self.observations);
        obs.passed = obs.failures.is_empty();
        if target.is_some() {
            self.focus.clone_from(&target);
        }
        self.scopes.push(target);
        Ok(obs)
    }

    fn with_faults<T>(
        &mut self,
        fault: Option<&str>,
        f: impl FnOnce(&mut Engine) -> Result<T, EngineError>,
    ) -> Result<T, StepError> {
        let plan = parse_faults(fault)?;
        let engine = self.engine()?;
        engine.set_faults(plan);
        let out = f(engine);
        engine.set_faults(FaultPlan::none());
        Ok(out?)
    }

    fn execute(&mut self, step: &Step, target: Option<&Scope>) -> Result<Exec, StepError> {
        let n = step.number;
        match &step.action {
            Action::Dispatch(c) if c.in_background => {
                let req = self.request(n, c)?;
                let plan = parse_faults(c.fault.as_deref())?;
                self.start_background(n, target.cloned(), plan, move |e| e.dispatch(&req))
            }
            Action::Dispatch(c) => {
                let req = self.request(n, c)?;
                let env = self.with_faults(c.fault.as_deref(), |e| e.dispatch(&req))?;
                Ok(Exec { envelope: Some(env), ..Exec::default() })
            }
            Action::Crash(c) => {
                let req = self.request(n, c)?;
                let report = match self.crash_mode.clone() {
                    CrashMode::ChildProcess(bin) => self.crash_child(&bin, &req, c)?,
                    CrashMode::InProcess => {
                        // The reply nobody receives: the process "died" before it got it.
                        let _lost = self.with_faults(Some("timeout_after_commit"), |e| e.dispatch(&req))?;
                        self.engine = None;
                        CrashReport {
                            mode: CrashKind::InProcess,
                            aborted: false,
                            detail: "in this process: the provider committed (timeout_after_commit), the reply was dropped and the engine closed".into(),
                        }
                    }
                };
                Ok(Exec { sees: Some("no reply: the dispatcher died".into()), crash: Some(report), ..Exec::default() })
            }
            Action::Query { tenant, subject, status_ref_from, expected_sha256_from, call_id } => {
                let sr = self.envelope_of(*status_ref_from, "status_ref_from")?.status_ref().map(str::to_string);
                let sha = self
                    .envelope_of(*expected_sha256_from, "expected_sha256_from")?
                    .protected_audit
                    .binding
                    .request_sha256
                    .clone();
                let (Some(status_ref), Some(expected)) = (sr, sha) else {
                    return Err(StepError::new(
                        "status_ref_from",
                        "the referenced step gave no status_ref or request digest",
                    ));
                };
                // Field by field: QueryRequest grows optional fields over time.
                let mut q = QueryRequest::default();
                q.tenant.clone_from(tenant);
                q.subject.clone_from(subject);
                q.status_ref = status_ref;
                q.expected_request_sha256 = expected;
                q.call = Some(Self::call_identity(n, call_id.as_deref()));
                let env = self.engine()?.query_operation_status(&q)?;
                Ok(Exec { envelope: Some(env), ..Exec::default() })
            }
            Action::Approve { approval_from, approver, fault, in_background } => {
                let id = self.approval_id_of(*approval_from)?;
                let approver = approver.clone();
                if *in_background {
                    let plan = parse_faults(fault.as_deref())?;
                    return self.start_background(n, target.cloned(), plan, move |e| e.approve(&id, &approver));
                }
                let env = self.with_faults(fault.as_deref(), |e| e.approve(&id, &approver))?;
                Ok(Exec { envelope: Some(env), ..Exec::default() })
            }
            Action::Deny { approval_from, approver, note } => {
                let id = self.approval_id_of(*approval_from)?;
                let out = self.engine()?.deny(&id, approver, note)?;
                let sees = if out.applied { "approval denied".to_string() } else { format!("refused: {}", out.code) };
                Ok(Exec { sees: Some(sees), applied: Some(out.applied), ..Exec::default() })
            }
            Action::Resolve { operation_from, resolution, operator, note, evidence } => {
                let op_id = self.operation_id_of(*operation_from, "operation_from")?;
                let evidence = match evidence {
                    None => None,
                    Some(Evidence::Text(t)) => Some(t.clone()),
                    Some(Evidence::ProviderReceiptOf(k)) => Some(self.provider_receipt(*k)?),
                };
                let out = self.engine()?.resolve(&ResolveRequest {
                    operation_id: op_id,
                    resolution: *resolution,
                    operator: operator.clone(),
                    note: note.clone(),
                    evidence,
                    seen_version: None,
                    action_id: None,
                    no_evidence: false,
                })?;
                let sees = if out.applied {
                    format!("resolved as {}", resolution.as_str())
                } else {
                    format!("refused: {}", out.code)
                };
                Ok(Exec { sees: Some(sees), applied: Some(out.applied), ..Exec::default() })
            }
            Action::Grant { tenant, subject, tool } => {
                let changed = self.engine()?.grant(tenant, subject, tool)?;
                let more = if changed { "" } else { " (already granted)" };
                Ok(Exec { sees: Some(format!("{tool} granted to {subject}{more}")), ..Exec::default() })
            }
            Action::Revoke { tenant, subject, tool } => {
                let changed = self.engine()?.revoke(tenant, subject, tool)?;
                let more = if changed { "" } else { " (was not granted)" };
                Ok(Exec { sees: Some(format!("{tool} revoked from {subject}{more}")), ..Exec::default() })
            }
            Action::AdvanceClock { ms } => {
                self.clock.manual().advance(*ms);
                if let Some(h) = &self.http {
                    // A served provider keeps real time. The scenario's time
                    // passes for it too: its receipts become visible as much
                    // earlier (all a lookup compares with its clock), so a
                    // `receipt_delay` ends on the scenario's clock as in process.
                    let mut provider =
                        ProviderStore::open(&h.provider_db, OpenOptions { create: false, sync: Sync::Normal })?;
                    provider.write(|tx| tx.shift_visibility(*ms))?;
                }
                Ok(Exec { sees: Some(format!("clock moves {}", fmt_offset(*ms))), ..Exec::default() })
            }
            Action::Restart => {
                self.engine = None;
                self.generation += 1;
                let worker = format!("scenario-w{}", self.generation);
                let opts = engine_options(
                    &self.clock,
                    &self.contracts,
                    &self.toolset,
                    &worker,
                    seed(self.script.id, u64::from(self.generation)),
                );
                self.engine = Some(Engine::open(&self.path, opts)?);
                Ok(Exec { sees: Some("dispatcher restarted".into()), ..Exec::default() })
            }
            Action::Reap => {
                let r = self.engine()?.reap()?;
                Ok(Exec { sees: Some(reap_line(&r)), ..Exec::default() })
            }
            Action::Work { fault } => {
                let ran = self.with_faults(fault.as_deref(), |e| e.work(1_000))?;
                let sees = if ran == 0 { "worker: nothing to run".to_string() } else { format!("worker: ran {ran}") };
                Ok(Exec { sees: Some(sees), ..Exec::default() })
            }
            Action::Await { from } => {
                let Some(bg) = self.background.take().filter(|b| b.step == *from) else {
                    return Err(StepError::new("from", format!("step {from} is not a background call still running")));
                };
                let waited = self.clock.open_and_wait(WAIT_LIMIT);
                if bg.handle.join().is_err() {
                    return Err(StepError::new("action", "the background call panicked"));
                }
                match waited {
                    Waited::Done(Ok(env)) => Ok(Exec { envelope: Some(env), ..Exec::default() }),
                    Waited::Done(Err(e)) => Err(StepError::new("engine", e)),
                    Waited::Parked | Waited::TimedOut => {
                        Err(StepError::new("action", "the background call did not finish in time"))
                    }
                }
            }
        }
    }

    /// Starts a call on its own thread and engine, and returns once it is parked
    /// inside the provider call (or finished, which the expectations will show).
    fn start_background(
        &mut self,
        n: usize,
        scope: Option<Scope>,
        plan: FaultPlan,
        call: impl FnOnce(&mut Engine) -> Result<Envelope, EngineError> + Send + 'static,
    ) -> Result<Exec, StepError> {
        self.clock.arm();
        let clock = self.clock.clone();
        let opts = engine_options(
            &self.clock,
            &self.contracts,
            &self.toolset,
            &format!("scenario-bg{n}"),
            seed(self.script.id, 1000 + n as u64),
        );
        let path = self.path.clone();
        let handle = std::thread::spawn(move || {
            clock.hold_current_thread();
            let result = Engine::open(&path, opts).and_then(|mut e| {
                e.set_faults(plan);
                call(&mut e)
            });
            clock.finish(result.map_err(|e| format!("{}: {e}", e.code())));
        });
        let waited = self.clock.wait_parked(WAIT_LIMIT);
        match waited {
            Waited::Parked => {
                self.background = Some(Background { step: n, scope, handle });
                Ok(Exec { sees: Some("no reply yet: the provider is working".into()), ..Exec::default() })
            }
            Waited::Done(r) => {
                let _ = handle.join();
                let env = r.map_err(|e| StepError::new("engine", e))?;
                Ok(Exec {
                    sees: Some(format!("finished at once: {}", sees(&env))),
                    envelope: Some(env),
                    ..Exec::default()
                })
            }
            Waited::TimedOut => {
                self.clock.release();
                let _ = handle.join();
                Err(StepError::new("action", "the background call neither reached the provider nor finished"))
            }
        }
    }

    /// The receipt the provider holds for step `k`'s operation: what an operator
    /// reads off the provider's own console (the engine itself never does).
    fn provider_receipt(&mut self, k: usize) -> Result<String, StepError> {
        let op_id = self.operation_id_of(k, "evidence")?;
        let op = self
            .observer
            .read(|tx| tx.operation(&op_id))?
            .ok_or_else(|| StepError::new("evidence", format!("step {k}'s operation is gone")))?;
        let provider = self
            .contracts
            .get(&op.tool)
            .map(|c| c.downstream.as_str())
            .ok_or_else(|| StepError::new("evidence", "the operation's tool is not in the catalog"))?;
        let effect = self.effects.read(|tx| tx.provider_effect_by_key(provider, &op.downstream_key))?;
        effect
            .map(|e| e.receipt_id)
            .ok_or_else(|| StepError::new("evidence", format!("the provider has no record for step {k}'s operation")))
    }

    /// Runs the call in a child `toolgate dispatch` that aborts after the
    /// provider commits. The dispatcher of this run is closed first: it is the
    /// process that dies.
    fn crash_child(&mut self, bin: &Path, req: &DispatchRequest, c: &Call) -> Result<CrashReport, StepError> {
        self.engine = None;
        let call = req.call.clone().unwrap_or_else(crate::engine::fresh_call_identity);
        let mut cmd = Command::new(bin);
        cmd.env_remove("TOOLGATE_FAILPOINT")
            .arg("dispatch")
            .arg("--db")
            .arg(&self.path)
            .arg("--now")
            .arg(rfc3339(self.now()))
            .args(["--tenant", &req.tenant, "--subject", &req.subject, "--tool", &req.tool])
            .arg("--args")
            .arg(c.args.to_string())
            .args(["--key", req.idempotency_key.as_deref().unwrap_or_default()])
            .args(["--provider", &call.provider, "--api-family", &call.api_family])
            .args(["--response-id", &call.response_id, "--call-id", &call.call_id])
            .args(["--adapter-revision", &call.adapter_revision])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        match &self.http {
            // Over HTTP the provider is another process: the dispatcher dies
            // right after the reply arrived, before it records it.
            Some(h) => {
                cmd.arg("--catalog").arg(&h.catalog).env("TOOLGATE_FAILPOINT", "before_persist");
            }
            None => {
                cmd.args(["--fault", "crash_after_commit"]);
            }
        }
        if let Some(d) = req.deadline_ms {
            cmd.arg("--deadline-ms").arg(d.to_string());
        }
        if let Some(a) = &req.approval_id {
            cmd.args(["--approval-id", a]);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| StepError::new("crash", format!("cannot start the toolgate child process: {}", e.kind())))?;
        let pid = child.id();
        let started = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if started.elapsed() < WAIT_LIMIT => std::thread::sleep(Duration::from_millis(2)),
                Ok(None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(StepError::new("crash", "the child process did not finish in time"));
                }
                Err(e) => return Err(StepError::new("crash", format!("cannot wait for the child: {}", e.kind()))),
            }
        };
        let aborted = died_by_abort(status);
        let detail = if aborted {
            format!("child process {pid} aborted (SIGABRT) after the provider committed")
        } else {
            format!("child process {pid} did not abort: {}", describe_exit(status))
        };
        Ok(CrashReport { mode: CrashKind::ChildProcess, aborted, detail })
    }
}

/// Options of one engine of a run. Each engine gets its own seed (derived from
/// the scenario and the engine's role) so that ids, receipts and backoff jitter
/// are the same on every run, and two engines never mint the same id.
fn engine_options(
    clock: &Arc<ScenarioClock>,
    contracts: &Arc<Contracts>,
    toolset: &Arc<crate::engine::tool::Toolset>,
    worker: &str,
    seed: u64,
) -> EngineOptions {
    EngineOptions {
        clock: clock.clone(),
        // Process crashes are what scenarios exercise, and WAL with NORMAL survives
        // those; FULL would only add an fsync per commit to a throwaway database.
        sync: Sync::Normal,
        worker_id: worker.to_string(),
        contracts: Some(contracts.clone()),
        seed: Some(seed),
        ..EngineOptions::new(toolset.clone())
    }
}

/// The seed of one engine: the scenario number and a lane (1, 2... for the
/// dispatcher across restarts, 1000 + step for a background worker).
fn seed(script_id: u32, lane: u64) -> u64 {
    (u64::from(script_id) << 32) | lane
}

fn parse_faults(fault: Option<&str>) -> Result<FaultPlan, StepError> {
    match fault {
        None => Ok(FaultPlan::none()),
        Some(f) => FaultPlan::parse(f).map_err(|e| StepError::new("fault", e.to_string())),
    }
}

#[cfg(unix)]
fn died_by_abort(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    status.signal() == Some(6)
}

#[cfg(not(unix))]
fn died_by_abort(status: ExitStatus) -> bool {
    // Windows reports abort() as exit code 3.
    status.code() == Some(3)
}

fn describe_exit(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    status.code().map_or_else(|| "unknown exit".to_string(), |c| format!("exit code {c}"))
}

/// The approval id an envelope carries.
fn approval_id(env: &Envelope) -> Option<String> {
    env.protected_audit.approval_id.clone().or_else(|| {
        env.model_result
            .error
            .as_ref()
            .and_then(|e| e.detail.as_ref())
            .and_then(|d| d.get("approval_id"))
            .and_then(Value::as_str)
            .map(str::to_string)
    })
}

fn reap_line(r: &ReapReport) -> String {
    let mut parts = Vec::new();
    for (n, what) in [
        (r.requeued_unsent, "back to accepted"),
        (r.requeued_same_key, "re-queued with the same key"),
        (r.parked_unknown, "parked as unknown"),
    ] {
        if n > 0 {
            parts.push(format!("{n} {what}"));
        }
    }
    if parts.is_empty() {
        "reaper: nothing to do".into()
    } else {
        format!("reaper: {}", parts.join(", "))
    }
}

/// The stable snake_case name of a serde enum value.
pub(crate) fn name<T: Serialize>(v: &T) -> String {
    serde_json::to_value(v).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_else(|| "?".into())
}

/// Minor units as a decimal amount: 1000 EUR → "10.00 EUR".
use crate::display::money;

/// What the user sees of an envelope, as one short line: the code and what to do
/// next for an error; what happened (and how it was delivered) otherwise.
pub fn sees(env: &Envelope) -> String {
    let m = &env.model_result;
    if let Some(e) = &m.error {
        if e.code == Code::InProgress {
            return format!("{}: still running, retry later with the same key", e.code);
        }
        let next = match e.recovery {
            Recovery::QueryStatus => "query the status",
            Recovery::RetryAfter => "nothing done, retry later",
            Recovery::HumanReview => "a human must review",
            Recovery::RequestApproval => "ask an approver",
            Recovery::RequestAuthorization => "ask for access",
            Recovery::CorrectInput => "fix the input",
            Recovery::None => "nothing to do",
        };
        return format!("{}: {next}", e.code);
    }
    let data = m.data.as_ref().unwrap_or(&Value::Null);
    if m.execution.delivery == Delivery::HumanResolved {
        let r = data.get("resolution").and_then(Value::as_str).unwrap_or("?");
        return format!("human decision: {r}");
    }
    let s = |k: &str| data.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let i = |k: &str| data.get(k).and_then(Value::as_i64).unwrap_or(0);
    let what = if data.get("refund_id").is_some() {
        format!("refunded {} on {}", money(i("amount_minor"), &s("currency")), s("order_ref"))
    } else if data.get("message_id").is_some() {
        format!("message {} sent", s("template"))
    } else if data.get("captured_minor").is_some() {
        format!(
            "{}: {} of {} refunded",
            s("order_ref"),
            money(i("refunded_minor"), &s("currency")),
            money(i("captured_minor"), &s("currency"))
        )
    } else {
        name(&m.status)
    };
    match m.execution.delivery {
        Delivery::Fresh => what,
        d => format!("{what} ({})", name(&d)),
    }
}

/// A clock offset for people: `+0s`, `+2s`, `+1.5s`, `+15m`, `+1h`.
pub fn fmt_offset(ms: i64) -> String {
    let (h, m, s, frac) = (ms / 3_600_000, (ms / 60_000) % 60, (ms / 1000) % 60, ms % 1000);
    if ms > 0 && ms < 1000 {
        format!("+{ms}ms")
    } else if ms < 60_000 {
        if frac == 0 {
            format!("+{s}s")
        } else {
            format!("+{:.1}s", ms as f64 / 1000.0)
        }
    } else {
        let mut out = String::from("+");
        for (n, unit) in [(h, "h"), (m, "m"), (s, "s")] {
            if n > 0 {
                out.push_str(&n.to_string());
                out.push_str(unit);
            }
        }
        out
    }
}

fn show<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_string(), |v| v.to_string())
}

fn show_name<T: Serialize>(v: Option<&T>) -> String {
    v.map_or_else(|| "null".to_string(), name)
}

/// Compares one observation with its expectation; one mismatch per field.
fn check(x: &Expectation, o: &StepObservation, prior: &[StepObservation]) -> Vec<Mismatch> {
    let mut out = Vec::new();
    let mut cmp = |field: &str, expected: String, actual: String| {
        if expected != actual {
            out.push(Mismatch { field: field.to_string(), expected, actual });
        }
    };
    if let Some(c) = &x.code {
        cmp("code", show(c.as_option()), show(o.code));
    }
    if let Some(s) = &x.status {
        cmp("status", name(s), show_name(o.status.as_ref()));
    }
    if let Some(v) = &x.outcome {
        cmp("outcome", name(v), show_name(o.outcome.as_ref()));
    }
    if let Some(v) = &x.delivery {
        cmp("delivery", name(v), show_name(o.delivery.as_ref()));
    }
    if let Some(v) = &x.recovery {
        cmp("recovery", show_name(v.as_option()), show_name(o.recovery.as_ref()));
    }
    if let Some(v) = &x.retryable {
        cmp("retryable", show(v.as_option()), show(o.retryable));
    }
    if let Some(v) = &x.retry_after_ms {
        cmp("retry_after_ms", show(v.as_option()), show(o.retry_after_ms));
    }
    if let Some(t) = &x.transition {
        cmp("transition", t.to_string(), o.transition.to_string());
    }
    if let Some(s) = &x.sees {
        cmp("sees", s.clone(), o.sees.clone());
    }
    if let Some(v) = x.effects {
        cmp("effects", v.to_string(), o.effects.to_string());
    }
    if let Some(v) = x.new_effects {
        cmp("new_effects", v.to_string(), o.new_effects.to_string());
    }
    cmp("duplicates", x.duplicates.to_string(), o.duplicates.to_string());
    if let Some(v) = x.applied {
        cmp("applied", v.to_string(), show(o.applied));
    }
    if let Some(v) = x.attempts {
        cmp("attempts", v.to_string(), show(o.attempts));
    }
    if let Some(v) = x.elapsed_ms {
        cmp("elapsed_ms", v.to_string(), o.at_ms.to_string());
    }
    for t in &x.trace_includes {
        if !o.trace.contains(t) {
            cmp("trace_includes", t.clone(), if o.trace.is_empty() { "no events".into() } else { o.trace.join(", ") });
        }
    }
    let env_of = |k: usize| prior.get(k - 1).and_then(|p| p.envelope.as_ref());
    let relate = |field: &str, rel: &Relation, get: &dyn Fn(&Envelope) -> Option<String>| -> Option<Mismatch> {
        let mine = o.envelope.as_ref().and_then(get);
        let (ok, expected) = match rel {
            Relation::Absent => (mine.is_none(), "absent".to_string()),
            Relation::Present => (mine.is_some(), "present".to_string()),
            Relation::SameAs(k) => {
                let theirs = env_of(*k).and_then(get);
                (mine.is_some() && mine == theirs, format!("same as step {k} ({})", show(theirs)))
            }
            Relation::DiffersFrom(k) => {
                let theirs = env_of(*k).and_then(get);
                (mine.is_some() && mine != theirs, format!("different from step {k} ({})", show(theirs)))
            }
        };
        (!ok).then(|| Mismatch { field: field.to_string(), expected, actual: show(mine) })
    };
    if let Some(r) = &x.status_ref {
        out.extend(relate("status_ref", r, &|e: &Envelope| e.status_ref().map(str::to_string)));
    }
    if let Some(r) = &x.data {
        out.extend(relate("data", r, &|e: &Envelope| e.model_result.data.as_ref().map(Value::to_string)));
    }
    if let Some(r) = &x.approval {
        out.extend(relate("approval", r, &approval_id));
    }
    if let Some(c) = &o.crash {
        if c.mode == CrashKind::ChildProcess && !c.aborted {
            out.push(Mismatch {
                field: "crash".into(),
                expected: "the child aborts (SIGABRT)".into(),
                actual: c.detail.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_read_well() {
        for (ms, s) in [
            (0, "+0s"),
            (2_000, "+2s"),
            (1_500, "+1.5s"),
            (17, "+17ms"),
            (60_000, "+1m"),
            (900_000, "+15m"),
            (906_000, "+15m6s"),
            (3_600_000, "+1h"),
            (86_400_000, "+24h"),
        ] {
            assert_eq!(fmt_offset(ms), s, "{ms}");
        }
    }

    #[test]
    fn a_run_can_move_to_another_thread() {
        // The console steps a run on its engine thread.
        fn send<T: Send>() {}
        send::<ScenarioRun>();
    }

    #[test]
    fn money_has_two_decimals() {
        assert_eq!(money(1000, "EUR"), "10.00 EUR");
        assert_eq!(money(5, "GBP"), "0.05 GBP");
    }
}
