//! Read queries for the console's panes: keyset-paged, index-backed, only the
//! rows that are visible.

use super::sql::params;

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

/// A sort key's value, as a keyset cursor carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    /// An integer column (times, counts, sequence numbers).
    Int(i64),
    /// A text column (ids, names, states).
    Text(String),
}

impl rusqlite::ToSql for Key {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Key::Int(v) => v.to_sql(),
            Key::Text(v) => v.to_sql(),
        }
    }
}

impl postgres::types::ToSql for Key {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Key::Int(v) => v.to_sql(ty, out),
            Key::Text(v) => v.to_sql(ty, out),
        }
    }

    fn accepts(ty: &postgres::types::Type) -> bool {
        <i64 as postgres::types::ToSql>::accepts(ty) || <String as postgres::types::ToSql>::accepts(ty)
    }

    postgres::types::to_sql_checked!();
}

/// Where the next page starts: the sort key of the last row shown, and its
/// unique tie-breaker (id, or the operator log's sequence number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    /// The last row's sort key.
    pub key: Key,
    /// The last row's tie-breaker.
    pub tie: Key,
}

/// A column a page can be ordered by. The SQL is fixed here (a pane names a
/// column, never sends SQL); `key` reads the same value from a fetched row, for
/// the cursor of the next page.
pub struct SortColumn<R> {
    /// The name the console shows and `:sort` takes.
    pub name: &'static str,
    /// Portable SQL for the value (`coalesce` for nullable columns).
    expr: &'static str,
    /// The value as [`Key::Int`] (else [`Key::Text`]).
    int: bool,
    /// The same value, read from a row.
    pub key: fn(&R) -> Key,
}

/// How a page is ordered: an index into the table's sort columns, and the direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Order {
    /// Index into [`OPS_SORT`], [`LIVE_SORT`], [`APPROVALS_SORT`] or [`AUDIT_SORT`].
    pub column: usize,
    /// Descending.
    pub desc: bool,
}

fn int(v: i64) -> Key {
    Key::Int(v)
}

fn text(v: &str) -> Key {
    Key::Text(v.to_string())
}

/// Sort columns of the ledger and the unknown queue. The first three are index-backed
/// (`operations_updated`, the primary key); the others sort the rows the filter leaves.
pub const OPS_SORT: &[SortColumn<OperationRow>] = &[
    SortColumn { name: "updated", expr: "updated_at", int: true, key: |r| int(r.updated_at) },
    SortColumn { name: "operation", expr: "id", int: false, key: |r| text(&r.id) },
    SortColumn {
        name: "since",
        expr: "coalesce(state_since, updated_at)",
        int: true,
        key: |r| int(r.state_since.unwrap_or(r.updated_at)),
    },
    SortColumn { name: "created", expr: "created_at", int: true, key: |r| int(r.created_at) },
    SortColumn { name: "tool", expr: "tool", int: false, key: |r| text(&r.tool) },
    SortColumn { name: "scope", expr: "tenant", int: false, key: |r| text(&r.tenant) },
    SortColumn { name: "state", expr: "state", int: false, key: |r| text(r.state.as_str()) },
    SortColumn { name: "code", expr: "coalesce(code, '')", int: false, key: |r| text(r.code.as_deref().unwrap_or("")) },
];

/// Sort columns of the live pane (in-flight and waiting outbox rows).
pub const LIVE_SORT: &[SortColumn<LiveRow>] = &[
    SortColumn { name: "next", expr: "o.available_at", int: true, key: |r| int(r.available_at) },
    SortColumn { name: "operation", expr: "o.operation_id", int: false, key: |r| text(&r.operation_id) },
    SortColumn { name: "tool", expr: "p.tool", int: false, key: |r| text(&r.tool) },
    SortColumn { name: "state", expr: "p.state", int: false, key: |r| text(r.state.as_str()) },
    SortColumn { name: "attempt", expr: "o.attempt", int: true, key: |r| int(r.attempt) },
    SortColumn {
        name: "lease",
        expr: "coalesce(o.lease_until, 0)",
        int: true,
        key: |r| int(r.lease_until.unwrap_or(0)),
    },
    SortColumn {
        name: "worker",
        expr: "coalesce(o.lease_owner, '')",
        int: false,
        key: |r| text(r.lease_owner.as_deref().unwrap_or("")),
    },
    SortColumn { name: "deadline", expr: "p.deadline_at", int: true, key: |r| int(r.deadline_at) },
];

