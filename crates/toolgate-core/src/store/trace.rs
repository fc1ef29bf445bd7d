//! Typed queries: Trace events (their rollups: folded in batches on SQLite, kept by triggers on PostgreSQL).

use super::sql::sql_text;
use super::{params, TraceRow, Tx, R, TRACE_COLS};

impl Tx<'_> {
    // ---------------------------------------------------------------- trace

    /// Appends a trace event.
    pub fn insert_trace(&self, e: &TraceRow) -> R<()> {
        // The trace's order is `seq`: SQLite's rowid, and on PostgreSQL the
        // column's sequence, which leaves a gap for every rolled-back insert.
        // What proves that no event was deleted is a gapless number: `seq`
        // itself on SQLite, which never leaves one; on PostgreSQL a number
        // per writer's slot that the insert's trigger takes (migration
        // pg/0004), so that concurrent writers do not all read and write the
        // one "next number" (see `Tx::trace_damage`).
        let sql = "INSERT INTO trace_events (at, operation_id, step, tool, code, outcome, delivery, attempt, duration_us, fields,
                     answer, latency_us, tenant_ref, tool_version, timeout_stage, reason, latency_bucket_us)
                   VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)";
        self.conn.prepare_cached(sql)?.execute(params![
            e.at,
            e.operation_id,
            e.step,
            e.tool,
            e.code,
            e.outcome,
            e.delivery,
            e.attempt,
            e.duration_us,
            e.fields,
            e.answer,
            e.latency_us,
            e.tenant_ref,
            e.tool_version,
            e.timeout_stage,
            e.reason,
            // The one rounding rule of the latency rollups (migration 0006).
            e.latency_us.map(super::latency_bucket::bucket_upper)
        ])?;
        // SQLite folds the rollups every FOLD_EVERY events (migration 0012):
        // `seq` is the rowid, gapless, so exactly one insert in FOLD_EVERY
        // folds (again, if its transaction rolled back and the number is reused).
        if self.conn.last_insert_rowid().is_some_and(|seq| seq % super::FOLD_EVERY == 0) {
            self.fold_rollups()?;
        }
        Ok(())
    }

    /// The trace of one operation.
    pub fn trace_for(&self, operation_id: &str) -> R<Vec<TraceRow>> {
        let mut st = self
            .conn
            .prepare_cached(sql_text!("SELECT {TRACE_COLS} FROM trace_events WHERE operation_id = ?1 ORDER BY seq"))?;
        let rows = st.query_map([operation_id], TraceRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Trace events with seq > `after`, in order.
    pub fn trace_since(&self, after_seq: i64, since_at: i64, limit: i64) -> R<Vec<TraceRow>> {
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT {TRACE_COLS} FROM trace_events WHERE seq > ?1 AND at >= ?2 ORDER BY seq LIMIT ?3"
        ))?;
        let rows = st.query_map(params![after_seq, since_at, limit], TraceRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }
}
