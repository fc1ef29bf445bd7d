//! The error catalog and the two-part result envelope (docs/design.md §4).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Every stable error code a call can return.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Code {
    /// The tool is not in the catalog.
    UnknownTool,
    /// Arguments fail the input contract.
    InvalidArguments,
    /// A write or external tool was called without an idempotency key.
    IdempotencyKeyRequired,
    /// The resource does not exist for this subject (also: not owned, other tenant).
    NotFound,
    /// The subject has no grant for the tool.
    PolicyDenied,
    /// An operator disabled the subject or its whole tenant (`toolgate
    /// subject disable`, `toolgate tenant disable`): every call is refused,
    /// whatever its grants, until it is enabled again.
    SubjectDisabled,
    /// The business state forbids the action.
    BusinessRuleViolation,
    /// A call identity reused for another request, key or purpose.
    CallIdConflict,
    /// The same idempotency key with a different request.
    IdempotencyConflict,
    /// The action needs a human approval first.
    ApprovalRequired,
    /// The approval is expired, mismatched, denied or by a wrong approver.
    ApprovalInvalid,
    /// The deadline passed before anything was sent: provably no effect.
    TimeoutBeforeExecute,
    /// The downstream asked us to slow down (Retry-After).
    RateLimit,
    /// The downstream refused before accepting, or the circuit is open.
    ToolUnavailable,
    /// The downstream refused toolgate's own credentials (401/403): an
    /// operator must fix the configuration; nothing was done.
    DownstreamAuthFailed,
    /// The downstream may have committed; only a status query or a human can tell.
    OutcomeUnknown,
    /// A write tool's reply did not match its output contract.
    OutputContractViolation,
    /// A status query found evidence that does not match.
    StatusConflict,
    /// A read handler failed.
    ToolError,
    /// An operator cancelled the operation before anything was sent (docs/design.md §11).
    Cancelled,
    /// The key was used by an operation that has since been purged: it is
    /// never run again (its tombstone keeps the key taken).
    IdempotencyKeyExpired,
    /// The same intent (key and arguments) is running right now under a live
    /// lease: not an unknown outcome, just not finished. Retry the same key
    /// after the given time (the IETF idempotency draft's 409).
    InProgress,
}

/// What a failure allows next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Recovery {
    /// Fix the input.
    CorrectInput,
    /// Nothing to do.
    None,
    /// Ask for a grant.
    RequestAuthorization,
    /// A human must look.
    HumanReview,
    /// Ask for an approval.
    RequestApproval,
    /// Retry after the given time.
    RetryAfter,
    /// Query the status explicitly.
    QueryStatus,
}

/// Whether the downstream effect happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The effect is committed.
    Committed,
    /// Nothing was done.
    NotStarted,
    /// It may or may not have happened.
    Unknown,
}

/// How a result reached the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// Executed now.
    Fresh,
    /// Replayed from the ledger.
    LocalReplay,
    /// Backfilled from a downstream receipt by a status query.
    ReceiptReconciled,
    /// Decided by a human.
    HumanResolved,
}

/// The three statuses the model sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// It worked.
    Succeeded,
    /// It did not, definitively or before starting.
    Failed,
    /// Nobody knows yet.
    Unknown,
}

impl Code {
    /// All codes, in catalog order.
    pub const ALL: [Code; 22] = [
        Code::UnknownTool,
        Code::InvalidArguments,
        Code::IdempotencyKeyRequired,
        Code::NotFound,
        Code::PolicyDenied,
        Code::SubjectDisabled,
        Code::BusinessRuleViolation,
        Code::CallIdConflict,
        Code::IdempotencyConflict,
        Code::ApprovalRequired,
        Code::ApprovalInvalid,
        Code::TimeoutBeforeExecute,
        Code::RateLimit,
        Code::ToolUnavailable,
        Code::DownstreamAuthFailed,
        Code::OutcomeUnknown,
        Code::OutputContractViolation,
        Code::StatusConflict,
        Code::ToolError,
        Code::Cancelled,
        Code::IdempotencyKeyExpired,
        Code::InProgress,
    ];

