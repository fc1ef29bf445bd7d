//! Metrics computed from the database, so every process sees the same numbers
//! (docs/design.md §12): counters from the trace rollups, gauges from the ledger's current
//! state, latency histograms of answered calls. [`snapshot`] is the one entry
//! point: the CLI (`toolgate metrics`), the `/metrics` endpoint and the console
//! all call it.
//!
//! Every series is sliceable by tool, tenant (a salted hash, never the tenant
//! itself), risk (the tool contract's risk label) and tool version (contract
//! revisions `input.output.effect`).
//!
//! The retry budget (tokens left per tool) and the circuit breaker (state and
//! open-since per tool) are read from their rows in the ledger.
//! [`MetricsSnapshot::not_tracked`] would name any metric not exported yet
//! rather than export a made-up value; today it is empty.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::histogram::{Histogram, Percentiles, PROMETHEUS_BOUNDS_US};
use crate::engine::{Engine, EngineError};
use crate::store::{AnswerKind, Reason, Step};
use crate::store::{ApprovalStateRow, CircuitState, LatencyRow, MetricRow, OpenOperationsRow, StoreError};

pub use crate::engine::trace::{minutes_retained_from, MINUTES_RETAINED};

/// Connections this process refused because their client address held too
/// many at once (`toolgate_connections_refused_total`); counted in memory.
pub static CONNECTIONS_REFUSED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The time window for rates and windowed percentiles: the last `span_minutes`
/// (the current, partial minute included), in buckets of `bucket_minutes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Window {
    /// Length of the window in minutes.
    pub span_minutes: i64,
    /// Length of one rate bucket in minutes.
    pub bucket_minutes: i64,
}

impl Default for Window {
    fn default() -> Self {
        Self { span_minutes: 15, bucket_minutes: 1 }
    }
}

impl Window {
    /// The last `span` minutes in one-minute buckets.
    pub fn last_minutes(span: i64) -> Self {
        Self { span_minutes: span.clamp(1, MINUTES_RETAINED), bucket_minutes: 1 }
    }

    /// A window with buckets of `bucket` minutes (the span is rounded up to a
    /// whole number of buckets).
    pub fn with_buckets(span: i64, bucket: i64) -> Self {
        let bucket = bucket.clamp(1, MINUTES_RETAINED);
        let span = span.clamp(1, MINUTES_RETAINED);
        Self { span_minutes: (span + bucket - 1) / bucket * bucket, bucket_minutes: bucket }
    }
}

/// Restricts every series to one tool, tenant, risk or tool version (`None`:
/// all). The tenant is matched by its salted hash (`Engine::hashed("tenant", t)`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slice {
    /// Tool name.
    pub tool: Option<String>,
    /// Salted tenant hash (`tenant_…`).
    pub tenant_ref: Option<String>,
    /// Risk label of the tool contract.
    pub risk: Option<String>,
    /// Contract revisions `input.output.effect`.
    pub version: Option<String>,
}

/// Prometheus metric type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// Monotonic, name ends in `_total`.
    Counter,
    /// Current value.
    Gauge,
    /// Buckets, sum and count.
    Histogram,
}

/// One metric family: a name, its help text, its type and its samples.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Family {
    /// `toolgate_…`.
    pub name: &'static str,
    /// One line of help.
    pub help: &'static str,
    /// Type.
    pub kind: Kind,
    /// Samples, one per label set.
    pub samples: Vec<Sample>,
}

/// One labelled sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sample {
    /// Label names and values, in a stable order.
    pub labels: BTreeMap<&'static str, String>,
    /// Counter or gauge value (for a histogram: the number of observations).
    pub value: f64,
    /// For histograms: cumulative counts per `le` bound in seconds (`+Inf` last).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub histogram: Option<HistogramSample>,
}

/// A Prometheus histogram sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HistogramSample {
    /// `(le in seconds, cumulative count)`; the last bound is `+Inf`.
    pub buckets: Vec<(f64, u64)>,
    /// Sum of the observations, in seconds.
    pub sum_seconds: f64,
    /// Number of observations.
    pub count: u64,
}

/// Counts per time bucket of the window, oldest first (sparklines).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rate {
    /// `dispatches`, `committed`, `replays`, `conflicts`, `unknown`,
    /// `auth_denied`, `rate_limits`, `retries`, `queries`.
    pub name: &'static str,
    /// One count per bucket.
    pub counts: Vec<i64>,
    /// Sum over the window.
    pub total: i64,
}

