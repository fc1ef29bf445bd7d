//! The outbox worker (docs/design.md §6): claim a lease, re-check, write the
//! sent-marker, call the downstream, persist the outcome fenced; the
//! background loop over due rows.

use std::panic::AssertUnwindSafe;
use std::time::Instant;

use serde_json::{json, Value};

use super::persist::{persist, PersistCtx, Persisted};
use crate::engine::contracts::{Contract, Contracts};
use crate::engine::envelope::{Code, Delivery, Envelope, ProtectedAudit};
use crate::engine::lab::caller_key;
use crate::engine::operation::{
    args_of, authorize, business_rules, intent_of, op_envelope, reserve, revisions_of, verify_row,
};
use crate::engine::policy::{self, backoff_ms, Admission};
use crate::engine::tool::DownstreamRequest;
use crate::engine::tool::ToolDomain;
use crate::engine::trace::{Answering, TraceEvent};
use crate::engine::{error_envelope, with_detail, with_retry_after, Engine, EngineError};
use crate::failpoint;
use crate::store::Reason;
use crate::store::Scope;
use crate::store::Step;
use crate::store::{AttemptOutcome, ForClaim, OpState, OperationRow, OutboxState, StoreError, Tx};

/// The operations engines of this process are running right now (inside
/// `run_operation_from`), by ledger and operation: a lease whose holder is
/// known to be alive. A duplicate of one is `IN_PROGRESS`. A lease held by
/// another process, or by one that died with it (a crash before the result was
/// stored), is not known to be running: that duplicate is `OUTCOME_UNKNOWN`.
///
/// Counted, not a set: a second run of the same operation in this process (a
/// worker pass that then finds the lease taken) must not erase the first
/// one's entry when it ends. Keyed by the ledger too: two ledgers in one
/// process (tests, a seeded lab) can hold equal operation ids.
static RUNNING: std::sync::Mutex<std::collections::BTreeMap<(String, String), usize>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// One entry of [`RUNNING`], removed when the run ends (or unwinds).
pub(super) struct Running((String, String));

impl Running {
    pub(super) fn start(ledger: &std::path::Path, op_id: &str) -> Self {
        let key = (ledger.to_string_lossy().into_owned(), op_id.to_string());
        *RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).entry(key.clone()).or_default() += 1;
        Self(key)
    }

    pub(super) fn holds(ledger: &std::path::Path, op_id: &str) -> bool {
        let key = (ledger.to_string_lossy().into_owned(), op_id.to_string());
        RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner).contains_key(&key)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = running.get_mut(&self.0) {
            *n -= 1;
            if *n == 0 {
                running.remove(&self.0);
            }
        }
    }
}

/// What one claim decided.
pub(super) enum Claim {
    /// We hold attempt `n`, and a send slot of its downstream's bulkhead
    /// until its outcome is persisted.
    Claimed { attempt: i64, op: Box<OperationRow>, slot: crate::engine::bulkhead::Slot },
    /// Not ours to run (or nothing to run): here is the state.
    Answer(Envelope),
}

impl Engine {
    /// Runs the outbox row of one operation: claim, re-check, sent-marker,
    /// downstream call, fenced persist; retries `retry_after` failures within the
    /// deadline and the attempt cap. `answer` is the call waiting for the result
    /// (none for a worker pass): the event that ends the run answers it.
    pub(crate) fn run_operation(
        &mut self,
        op_id: &str,
        contracts: &Contracts,
        answer: Option<Answering>,
    ) -> Result<Envelope, EngineError> {
        self.run_operation_from(op_id, contracts, answer, None)
    }

