//! Read queries for the console's panes: keyset-paged, index-backed, only the
//! rows that are visible.

use super::sql::sql_text;
use super::sql::{params, Backend, Param};

use super::rows::{ApprovalRow, OperationRow, APPROVAL_COLS, OP_COLS};
use super::{OpState, OutboxState, StoreError, Tx};

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
    pub state: OpState,
    /// Outbox state (`pending` or `leased`).
    pub outbox_state: OutboxState,
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

/// Sort columns of the ledger and the unknown queue. Every one is index-backed
/// in both directions (`operations_updated`, the primary key, and migration
/// 0011's `operations_*` and, for the Unknown pane, `unknown_*` indexes, whose
/// expressions are these `expr`s exactly): keep them in step when adding one.
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

/// A page query's parameters: ?1 the cursor's key, ?2 its tie, ?3 whether
/// there is a cursor, ?4 the limit, then the filter's from ?5.
fn page_params<'a>(key: &'a Key, tie: &'a Key, has: &'a i64, limit: &'a i64, filter: &'a [Key]) -> Vec<&'a dyn Param> {
    let mut all: Vec<&dyn Param> = vec![key, tie, has, limit];
    all.extend(filter.iter().map(|k| k as &dyn Param));
    all
}

fn bind(cursor: Option<&Cursor>, blank_key: Key, blank_tie: Key) -> (Key, Key, i64) {
    match cursor {
        Some(c) => (c.key.clone(), c.tie.clone(), 1),
        None => (blank_key, blank_tie, 0),
    }
}

/// Which rows a page shows, beyond its view: the console's filter expression
/// and the CLI's selection flags both become one. Every part that is set must
/// hold; an empty filter matches every row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Bare words (each must match): an exact tenant, subject, state or tool
    /// (in the operator log: actor, action or result too), or the start of an id.
    pub words: Vec<String>,
    /// Exact tenant.
    pub tenant: Option<String>,
    /// Exact subject (requester).
    pub subject: Option<String>,
    /// Exact tool.
    pub tool: Option<String>,
    /// Any of these ledger states (empty: any).
    pub states: Vec<String>,
    /// Ids that start with this, exactly (`_` and `%` are themselves, case counts).
    pub id_prefix: Option<String>,
    /// In its current state (approvals: since asked; operator log: since
    /// recorded) for at least this long, in milliseconds.
    pub older_than_ms: Option<i64>,
    /// In its current state for less than this long, in milliseconds.
    pub newer_than_ms: Option<i64>,
    /// No status query has been made yet.
    pub never_queried: bool,
    /// Operator log: exact actor.
    pub actor: Option<String>,
    /// Operator log: exact action.
    pub action: Option<String>,
}

/// The table a [`Filter`] is applied to (what each can be filtered by differs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FilterTarget {
    /// Operations (the Ledger and Unknown panes).
    Operations,
    /// Outbox rows with their operation (the Live pane).
    Live,
    /// Pending approvals.
    Approvals,
    /// The operator log.
    Audit,
}

impl Filter {
    /// A filter of one bare word (empty: everything), the console's filter before expressions.
    pub fn word(w: &str) -> Self {
        let w = w.trim();
        Self { words: if w.is_empty() { Vec::new() } else { vec![w.to_string()] }, ..Self::default() }
    }

    /// Whether nothing is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The first field that is set but that `target` cannot be filtered by.
    pub fn unsupported(&self, target: FilterTarget) -> Option<&'static str> {
        let set = [
            ("state", !self.states.is_empty(), matches!(target, FilterTarget::Operations | FilterTarget::Live)),
            ("needs:query", self.never_queried, matches!(target, FilterTarget::Operations | FilterTarget::Live)),
            ("actor", self.actor.is_some(), target == FilterTarget::Audit),
            ("action", self.action.is_some(), target == FilterTarget::Audit),
        ];
        set.into_iter().find(|(_, on, ok)| *on && !ok).map(|(name, _, _)| name)
    }
}