/// Dispatch latency of one tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolLatency {
    /// Tool.
    pub tool: String,
    /// Dispatches answered.
    pub count: u64,
    /// p50 / p95 / p99 (`None` when there was no call).
    pub percentiles: Option<Percentiles>,
}

/// What stands between a tool and its downstream right now: the retry budget,
/// the circuit breaker of its downstream, and any provider rate-limit cooldown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ToolResilience {
    /// Tool.
    pub tool: String,
    /// Its downstream (whose circuit it shares with the other tools there).
    pub downstream: String,
    /// Retry tokens left, in thousandths ([`crate::store::MILLI_TOKEN`]).
    pub budget_milli: i64,
    /// The bucket's size, in thousandths.
    pub capacity_milli: i64,
    /// `closed`, `open` or `half_open`.
    pub circuit: CircuitState,
    /// While open: since when (ms since the epoch).
    pub open_since_ms: Option<i64>,
    /// While open: the first instant a probe may go; while half-open: when the
    /// probe's slot lapses (another probe may go then).
    pub next_probe_ms: Option<i64>,
    /// Operations waiting out a `RATE_LIMIT` answer.
    pub rate_limited: i64,
    /// When the last of them is due again.
    pub rate_limited_until_ms: Option<i64>,
}

/// A metric the design asks for that the engine does not have yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NotTracked {
    /// The metric.
    pub metric: &'static str,
    /// Why it is not exported.
    pub why: &'static str,
}

/// The window a snapshot's rates cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct WindowInfo {
    /// Start (inclusive), ms since the epoch, on a minute boundary.
    pub start_ms: i64,
    /// End (exclusive), ms since the epoch: the end of the current minute.
    pub end_ms: i64,
    /// Length of one bucket.
    pub bucket_ms: i64,
}

/// Everything the metrics say at one instant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MetricsSnapshot {
    /// When it was computed (the engine's clock).
    pub generated_at_ms: i64,
    /// The window of `rates` and `latency_window`.
    pub window: WindowInfo,
    /// Every exported family, in a stable order (what Prometheus gets).
    pub families: Vec<Family>,
    /// Counts per bucket of the window.
    pub rates: Vec<Rate>,
    /// Dispatch latency per tool over the window.
    pub latency_window: Vec<ToolLatency>,
    /// Dispatch latency per tool since the database was created.
    pub latency_all_time: Vec<ToolLatency>,
    /// Operations now `unknown` or `needs_review`.
    pub outcome_unknown: i64,
    /// Age of the oldest of them (since it was accepted).
    pub oldest_unknown_age_ms: Option<i64>,
    /// Intents with more than one committed downstream effect (must be 0).
    pub side_effect_duplicates: i64,
    /// Per tool (of the slice): retry budget, circuit breaker, rate-limit cooldown.
    pub resilience: Vec<ToolResilience>,
    /// Metrics the design names that are not exported yet, and why.
    pub not_tracked: Vec<NotTracked>,
}

impl MetricsSnapshot {
    /// A family by name.
    pub fn family(&self, name: &str) -> Option<&Family> {
        self.families.iter().find(|f| f.name == name)
    }

    /// The sum of a family's sample values whose labels include all of `labels`.
    pub fn total(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.family(name).map_or(0.0, |f| {
            f.samples
                .iter()
                .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k).map(String::as_str) == Some(*v)))
                .map(|s| s.value)
                .sum()
        })
    }

    /// A rate series by name.
    pub fn rate(&self, name: &str) -> Option<&Rate> {
        self.rates.iter().find(|r| r.name == name)
    }
}

/// Every metric the design names is exported; the list stays for metrics a
/// later version names before it exports them.
const NOT_TRACKED: [NotTracked; 0] = [];

