//! Provider projections (docs/design.md §17): the model-facing part of an
//! envelope rendered as one model provider's tool-result message, so a harness
//! can hand toolgate's answer straight back to the model.
//!
//! Only [`ModelResult`] goes in: a projection has no way to leak the
//! `protected_audit` (operation id, principal, digests, status_ref) because it
//! never sees it. The text forms carry the model result as compact JSON, the
//! same fields the envelope's `model_result` has.

use serde_json::{json, Value};

use crate::engine::envelope::{ModelResult, Status};

/// The name a status query answers under, as a tool (`query_operation_status`
/// in docs/design.md §8): what a projection that names the tool (Gemini) calls it.
pub const QUERY_STATUS_TOOL: &str = "query_operation_status";

/// One provider's tool-result message shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projection {
    /// OpenAI Responses API: a `function_call_output` input item.
    OpenAiResponses,
    /// OpenAI Chat Completions: a `tool` role message.
    OpenAiChat,
    /// Anthropic Messages: a `tool_result` content block.
    Anthropic,
    /// Google Gemini: a `functionResponse` part.
    Gemini,
}

/// A projection name that is not one of [`Projection::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown projection: expected one of openai-responses, openai-chat, anthropic, gemini")]
pub struct UnknownProjection;

impl UnknownProjection {
    /// Stable code.
    pub const CODE: &'static str = "UNKNOWN_PROJECTION";
}

impl Projection {
    /// Every projection, in documentation order.
    pub const ALL: [Projection; 4] =
        [Projection::OpenAiResponses, Projection::OpenAiChat, Projection::Anthropic, Projection::Gemini];

    /// The name used on the command line and in `?project=`.
    pub fn name(self) -> &'static str {
        match self {
            Projection::OpenAiResponses => "openai-responses",
            Projection::OpenAiChat => "openai-chat",
            Projection::Anthropic => "anthropic",
            Projection::Gemini => "gemini",
        }
    }

    /// The projection of a name; exact and case-sensitive, like the CLI's other
    /// stable names.
    pub fn parse(name: &str) -> Result<Projection, UnknownProjection> {
        Projection::ALL.into_iter().find(|p| p.name() == name).ok_or(UnknownProjection)
    }

    /// Renders `model` as this provider's tool result for the call `call_id`
    /// of the tool `tool` (Gemini matches results by function name; the others
    /// by the provider's call id).
    pub fn render(self, call_id: &str, tool: &str, model: &ModelResult) -> Value {
        // The model result is plain data (strings, numbers, maps): it always
        // serializes; the fallback only keeps this function total.
        let object = serde_json::to_value(model).unwrap_or(Value::Null);
        let text = serde_json::to_string(&object).unwrap_or_else(|_| "null".into());
        match self {
            Projection::OpenAiResponses => json!({
                "type": "function_call_output",
                "call_id": call_id,
                "output": text,
            }),
            Projection::OpenAiChat => json!({
                "role": "tool",
                "tool_call_id": call_id,
                "content": text,
            }),
            Projection::Anthropic => json!({
                "type": "tool_result",
                "tool_use_id": call_id,
                "content": [{"type": "text", "text": text}],
                // Unknown is not success either: the model must not act as if
                // the effect happened (it should query the status instead).
                "is_error": model.status != Status::Succeeded,
            }),
            Projection::Gemini => json!({
                "functionResponse": {"name": tool, "response": object},
            }),
        }
    }
}

impl std::fmt::Display for Projection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::{Projection, UnknownProjection};
    use crate::engine::envelope::{Code, Delivery, ErrorInfo, Execution, ModelResult, Outcome, Status};
    use serde_json::json;

    fn succeeded() -> ModelResult {
        ModelResult {
            status: Status::Succeeded,
            data: Some(json!({"refund_id": "rf_1", "amount_cents": 1500, "currency": "EUR"})),
            error: None,
            execution: Execution { outcome: Outcome::Committed, delivery: Delivery::LocalReplay },
        }
    }

    fn failed(code: Code, outcome: Outcome) -> ModelResult {
        ModelResult {
            status: if outcome == Outcome::Unknown { Status::Unknown } else { Status::Failed },
            data: None,
            error: Some(ErrorInfo::new(code)),
            execution: Execution { outcome, delivery: Delivery::Fresh },
        }
    }

    fn check(p: Projection, model: &ModelResult) -> serde_json::Value {
        let v = p.render("call_42", "create_refund", model);
        // The text forms hold exactly the model result, nothing more.
        let text = match p {
            Projection::OpenAiResponses => v["output"].as_str(),
            Projection::OpenAiChat => v["content"].as_str(),
            Projection::Anthropic => v["content"][0]["text"].as_str(),
            Projection::Gemini => None,
        };
        let inner = text.map_or_else(
            || v["functionResponse"]["response"].clone(),
            |t| serde_json::from_str(t).expect("the text is JSON"),
        );
        assert_eq!(inner, serde_json::to_value(model).unwrap(), "{p}");
        v
    }

    #[test]
    fn every_shape_for_a_success_a_failure_and_an_unknown() {
        let cases = [
            ("succeeded", succeeded()),
            ("idempotency_conflict", failed(Code::IdempotencyConflict, Outcome::NotStarted)),
            ("outcome_unknown", failed(Code::OutcomeUnknown, Outcome::Unknown)),
        ];
        for p in Projection::ALL {
            for (name, model) in &cases {
                insta::assert_snapshot!(
                    format!("{}__{name}", p.name()),
                    serde_json::to_string_pretty(&check(p, model)).unwrap()
                );
            }
        }
    }

    #[test]
    fn anthropic_marks_everything_but_success_as_an_error() {
        let is_error = |m: &ModelResult| Projection::Anthropic.render("c", "t", m)["is_error"].clone();
        assert_eq!(is_error(&succeeded()), json!(false));
        assert_eq!(is_error(&failed(Code::IdempotencyConflict, Outcome::NotStarted)), json!(true));
        assert_eq!(is_error(&failed(Code::OutcomeUnknown, Outcome::Unknown)), json!(true));
    }

    #[test]
    fn names_round_trip_and_anything_else_is_refused() {
        for p in Projection::ALL {
            assert_eq!(Projection::parse(p.name()), Ok(p));
        }
        for bad in ["", "openai", "OpenAI-Chat", "anthropic ", "gemini\0", "mcp"] {
            assert_eq!(Projection::parse(bad), Err(UnknownProjection), "{bad:?}");
        }
    }
}
