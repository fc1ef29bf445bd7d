//! Property tests (proptest): canonical JSON, `status_ref`, and a state machine
//! of the ledger. Case counts are modest for a 2-core CI; `PROPTEST_CASES=N`
//! overrides them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use serde_json::Value;
use toolgate::downstream::{Downstream, DownstreamRequest, FaultPlan, SimKind, Simulated};
use toolgate::engine::canonical::{
    canonical_string, canonicalize_text, parse_strict, CanonicalError, StatusRefError, StatusRefKey,
};
use toolgate::engine::clock::{Clock, ManualClock};
use toolgate::engine::envelope::{Code, Delivery, Status};
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{DispatchRequest, Engine, EngineOptions, QueryRequest, Resolution, ResolveRequest};
use toolgate::store::{OpenOptions, Store, Sync};

use crate::invariants::{check, check_with, intent, Expect};
use crate::support::T0;

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

// ------------------------------------------------------------ canonical JSON

/// Any JSON value whose numbers are exactly representable as IEEE-754 doubles
/// (RFC 8785 numbers *are* doubles: an integer beyond 2^53 is not a JCS number).
fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        (-(1i64 << 53)..(1i64 << 53)).prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        any::<String>().prop_map(Value::String),
        "[a-z\u{e9}\u{1f600}\u{20ac}]{0,6}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Equality up to number representation (`1.0` and `1` are the same JCS number).
fn same_json(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same_json(a, b)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same_json(v, w)))
        }
        _ => a == b,
    }
}

/// An object's text with its members in the given order.
fn object_text(members: &[(String, Value)]) -> String {
    let parts: Vec<String> = members
        .iter()
        .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).unwrap(), serde_json::to_string(v).unwrap()))
        .collect();
    format!("{{{}}}", parts.join(","))
}

proptest! {
    #![proptest_config(cases(64))]

    /// Canonicalization is idempotent, its output is accepted by the strict
    /// parser, and parsing the canonical text gives back the input value.
    #[test]
    fn canonical_json_is_idempotent_and_round_trips(v in arb_json()) {
        let c = canonical_string(&v);
        let parsed = parse_strict(c.as_bytes(), usize::MAX, 256).unwrap();
        prop_assert!(same_json(&parsed, &v), "{c}");
        prop_assert_eq!(canonical_string(&parsed), c.clone());
        prop_assert_eq!(canonicalize_text(c.as_bytes()).unwrap(), c.clone());
        // Pretty-printed (other whitespace, other number spellings) canonicalizes the same.
        let pretty = serde_json::to_string_pretty(&v).unwrap();
        prop_assert_eq!(canonicalize_text(pretty.as_bytes()).unwrap(), c);
    }

    /// The canonical form does not depend on the order of an object's members.
    #[test]
    fn canonical_json_ignores_member_order(
        members in prop::collection::btree_map(any::<String>(), arb_json(), 1..8),
        seed in any::<u64>(),
    ) {
        let mut a: Vec<(String, Value)> = members.into_iter().collect();
        let sorted = canonicalize_text(object_text(&a).as_bytes()).unwrap();
        a.reverse();
        let reversed = canonicalize_text(object_text(&a).as_bytes()).unwrap();
        use rand::seq::SliceRandom;
        a.shuffle(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed));
        let shuffled = canonicalize_text(object_text(&a).as_bytes()).unwrap();
        prop_assert_eq!(&sorted, &reversed);
        prop_assert_eq!(&sorted, &shuffled);
    }

    /// An object that names a key twice is refused, wherever the twin sits.
    #[test]
    fn duplicate_keys_are_always_refused(
        members in prop::collection::btree_map("[a-z]{1,4}", arb_json(), 1..6),
        pick in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
    ) {
        let mut a: Vec<(String, Value)> = members.into_iter().collect();
        let twin = a[pick.index(a.len())].clone();
        let pos = at.index(a.len() + 1);
        a.insert(pos, (twin.0.clone(), Value::Null));
        let got = parse_strict(object_text(&a).as_bytes(), usize::MAX, 256);
        prop_assert_eq!(got, Err(CanonicalError::DuplicateKey { key: twin.0 }));
    }

    /// The strict parser never panics on arbitrary bytes.
    #[test]
    fn strict_parse_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_strict(&bytes, 1024, 8);
    }
}

