//! The reaper (docs/design.md §6): leases and deadlines that ran out.

use super::ReapReport;
use crate::engine::envelope::Code;
use crate::engine::trace::TraceEvent;
use crate::engine::{Engine, EngineError};
use crate::store::Reason;
use crate::store::Step;
use crate::store::{AttemptOutcome, OpState, OutboxState, StoreError, SENDER_DETACHED};

impl Engine {
    /// One reaper pass (docs/design.md §6).
    pub fn reap(&mut self) -> Result<ReapReport, EngineError> {
        if let Some(why) = self.clock_check()? {
            return Ok(ReapReport { clock_paused: Some(why), ..ReapReport::default() });
        }
        let now = self.clock.now_ms();
        let contracts = self.contracts.clone();
        let salt = self.salt.clone();
        // A lease is never longer than the longest attempt timeout plus a
        // second; one that ends further ahead was written on a clock that ran
        // ahead (before the one clock, or by hand) and is treated as expired,
        // with the clock bound as slack.
        let longest = contracts.all().iter().map(|c| c.retry.attempt_timeout_ms as i64 + 1_000).max().unwrap_or(0);
        let beyond = now + longest + crate::engine::ledger_clock::CLOCK_BOUND_MS;
        Ok(self.store.write(|tx| -> Result<ReapReport, StoreError> {
            let mut report = ReapReport::default();
            for ob in tx.expired_leases(now, beyond)? {
                let Some(mut op) = tx.operation(&ob.operation_id)? else { continue };
                let attempts = tx.attempts(&ob.operation_id)?;
                let current = attempts.iter().find(|a| a.attempt == ob.attempt);
                let sent = current.is_some_and(|a| a.sent_at.is_some());
                let honours = contracts.get(&op.tool).is_some_and(|c| c.downstream.honours_keys());
                let mut ev = TraceEvent::of_operation(Step::Reaped, &op, &salt, now);
                ev.attempt = Some(ob.attempt);
                ev.worker.clone_from(&ob.lease_owner);
                if !sent {
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::NotSent, None, now)?;
                    tx.release_outbox(&op.id, now, None)?;
                    // Back to `accepted` only if no earlier attempt may have been received.
                    let earlier = attempts.iter().any(|a| a.attempt != ob.attempt && !a.proven_not_received());
                    op.state = if earlier { OpState::InFlight } else { OpState::Accepted };
                    ev.note = Some("lease expired before send: back to accepted".into());
                    ev.reason = Some(Reason::RequeuedUnsent);
                    report.requeued_unsent += 1;
                } else if honours && now < op.deadline_at {
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::Unknown, Some(SENDER_DETACHED), now)?;
                    tx.release_outbox(&op.id, now, Some("OUTCOME_UNKNOWN"))?;
                    op.state = crate::store::OpState::InFlight;
                    ev.note = Some("lease expired after send: re-queued with the same downstream key".into());
                    ev.reason = Some(Reason::RequeuedSameKey);
                    report.requeued_same_key += 1;
                } else {
                    // Past the deadline nothing is sent again (docs/design.md §11), and a
                    // re-queued row would never be picked up: the explicit status
                    // query (or a human) settles it.
                    tx.finish_attempt(&op.id, ob.attempt, AttemptOutcome::Unknown, Some(SENDER_DETACHED), now)?;
                    tx.close_outbox(&op.id, OutboxState::Parked, Some("OUTCOME_UNKNOWN"))?;
                    op.state = contracts.get(&op.tool).map_or(OpState::Unknown, |c| c.downstream.unknown_state());
                    op.code = Some(Code::OutcomeUnknown.as_str().into());
                    ev.code = Some(Code::OutcomeUnknown);
                    ev.outcome = Some("unknown");
                    ev.timeout_stage = Some("response");
                    ev.note = Some(if honours {
                        "lease expired after send, deadline passed: unknown".into()
                    } else {
                        "lease expired after send, downstream does not de-duplicate: unknown".into()
                    });
                    ev.reason = Some(Reason::ParkedUnknown);
                    report.parked_unknown += 1;
                }
                op.updated_at = now;
                tx.update_operation(&op)?.or_stale()?;
                ev.write(tx, now)?;
            }
            // Re-queued possibly-sent attempts whose deadline passed before a
            // worker re-sent them: no worker picks them up any more, so they
            // would be stuck in flight for ever. Park them for a status query.
            for id in tx.overdue_in_flight(now)? {
                let Some(mut op) = tx.operation(&id)? else { continue };
                tx.close_outbox(&id, OutboxState::Parked, Some("OUTCOME_UNKNOWN"))?;
                op.state = contracts.get(&op.tool).map_or(OpState::Unknown, |c| c.downstream.unknown_state());
                op.code = Some(Code::OutcomeUnknown.as_str().into());
                op.updated_at = now;
                tx.update_operation(&op)?.or_stale()?;
                let mut ev = TraceEvent::of_operation(Step::Reaped, &op, &salt, now);
                ev.code = Some(Code::OutcomeUnknown);
                ev.outcome = Some("unknown");
                ev.timeout_stage = Some("deadline");
                ev.note = Some("deadline passed before a possibly-sent attempt was re-sent: unknown".into());
                ev.reason = Some(Reason::ParkedUnknown);
                ev.write(tx, now)?;
                report.parked_unknown += 1;
            }
            tx.prune_metric_minutes(crate::engine::trace::minutes_retained_from(now))?;
            Ok(report)
        })?)
    }
}
