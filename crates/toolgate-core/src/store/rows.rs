//! Row types: plain data, one struct per table.

use super::sql::{Param, Row};
use super::states::{ApprovalState, AttemptOutcome, OpState, OutboxState};
use super::StoreError;
use serde::Serialize;

/// Defines a row struct whose fields are, in order, the columns a query selects.
/// The column list (`[NAME]`: a `const` of the table's column names), `from_row`
/// and `params` all come from the one field list, so they cannot drift apart.
macro_rules! row {
    (
        $(#[$meta:meta])*
        pub struct $name:ident $([$cols:ident])? {
            $( $(#[$fmeta:meta])* pub $field:ident : $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct $name {
            $( $(#[$fmeta])* pub $field: $ty, )*
        }
        $(
            pub(crate) const $cols: &str = $name::COLUMNS;
        )?
        impl $name {
            /// The column names, in field order.
            #[allow(dead_code)]
            pub(crate) const COLUMNS: &'static str = row!(@cols $($field)*);

            /// Number of columns.
            #[allow(dead_code)]
            pub(crate) const WIDTH: usize = [$(stringify!($field)),*].len();

            /// Reads the columns in field order.
            pub(crate) fn from_row(r: &Row<'_>) -> Result<Self, StoreError> {
                let mut i = 0..;
                let mut next = || i.next().unwrap_or(0);
                Ok(Self { $( $field: r.get(next())?, )* })
            }

            /// The values in column order (for an insert of every column).
            #[allow(dead_code)]
            pub(crate) fn params(&self) -> [&dyn Param; Self::WIDTH] {
                [$( &self.$field as &dyn Param ),*]
            }
        }
    };
    (@cols $first:ident $($rest:ident)*) => { concat!(stringify!($first) $(, ", ", stringify!($rest))*) };
}

/// `?1, ?2, …, ?n`: the placeholders of an insert of `n` columns.
pub(crate) fn placeholders(n: usize) -> String {
    use std::fmt::Write as _;
    // One buffer, not a string per parameter: an insert builds its SQL text
    // before the statement cache can answer for it.
    let mut s = String::with_capacity(n * 5);
    for i in 1..=n {
        if i > 1 {
            s.push_str(", ");
        }
        let _ = write!(s, "?{i}");
    }
    s
}

/// A tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TenantRow {
    /// Id.
    pub id: String,
    /// Refunds above this need approval.
    pub approval_threshold_minor: i64,
    /// Bumped on every policy change; pending approvals bound to an older one are invalid.
    pub policy_revision: i64,
}

/// Key of a call identity.
#[derive(Debug, Clone, Copy)]
pub struct CallKey<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Subject.
    pub subject: &'a str,
    /// Provider.
    pub provider: &'a str,
    /// API family.
    pub api_family: &'a str,
    /// Response id.
    pub response_id: &'a str,
    /// Call id.
    pub call_id: &'a str,
}

/// What a call identity is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallIdentityRow {
    /// `dispatch` or `query_status`.
    pub purpose: String,
    /// The request digest (for queries: the expected digest).
    pub request_sha256: String,
    /// SHA-256 of the idempotency key (for queries: of the status_ref).
    pub key_sha256: String,
    /// The operation, once one exists.
    pub operation_id: Option<String>,
}

row! {
    /// One row of the idempotency ledger.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct OperationRow [OP_COLS] {
        /// Operation id.
        pub id: String,
        /// Tenant.
        pub tenant: String,
        /// Subject.
        pub subject: String,
        /// Tool.
        pub tool: String,
        /// The caller's idempotency key (never serialized: screens and exports show its hash).
        #[serde(skip)]
        pub idem_key: String,
        /// SHA-256 of the key (what traces and screens show).
        pub key_sha256: String,
        /// Request digest.
        pub request_sha256: String,
        /// Canonical request JSON (its SHA-256 is `request_sha256`).
        pub request_json: String,
        /// Input revision.
        pub input_rev: i64,
        /// Output revision.
        pub output_rev: i64,
        /// Effect revision.
        pub effect_rev: i64,
        /// `write` or `external`.
        pub effect: String,
        /// Ledger state.
        pub state: OpState,
        /// Optimistic version, bumped on every change.
        pub version: i64,
        /// Opaque status handle.
        pub status_ref: String,
        /// The key the downstream sees, stable across attempts.
        pub downstream_key: String,
        /// Last code.
        pub code: Option<String>,
        /// Canonical result JSON.
        pub result_json: Option<String>,
        /// Result digest.
        pub result_sha256: Option<String>,
        /// Downstream request id.
        pub downstream_request_id: Option<String>,
        /// Downstream receipt id.
        pub receipt_id: Option<String>,
        /// Call binding digest.
        pub call_binding_sha256: String,
        /// Call identity: provider.
        pub call_provider: String,
        /// Call identity: API family.
        pub call_api_family: String,
        /// Call identity: response id.
        pub call_response_id: String,
        /// Call identity: call id.
        pub call_id: String,
        /// Call identity: adapter revision.
        pub adapter_revision: String,
        /// Approval that authorised it.
        pub approval_id: Option<String>,
        /// Human resolution.
        pub resolution: Option<String>,
        /// Resolution note.
        pub resolution_note: Option<String>,
        /// Resolving operator.
        pub resolved_by: Option<String>,
        /// Last explicit status query time.
        pub last_query_at: Option<i64>,
        /// Last explicit status query result.
        pub last_query_result: Option<String>,
        /// Created.
        pub created_at: i64,
        /// Last change.
        pub updated_at: i64,
        /// Operation deadline.
        pub deadline_at: i64,
        /// Earliest purge time: `terminal_at + retention_ms` once terminal (before
        /// that, creation + retention, and not used).
        pub expires_at: i64,
        /// How long the operation is kept once terminal.
        pub retention_ms: i64,
        /// When it became terminal (`succeeded`, `failed`, `resolved`); set by the store.
        pub terminal_at: Option<i64>,
        /// When it entered its current state; set by the store.
        pub state_since: Option<i64>,
    }
}

row! {
    /// One outbox row.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct OutboxRow [OUTBOX_COLS] {
        /// Operation.
        pub operation_id: String,
        /// Delivery state.
        pub state: OutboxState,
        /// Attempts claimed so far.
        pub attempt: i64,
        /// Attempt cap.
        pub max_attempts: i64,
        /// Lease holder.
        pub lease_owner: Option<String>,
        /// Lease end (expired at `until <= now`).
        pub lease_until: Option<i64>,
        /// Not before.
        pub available_at: i64,
        /// Last code seen.
        pub last_code: Option<String>,
    }
}

