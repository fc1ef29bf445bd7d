//! The scenario file format (documented in `assets/scenarios/README.md`) and its
//! strict loader.
//!
//! Loading happens in two passes. The first is mechanical: [`parse_strict`]
//! refuses duplicate keys, then serde with `deny_unknown_fields` refuses unknown
//! fields, one step at a time so that every error names its step and field. The
//! second checks meaning: which fields an action takes, that every reference
//! points to an *earlier* step that can provide what is asked, that codes and
//! states exist, that fault plans parse, and that the dispatcher is up (after a
//! crash, only a restart brings it back).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use super::ScenarioError;
use crate::downstream::FaultPlan;
use crate::engine::canonical::parse_strict;
use crate::engine::clock::parse_rfc3339;
use crate::engine::envelope::{Code, Delivery, Outcome, Recovery, Status};
use crate::engine::world::World;
use crate::engine::Resolution;
use crate::tools::demo::DEMO_WORLD;

/// Largest scenario file accepted.
const MAX_SCRIPT_BYTES: usize = 1024 * 1024;
/// Deepest nesting accepted (an inline world plus arguments fit easily).
const MAX_DEPTH: usize = 32;

/// Whether a transition may name `state`: one of the ledger's states, or
/// `none` ("no operation").
fn is_state(state: &str) -> bool {
    state == "none" || crate::store::OpState::parse(state).is_some()
}

/// Every state a transition may name, for an error.
fn states() -> String {
    let mut all = vec!["none"];
    all.extend(crate::store::OpState::ALL.iter().map(|s| s.as_str()));
    all.join(", ")
}

/// Every action a step may take.
pub const ACTIONS: [&str; 13] = [
    "dispatch",
    "crash",
    "query",
    "approve",
    "deny",
    "resolve",
    "grant",
    "revoke",
    "advance_clock",
    "restart",
    "reap",
    "work",
    "await",
];

/// One scenario, loaded and checked.
#[derive(Debug, Clone, Serialize)]
pub struct Script {
    /// The file it came from (a name, never a local path).
    pub file: String,
    /// Number used by `toolgate scenario run N`.
    pub id: u32,
    /// Short stable name.
    pub slug: String,
    /// One-line title.
    pub title: String,
    /// What the scenario teaches.
    pub summary: String,
    /// The world the fresh database starts with.
    #[serde(skip)]
    pub world: World,
    /// The manual clock's start, in ms since the Unix epoch.
    pub start_ms: i64,
    /// The steps, in order (numbered from 1).
    pub steps: Vec<Step>,
}

/// One step of a scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    /// 1-based position.
    pub number: usize,
    /// Short text for the action column (defaults to the action's name).
    pub label: Option<String>,
    /// A sentence for the learner (the console shows it).
    pub explain: Option<String>,
    /// What the step does.
    pub action: Action,
    /// What the step must show.
    pub expect: Expectation,
    /// What it must show instead when the crash was simulated in process
    /// (`expect` with the `in_process` fields laid over it).
    pub expect_in_process: Expectation,
}

impl Step {
    /// The text of the action column.
    pub fn display_label(&self) -> String {
        self.label.clone().unwrap_or_else(|| self.action.name().to_string())
    }
}

/// A tool call as a step describes it.
#[derive(Debug, Clone, Serialize)]
pub struct Call {
    /// Tenant.
    pub tenant: String,
    /// Subject.
    pub subject: String,
    /// Tool.
    pub tool: String,
    /// Arguments (sent as their JSON text).
    pub args: Value,
    /// Idempotency key.
    pub key: Option<String>,
    /// Call id; each step gets a fresh one (`call_sN`) when absent, as a model's retry would.
    pub call_id: Option<String>,
    /// Downstream faults for this step's attempts.
    pub fault: Option<String>,
    /// Operation deadline in ms.
    pub deadline_ms: Option<u64>,
    /// Pass the approval id returned by that earlier step.
    pub approval_from: Option<usize>,
    /// Run on a worker thread that stays inside the provider call until an `await` step.
    pub in_background: bool,
}

/// Where resolution evidence comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Evidence {
    /// A literal receipt id.
    Text(String),
    /// The receipt the provider holds for that step's operation, as an operator
    /// would read it off the provider's own console.
    ProviderReceiptOf(usize),
}

