//! Bulk operator actions (the console's marks, the CLI's `--all`): one action
//! on many operations or approvals, run as one ordinary engine call each, so
//! every operation gets its own operator-log entry (the operator, the shared
//! note, its own evidence) and its own trace, exactly as when acted on alone.
//! One refusal or failure never stops the rest; the report counts what
//! happened ("37 settled, 2 still unknown, 1 refused: lease held").

use crate::store::OpState;
use crate::Coded;
use serde::Serialize;

use super::envelope::{Code, Envelope, Status};
use super::{CancelRequest, Engine, EngineError, Resolution, ResolveRequest};

/// What to do to every target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BulkAction {
    /// An explicit status query on each operation (never executes the tool).
    Query,
    /// Approve each pending approval (each held call then runs).
    Approve,
    /// Deny each pending approval.
    Deny {
        /// The shared note.
        note: String,
    },
    /// Resolve each unknown / needs-review operation by one human decision
    /// (`failed` or `compensated`: `succeeded` needs each operation's own receipt id).
    Resolve {
        /// The decision.
        resolution: Resolution,
        /// The shared note.
        note: String,
        /// The operator states there is no evidence either way (needed for
        /// `failed` on a downstream that cannot be asked).
        no_evidence: bool,
    },
    /// Cancel each accepted / in-flight operation.
    Cancel {
        /// The shared note.
        note: String,
    },
}

impl BulkAction {
    /// The verb, for titles and reports (`query`, `approve`, …).
    pub fn verb(&self) -> &'static str {
        match self {
            BulkAction::Query => "query",
            BulkAction::Approve => "approve",
            BulkAction::Deny { .. } => "deny",
            BulkAction::Resolve { .. } => "resolve",
            BulkAction::Cancel { .. } => "cancel",
        }
    }

    /// Whether the targets are approvals (else operations).
    pub fn on_approvals(&self) -> bool {
        matches!(self, BulkAction::Approve | BulkAction::Deny { .. })
    }

    /// A decision a bulk action cannot take: `succeeded` needs a receipt id
    /// per operation, which one shared form cannot give.
    pub fn check(&self) -> Result<(), EngineError> {
        if let BulkAction::Resolve { resolution: Resolution::Succeeded, .. } = self {
            return Err(EngineError::invalid(
                "EVIDENCE_PER_OPERATION",
                "resolving as succeeded needs each operation's own receipt id: resolve those one at a time",
            ));
        }
        Ok(())
    }
}

/// One row to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BulkTarget {
    /// Operation or approval id.
    pub id: String,
    /// The version the operator saw (resolve and cancel refuse a changed row).
    pub seen_version: Option<i64>,
}

/// What happened to one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BulkItem {
    /// Operation or approval id.
    pub id: String,
    /// The class the summary counts it in: `settled`, `still unknown`,
    /// `needs review`, `approved`, `denied`, `resolved`, `cancelled`, or
    /// `refused: REASON`.
    pub outcome: String,
    /// Whether the action changed it (a query that still knows nothing did not).
    pub changed: bool,
    /// `OK`, or the code the engine answered.
    pub code: String,
    /// The engine's one line.
    pub message: String,
}

impl BulkItem {
    /// Whether the engine refused (or failed) this one.
    pub fn refused(&self) -> bool {
        self.outcome.starts_with("refused")
    }
}

/// Every target's outcome, in the order they were acted on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct BulkReport {
    /// Per target.
    pub items: Vec<BulkItem>,
}

impl BulkReport {
    /// `37 settled, 2 still unknown, 1 refused: lease held` (classes in the
    /// order they first occur, refusals last).
    pub fn summary(&self) -> String {
        let mut counts: Vec<(&str, usize)> = Vec::new();
        for it in &self.items {
            match counts.iter_mut().find(|(k, _)| *k == it.outcome) {
                Some((_, n)) => *n += 1,
                None => counts.push((&it.outcome, 1)),
            }
        }
        counts.sort_by_key(|(k, _)| k.starts_with("refused"));
        if counts.is_empty() {
            return "nothing to do".into();
        }
        counts.iter().map(|(k, n)| format!("{n} {k}")).collect::<Vec<_>>().join(", ")
    }

    /// Whether every target ended as the action meant (nothing refused,
    /// nothing still unknown).
    pub fn all_done(&self) -> bool {
        self.items.iter().all(|i| !i.refused() && i.outcome != "still unknown")
    }
}

/// A refusal's class for the summary: one phrase per code (ids and versions
/// stay in the item's message, so like refusals count together).
fn refused(code: &str, message: &str) -> String {
    let phrase = match code {
        "STALE_VERSION" => "changed since it was marked",
        "STATUS_CONFLICT" => "the provider's evidence contradicts it",
        "NOT_RESOLVABLE" => "no longer unknown",
        "NOT_CANCELLABLE" => "no longer cancellable",
        "NO_SUCH_OPERATION" | "OPERATION_PURGED" => "gone",
        "NOT_FOUND" => "the provider does not know it",
        // Approval refusals carry short generic reasons: keep them.
        "APPROVAL_INVALID" if !message.is_empty() => {
            return format!("refused: {}", message.chars().take(48).collect::<String>())
        }
        _ => return format!("refused: {}", code.to_ascii_lowercase().replace('_', " ")),
    };
    format!("refused: {phrase}")
}

