//! Resilience policies (docs/design.md §11): when an automatic retry may happen, and when a
//! downstream is left alone.
//!
//! - **Backoff**: exponential with full jitter, `uniform(0, min(cap, base·2^(n-1)))`
//!   ([`backoff_ms`]); a provider's Retry-After wins when it is larger
//!   ([`retry_delay_ms`]). Nothing is retried past the operation deadline (the
//!   caller then gets the code with `retry_after_ms`, and the operation stays
//!   retryable): `dispatch::refused` checks it, and a claim whose deadline has
//!   passed answers `TIMEOUT_BEFORE_EXECUTE` without sending.
//! - **Retry budget** per tool, a token bucket: each first attempt deposits
//!   `budget_percent / 100` of a token, each automatic retry spends one, and the
//!   bucket holds at most `budget_burst` tokens. So retries add at most that
//!   fraction of the load, plus a small burst, however many callers retry.
//! - **Circuit breaker** per downstream: closed → open after `failure_threshold`
//!   consecutive transient failures → after `cool_down_ms` one probe goes through
//!   (half-open) → closed on a healthy reply, open again on a failing one. While
//!   open, a new call is refused before accept with `TOOL_UNAVAILABLE` and
//!   `retry_after_ms` (only its trace is stored), and an accepted operation's
//!   claim is refused the same way without sending.
//!
//! Both states live in the database (migration 0004, `store::resilience`), so
//! every process sharing the ledger shares them; every change happens inside the
//! claim's or the persist's `BEGIN IMMEDIATE` transaction.

use super::contracts::{CircuitPolicy, RetryPolicy};
use super::ids::Ids;
use super::tool::Reply;
use crate::store::{CircuitRow, CircuitState, StoreError, Tx, MILLI_TOKEN};

/// Full-jitter exponential backoff: uniform in `[0, min(cap, base·2^(attempt-1))]`
/// for the `attempt`-th retry.
pub fn backoff_ms(ids: &Ids, base: u64, cap: u64, attempt: u32) -> u64 {
    let exp = base.saturating_mul(1u64 << attempt.saturating_sub(1).min(30));
    ids.up_to(exp.min(cap))
}

/// The wait before the next attempt: the backoff, or the provider's Retry-After
/// when that is longer (it knows its own load better than our jitter does).
pub fn retry_delay_ms(backoff_ms: u64, retry_after_ms: Option<u64>) -> u64 {
    retry_after_ms.map_or(backoff_ms, |r| r.max(backoff_ms))
}

// ------------------------------------------------------------ retry budget

fn capacity_milli(p: &RetryPolicy) -> i64 {
    i64::from(p.budget_burst) * MILLI_TOKEN
}

fn deposit_milli(p: &RetryPolicy) -> i64 {
    i64::from(p.budget_percent) * MILLI_TOKEN / 100
}

/// A first attempt of `tool` earns the budget its share of a retry.
pub(crate) fn budget_deposit(tx: &Tx<'_>, tool: &str, p: &RetryPolicy, now: i64) -> Result<(), StoreError> {
    tx.budget_deposit(tool, deposit_milli(p), capacity_milli(p), now)
}

/// An automatic retry of `tool` asks the budget for a token.
pub(crate) fn budget_withdraw(tx: &Tx<'_>, tool: &str, p: &RetryPolicy, now: i64) -> Result<bool, StoreError> {
    tx.budget_withdraw(tool, capacity_milli(p), now)
}

// --------------------------------------------------------- circuit breaker

/// Whether a call may go to a downstream now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admission {
    /// Closed: go.
    Closed,
    /// Half-open, and this operation is the one probe.
    Probe,
    /// Open (or a probe is out): come back after this long.
    Refused {
        /// Until the cool-down ends or the probe's slot lapses.
        retry_after_ms: u64,
    },
}

/// What a reply says about the downstream's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Health {
    /// It answered (committed, refused the business request, or rate-limited us).
    Healthy,
    /// It did not answer usefully: unavailable, connect timeout, response
    /// timeout, malformed reply.
    Failing,
    /// Our side failed (the handler panicked, our storage failed): says nothing.
    Neutral,
}