/// The retry budget and the circuit breaker, as they stand in the ledger (every
/// process shares them): tokens left per tool, and per tool the state of its
/// downstream's circuit, with since when it is open. Returns the same per tool,
/// with the rate-limit cooldowns, for screens.
fn resilience_families(families: &mut Vec<Family>, engine: &Engine, raw: &Raw, slice: &Slice) -> Vec<ToolResilience> {
    let mut tools = Vec::new();
    let mut tokens = BTreeMap::new();
    let mut capacity = BTreeMap::new();
    let mut state = BTreeMap::new();
    let mut open_since = BTreeMap::new();
    for c in engine.contracts().all() {
        if slice.tool.as_deref().is_some_and(|t| t != c.name) || slice.risk.as_deref().is_some_and(|r| r != c.risk) {
            continue;
        }
        let tool = BTreeMap::from([("tool", c.name.clone())]);
        let cap = f64::from(c.retry.budget_burst);
        // A tool without a row has a full bucket.
        let left = raw
            .budgets
            .iter()
            .find(|b| b.tool == c.name)
            .map_or(cap, |b| b.tokens_milli as f64 / crate::store::MILLI_TOKEN as f64);
        tokens.insert(tool.clone(), left);
        capacity.insert(tool, cap);
        let downstream = c.downstream.as_str();
        let row = raw.circuits.iter().find(|r| r.downstream == downstream);
        let current = row.map_or(CircuitState::Closed, |r| r.state);
        for s in CircuitState::ALL {
            let labels = BTreeMap::from([
                ("tool", c.name.clone()),
                ("downstream", downstream.to_string()),
                ("state", s.as_str().to_string()),
            ]);
            state.insert(labels, if *s == current { 1.0 } else { 0.0 });
        }
        let mut since_ms = None;
        if let (Some(r), CircuitState::Open) = (row, current) {
            if let Some(until) = r.open_until {
                let since = until - c.circuit.cool_down_ms as i64;
                let labels = BTreeMap::from([("tool", c.name.clone()), ("downstream", downstream.to_string())]);
                open_since.insert(labels, since as f64 / 1000.0);
                since_ms = Some(since);
            }
        }
        let cap_milli = i64::from(c.retry.budget_burst) * crate::store::MILLI_TOKEN;
        let limited = raw.rate_limited.iter().find(|r| r.tool == c.name);
        tools.push(ToolResilience {
            tool: c.name.clone(),
            downstream: downstream.to_string(),
            budget_milli: raw.budgets.iter().find(|b| b.tool == c.name).map_or(cap_milli, |b| b.tokens_milli),
            capacity_milli: cap_milli,
            circuit: current,
            open_since_ms: since_ms,
            next_probe_ms: match current {
                CircuitState::Open => row.and_then(|r| r.open_until),
                CircuitState::HalfOpen => row.and_then(|r| r.probe_until),
                CircuitState::Closed | CircuitState::Unrecognized => None,
            },
            rate_limited: limited.map_or(0, |r| r.waiting),
            rate_limited_until_ms: limited.map(|r| r.until),
        });
    }
    families.push(Family {
        name: "toolgate_retry_budget_tokens",
        help: "Automatic retries the tool's retry budget allows now (tokens left in its bucket).",
        kind: Kind::Gauge,
        samples: samples_of(tokens),
    });
    families.push(Family {
        name: "toolgate_retry_budget_capacity",
        help: "The size of the tool's retry budget bucket, in retries.",
        kind: Kind::Gauge,
        samples: samples_of(capacity),
    });
    families.push(Family {
        name: "toolgate_circuit_state",
        help: "The circuit breaker of the tool's downstream: 1 for its current state.",
        kind: Kind::Gauge,
        samples: samples_of(state),
    });
    families.push(Family {
        name: "toolgate_circuit_open_since_seconds",
        help: "Since when (Unix seconds) the circuit of the tool's downstream is open; absent when it is not.",
        kind: Kind::Gauge,
        samples: samples_of(open_since),
    });
    tools
}

/// What every event-based series is labelled with.
struct Labeler<'a> {
    risk: &'a HashMap<String, String>,
}

fn or_none(s: &str) -> String {
    if s.is_empty() {
        "none".to_string()
    } else {
        s.to_string()
    }
}

fn code_label(code: &str) -> String {
    if code.is_empty() {
        "OK".to_string()
    } else {
        code.to_string()
    }
}