fn item(id: &str, outcome: String, changed: bool, code: &str, message: String) -> BulkItem {
    BulkItem { id: id.to_string(), outcome, changed, code: code.to_string(), message }
}

fn reason_of(env: &Envelope) -> (String, String) {
    let Some(e) = &env.model_result.error else { return ("OK".into(), String::new()) };
    let why = e
        .detail
        .as_ref()
        .and_then(|d| d.get("reason").or_else(|| d.get("rule")))
        .and_then(|v| v.as_str())
        .map_or_else(|| e.message.clone(), str::to_string);
    (e.code.as_str().to_string(), why)
}

impl Engine {
    /// Runs `action` on every target, one engine call each, as `operator`;
    /// `progress` hears of each as it finishes (the console's gauge). An
    /// environment failure on one target is recorded as its refusal and the
    /// rest still run.
    pub fn bulk(
        &mut self,
        action: &BulkAction,
        targets: &[BulkTarget],
        operator: &str,
        mut progress: impl FnMut(usize, &BulkItem),
    ) -> Result<BulkReport, EngineError> {
        action.check()?;
        super::check_operator(operator)?;
        let mut report = BulkReport::default();
        for (i, t) in targets.iter().enumerate() {
            let it = self.bulk_one(action, t, operator);
            progress(i + 1, &it);
            report.items.push(it);
        }
        Ok(report)
    }

    fn bulk_one(&mut self, action: &BulkAction, t: &BulkTarget, operator: &str) -> BulkItem {
        let id = t.id.as_str();
        let r: Result<BulkItem, EngineError> = match action {
            BulkAction::Query => self.operator_query(id, operator).and_then(|env| {
                let (code, why) = reason_of(&env);
                let state = self.read(|tx| tx.operation(id))?.map(|o| o.state);
                let shown = state.map(|s| s.to_string()).unwrap_or_default();
                let msg = if why.is_empty() { shown } else { format!("{shown}: {why}") };
                Ok(match state {
                    Some(s) if s.is_terminal() => item(id, "settled".into(), true, &code, msg),
                    Some(OpState::NeedsReview) => item(id, "needs review".into(), true, &code, msg),
                    Some(OpState::Unknown) if env.model_result.status == Status::Unknown => {
                        item(id, "still unknown".into(), false, &code, msg)
                    }
                    _ => item(id, refused(&code, &why), false, &code, msg),
                })
            }),
            BulkAction::Approve => self.approve(id, operator).map(|env| {
                let (code, why) = reason_of(&env);
                let invalid = env.model_result.error.as_ref().is_some_and(|e| e.code == Code::ApprovalInvalid);
                if invalid {
                    item(id, refused(&code, &why), false, &code, why)
                } else {
                    let status = serde_json::to_value(env.model_result.status).unwrap_or_default();
                    let msg = format!("approved; the call {}", status.as_str().unwrap_or("?"));
                    item(id, "approved".into(), true, &code, msg)
                }
            }),
            BulkAction::Deny { note } => self.deny(id, operator, note).map(|o| outcome_item(id, &o, "denied")),
            BulkAction::Resolve { resolution, note, no_evidence } => self
                .resolve(&ResolveRequest {
                    operation_id: id.to_string(),
                    resolution: *resolution,
                    operator: operator.to_string(),
                    note: note.clone(),
                    evidence: None,
                    seen_version: t.seen_version,
                    action_id: None,
                    no_evidence: *no_evidence,
                })
                .map(|o| outcome_item(id, &o, "resolved")),
            BulkAction::Cancel { note } => self
                .cancel(&CancelRequest {
                    operation_id: id.to_string(),
                    operator: operator.to_string(),
                    note: note.clone(),
                    seen_version: t.seen_version,
                    action_id: None,
                })
                .map(|o| outcome_item(id, &o, "cancelled")),
        };
        r.unwrap_or_else(|e| item(id, refused(e.code(), &e.to_string()), false, e.code(), e.to_string()))
    }
}

fn outcome_item(id: &str, o: &super::OperatorOutcome, done: &str) -> BulkItem {
    if o.applied {
        item(id, done.into(), true, o.code, o.message.clone())
    } else {
        item(id, refused(o.code, &o.message), false, o.code, o.message.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(outcomes: &[&str]) -> BulkReport {
        BulkReport {
            items: outcomes.iter().map(|o| item("op_1", (*o).to_string(), true, "OK", String::new())).collect(),
        }
    }

    #[test]
    fn the_summary_counts_each_class_refusals_last() {
        let mut o = vec!["settled"; 37];
        o.insert(3, "refused: lease held");
        o.extend(["still unknown", "still unknown"]);
        let r = report(&o);
        assert_eq!(r.summary(), "37 settled, 2 still unknown, 1 refused: lease held");
        assert!(!r.all_done());
        assert!(report(&["settled", "needs review"]).all_done());
        assert_eq!(report(&[]).summary(), "nothing to do");
    }
}