/// The health a reply reports.
pub(crate) fn health(reply: &Result<Reply, String>) -> Health {
    match reply {
        Ok(
            Reply::Committed(_)
            | Reply::Rejected { .. }
            | Reply::RateLimited { .. }
            | Reply::InProgress { .. }
            | Reply::KeyConflict
            // The downstream answered: its tool failed, the service did not.
            | Reply::ToolFailed(_),
        ) => Health::Healthy,
        Ok(
            Reply::Unavailable { .. }
            | Reply::ConnectTimeout
            | Reply::TimedOut
            | Reply::ServerError
            | Reply::Malformed
            | Reply::AuthRefused(_),
        ) => Health::Failing,
        Err(_) => Health::Neutral,
    }
}

fn wait_until(until: Option<i64>, now: i64) -> u64 {
    until.map_or(1, |u| (u - now).max(1) as u64)
}

/// The gate for a *new* call, before accept: refused while the circuit is open
/// and cooling down, or half-open with a probe out. It never takes the probe
/// slot (nothing is sent at accept; the claim does that). A refusal is counted.
pub(crate) fn admit_new(tx: &Tx<'_>, downstream: &str, now: i64) -> Result<Option<u64>, StoreError> {
    let refusal = |c: &CircuitRow| match c.state {
        CircuitState::Open if c.open_until.is_some_and(|u| now < u) => Some(wait_until(c.open_until, now)),
        CircuitState::HalfOpen if c.probe_until.is_some_and(|u| now < u) => Some(wait_until(c.probe_until, now)),
        _ => None,
    };
    let Some(c) = tx.circuit(downstream)? else { return Ok(None) };
    if refusal(&c).is_none() {
        return Ok(None);
    }
    // About to count a refusal: decide again on the row under its lock.
    let Some(mut c) = tx.circuit_for_change(downstream)? else { return Ok(None) };
    let wait = refusal(&c);
    if wait.is_some() {
        c.refused_total += 1;
        c.updated_at = now;
        tx.put_circuit(&c)?;
    }
    Ok(wait)
}

/// The gate before a send (in the claim's transaction). Open and cooled down, or
/// half-open with a lapsed probe: this operation becomes the probe, holding the
/// slot for `probe_ms`.
pub(crate) fn admit_send(
    tx: &Tx<'_>,
    downstream: &str,
    operation_id: &str,
    now: i64,
    probe_ms: i64,
) -> Result<Admission, StoreError> {
    match tx.circuit(downstream)? {
        None => return Ok(Admission::Closed),
        Some(c) if c.state == CircuitState::Closed => return Ok(Admission::Closed),
        Some(_) => {}
    }
    // Not closed: whatever this claim decides (become the probe, be refused)
    // it writes, so it decides on the row under its lock (two hosts never
    // both become the probe).
    let Some(mut c) = tx.circuit_for_change(downstream)? else { return Ok(Admission::Closed) };
    let take_probe = |c: &mut CircuitRow| -> Result<Admission, StoreError> {
        c.state = CircuitState::HalfOpen;
        c.open_until = None;
        c.probe_operation = Some(operation_id.to_string());
        c.probe_until = Some(now + probe_ms);
        c.updated_at = now;
        tx.put_circuit(c)?;
        Ok(Admission::Probe)
    };
    match c.state {
        CircuitState::Open if c.open_until.is_some_and(|u| now < u) => {}
        CircuitState::Open => return take_probe(&mut c),
        CircuitState::HalfOpen if c.probe_operation.as_deref() == Some(operation_id) => return take_probe(&mut c),
        CircuitState::HalfOpen if c.probe_until.is_some_and(|u| now < u) => {}
        CircuitState::HalfOpen => return take_probe(&mut c),
        CircuitState::Closed | CircuitState::Unrecognized => return Ok(Admission::Closed),
    }
    let until = if c.state == CircuitState::Open { c.open_until } else { c.probe_until };
    c.refused_total += 1;
    c.updated_at = now;
    tx.put_circuit(&c)?;
    Ok(Admission::Refused { retry_after_ms: wait_until(until, now) })
}