/// What a step does.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// A tool call through the engine.
    Dispatch(Call),
    /// A tool call in a dispatcher that dies after the provider commits.
    Crash(Call),
    /// `query_operation_status`.
    Query {
        /// Caller tenant.
        tenant: String,
        /// Caller subject.
        subject: String,
        /// Step whose envelope holds the status_ref.
        status_ref_from: usize,
        /// Step whose envelope holds the request digest.
        expected_sha256_from: usize,
        /// Call id of the query.
        call_id: Option<String>,
    },
    /// Approve a pending request (the held call runs now).
    Approve {
        /// Step whose envelope holds the approval id.
        approval_from: usize,
        /// Who approves.
        approver: String,
        /// Downstream faults for the held call.
        fault: Option<String>,
        /// Run on a worker thread (see [`Call::in_background`]).
        in_background: bool,
    },
    /// Deny a pending request.
    Deny {
        /// Step whose envelope holds the approval id.
        approval_from: usize,
        /// Who denies.
        approver: String,
        /// Why.
        note: String,
    },
    /// A human resolution.
    Resolve {
        /// Step whose operation is resolved.
        operation_from: usize,
        /// The decision.
        resolution: Resolution,
        /// Who.
        operator: String,
        /// Why.
        note: String,
        /// Receipt id, for `succeeded`.
        evidence: Option<Evidence>,
    },
    /// Grant a tool.
    Grant {
        /// Tenant.
        tenant: String,
        /// Subject.
        subject: String,
        /// Tool.
        tool: String,
    },
    /// Revoke a tool.
    Revoke {
        /// Tenant.
        tenant: String,
        /// Subject.
        subject: String,
        /// Tool.
        tool: String,
    },
    /// Move the manual clock forward.
    AdvanceClock {
        /// By how much.
        ms: i64,
    },
    /// Close the dispatcher and open a new one on the same database.
    Restart,
    /// One reaper pass.
    Reap,
    /// One worker pass over due outbox rows.
    Work {
        /// Downstream faults for the rows it runs.
        fault: Option<String>,
    },
    /// Let a background call finish and take its envelope.
    Await {
        /// The background step.
        from: usize,
    },
}

impl Action {
    /// The action's name in the file.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Dispatch(_) => "dispatch",
            Action::Crash(_) => "crash",
            Action::Query { .. } => "query",
            Action::Approve { .. } => "approve",
            Action::Deny { .. } => "deny",
            Action::Resolve { .. } => "resolve",
            Action::Grant { .. } => "grant",
            Action::Revoke { .. } => "revoke",
            Action::AdvanceClock { .. } => "advance_clock",
            Action::Restart => "restart",
            Action::Reap => "reap",
            Action::Work { .. } => "work",
            Action::Await { .. } => "await",
        }
    }

    /// What kind of result the step produces.
    pub fn kind(&self) -> Kind {
        match self {
            Action::Dispatch(c) if !c.in_background => Kind::Envelope,
            Action::Approve { in_background: false, .. } | Action::Query { .. } | Action::Await { .. } => {
                Kind::Envelope
            }
            Action::Deny { .. } | Action::Resolve { .. } => Kind::Operator,
            _ => Kind::Plain,
        }
    }
}

/// The three kinds of step results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A result envelope (code, status, outcome, delivery...).
    Envelope,
    /// An operator outcome (applied or refused).
    Operator,
    /// Neither: only the transition, what the user sees and the effects.
    Plain,
}

/// A state transition, `from → to`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transition {
    /// State before the step (`none`: no operation).
    pub from: String,
    /// State after the step.
    pub to: String,
}

impl std::fmt::Display for Transition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} → {}", self.from, self.to)
    }
}

impl Transition {
    fn parse(s: &str) -> Result<Transition, String> {
        let (from, to) = s
            .split_once("->")
            .or_else(|| s.split_once('→'))
            .ok_or_else(|| format!("{s:?} is not of the form \"from -> to\""))?;
        let (from, to) = (from.trim(), to.trim());
        for st in [from, to] {
            if !is_state(st) {
                return Err(format!("unknown state {st:?} (states: {})", states()));
            }
        }
        Ok(Transition { from: from.to_string(), to: to.to_string() })
    }
}

/// How a value relates to the same value at an earlier step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Relation {
    /// There is none.
    Absent,
    /// There is one.
    Present,
    /// Equal to that step's.
    SameAs(usize),
    /// Present and different from that step's.
    DiffersFrom(usize),
}

/// A value a step may expect to be missing: JSON `null` in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum OrNull<T> {
    /// Must be absent.
    Null,
    /// Must be this.
    Value(T),
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for OrNull<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Option::<T>::deserialize(d).map(|o| o.map_or(OrNull::Null, OrNull::Value))
    }
}