// ------------------------------------------------------------------ status_ref

proptest! {
    #![proptest_config(cases(128))]

    /// Verification never panics and never accepts a string it did not mint.
    #[test]
    fn status_ref_verify_never_panics_or_accepts_junk(
        secret in prop::collection::vec(any::<u8>(), 1..48),
        s in prop_oneof![any::<String>(), "sr1_[0-9a-f]{64}", "sr1_[0-9a-fA-F]{60,68}", "[ -~]{68}"],
    ) {
        prop_assert!(StatusRefKey::new(&secret).verify(&s).is_err());
    }

    /// Minting then verifying round-trips under the same secret, and fails under another.
    #[test]
    fn status_ref_round_trips_under_its_own_secret_only(
        secret in prop::collection::vec(any::<u8>(), 1..48),
        other in prop::collection::vec(any::<u8>(), 1..48),
        nonce in any::<[u8; 16]>(),
    ) {
        let k = StatusRefKey::new(&secret);
        let s = k.mint(nonce);
        prop_assert_eq!(k.verify(&s), Ok(()));
        if other != secret {
            prop_assert_eq!(StatusRefKey::new(&other).verify(&s), Err(StatusRefError::Forged));
        }
    }

    /// Any single-character mutation (replacement, deletion or insertion, with any
    /// character) is refused.
    #[test]
    fn status_ref_rejects_every_single_character_mutation(
        secret in prop::collection::vec(any::<u8>(), 1..48),
        nonce in any::<[u8; 16]>(),
        at in any::<prop::sample::Index>(),
        c in any::<char>(),
        how in 0..3u8,
    ) {
        let k = StatusRefKey::new(&secret);
        let mut chars: Vec<char> = k.mint(nonce).chars().collect();
        let i = at.index(chars.len());
        match how {
            0 => {
                prop_assume!(chars[i] != c);
                chars[i] = c;
            }
            1 => {
                chars.remove(i);
            }
            _ => chars.insert(i, c),
        }
        let mutated: String = chars.into_iter().collect();
        prop_assert!(k.verify(&mutated).is_err(), "{mutated}");
    }
}

// ------------------------------------------------------- ledger state machine