impl Labeler<'_> {
    fn risk_of(&self, tool: &str) -> String {
        self.risk.get(tool).cloned().unwrap_or_else(|| "none".to_string())
    }

    fn base(&self, tool: &str, tenant_ref: &str, version: &str) -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("tool", or_none(tool)),
            ("tenant", or_none(tenant_ref)),
            ("risk", self.risk_of(tool)),
            ("version", or_none(version)),
        ])
    }

    fn row(&self, r: &MetricRow) -> BTreeMap<&'static str, String> {
        self.base(&r.tool, &r.tenant_ref, &r.tool_version)
    }

    fn keep(&self, slice: &Slice, tool: &str, tenant_ref: &str, version: &str) -> bool {
        slice.tool.as_deref().is_none_or(|t| t == tool)
            && slice.tenant_ref.as_deref().is_none_or(|t| t == tenant_ref)
            && slice.version.as_deref().is_none_or(|v| v == version)
            && slice.risk.as_deref().is_none_or(|k| k == self.risk_of(tool))
    }
}

/// `Some(extra labels)` when a rollup row counts towards a counter.
type Extra = fn(&MetricRow) -> Option<Vec<(&'static str, String)>>;
/// Whether a per-minute row counts towards a rate.
type Pred = fn(&MetricRow) -> bool;

/// One event-based counter: which rollup rows it counts and how it labels them.
struct CounterDef {
    name: &'static str,
    help: &'static str,
    /// `Some(labels)` when the row counts, with its extra labels.
    extra: Extra,
}

fn is_conflict(code: &str) -> Option<&'static str> {
    match code {
        "IDEMPOTENCY_CONFLICT" => Some("idempotency_key"),
        "CALL_ID_CONFLICT" => Some("call_id"),
        _ => None,
    }
}

