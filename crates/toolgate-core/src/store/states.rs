//! The states the ledger's rows move through, as types. The store reads and
//! writes them as their stored text; everything above it matches on variants.
//!
//! Stored text that is none of a type's values (only a hand edit that got
//! past the CHECK constraints leaves one) reads as `Unrecognized`, so the row
//! still loads: the engine refuses it (`STATUS_CONFLICT`) and `toolgate audit`
//! reports the text itself. `Unrecognized` is never written.

use serde::Serialize;

use super::sql::Col;
use super::StoreError;

macro_rules! state_enum {
    (
        $(#[$meta:meta])*
        $name:ident { $( $(#[$vmeta:meta])* $var:ident => $text:literal, )* }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $var, )*
            /// Stored text that is none of the above (a hand edit).
            Unrecognized,
        }

        impl $name {
            /// Every value, in the order the type lists them (not `Unrecognized`).
            pub const ALL: &'static [$name] = &[$($name::$var),*];

            /// The stored text (`Unrecognized` shows as `?`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $( $name::$var => $text, )*
                    $name::Unrecognized => "?",
                }
            }

            /// The value a text names, if any (user input: `None` is a refusal).
            pub fn parse(text: &str) -> Option<Self> {
                match text {
                    $( $text => Some($name::$var), )*
                    _ => None,
                }
            }

            fn stored(text: &str) -> Self {
                Self::parse(text).unwrap_or($name::Unrecognized)
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                // `pad`: a width or alignment (`{:<13}` in a table) applies.
                f.pad(self.as_str())
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.as_str() == other && *self != $name::Unrecognized
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self == *other
            }
        }

        // Stored text read back as text (a trace row keeps whatever an older
        // version wrote) compared with a value: `row.step == Step::Query`.
        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                other == self.as_str()
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                other == self
            }
        }

        impl Col for $name {
            fn lite(r: &rusqlite::Row<'_>, i: usize) -> Result<Self, StoreError> {
                Ok(Self::stored(&<String as Col>::lite(r, i)?))
            }
            fn pg(r: &postgres::Row, i: usize) -> Result<Self, StoreError> {
                Ok(Self::stored(&<String as Col>::pg(r, i)?))
            }
        }

        impl Col for Option<$name> {
            fn lite(r: &rusqlite::Row<'_>, i: usize) -> Result<Self, StoreError> {
                Ok(<Option<String> as Col>::lite(r, i)?.map(|t| $name::stored(&t)))
            }
            fn pg(r: &postgres::Row, i: usize) -> Result<Self, StoreError> {
                Ok(<Option<String> as Col>::pg(r, i)?.map(|t| $name::stored(&t)))
            }
        }

        impl rusqlite::ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
                Ok(rusqlite::types::ToSqlOutput::from(self.as_str()))
            }
        }

        impl postgres::types::ToSql for $name {
            fn to_sql(
                &self,
                ty: &postgres::types::Type,
                out: &mut bytes::BytesMut,
            ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
                self.as_str().to_sql(ty, out)
            }

            fn accepts(ty: &postgres::types::Type) -> bool {
                <&str as postgres::types::ToSql>::accepts(ty)
            }

            postgres::types::to_sql_checked!();
        }
    };
}

state_enum! {
    /// Where an operation is (docs/design.md §6).
    OpState {
        /// Accepted, nothing sent.
        Accepted => "accepted",
        /// A leased attempt (or a re-queued possibly-sent one).
        InFlight => "in_flight",
        /// Committed downstream, result recorded.
        Succeeded => "succeeded",
        /// Definitive, no effect.
        Failed => "failed",
        /// The outcome cannot be known: waits for a status query or a human.
        Unknown => "unknown",
        /// Evidence contradicts the ledger: a human decides.
        NeedsReview => "needs_review",
        /// A human decided.
        Resolved => "resolved",
    }
}

impl OpState {
    /// Terminal: nothing will change it again (only retention removes it).
    pub fn is_terminal(self) -> bool {
        matches!(self, OpState::Succeeded | OpState::Failed | OpState::Resolved)
    }

    /// In the unknown queue (`unknown` or `needs_review`): only a status
    /// query or a person's decision moves it on.
    pub fn is_unknown_queue(self) -> bool {
        matches!(self, OpState::Unknown | OpState::NeedsReview)
    }