/// The intents of the state machine: small refunds, one above acme's approval
/// threshold, and notifications (always approved).
const INTENTS: [(&str, &str, &str); 6] = [
    (
        "create_refund",
        "sm-refund-0001",
        r#"{"order_ref":"ord_1002","amount_minor":700,"currency":"EUR","reason":"damaged"}"#,
    ),
    (
        "create_refund",
        "sm-refund-0002",
        r#"{"order_ref":"ord_1002","amount_minor":900,"currency":"EUR","reason":"other"}"#,
    ),
    (
        "create_refund",
        "sm-refund-0003",
        r#"{"order_ref":"ord_1001","amount_minor":12000,"currency":"EUR","reason":"duplicate"}"#,
    ),
    (
        "create_refund",
        "sm-refund-big1",
        r#"{"order_ref":"ord_1002","amount_minor":60000,"currency":"EUR","reason":"other"}"#,
    ),
    ("notify_customer", "sm-notify-0001", r#"{"order_ref":"ord_1001","template":"refund_issued"}"#),
    ("notify_customer", "sm-notify-0002", r#"{"order_ref":"ord_1002","template":"order_update"}"#),
];

const FAULTS: [&str; 10] = [
    "timeout_after_commit",
    "receipt_delay(5000)",
    "connect_timeout",
    "rate_limit(2000)",
    "rate_limit(90000)",
    "timeout_before_commit",
    "malformed_response",
    "mismatch_after_commit",
    "reject(card_declined)",
    "panic_after_commit",
];

/// One step a caller, a worker, an operator, the clock or a crash can take.
#[derive(Debug, Clone)]
enum Step {
    /// A caller (re)tries an intent, maybe meeting a downstream fault.
    Dispatch { intent: usize, fault: Option<usize> },
    /// An approver decides the intent's pending request (index 2 is the requester: refused).
    Approve { intent: usize, approver: usize, fault: Option<usize> },
    /// A worker pass.
    Work,
    /// A reaper pass.
    Reap,
    /// Time passes.
    Advance(i64),
    /// The caller asks for the intent's status explicitly.
    Query { intent: usize },
    /// An operator settles the intent's operation.
    Resolve { intent: usize, how: usize },
    /// A worker claims the intent's outbox row, records the sent-marker and dies.
    CrashAfterSent { intent: usize },
    /// The same, but the provider committed before the worker died.
    CrashAfterCommit { intent: usize },
    /// The process restarts: a new engine with new connections.
    Restart,
}

fn arb_step() -> impl Strategy<Value = Step> {
    let i = 0..INTENTS.len();
    let fault = prop::option::weighted(0.4, 0..FAULTS.len());
    prop_oneof![
        6 => (i.clone(), fault.clone()).prop_map(|(intent, fault)| Step::Dispatch { intent, fault }),
        3 => (i.clone(), 0..3usize, fault).prop_map(|(intent, approver, fault)| Step::Approve { intent, approver, fault }),
        2 => Just(Step::Work),
        2 => Just(Step::Reap),
        2 => prop::sample::select(vec![50i64, 2_000, 7_000, 40_000, 20 * 60_000]).prop_map(Step::Advance),
        2 => i.clone().prop_map(|intent| Step::Query { intent }),
        1 => (i.clone(), 0..3usize).prop_map(|(intent, how)| Step::Resolve { intent, how }),
        1 => i.clone().prop_map(|intent| Step::CrashAfterSent { intent }),
        1 => i.prop_map(|intent| Step::CrashAfterCommit { intent }),
        1 => Just(Step::Restart),
    ]
}

struct Machine {
    _dir: tempfile::TempDir,
    _pg: Option<crate::support::PgDb>,
    path: PathBuf,
    clock: ManualClock,
    engine: Engine,
    /// The first successful result each intent got: every later success must equal it.
    first_success: BTreeMap<usize, Value>,
    /// Operations the machine resolved as failed: the decision is random, not
    /// evidence, so the audit's money check may rightly find the provider paid
    /// for one of them (a receipt seen against the decision, or one that
    /// became visible later). Only those findings are expected.
    resolved_failed: std::collections::BTreeSet<String>,
}

fn sm_engine(path: &Path, clock: &ManualClock, worker: &str) -> Engine {
    // WAL NORMAL: the machine never loses power, and fsyncs would dominate the run.
    let o = EngineOptions {
        clock: Arc::new(clock.clone()),
        worker_id: worker.into(),
        sync: Sync::Normal,
        ..toolgate::tools::demo_options()
    };
    Engine::open(path, o).unwrap()
}

fn request(intent: usize) -> DispatchRequest {
    let (tool, key, args) = INTENTS[intent];
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: tool.into(),
        arguments: args.as_bytes().to_vec(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

impl Machine {
    fn on(backend: crate::support::Backend) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pg = (backend == crate::support::Backend::Postgres).then(|| crate::support::PgDb::new().unwrap());
        let path = pg.as_ref().map_or_else(|| dir.path().join("sm.db"), |db| PathBuf::from(&db.url));
        let clock = ManualClock::new(T0);
        let o = EngineOptions { clock: Arc::new(clock.clone()), sync: Sync::Normal, ..toolgate::tools::demo_options() };
        let mut engine = Engine::create(&path, o).unwrap();
        engine.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
        Self {
            _dir: dir,
            _pg: pg,
            path,
            clock,
            engine,
            first_success: BTreeMap::new(),
            resolved_failed: std::collections::BTreeSet::new(),
        }
    }

    /// Drops the audit's money findings for operations the machine itself
    /// resolved as failed (see [`Machine::resolved_failed`]); any other stays.
    fn expected_money(&self, v: &mut Vec<String>) {
        v.retain(|x| !self.resolved_failed.iter().any(|id| x.starts_with(&format!("audit: money {id} "))));
    }

    fn op(&mut self, intent: usize) -> Option<toolgate::store::OperationRow> {
        let (tool, key, _) = INTENTS[intent];
        self.engine.list_operations(None, 100).unwrap().into_iter().find(|o| o.tool == tool && o.idem_key == key)
    }

    fn faulted<T>(&mut self, fault: Option<usize>, f: impl FnOnce(&mut Engine) -> T) -> T {
        self.engine.set_faults(fault.map_or_else(FaultPlan::none, |i| FaultPlan::parse(FAULTS[i]).unwrap()));
        let out = f(&mut self.engine);
        self.engine.set_faults(FaultPlan::none());
        out
    }

    /// A successful answer must carry the intent's one result, whenever it comes.
    fn observe(&mut self, intent: usize, env: &toolgate::engine::envelope::Envelope) -> Result<(), TestCaseError> {
        if env.model_result.status == Status::Succeeded
            && env.model_result.execution.delivery != Delivery::HumanResolved
        {
            let data = env.model_result.data.clone().unwrap_or(Value::Null);
            let first = self.first_success.entry(intent).or_insert_with(|| data.clone());
            prop_assert_eq!(&*first, &data, "a success for intent {} changed its result", intent);
        }
        Ok(())
    }

    /// A worker that dies after its sent-marker (and, with `commit`, after the
    /// provider committed): the durable state such a crash leaves.
    fn crash_mid_attempt(&mut self, intent: usize, commit: bool) {
        let Some(op) = self.op(intent) else { return };
        let now = self.clock.now_ms();
        let mut store = Store::open(&self.path, OpenOptions { create: false, sync: Sync::Normal }).unwrap();
        // What a worker's claim does (dispatch.rs `claim`): only a due row whose
        // deadline has not passed, and the operation moves to in_flight with it.
        if now >= op.deadline_at {
            return;
        }
        let claimed = store
            .write(|tx| -> Result<Option<i64>, toolgate::store::StoreError> {
                let Some(attempt) = tx.claim(&op.id, "doomed-worker", now, now + 6_000)? else { return Ok(None) };
                let mut cur = tx.operation(&op.id)?.expect("the operation exists");
                cur.state = toolgate::store::OpState::InFlight;
                cur.updated_at = now;
                tx.update_operation(&cur)?.or_stale()?;
                Ok(Some(attempt))
            })
            .unwrap();
        let Some(attempt) = claimed else { return };
        assert!(store.write(|tx| tx.mark_sent(&op.id, "doomed-worker", attempt, now)).unwrap());
        if commit {
            let kind = if op.tool == "create_refund" { SimKind::Payments } else { SimKind::Notifications };
            let clock: Arc<dyn Clock> = Arc::new(self.clock.clone());
            let faults = Arc::new(Mutex::new(FaultPlan::none()));
            let ids = toolgate::engine::ids::Ids::default();
            let mut provider = Simulated::open(kind, &self.path, clock, faults, Sync::Normal, ids).unwrap();
            let args: Value = serde_json::from_str::<Value>(&op.request_json).unwrap()["arguments"].clone();
            let req = DownstreamRequest {
                intent: intent_of(&op),
                tool: op.tool.clone(),
                arguments: args,
                request_sha256: op.request_sha256.clone(),
                timeout_ms: 5_000,
            };
            provider.execute(&op.downstream_key, &req).unwrap();
        }
    }

    fn query(&mut self, intent: usize) -> Option<toolgate::engine::envelope::Envelope> {
        let op = self.op(intent)?;
        Some(
            self.engine
                .query_operation_status(&QueryRequest {
                    tenant: op.tenant.clone(),
                    subject: op.subject.clone(),
                    status_ref: op.status_ref.clone(),
                    expected_request_sha256: op.request_sha256.clone(),
                    idempotency_key: Some(op.idem_key.clone()),
                    ..QueryRequest::default()
                })
                .unwrap(),
        )
    }

    fn step(&mut self, s: &Step) -> Result<(), TestCaseError> {
        match *s {
            Step::Dispatch { intent, fault } => {
                let env = self.faulted(fault, |e| e.dispatch(&request(intent)).unwrap());
                self.observe(intent, &env)?;
            }
            Step::Approve { intent, approver, fault } => {
                let (tool, key, _) = INTENTS[intent];
                let pending = self.engine.pending_approvals(100).unwrap();
                if let Some(a) = pending.iter().find(|a| a.tool == tool && a.idem_key == key) {
                    let who = ["alice", "bob", "agent_ana"][approver];
                    let env = self.faulted(fault, |e| e.approve(&a.id, who).unwrap());
                    if who == "agent_ana" {
                        prop_assert_eq!(env.code(), Some(Code::ApprovalInvalid), "the requester approved own request");
                    }
                    self.observe(intent, &env)?;
                }
            }
            Step::Work => {
                self.engine.work(100).unwrap();
            }
            Step::Reap => {
                self.engine.reap().unwrap();
            }
            Step::Advance(ms) => self.clock.advance(ms),
            Step::Query { intent } => {
                if let Some(env) = self.query(intent) {
                    self.observe(intent, &env)?;
                }
            }
            Step::Resolve { intent, how } => {
                if let Some(op) = self.op(intent) {
                    let resolution = [Resolution::Failed, Resolution::Compensated, Resolution::Succeeded][how];
                    let req = ResolveRequest {
                        operation_id: op.id.clone(),
                        resolution,
                        operator: "oncall".into(),
                        note: "state machine".into(),
                        evidence: Some("rcpt_from_operator".into()),
                        seen_version: Some(op.version),
                        action_id: None,
                        no_evidence: false,
                    };
                    let mut out = self.engine.resolve(&req).unwrap();
                    if out.code == "STATUS_CONFLICT" || out.code == "RECEIPT_MAY_STILL_APPEAR" {
                        // The provider's evidence contradicts the decision, or a
                        // receipt may still appear (failed inside the receipt
                        // window): only an explicit override applies it.
                        prop_assert!(op.state == "unknown" || op.state == "needs_review");
                        out = self.engine.resolve_against_evidence(&req).unwrap();
                    }
                    let resolvable = op.state == "unknown" || op.state == "needs_review";
                    prop_assert_eq!(out.applied, resolvable, "resolve of a {} operation: {:?}", op.state, out);
                    if out.applied && resolution == Resolution::Failed {
                        self.resolved_failed.insert(op.id.clone());
                    }
                }
            }
            Step::CrashAfterSent { intent } => self.crash_mid_attempt(intent, false),
            Step::CrashAfterCommit { intent } => self.crash_mid_attempt(intent, true),
            Step::Restart => {
                self.engine = sm_engine(&self.path, &self.clock, &format!("restart-{}", self.clock.now_ms()));
            }
        }
        Ok(())
    }

    /// Recovery: reaper past every lease, workers, each caller's retry, an hour
    /// later the reaper again, then explicit queries for what is still unknown.
    fn recover(&mut self) -> Result<(), TestCaseError> {
        self.clock.advance(3_600_000);
        self.engine.reap().unwrap();
        self.engine.work(1_000).unwrap();
        for i in 0..INTENTS.len() {
            if self.op(i).is_some_and(|o| o.state == "accepted" || o.state == "in_flight") {
                let env = self.engine.dispatch(&request(i)).unwrap();
                self.observe(i, &env)?;
            }
        }
        self.engine.work(1_000).unwrap();
        self.clock.advance(3_600_000);
        self.engine.reap().unwrap();
        for i in 0..INTENTS.len() {
            if self.op(i).is_some_and(|o| o.state == "unknown") {
                let env = self.query(i).unwrap();
                self.observe(i, &env)?;
            }
        }
        Ok(())
    }
}

fn intent_of(op: &toolgate::store::OperationRow) -> String {
    intent(&op.tenant, &op.subject, &op.tool, &op.idem_key)
}

/// The state machine on one backend: the invariants hold after every step and
/// after recovery.
fn run_machine(backend: crate::support::Backend, steps: &[Step]) -> Result<(), TestCaseError> {
    let mut m = Machine::on(backend);
    for (n, s) in steps.iter().enumerate() {
        m.step(s)?;
        let (mut v, _) = check_with(&m.path, Expect::default(), &mut m.engine);
        m.expected_money(&mut v);
        prop_assert!(v.is_empty(), "after step {} {:?}: {:#?}", n, s, v);
    }
    m.recover()?;
    let (mut v, tally) = check(&m.path, Expect { settled: true, queried: true });
    m.expected_money(&mut v);
    prop_assert!(v.is_empty(), "after recovery: {:#?}", v);
    prop_assert_eq!(tally.duplicates, 0);
    Ok(())
}

proptest! {
    #![proptest_config(cases(24))]

    /// Random sequences of dispatches (with faults), approvals, workers, reaper
    /// passes, clock steps, status queries, human resolutions, simulated crashes
    /// mid-attempt and restarts never break the invariants of
    /// [`crate::invariants::check`], after any step; once recovery has run, every
    /// operation is settled and nothing a query could find is left unknown. A
    /// success always carries the intent's one result, however it is delivered.
    #[test]
    fn ledger_state_machine_keeps_every_invariant(steps in prop::collection::vec(arb_step(), 1..28)) {
        run_machine(crate::support::Backend::Sqlite, &steps)?;
    }
}

proptest! {
    // Fewer cases: each makes a database on the server.
    #![proptest_config(cases(8))]

    /// The same machine on PostgreSQL.
    #[test]
    fn ledger_state_machine_keeps_every_invariant_on_postgres(steps in prop::collection::vec(arb_step(), 1..28)) {
        if crate::support::pg_base().is_some() {
            run_machine(crate::support::Backend::Postgres, &steps)?;
        }
    }
}

// ------------------------------------------------------------ folded rollups

/// One batch of trace events written in one transaction: (events as (series
/// pick, latency, minute offset), commit or roll back).
type Batch = (Vec<(u8, Option<i64>, i64)>, bool);

fn fold_event(pick: u8, latency_us: Option<i64>, minute: i64) -> toolgate::store::TraceRow {
    let some = |s: &str, on: u8| (pick & on != 0).then(|| s.to_string());
    toolgate::store::TraceRow {
        seq: 0,
        at: T0 + minute * 60_000 + i64::from(pick),
        operation_id: None,
        step: ["accept", "send", "persist", "replay"][usize::from(pick % 4)].into(),
        tool: some("create_refund", 4),
        code: some("TIMEOUT", 8),
        outcome: some("ok", 16),
        delivery: some("fresh", 32),
        attempt: None,
        duration_us: None,
        fields: "{}".into(),
        answer: some("dispatch", 64),
        latency_us,
        tenant_ref: some("tr_1", 128),
        tool_version: Some("1.1.1".into()),
        timeout_stage: None,
        reason: pick.is_multiple_of(3).then(|| "replay".to_string()),
    }
}

proptest! {
    #![proptest_config(cases(12))]

    /// However the trace events fall into transactions, folds and rollbacks
    /// (SQLite folds the rollups every `FOLD_EVERY` events, migration 0012),
    /// every rollup reader sees exactly what a scan of the whole trace counts.
    #[test]
    fn folded_rollups_read_exactly_what_the_trace_holds(
        batches in prop::collection::vec(
            (prop::collection::vec((any::<u8>(), prop::option::of(0i64..5_000_000), 0i64..4), 1..200), prop::bool::weighted(0.8)),
            1..8,
        ),
    ) {
        let batches: Vec<Batch> = batches;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fold.db");
        let mut store = Store::open(&path, OpenOptions { create: true, sync: Sync::Normal }).unwrap();
        for (events, commit) in &batches {
            let r = store.write(|tx| -> Result<(), toolgate::store::StoreError> {
                for (pick, lat, minute) in events {
                    tx.insert_trace(&fold_event(*pick, *lat, *minute))?;
                }
                if *commit { Ok(()) } else { Err(toolgate::store::StoreError::Other("roll back".into())) }
            });
            prop_assert_eq!(r.is_ok(), *commit);
        }
        let (totals, minutes, latency) = store
            .read(|tx| -> Result<_, toolgate::store::StoreError> {
                Ok((tx.metric_totals()?, tx.metric_minutes(i64::MIN, i64::MAX)?, tx.latency_totals()?))
            })
            .unwrap();
        // The same counts, straight from the trace.
        let c = crate::support::raw(&path);
        let scan = |sql: &str| -> BTreeMap<String, i64> {
            let mut st = c.prepare(sql).unwrap();
            st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        let key = "coalesce(answer,'')||'|'||step||'|'||coalesce(tool,'')||'|'||coalesce(tenant_ref,'')||'|'||coalesce(code,'')||'|'||coalesce(outcome,'')||'|'||coalesce(delivery,'')||'|'||coalesce(reason,'')";
        let want_totals = scan(&format!("SELECT {key}, count(*) * 1000000000 + sum(coalesce(latency_us, 0)) FROM trace_events GROUP BY 1"));
        let want_minutes = scan(&format!("SELECT (at / 60000) || '|' || {key}, count(*) FROM trace_events GROUP BY 1"));
        let want_latency = scan("SELECT answer || '|' || coalesce(tool,'') || '|' || coalesce(tenant_ref,'') || '|' || latency_bucket_us, count(*) FROM trace_events
                                 WHERE answer IS NOT NULL AND latency_bucket_us IS NOT NULL GROUP BY 1");
        let k = |m: &toolgate::store::MetricRow| {
            format!("{}|{}|{}|{}|{}|{}|{}|{}", m.answer, m.step, m.tool, m.tenant_ref, m.code, m.outcome, m.delivery, m.reason)
        };
        let got_totals: BTreeMap<String, i64> =
            totals.iter().map(|m| (k(m), m.events * 1_000_000_000 + m.latency_sum_us)).collect();
        let got_minutes: BTreeMap<String, i64> =
            minutes.iter().map(|m| (format!("{}|{}", m.minute.unwrap(), k(m)), m.events)).collect();
        let got_latency: BTreeMap<String, i64> =
            latency.iter().map(|l| (format!("{}|{}|{}|{}", l.answer, l.tool, l.tenant_ref, l.bucket_us), l.count)).collect();
        prop_assert_eq!(got_totals, want_totals);
        prop_assert_eq!(got_minutes, want_minutes);
        prop_assert_eq!(got_latency, want_latency);
        // A fold runs right after the insert whose seq is a multiple of
        // FOLD_EVERY, so the mark sits on one, and the unfolded tail is
        // shorter than one batch.
        let (folded, last): (i64, i64) = c
            .query_row("SELECT folded_seq, (SELECT coalesce(max(seq), 0) FROM trace_events) FROM rollup_mark", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap();
        prop_assert_eq!(folded % toolgate::store::FOLD_EVERY, 0);
        prop_assert!((0..toolgate::store::FOLD_EVERY).contains(&(last - folded)), "folded {} last {}", folded, last);
    }
}

// ------------------------------------------------------------- trace fields

fn opt_text() -> impl Strategy<Value = Option<String>> {
    prop::option::of(prop_oneof![any::<String>(), "[ -~]{0,12}", Just("\u{1f}\"\\\u{7f}é😀".to_string())])
}

prop_compose! {
    fn arb_trace_event()(
        texts in prop::collection::vec(opt_text(), 15),
        ints in prop::collection::vec(prop::option::of(any::<i64>()), 2),
        retry in prop::option::of(any::<u64>()),
        committed in prop::option::of(any::<bool>()),
        call in prop::option::of(prop::collection::vec(any::<String>(), 5)),
        revisions in prop::option::of((any::<i64>(), any::<i64>(), any::<i64>())),
        checks in prop::sample::subsequence(vec!["authorization", "business_rules", "approval", "schema", "\u{0}odd"], 0..5),
    ) -> toolgate::engine::trace::TraceEvent {
        let t = |i: usize| texts[i].clone();
        toolgate::engine::trace::TraceEvent {
            call: call.map(|c| toolgate::engine::canonical::CallIdentity {
                provider: c[0].clone(),
                api_family: c[1].clone(),
                response_id: c[2].clone(),
                call_id: c[3].clone(),
                adapter_revision: c[4].clone(),
            }),
            revisions: revisions.map(|(input, output, effect)| toolgate::engine::canonical::Revisions { input, output, effect }),
            subject_ref: t(0),
            key_sha256: t(1),
            request_sha256: t(2),
            arguments_sha256: t(3),
            data_classification: t(4),
            checks,
            approval_id: t(5),
            policy_revision: ints[0],
            deadline_left_ms: ints[1],
            recovery: t(6),
            downstream_request_id: t(7),
            receipt_id: t(8),
            status_ref: t(9),
            result_sha256: t(10),
            call_binding_sha256: t(11),
            downstream_committed: committed,
            retry_after_ms: retry,
            worker: t(12),
            note: t(13),
            tenant_ref: t(14),
            ..toolgate::engine::trace::TraceEvent::default()
        }
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// The trace's `fields`, written member by member, are exactly the
    /// canonical form of the event's serialized tree.
    #[test]
    fn trace_fields_written_by_hand_are_the_canonical_tree(ev in arb_trace_event()) {
        let tree = canonical_string(&serde_json::to_value(&ev).unwrap());
        prop_assert_eq!(ev.fields_json(), tree);
    }
}
