//! Which HTTP status goes with which answer, and the envelopes of the
//! server's own refusals (a token problem, a body over the limit) in the same
//! shape as the engine's (docs/design.md §4).
//!
//! The status follows the IETF httpapi idempotency-key draft where it speaks
//! (400 a write tool without a key, 422 a key reused with another payload, 409
//! the same key still in flight, with Retry-After) and RFC 9110 elsewhere. The
//! body is the truth: a harness reads `model_result`, and the status only lets
//! generic HTTP machinery (proxies, retry middleware, dashboards) do the safe
//! thing. The whole table is in the README.

use axum::http::StatusCode;
use serde_json::{json, Value};

use crate::engine::envelope::{Code, Envelope, ProtectedAudit, Status};
use crate::store::OpState;

/// The status of an engine envelope. `op_state` is the operation's state when
/// the answer is `OUTCOME_UNKNOWN` (read after the call).
pub fn of_envelope(env: &Envelope, op_state: Option<OpState>) -> StatusCode {
    let Some(code) = env.code() else {
        // Succeeded (fresh, replayed, reconciled, resolved) or a human's
        // "failed"/"compensated" decision: a settled answer to the request.
        return StatusCode::OK;
    };
    if env.model_result.status == Status::Succeeded {
        return StatusCode::OK;
    }
    of_code(code, op_state)
}

/// The status of one engine code.
pub fn of_code(code: Code, op_state: Option<OpState>) -> StatusCode {
    match code {
        Code::InvalidArguments | Code::IdempotencyKeyRequired => StatusCode::BAD_REQUEST,
        Code::UnknownTool | Code::NotFound => StatusCode::NOT_FOUND,
        Code::PolicyDenied | Code::SubjectDisabled | Code::ApprovalInvalid => StatusCode::FORBIDDEN,
        Code::IdempotencyConflict
        | Code::IdempotencyKeyExpired
        | Code::CallIdConflict
        | Code::BusinessRuleViolation => StatusCode::UNPROCESSABLE_ENTITY,
        // A pending approval request now holds the exact call; once approved,
        // the workers run it. Not a success: the model_result says failed.
        Code::ApprovalRequired => StatusCode::ACCEPTED,
        Code::RateLimit => StatusCode::TOO_MANY_REQUESTS,
        Code::TimeoutBeforeExecute | Code::ToolUnavailable | Code::DownstreamAuthFailed => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        // The draft's "request still in progress": retry later with the same key.
        Code::OutcomeUnknown if matches!(op_state, Some(OpState::Accepted | OpState::InFlight)) => StatusCode::CONFLICT,
        // Parked: the provider's answer did not come back. Only a status query
        // (or a person) settles it; a retry with the same key is harmless.
        Code::OutcomeUnknown => StatusCode::GATEWAY_TIMEOUT,
        Code::OutputContractViolation | Code::ToolError => StatusCode::BAD_GATEWAY,
        Code::StatusConflict => StatusCode::CONFLICT,
        Code::Cancelled => StatusCode::GONE,
        // The draft's "request still in progress".
        Code::InProgress => StatusCode::CONFLICT,
    }
}

/// A refusal of the server itself, before or around the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerCode {
    /// Stable code.
    pub code: &'static str,
    /// HTTP status.
    pub status: StatusCode,
    /// Catalog category.
    pub category: &'static str,
    /// What the refusal allows next (the engine's recovery names).
    pub recovery: &'static str,
    /// Fixed message.
    pub message: &'static str,
}

macro_rules! server_codes {
    ($($name:ident = $code:literal, $status:ident, $cat:literal, $rec:literal, $msg:literal;)*) => {
        $(
            #[doc = $msg]
            pub const $name: ServerCode = ServerCode {
                code: $code, status: StatusCode::$status, category: $cat, recovery: $rec, message: $msg,
            };
        )*
        /// Every server code (the README's table is checked against it).
        pub const ALL: &[ServerCode] = &[$($name),*];
    };
}