/// One delivery attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AttemptRow {
    /// Operation.
    pub operation_id: String,
    /// Attempt number (1-based).
    pub attempt: i64,
    /// Worker.
    pub owner: String,
    /// Claimed.
    pub claimed_at: i64,
    /// Sent-marker time.
    pub sent_at: Option<i64>,
    /// Finished.
    pub finished_at: Option<i64>,
    /// How it ended.
    pub outcome: Option<AttemptOutcome>,
    /// Code.
    pub code: Option<String>,
}

/// The code of an attempt that was sent and then taken from its sender (a
/// cancel, or the reaper after its lease expired) while the sender may still be
/// inside the downstream call: nobody heard how it ended.
pub const SENDER_DETACHED: &str = "SENDER_DETACHED";

impl AttemptRow {
    /// Provably never received downstream: never sent, or refused before acceptance.
    pub fn proven_not_received(&self) -> bool {
        self.sent_at.is_none() || matches!(self.outcome, Some(AttemptOutcome::Refused | AttemptOutcome::NotSent))
    }

    /// Until when a receipt of this attempt may still appear in a lookup: it
    /// may have been received (sent, not refused), the provider may commit it
    /// up to `sent_at + attempt_timeout_ms`, and a commit may take
    /// `visible_within_ms` to show. `None` when it was provably not received.
    pub fn receipt_may_appear_until(&self, attempt_timeout_ms: u64, visible_within_ms: u64) -> Option<i64> {
        let sent = self.sent_at?;
        (!self.proven_not_received())
            .then(|| sent.saturating_add(attempt_timeout_ms as i64).saturating_add(visible_within_ms as i64))
    }

    /// Until when this attempt may still land downstream: it was written to
    /// the wire and no answer ended it, because its sender is still in the call
    /// (no outcome yet) or was detached from it by a cancel or the reaper
    /// ([`SENDER_DETACHED`]); the provider may commit it up to the sender's own
    /// bound, `sent_at + attempt_timeout_ms`. `None` when it cannot land: never
    /// sent, or ended by its sender (an answer, or its own timeout).
    pub fn may_land_until(&self, attempt_timeout_ms: u64) -> Option<i64> {
        let sent = self.sent_at?;
        let detached = self.outcome == Some(AttemptOutcome::Unknown) && self.code.as_deref() == Some(SENDER_DETACHED);
        (self.outcome.is_none() || detached).then(|| sent.saturating_add(attempt_timeout_ms as i64))
    }
}