/// Sort columns of the pending approvals.
pub const APPROVALS_SORT: &[SortColumn<ApprovalRow>] = &[
    SortColumn { name: "expires", expr: "expires_at", int: true, key: |r| int(r.expires_at) },
    SortColumn { name: "approval", expr: "id", int: false, key: |r| text(&r.id) },
    SortColumn { name: "tool", expr: "tool", int: false, key: |r| text(&r.tool) },
    SortColumn { name: "tenant", expr: "tenant", int: false, key: |r| text(&r.tenant) },
    SortColumn { name: "requester", expr: "subject", int: false, key: |r| text(&r.subject) },
    SortColumn {
        name: "amount",
        expr: "coalesce(amount_minor, 0)",
        int: true,
        key: |r| int(r.amount_minor.unwrap_or(0)),
    },
    SortColumn { name: "created", expr: "created_at", int: true, key: |r| int(r.created_at) },
];

/// Sort columns of the operator log (the sequence is the tie-breaker).
pub const AUDIT_SORT: &[SortColumn<super::AuditRow>] = &[
    SortColumn { name: "seq", expr: "l.seq", int: true, key: |r| int(r.seq) },
    SortColumn { name: "time", expr: "l.at", int: true, key: |r| int(r.at) },
    SortColumn { name: "actor", expr: "l.actor", int: false, key: |r| text(&r.actor) },
    SortColumn { name: "action", expr: "l.action", int: false, key: |r| text(&r.action) },
    SortColumn { name: "result", expr: "l.result", int: false, key: |r| text(&r.result) },
    SortColumn {
        name: "target",
        expr: "coalesce(l.operation_id, l.approval_id, '')",
        int: false,
        key: |r| text(r.operation_id.as_deref().or(r.approval_id.as_deref()).unwrap_or("")),
    },
];

/// The keyset condition and ORDER BY for `order` over `cols`, with `tie` the
/// unique tie-breaker column. Parameters: ?1 the cursor's key, ?2 its tie,
/// ?3 1 when there is a cursor (0: the first page). Also the placeholder
/// values to bind when there is no cursor (typed like the columns, for backends
/// that type parameters).
fn keyset<R>(cols: &[SortColumn<R>], order: Order, tie: &str, tie_int: bool) -> (String, String, Key, Key) {
    let c = cols.get(order.column).unwrap_or(&cols[0]);
    let (op, dir) = if order.desc { ("<", "DESC") } else { (">", "ASC") };
    let e = c.expr;
    let cond = format!("(CAST(?3 AS BIGINT) = 0 OR {e} {op} ?1 OR ({e} = ?1 AND {tie} {op} ?2))");
    let by = format!("{e} {dir}, {tie} {dir}");
    let blank = |int: bool| if int { Key::Int(0) } else { Key::Text(String::new()) };
    (cond, by, blank(c.int), blank(tie_int))
}

/// The cursor after `row`, for `order` over `cols`.
pub fn cursor_after<R>(cols: &[SortColumn<R>], order: Order, row: &R, tie: Key) -> Cursor {
    let c = cols.get(order.column).unwrap_or(&cols[0]);
    Cursor { key: (c.key)(row), tie }
}

fn bind(cursor: Option<&Cursor>, blank_key: Key, blank_tie: Key) -> (Key, Key, i64) {
    match cursor {
        Some(c) => (c.key.clone(), c.tie.clone(), 1),
        None => (blank_key, blank_tie, 0),
    }
}