/// Gives a probe slot back without sending (the claim was refused for another
/// reason after the circuit let it through).
pub(crate) fn release_probe(tx: &Tx<'_>, downstream: &str, operation_id: &str, now: i64) -> Result<(), StoreError> {
    if let Some(mut c) = tx.circuit_for_change(downstream)? {
        if c.state == CircuitState::HalfOpen && c.probe_operation.as_deref() == Some(operation_id) {
            c.probe_operation = None;
            c.probe_until = Some(now);
            c.updated_at = now;
            tx.put_circuit(&c)?;
        }
    }
    Ok(())
}

/// A state change of a circuit, for the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Transition {
    /// From.
    pub from: CircuitState,
    /// To.
    pub to: CircuitState,
}

/// A stored state as the breaker acts on it: unrecognized text is closed.
fn known(s: CircuitState) -> CircuitState {
    match s {
        CircuitState::Unrecognized => CircuitState::Closed,
        s => s,
    }
}

/// Records a reply's health against the downstream's circuit (in the persist's
/// transaction). A healthy reply on a clean closed circuit writes nothing.
pub(crate) fn record(
    tx: &Tx<'_>,
    downstream: &str,
    policy: &CircuitPolicy,
    health: Health,
    now: i64,
) -> Result<Option<Transition>, StoreError> {
    let clean = |c: &Option<CircuitRow>| match (health, c) {
        (Health::Neutral, _) | (Health::Healthy, None) => true,
        (Health::Healthy, Some(c)) => c.state == CircuitState::Closed && c.consecutive_failures == 0,
        (Health::Failing, _) => false,
    };
    if clean(&tx.circuit(downstream)?) {
        return Ok(None);
    }
    // About to write: decide on the row under its lock.
    let existing = tx.circuit_for_change(downstream)?;
    if clean(&existing) {
        return Ok(None);
    }
    let mut c = existing.unwrap_or_else(|| CircuitRow::closed(downstream, now));
    let from = known(c.state);
    c.updated_at = now;
    let open = |c: &mut CircuitRow| {
        c.state = CircuitState::Open;
        c.open_until = Some(now + policy.cool_down_ms as i64);
        c.probe_operation = None;
        c.probe_until = None;
        c.opened_total += 1;
    };
    if health == Health::Healthy {
        c.state = CircuitState::Closed;
        c.consecutive_failures = 0;
        c.open_until = None;
        c.probe_operation = None;
        c.probe_until = None;
    } else {
        c.consecutive_failures += 1;
        match from {
            CircuitState::Closed if c.consecutive_failures >= i64::from(policy.failure_threshold.max(1)) => {
                open(&mut c);
            }
            CircuitState::HalfOpen => open(&mut c),
            _ => {}
        }
    }
    tx.put_circuit(&c)?;
    let to = known(c.state);
    Ok((from != to).then_some(Transition { from, to }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_by_cap_and_exponent() {
        let ids = Ids::seeded(7);
        for attempt in 1..10 {
            for _ in 0..200 {
                let d = backoff_ms(&ids, 100, 2_000, attempt);
                assert!(d <= (100u64 << (attempt - 1)).min(2_000), "attempt {attempt}: {d}");
            }
        }
        assert_eq!(backoff_ms(&ids, 0, 0, 3), 0);
    }

    #[test]
    fn retry_after_wins_when_larger() {
        for (backoff, after, expect) in [(100, None, 100), (100, Some(50), 100), (100, Some(900), 900), (0, Some(0), 0)]
        {
            assert_eq!(retry_delay_ms(backoff, after), expect, "{backoff} {after:?}");
        }
    }

    #[test]
    fn health_of_replies() {
        let check = |r: Result<Reply, String>, h: Health| assert_eq!(health(&r), h, "{r:?}");
        check(Ok(Reply::Rejected { reason: "x".into(), refusal: None }), Health::Healthy);
        check(Ok(Reply::RateLimited { retry_after_ms: 5 }), Health::Healthy);
        check(Ok(Reply::Unavailable { retry_after_ms: None }), Health::Failing);
        check(Ok(Reply::ConnectTimeout), Health::Failing);
        check(Ok(Reply::TimedOut), Health::Failing);
        check(Ok(Reply::Malformed), Health::Failing);
        check(Err("handler panicked".into()), Health::Neutral);
    }
}