/// A receipt the ledger recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReceiptRow {
    /// Receipt id.
    pub receipt_id: String,
    /// Operation.
    pub operation_id: String,
    /// Downstream request id.
    pub request_id: String,
    /// Request digest the downstream recorded.
    pub body_sha256: String,
    /// Result digest.
    pub result_sha256: String,
    /// `reply` or `query`.
    pub source: String,
    /// When recorded.
    pub recorded_at: i64,
}

row! {
    /// One trace event.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct TraceRow [TRACE_COLS] {
        /// Sequence (assigned on insert).
        pub seq: i64,
        /// Time.
        pub at: i64,
        /// Operation, when one exists.
        pub operation_id: Option<String>,
        /// Pipeline step.
        pub step: String,
        /// Tool.
        pub tool: Option<String>,
        /// Code.
        pub code: Option<String>,
        /// Outcome.
        pub outcome: Option<String>,
        /// Delivery.
        pub delivery: Option<String>,
        /// Attempt.
        pub attempt: Option<i64>,
        /// Step duration.
        pub duration_us: Option<i64>,
        /// The other trace fields (docs/design.md §12), canonical JSON.
        pub fields: String,
        /// The API call this event answers (`dispatch`, `query`, `approve`), on
        /// exactly one event per call.
        pub answer: Option<String>,
        /// The whole call's latency, on answer events.
        pub latency_us: Option<i64>,
        /// Salted hash of the tenant.
        pub tenant_ref: Option<String>,
        /// Contract revisions as `input.output.effect`.
        pub tool_version: Option<String>,
        /// Where a timeout happened.
        pub timeout_stage: Option<String>,
        /// Low-cardinality classification of the step's decision.
        pub reason: Option<String>,
    }
}

row! {
    /// A pending (or decided) approval request holding the exact call.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct ApprovalRow [APPROVAL_COLS] {
        /// Approval id.
        pub id: String,
        /// Tenant.
        pub tenant: String,
        /// Requesting subject.
        pub subject: String,
        /// Tool.
        pub tool: String,
        /// Idempotency key of the held call.
        pub idem_key: String,
        /// Its hash.
        pub key_sha256: String,
        /// Request digest.
        pub request_sha256: String,
        /// Canonical request.
        pub request_json: String,
        /// Input revision.
        pub input_rev: i64,
        /// Output revision.
        pub output_rev: i64,
        /// Effect revision.
        pub effect_rev: i64,
        /// Tenant policy revision at request time.
        pub policy_revision: i64,
        /// Held call identity: provider.
        pub call_provider: String,
        /// Held call identity: API family.
        pub call_api_family: String,
        /// Held call identity: response id.
        pub call_response_id: String,
        /// Held call identity: call id.
        pub call_id: String,
        /// Held call identity: adapter revision.
        pub adapter_revision: String,
        /// Amount, for display.
        pub amount_minor: Option<i64>,
        /// Digest over everything the approval binds except the approver.
        pub base_sha256: String,
        /// Digest including the approver, once approved.
        pub approval_sha256: Option<String>,
        /// Approval state.
        pub state: ApprovalState,
        /// Who decided.
        pub decided_by: Option<String>,
        /// When.
        pub decided_at: Option<i64>,
        /// Denial note.
        pub note: Option<String>,
        /// The operation the approval created.
        pub operation_id: Option<String>,
        /// Deadline budget for the execution.
        pub deadline_ms: i64,
        /// Created.
        pub created_at: i64,
        /// Expiry (exclusive: `now == expires_at` is expired).
        pub expires_at: i64,
    }
}

row! {
    /// One operator-log row.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct AuditRow [AUDIT_COLS] {
        /// Sequence (assigned on insert).
        pub seq: i64,
        /// Time.
        pub at: i64,
        /// The operator action's own id (operator actions are idempotent).
        pub action_id: Option<String>,
        /// Who.
        pub actor: String,
        /// What (`approve`, `deny`, `query`, `resolve`, ...).
        pub action: String,
        /// Operation.
        pub operation_id: Option<String>,
        /// Approval.
        pub approval_id: Option<String>,
        /// `applied` or `refused`.
        pub result: String,
        /// Why.
        pub reason: String,
        /// Evidence seen, canonical JSON.
        pub evidence: String,
        /// SHA-256 of the row before (its content and link): the hash chain
        /// (migration 0007); `None` on rows written before it.
        pub chain_sha256: Option<String>,
    }
}