    /// On its way: accepted or in flight, with no outcome yet (what a
    /// cancellation can still stop).
    pub fn is_in_progress(self) -> bool {
        matches!(self, OpState::Accepted | OpState::InFlight)
    }
}

state_enum! {
    /// Where an operation's delivery row is.
    OutboxState {
        /// Waiting for a worker (due at `available_at`).
        Pending => "pending",
        /// A worker holds the lease.
        Leased => "leased",
        /// Delivered (the operation is terminal).
        Done => "done",
        /// Parked: the operation waits for a status query or a human.
        Parked => "parked",
    }
}

state_enum! {
    /// Where an approval request is.
    ApprovalState {
        /// Waiting for an approver.
        Pending => "pending",
        /// Approved (its operation exists).
        Approved => "approved",
        /// Denied.
        Denied => "denied",
        /// Expired unapproved.
        Expired => "expired",
        /// A policy or contract change invalidated it.
        Invalidated => "invalidated",
    }
}

state_enum! {
    /// How a delivery attempt ended.
    AttemptOutcome {
        /// It never left.
        NotSent => "not_sent",
        /// Provably not received downstream.
        Refused => "refused",
        /// The downstream committed.
        Committed => "committed",
        /// The downstream answered with a definitive refusal.
        Rejected => "rejected",
        /// It may have been received.
        Unknown => "unknown",
    }
}

