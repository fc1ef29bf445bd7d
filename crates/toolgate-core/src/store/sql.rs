//! The one SQL surface every typed query is written against, whichever backend
//! holds the ledger: a connection ([`Conn`]), a prepared statement ([`Stmt`]),
//! a row ([`Row`]), parameters ([`Param`]) and column values ([`Col`]).
//!
//! Queries are written once, in the SQL that SQLite and PostgreSQL share
//! (`?N` parameters, `coalesce`, `CASE`, `ON CONFLICT (...)`, `RETURNING`,
//! window functions). For PostgreSQL the parameters are rewritten to `$N` when
//! a statement is first prepared (and cached per connection); the few places
//! where the dialects differ ask [`Conn::backend`]. Written by hand because no
//! crate puts rusqlite and the `postgres` driver behind one statement API;
//! it is a thin adapter, not an ORM: the SQL stays visible at every call site.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use postgres::error::SqlState;
use postgres::types::Type;

use super::StoreError;

type R<T> = Result<T, StoreError>;

/// Which database a connection talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// An embedded SQLite file.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

/// A PostgreSQL connection with its statement cache.
pub(crate) struct PgConn {
    pub(crate) client: RefCell<super::pg_client::PgClient>,
    /// How to connect again after the server went away, and the session
    /// settings to restore.
    config: tokio_postgres::Config,
    connector: super::pg_tls::Connector,
    /// The bound on one round trip (`pg_client`).
    bound: std::time::Duration,
    session: String,
    cache: RefCell<HashMap<String, postgres::Statement>>,
    /// A statement of the open transaction failed: PostgreSQL has aborted
    /// the transaction, so it must not be committed. Says whether the store
    /// may run the transaction again (see `Failed`).
    pub(crate) failed: Cell<Option<Failed>>,
}

/// Why a statement of an open PostgreSQL transaction failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Failed {
    /// A serialization failure or deadlock: run the transaction again.
    Serialization,
    /// A unique constraint. Under SERIALIZABLE, PostgreSQL reports a
    /// concurrent insert of the same key (two hosts accepting one scope, or
    /// binding one call identity, at once) as a unique violation rather than
    /// a serialization failure whenever the earlier "is it there?" read did
    /// not take a predicate lock on that index entry. Run again, the
    /// transaction sees the committed row and answers as for any existing
    /// record (replay, in flight, conflict). A violation that persists over a
    /// few runs is a real one and is returned.
    Unique,
    /// Anything else: the transaction cannot commit.
    Other,
}

impl PgConn {
    pub(crate) fn new(
        client: super::pg_client::PgClient,
        config: tokio_postgres::Config,
        connector: super::pg_tls::Connector,
        bound: std::time::Duration,
        session: String,
    ) -> Self {
        Self {
            client: RefCell::new(client),
            config,
            connector,
            bound,
            session,
            cache: RefCell::new(HashMap::new()),
            failed: Cell::new(None),
        }
    }

    /// A connection the server closed (a restart, a failover) is replaced
    /// before the next transaction begins; its prepared statements went with it.
    pub(crate) fn ensure_connected(&self) -> R<()> {
        if !self.client.borrow().is_closed() {
            return Ok(());
        }
        self.reconnect()
    }

    /// Replaces the connection whatever the client believes: a server that
    /// restarted is noticed only when a statement fails.
    pub(crate) fn reconnect(&self) -> R<()> {
        let client = super::pg_client::PgClient::connect(&self.config, &self.connector, self.bound)
            .map_err(|_| StoreError::Unavailable)?;
        client.batch_execute(&self.session).map_err(|e| pg_error(&e))?;
        *self.client.borrow_mut() = client;
        self.cache.borrow_mut().clear();
        Ok(())
    }

    /// Records a failure of a statement of the open transaction and maps it.
    fn fail(&self, e: &super::pg_client::PgError) -> StoreError {
        let err = pg_error(e);
        let now = if matches!(err, StoreError::Conflict) {
            Failed::Serialization
        } else if e.as_db_error().is_some_and(|db| *db.code() == SqlState::UNIQUE_VIOLATION) {
            Failed::Unique
        } else {
            Failed::Other
        };
        // The first failure aborted the transaction; what follows it is noise.
        if self.failed.get().is_none() {
            self.failed.set(Some(now));
        }
        err
    }

    fn prepare(&self, sql: &str) -> R<postgres::Statement> {
        if let Some(st) = self.cache.borrow().get(sql) {
            return Ok(st.clone());
        }
        let text = pg_placeholders(sql);
        let st = self.client.borrow_mut().prepare(&text).map_err(|e| self.fail(&e))?;
        self.cache.borrow_mut().insert(sql.to_string(), st.clone());
        Ok(st)
    }
}