    /// [`Engine::run_operation`], where `claimed` is an attempt already
    /// claimed and marked sent (in the accept's transaction) to send first.
    pub(super) fn run_operation_from(
        &mut self,
        op_id: &str,
        contracts: &Contracts,
        answer: Option<Answering>,
        mut claimed: Option<(i64, Box<OperationRow>, crate::engine::bulkhead::Slot)>,
    ) -> Result<Envelope, EngineError> {
        let _running = Running::start(&self.path, op_id);
        let mut attempts_this_call: u32 = 0;
        let salt = self.salt.clone();
        loop {
            let t0 = Instant::now();
            let worker = self.worker_id.clone();
            let (attempt, op, slot) = if let Some(c) = claimed.take() {
                c
            } else {
                let now = self.clock.now_ms();
                let defenses_now = self.defenses()?;
                let op0 = self.store.read(|tx| tx.operation(op_id))?;
                let Some(op0) = op0 else {
                    return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
                };
                let pref = self.principal_ref(&op0.tenant, &op0.subject);
                let Some(contract) = contracts.get(&op0.tool) else {
                    return Err(EngineError::invalid("UNKNOWN_TOOL", "operation names a tool not in the catalog"));
                };
                let lease_ms = contract.retry.attempt_timeout_ms as i64 + 1_000;
                let caller =
                    Caller { principal_ref: &pref, salt: &salt, answer, reserve: !defenses_now.balance_not_reserved };
                let domain = self.domain(&op0.tool);
                let claim = self.store.write(|tx| {
                    let c = ClaimCtx { contract, domain: &*domain, worker: &worker, now, lease_ms, caller: &caller };
                    claim_to_send(tx, op_id, None, &c)
                })?;
                match claim {
                    Claim::Answer(env) => return Ok(env),
                    Claim::Claimed { attempt, op, slot } => (attempt, op, slot),
                }
            };
            let now = self.clock.now_ms();
            let pref = self.principal_ref(&op.tenant, &op.subject);
            let Some(contract) = contracts.get(&op.tool) else {
                return Err(EngineError::invalid("UNKNOWN_TOOL", "operation names a tool not in the catalog"));
            };
            let domain = self.domain(&op.tool);
            failpoint::hit("after_sent");
            let defenses = self.defenses()?;
            // The deadline propagates: an attempt never waits past it.
            let dreq =
                downstream_request(&op, contract.retry.attempt_timeout_ms.min((op.deadline_at - now).max(1) as u64));
            let key = if defenses.unique_downstream_key_per_attempt {
                // Lab mode only: a new key per attempt defeats the provider's de-duplication.
                format!("{}-a{attempt}", op.downstream_key)
            } else {
                op.downstream_key.clone()
            };
            let reply = {
                let ds = self.downstream(&contract.downstream.name)?;
                std::panic::catch_unwind(AssertUnwindSafe(|| ds.execute(&key, &dreq)))
            };
            let reply = match reply {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => {
                    tracing::error!(op = op_id, attempt, error = %e, "downstream storage failed");
                    // The real cause, for the trace and the detail (never
                    // "no reply"): the adapter's own storage failed mid-call.
                    Err(format!("{e}: the downstream may or may not have committed"))
                }
                Err(_) => {
                    tracing::error!(op = op_id, attempt, "downstream handler panicked");
                    Err("handler panicked".to_string())
                }
            };
            failpoint::hit("before_persist");
            attempts_this_call += 1;
            let jitter = backoff_ms(
                &self.ids,
                contract.retry.backoff_base_ms,
                contract.retry.backoff_cap_ms,
                attempts_this_call,
            );
            let now = self.clock.now_ms();
            let pctx = PersistCtx {
                op: &op,
                contract,
                domain: &*domain,
                worker: &worker,
                attempt,
                now,
                backoff_ms: jitter,
                may_retry: attempts_this_call < contract.retry.max_attempts,
                principal_ref: &pref,
                duration_us: t0.elapsed().as_micros() as i64,
                salt: &salt,
                answer,
                naive_timeout_retry: defenses.naive_timeout_retry,
            };
            let step = self.store.write(|tx| persist(tx, &pctx, reply.clone()));
            // The send is over: its slot is free before any backoff wait.
            drop(slot);
            let step = match step {
                Ok(step) => step,
                // The downstream was called and what it answered could not be
                // recorded (the database went away, a partition, a disk, or
                // the row changed under this attempt): the caller is told what
                // is known, an unknown outcome with the status_ref to ask by,
                // never a database error as if nothing had happened. The
                // ledger holds the attempt as it last recorded it; a lease
                // that runs out goes to the reaper (docs/design.md §6, §8),
                // and a status query settles it from the downstream.
                Err(EngineError::Store(e)) => {
                    // The receipt's ids are evidence a person can look up.
                    let (receipt, request) = match &reply {
                        Ok(crate::engine::tool::Reply::Committed(r)) => {
                            (Some(r.receipt_id.clone()), Some(r.request_id.clone()))
                        }
                        _ => (None, None),
                    };
                    tracing::error!(op = op_id, attempt, error = %e, receipt = ?receipt, downstream_request = ?request, "the reply could not be recorded");
                    return Ok(crate::engine::operation::op_envelope(
                        &op,
                        Delivery::Fresh,
                        pref.clone(),
                        Some(Code::OutcomeUnknown.as_str()),
                    ));
                }
                Err(e) => return Err(e),
            };
            match step {
                Persisted::Done(env) => return Ok(env),
                Persisted::RetryAfter(ms) => self.clock.sleep_ms(ms),
                Persisted::Late(env) => {
                    // Best effort: the reply's caller gets its answer whatever
                    // the follow-up meets (the receipt is in the trace, and an
                    // explicit query can always do the same later).
                    if let Err(e) = self.act_on_late_receipt(op_id) {
                        tracing::warn!(op = op_id, error = %e, "acting on a late receipt failed");
                    }
                    return Ok(env);
                }
            }
        }
    }