impl<T> OrNull<T> {
    /// As an `Option`.
    pub fn as_option(&self) -> Option<&T> {
        match self {
            OrNull::Null => None,
            OrNull::Value(v) => Some(v),
        }
    }

    fn try_map<U, E>(self, f: impl FnOnce(T) -> Result<U, E>) -> Result<OrNull<U>, E> {
        match self {
            OrNull::Null => Ok(OrNull::Null),
            OrNull::Value(v) => f(v).map(OrNull::Value),
        }
    }
}

/// What a step must show. `None` means "not checked"; for the nullable fields,
/// `Some(OrNull::Null)` means "must be absent" (JSON `null`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Expectation {
    /// Error code (`null`: no error).
    pub code: Option<OrNull<Code>>,
    /// Model-visible status.
    pub status: Option<Status>,
    /// Execution outcome.
    pub outcome: Option<Outcome>,
    /// Delivery.
    pub delivery: Option<Delivery>,
    /// Recovery (`null`: no error).
    pub recovery: Option<OrNull<Recovery>>,
    /// Retryable (`null`: no error).
    pub retryable: Option<OrNull<bool>>,
    /// Retry-after (`null`: none given).
    pub retry_after_ms: Option<OrNull<u64>>,
    /// Operation state before → after.
    pub transition: Option<Transition>,
    /// What the user sees (the runner's short line, see the README).
    pub sees: Option<String>,
    /// Committed downstream effects in the whole database after the step.
    pub effects: Option<i64>,
    /// Effects this step added.
    pub new_effects: Option<i64>,
    /// Intents with more than one effect; always checked, 0 unless given.
    pub duplicates: i64,
    /// Operator action applied (deny, resolve).
    pub applied: Option<bool>,
    /// The envelope's status_ref.
    pub status_ref: Option<Relation>,
    /// The envelope's data.
    pub data: Option<Relation>,
    /// The approval id.
    pub approval: Option<Relation>,
    /// Attempts recorded for the operation.
    pub attempts: Option<i64>,
    /// Clock offset from the start after the step.
    pub elapsed_ms: Option<i64>,
    /// Trace events this step must have added to the operation.
    pub trace_includes: Vec<String>,
}

// ------------------------------------------------------------------ raw form