    /// The stable string form, e.g. `OUTCOME_UNKNOWN`.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::UnknownTool => "UNKNOWN_TOOL",
            Code::InvalidArguments => "INVALID_ARGUMENTS",
            Code::IdempotencyKeyRequired => "IDEMPOTENCY_KEY_REQUIRED",
            Code::NotFound => "NOT_FOUND",
            Code::PolicyDenied => "POLICY_DENIED",
            Code::SubjectDisabled => "SUBJECT_DISABLED",
            Code::BusinessRuleViolation => "BUSINESS_RULE_VIOLATION",
            Code::CallIdConflict => "CALL_ID_CONFLICT",
            Code::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            Code::ApprovalRequired => "APPROVAL_REQUIRED",
            Code::ApprovalInvalid => "APPROVAL_INVALID",
            Code::TimeoutBeforeExecute => "TIMEOUT_BEFORE_EXECUTE",
            Code::RateLimit => "RATE_LIMIT",
            Code::ToolUnavailable => "TOOL_UNAVAILABLE",
            Code::DownstreamAuthFailed => "DOWNSTREAM_AUTH_FAILED",
            Code::OutcomeUnknown => "OUTCOME_UNKNOWN",
            Code::OutputContractViolation => "OUTPUT_CONTRACT_VIOLATION",
            Code::StatusConflict => "STATUS_CONFLICT",
            Code::ToolError => "TOOL_ERROR",
            Code::Cancelled => "CANCELLED",
            Code::IdempotencyKeyExpired => "IDEMPOTENCY_KEY_EXPIRED",
            Code::InProgress => "IN_PROGRESS",
        }
    }

    /// Parses the stable string form.
    pub fn parse(s: &str) -> Option<Code> {
        Code::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// The catalog row: (category, outcome, recovery).
    pub fn catalog(self) -> (&'static str, Outcome, Recovery) {
        use Outcome::{NotStarted, Unknown};
        match self {
            Code::UnknownTool | Code::InvalidArguments | Code::IdempotencyKeyRequired => {
                ("invalid_request", NotStarted, Recovery::CorrectInput)
            }
            Code::NotFound => ("not_found", NotStarted, Recovery::None),
            Code::PolicyDenied | Code::SubjectDisabled => ("permission", NotStarted, Recovery::RequestAuthorization),
            Code::BusinessRuleViolation => ("business_rule", NotStarted, Recovery::HumanReview),
            Code::CallIdConflict | Code::IdempotencyConflict | Code::IdempotencyKeyExpired => {
                ("conflict", NotStarted, Recovery::HumanReview)
            }
            Code::ApprovalRequired | Code::ApprovalInvalid => ("approval", NotStarted, Recovery::RequestApproval),
            Code::TimeoutBeforeExecute | Code::RateLimit | Code::ToolUnavailable => {
                ("transient", NotStarted, Recovery::RetryAfter)
            }
            // The operator's configuration, not the request: retried later with
            // the same key once fixed (the breaker holds callers off meanwhile).
            Code::DownstreamAuthFailed => ("configuration", NotStarted, Recovery::RetryAfter),
            Code::OutcomeUnknown => ("outcome_unknown", Unknown, Recovery::QueryStatus),
            Code::OutputContractViolation | Code::StatusConflict => ("conflict", Unknown, Recovery::HumanReview),
            Code::ToolError => ("tool_error", NotStarted, Recovery::HumanReview),
            Code::Cancelled => ("cancelled", NotStarted, Recovery::None),
            Code::InProgress => ("in_progress", Unknown, Recovery::RetryAfter),
        }
    }

    /// Retryable exactly when the recovery is `retry_after` (docs/design.md §4).
    pub fn retryable(self) -> bool {
        self.catalog().2 == Recovery::RetryAfter
    }

    /// The fixed catalog message the model sees. Details never leak into it.
    pub fn message(self) -> &'static str {
        match self {
            Code::UnknownTool => "The requested tool does not exist.",
            Code::InvalidArguments => "The arguments do not match the tool's input contract.",
            Code::IdempotencyKeyRequired => {
                "This tool has side effects and needs an idempotency key (8 to 255 characters)."
            }
            Code::NotFound => "The resource was not found.",
            Code::PolicyDenied => "The caller is not allowed to use this tool.",
            Code::SubjectDisabled => {
                "The caller (its subject or its whole tenant) is disabled by an operator; nothing was done."
            }
            Code::BusinessRuleViolation => "The action is not allowed in the resource's current state.",
            Code::CallIdConflict => "This call identity is already bound to another request.",
            Code::IdempotencyConflict => "This idempotency key was already used for a different request.",
            Code::ApprovalRequired => "A human approval is required before this action can run.",
            Code::ApprovalInvalid => "The approval is expired, denied, or does not match this action.",
            Code::TimeoutBeforeExecute => "The deadline expired before the request was sent; nothing was done.",
            Code::RateLimit => "The downstream service is rate limiting; nothing was done. Retry later.",
            Code::ToolUnavailable => "The downstream service is unavailable; nothing was done. Retry later.",
            Code::DownstreamAuthFailed => {
                "The downstream service refused this gateway's credentials; nothing was done. An operator must fix the configuration; retry later with the same idempotency key."
            }
            Code::OutcomeUnknown => "The outcome is unknown. Do not retry: query the status with the status reference.",
            Code::OutputContractViolation => {
                "The downstream reply broke the output contract; the outcome needs human review."
            }
            Code::StatusConflict => "The downstream evidence does not match this request; a human must review it.",
            Code::ToolError => "The tool failed while reading; nothing was changed.",
            Code::Cancelled => "This call was cancelled (by its caller or an operator) before anything was sent; nothing was done.",
            Code::IdempotencyKeyExpired => {
                "This idempotency key was used by an earlier operation whose record has expired; it is not run again. Do not retry under a new key without checking how the earlier one ended."
            }
            Code::InProgress => {
                "This call (the same idempotency key and arguments) is still running. Wait retry_after_ms, then call again with the same key and arguments, or query its status with the status reference below; never use a new key for it."
            }
        }
    }
}