impl Tx<'_> {
    /// One page of operations in `order`, after `cursor`, matching `filter`
    /// (an exact tenant, subject, state or tool, or an id prefix; empty = all).
    pub fn ops_page(
        &self,
        view: OpsView,
        filter: &str,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<OperationRow>> {
        let (cond, by, bk, bt) = keyset(OPS_SORT, order, "id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        let states = match view {
            OpsView::All => "",
            OpsView::Unknown => "AND state IN ('unknown', 'needs_review')",
        };
        let sql = format!(
            "SELECT {OP_COLS} FROM operations
             WHERE {cond} {states}
               AND (?4 = '' OR tenant = ?4 OR subject = ?4 OR state = ?4 OR tool = ?4 OR id LIKE ?4 || '%')
             ORDER BY {by} LIMIT ?5"
        );
        let mut st = self.conn.prepare_cached(&sql)?;
        let rows = st.query_map(params![key, tie, has, filter, limit], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// In-flight and waiting outbox rows in `order` (the console's default: soonest first).
    pub fn live_page(&self, filter: &str, order: Order, cursor: Option<&Cursor>, limit: i64) -> R<Vec<LiveRow>> {
        let (cond, by, bk, bt) = keyset(LIVE_SORT, order, "o.operation_id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT o.operation_id, p.tool, p.tenant, p.subject, p.state, o.state, o.attempt, o.max_attempts,
                    o.lease_owner, o.lease_until, o.available_at, o.last_code, p.deadline_at
             FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state IN ('leased', 'pending') AND {cond}
               AND (?4 = '' OR p.tenant = ?4 OR p.subject = ?4 OR p.state = ?4 OR p.tool = ?4 OR p.id LIKE ?4 || '%')
             ORDER BY {by} LIMIT ?5"
        ))?;
        let rows = st.query_map(params![key, tie, has, filter, limit], |r| {
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
        rows.collect::<Result<_, _>>()
    }

    /// Pending approvals matching `filter`, in `order`, after `cursor`.
    pub fn approvals_page(
        &self,
        filter: &str,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<ApprovalRow>> {
        let (cond, by, bk, bt) = keyset(APPROVALS_SORT, order, "id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {APPROVAL_COLS} FROM approvals
             WHERE state = 'pending' AND {cond}
               AND (?4 = '' OR tenant = ?4 OR subject = ?4 OR tool = ?4 OR id LIKE ?4 || '%')
             ORDER BY {by} LIMIT ?5"
        ))?;
        let rows = st.query_map(params![key, tie, has, filter, limit], ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operator-log rows in `order`, after `cursor`; with a filter,
    /// the rows whose actor, action or result is it, whose target id starts
    /// with it, or whose operation or approval has it as tenant, subject or tool.
    pub fn audit_page(
        &self,
        filter: &str,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<super::AuditRow>> {
        let (cond, by, bk, bt) = keyset(AUDIT_SORT, order, "l.seq", true);
        let (key, tie, has) = bind(cursor, bk, bt);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {} FROM audit_log l WHERE {cond}
               AND (?4 = '' OR l.actor = ?4 OR l.action = ?4 OR l.result = ?4
                    OR l.operation_id LIKE ?4 || '%' OR l.approval_id LIKE ?4 || '%'
                    OR EXISTS (SELECT 1 FROM operations o WHERE o.id = l.operation_id
                                 AND (o.tenant = ?4 OR o.subject = ?4 OR o.tool = ?4))
                    OR EXISTS (SELECT 1 FROM approvals a WHERE a.id = l.approval_id
                                 AND (a.tenant = ?4 OR a.subject = ?4 OR a.tool = ?4)))
             ORDER BY {by} LIMIT ?5",
            super::rows::AUDIT_COLS
        ))?;
        let rows = st.query_map(params![key, tie, has, filter, limit], super::AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
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
        let rows = st.query_map(params![prefix, pattern, limit], |r| r.get::<String>(0))?;
        let ids: Vec<String> = rows.collect::<Result<_, _>>()?;
        Ok(ids.into_iter().filter(|id| id.starts_with(prefix)).collect())
    }

    /// Ids of the operations holding idempotency key `key` in `tenant` (any
    /// subject and tool), in id order (`:key` in the console; index `operations_key`).
    pub fn operation_ids_with_key(&self, key: &str, tenant: &str, limit: i64) -> R<Vec<String>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT id FROM operations WHERE idem_key = ?1 AND tenant = ?2 ORDER BY id LIMIT ?3")?;
        let rows = st.query_map(params![key, tenant, limit], |r| r.get::<String>(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Count of pending approvals.
    /// (Pending and not yet expired: expiry is exclusive.)
    pub fn count_pending_approvals(&self, now: i64) -> R<i64> {
        self.conn
            .prepare_cached("SELECT count(*) FROM approvals WHERE state = 'pending' AND expires_at > ?1")?
            .query_row([now], |r| r.get(0))
    }

    /// Every tenant's approver allowlist, as (tenant, approver), sorted.
    pub fn approver_lists(&self) -> R<Vec<(String, String)>> {
        let mut st = self.conn.prepare_cached("SELECT tenant, approver FROM approvers ORDER BY tenant, approver")?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<_, _>>()
    }

    /// The age anchor of the oldest unknown / needs-review operation.
    pub fn oldest_unknown_at(&self) -> R<Option<i64>> {
        Ok(self
            .conn
            .prepare_cached("SELECT min(updated_at) FROM operations WHERE state IN ('unknown', 'needs_review')")?
            .query_opt((), |r| r.get(0))?
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