state_enum! {
    /// Where a downstream's circuit breaker is.
    CircuitState {
        /// Calls go through.
        Closed => "closed",
        /// Nothing is sent until `open_until`.
        Open => "open",
        /// One probe call may go; the rest wait for its outcome.
        HalfOpen => "half_open",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_round_trips_and_junk_is_unrecognized() {
        for s in OpState::ALL {
            assert_eq!(OpState::parse(s.as_str()), Some(*s));
            assert!(*s == s.as_str());
        }
        assert_eq!(OpState::parse("bogus"), None);
        assert_eq!(OpState::stored("bogus"), OpState::Unrecognized);
        assert!(OpState::Unrecognized != "?");
        assert_eq!(OutboxState::ALL.len() + ApprovalState::ALL.len() + AttemptOutcome::ALL.len(), 14);
    }
}

state_enum! {
    /// The pipeline step a trace event records (`trace_events.step`, the
    /// metrics' `step` label). Written only as these values; read back as text
    /// (a trace keeps the steps of older versions) and compared with them.
    Step {
        /// A call refused before it reached the ledger (bad input, unknown tool).
        Rejected => "rejected",
        /// A call arrived (the API's first event of a call).
        Received => "received",
        /// A call answered without a new decision (a replay).
        Answered => "answered",
        /// A read tool answered from local state.
        Read => "read",
        /// A bearer token checked (`toolgate serve`, `toolgate mcp`).
        Authentication => "authentication",
        /// The grant checked.
        Authorization => "authorization",
        /// The call identity checked or bound.
        CallIdentity => "call_identity",
        /// The scope looked up: fresh, replay, conflict.
        Idempotency => "idempotency",
        /// A stored row's digests did not match its contents.
        TamperDetected => "tamper_detected",
        /// The call's deadline passed.
        Deadline => "deadline",
        /// The downstream's circuit breaker decided or changed.
        Circuit => "circuit",
        /// The domain's business rules checked.
        BusinessRules => "business_rules",
        /// An approval requested, granted, denied or expired.
        Approval => "approval",
        /// The operation accepted (operation, outbox row and binding written).
        Accepted => "accepted",
        /// A worker leased the operation.
        Claimed => "claimed",
        /// A worker found nothing to do with a claimed operation.
        ClaimSkipped => "claim_skipped",
        /// The downstream's retry budget was spent.
        RetryBudget => "retry_budget",
        /// The downstream's bulkhead was full.
        Bulkhead => "bulkhead",
        /// The re-check before the send refused the operation.
        RecheckFailed => "recheck_failed",
        /// The sent-marker written: the request may reach the downstream.
        Sent => "sent",
        /// The downstream answered (or did not).
        DownstreamReply => "downstream_reply",
        /// A reply that came after the lease was lost.
        LateReply => "late_reply",
        /// The outcome recorded (fenced).
        Persisted => "persisted",
        /// The reaper moved an operation whose lease or deadline ran out.
        Reaped => "reaped",
        /// A cancellation.
        Cancel => "cancel",
        /// A status query against the downstream's receipts.
        Query => "query",
        /// A person's decision on an unknown or contested operation.
        Resolution => "resolution",
    }
}

state_enum! {
    /// The API call an answer event answers (`trace_events.answer`): what the
    /// metrics count dispatches, queries and approvals by.
    AnswerKind {
        /// `dispatch` (and read tools).
        Dispatch => "dispatch",
        /// A status query.
        Query => "query",
        /// An approval.
        Approve => "approve",
    }
}

/// `TraceEvent::default()` has no step yet: every constructor sets one, and
/// the store never writes `Unrecognized`.
impl Default for Step {
    fn default() -> Self {
        Step::Unrecognized
    }
}

macro_rules! reasons {
    ( $( $(#[$vmeta:meta])* $var:ident => $text:literal, )* ) => {
        /// Why a trace event's step decided what it did (`trace_events.reason`,
        /// a label of several metrics). Low cardinality, never free text: the
        /// engine writes only these, and a domain's business rules add their
        /// own rule names (`Rule`). Read back as text (a trace keeps what older
        /// versions wrote) and compared with a value: `row.reason == Reason::Retry`,
        /// so a misspelt reason is a compile error, not a counter that stays 0.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Reason {
            $( $(#[$vmeta])* $var, )*
            /// A domain's business rule refused the call (`ToolDomain::rules`).
            Rule(&'static str),
        }

        impl Reason {
            /// Every engine reason (not `Rule`).
            pub const ALL: &'static [Reason] = &[$(Reason::$var),*];

            /// The stored text.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( Reason::$var => $text, )*
                    Reason::Rule(name) => name,
                }
            }
        }
    };
}

reasons! {
    // Admission: who may call, and what the scope already holds.
    /// The caller's grant was checked now, not from the stored row.
    CurrentAuthorization => "current_authorization",
    /// The call id is bound to another request.
    CallIdConflict => "call_id_conflict",
    /// A stored row's digests did not match its contents.
    Tampered => "tampered",
    /// The lab's toggle masked a conflict (`toolgate lab`).
    LabConflictMasked => "lab_conflict_masked",
    /// The key is bound to another request.
    Conflict => "conflict",
    /// The stored answer, replayed.
    Replay => "replay",
    /// The stored human resolution, replayed.
    ReplayResolved => "replay_resolved",
    /// Proven never sent and due: executed by this caller.
    ProvenUnsentExecute => "proven_unsent_execute",
    /// Proven never sent, not due yet.
    ProvenUnsentNotDue => "proven_unsent_not_due",
    /// Another caller holds it.
    InProgress => "in_progress",
    /// The key's retention ended.
    KeyExpired => "key_expired",
    /// The deadline passed before the call was accepted.
    DeadlineBeforeAccept => "deadline_before_accept",
    /// The downstream's circuit is open.
    CircuitOpen => "circuit_open",
    /// An approval bound to another action.
    ApprovalMismatch => "approval_mismatch",
    /// An approval was requested.
    ApprovalRequired => "approval_required",
    /// An approval is still pending.
    ApprovalPending => "approval_pending",
    /// The approval was denied.
    ApprovalDenied => "approval_denied",
    /// The approval lapsed (a new one is requested).
    ApprovalExpired => "approval_expired",
    // Bearer tokens (`authentication` step).
    /// No token.
    TokenMissing => "token_missing",
    /// Not a token.
    TokenMalformed => "token_malformed",
    /// No such token.
    TokenUnknown => "token_unknown",
    /// The token expired.
    TokenExpired => "token_expired",
    /// The token was revoked.
    TokenRevoked => "token_revoked",
    // Claims and sends.
    /// No outbox row to claim.
    NoOutboxRow => "no_outbox_row",
    /// Another worker holds the lease.
    ClaimedElsewhere => "claimed_elsewhere",
    /// The outbox row is not pending.
    NotPending => "not_pending",
    /// The outbox row is not due yet.
    NotDue => "not_due",
    /// Another worker won the claim.
    LostRace => "lost_race",
    /// The deadline passed before a send.
    DeadlinePassed => "deadline_passed",
    /// The downstream's retry budget is spent.
    BudgetExhausted => "budget_exhausted",
    /// The downstream's bulkhead is full.
    BulkheadFull => "bulkhead_full",
    /// The first attempt.
    FirstAttempt => "first_attempt",
    /// A later attempt.
    Retry => "retry",
    /// The caller's grant no longer allows the call (the re-check before a send).
    Unauthorized => "authorization",
    /// The contract changed between accept and send.
    ContractRevisionChanged => "contract_revision_changed",
    // Replies.
    /// The lease was lost before the reply was recorded.
    LeaseLost => "lease_lost",
    /// The circuit opened.
    CircuitOpened => "circuit_opened",
    /// The circuit let a probe through.
    CircuitHalfOpen => "circuit_half_open",
    /// The circuit closed.
    CircuitClosed => "circuit_closed",
    /// Parked for a person (a status conflict).
    NeedsReview => "needs_review",
    /// Parked in the unknown queue.
    ParkedUnknown => "parked_unknown",
    /// The downstream committed.
    Committed => "committed",
    /// A refusal after an earlier attempt may have been received.
    RejectedAfterPossibleSend => "rejected_after_possible_send",
    /// The downstream refused.
    Rejected => "rejected",
    /// Another attempt is scheduled.
    RetryScheduled => "retry_scheduled",
    /// No attempts left.
    AttemptsExhausted => "attempts_exhausted",
    /// No time left before the deadline.
    DeadlineExhausted => "deadline_exhausted",
    /// The downstream refused toolgate's credentials.
    DownstreamAuthFailed => "downstream_auth_failed",
    // The reaper.
    /// A lapsed lease of an unsent attempt: re-queued.
    RequeuedUnsent => "requeued_unsent",
    /// A lapsed lease re-queued with the same downstream key.
    RequeuedSameKey => "requeued_same_key",
    // Cancellation.
    /// Cancelled after a send: moved to the unknown queue.
    CancelledAfterSend => "cancelled_after_send",
    /// Cancelled before anything was sent.
    CancelledBeforeSend => "cancelled_before_send",
    /// An operator action refused.
    Refused => "refused",
    // Status queries.
    /// A status_ref that does not parse.
    StatusRefMalformed => "status_ref_malformed",
    /// A status_ref not signed by this ledger.
    StatusRefForged => "status_ref_forged",
    /// An expected digest that is not one.
    BadExpectedDigest => "bad_expected_digest",
    /// No such operation.
    NoSuchOperation => "no_such_operation",
    /// Another principal's operation.
    OtherPrincipal => "other_principal",
    /// The query's scope is not the operation's.
    ScopeMismatch => "scope_mismatch",
    /// The operation changed while the downstream was asked.
    ChangedDuringLookup => "changed_during_lookup",
    /// A receipt bound to the request: the outcome recorded.
    Reconciled => "reconciled",
    /// A receipt that does not bind to the request.
    Mismatch => "mismatch",
    /// No receipt (yet).
    NotFound => "not_found",
    /// The lookup failed.
    Unavailable => "unavailable",
    /// The downstream has no lookup.
    Unsupported => "unsupported",
    /// A receipt that contradicts a person's resolution.
    ContradictsResolution => "contradicts_resolution",
    // Approvals decided.
    /// Approved.
    Approved => "approved",
    /// Denied.
    Denied => "denied",
    /// No such approval request.
    NoSuchApproval => "no_such_approval",
    /// The approver is not on the tenant's allowlist.
    NotAllowlisted => "not_allowlisted",
    /// A requester approving their own request.
    SelfApproval => "self_approval",
    /// The intent already has an operation.
    AlreadyAccepted => "already_accepted",
    /// The tool no longer exists.
    UnknownTool => "unknown_tool",
    /// The policy or contract changed since the request.
    RevisionChanged => "revision_changed",
    // A person's resolution.
    /// Resolved as succeeded.
    Succeeded => "succeeded",
    /// Resolved as failed.
    Failed => "failed",
    /// Resolved as compensated.
    Compensated => "compensated",
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl PartialEq<Reason> for String {
    fn eq(&self, other: &Reason) -> bool {
        self.as_str() == other.as_str()
    }
}

impl PartialEq<Reason> for str {
    fn eq(&self, other: &Reason) -> bool {
        self == other.as_str()
    }
}

#[cfg(test)]
mod reason_tests {
    use super::Reason;

    #[test]
    fn reasons_are_distinct_lower_case_labels() {
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            assert!(seen.insert(r.as_str()), "{r} twice");
            assert!(r.as_str().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{r}");
        }
        let stored = String::from("retry");
        assert!(stored == Reason::Retry && *stored != Reason::FirstAttempt);
        assert_eq!(Reason::Rule("refund_exceeds_capture").as_str(), "refund_exceeds_capture");
    }
}