impl std::fmt::Display for Code {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// The error part of a model result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorInfo {
    /// Stable code.
    pub code: Code,
    /// Catalog category.
    pub category: String,
    /// What the failure allows next.
    pub recovery: Recovery,
    /// Exactly `recovery == retry_after`.
    pub retryable: bool,
    /// When to retry, for `retry_after` codes.
    pub retry_after_ms: Option<u64>,
    /// The fixed catalog message.
    pub message: String,
    /// Extra facts safe to show the model (a JSON pointer, an approval id).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<Value>,
}

impl ErrorInfo {
    /// The catalog entry for a code.
    pub fn new(code: Code) -> Self {
        let (category, _, recovery) = code.catalog();
        Self {
            code,
            category: category.to_string(),
            recovery,
            retryable: code.retryable(),
            retry_after_ms: None,
            message: code.message().to_string(),
            detail: None,
        }
    }
}

/// Where the execution stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Execution {
    /// Whether the effect happened.
    pub outcome: Outcome,
    /// How the result was delivered.
    pub delivery: Delivery,
}

/// What the model sees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResult {
    /// Succeeded, failed or unknown.
    pub status: Status,
    /// The tool's data, on success.
    pub data: Option<Value>,
    /// The error, otherwise.
    pub error: Option<ErrorInfo>,
    /// Outcome and delivery.
    pub execution: Execution,
}

/// The digests that bind a result to its call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// Request digest.
    pub request_sha256: Option<String>,
    /// Result digest.
    pub result_sha256: Option<String>,
    /// Call binding digest.
    pub call_binding_sha256: Option<String>,
}

/// Downstream evidence.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Downstream {
    /// Downstream request id.
    pub request_id: Option<String>,
    /// Downstream receipt id.
    pub receipt_id: Option<String>,
    /// Opaque handle for `query_operation_status`.
    pub status_ref: Option<String>,
}

/// What the harness keeps for audit; the model never sees it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProtectedAudit {
    /// The operation, once one exists.
    pub operation_id: Option<String>,
    /// Hashed tenant+subject.
    pub principal_ref: String,
    /// Provider context of the call.
    pub provider: Option<crate::engine::canonical::CallIdentity>,
    /// Tool name.
    pub tool: String,
    /// Contract revisions.
    pub revisions: Option<crate::engine::canonical::Revisions>,
    /// The binding digests.
    pub binding: Binding,
    /// Downstream evidence.
    pub downstream: Downstream,
    /// Approval id, if any.
    pub approval_id: Option<String>,
}

/// The one result every call returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// The model's part.
    pub model_result: ModelResult,
    /// The audit part.
    pub protected_audit: ProtectedAudit,
}

impl Envelope {
    /// The error code, if any.
    pub fn code(&self) -> Option<Code> {
        self.model_result.error.as_ref().map(|e| e.code)
    }

    /// The status_ref, if any.
    pub fn status_ref(&self) -> Option<&str> {
        self.protected_audit.downstream.status_ref.as_deref()
    }

    /// Exit code for the CLI: 0 when succeeded, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.model_result.status != Status::Succeeded)
    }
}