const COUNTERS: &[CounterDef] = &[
    CounterDef {
        name: "toolgate_dispatches_total",
        help: "Dispatch calls answered, by code, outcome and delivery (code OK: succeeded).",
        extra: |r| {
            (r.answer == AnswerKind::Dispatch).then(|| {
                vec![
                    ("code", code_label(&r.code)),
                    ("outcome", or_none(&r.outcome)),
                    ("delivery", or_none(&r.delivery)),
                ]
            })
        },
    },
    CounterDef {
        name: "toolgate_status_queries_total",
        help: "Explicit status queries answered, by code, outcome and delivery.",
        extra: |r| {
            (r.answer == AnswerKind::Query).then(|| {
                vec![
                    ("code", code_label(&r.code)),
                    ("outcome", or_none(&r.outcome)),
                    ("delivery", or_none(&r.delivery)),
                ]
            })
        },
    },
    CounterDef {
        name: "toolgate_idempotency_hits_total",
        help: "Dispatches that found their intent already in the ledger and did not execute it again, by result.",
        extra: |r| {
            (r.step == Step::Idempotency
                && !r.reason.is_empty()
                && !reason_in(&r.reason, &[Reason::Conflict, Reason::Tampered]))
            .then(|| vec![("result", r.reason.clone())])
        },
    },
    CounterDef {
        name: "toolgate_idempotency_conflicts_total",
        help: "Calls refused because the key or the call id was bound to another request, by kind and call.",
        extra: |r| {
            let kind = is_conflict(&r.code)?;
            (!r.answer.is_empty()).then(|| vec![("kind", kind.to_string()), ("call", r.answer.clone())])
        },
    },
    CounterDef {
        name: "toolgate_approvals_required_total",
        help: "New approval requests created by dispatches (reason approval_expired: the previous one lapsed).",
        extra: |r| {
            (r.answer == AnswerKind::Dispatch
                && r.code == "APPROVAL_REQUIRED"
                && reason_in(&r.reason, &[Reason::ApprovalRequired, Reason::ApprovalExpired]))
            .then(|| vec![("reason", r.reason.clone())])
        },
    },
    CounterDef {
        name: "toolgate_approval_decisions_total",
        help: "Approval decisions: approved, denied, expired (found lapsed when approving) or invalid (refused).",
        extra: |r| {
            if r.step != Step::Approval {
                return None;
            }
            let approving = r.answer == AnswerKind::Approve;
            let decision = match &r.reason {
                x if *x == Reason::Approved => "approved",
                x if *x == Reason::Denied => "denied",
                x if *x == Reason::ApprovalExpired && approving => "expired",
                _ if approving => "invalid",
                _ => return None,
            };
            Some(vec![("decision", decision.to_string()), ("reason", or_none(&r.reason))])
        },
    },
    CounterDef {
        name: "toolgate_auth_denied_total",
        help:
            "Authorization refusals (POLICY_DENIED, SUBJECT_DISABLED, NOT_FOUND) of callers and of workers' re-checks.",
        extra: |r| {
            let counted = !r.answer.is_empty() || r.step == Step::RecheckFailed;
            (matches!(r.code.as_str(), "POLICY_DENIED" | "SUBJECT_DISABLED" | "NOT_FOUND") && counted).then(|| {
                let call = if r.answer.is_empty() { "worker".to_string() } else { r.answer.clone() };
                vec![("code", r.code.clone()), ("call", call)]
            })
        },
    },
    CounterDef {
        name: "toolgate_timeouts_total",
        help: "Timeouts by stage: before_send (deadline passed, nothing sent), connect, response, handler.",
        extra: |r| (!r.timeout_stage.is_empty()).then(|| vec![("stage", r.timeout_stage.clone())]),
    },
    CounterDef {
        name: "toolgate_outcome_unknown_total",
        help: "Operations parked as unknown (or needs_review) after a send whose outcome cannot be known, by code.",
        extra: |r| {
            reason_in(&r.reason, &[Reason::ParkedUnknown, Reason::NeedsReview])
                .then(|| vec![("code", code_label(&r.code)), ("state", r.reason.clone())])
        },
    },
    CounterDef {
        name: "toolgate_reconciliations_total",
        help: "Downstream receipt lookups of status queries, by result (reconciled, not_found, unavailable, mismatch).",
        extra: |r| {
            (r.step == Step::Query
                && reason_in(&r.reason, &[Reason::Reconciled, Reason::NotFound, Reason::Unavailable, Reason::Mismatch]))
            .then(|| vec![("result", r.reason.clone())])
        },
    },
    CounterDef {
        name: "toolgate_rate_limits_total",
        help: "Downstream 429 replies (each one provably not accepted).",
        extra: |r| (r.step == Step::DownstreamReply && r.code == "RATE_LIMIT").then(Vec::new),
    },
    CounterDef {
        name: "toolgate_retries_total",
        help: "Delivery attempts after the first (claimed with attempt > 1).",
        extra: |r| (r.step == Step::Claimed && r.reason == Reason::Retry).then(Vec::new),
    },
    CounterDef {
        name: "toolgate_retry_exhausted_total",
        help: "Retryable failures returned to the caller because the attempt cap or the deadline was reached.",
        extra: |r| {
            let limit = match &r.reason {
                x if *x == Reason::AttemptsExhausted => "attempts",
                x if *x == Reason::DeadlineExhausted => "deadline",
                _ => return None,
            };
            Some(vec![("limit", limit.to_string()), ("code", code_label(&r.code))])
        },
    },
    CounterDef {
        name: "toolgate_downstream_replies_total",
        help: "Replies of downstream attempts, by result (late: after the lease was lost, evidence only).",
        extra: |r| {
            (r.step == Step::DownstreamReply || r.step == Step::LateReply)
                .then(|| vec![("result", or_none(&r.reason)), ("code", code_label(&r.code))])
        },
    },
    CounterDef {
        name: "toolgate_resolutions_total",
        help: "Human resolutions of unknown / needs_review operations (refused: the attempt was refused).",
        extra: |r| (r.step == Step::Resolution).then(|| vec![("resolution", or_none(&r.reason))]),
    },
    CounterDef {
        name: "toolgate_reaped_total",
        help: "Expired leases handled by the reaper, by what it did.",
        extra: |r| (r.step == Step::Reaped).then(|| vec![("action", or_none(&r.reason))]),
    },
];

/// Whether a stored reason is one of these.
fn reason_in(stored: &str, any: &[Reason]) -> bool {
    any.iter().any(|r| *stored == *r)
}

/// Rate series of the window: name and predicate over per-minute rows.
const RATES: &[(&str, Pred)] = &[
    ("dispatches", |r| r.answer == AnswerKind::Dispatch),
    ("committed", |r| r.answer == AnswerKind::Dispatch && r.outcome == "committed"),
    ("replays", |r| r.answer == AnswerKind::Dispatch && r.delivery == "local_replay"),
    ("conflicts", |r| r.answer == AnswerKind::Dispatch && is_conflict(&r.code).is_some()),
    ("unknown", |r| reason_in(&r.reason, &[Reason::ParkedUnknown, Reason::NeedsReview])),
    ("auth_denied", |r| {
        !r.answer.is_empty() && matches!(r.code.as_str(), "POLICY_DENIED" | "SUBJECT_DISABLED" | "NOT_FOUND")
    }),
    ("rate_limits", |r| r.step == Step::DownstreamReply && r.code == "RATE_LIMIT"),
    ("retries", |r| r.step == Step::Claimed && r.reason == Reason::Retry),
    ("queries", |r| r.answer == AnswerKind::Query),
];