/// `substr(col, 1, length(p)) = p`: an exact prefix on both backends (LIKE
/// treats `_` and `%` as wildcards, and SQLite's LIKE ignores ASCII case
/// where PostgreSQL's does not).
fn prefix_of(col: &str, p: &str) -> String {
    format!("substr({col}, 1, length(CAST({p} AS TEXT))) = CAST({p} AS TEXT)")
}

/// The SQL of a [`Filter`] for one target: `AND …` conditions whose parameters
/// are numbered from `first`, and their values in order.
struct Where {
    sql: String,
    params: Vec<Key>,
    first: usize,
}

impl Where {
    fn new(first: usize) -> Self {
        Self { sql: String::new(), params: Vec::new(), first }
    }

    /// A parameter's placeholder.
    fn p(&mut self, k: Key) -> String {
        self.params.push(k);
        format!("?{}", self.first + self.params.len() - 1)
    }

    fn and(&mut self, cond: &str) {
        self.sql.push_str(" AND (");
        self.sql.push_str(cond);
        self.sql.push(')');
    }
}

/// Column names of a filterable table.
struct Cols {
    id: &'static str,
    tenant: &'static str,
    subject: &'static str,
    tool: &'static str,
    state: Option<&'static str>,
    since: &'static str,
    last_query: Option<&'static str>,
}

const OPS_COLS: Cols = Cols {
    id: "id",
    tenant: "tenant",
    subject: "subject",
    tool: "tool",
    state: Some("state"),
    since: "coalesce(state_since, updated_at)",
    last_query: Some("last_query_at"),
};

const LIVE_COLS: Cols = Cols {
    id: "p.id",
    tenant: "p.tenant",
    subject: "p.subject",
    tool: "p.tool",
    state: Some("p.state"),
    since: "coalesce(p.state_since, p.updated_at)",
    last_query: Some("p.last_query_at"),
};

const APPROVAL_FILTER_COLS: Cols = Cols {
    id: "id",
    tenant: "tenant",
    subject: "subject",
    tool: "tool",
    state: None,
    since: "created_at",
    last_query: None,
};

fn text_key(s: &str) -> Key {
    Key::Text(s.to_string())
}

/// The conditions of `f` over a table with columns `c` (not the operator log).
fn filter_where(f: &Filter, c: &Cols, now: i64, first: usize) -> Where {
    let mut w = Where::new(first);
    for word in &f.words {
        let p = w.p(text_key(word));
        let state = c.state.map(|s| format!(" OR {s} = {p}")).unwrap_or_default();
        let cond =
            format!("{} = {p} OR {} = {p} OR {} = {p}{state} OR {}", c.tenant, c.subject, c.tool, prefix_of(c.id, &p));
        w.and(&cond);
    }
    for (col, v) in [(c.tenant, &f.tenant), (c.subject, &f.subject), (c.tool, &f.tool)] {
        if let Some(v) = v {
            let p = w.p(text_key(v));
            w.and(&format!("{col} = {p}"));
        }
    }
    if let (Some(col), false) = (c.state, f.states.is_empty()) {
        let list: Vec<String> = f.states.iter().map(|s| w.p(text_key(s))).collect();
        w.and(&format!("{col} IN ({})", list.join(", ")));
    }
    if let Some(prefix) = &f.id_prefix {
        let p = w.p(text_key(prefix));
        w.and(&prefix_of(c.id, &p));
    }
    since_where(&mut w, f, c.since, now);
    if let (Some(col), true) = (c.last_query, f.never_queried) {
        w.and(&format!("{col} IS NULL"));
    }
    w
}

fn since_where(w: &mut Where, f: &Filter, since: &str, now: i64) {
    if let Some(ms) = f.older_than_ms {
        let p = w.p(Key::Int(now.saturating_sub(ms)));
        w.and(&format!("{since} <= CAST({p} AS BIGINT)"));
    }
    if let Some(ms) = f.newer_than_ms {
        let p = w.p(Key::Int(now.saturating_sub(ms)));
        w.and(&format!("{since} > CAST({p} AS BIGINT)"));
    }
}