/// Maps a PostgreSQL error to a backend-neutral one: never the statement text,
/// never connection parameters (the server's message names schema objects only).
pub(crate) fn pg_error(e: &super::pg_client::PgError) -> StoreError {
    use super::pg_client::PgError;
    let e = match e {
        PgError::Pg(e) => e,
        // No answer within the bound: the path to the server is broken.
        PgError::TimedOut | PgError::Io(_) => return StoreError::Unavailable,
    };
    let Some(db) = e.as_db_error() else {
        if e.is_closed() || std::error::Error::source(e).is_some_and(<dyn std::error::Error>::is::<std::io::Error>) {
            return StoreError::Unavailable;
        }
        // Client-side errors (a type the column does not take, I/O): the
        // driver's description, which carries no SQL text.
        return StoreError::Other(e.to_string());
    };
    let code = db.code();
    // Class 08 (connection exception) and 57 (operator intervention: the
    // server is shutting down, crashed, or not accepting connections yet).
    // And 25P03: the server ended a session left idle inside a transaction
    // (a host that hung holding locks): nothing of it committed.
    if code.code().starts_with("08") || code.code().starts_with("57P") || code.code() == "25P03" {
        return StoreError::Unavailable;
    }
    if *code == SqlState::T_R_SERIALIZATION_FAILURE || *code == SqlState::T_R_DEADLOCK_DETECTED {
        StoreError::Conflict
    } else if *code == SqlState::READ_ONLY_SQL_TRANSACTION || *code == SqlState::INSUFFICIENT_PRIVILEGE {
        StoreError::ReadOnly
    } else if *code == SqlState::DISK_FULL {
        StoreError::DiskFull
    } else if *code == SqlState::LOCK_NOT_AVAILABLE || *code == SqlState::QUERY_CANCELED {
        StoreError::Busy
    } else if *code == SqlState::UNIQUE_VIOLATION
        || *code == SqlState::CHECK_VIOLATION
        || *code == SqlState::FOREIGN_KEY_VIOLATION
        || *code == SqlState::NOT_NULL_VIOLATION
    {
        StoreError::Constraint(db.message().to_string())
    } else {
        StoreError::Other(db.message().to_string())
    }
}

/// `?N` → `$N` outside string literals and quoted identifiers.
pub(crate) fn pg_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quote: Option<char> = None;
    for c in sql.chars() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    out.push(c);
                }
                '?' => out.push('$'),
                _ => out.push(c),
            },
        }
    }
    out
}

/// A connection to either backend.
pub(crate) enum Conn {
    Lite(rusqlite::Connection),
    Pg(PgConn),
}

impl Conn {
    /// The backend this connection talks to.
    pub(crate) fn backend(&self) -> Backend {
        match self {
            Conn::Lite(_) => Backend::Sqlite,
            Conn::Pg(_) => Backend::Postgres,
        }
    }

    /// SQLite: the rowid of the row this connection inserted last; `None` on
    /// PostgreSQL.
    pub(crate) fn last_insert_rowid(&self) -> Option<i64> {
        match self {
            Conn::Lite(c) => Some(c.last_insert_rowid()),
            Conn::Pg(_) => None,
        }
    }

    /// A prepared statement, cached per connection.
    pub(crate) fn prepare_cached(&self, sql: &str) -> R<Stmt<'_>> {
        match self {
            Conn::Lite(c) => Ok(Stmt::Lite(c.prepare_cached(sql)?)),
            Conn::Pg(c) => Ok(Stmt::Pg { conn: c, st: c.prepare(sql)? }),
        }
    }

    /// A statement prepared once (rare statements: the audit's checks).
    pub(crate) fn prepare(&self, sql: &str) -> R<Stmt<'_>> {
        self.prepare_cached(sql)
    }

    /// Runs several statements (a migration), no parameters.
    pub(crate) fn execute_batch(&self, sql: &str) -> R<()> {
        match self {
            Conn::Lite(c) => Ok(c.execute_batch(sql)?),
            Conn::Pg(c) => c.client.borrow_mut().batch_execute(sql).map_err(|e| c.fail(&e)),
        }
    }

    /// Runs one statement; returns the rows changed.
    #[allow(clippy::needless_pass_by_value)]
    pub(crate) fn execute(&self, sql: &str, params: impl Params) -> R<usize> {
        self.prepare_cached(sql)?.execute(params)
    }
}

