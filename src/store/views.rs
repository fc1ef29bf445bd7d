//! Read queries for the console's panes: keyset-paged, index-backed, only the
//! rows that are visible.

use rusqlite::{params, OptionalExtension};

use super::rows::{ApprovalRow, OperationRow, APPROVAL_COLS, OP_COLS};
use super::{StoreError, Tx};

type R<T> = Result<T, StoreError>;

/// A row of the live-operations pane: an outbox row with its operation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LiveRow {
    /// Operation.
    pub operation_id: String,
    /// Tool.
    pub tool: String,
    /// Tenant.
    pub tenant: String,
    /// Subject.
    pub subject: String,
    /// Ledger state.
    pub state: String,
    /// Outbox state (`pending` or `leased`).
    pub outbox_state: String,
    /// Attempts so far.
    pub attempt: i64,
    /// Attempt cap.
    pub max_attempts: i64,
    /// Lease holder.
    pub lease_owner: Option<String>,
    /// Lease end.
    pub lease_until: Option<i64>,
    /// Next retry not before.
    pub available_at: i64,
    /// Last code.
    pub last_code: Option<String>,
    /// Operation deadline.
    pub deadline_at: i64,
}

/// Which operations a page shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpsView {
    /// Every operation (the ledger).
    All,
    /// `unknown` and `needs_review`.
    Unknown,
}

/// The sort key of the last row of a page (for the next page).
pub type Cursor = (i64, String);