/// The conditions of `f` over the operator log (`l`): tenant, subject and tool
/// are those of the operation or approval an entry is about.
fn audit_where(f: &Filter, now: i64, first: usize) -> Where {
    let mut w = Where::new(first);
    let about = |cond: &dyn Fn(&str) -> String| -> String {
        format!(
            "EXISTS (SELECT 1 FROM operations o WHERE o.id = l.operation_id AND ({}))
             OR EXISTS (SELECT 1 FROM approvals a WHERE a.id = l.approval_id AND ({}))",
            cond("o"),
            cond("a")
        )
    };
    for word in &f.words {
        let p = w.p(text_key(word));
        let inner = about(&|t| format!("{t}.tenant = {p} OR {t}.subject = {p} OR {t}.tool = {p}"));
        let cond = format!(
            "l.actor = {p} OR l.action = {p} OR l.result = {p} OR {} OR {} OR {inner}",
            prefix_of("l.operation_id", &p),
            prefix_of("l.approval_id", &p)
        );
        w.and(&cond);
    }
    for (col, v) in [("tenant", &f.tenant), ("subject", &f.subject), ("tool", &f.tool)] {
        if let Some(v) = v {
            let p = w.p(text_key(v));
            let cond = about(&|t| format!("{t}.{col} = {p}"));
            w.and(&cond);
        }
    }
    for (col, v) in [("l.actor", &f.actor), ("l.action", &f.action)] {
        if let Some(v) = v {
            let p = w.p(text_key(v));
            w.and(&format!("{col} = {p}"));
        }
    }
    if let Some(prefix) = &f.id_prefix {
        let p = w.p(text_key(prefix));
        let cond = format!("{} OR {}", prefix_of("l.operation_id", &p), prefix_of("l.approval_id", &p));
        w.and(&cond);
    }
    since_where(&mut w, f, "l.at", now);
    w
}