/// Distinguishes an absent field (`None`) from `null` (`Some(OrNull::Null)`):
/// serde would read `null` as `None` before asking `OrNull`.
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<OrNull<T>>, D::Error> {
    OrNull::<T>::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScript {
    id: u32,
    slug: String,
    title: String,
    summary: String,
    #[serde(default)]
    world: Option<Value>,
    start: String,
    steps: Vec<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStep {
    action: String,
    label: Option<String>,
    explain: Option<String>,
    tenant: Option<String>,
    subject: Option<String>,
    tool: Option<String>,
    args: Option<Value>,
    key: Option<String>,
    call_id: Option<String>,
    fault: Option<String>,
    deadline_ms: Option<u64>,
    approval_from: Option<usize>,
    approver: Option<String>,
    note: Option<String>,
    status_ref_from: Option<usize>,
    expected_sha256_from: Option<usize>,
    operation_from: Option<usize>,
    resolution: Option<String>,
    operator: Option<String>,
    evidence: Option<Value>,
    ms: Option<i64>,
    in_background: Option<bool>,
    from: Option<usize>,
    expect: Value,
    in_process: Option<Value>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawExpect {
    #[serde(default, deserialize_with = "nullable")]
    code: Option<OrNull<String>>,
    status: Option<String>,
    outcome: Option<String>,
    delivery: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    recovery: Option<OrNull<String>>,
    #[serde(default, deserialize_with = "nullable")]
    retryable: Option<OrNull<bool>>,
    #[serde(default, deserialize_with = "nullable")]
    retry_after_ms: Option<OrNull<u64>>,
    transition: Option<String>,
    sees: Option<String>,
    effects: Option<i64>,
    new_effects: Option<i64>,
    duplicates: Option<i64>,
    applied: Option<bool>,
    status_ref: Option<Value>,
    data: Option<Value>,
    approval: Option<Value>,
    attempts: Option<i64>,
    elapsed_ms: Option<i64>,
    trace_includes: Option<Vec<String>>,
}

impl RawStep {
    /// The optional fields that are present, by name.
    fn present(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        macro_rules! present {
            ($($f:ident),*) => { $( if self.$f.is_some() { v.push(stringify!($f)); } )* };
        }
        present!(
            tenant,
            subject,
            tool,
            args,
            key,
            call_id,
            fault,
            deadline_ms,
            approval_from,
            approver,
            note,
            status_ref_from,
            expected_sha256_from,
            operation_from,
            resolution,
            operator,
            evidence,
            ms,
            in_background,
            from
        );
        v
    }
}

impl RawExpect {
    fn present(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        macro_rules! present {
            ($($f:ident),*) => { $( if self.$f.is_some() { v.push(stringify!($f)); } )* };
        }
        present!(
            code,
            status,
            outcome,
            delivery,
            recovery,
            retryable,
            retry_after_ms,
            transition,
            sees,
            effects,
            new_effects,
            duplicates,
            applied,
            status_ref,
            data,
            approval,
            attempts,
            elapsed_ms,
            trace_includes
        );
        v
    }
}

/// The fields each action takes (besides `action`, `label`, `explain`, `expect`, `in_process`).
fn allowed_fields(action: &str) -> &'static [&'static str] {
    match action {
        "dispatch" => &[
            "tenant",
            "subject",
            "tool",
            "args",
            "key",
            "call_id",
            "fault",
            "deadline_ms",
            "approval_from",
            "in_background",
        ],
        "crash" => &["tenant", "subject", "tool", "args", "key", "call_id", "deadline_ms", "approval_from"],
        "query" => &["tenant", "subject", "status_ref_from", "expected_sha256_from", "call_id"],
        "approve" => &["approval_from", "approver", "fault", "in_background"],
        "deny" => &["approval_from", "approver", "note"],
        "resolve" => &["operation_from", "resolution", "operator", "note", "evidence"],
        "grant" | "revoke" => &["tenant", "subject", "tool"],
        "advance_clock" => &["ms"],
        "work" => &["fault"],
        "await" => &["from"],
        _ => &[],
    }
}

const ENVELOPE_FIELDS: [&str; 10] = [
    "code",
    "status",
    "outcome",
    "delivery",
    "recovery",
    "retryable",
    "retry_after_ms",
    "status_ref",
    "data",
    "approval",
];

// -------------------------------------------------------------------- loader

/// Errors are built with a location ("step 3 expect.code") and a message.
struct Ctx<'a> {
    file: &'a str,
}

impl Ctx<'_> {
    fn err(&self, at: impl Into<String>, message: impl Into<String>) -> ScenarioError {
        ScenarioError::Script { file: self.file.to_string(), at: at.into(), message: message.into() }
    }

    /// serde with `deny_unknown_fields`; a type error names the field it is about.
    fn de<T: DeserializeOwned>(&self, v: &Value, at: &str) -> Result<T, ScenarioError> {
        match serde_json::from_value::<T>(v.clone()) {
            Ok(t) => Ok(t),
            Err(e) => {
                // serde's messages do not say which field a type error is about: find
                // it by trying each field alone (every field but the required ones is optional).
                if let Value::Object(m) = v {
                    for (k, fv) in m {
                        let mut one = Map::new();
                        one.insert(k.clone(), fv.clone());
                        if let Err(e1) = serde_json::from_value::<T>(Value::Object(one)) {
                            let msg = e1.to_string();
                            if !msg.starts_with("missing field") {
                                let field = if at.is_empty() { k.clone() } else { format!("{at}.{k}") };
                                return Err(self.err(field, msg));
                            }
                        }
                    }
                }
                Err(self.err(if at.is_empty() { "file" } else { at }, e.to_string()))
            }
        }
    }
}

fn enum_of<T: DeserializeOwned>(s: &str, what: &str, choices: &[&str]) -> Result<T, String> {
    serde_json::from_value::<T>(Value::String(s.to_string()))
        .map_err(|_| format!("unknown {what} {s:?} (one of: {})", choices.join(", ")))
}

