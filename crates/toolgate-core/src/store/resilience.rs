//! Typed queries for the resilience policies (migration 0004): the per-tool retry
//! budget and the per-downstream circuit breaker. The policy logic lives in
//! `engine::policy`; this file only reads and writes the rows, inside the
//! caller's transaction.

use super::sql::sql_text;
use super::sql::{params, Row};
use serde::Serialize;

use super::{CircuitState, Tx, R};

/// One thousandth of a retry token: the unit of [`RetryBudgetRow`].
pub const MILLI_TOKEN: i64 = 1000;

/// A tool's retry budget (token bucket). A tool without a row has a full bucket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RetryBudgetRow {
    /// Tool.
    pub tool: String,
    /// Tokens left, in thousandths (one retry costs 1000).
    pub tokens_milli: i64,
    /// Capacity, in thousandths.
    pub capacity_milli: i64,
    /// Retries the budget allowed, all time.
    pub retries: i64,
    /// Retries the budget refused, all time.
    pub refused: i64,
    /// Last change.
    pub updated_at: i64,
}

impl RetryBudgetRow {
    fn from_row(r: &Row<'_>) -> R<Self> {
        Ok(Self {
            tool: r.get(0)?,
            tokens_milli: r.get(1)?,
            capacity_milli: r.get(2)?,
            retries: r.get(3)?,
            refused: r.get(4)?,
            updated_at: r.get(5)?,
        })
    }
}

/// A downstream's circuit breaker. A downstream without a row is closed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CircuitRow {
    /// Downstream (`payments`, `notifications`).
    pub downstream: String,
    /// Closed, open or half-open.
    pub state: CircuitState,
    /// Transient failures in a row.
    pub consecutive_failures: i64,
    /// While open: no call before this instant.
    pub open_until: Option<i64>,
    /// While half-open: the operation sending the probe.
    pub probe_operation: Option<String>,
    /// While half-open: the probe's slot is held until then.
    pub probe_until: Option<i64>,
    /// Times it opened, all time.
    pub opened_total: i64,
    /// Calls it refused, all time.
    pub refused_total: i64,
    /// Last change.
    pub updated_at: i64,
}

impl CircuitRow {
    /// A closed circuit with no history.
    pub fn closed(downstream: &str, now: i64) -> Self {
        Self {
            downstream: downstream.to_string(),
            state: CircuitState::Closed,
            consecutive_failures: 0,
            open_until: None,
            probe_operation: None,
            probe_until: None,
            opened_total: 0,
            refused_total: 0,
            updated_at: now,
        }
    }

    fn from_row(r: &Row<'_>) -> R<Self> {
        Ok(Self {
            downstream: r.get(0)?,
            state: r.get(1)?,
            consecutive_failures: r.get(2)?,
            open_until: r.get(3)?,
            probe_operation: r.get(4)?,
            probe_until: r.get(5)?,
            opened_total: r.get(6)?,
            refused_total: r.get(7)?,
            updated_at: r.get(8)?,
        })
    }
}

/// A tool's operations waiting out a provider's rate limit: pending outbox rows
/// whose last attempt was answered `RATE_LIMIT` and that are not due yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RateLimitedRow {
    /// Tool.
    pub tool: String,
    /// Operations waiting.
    pub waiting: i64,
    /// When the last of them is due again.
    pub until: i64,
}

const BUDGET_COLS: &str = "tool, tokens_milli, capacity_milli, retries, refused, updated_at";
const CIRCUIT_COLS: &str = "downstream, state, consecutive_failures, open_until, probe_operation, probe_until, \
                            opened_total, refused_total, updated_at";