    /// Runs every due outbox row (the worker loop's body). Returns how many ran.
    pub fn work(&mut self, limit: usize) -> Result<usize, EngineError> {
        self.work_due(limit, 0)
    }

    /// [`Engine::work`] for a background worker beside dispatchers (`serve`,
    /// the console, the load generator): it leaves a row alone until it has
    /// been due for [`BACKGROUND_GRACE_MS`]. The dispatcher that accepted a
    /// call runs it at once in the same call (and an in-call retry claims its
    /// row the moment it falls due); a worker polling in between would take
    /// it from under that caller, who would then be told "in flight" or
    /// "replayed" about its own first call. Rows nobody runs (approved calls,
    /// retries whose caller went away, rows re-queued by the reaper) are
    /// picked up a moment later.
    pub fn work_background(&mut self, limit: usize) -> Result<usize, EngineError> {
        self.work_due(limit, BACKGROUND_GRACE_MS)
    }

    pub(super) fn work_due(&mut self, limit: usize, grace_ms: i64) -> Result<usize, EngineError> {
        self.clock_tick();
        let contracts = self.contracts.clone();
        let mut ran = 0;
        while ran < limit {
            let now = self.clock.now_ms();
            let ready = self.store.read(|tx| tx.ready_outbox(now, now.saturating_sub(grace_ms), 16))?;
            if ready.is_empty() {
                break;
            }
            for id in ready {
                self.run_operation(&id, &contracts, None)?;
                ran += 1;
            }
        }
        Ok(ran)
    }
}

/// How long a background worker leaves a due outbox row to the caller that
/// is about to run it ([`Engine::work_background`]).
pub const BACKGROUND_GRACE_MS: i64 = 1_000;

/// Who waits for a run of the outbox row: for the envelope and the trace.
pub(super) struct Caller<'a> {
    pub(super) principal_ref: &'a str,
    pub(super) salt: &'a str,
    pub(super) answer: Option<Answering>,
    /// Holds are written (every defense on): an operation accepted without
    /// one (its rules refused at approval, or the lab's toggle was on) takes
    /// it when its re-check passes.
    pub(super) reserve: bool,
}

/// What a claim needs besides the transaction and the row: the tool, the
/// worker and its lease, the time, and who waits for the run.
#[derive(Clone, Copy)]
pub(super) struct ClaimCtx<'a> {
    pub(super) contract: &'a Contract,
    pub(super) domain: &'a dyn ToolDomain,
    pub(super) worker: &'a str,
    pub(super) now: i64,
    pub(super) lease_ms: i64,
    pub(super) caller: &'a Caller<'a>,
}