/// Parses and checks one scenario file. `file` names it in error messages.
pub fn parse(file: &str, text: &[u8]) -> Result<Script, ScenarioError> {
    let cx = Ctx { file };
    let v = parse_strict(text, MAX_SCRIPT_BYTES, MAX_DEPTH).map_err(|e| cx.err("file", e.to_string()))?;
    let raw: RawScript = cx.de(&v, "")?;
    if raw.id == 0 {
        return Err(cx.err("id", "must be 1 or more"));
    }
    if raw.slug.is_empty() || !raw.slug.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
        return Err(cx.err("slug", "must be lower-case letters, digits and _"));
    }
    // Scenarios run on the demo toolset: its domain checks the orders too.
    let tools = crate::tools::demo_toolset();
    let world = match &raw.world {
        None => World::parse_checked("world", DEMO_WORLD.as_bytes(), &tools),
        Some(Value::String(s)) if s == "demo" => World::parse_checked("world", DEMO_WORLD.as_bytes(), &tools),
        Some(w @ Value::Object(_)) => World::parse_checked("world", w.to_string().as_bytes(), &tools),
        Some(_) => return Err(cx.err("world", "must be \"demo\" or a world object")),
    }
    .map_err(|e| cx.err("world", e.to_string()))?;
    let start_ms =
        parse_rfc3339(&raw.start).ok_or_else(|| cx.err("start", format!("{:?} is not an RFC 3339 time", raw.start)))?;
    if raw.steps.is_empty() {
        return Err(cx.err("steps", "a scenario needs at least one step"));
    }
    let mut steps: Vec<Step> = Vec::with_capacity(raw.steps.len());
    let mut flow = Flow { up: true, crashed: false, background: None };
    for (i, sv) in raw.steps.iter().enumerate() {
        let step = parse_step(&cx, i + 1, sv, &steps, &mut flow)?;
        steps.push(step);
    }
    Ok(Script {
        file: file.to_string(),
        id: raw.id,
        slug: raw.slug,
        title: raw.title,
        summary: raw.summary,
        world,
        start_ms,
        steps,
    })
}

/// What the loader tracks across steps.
struct Flow {
    /// The dispatcher is running.
    up: bool,
    /// A crash step has happened.
    crashed: bool,
    /// A background step not yet awaited.
    background: Option<usize>,
}