impl Tx<'_> {
    /// One page of operations, newest first, after `cursor`, matching `filter`
    /// (an exact tenant, subject, state or tool, or an id prefix; empty = all).
    pub fn ops_page(&self, view: OpsView, filter: &str, cursor: Option<&Cursor>, limit: i64) -> R<Vec<OperationRow>> {
        let (at, id) = cursor.map_or((i64::MAX, String::new()), |(a, i)| (*a, i.clone()));
        let states = match view {
            OpsView::All => "",
            OpsView::Unknown => "AND state IN ('unknown', 'needs_review')",
        };
        let sql = format!(
            "SELECT {OP_COLS} FROM operations
             WHERE (updated_at < ?1 OR (updated_at = ?1 AND id < ?2) OR ?2 = '') {states}
               AND (?3 = '' OR tenant = ?3 OR subject = ?3 OR state = ?3 OR tool = ?3 OR id LIKE ?3 || '%')
             ORDER BY updated_at DESC, id DESC LIMIT ?4"
        );
        let mut st = self.conn.prepare_cached(&sql)?;
        let rows = st.query_map(params![at, id, filter, limit], OperationRow::from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// In-flight and waiting outbox rows, soonest first.
    pub fn live_page(&self, filter: &str, offset_key: Option<&Cursor>, limit: i64) -> R<Vec<LiveRow>> {
        let (at, id) = offset_key.map_or((i64::MIN, String::new()), |(a, i)| (*a, i.clone()));
        let mut st = self.conn.prepare_cached(
            "SELECT o.operation_id, p.tool, p.tenant, p.subject, p.state, o.state, o.attempt, o.max_attempts,
                    o.lease_owner, o.lease_until, o.available_at, o.last_code, p.deadline_at
             FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state IN ('leased', 'pending')
               AND (o.available_at > ?1 OR (o.available_at = ?1 AND o.operation_id > ?2))
               AND (?3 = '' OR p.tenant = ?3 OR p.subject = ?3 OR p.state = ?3 OR p.tool = ?3 OR p.id LIKE ?3 || '%')
             ORDER BY o.available_at, o.operation_id LIMIT ?4",
        )?;
        let rows = st.query_map(params![at, id, filter, limit], |r| {
            Ok(LiveRow {
                operation_id: r.get(0)?,
                tool: r.get(1)?,
                tenant: r.get(2)?,
                subject: r.get(3)?,
                state: r.get(4)?,
                outbox_state: r.get(5)?,
                attempt: r.get(6)?,
                max_attempts: r.get(7)?,
                lease_owner: r.get(8)?,
                lease_until: r.get(9)?,
                available_at: r.get(10)?,
                last_code: r.get(11)?,
                deadline_at: r.get(12)?,
            })
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Pending approvals matching `filter`, soonest expiry first, after `cursor`.
    pub fn approvals_page(&self, filter: &str, cursor: Option<&Cursor>, limit: i64) -> R<Vec<ApprovalRow>> {
        let (at, id) = cursor.map_or((i64::MIN, String::new()), |(a, i)| (*a, i.clone()));
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {APPROVAL_COLS} FROM approvals
             WHERE state = 'pending' AND (expires_at > ?1 OR (expires_at = ?1 AND id > ?2))
               AND (?3 = '' OR tenant = ?3 OR subject = ?3 OR tool = ?3 OR id LIKE ?3 || '%')
             ORDER BY expires_at, id LIMIT ?4"
        ))?;
        let rows = st.query_map(params![at, id, filter, limit], ApprovalRow::from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Operator-log rows, newest first, before `before_seq`; with a filter,
    /// the rows whose actor, action or result is it, whose target id starts
    /// with it, or whose operation or approval has it as tenant, subject or tool.
    pub fn audit_page(&self, filter: &str, before_seq: Option<i64>, limit: i64) -> R<Vec<super::AuditRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {} FROM audit_log l WHERE seq < ?1
               AND (?3 = '' OR l.actor = ?3 OR l.action = ?3 OR l.result = ?3
                    OR l.operation_id LIKE ?3 || '%' OR l.approval_id LIKE ?3 || '%'
                    OR EXISTS (SELECT 1 FROM operations o WHERE o.id = l.operation_id
                                 AND (o.tenant = ?3 OR o.subject = ?3 OR o.tool = ?3))
                    OR EXISTS (SELECT 1 FROM approvals a WHERE a.id = l.approval_id
                                 AND (a.tenant = ?3 OR a.subject = ?3 OR a.tool = ?3)))
             ORDER BY seq DESC LIMIT ?2",
            super::rows::AUDIT_COLS
        ))?;
        let rows = st.query_map(params![before_seq.unwrap_or(i64::MAX), limit, filter], super::AuditRow::from_row)?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Ids of operations whose id starts with `prefix`, in id order (`:op` in
    /// the console). `LIKE` with an escape character so `_` and `%` in the
    /// prefix match only themselves; the prefix is compared again exactly (a
    /// backend's `LIKE` may ignore case), so rows that differ are dropped.
    pub fn operation_ids_with_prefix(&self, prefix: &str, limit: i64) -> R<Vec<String>> {
        let mut pattern = String::with_capacity(prefix.len() + 1);
        for c in prefix.chars() {
            if matches!(c, '\\' | '%' | '_') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        pattern.push('%');
        let mut st = self.conn.prepare_cached(
            "SELECT id FROM operations WHERE id >= ?1 AND id LIKE ?2 ESCAPE '\\' ORDER BY id LIMIT ?3",
        )?;
        let rows = st.query_map(params![prefix, pattern, limit], |r| r.get::<_, String>(0))?;
        let ids: Vec<String> = rows.collect::<Result<_, _>>()?;
        Ok(ids.into_iter().filter(|id| id.starts_with(prefix)).collect())
    }

    /// Ids of the operations holding idempotency key `key` in `tenant` (any
    /// subject and tool), in id order (`:key` in the console; index `operations_key`).
    pub fn operation_ids_with_key(&self, key: &str, tenant: &str, limit: i64) -> R<Vec<String>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT id FROM operations WHERE idem_key = ?1 AND tenant = ?2 ORDER BY id LIMIT ?3")?;
        let rows = st.query_map(params![key, tenant, limit], |r| r.get::<_, String>(0))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// Count of pending approvals.
    /// (Pending and not yet expired: expiry is exclusive.)
    pub fn count_pending_approvals(&self, now: i64) -> R<i64> {
        Ok(self
            .conn
            .prepare_cached("SELECT count(*) FROM approvals WHERE state = 'pending' AND expires_at > ?1")?
            .query_row([now], |r| r.get(0))?)
    }

    /// Every tenant's approver allowlist, as (tenant, approver), sorted.
    pub fn approver_lists(&self) -> R<Vec<(String, String)>> {
        let mut st = self.conn.prepare_cached("SELECT tenant, approver FROM approvers ORDER BY tenant, approver")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    /// The age anchor of the oldest unknown / needs-review operation.
    pub fn oldest_unknown_at(&self) -> R<Option<i64>> {
        Ok(self
            .conn
            .prepare_cached("SELECT min(updated_at) FROM operations WHERE state IN ('unknown', 'needs_review')")?
            .query_row([], |r| r.get(0))
            .optional()?
            .flatten())
    }

    /// Shifts every stored time by `delta_ms` (the demo's working copy is re-based
    /// to now so countdowns are live).
    pub fn rebase_times(&self, delta_ms: i64) -> R<()> {
        let cols: [(&str, &[&str]); 10] = [
            ("grants", &["granted_at", "revoked_at"]),
            (
                "operations",
                &[
                    "created_at",
                    "updated_at",
                    "deadline_at",
                    "expires_at",
                    "last_query_at",
                    "terminal_at",
                    "state_since",
                ],
            ),
            ("outbox", &["lease_until", "available_at"]),
            ("attempts", &["claimed_at", "sent_at", "finished_at"]),
            ("call_identities", &["created_at"]),
            ("receipts", &["recorded_at"]),
            ("trace_events", &["at"]),
            ("approvals", &["decided_at", "created_at", "expires_at"]),
            ("provider_effects", &["committed_at", "visible_at"]),
            ("purged_operations", &["created_at", "terminal_at", "purged_at"]),
        ];
        for (table, columns) in cols {
            let sets: Vec<String> = columns.iter().map(|c| format!("{c} = {c} + ?1")).collect();
            self.conn.execute(&format!("UPDATE {table} SET {}", sets.join(", ")), [delta_ms])?;
        }
        // Per-minute rollups (migration 0002) move by whole minutes. Their minute is
        // part of the primary key, so shift through a far-away range to keep every
        // intermediate row unique.
        let minutes = (delta_ms as f64 / 60_000.0).round() as i64;
        if minutes != 0 {
            const FAR: i64 = 1_000_000_000;
            for table in ["metric_minutes", "latency_minutes"] {
                self.conn.execute(&format!("UPDATE {table} SET minute = minute + ?1"), [FAR])?;
                self.conn.execute(&format!("UPDATE {table} SET minute = minute - ?1"), [FAR - minutes])?;
            }
        }
        // The audit log is append-only even here: its times stay as recorded.
        Ok(())
    }
}