server_codes! {
    OPERATOR_TOKEN_REQUIRED = "OPERATOR_TOKEN_REQUIRED", FORBIDDEN, "permission", "request_authorization",
        "This endpoint needs an operator token; an agent's token may not approve, deny, resolve or cancel.";
    SUBJECT_TOKEN_REQUIRED = "SUBJECT_TOKEN_REQUIRED", FORBIDDEN, "permission", "request_authorization",
        "This endpoint needs an agent's (subject) token; an operator token cannot act as a subject.";
    BODY_TOO_LARGE = "BODY_TOO_LARGE", PAYLOAD_TOO_LARGE, "invalid_request", "correct_input",
        "The request body is larger than the limit.";
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE", UNSUPPORTED_MEDIA_TYPE, "invalid_request", "correct_input",
        "The request body must be application/json.";
    BODY_TIMEOUT = "BODY_TIMEOUT", REQUEST_TIMEOUT, "invalid_request", "correct_input",
        "The request body did not arrive in time.";
    INVALID_BODY = "INVALID_BODY", BAD_REQUEST, "invalid_request", "correct_input",
        "The request body is not the JSON object this endpoint takes.";
    INVALID_HEADER = "INVALID_HEADER", BAD_REQUEST, "invalid_request", "correct_input",
        "A request header has a value this endpoint cannot take.";
    DUPLICATE_HEADER = "DUPLICATE_HEADER", BAD_REQUEST, "invalid_request", "correct_input",
        "A header that names the caller or the intent (Authorization, Idempotency-Key, Mcp-Session-Id, Toolgate-*) appears more than once.";
    FAULT_NOT_ALLOWED = "FAULT_NOT_ALLOWED", BAD_REQUEST, "invalid_request", "correct_input",
        "Toolgate-Fault is honoured only on a database marked as a demo.";
    BAD_FAULT = "BAD_FAULT", BAD_REQUEST, "invalid_request", "correct_input",
        "The Toolgate-Fault header is not a fault plan.";
    UNKNOWN_PROJECTION = "UNKNOWN_PROJECTION", BAD_REQUEST, "invalid_request", "correct_input",
        "?project= must be one of openai-responses, openai-chat, anthropic, gemini.";
    INVALID_QUERY = "INVALID_QUERY", BAD_REQUEST, "invalid_request", "correct_input",
        "This endpoint takes no query parameter but one ?project=.";
    NO_SUCH_ROUTE = "NO_SUCH_ROUTE", NOT_FOUND, "not_found", "none",
        "There is no such endpoint.";
    NO_SUCH_SESSION = "NO_SUCH_SESSION", NOT_FOUND, "not_found", "correct_input",
        "There is no such MCP session for this token: start one with initialize.";
    NO_SUCH_OPERATION = "NO_SUCH_OPERATION", NOT_FOUND, "not_found", "none",
        "There is no such operation.";
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED", METHOD_NOT_ALLOWED, "invalid_request", "correct_input",
        "This endpoint does not take that method.";
    SERVER_BUSY = "SERVER_BUSY", SERVICE_UNAVAILABLE, "transient", "retry_after",
        "The server is at capacity; nothing was done. Retry later.";
    CLIENT_GONE = "CLIENT_GONE", REQUEST_TIMEOUT, "transient", "retry_after",
        "The client closed the connection before the call was accepted; nothing was done.";
    INTERNAL = "INTERNAL", INTERNAL_SERVER_ERROR, "internal", "retry_after",
        "The server failed to answer; retrying with the same idempotency key is safe.";
}

/// An envelope-shaped body for a refusal that is not one of the engine's codes.
/// `unknown` marks an answer whose outcome the server cannot vouch for (an
/// environment failure during a call).
pub fn envelope_json(
    code: &str,
    category: &str,
    recovery: &str,
    message: &str,
    retry_after_ms: Option<u64>,
    unknown: bool,
) -> Value {
    json!({
        "model_result": {
            "status": if unknown { "unknown" } else { "failed" },
            "data": null,
            "error": {
                "code": code,
                "category": category,
                "recovery": recovery,
                "retryable": recovery == "retry_after",
                "retry_after_ms": retry_after_ms,
                "message": message,
            },
            "execution": {"outcome": if unknown { "unknown" } else { "not_started" }, "delivery": "fresh"},
        },
        "protected_audit": serde_json::to_value(ProtectedAudit::default()).unwrap_or(Value::Null),
    })
}

/// The status of an engine environment error (`EngineError::code`).
pub fn of_engine_error(code: &str) -> StatusCode {
    match code {
        "NO_SUCH_OPERATION" | "NO_SUCH_APPROVAL" | "OPERATION_PURGED" => StatusCode::NOT_FOUND,
        c if c.starts_with("INVALID_") || c == "UNKNOWN_TOOL" || c == "NOTE_REQUIRED" || c == "EVIDENCE_REQUIRED" => {
            StatusCode::BAD_REQUEST
        }
        "DB_UNAVAILABLE" | "DB_BUSY" | "DISK_FULL" | "DB_READ_ONLY" => StatusCode::SERVICE_UNAVAILABLE,
        // A token revoked or expired while its call was being decided.
        "TOKEN_REVOKED" | "TOKEN_EXPIRED" => StatusCode::UNAUTHORIZED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::{of_code, OpState, StatusCode};
    use crate::engine::envelope::Code;

    #[test]
    fn every_engine_code_has_a_status_and_unknown_depends_on_the_state() {
        for c in Code::ALL {
            let s = of_code(c, None);
            assert!(s.is_client_error() || s.is_server_error() || s == StatusCode::ACCEPTED, "{c}");
        }
        assert_eq!(of_code(Code::OutcomeUnknown, Some(OpState::InFlight)), StatusCode::CONFLICT);
        assert_eq!(of_code(Code::OutcomeUnknown, Some(OpState::Accepted)), StatusCode::CONFLICT);
        assert_eq!(of_code(Code::OutcomeUnknown, Some(OpState::Unknown)), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(of_code(Code::IdempotencyConflict, None), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(of_code(Code::IdempotencyKeyRequired, None), StatusCode::BAD_REQUEST);
        assert_eq!(of_code(Code::RateLimit, None), StatusCode::TOO_MANY_REQUESTS);
    }
}