fn parse_step(cx: &Ctx<'_>, n: usize, v: &Value, earlier: &[Step], flow: &mut Flow) -> Result<Step, ScenarioError> {
    let at = format!("step {n}");
    let raw: RawStep = cx.de(v, &at)?;
    let action = raw.action.as_str();
    if !ACTIONS.contains(&action) {
        return Err(
            cx.err(format!("{at}.action"), format!("unknown action {action:?} (one of: {})", ACTIONS.join(", ")))
        );
    }
    let at = format!("step {n} ({action})");
    let allowed = allowed_fields(action);
    if let Some(f) = raw.present().into_iter().find(|f| !allowed.contains(f)) {
        let takes = if allowed.is_empty() { "no fields".to_string() } else { allowed.join(", ") };
        return Err(cx.err(format!("{at}.{f}"), format!("not a field of {action} (it takes: {takes})")));
    }
    let need = |v: Option<String>, f: &str| v.ok_or_else(|| cx.err(format!("{at}.{f}"), "missing"));
    // A reference must point to an earlier step, and to one that can provide what is asked.
    let refer = |f: &str, k: usize, needs_envelope: bool| -> Result<usize, ScenarioError> {
        if k == 0 || k >= n {
            let why = if k == 0 {
                "steps are numbered from 1".to_string()
            } else if k == n {
                "a step cannot refer to itself".to_string()
            } else {
                format!("step {k} comes later; a step can only use earlier steps")
            };
            return Err(cx.err(format!("{at}.{f}"), format!("refers to step {k}: {why}")));
        }
        if needs_envelope && earlier[k - 1].action.kind() != Kind::Envelope {
            return Err(cx.err(
                format!("{at}.{f}"),
                format!("step {k} ({}) returns no envelope to take it from", earlier[k - 1].action.name()),
            ));
        }
        Ok(k)
    };
    let fault = |f: Option<String>| -> Result<Option<String>, ScenarioError> {
        if let Some(spec) = &f {
            FaultPlan::parse(spec).map_err(|e| cx.err(format!("{at}.fault"), e.to_string()))?;
        }
        Ok(f)
    };
    let call = |raw: &RawStep, fault: Option<String>| -> Result<Call, ScenarioError> {
        Ok(Call {
            tenant: need(raw.tenant.clone(), "tenant")?,
            subject: need(raw.subject.clone(), "subject")?,
            tool: need(raw.tool.clone(), "tool")?,
            args: raw.args.clone().ok_or_else(|| cx.err(format!("{at}.args"), "missing"))?,
            key: raw.key.clone(),
            call_id: raw.call_id.clone(),
            fault,
            deadline_ms: raw.deadline_ms,
            approval_from: raw.approval_from.map(|k| refer("approval_from", k, true)).transpose()?,
            in_background: raw.in_background.unwrap_or(false),
        })
    };
    let parsed = match action {
        "dispatch" => Action::Dispatch(call(&raw, fault(raw.fault.clone())?)?),
        "crash" => {
            let c = call(&raw, None)?;
            if c.key.is_none() {
                return Err(cx.err(format!("{at}.key"), "missing (the crash is of a write call)"));
            }
            Action::Crash(c)
        }
        "query" => {
            let sr = raw.status_ref_from.ok_or_else(|| cx.err(format!("{at}.status_ref_from"), "missing"))?;
            let sr = refer("status_ref_from", sr, true)?;
            let ex = match raw.expected_sha256_from {
                Some(k) => refer("expected_sha256_from", k, true)?,
                None => sr,
            };
            Action::Query {
                tenant: need(raw.tenant.clone(), "tenant")?,
                subject: need(raw.subject.clone(), "subject")?,
                status_ref_from: sr,
                expected_sha256_from: ex,
                call_id: raw.call_id.clone(),
            }
        }
        "approve" | "deny" => {
            let k = raw.approval_from.ok_or_else(|| cx.err(format!("{at}.approval_from"), "missing"))?;
            let k = refer("approval_from", k, true)?;
            let approver = need(raw.approver.clone(), "approver")?;
            if action == "approve" {
                Action::Approve {
                    approval_from: k,
                    approver,
                    fault: fault(raw.fault.clone())?,
                    in_background: raw.in_background.unwrap_or(false),
                }
            } else {
                Action::Deny { approval_from: k, approver, note: need(raw.note.clone(), "note")? }
            }
        }
        "resolve" => {
            let k = raw.operation_from.ok_or_else(|| cx.err(format!("{at}.operation_from"), "missing"))?;
            let k = refer("operation_from", k, false)?;
            let res = need(raw.resolution.clone(), "resolution")?;
            let resolution = enum_of::<Resolution>(&res, "resolution", &["succeeded", "failed", "compensated"])
                .map_err(|m| cx.err(format!("{at}.resolution"), m))?;
            let evidence = match &raw.evidence {
                None => None,
                Some(Value::String(s)) => Some(Evidence::Text(s.clone())),
                Some(Value::Object(m)) if m.len() == 1 && m.contains_key("provider_receipt_of") => {
                    let k = m
                        .get("provider_receipt_of")
                        .and_then(Value::as_u64)
                        .ok_or_else(|| cx.err(format!("{at}.evidence.provider_receipt_of"), "must be a step number"))?;
                    Some(Evidence::ProviderReceiptOf(refer("evidence.provider_receipt_of", k as usize, false)?))
                }
                Some(_) => {
                    return Err(
                        cx.err(format!("{at}.evidence"), "must be a receipt id or {\"provider_receipt_of\": STEP}")
                    )
                }
            };
            Action::Resolve {
                operation_from: k,
                resolution,
                operator: need(raw.operator.clone(), "operator")?,
                note: need(raw.note.clone(), "note")?,
                evidence,
            }
        }
        "grant" | "revoke" => {
            let (tenant, subject, tool) = (
                need(raw.tenant.clone(), "tenant")?,
                need(raw.subject.clone(), "subject")?,
                need(raw.tool.clone(), "tool")?,
            );
            if action == "grant" {
                Action::Grant { tenant, subject, tool }
            } else {
                Action::Revoke { tenant, subject, tool }
            }
        }
        "advance_clock" => {
            let ms = raw.ms.ok_or_else(|| cx.err(format!("{at}.ms"), "missing"))?;
            if ms <= 0 {
                return Err(cx.err(format!("{at}.ms"), "must be more than 0 (the clock only moves forward)"));
            }
            Action::AdvanceClock { ms }
        }
        "restart" => Action::Restart,
        "reap" => Action::Reap,
        "work" => Action::Work { fault: fault(raw.fault.clone())? },
        _ => {
            let k = raw.from.ok_or_else(|| cx.err(format!("{at}.from"), "missing"))?;
            Action::Await { from: refer("from", k, false)? }
        }
    };
    check_flow(cx, &at, n, &parsed, flow)?;
    if raw.in_process.is_some() && !flow.crashed {
        return Err(cx.err(
            format!("{at}.in_process"),
            "only steps at or after a crash step can differ when the crash is simulated in process",
        ));
    }
    let kind = parsed.kind();
    let expect = parse_expect(cx, &format!("{at}.expect"), &raw.expect, kind, n, earlier, true)?;
    let expect_in_process = match &raw.in_process {
        None => expect.clone(),
        Some(v) => overlay(&expect, &parse_expect(cx, &format!("{at}.in_process"), v, kind, n, earlier, false)?),
    };
    Ok(Step { number: n, label: raw.label, explain: raw.explain, action: parsed, expect, expect_in_process })
}