impl Tx<'_> {
    // ------------------------------------------------------- retry budget

    /// A first attempt deposits `deposit_milli` into the tool's bucket, up to
    /// `capacity_milli`. A full bucket (or a missing row) is not written at all,
    /// so the common case costs one indexed lookup.
    pub fn budget_deposit(&self, tool: &str, deposit_milli: i64, capacity_milli: i64, now: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE retry_budgets SET tokens_milli = CASE WHEN tokens_milli + ?2 > ?3 THEN ?3 ELSE tokens_milli + ?2 END, capacity_milli = ?3, updated_at = ?4
                 WHERE tool = ?1 AND tokens_milli < ?3",
            )?
            .execute(params![tool, deposit_milli, capacity_milli, now])?;
        Ok(())
    }

    /// An automatic retry asks for one token. Returns whether it got it; either
    /// way the all-time counters move.
    pub fn budget_withdraw(&self, tool: &str, capacity_milli: i64, now: i64) -> R<bool> {
        self.conn
            .prepare_cached(
                "INSERT INTO retry_budgets (tool, tokens_milli, capacity_milli, updated_at) VALUES (?1, ?2, ?2, ?3)
                 ON CONFLICT (tool) DO NOTHING",
            )?
            .execute(params![tool, capacity_milli, now])?;
        let took = self
            .conn
            .prepare_cached(
                "UPDATE retry_budgets SET tokens_milli = CASE WHEN tokens_milli > ?2 THEN ?2 ELSE tokens_milli END - ?4, capacity_milli = ?2,
                   retries = retries + 1, updated_at = ?3
                 WHERE tool = ?1 AND CASE WHEN tokens_milli > ?2 THEN ?2 ELSE tokens_milli END >= ?4",
            )?
            .execute(params![tool, capacity_milli, now, MILLI_TOKEN])?
            == 1;
        if !took {
            self.conn
                .prepare_cached("UPDATE retry_budgets SET refused = refused + 1, updated_at = ?2 WHERE tool = ?1")?
                .execute(params![tool, now])?;
        }
        Ok(took)
    }

    /// Every tool's budget row (tools never short of a token have none).
    pub fn retry_budgets(&self) -> R<Vec<RetryBudgetRow>> {
        let mut st = self.conn.prepare_cached(sql_text!("SELECT {BUDGET_COLS} FROM retry_budgets ORDER BY tool"))?;
        let rows = st.query_map((), RetryBudgetRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    // ---------------------------------------------------- circuit breaker

    /// A downstream's circuit, if it ever left the initial closed state.
    pub fn circuit(&self, downstream: &str) -> R<Option<CircuitRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {CIRCUIT_COLS} FROM circuits WHERE downstream = ?1"))?
            .query_opt([downstream], CircuitRow::from_row)
    }

    /// A downstream's circuit read for a change: on PostgreSQL under a row
    /// lock (`FOR UPDATE`), so two hosts deciding at once (who becomes the
    /// half-open probe, who opens it) queue on the row instead of both acting
    /// on what they read; on SQLite the write transaction already holds the
    /// whole file. Gates read with [`Tx::circuit`] first and take the lock only
    /// when they are about to write: a closed circuit costs no lock.
    pub fn circuit_for_change(&self, downstream: &str) -> R<Option<CircuitRow>> {
        if self.backend() != super::Backend::Postgres {
            return self.circuit(downstream);
        }
        self.conn
            .prepare_cached(sql_text!("SELECT {CIRCUIT_COLS} FROM circuits WHERE downstream = ?1 FOR UPDATE"))?
            .query_opt([downstream], CircuitRow::from_row)
    }

    /// Writes a circuit's row (insert or replace).
    pub fn put_circuit(&self, c: &CircuitRow) -> R<()> {
        self.conn
            .prepare_cached(sql_text!(
                "INSERT INTO circuits ({CIRCUIT_COLS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)
                 ON CONFLICT (downstream) DO UPDATE SET state = excluded.state,
                   consecutive_failures = excluded.consecutive_failures, open_until = excluded.open_until,
                   probe_operation = excluded.probe_operation, probe_until = excluded.probe_until,
                   opened_total = excluded.opened_total, refused_total = excluded.refused_total,
                   updated_at = excluded.updated_at"
            ))?
            .execute(params![
                c.downstream,
                c.state.as_str(),
                c.consecutive_failures,
                c.open_until,
                c.probe_operation,
                c.probe_until,
                c.opened_total,
                c.refused_total,
                c.updated_at
            ])?;
        Ok(())
    }

    /// Per tool, the operations cooling down after a `RATE_LIMIT` answer at
    /// `now` (pending, due later; served by the `outbox_ready` index).
    pub fn rate_limited(&self, now: i64) -> R<Vec<RateLimitedRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT p.tool, count(*), max(o.available_at) FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state = 'pending' AND o.available_at > ?1 AND o.last_code = 'RATE_LIMIT'
             GROUP BY p.tool ORDER BY p.tool",
        )?;
        let rows =
            st.query_map([now], |r| Ok(RateLimitedRow { tool: r.get(0)?, waiting: r.get(1)?, until: r.get(2)? }))?;
        rows.collect::<Result<_, _>>()
    }

    /// Every downstream's circuit row (downstreams never disturbed have none).
    pub fn circuits(&self) -> R<Vec<CircuitRow>> {
        let mut st = self.conn.prepare_cached(sql_text!("SELECT {CIRCUIT_COLS} FROM circuits ORDER BY downstream"))?;
        let rows = st.query_map((), CircuitRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }
}