/// [`claim`], then, in the same transaction, the sent-marker: the commit
/// that returns from here is the last one before the send. A crash before it
/// leaves the row unclaimed (provably unsent); after it, the attempt is
/// possibly received, exactly as a separate sent-marker commit would leave it.
pub(super) fn claim_to_send(
    tx: &Tx<'_>,
    op_id: &str,
    built: Option<OperationRow>,
    c: &ClaimCtx<'_>,
) -> Result<Claim, EngineError> {
    let ClaimCtx { worker, now, caller, .. } = *c;
    let claimed = claim(tx, op_id, built, c)?;
    let Claim::Claimed { attempt, op, slot } = claimed else {
        return Ok(claimed);
    };
    failpoint::hit("after_claim");
    if !tx.mark_sent(op_id, worker, attempt, now)? {
        // The lease was taken in this very transaction: unreachable unless the
        // store is broken; nothing of this transaction commits.
        return Err(EngineError::invalid("SENT_MARKER_LOST", "the lease claimed in this transaction is not held"));
    }
    let mut ev = TraceEvent::of_operation(Step::Sent, &op, caller.salt, now);
    ev.attempt = Some(attempt);
    ev.worker = Some(worker.to_string());
    ev.write(tx, now)?;
    Ok(Claim::Claimed { attempt, op, slot })
}