/// The dispatcher must be up for everything but a restart or a clock move; one
/// background call at a time, awaited before a crash or a restart.
fn check_flow(cx: &Ctx<'_>, at: &str, n: usize, a: &Action, flow: &mut Flow) -> Result<(), ScenarioError> {
    let down = |what: &str| {
        cx.err(
            format!("{at}.action"),
            format!("{what}: the dispatcher is down after a crash; add a restart step first"),
        )
    };
    let busy =
        |k: usize| cx.err(format!("{at}.action"), format!("the background call of step {k} must be awaited first"));
    match a {
        Action::AdvanceClock { .. } => {}
        Action::Restart => {
            if let Some(k) = flow.background {
                return Err(busy(k));
            }
            flow.up = true;
        }
        Action::Crash(_) => {
            if !flow.up {
                return Err(down("cannot crash again"));
            }
            if let Some(k) = flow.background {
                return Err(busy(k));
            }
            flow.up = false;
            flow.crashed = true;
        }
        Action::Await { from } => {
            if flow.background != Some(*from) {
                return Err(cx.err(format!("{at}.from"), format!("step {from} is not a background call still running")));
            }
            flow.background = None;
        }
        Action::Dispatch(Call { in_background: true, .. }) | Action::Approve { in_background: true, .. } => {
            if !flow.up {
                return Err(down("cannot start a call"));
            }
            if let Some(k) = flow.background {
                return Err(busy(k));
            }
            flow.background = Some(n);
        }
        other => {
            if !flow.up {
                return Err(down(&format!("cannot {}", other.name())));
            }
        }
    }
    Ok(())
}

fn overlay(base: &Expectation, top: &Expectation) -> Expectation {
    Expectation {
        code: top.code.or(base.code),
        status: top.status.or(base.status),
        outcome: top.outcome.or(base.outcome),
        delivery: top.delivery.or(base.delivery),
        recovery: top.recovery.or(base.recovery),
        retryable: top.retryable.or(base.retryable),
        retry_after_ms: top.retry_after_ms.or(base.retry_after_ms),
        transition: top.transition.clone().or_else(|| base.transition.clone()),
        sees: top.sees.clone().or_else(|| base.sees.clone()),
        effects: top.effects.or(base.effects),
        new_effects: top.new_effects.or(base.new_effects),
        duplicates: base.duplicates.max(top.duplicates),
        applied: top.applied.or(base.applied),
        status_ref: top.status_ref.clone().or_else(|| base.status_ref.clone()),
        data: top.data.clone().or_else(|| base.data.clone()),
        approval: top.approval.clone().or_else(|| base.approval.clone()),
        attempts: top.attempts.or(base.attempts),
        elapsed_ms: top.elapsed_ms.or(base.elapsed_ms),
        trace_includes: if top.trace_includes.is_empty() {
            base.trace_includes.clone()
        } else {
            top.trace_includes.clone()
        },
    }
}

