//! Typed queries: The append-only operator log (hash-chained) and the integrity checks `toolgate audit` runs.

use super::sql::sql_text;
use super::{params, ApprovalRow, AuditRow, Backend, TraceDamage, Tx, APPROVAL_COLS, AUDIT_COLS, AUDIT_GENESIS, R};

/// A trace event dated before its operation: (seq, operation id, at, the
/// operation's creation).
pub type EarlyEvent = (i64, String, i64, i64);

impl Tx<'_> {
    // ------------------------------------------------------------ audit log

    /// Appends to the operator log (there is no update or delete).
    pub fn insert_audit(&self, a: &AuditRow) -> R<()> {
        // Link to the newest row (migration 0007): the chain `audit` verifies.
        let last = self
            .conn
            .prepare_cached(sql_text!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq DESC LIMIT 1"))?
            .query_opt((), AuditRow::from_row)?;
        let link = last.as_ref().map_or_else(|| AUDIT_GENESIS.to_string(), AuditRow::chain_hash);
        let seq: i64 = self
            .conn
            .prepare_cached(
                "INSERT INTO audit_log (at, action_id, actor, action, operation_id, approval_id, result, reason, evidence, chain_sha256)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) RETURNING seq",
            )?
            .query_row(
                params![a.at, a.action_id, a.actor, a.action, a.operation_id, a.approval_id, a.result, a.reason, a.evidence, link],
                |r| r.get(0),
            )?;
        let mut stored = a.clone();
        stored.seq = seq;
        stored.chain_sha256 = Some(link);
        let head = stored.chain_hash();
        // The head is anchored on the rows the entry touches (migration 0017),
        // where deleting the log and meta `audit_head` cannot reach it.
        if let Some(op) = &a.operation_id {
            self.conn
                .prepare_cached("UPDATE operations SET audit_anchor = ?1 WHERE id = ?2")?
                .execute(params![head, op])?;
        }
        if let Some(approval) = &a.approval_id {
            self.conn
                .prepare_cached("UPDATE approvals SET audit_anchor = ?1 WHERE id = ?2")?
                .execute(params![head, approval])?;
        }
        self.meta_set("audit_head", &head)
    }

    /// Every anchored row: (`"operation"` or `"approval"`, its id, the head
    /// its newest operator-log entry made), for the audit.
    pub fn audit_anchors(&self) -> R<Vec<(&'static str, String, String)>> {
        let mut out = Vec::new();
        for (kind, sql) in [
            ("operation", "SELECT id, audit_anchor FROM operations WHERE audit_anchor IS NOT NULL ORDER BY id"),
            ("approval", "SELECT id, audit_anchor FROM approvals WHERE audit_anchor IS NOT NULL ORDER BY id"),
        ] {
            let mut st = self.conn.prepare_cached(sql)?;
            let rows = st.query_map((), |r| Ok((kind, r.get::<String>(0)?, r.get::<String>(1)?)))?;
            out.extend(rows.collect::<Result<Vec<_>, _>>()?);
        }
        Ok(out)
    }

    /// Every operator-log row, oldest first (for the chain check).
    pub fn audit_log_ascending(&self) -> R<Vec<AuditRow>> {
        let mut st = self.conn.prepare_cached(sql_text!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq"))?;
        let rows = st.query_map((), AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The operator log, newest first.
    pub fn audit_log(&self, limit: i64) -> R<Vec<AuditRow>> {
        let mut st =
            self.conn.prepare_cached(sql_text!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq DESC LIMIT ?1"))?;
        let rows = st.query_map([limit], AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The applied operator-log row carrying an action id, if any.
    pub fn audit_by_action_id(&self, action_id: &str) -> R<Option<AuditRow>> {
        self.conn
            .prepare_cached(sql_text!("SELECT {AUDIT_COLS} FROM audit_log WHERE action_id = ?1"))?
            .query_opt([action_id], AuditRow::from_row)
    }

    /// The operator log rows about one operation.
    pub fn audit_for(&self, operation_id: &str) -> R<Vec<AuditRow>> {
        let mut st = self
            .conn
            .prepare_cached(sql_text!("SELECT {AUDIT_COLS} FROM audit_log WHERE operation_id = ?1 ORDER BY seq"))?;
        let rows = st.query_map([operation_id], AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    // ------------------------------------------------------------ integrity

    /// SQLite's own integrity and foreign-key checks; returns problems found.
    /// On PostgreSQL the server enforces every constraint as rows are written
    /// (there is no per-file integrity check to run): nothing to report.
    pub fn sqlite_checks(&self) -> R<Vec<String>> {
        let mut out = Vec::new();
        if self.backend() == Backend::Postgres {
            return Ok(out);
        }
        let mut st = self.conn.prepare("PRAGMA integrity_check")?;
        for r in st.query_map((), |r| r.get::<String>(0))? {
            let r = r?;
            if r != "ok" {
                out.push(format!("integrity_check: {r}"));
            }
        }
        let mut st = self.conn.prepare("PRAGMA foreign_key_check")?;
        for r in st.query_map((), |r| r.get::<String>(0))? {
            out.push(format!("foreign key violation in table {}", r?));
        }
        Ok(out)
    }

    /// Rows whose state (or outcome) is none of the values their table allows,
    /// as (table, row id, value): only a hand edit that bypassed the CHECK
    /// constraints leaves one.
    pub fn invalid_states(&self) -> R<Vec<(String, String, String)>> {
        let mut st = self.conn.prepare(
            "SELECT 'operations', id, state FROM operations
               WHERE state NOT IN ('accepted', 'in_flight', 'succeeded', 'failed', 'unknown', 'needs_review', 'resolved')
             UNION ALL SELECT 'outbox', operation_id, state FROM outbox
               WHERE state NOT IN ('pending', 'leased', 'done', 'parked')
             UNION ALL SELECT 'approvals', id, state FROM approvals
               WHERE state NOT IN ('pending', 'approved', 'denied', 'expired', 'invalidated')
             UNION ALL SELECT 'attempts', operation_id || '#' || CAST(attempt AS TEXT), outcome FROM attempts
               WHERE outcome IS NOT NULL AND outcome NOT IN ('not_sent', 'refused', 'committed', 'rejected', 'unknown')
             UNION ALL SELECT 'audit_log', CAST(seq AS TEXT), result FROM audit_log WHERE result NOT IN ('applied', 'refused')",
        )?;
        // The value as an SQL literal (the tables are STRICT / typed: always text).
        let quote = |v: String| format!("'{}'", v.replace('\'', "''"));
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?, quote(r.get(2)?))))?;
        rows.collect::<Result<_, _>>()
    }

    /// States whose kept count (`state_counts`, summed over PostgreSQL's
    /// slots) is not the number of rows in that state, as (state, counted,
    /// held): only a write that bypassed the store (a hand edit) leaves one.
    pub fn state_count_drift(&self) -> R<Vec<(String, i64, i64)>> {
        let mut st = self.conn.prepare(
            "SELECT state, CAST(sum(counted) AS BIGINT), CAST(sum(held) AS BIGINT) FROM (
                 SELECT state, n AS counted, 0 AS held FROM state_counts
                 UNION ALL SELECT state, 0, count(*) FROM operations GROUP BY state) AS c
             GROUP BY state HAVING sum(counted) <> sum(held) ORDER BY state",
        )?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        rows.collect::<Result<_, _>>()
    }

    /// Operations whose downstream key has a shape older than the row: a key
    /// other than `dk3_` on a row written after migration 0015, or a random
    /// `dk_` key on a row written after migration 0009. A hand edit.
    pub fn legacy_keys_after_migration(&self) -> R<Vec<String>> {
        let mut st = self.conn.prepare(
            "SELECT id FROM operations
             WHERE (downstream_key NOT LIKE 'dk3!_%' ESCAPE '!'
                    AND rowid > coalesce((SELECT CAST(value AS BIGINT) FROM meta
                                          WHERE key = 'dk2_downstream_keys_until_rowid'), 0))
                OR (downstream_key NOT LIKE 'dk3!_%' ESCAPE '!' AND downstream_key NOT LIKE 'dk2!_%' ESCAPE '!'
                    AND rowid > coalesce((SELECT CAST(value AS BIGINT) FROM meta
                                          WHERE key = 'legacy_downstream_keys_until_rowid'), 0))
             ORDER BY id",
        )?;
        let rows = st.query_map((), |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// How many trace events name an operation.
    pub fn trace_count_for(&self, operation_id: &str) -> R<i64> {
        self.conn
            .prepare_cached("SELECT count(*) FROM trace_events WHERE operation_id = ?1")?
            .query_row([operation_id], |r| r.get(0))
    }

    /// Trace events whose fields are not valid JSON, and the gaps in the trace's
    /// sequence (events are never deleted, so a gap is a deleted event), as
    /// (first missing, last missing).
    ///
    /// SQLite's `seq` is gapless. PostgreSQL's leaves a gap for each rolled-back
    /// insert, so there the gapless number is `slot_seq` within each writer's
    /// slot (migration pg/0004): a number missing there, or past the last one
    /// present while `trace_slots` counted further, is a deleted event, reported
    /// as the range of `seq` it lay in. Events from before that migration have
    /// no slot and keep the gapless `seq`.
    pub fn trace_damage(&self) -> R<TraceDamage> {
        let mut st = self.conn.prepare("SELECT seq FROM trace_events WHERE json_valid(fields) = 0 ORDER BY seq")?;
        let bad = st.query_map((), |r| r.get(0))?.collect::<Result<Vec<i64>, _>>()?;
        let mut st = self.conn.prepare(match self.backend() {
            Backend::Sqlite => {
                "SELECT seq + 1, next - 1 FROM (SELECT seq, lead(seq) OVER (ORDER BY seq) AS next FROM trace_events) AS t
                 WHERE next > seq + 1"
            }
            Backend::Postgres => {
                "SELECT seq + 1, next - 1
                   FROM (SELECT seq, lead(seq) OVER (ORDER BY seq) AS next FROM trace_events WHERE slot IS NULL) AS t
                  WHERE next > seq + 1
                 UNION ALL
                 SELECT coalesce(prev_seq, 0) + 1, seq - 1
                   FROM (SELECT seq, slot_seq, lag(seq) OVER w AS prev_seq, lag(slot_seq) OVER w AS prev_slot_seq
                           FROM trace_events WHERE slot IS NOT NULL WINDOW w AS (PARTITION BY slot ORDER BY slot_seq)) AS t
                  WHERE slot_seq > coalesce(prev_slot_seq, 0) + 1
                 UNION ALL
                 SELECT coalesce(max(e.seq), 0) + 1,
                        coalesce(pg_sequence_last_value(pg_get_serial_sequence('trace_events', 'seq')::regclass),
                                 (SELECT max(seq) FROM trace_events))
                   FROM trace_slots s LEFT JOIN trace_events e ON e.slot = s.slot
                  GROUP BY s.slot, s.last HAVING s.last > coalesce(max(e.slot_seq), 0)
                 ORDER BY 1"
            }
        })?;
        let gaps = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<Vec<_>, _>>()?;
        Ok((bad, gaps))
    }

    /// Trace events dated before their operation was created by more than
    /// `slack` ms (one of the two was written on a wrong clock): (seq,
    /// operation id, at, the operation's creation), at most `limit` of them,
    /// oldest first, and how many there are.
    pub fn trace_times_before_creation(&self, slack: i64, limit: i64) -> R<(Vec<EarlyEvent>, i64)> {
        const EARLY: &str =
            "FROM trace_events t JOIN operations o ON o.id = t.operation_id WHERE t.at < o.created_at - ?1";
        let n: i64 = self.conn.prepare_cached(&format!("SELECT count(*) {EARLY}"))?.query_row([slack], |r| r.get(0))?;
        if n == 0 {
            return Ok((Vec::new(), 0));
        }
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT t.seq, t.operation_id, t.at, o.created_at {EARLY} ORDER BY t.seq LIMIT ?2"
        ))?;
        let rows = st.query_map(params![slack, limit], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
        Ok((rows.collect::<Result<Vec<EarlyEvent>, _>>()?, n))
    }

    /// Every approval request (for the integrity audit).
    pub fn all_approvals(&self) -> R<Vec<ApprovalRow>> {
        let mut st = self.conn.prepare(&format!("SELECT {APPROVAL_COLS} FROM approvals ORDER BY created_at, id"))?;
        let rows = st.query_map((), ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }
}