/// Claims the outbox row and re-checks authorization, business state and
/// contract revision before anything is sent. `built`: the row the same
/// transaction has just inserted after those very checks
/// ([`Decision::Execute`]); nothing can have changed since (the transaction
/// holds the write lock), so it is neither read back nor checked again.
pub(super) fn claim(
    tx: &Tx<'_>,
    op_id: &str,
    built: Option<OperationRow>,
    c: &ClaimCtx<'_>,
) -> Result<Claim, EngineError> {
    let ClaimCtx { contract, domain, worker, now, lease_ms, caller } = *c;
    let pref = caller.principal_ref;
    let built_here = built.is_some();
    let Some(mut op) = (match built {
        Some(op) => Some(op),
        None => tx.operation(op_id)?,
    }) else {
        return Err(EngineError::invalid("NO_SUCH_OPERATION", "no such operation"));
    };
    let mut ev = TraceEvent::of_operation(Step::Claimed, &op, caller.salt, now);
    ev.worker = Some(worker.to_string());
    // Nothing to claim: the answer is the operation's state, and the trace says why.
    let skipped = |ev: &TraceEvent, env: Envelope, reason: Reason| -> Result<Claim, EngineError> {
        let mut ev = ev.clone().because(reason).from_envelope(&env).answering(caller.answer);
        ev.step = Step::ClaimSkipped;
        ev.write(tx, now)?;
        Ok(Claim::Answer(env))
    };
    // A built row's outbox row is the one accept inserted beside it in this
    // transaction (pending, due now, no attempt yet): it is not read back.
    let ob = if built_here {
        None
    } else {
        Some(match tx.outbox_for_claim(op_id)? {
            ForClaim::Row(ob) => ob,
            ForClaim::Missing => {
                return skipped(&ev, op_envelope(&op, Delivery::Fresh, pref.to_string(), None), Reason::NoOutboxRow);
            }
            // Another worker is claiming it this instant: it runs there. Its
            // claim is not committed yet, so the row still reads `accepted`; the
            // caller is answered as for any call in flight elsewhere (never
            // "nothing was sent": it may be being sent right now).
            ForClaim::Busy => {
                let seen = OperationRow { state: OpState::InFlight, ..op.clone() };
                let env = op_envelope(&seen, Delivery::LocalReplay, pref.to_string(), None);
                return skipped(&ev, env, Reason::ClaimedElsewhere);
            }
        })
    };
    let last_code = ob.as_ref().and_then(|o| o.last_code.as_deref());
    if let Some(ob) = &ob {
        // Someone else runs it (or ran it): report its state, not a fresh execution.
        if ob.state != OutboxState::Pending {
            let env = op_envelope(&op, Delivery::LocalReplay, pref.to_string(), last_code);
            return skipped(&ev, env, Reason::NotPending);
        }
        if ob.available_at > now {
            let env = op_envelope(&op, Delivery::Fresh, pref.to_string(), last_code);
            return skipped(&ev, with_retry_after(env, (ob.available_at - now) as u64), Reason::NotDue);
        }
    }
    if now >= op.deadline_at {
        // Nothing was sent and the deadline has passed: provably no effect.
        let env = with_retry_after(
            op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(Code::TimeoutBeforeExecute.as_str())),
            0,
        );
        ev.step = Step::Deadline;
        ev.timeout_stage = Some("before_send");
        let ev = ev.because(Reason::DeadlinePassed).from_envelope(&env).answering(caller.answer);
        ev.write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // A row this transaction built is not read from storage: nothing to
    // verify (debug builds, the tests, verify it all the same).
    let verified = if built_here {
        debug_assert_eq!(crate::engine::operation::verify_row_afresh(&op, caller.salt), Ok(()));
        Ok(())
    } else {
        verify_row(&op, caller.salt)
    };
    if let Err(why) = verified {
        let env = with_detail(
            error_envelope(
                Code::StatusConflict,
                ProtectedAudit { operation_id: Some(op.id.clone()), ..ProtectedAudit::default() },
            ),
            json!({"reason": "stored record failed its integrity check"}),
        );
        ev.step = Step::TamperDetected;
        ev.note = Some(why.into());
        ev.because(Reason::Tampered).from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The downstream's circuit breaker: nothing is sent while it is open.
    let admission = policy::admit_send(tx, &contract.downstream.name, op_id, now, lease_ms)?;
    if let Admission::Refused { retry_after_ms } = admission {
        let code = Code::ToolUnavailable.as_str();
        tx.release_outbox(op_id, now + retry_after_ms as i64, Some(code))?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(code)), retry_after_ms);
        ev.step = Step::Circuit;
        ev.note = Some(format!("circuit of {} is open: not sent", contract.downstream.as_str()));
        ev.because(Reason::CircuitOpen).from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The tool's retry budget: a retry after a refused attempt spends a token.
    let retrying = ob.as_ref().is_some_and(|ob| ob.attempt > 0)
        && tx.attempts(op_id)?.last().is_some_and(|a| a.outcome == Some(AttemptOutcome::Refused));
    if retrying && !policy::budget_withdraw(tx, &op.tool, &contract.retry, now)? {
        if admission == Admission::Probe {
            policy::release_probe(tx, &contract.downstream.name, op_id, now)?;
        }
        // No jitter source here; the longest backoff is the honest hint.
        let wait = contract.retry.backoff_cap_ms.max(1);
        tx.release_outbox(op_id, now + wait as i64, None)?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), last_code), wait);
        ev.step = Step::RetryBudget;
        ev.note = Some("retry budget of the tool exhausted: not sent".into());
        ev.because(Reason::BudgetExhausted).from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    // The downstream's bulkhead: a slow downstream takes at most its limit
    // of this process's engine threads; beyond it nothing is sent and the
    // operation waits in the outbox under its key.
    let limit = crate::engine::bulkhead::limit_of(contract.downstream.max_in_flight);
    let Some(slot) = crate::engine::bulkhead::try_acquire(&contract.downstream.name, limit) else {
        if admission == Admission::Probe {
            policy::release_probe(tx, &contract.downstream.name, op_id, now)?;
        }
        let wait = crate::engine::bulkhead::FULL_RETRY_AFTER_MS;
        let code = Code::ToolUnavailable.as_str();
        tx.release_outbox(op_id, now + wait as i64, Some(code))?;
        let env = with_retry_after(op_envelope(&op, Delivery::Fresh, pref.to_string(), Some(code)), wait);
        ev.step = Step::Bulkhead;
        ev.note = Some(format!(
            "{limit} call(s) to {} in flight from this process already: not sent",
            contract.downstream.as_str()
        ));
        ev.because(Reason::BulkheadFull).from_envelope(&env).answering(caller.answer).write(tx, now)?;
        return Ok(Claim::Answer(env));
    };
    let Some(attempt) = tx.claim(op_id, worker, now, now + lease_ms)? else {
        return skipped(&ev, op_envelope(&op, Delivery::LocalReplay, pref.to_string(), None), Reason::LostRace);
    };
    if attempt == 1 {
        // Load earns retries: each first attempt deposits the tool's ratio.
        policy::budget_deposit(tx, &op.tool, &contract.retry, now)?;
    }
    ev.attempt = Some(attempt);
    ev.reason = Some(if attempt > 1 { Reason::Retry } else { Reason::FirstAttempt });
    // Re-check: authorization, business state and contract revision, read now
    // (unless this transaction made those checks itself).
    let args: Option<Value> = (!built_here).then(|| args_of(&op.request_json));
    let (tenant, subject, tool) = (&op.tenant, &op.subject, &op.tool);
    let mut failed: Option<(Code, Reason)> = None;
    if let Some(code) = args.as_ref().map(|a| authorize(tx, domain, tenant, subject, tool, a)).transpose()?.flatten() {
        failed = Some((code, Reason::Unauthorized));
    } else if revisions_of(&op) != contract.revisions {
        failed = Some((Code::BusinessRuleViolation, Reason::ContractRevisionChanged));
    } else if let Some(rule) = args
        .as_ref()
        .map(|a| business_rules(tx, domain, [tenant, subject, tool], a, Some(op_id)))
        .transpose()?
        .flatten()
    {
        failed = Some((Code::BusinessRuleViolation, Reason::Rule(rule)));
    }
    if let Some((code, why)) = failed {
        tx.finish_attempt(op_id, attempt, AttemptOutcome::NotSent, Some(code.as_str()), now)?;
        // Nothing more is sent; but an earlier attempt that may have been
        // received may still land: then the outcome is unknown (a status query
        // or a person settles it, and its hold stays), never "failed".
        let earlier =
            attempt > 1 && tx.attempts(op_id)?.iter().any(|a| a.attempt != attempt && !a.proven_not_received());
        if earlier {
            tx.close_outbox(op_id, OutboxState::Parked, Some(Code::OutcomeUnknown.as_str()))?;
            op.state = contract.downstream.unknown_state();
            op.code = Some(Code::OutcomeUnknown.as_str().into());
        } else {
            tx.close_outbox(op_id, OutboxState::Done, Some(code.as_str()))?;
            op.state = crate::store::OpState::Failed;
            op.code = Some(code.as_str().into());
        }
        op.updated_at = now;
        tx.update_operation(&op)?.or_stale()?;
        op.version += 1;
        let env = op_envelope(&op, Delivery::Fresh, pref.to_string(), None);
        ev.step = Step::RecheckFailed;
        ev.note = Some(why.as_str().into());
        ev.deadline_left_ms = None;
        let ev = ev.because(why).from_envelope(&env).answering(caller.answer);
        ev.write(tx, now)?;
        return Ok(Claim::Answer(env));
    }
    if let (true, Some(a)) = (caller.reserve, args.as_ref()) {
        // Accepted without a hold (rules refused at approval, or the lab's
        // toggle was on then): what the rules just granted is held now.
        if tx.hold_of(op_id)?.is_none() {
            reserve(tx, domain, &op, a, now)?;
        }
    }
    // The row this transaction inserted is what the ledger holds: no need to read it again.
    let stored = built_here.then(|| op.clone());
    op.state = crate::store::OpState::InFlight;
    op.updated_at = now;
    match &stored {
        Some(stored) => tx.update_operation_from(stored, &op)?,
        None => tx.update_operation(&op)?,
    }
    .or_stale()?;
    op.version += 1;
    ev.write(tx, now)?;
    Ok(Claim::Claimed { attempt, op: Box::new(op), slot })
}