/// A prepared statement.
pub(crate) enum Stmt<'c> {
    Lite(rusqlite::CachedStatement<'c>),
    Pg { conn: &'c PgConn, st: postgres::Statement },
}

// Parameters are taken by value as rusqlite takes them (`[a, b]`, `params![..]`).
#[allow(clippy::needless_pass_by_value)]
impl Stmt<'_> {
    /// Runs it; returns the rows changed.
    pub(crate) fn execute(&mut self, params: impl Params) -> R<usize> {
        let list = params.list();
        match self {
            Stmt::Lite(st) => {
                let p: Vec<&dyn rusqlite::ToSql> = list.iter().map(|p| p.lite()).collect();
                Ok(st.execute(p.as_slice())?)
            }
            Stmt::Pg { conn, st } => {
                let p: Vec<&(dyn postgres::types::ToSql + Sync)> = list.iter().map(|p| p.pg()).collect();
                let n = conn.client.borrow_mut().execute(st, &p).map_err(|e| conn.fail(&e))?;
                Ok(n as usize)
            }
        }
    }

    /// Every row, mapped.
    pub(crate) fn query_map<T>(
        &mut self,
        params: impl Params,
        mut f: impl FnMut(&Row<'_>) -> R<T>,
    ) -> R<std::vec::IntoIter<R<T>>> {
        let list = params.list();
        let mut out = Vec::new();
        match self {
            Stmt::Lite(st) => {
                let p: Vec<&dyn rusqlite::ToSql> = list.iter().map(|p| p.lite()).collect();
                let mut rows = st.query(p.as_slice())?;
                while let Some(r) = rows.next()? {
                    out.push(f(&Row::Lite(r)));
                }
            }
            Stmt::Pg { conn, st } => {
                let p: Vec<&(dyn postgres::types::ToSql + Sync)> = list.iter().map(|p| p.pg()).collect();
                let rows = conn.client.borrow_mut().query(st, &p).map_err(|e| conn.fail(&e))?;
                for r in &rows {
                    out.push(f(&Row::Pg(r)));
                }
            }
        }
        Ok(out.into_iter())
    }

    /// The first row, mapped, or `None`.
    pub(crate) fn query_opt<T>(&mut self, params: impl Params, f: impl FnOnce(&Row<'_>) -> R<T>) -> R<Option<T>> {
        let list = params.list();
        match self {
            Stmt::Lite(st) => {
                let p: Vec<&dyn rusqlite::ToSql> = list.iter().map(|p| p.lite()).collect();
                let mut rows = st.query(p.as_slice())?;
                match rows.next()? {
                    Some(r) => Ok(Some(f(&Row::Lite(r))?)),
                    None => Ok(None),
                }
            }
            Stmt::Pg { conn, st } => {
                let p: Vec<&(dyn postgres::types::ToSql + Sync)> = list.iter().map(|p| p.pg()).collect();
                let rows = conn.client.borrow_mut().query(st, &p).map_err(|e| conn.fail(&e))?;
                match rows.first() {
                    Some(r) => Ok(Some(f(&Row::Pg(r))?)),
                    None => Ok(None),
                }
            }
        }
    }

    /// The first row, mapped; no row is an error (for aggregates, which always
    /// return one).
    pub(crate) fn query_row<T>(&mut self, params: impl Params, f: impl FnOnce(&Row<'_>) -> R<T>) -> R<T> {
        self.query_opt(params, f)?.ok_or_else(|| StoreError::Other("a query that returns one row returned none".into()))
    }
}

/// One result row.
pub(crate) enum Row<'a> {
    Lite(&'a rusqlite::Row<'a>),
    Pg(&'a postgres::Row),
}

impl Row<'_> {
    /// Column `i` (from 0).
    pub(crate) fn get<T: Col>(&self, i: usize) -> R<T> {
        match self {
            Row::Lite(r) => T::lite(r, i),
            Row::Pg(r) => T::pg(r, i),
        }
    }

    /// Text column `i`, borrowed from the row (no copy); `None` for NULL.
    pub(crate) fn str_ref(&self, i: usize) -> R<Option<&str>> {
        match self {
            Row::Lite(r) => Ok(r.get_ref(i)?.as_str_or_null().map_err(|e| StoreError::Other(e.to_string()))?),
            Row::Pg(r) => pg_get(r, i),
        }
    }
}

/// A Rust type a column can be read as, on both backends.
pub trait Col: Sized {
    #[doc(hidden)]
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self>;
    #[doc(hidden)]
    fn pg(r: &postgres::Row, i: usize) -> R<Self>;
}

fn pg_get<'a, T: postgres::types::FromSql<'a>>(r: &'a postgres::Row, i: usize) -> R<T> {
    r.try_get(i).map_err(|e| StoreError::Other(e.to_string()))
}

/// An integer column of any width (PostgreSQL's `length()` and literals are
/// `integer`, its counts `bigint`).
fn pg_int(r: &postgres::Row, i: usize) -> R<Option<i64>> {
    let ty = r.columns().get(i).map(|c| c.type_().clone());
    match ty {
        Some(Type::INT2) => Ok(pg_get::<Option<i16>>(r, i)?.map(i64::from)),
        Some(Type::INT4) => Ok(pg_get::<Option<i32>>(r, i)?.map(i64::from)),
        Some(Type::BOOL) => Ok(pg_get::<Option<bool>>(r, i)?.map(i64::from)),
        _ => pg_get::<Option<i64>>(r, i),
    }
}

impl Col for i64 {
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self> {
        Ok(r.get(i)?)
    }
    fn pg(r: &postgres::Row, i: usize) -> R<Self> {
        pg_int(r, i)?.ok_or_else(|| StoreError::Other(format!("column {i} is NULL")))
    }
}

impl Col for Option<i64> {
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self> {
        Ok(r.get(i)?)
    }
    fn pg(r: &postgres::Row, i: usize) -> R<Self> {
        pg_int(r, i)
    }
}

impl Col for bool {
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self> {
        Ok(r.get(i)?)
    }
    fn pg(r: &postgres::Row, i: usize) -> R<Self> {
        Ok(<i64 as Col>::pg(r, i)? != 0)
    }
}

impl Col for String {
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self> {
        Ok(r.get(i)?)
    }
    fn pg(r: &postgres::Row, i: usize) -> R<Self> {
        pg_get(r, i)
    }
}

impl Col for Option<String> {
    fn lite(r: &rusqlite::Row<'_>, i: usize) -> R<Self> {
        Ok(r.get(i)?)
    }
    fn pg(r: &postgres::Row, i: usize) -> R<Self> {
        pg_get(r, i)
    }
}

/// A parameter value both drivers can bind (`&str`, `String`, `i64`,
/// `bool`, their `Option`s).
pub trait Param: Sync {
    #[doc(hidden)]
    fn lite(&self) -> &dyn rusqlite::ToSql;
    #[doc(hidden)]
    fn pg(&self) -> &(dyn postgres::types::ToSql + Sync);
}

impl<T: rusqlite::ToSql + postgres::types::ToSql + Sync> Param for T {
    fn lite(&self) -> &dyn rusqlite::ToSql {
        self
    }
    fn pg(&self) -> &(dyn postgres::types::ToSql + Sync) {
        self
    }
}

/// A statement's parameters.
pub(crate) trait Params {
    fn list(&self) -> Vec<&dyn Param>;
}

impl Params for () {
    fn list(&self) -> Vec<&dyn Param> {
        Vec::new()
    }
}

impl<T: Param, const N: usize> Params for [T; N] {
    fn list(&self) -> Vec<&dyn Param> {
        self.iter().map(|p| p as &dyn Param).collect()
    }
}

impl Params for &[&dyn Param] {
    fn list(&self) -> Vec<&dyn Param> {
        self.to_vec()
    }
}

/// `params![a, b, c]`: parameters of mixed types.
macro_rules! params {
    ($($p:expr),* $(,)?) => {
        &[$(&$p as &dyn $crate::store::sql::Param),*] as &[&dyn $crate::store::sql::Param]
    };
}
pub(crate) use params;

/// `sql_text!("SELECT {COLS} FROM …")`: a statement text formatted from
/// constants once per process, not once per call (`prepare_cached` then looks
/// it up; a `format!` of the forty-column operation list on every call was a
/// measurable share of a dispatch, callgrind). The text lives in a `static`,
/// so the compiler refuses local variables; the arguments must also give the
/// same text every time (constants, `placeholders(N)`), which it cannot check.
macro_rules! sql_text {
    ($($fmt:tt)*) => {{
        static TEXT: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!($($fmt)*));
        TEXT.as_str()
    }};
}
pub(crate) use sql_text;

#[cfg(test)]
mod tests {
    use super::pg_placeholders;

    fn check(input: &str, expect: &str) {
        assert_eq!(pg_placeholders(input), expect);
    }

    #[test]
    fn placeholders_are_rewritten_outside_literals() {
        check("SELECT a FROM t WHERE b = ?1 AND c = ?12", "SELECT a FROM t WHERE b = $1 AND c = $12");
        check("SELECT '?1', \"x?\" FROM t WHERE b = ?2", "SELECT '?1', \"x?\" FROM t WHERE b = $2");
        check("SELECT 'it''s ?' || ?3", "SELECT 'it''s ?' || $3");
    }
}