impl AuditRow {
    /// This row's hash, the link the next row carries: SHA-256 over a JSON array
    /// of every column, its own link included (unambiguous, order fixed).
    pub fn chain_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        let text = serde_json::json!([
            self.seq,
            self.at,
            self.action_id,
            self.actor,
            self.action,
            self.operation_id,
            self.approval_id,
            self.result,
            self.reason,
            self.evidence,
            self.chain_sha256,
        ])
        .to_string();
        hex::encode(Sha256::digest(text.as_bytes()))
    }
}

row! {
    /// One effect a simulated provider committed.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct EffectRow [EFFECT_COLS] {
        /// Provider name.
        pub provider: String,
        /// The key it was sent under.
        pub downstream_key: String,
        /// Business intent label (for duplicate counting).
        pub intent: String,
        /// Digest of the request body it received.
        pub body_sha256: String,
        /// Its request id.
        pub request_id: String,
        /// Its receipt id.
        pub receipt_id: String,
        /// The result it returned.
        pub result_json: String,
        /// Commit time.
        pub committed_at: i64,
        /// When lookups start to see it.
        pub visible_at: i64,
    }
}

// ---------------------------------------------------------- observability

row! {
    /// One series of the trace rollups (`metric_totals` / `metric_minutes`). Absent
    /// dimensions are empty strings.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct MetricRow {
        /// The minute (`at / 60000`), for per-minute rows.
        pub minute: Option<i64>,
        /// The API call answered (`dispatch`, `query`, `approve`), or empty.
        pub answer: String,
        /// Pipeline step.
        pub step: String,
        /// Tool.
        pub tool: String,
        /// Salted hash of the tenant.
        pub tenant_ref: String,
        /// Contract revisions `input.output.effect`.
        pub tool_version: String,
        /// Code.
        pub code: String,
        /// Outcome.
        pub outcome: String,
        /// Delivery.
        pub delivery: String,
        /// Timeout stage.
        pub timeout_stage: String,
        /// Decision class.
        pub reason: String,
        /// Events in the series.
        pub events: i64,
        /// Sum of the answer latencies in the series.
        pub latency_sum_us: i64,
    }
}

row! {
    /// One latency bucket of answered calls (`latency_totals` / `latency_minutes`).
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct LatencyRow {
        /// The minute, for per-minute rows.
        pub minute: Option<i64>,
        /// The API call answered.
        pub answer: String,
        /// Tool.
        pub tool: String,
        /// Salted hash of the tenant.
        pub tenant_ref: String,
        /// Contract revisions.
        pub tool_version: String,
        /// Upper bound of the bucket (latency rounded up to 3 significant digits).
        pub bucket_us: i64,
        /// Calls in the bucket.
        pub count: i64,
    }
}

row! {
    /// What is left of a purged operation (the audit log and the trace still
    /// point at its id): digests and dates, never arguments or results.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize)]
    pub struct TombstoneRow [TOMBSTONE_COLS] {
        /// The purged operation's id.
        pub operation_id: String,
        /// SHA-256 of the canonical `{tenant, subject, tool, idempotency_key}`.
        pub scope_sha256: String,
        /// Tool.
        pub tool: String,
        /// Its final state.
        pub final_state: String,
        /// Its final code.
        pub code: Option<String>,
        /// Request digest.
        pub request_sha256: String,
        /// Result digest.
        pub result_sha256: Option<String>,
        /// Downstream receipt id.
        pub receipt_id: Option<String>,
        /// Created.
        pub created_at: i64,
        /// Became terminal.
        pub terminal_at: i64,
        /// Purged.
        pub purged_at: i64,
        /// Why (`retention_ended`).
        pub reason: String,
    }
}

/// Non-terminal operations of one state, tool, tenant and contract revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OpenOperationsRow {
    /// State (`accepted`, `in_flight`, `unknown`, `needs_review`).
    pub state: OpState,
    /// Tool.
    pub tool: String,
    /// Tenant (raw: hash it before exporting).
    pub tenant: String,
    /// Contract revisions.
    pub tool_version: String,
    /// How many.
    pub count: i64,
    /// Creation time of the oldest.
    pub oldest_created_at: i64,
}

/// Approval requests of one tool, tenant and effective state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApprovalStateRow {
    /// Tool.
    pub tool: String,
    /// Tenant (raw: hash it before exporting).
    pub tenant: String,
    /// `pending`, `approved`, `denied`, `expired`, `invalidated`.
    pub state: String,
    /// How many.
    pub count: i64,
}