/// A refusal that proves nothing was received: retry within the deadline, or
/// answer with `retry_after_ms`.
pub(super) fn refused(
    tx: &Tx<'_>,
    c: &PersistCtx<'_>,
    op: &mut OperationRow,
    mut ev: TraceEvent,
    code: Code,
    delay: u64,
    stage: Option<&'static str>,
) -> Result<Persisted, EngineError> {
    let op_id = c.op.id.as_str();
    tx.finish_attempt(op_id, c.attempt, AttemptOutcome::Refused, Some(code.as_str()), c.now)?;
    tx.release_outbox(op_id, c.now + delay as i64, Some(code.as_str()))?;
    // `accepted` promises that nothing was sent. After a re-queued possibly-sent
    // attempt that is no longer true: the operation stays `in_flight` (callers see
    // OUTCOME_UNKNOWN, and the reaper parks it if the deadline passes).
    let earlier = earlier_possibly_received(tx, op_id, c.attempt)?;
    op.state = if earlier { OpState::InFlight } else { OpState::Accepted };
    op.code = Some(code.as_str().into());
    tx.update_operation(op)?.or_stale()?;
    op.version += 1;
    ev.timeout_stage = stage;
    ev.code = Some(code);
    ev.outcome = Some("not_started");
    ev.retry_after_ms = Some(delay);
    ev.downstream_committed = Some(false);
    let within_deadline = c.now + (delay as i64) < op.deadline_at;
    // A credentials refusal is not retried by this call: nothing changes until
    // an operator fixes the configuration.
    let automatic = code != Code::DownstreamAuthFailed;
    if c.may_retry && automatic && within_deadline {
        ev.note = Some("provably not received: retry after backoff".into());
        ev.because(Reason::RetryScheduled).write(tx, c.now)?;
        return Ok(Persisted::RetryAfter(delay));
    }
    if automatic {
        ev.note = Some(if within_deadline {
            "attempt cap reached".into()
        } else {
            "next retry would pass the deadline".into()
        });
        ev.reason = Some(if within_deadline { Reason::AttemptsExhausted } else { Reason::DeadlineExhausted });
    } else {
        ev.reason = Some(Reason::DownstreamAuthFailed);
    }
    let env =
        with_retry_after(op_envelope(op, Delivery::Fresh, c.principal_ref.to_string(), Some(code.as_str())), delay);
    ev.from_envelope(&env).answering(c.answer).write(tx, c.now)?;
    Ok(Persisted::Done(env))
}

