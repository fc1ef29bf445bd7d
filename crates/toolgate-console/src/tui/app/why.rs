//! "Why is this stuck": one plain sentence about an operation that is not
//! terminal, built only from its stored facts (the ledger row, the outbox row,
//! the attempts, the trace, the operator log), and the next safe action with
//! its key. The detail view opens with it; the Unknown pane shows [`reason`],
//! the same in a few words. Model code: plain strings, no rendering.

use crate::engine::clock::rfc3339;
use crate::engine::OperationDetail;
use crate::store::Step;
use crate::store::{ApprovalRow, OpState, OperationRow, OutboxState};
use crate::tui::format::{human_ms, short};

/// What the detail view says about a stuck operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Why {
    /// What is going on, in one sentence.
    pub sentence: String,
    /// The next safe action, with its key.
    pub next: String,
}

/// `07:58:12 UTC`, the time of day of a stored instant.
fn clock(at: i64) -> String {
    format!("{} UTC", rfc3339(at).chars().skip(11).take(8).collect::<String>())
}

/// `in 12s` / `12s ago`.
fn relative(now: i64, at: i64) -> String {
    if at > now {
        format!("in {}", human_ms(at.saturating_sub(now)))
    } else {
        format!("{} ago", human_ms(now.saturating_sub(at)))
    }
}

fn times(n: usize) -> String {
    if n == 1 {
        "once".to_string()
    } else {
        format!("{n} times")
    }
}

/// A receipt a status query found under the operation's key (kept in the
/// query's trace event, also when it did not settle the operation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundReceipt {
    /// The provider's receipt id.
    pub receipt_id: String,
    /// The provider's id of the request that made it.
    pub request_id: Option<String>,
    /// Why the engine did not take it as this request's (the query's note).
    pub why_not: Option<String>,
}

impl FoundReceipt {
    /// `receipt rcpt_… (downstream request dreq_…)`.
    pub fn ids(&self) -> String {
        match &self.request_id {
            Some(r) => format!("receipt {} (downstream request {})", short(&self.receipt_id, 48), short(r, 48)),
            None => format!("receipt {}", short(&self.receipt_id, 48)),
        }
    }
}

/// The receipt the latest status query that found one reported, if any.
pub fn found_receipt(d: &OperationDetail) -> Option<FoundReceipt> {
    d.trace.iter().rev().filter(|e| e.step == Step::Query).find_map(|e| {
        let f: serde_json::Value = serde_json::from_str(&e.fields).ok()?;
        let text = |k: &str| f.get(k).and_then(serde_json::Value::as_str).map(str::to_string);
        Some(FoundReceipt {
            receipt_id: text("receipt_id")?,
            request_id: text("downstream_request_id"),
            why_not: text("note").filter(|_| e.reason.as_deref() == Some("mismatch")),
        })
    })
}

/// What a call asked for, in money and order (`4.00 EUR on order ord_2001`),
/// read from the bound request only when it matches its digest (as the
/// approval dialog does); `None` for a call without an amount.
pub fn request_terms(o: &OperationRow) -> Option<String> {
    if crate::engine::canonical::sha256_hex(o.request_json.as_bytes()) != o.request_sha256 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&o.request_json).ok()?;
    let args = v.get("arguments")?;
    let minor = args.get("amount_minor")?.as_i64()?;
    let currency = args.get("currency").and_then(serde_json::Value::as_str).unwrap_or("");
    let order = args
        .get("order_ref")
        .and_then(serde_json::Value::as_str)
        .map_or_else(String::new, |o| format!(" on order {}", short(o, 40)));
    Some(format!("{}  ({minor} minor units){order}", crate::tui::format::money(minor, currency)))
}