fn parse_expect(
    cx: &Ctx<'_>,
    at: &str,
    v: &Value,
    kind: Kind,
    n: usize,
    earlier: &[Step],
    complete: bool,
) -> Result<Expectation, ScenarioError> {
    let raw: RawExpect = cx.de(v, at)?;
    let present = raw.present();
    for f in &present {
        let ok = match kind {
            Kind::Envelope => *f != "applied",
            Kind::Operator | Kind::Plain => !ENVELOPE_FIELDS.contains(f) && (*f != "applied" || kind == Kind::Operator),
        };
        if !ok {
            let why = match kind {
                Kind::Envelope => "this step returns an envelope, not an operator outcome",
                Kind::Operator => "this step returns an operator outcome, not an envelope",
                Kind::Plain => "this step returns no envelope",
            };
            return Err(cx.err(format!("{at}.{f}"), format!("cannot be checked here: {why}")));
        }
    }
    if complete {
        let required: &[&str] = match kind {
            Kind::Envelope => {
                &["code", "status", "outcome", "delivery", "recovery", "retryable", "transition", "sees", "effects"]
            }
            Kind::Operator => &["applied", "transition", "sees", "effects"],
            Kind::Plain => &["transition", "sees", "effects"],
        };
        if let Some(f) = required.iter().find(|f| !present.contains(f)) {
            return Err(cx.err(format!("{at}.{f}"), "missing (every step states what it must show)"));
        }
    }
    let field = |f: &str| format!("{at}.{f}");
    let code = raw
        .code
        .map(|c| {
            c.try_map(|c| {
                Code::parse(&c).ok_or_else(|| {
                    let all: Vec<&str> = Code::ALL.iter().map(|c| c.as_str()).collect();
                    cx.err(field("code"), format!("unknown code {c:?} (codes: {})", all.join(", ")))
                })
            })
        })
        .transpose()?;
    let status = raw
        .status
        .map(|s| enum_of::<Status>(&s, "status", &["succeeded", "failed", "unknown"]))
        .transpose()
        .map_err(|m| cx.err(field("status"), m))?;
    let outcome = raw
        .outcome
        .map(|s| enum_of::<Outcome>(&s, "outcome", &["committed", "not_started", "unknown"]))
        .transpose()
        .map_err(|m| cx.err(field("outcome"), m))?;
    let delivery = raw
        .delivery
        .map(|s| {
            enum_of::<Delivery>(&s, "delivery", &["fresh", "local_replay", "receipt_reconciled", "human_resolved"])
        })
        .transpose()
        .map_err(|m| cx.err(field("delivery"), m))?;
    let recoveries = [
        "correct_input",
        "none",
        "request_authorization",
        "human_review",
        "request_approval",
        "retry_after",
        "query_status",
    ];
    let recovery = raw
        .recovery
        .map(|r| r.try_map(|s| enum_of::<Recovery>(&s, "recovery", &recoveries)))
        .transpose()
        .map_err(|m| cx.err(field("recovery"), m))?;
    let transition =
        raw.transition.map(|t| Transition::parse(&t)).transpose().map_err(|m| cx.err(field("transition"), m))?;
    let relation = |f: &str, v: Option<Value>| -> Result<Option<Relation>, ScenarioError> {
        let Some(v) = v else { return Ok(None) };
        let bad =
            || cx.err(field(f), "must be \"absent\", \"present\", {\"same_as\": STEP} or {\"differs_from\": STEP}");
        let r = match &v {
            Value::String(s) if s == "absent" => Relation::Absent,
            Value::String(s) if s == "present" => Relation::Present,
            Value::Object(m) if m.len() == 1 => {
                let (k, step) = m.iter().next().ok_or_else(bad)?;
                let step = step.as_u64().ok_or_else(bad)? as usize;
                if step == 0 || step >= n {
                    return Err(cx.err(
                        format!("{}.{k}", field(f)),
                        format!("refers to step {step}: a step can only compare with earlier steps"),
                    ));
                }
                if earlier[step - 1].action.kind() != Kind::Envelope {
                    return Err(cx.err(
                        format!("{}.{k}", field(f)),
                        format!(
                            "step {step} ({}) returns no envelope to compare with",
                            earlier[step - 1].action.name()
                        ),
                    ));
                }
                match k.as_str() {
                    "same_as" => Relation::SameAs(step),
                    "differs_from" => Relation::DiffersFrom(step),
                    _ => return Err(bad()),
                }
            }
            _ => return Err(bad()),
        };
        Ok(Some(r))
    };
    if let Some(t) = raw.trace_includes.as_ref().and_then(|t| t.iter().find(|s| s.is_empty())) {
        return Err(cx.err(field("trace_includes"), format!("{t:?} is not a trace step name")));
    }
    Ok(Expectation {
        code,
        status,
        outcome,
        delivery,
        recovery,
        retryable: raw.retryable,
        retry_after_ms: raw.retry_after_ms,
        transition,
        sees: raw.sees,
        effects: raw.effects,
        new_effects: raw.new_effects,
        duplicates: raw.duplicates.unwrap_or(0),
        applied: raw.applied,
        status_ref: relation("status_ref", raw.status_ref)?,
        data: relation("data", raw.data)?,
        approval: relation("approval", raw.approval)?,
        attempts: raw.attempts,
        elapsed_ms: raw.elapsed_ms,
        trace_includes: raw.trace_includes.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_parse_both_arrows_and_refuse_unknown_states() {
        for (s, ok) in [
            ("none -> succeeded", true),
            ("in_flight → unknown", true),
            ("none-> resolved", true),
            ("none => succeeded", false),
            ("none -> done", false),
            ("pending -> none", false),
        ] {
            assert_eq!(Transition::parse(s).is_ok(), ok, "{s}");
        }
    }
}