impl Tx<'_> {
    /// Of `ids`, the operations a person acted on (an approval, or an
    /// operator-log entry other than a caller's own status query): the purge
    /// never takes them, whatever their retention says
    /// ([`Tx::purgeable_operations`] has the same rule).
    pub fn acted_on_by_a_person(&self, ids: &[String]) -> R<Vec<String>> {
        // A fixed number of parameters, so one statement serves every page.
        const CHUNK: usize = 16;
        let marks: Vec<String> = (1..=CHUNK).map(|i| format!("?{i}")).collect();
        let sql = format!(
            "SELECT o.id FROM operations o
             WHERE o.id IN ({})
               AND (o.approval_id IS NOT NULL
                    OR EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND {}))",
            marks.join(", "),
            self.by_a_person()
        );
        let mut out = Vec::new();
        for chunk in ids.chunks(CHUNK) {
            // Padding: an empty id matches no operation.
            let list: [String; CHUNK] = std::array::from_fn(|i| chunk.get(i).cloned().unwrap_or_default());
            let mut st = self.conn.prepare_cached(&sql)?;
            for id in st.query_map(list, |r| r.get(0))? {
                out.push(id?);
            }
        }
        Ok(out)
    }

    /// One page of operations in `order`, after `cursor`, matching `filter`
    /// (ages measured at `now`).
    pub fn ops_page(
        &self,
        view: OpsView,
        filter: &Filter,
        now: i64,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<OperationRow>> {
        let (cond, by, bk, bt) = keyset(OPS_SORT, order, "id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        // The Unknown pane reads the partial index of its sort column
        // (`unknown_` + the column's name, migration 0011), whose WHERE is this
        // condition word for word. Without statistics SQLite guesses that
        // `state IN (…)` picks out a few rows, seeks them on `operations_state`
        // and sorts them all (every unknown operation, each frame); `INDEXED BY`
        // names the index, and fails loudly rather than slowly if it is gone.
        // PostgreSQL has statistics and no `INDEXED BY`.
        let (indexed, states) = match view {
            OpsView::All => (String::new(), ""),
            OpsView::Unknown => {
                let name = OPS_SORT.get(order.column).unwrap_or(&OPS_SORT[0]).name;
                let indexed = match self.backend() {
                    Backend::Sqlite => format!(" INDEXED BY unknown_{name}"),
                    Backend::Postgres => String::new(),
                };
                (indexed, "AND state IN ('unknown', 'needs_review')")
            }
        };
        let w = filter_where(filter, &OPS_COLS, now, 5);
        let sql = format!(
            "SELECT {OP_COLS} FROM operations{indexed}
             WHERE {cond} {states}{}
             ORDER BY {by} LIMIT ?4",
            w.sql
        );
        let mut st = self.conn.prepare_cached(&sql)?;
        let all = page_params(&key, &tie, &has, &limit, &w.params);
        let rows = st.query_map(all.as_slice(), OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// In-flight and waiting outbox rows in `order` (the console's default: soonest first).
    pub fn live_page(
        &self,
        filter: &Filter,
        now: i64,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<LiveRow>> {
        let (cond, by, bk, bt) = keyset(LIVE_SORT, order, "o.operation_id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        let w = filter_where(filter, &LIVE_COLS, now, 5);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT o.operation_id, p.tool, p.tenant, p.subject, p.state, o.state, o.attempt, o.max_attempts,
                    o.lease_owner, o.lease_until, o.available_at, o.last_code, p.deadline_at
             FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state IN ('leased', 'pending') AND {cond}{}
             ORDER BY {by} LIMIT ?4",
            w.sql
        ))?;
        let all = page_params(&key, &tie, &has, &limit, &w.params);
        let rows = st.query_map(all.as_slice(), |r| {
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
        filter: &Filter,
        now: i64,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<ApprovalRow>> {
        let (cond, by, bk, bt) = keyset(APPROVALS_SORT, order, "id", false);
        let (key, tie, has) = bind(cursor, bk, bt);
        let w = filter_where(filter, &APPROVAL_FILTER_COLS, now, 5);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {APPROVAL_COLS} FROM approvals
             WHERE state = 'pending' AND {cond}{}
             ORDER BY {by} LIMIT ?4",
            w.sql
        ))?;
        let all = page_params(&key, &tie, &has, &limit, &w.params);
        let rows = st.query_map(all.as_slice(), ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operator-log rows in `order`, after `cursor`; with a filter,
    /// the rows whose actor, action or result is it, whose target id starts
    /// with it, or whose operation or approval has it as tenant, subject or tool.
    pub fn audit_page(
        &self,
        filter: &Filter,
        now: i64,
        order: Order,
        cursor: Option<&Cursor>,
        limit: i64,
    ) -> R<Vec<super::AuditRow>> {
        let (cond, by, bk, bt) = keyset(AUDIT_SORT, order, "l.seq", true);
        let (key, tie, has) = bind(cursor, bk, bt);
        let w = audit_where(filter, now, 5);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {} FROM audit_log l WHERE {cond}{}
             ORDER BY {by} LIMIT ?4",
            super::rows::AUDIT_COLS,
            w.sql
        ))?;
        let all = page_params(&key, &tie, &has, &limit, &w.params);
        let rows = st.query_map(all.as_slice(), super::AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Ids of operations whose id starts with `prefix`, in id order (`:op` in
    /// the console): an exact prefix on both backends (no LIKE: `_` and `%`
    /// are themselves and case counts), from the first id at or after it.
    pub fn operation_ids_with_prefix(&self, prefix: &str, limit: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT id FROM operations WHERE id >= ?1 AND {} ORDER BY id LIMIT ?2",
            prefix_of("id", "?1")
        ))?;
        let rows = st.query_map(params![prefix, limit], |r| r.get::<String>(0))?;
        rows.collect::<Result<_, _>>()
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

    /// The age anchor of the oldest unknown / needs-review operation: the time
    /// it entered that state, as the Unknown pane's "since" column reads it
    /// (a status query that changes nothing does not make it younger).
    /// One entry of the `unknown_since` partial index (migration 0011), named on
    /// SQLite for the reason [`Tx::ops_page`] gives: else every unknown operation is
    /// read, each frame.
    pub fn oldest_unknown_at(&self) -> R<Option<i64>> {
        let sql = match self.backend() {
            Backend::Sqlite => {
                "SELECT min(coalesce(state_since, updated_at)) FROM operations INDEXED BY unknown_since
                 WHERE state IN ('unknown', 'needs_review')"
            }
            Backend::Postgres => {
                "SELECT min(coalesce(state_since, updated_at)) FROM operations WHERE state IN ('unknown', 'needs_review')"
            }
        };
        Ok(self.conn.prepare_cached(sql)?.query_opt((), |r| r.get(0))?.flatten())
    }

    /// Shifts every stored time by `delta_ms` (the demo's working copy is re-based
    /// to now so countdowns are live).
    pub fn rebase_times(&self, delta_ms: i64) -> R<()> {
        // The tail's minutes come from the events' times: fold it first, so
        // that every counted event moves with the rollups by whole minutes.
        self.fold_rollups()?;
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
        self.rebase_operator_log(delta_ms)
    }

    /// The operator log moved with everything else (a working copy only,
    /// from [`Tx::rebase_times`]): each entry's time shifts, its chain is
    /// re-linked over the new times, every anchor follows its entry and the
    /// head is the new newest. The append-only trigger is lifted for this one
    /// transaction and put back as its migration wrote it.
    fn rebase_operator_log(&self, delta_ms: i64) -> R<()> {
        let rows = self.audit_log_ascending()?;
        if rows.is_empty() || delta_ms == 0 {
            return Ok(());
        }
        let (lift, restore) = match self.backend() {
            Backend::Sqlite => (
                "DROP TRIGGER audit_log_no_update",
                "CREATE TRIGGER audit_log_no_update BEFORE UPDATE ON audit_log
                 BEGIN SELECT RAISE(ABORT, 'audit_log is append-only'); END",
            ),
            Backend::Postgres => (
                "ALTER TABLE audit_log DISABLE TRIGGER audit_log_no_update",
                "ALTER TABLE audit_log ENABLE TRIGGER audit_log_no_update",
            ),
        };
        self.conn.execute_batch(lift)?;
        let mut prev: Option<String> = None;
        let mut moved = Vec::with_capacity(rows.len());
        for mut r in rows {
            let old = r.chain_hash();
            r.at += delta_ms;
            if r.chain_sha256.is_some() {
                r.chain_sha256 = Some(prev.clone().unwrap_or_else(|| super::AUDIT_GENESIS.to_string()));
            }
            self.conn
                .prepare_cached("UPDATE audit_log SET at = ?1, chain_sha256 = ?2 WHERE seq = ?3")?
                .execute(params![r.at, r.chain_sha256, r.seq])?;
            let new = r.chain_hash();
            moved.push((old, new.clone()));
            prev = Some(new);
        }
        for (old, new) in &moved {
            for sql in [
                "UPDATE operations SET audit_anchor = ?1 WHERE audit_anchor = ?2",
                "UPDATE approvals SET audit_anchor = ?1 WHERE audit_anchor = ?2",
            ] {
                self.conn.prepare_cached(sql)?.execute(params![new, old])?;
            }
        }
        if self.meta("audit_head")?.is_some() {
            if let Some(head) = &prev {
                self.meta_set("audit_head", head)?;
            }
        }
        self.conn.execute_batch(restore)
    }
}