/// The sentence and next action for operation detail `d` at `now`; `None` for a
/// terminal operation (nothing is stuck).
pub fn explain(d: &OperationDetail, now: i64) -> Option<Why> {
    let o = &d.operation;
    let queries = d.trace.iter().filter(|e| e.step == Step::Query).count();
    let last_query = o.last_query_at.map_or_else(String::new, |at| format!(", last {}", relative(now, at)));
    let code = short(o.code.as_deref().unwrap_or("no code"), 40);
    let overdue = (o.deadline_at <= now)
        .then(|| format!(" Its deadline passed {} ago.", human_ms(now.saturating_sub(o.deadline_at))));
    let why = match o.state {
        OpState::Unknown => {
            let sent = d.attempts.iter().rev().find(|a| a.sent_at.is_some());
            let cancelled = d.audit.iter().find(|r| r.action == "cancel" && r.result == "applied");
            if let Some(until) = d.may_land_until {
                // Before anything else: "no effect" cannot be decided yet.
                let a = sent.map_or(0, |a| a.attempt);
                return Some(Why {
                    sentence: format!(
                        "Attempt {a} was sent and its sender may still be inside the call: it may land until {} ({}); failed cannot be decided before then.",
                        clock(until),
                        relative(now, until)
                    ),
                    next: format!("Press q after {} to ask the provider; r succeeded only with its receipt.", clock(until)),
                });
            }
            match o.last_query_result.as_deref() {
                None => {
                    let what = match (cancelled, sent) {
                        (Some(c), Some(a)) => format!(
                            "Cancelled by {} at {} after attempt {} was sent at {}: the provider may have acted",
                            short(&c.actor, 20),
                            clock(c.at),
                            a.attempt,
                            clock(a.sent_at.unwrap_or_default())
                        ),
                        (_, Some(a)) => {
                            let sent_at = a.sent_at.unwrap_or_default();
                            let after = a.finished_at.map_or_else(
                                || "no reply was recorded".to_string(),
                                |f| format!("the reply was lost after {}", human_ms(f.saturating_sub(sent_at))),
                            );
                            format!(
                                "Sent at {} (attempt {}), {after} ({})",
                                clock(sent_at),
                                a.attempt,
                                short(a.code.as_deref().unwrap_or(&code), 40)
                            )
                        }
                        (_, None) => format!(
                            "Parked as unknown at {} ({code}); no attempt records a send",
                            clock(o.state_since.unwrap_or(o.updated_at))
                        ),
                    };
                    Why {
                        sentence: format!("{what}; no status query yet."),
                        next: "Press q to ask the provider (a status query never executes the tool).".into(),
                    }
                }
                Some("not_found") if d.receipt_window_until.is_some() => {
                    let until = d.receipt_window_until.unwrap_or_default();
                    Why {
                        sentence: format!(
                            "Queried {}{last_query}: no receipt yet, but receipts can lag and one may still appear until {} ({}). No record is not proof of no effect.",
                            times(queries.max(1)),
                            clock(until),
                            relative(now, until)
                        ),
                        next: format!(
                            "Press q again after {} before deciding; failed is refused until then (unless against the evidence).",
                            clock(until)
                        ),
                    }
                }
                Some("not_found") => Why {
                    sentence: format!(
                        "Queried {}{last_query}, the provider does not know the key: needs a human decision.",
                        times(queries.max(1))
                    ),
                    next: "Press r to resolve it (failed needs only a note; succeeded needs the receipt id); q asks again."
                        .into(),
                },
                Some("unavailable") => Why {
                    sentence: format!(
                        "Queried {}{last_query}, the provider's lookup could not be reached: still unknown.",
                        times(queries.max(1))
                    ),
                    next: "Press q to ask again once the provider is back; r if it stays unreachable.".into(),
                },
                Some(other) => Why {
                    sentence: format!(
                        "Outcome unknown ({code}); queried {}{last_query}, last answer {}.",
                        times(queries.max(1)),
                        short(other, 20)
                    ),
                    next: "Press q to ask the provider again, or r to record a human decision.".into(),
                },
            }
        }
        OpState::NeedsReview => match found_receipt(d) {
            Some(r) if o.last_query_result.as_deref() == Some("mismatch") => Why {
                sentence: format!(
                    "The provider holds {} that does not match this request: {} ({code}; queried {}{last_query}). Needs a human decision.",
                    r.ids(),
                    r.why_not.as_deref().map_or_else(|| "not bound to it".to_string(), |w| short(w, 80)),
                    times(queries.max(1))
                ),
                next: format!(
                    "Check receipt {} with the provider, then press r: succeeded with that receipt id if it is this call's; another decision goes against the evidence (its own confirm).",
                    short(&r.receipt_id, 48)
                ),
            },
            _ => {
                let sentence = if o.last_query_result.as_deref() == Some("mismatch") {
                    format!(
                        "The provider holds a receipt that does not match this request ({code}; queried {}{last_query}): needs a human decision.",
                        times(queries.max(1))
                    )
                } else {
                    format!("Needs review ({code}): a person must decide what happened.")
                };
                Why { sentence, next: "Press r to resolve it once the receipt is checked with the provider.".into() }
            }
        },
        OpState::Accepted | OpState::InFlight => queued(d, now, &code),
        _ => return None,
    };
    Some(match overdue {
        Some(s) if o.state.is_in_progress() => Why { sentence: format!("{}{s}", why.sentence), ..why },
        _ => why,
    })
}