/// Everything read from the database in one snapshot transaction.
struct Raw {
    totals: Vec<MetricRow>,
    minutes: Vec<MetricRow>,
    latency_totals: Vec<LatencyRow>,
    latency_minutes: Vec<LatencyRow>,
    open: Vec<OpenOperationsRow>,
    approvals: Vec<ApprovalStateRow>,
    effects: i64,
    duplicates: i64,
    budgets: Vec<crate::store::RetryBudgetRow>,
    circuits: Vec<crate::store::CircuitRow>,
    rate_limited: Vec<crate::store::RateLimitedRow>,
}

/// Computes every metric at the engine clock's now, for one window and slice.
/// Reads the rollups and a few small ledger aggregates in one read transaction;
/// nothing here scans the trace.
pub fn snapshot(engine: &mut Engine, window: Window, slice: &Slice) -> Result<MetricsSnapshot, EngineError> {
    let now = engine.clock().now_ms();
    let risk: HashMap<String, String> =
        engine.contracts().all().iter().map(|c| (c.name.clone(), c.risk.clone())).collect();
    let end_minute = now.div_euclid(60_000) + 1;
    let start_minute = end_minute - window.span_minutes;
    let referee = engine.effect_counts()?;
    let raw = engine.read(|tx| -> Result<Raw, StoreError> {
        Ok(Raw {
            totals: tx.metric_totals()?,
            minutes: tx.metric_minutes(start_minute, end_minute)?,
            latency_totals: tx.latency_totals()?,
            latency_minutes: tx.latency_minutes(start_minute, end_minute)?,
            open: tx.open_operations()?,
            approvals: tx.approval_states(now)?,
            effects: referee.effects,
            duplicates: referee.duplicates,
            budgets: tx.retry_budgets()?,
            circuits: tx.circuits()?,
            rate_limited: tx.rate_limited(now)?,
        })
    })?;
    // The ledger's own rows hold the tenant itself: hash it before it is a label.
    let mut tenant_refs: HashMap<String, String> = HashMap::new();
    for t in raw.open.iter().map(|o| &o.tenant).chain(raw.approvals.iter().map(|a| &a.tenant)) {
        if !tenant_refs.contains_key(t) {
            tenant_refs.insert(t.clone(), engine.hashed("tenant", t));
        }
    }
    let lab = Labeler { risk: &risk };
    let keep_row = |r: &MetricRow| lab.keep(slice, &r.tool, &r.tenant_ref, &r.tool_version);
    let keep_lat = |r: &LatencyRow| lab.keep(slice, &r.tool, &r.tenant_ref, &r.tool_version);
    let tenant_ref = |t: &str| tenant_refs.get(t).cloned().unwrap_or_default();

    let mut families = Vec::new();
    for def in COUNTERS {
        let mut acc: BTreeMap<BTreeMap<&'static str, String>, f64> = BTreeMap::new();
        for r in raw.totals.iter().filter(|r| keep_row(r)) {
            if let Some(extra) = (def.extra)(r) {
                let mut labels = lab.row(r);
                labels.extend(extra);
                *acc.entry(labels).or_default() += r.events as f64;
            }
        }
        families.push(Family { name: def.name, help: def.help, kind: Kind::Counter, samples: samples_of(acc) });
    }
    let mut steps: BTreeMap<BTreeMap<&'static str, String>, f64> = BTreeMap::new();
    for r in raw.totals.iter().filter(|r| keep_row(r)) {
        *steps.entry(BTreeMap::from([("step", r.step.clone())])).or_default() += r.events as f64;
    }
    families.push(Family {
        name: "toolgate_trace_events_total",
        help: "Trace events written, by pipeline step.",
        kind: Kind::Counter,
        samples: samples_of(steps),
    });

    // Gauges from the ledger's current state.
    let mut open: BTreeMap<BTreeMap<&'static str, String>, f64> = BTreeMap::new();
    let mut oldest: BTreeMap<BTreeMap<&'static str, String>, i64> = BTreeMap::new();
    let (mut unknown, mut oldest_unknown) = (0, None::<i64>);
    for o in &raw.open {
        let tref = tenant_ref(&o.tenant);
        if !lab.keep(slice, &o.tool, &tref, &o.tool_version) {
            continue;
        }
        let base = lab.base(&o.tool, &tref, &o.tool_version);
        let mut labels = base.clone();
        labels.insert("state", o.state.to_string());
        *open.entry(labels).or_default() += o.count as f64;
        if o.state.is_unknown_queue() {
            unknown += o.count;
            oldest_unknown = Some(oldest_unknown.map_or(o.oldest_created_at, |t| t.min(o.oldest_created_at)));
            let e = oldest.entry(base).or_insert(o.oldest_created_at);
            *e = (*e).min(o.oldest_created_at);
        }
    }
    families.push(Family {
        name: "toolgate_operations_open",
        help: "Operations not yet terminal, by state (accepted, in_flight, unknown, needs_review).",
        kind: Kind::Gauge,
        samples: samples_of(open),
    });
    families.push(Family {
        name: "toolgate_outcome_unknown_oldest_age_seconds",
        help: "Age of the oldest unknown or needs_review operation (since it was accepted).",
        kind: Kind::Gauge,
        samples: samples_of(oldest.into_iter().map(|(l, t)| (l, (now - t).max(0) as f64 / 1000.0)).collect()),
    });
    let mut approvals: BTreeMap<BTreeMap<&'static str, String>, f64> = BTreeMap::new();
    // Approval requests carry no tool version: a version slice does not filter them.
    let unversioned = Slice { version: None, ..slice.clone() };
    for a in &raw.approvals {
        let tref = tenant_ref(&a.tenant);
        if !lab.keep(&unversioned, &a.tool, &tref, "") {
            continue;
        }
        let labels = BTreeMap::from([
            ("tool", or_none(&a.tool)),
            ("tenant", or_none(&tref)),
            ("risk", lab.risk_of(&a.tool)),
            ("state", a.state.clone()),
        ]);
        *approvals.entry(labels).or_default() += a.count as f64;
    }
    families.push(Family {
        name: "toolgate_approval_requests",
        help: "Approval requests by state; a pending request past its expiry counts as expired.",
        kind: Kind::Gauge,
        samples: samples_of(approvals),
    });
    let unsliced = |v: f64| vec![Sample { labels: BTreeMap::new(), value: v, histogram: None }];
    families.push(Family {
        name: "toolgate_side_effect_duplicates",
        help: "Business intents with more than one committed downstream effect (must be 0).",
        kind: Kind::Gauge,
        samples: unsliced(raw.duplicates as f64),
    });
    if let Some(clock) = engine.clock_status() {
        families.push(Family {
            name: "toolgate_clock_offset_ms",
            help: "This host's wall clock minus ledger time (the database's clock, or the SQLite host's anchor).",
            kind: Kind::Gauge,
            samples: unsliced(clock.offset_ms as f64),
        });
        families.push(Family {
            name: "toolgate_clock_paused",
            help: "1 while the ledger's clock pauses reaping and purging on this host (see toolgate clock).",
            kind: Kind::Gauge,
            samples: unsliced(if clock.paused.is_some() { 1.0 } else { 0.0 }),
        });
    }
    families.push(Family {
        name: "toolgate_downstream_effects_total",
        help: "Effects the simulated downstream providers committed.",
        kind: Kind::Counter,
        samples: unsliced(raw.effects as f64),
    });

    let resilience = resilience_families(&mut families, engine, &raw, slice);

    // Latency of answered calls.
    let mut hist: BTreeMap<BTreeMap<&'static str, String>, Histogram> = BTreeMap::new();
    for r in raw.latency_totals.iter().filter(|r| keep_lat(r)) {
        let mut labels = lab.base(&r.tool, &r.tenant_ref, &r.tool_version);
        labels.insert("call", r.answer.clone());
        hist.entry(labels).or_default().add_bucket(r.bucket_us, r.count as u64);
    }
    let mut sums: BTreeMap<BTreeMap<&'static str, String>, i64> = BTreeMap::new();
    for r in raw.totals.iter().filter(|r| keep_row(r) && !r.answer.is_empty()) {
        let mut labels = lab.row(r);
        labels.insert("call", r.answer.clone());
        *sums.entry(labels).or_default() += r.latency_sum_us;
    }
    let samples = hist
        .into_iter()
        .map(|(labels, h)| {
            let sum_us = sums.get(&labels).copied().unwrap_or(0);
            let count = h.count();
            let mut buckets: Vec<(f64, u64)> =
                PROMETHEUS_BOUNDS_US.iter().map(|b| (*b as f64 / 1e6, h.count_le(*b))).collect();
            buckets.push((f64::INFINITY, count));
            Sample {
                labels,
                value: count as f64,
                histogram: Some(HistogramSample { buckets, sum_seconds: sum_us as f64 / 1e6, count }),
            }
        })
        .collect();
    families.push(Family {
        name: "toolgate_call_duration_seconds",
        help: "Latency of answered calls (dispatch, query, approve) as their callers saw it.",
        kind: Kind::Histogram,
        samples,
    });

    families.push(Family {
        name: "toolgate_connections_refused_total",
        help: "Connections refused because their client address held too many at once (serve --max-connections-per-client), by this process since it started.",
        kind: Kind::Counter,
        samples: vec![Sample {
            labels: BTreeMap::new(),
            value: CONNECTIONS_REFUSED.load(std::sync::atomic::Ordering::Relaxed) as f64,
            histogram: None,
        }],
    });

    // This process's authentication refusals: counted in memory, not in the
    // ledger (a flood of bad tokens is sampled there at most once a second).
    families.push(Family {
        name: "toolgate_auth_refusals_total",
        help: "Requests refused for their token (missing, malformed, unknown, expired, revoked), by this process since it started.",
        kind: Kind::Counter,
        samples: crate::engine::tokens::AUTH_REFUSALS
            .totals()
            .into_iter()
            .map(|(reason, n)| Sample {
                labels: [("reason", reason.to_string())].into_iter().collect(),
                value: n as f64,
                histogram: None,
            })
            .collect(),
    });

    // The window: rates per bucket and percentiles.
    let buckets = (window.span_minutes / window.bucket_minutes).max(1) as usize;
    let mut rates: Vec<Rate> =
        RATES.iter().map(|(name, _)| Rate { name, counts: vec![0; buckets], total: 0 }).collect();
    for r in raw.minutes.iter().filter(|r| keep_row(r)) {
        let Some(minute) = r.minute else { continue };
        let i = ((minute - start_minute) / window.bucket_minutes).clamp(0, buckets as i64 - 1) as usize;
        for (rate, (_, pred)) in rates.iter_mut().zip(RATES) {
            if pred(r) {
                rate.counts[i] += r.events;
                rate.total += r.events;
            }
        }
    }
    let per_tool = |rows: &[LatencyRow]| -> Vec<ToolLatency> {
        let mut by_tool: BTreeMap<String, Histogram> = BTreeMap::new();
        for r in rows.iter().filter(|r| r.answer == AnswerKind::Dispatch && keep_lat(r)) {
            by_tool.entry(or_none(&r.tool)).or_default().add_bucket(r.bucket_us, r.count as u64);
        }
        by_tool
            .into_iter()
            .map(|(tool, h)| ToolLatency { tool, count: h.count(), percentiles: h.percentiles() })
            .collect()
    };
    Ok(MetricsSnapshot {
        generated_at_ms: now,
        window: WindowInfo {
            start_ms: start_minute * 60_000,
            end_ms: end_minute * 60_000,
            bucket_ms: window.bucket_minutes * 60_000,
        },
        families,
        rates,
        latency_window: per_tool(&raw.latency_minutes),
        latency_all_time: per_tool(&raw.latency_totals),
        outcome_unknown: unknown,
        oldest_unknown_age_ms: oldest_unknown.map(|t| (now - t).max(0)),
        side_effect_duplicates: raw.duplicates,
        resilience,
        not_tracked: NOT_TRACKED.to_vec(),
    })
}

fn samples_of(acc: BTreeMap<BTreeMap<&'static str, String>, f64>) -> Vec<Sample> {
    acc.into_iter().map(|(labels, value)| Sample { labels, value, histogram: None }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_whole_buckets() {
        assert_eq!(Window::with_buckets(15, 4), Window { span_minutes: 16, bucket_minutes: 4 });
        assert_eq!(Window::with_buckets(0, 0), Window { span_minutes: 1, bucket_minutes: 1 });
        assert_eq!(Window::last_minutes(60).span_minutes, 60);
        assert_eq!(minutes_retained_from(MINUTES_RETAINED * 60_000 + 59_999), 0);
    }
}