/// What the engine sends downstream for an operation (an attempt, or a status
/// query's re-send), waiting at most `timeout_ms`.
pub(crate) fn downstream_request(op: &OperationRow, timeout_ms: u64) -> DownstreamRequest {
    DownstreamRequest {
        // The business intent is the whole scope, not the key string alone;
        // and it is the caller's key even when a lab toggle re-scoped the ledger.
        intent: intent_of(Scope { key: caller_key(&op.idem_key), ..op.scope() }),
        tool: op.tool.clone(),
        arguments: args_of(&op.request_json),
        request_sha256: op.request_sha256.clone(),
        timeout_ms,
    }
}

/// Whether an attempt other than `this` may have been received downstream.
pub(super) fn earlier_possibly_received(tx: &Tx<'_>, op_id: &str, this: i64) -> Result<bool, StoreError> {
    Ok(tx.attempts(op_id)?.iter().any(|a| a.attempt != this && !a.proven_not_received()))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::Running;

    #[test]
    fn a_run_ending_leaves_another_run_of_the_same_operation_known() {
        let (a, b) = (Path::new("/tmp/running-test-a.db"), Path::new("/tmp/running-test-b.db"));
        let first = Running::start(a, "op_1");
        // A second run in this process (a worker pass that then finds the
        // lease taken) ends while the first still runs.
        drop(Running::start(a, "op_1"));
        assert!(Running::holds(a, "op_1"), "the first run is still running");
        // Another ledger's operation with the same id is another operation.
        assert!(!Running::holds(b, "op_1"));
        let other = Running::start(b, "op_1");
        drop(other);
        assert!(Running::holds(a, "op_1") && !Running::holds(b, "op_1"));
        drop(first);
        assert!(!Running::holds(a, "op_1"));
    }
}