/// A pending approval (no operation exists until it is approved) at `now`:
/// what it waits for, until when, and the keys; `refusal` is why this operator
/// may not decide it, when that is so.
pub fn explain_approval(a: &ApprovalRow, now: i64, refusal: Option<&str>) -> Why {
    let id = short(&a.id, 32);
    // Expiry is exclusive: at expires_at the request can no longer be decided.
    if now >= a.expires_at {
        return Why {
            sentence: format!(
                "Approval {id} expired {} ago, at {}: it can no longer be approved or denied.",
                human_ms(now.saturating_sub(a.expires_at)),
                clock(a.expires_at)
            ),
            next: "Nothing to decide: the agent's next dispatch of the same call makes a new request.".into(),
        };
    }
    let sentence = format!(
        "Waiting for approval {id}; it expires in {}, at {} (a approves, d denies).",
        human_ms(a.expires_at.saturating_sub(now)),
        clock(a.expires_at)
    );
    let next = match refusal {
        Some(why) => format!("You cannot decide it: {why}."),
        None => "Press a to approve (the call then runs once), d to deny with a note; the evidence is below.".into(),
    };
    Why { sentence, next }
}

/// An accepted or in-flight operation: what its outbox row waits for.
fn queued(d: &OperationDetail, now: i64, code: &str) -> Why {
    let o = &d.operation;
    let sent = d.attempts.iter().any(|a| !a.proven_not_received());
    let cancel = if sent {
        "c moves it to the unknown queue (an attempt may have been received)"
    } else {
        "c cancels it (nothing was sent)"
    };
    let Some(ob) = &d.outbox else {
        return Why {
            sentence: format!("{} with no outbox row: nothing will run it.", o.state),
            next: "Run toolgate audit: the record is inconsistent.".into(),
        };
    };
    match (ob.state, ob.lease_owner.as_deref(), ob.lease_until) {
        (OutboxState::Leased, Some(owner), Some(until)) if until > now => Why {
            sentence: format!(
                "Lease held by worker {} until {} (fence: attempt {}); it will be reclaimed after that.",
                short(owner, 24),
                clock(until),
                ob.attempt
            ),
            next: format!("Nothing to do yet: wait for the worker; {cancel}."),
        },
        (OutboxState::Leased, owner, until) => Why {
            sentence: format!(
                "The lease of worker {} (attempt {}) expired {}; the reaper reclaims it at its next pass.",
                short(owner.unwrap_or("?"), 24),
                ob.attempt,
                until.map_or_else(|| "at an unrecorded time".to_string(), |u| relative(now, u))
            ),
            next: format!("Wait for a reaper pass (toolgate reap, or a console with workers); {cancel}."),
        },
        (OutboxState::Pending, _, _) if ob.available_at > now => Why {
            sentence: format!(
                "Attempt {} (at most {} per call) ended {}; the next waits until {} ({}).",
                ob.attempt,
                ob.max_attempts,
                short(ob.last_code.as_deref().unwrap_or(code), 30),
                clock(ob.available_at),
                relative(now, ob.available_at)
            ),
            next: format!("Nothing to do: a worker takes it then; {cancel}."),
        },
        (OutboxState::Pending, _, _) => Why {
            sentence: format!(
                "Due since {} ({}), waiting for a worker to claim it{}.",
                clock(ob.available_at),
                relative(now, ob.available_at),
                if sent { "" } else { "; nothing has been sent" }
            ),
            next: format!("Check that a worker runs (toolgate work, or a console with workers); {cancel}."),
        },
        (state, _, _) => Why {
            sentence: format!(
                "{} while its outbox row is {}: nothing will run it.",
                o.state,
                short(state.as_str(), 12)
            ),
            next: "Run toolgate audit: the record is inconsistent.".into(),
        },
    }
}

/// The Unknown pane's short reason: what keeps the operation there, and the key.
pub fn reason(o: &OperationRow) -> String {
    match (o.state, o.last_query_result.as_deref()) {
        (OpState::Unknown, None) => "reply lost, not queried: q".into(),
        (OpState::Unknown, Some("not_found")) => "provider has no record: r".into(),
        (OpState::Unknown, Some("unavailable")) => "lookup unreachable: q".into(),
        (OpState::Unknown, Some(other)) => format!("last query {}: q", short(other, 10)),
        (OpState::NeedsReview, Some("mismatch")) => "receipt mismatch: r".into(),
        (OpState::NeedsReview, _) => "needs review: r".into(),
        (other, _) => short(other.as_str(), 20),
    }
}
