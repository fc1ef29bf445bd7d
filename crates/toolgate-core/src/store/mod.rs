//! Storage: connection set-up, embedded migrations and typed queries, on an
//! embedded SQLite file or a PostgreSQL server.
//!
//! **This is the ledger's only SQL** (a tool's domain keeps its own tables'
//! statements in a store module of its own, run through [`DomainTx`]). The engine sees [`Store`] (open, run a
//! transaction) and [`Tx`] (typed reads and writes inside one transaction).
//! Every query is written once against [`sql`]'s neutral statement API and runs
//! on either backend; a `--db` value that is a `postgres://` or
//! `postgresql://` URL selects PostgreSQL, anything else is a SQLite path.

mod approvals;
mod audit;
pub mod bench;
mod clock;
mod domain;
mod group;
mod holds;
pub mod latency_bucket;
mod ops;
mod pg;
mod pg_client;
pub mod pg_tls;
mod provider;
mod resilience;
mod trace;
mod world;
#[macro_use]
mod rows;
mod scope;
pub(crate) mod sql;
mod states;
mod tokens;
mod views;

use sql::sql_text;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

pub use domain::{DomainRow, DomainTx};
pub use pg::ScratchDatabase;
pub use provider::{ProviderStore, ProviderTx};
pub use resilience::{CircuitRow, RateLimitedRow, RetryBudgetRow, MILLI_TOKEN};
pub use rows::*;
pub use scope::Scope;
use sql::{params, Conn};
pub use sql::{Backend, Col, Param};
pub use states::{AnswerKind, ApprovalState, AttemptOutcome, CircuitState, OpState, OutboxState, Reason, Step};
pub use tokens::TokenRow;
pub use views::{
    cursor_after, Cursor, Filter, FilterTarget, Key, LiveRow, OpsView, Order, SortColumn, APPROVALS_SORT, AUDIT_SORT,
    LIVE_SORT, OPS_SORT,
};
pub use world::{Access, Principal};

/// Migrations, in order. The schema version is the number applied (`PRAGMA user_version`).
const MIGRATIONS: [&str; 18] = [
    include_str!("migrations/0001_ledger.sql"),
    include_str!("migrations/0002_observability.sql"),
    include_str!("migrations/0003_counters.sql"),
    include_str!("migrations/0004_resilience.sql"),
    include_str!("migrations/0005_retention.sql"),
    include_str!("migrations/0006_latency_bucket.sql"),
    include_str!("migrations/0007_integrity.sql"),
    include_str!("migrations/0008_state_since.sql"),
    include_str!("migrations/0009_downstream_key.sql"),
    include_str!("migrations/0010_api_tokens.sql"),
    include_str!("migrations/0011_sort_indexes.sql"),
    include_str!("migrations/0012_folded_rollups.sql"),
    include_str!("migrations/0013_state_counts_in_store.sql"),
    include_str!("migrations/0014_holds.sql"),
    include_str!("migrations/0015_scope_downstream_key.sql"),
    include_str!("migrations/0016_operator_token_tenants.sql"),
    include_str!("migrations/0017_audit_anchor.sql"),
    include_str!("migrations/0018_purge_indexes.sql"),
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The link of the first row of the operator log's hash chain.
pub const AUDIT_GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// Trace events with unparseable fields (their seq), and gaps in the sequence
/// as (first missing, last missing).
pub type TraceDamage = (Vec<i64>, Vec<(i64, i64)>);

/// Prepared statements kept per connection.
const STATEMENT_CACHE: usize = 160;

/// How long a writer waits for the lock before SQLite reports busy.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long we keep retrying `BEGIN IMMEDIATE` on busy (or, on PostgreSQL, a
/// transaction that met a serialization failure) before surfacing it.
const BEGIN_RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Storage errors, the same for every backend. Messages never include a local
/// path, a connection URL or SQL text.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database could not be opened or created.
    #[error("cannot open the database: {0}")]
    Open(String),
    /// The database file does not exist (and we were not asked to create it).
    #[error("no database at the given path (run `toolgate init` first)")]
    Missing,
    /// The file was written by a newer toolgate.
    #[error("the database has schema version {found}, newer than this build's {supported}; refusing to open it (nothing was changed)")]
    SchemaTooNew {
        /// Version in the file.
        found: i64,
        /// Version this build knows.
        supported: i64,
    },
    /// The file is not a toolgate database.
    #[error("the file is not a toolgate database")]
    NotToolgate,
    /// The database was opened read-only (a read command), or the file or its
    /// directory cannot be written.
    #[error("the database is read-only here: read commands work; to change it, run as a user who may write the file and its directory")]
    ReadOnly,
    /// The disk is full.
    #[error("the disk is full: nothing was written; free space and run the command again")]
    DiskFull,
    /// Another writer held the lock for longer than the busy timeout.
    #[error("the database stayed locked by another writer; run the command again")]
    Busy,
    /// The file's schema is older than this build's and the command may not migrate it.
    #[error("the database has schema version {found}, older than this build's {supported}; a read command does not migrate it: run `toolgate reap` (or any write command) once to migrate")]
    SchemaOld {
        /// Version in the file.
        found: i64,
        /// Version this build knows.
        supported: i64,
    },
    /// A migration failed (the file's schema does not match its version);
    /// nothing was changed.
    #[error("migration {number:04} failed ({reason}); the file's schema does not match its version {found}; nothing was changed")]
    Migration {
        /// Migration number.
        number: usize,
        /// Version the file claimed.
        found: i64,
        /// The database's reason, without the SQL text.
        reason: String,
    },
    /// A constraint refused a write (unique, check, foreign key).
    #[error("database constraint: {0}")]
    Constraint(String),
    /// Two transactions conflicted (PostgreSQL serialization failure or
    /// deadlock). The store retries the transaction; callers only see this
    /// when the retries ran out.
    #[error("the transaction kept conflicting with concurrent writers; run the command again")]
    Conflict,
    /// The database server went away (or is not accepting connections) in the
    /// middle of the call: nothing was decided that the ledger will not show;
    /// retry the call with the same key once the server is back.
    #[error("the database server is unreachable or restarting; retry the call with the same idempotency key")]
    Unavailable,
    /// What this backend does not do (the message says what does it).
    #[error("not on this backend: {0}")]
    Unsupported(String),
    /// Any other database error: its description only (never SQL text or a path).
    #[error("database error: {0}")]
    Other(String),
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode as C;
        match &e {
            rusqlite::Error::SqliteFailure(f, msg) => match f.code {
                C::ReadOnly => StoreError::ReadOnly,
                C::DiskFull => StoreError::DiskFull,
                C::DatabaseBusy | C::DatabaseLocked => StoreError::Busy,
                C::NotADatabase => StoreError::NotToolgate,
                // SQLite's own message ("no such table: x", "UNIQUE constraint
                // failed: t.c") names schema objects, never the statement text.
                C::ConstraintViolation => StoreError::Constraint(msg.clone().unwrap_or_else(|| f.to_string())),
                _ => StoreError::Other(msg.clone().unwrap_or_else(|| f.to_string())),
            },
            // These variants carry the SQL text: say what kind of error it was only.
            rusqlite::Error::SqlInputError { msg, .. } => StoreError::Other(msg.clone()),
            other => StoreError::Other(other.to_string()),
        }
    }
}

impl crate::Coded for StoreError {
    /// Stable code for the CLI.
    fn code(&self) -> &'static str {
        match self {
            StoreError::Open(_) => "DB_OPEN_FAILED",
            StoreError::Missing => "DB_NOT_FOUND",
            StoreError::SchemaTooNew { .. } => "DB_SCHEMA_TOO_NEW",
            StoreError::SchemaOld { .. } => "DB_SCHEMA_OLD",
            StoreError::NotToolgate => "DB_NOT_TOOLGATE",
            StoreError::ReadOnly => "DB_READ_ONLY",
            StoreError::DiskFull => "DISK_FULL",
            StoreError::Busy | StoreError::Conflict => "DB_BUSY",
            StoreError::Migration { .. } => "DB_MIGRATION_FAILED",
            StoreError::Constraint(_) => "DB_CONSTRAINT",
            StoreError::Unavailable => "DB_UNAVAILABLE",
            StoreError::Unsupported(_) => "DB_UNSUPPORTED",
            StoreError::Other(_) => "DB_ERROR",
        }
    }
}

/// Durability mode for the ledger (docs/design.md §6: FULL by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// fsync on every commit (PostgreSQL: `synchronous_commit = on`).
    Full,
    /// WAL NORMAL: survives process crashes, not power loss (PostgreSQL:
    /// `synchronous_commit = off`, which loses no committed state on a crash
    /// of a client, only the newest commits on a crash of the server's host).
    Normal,
}

/// How to open a store.
#[derive(Debug, Clone, Copy)]
pub struct OpenOptions {
    /// Create the file if missing.
    pub create: bool,
    /// Durability.
    pub sync: Sync,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self { create: false, sync: Sync::Full }
    }
}

/// Where a ledger lives: what a `--db` value names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location<'a> {
    /// A SQLite file.
    File(&'a Path),
    /// A PostgreSQL connection URL (`postgres://` or `postgresql://`).
    Postgres(&'a str),
}

impl<'a> Location<'a> {
    /// What `db` names: a PostgreSQL URL, or else a SQLite path.
    pub fn of(db: &'a Path) -> Self {
        match db.to_str() {
            Some(s) if s.starts_with("postgres://") || s.starts_with("postgresql://") => Location::Postgres(s),
            _ => Location::File(db),
        }
    }

    /// A name to show for it: the file's name, or `HOST/DB` of a URL (never
    /// its user or password).
    pub fn label(&self) -> String {
        match self {
            Location::File(p) => p.file_name().map_or_else(|| "ledger".into(), |n| n.to_string_lossy().into_owned()),
            Location::Postgres(url) => pg_tls::parse(url).map_or_else(
                |_| "postgres".into(),
                |u| {
                    let c = &u.config;
                    let host = match c.get_hosts().first() {
                        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
                        Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
                        None => "localhost".into(),
                    };
                    // Whether the connection is encrypted, and how it is checked.
                    let tls = match u.mode {
                        pg_tls::SslMode::Off => String::new(),
                        m => format!(" (TLS {})", m.as_str()),
                    };
                    format!("postgres {host}/{}{tls}", c.get_dbname().unwrap_or("postgres"))
                },
            ),
        }
    }

    /// Whether `db` is a PostgreSQL URL.
    pub fn is_postgres(db: &Path) -> bool {
        matches!(Location::of(db), Location::Postgres(_))
    }
}

/// One connection to a toolgate database.
pub struct Store {
    conn: Conn,
    /// The durability it was opened with.
    sync: Sync,
    /// A relaxed commit left the connection at `synchronous=NORMAL` and
    /// restoring FULL failed: the next synced write restores it first.
    relaxed: bool,
    /// This process's writer of the database ([`writer_lock`]).
    writer: Arc<group::Writer>,
    /// Opened with [`Store::open_read_only`].
    read_only: bool,
}

/// The writer of each database in this process ([`group::Writer`]): one per
/// database, shared by every store on it. Writers of one process (an engine
/// per thread, the providers' connections) queue on it and are woken as soon
/// as it is free, instead of polling SQLite's write lock from its busy
/// handler, which sleeps up to 100 ms between tries: under contention that
/// made the slowest calls wait seconds. On SQLite the writers that queue
/// together share one commit (group commit, `group.rs`, at FULL and at
/// NORMAL, never mixing a FULL caller into a NORMAL commit); other processes still
/// meet SQLite's lock and the busy timeout (on PostgreSQL: serializable
/// conflicts, retried). Nothing writes through a second connection while
/// holding a write transaction, so the writer cannot be taken twice by one
/// thread. `TOOLGATE_GROUP_COMMIT=off` switches group commit off (writers
/// only take turns), for measurements.
fn writer_lock(key: &Path) -> Arc<group::Writer> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, Weak<group::Writer>>>> = OnceLock::new();
    let (key, file) = match Location::of(key) {
        Location::File(path) => {
            let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            (canonical.clone(), Some(canonical))
        }
        Location::Postgres(url) => (PathBuf::from(url), None),
    };
    let mut locks = LOCKS.get_or_init(Mutex::default).lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(lock) = locks.get(&key).and_then(Weak::upgrade) {
        return lock;
    }
    locks.retain(|_, w| w.strong_count() > 0);
    let group = std::env::var("TOOLGATE_GROUP_COMMIT").map_or(true, |v| v != "off");
    let lock = Arc::new(group::Writer::new(file, group));
    locks.insert(key, Arc::downgrade(&lock));
    lock
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Store(..)")
    }
}

/// A SQLite file that is not a ledger is never made one by a command that
/// did not ask to create one (an existing empty file, e.g. a mistyped
/// `--db`), and never by any command when it holds tables of its own (another
/// program's database): a ledger's version is set by its first migration.
fn refuse_foreign(conn: &Connection, create: bool) -> Result<(), StoreError> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(|e| match e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => StoreError::NotToolgate,
        other => open_error(&other),
    })?;
    if version != 0 {
        return Ok(());
    }
    let tables: i64 = conn.query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0))?;
    if tables > 0 || !create {
        return Err(StoreError::NotToolgate);
    }
    Ok(())
}

fn open_error(e: &rusqlite::Error) -> StoreError {
    // rusqlite's messages for open failures do not include the path; keep only the
    // SQLite description.
    match e {
        rusqlite::Error::SqliteFailure(err, _) => StoreError::Open(err.to_string()),
        other => StoreError::Open(other.to_string()),
    }
}

/// Whether `path` is on a filesystem mounted read-only (asked with
/// `access(2)`, which opens nothing: see the lock note in [`Store::open`]).
fn on_read_only_filesystem(path: &Path) -> bool {
    matches!(rustix::fs::access(path, rustix::fs::Access::WRITE_OK), Err(e) if e == rustix::io::Errno::ROFS)
}

/// A SQLite URI naming `path` as immutable: read without the write-ahead
/// log's shared memory (which cannot be created on a read-only filesystem)
/// and without locks. Only used there, and only when no write-ahead log is
/// beside the file (it would be ignored): nothing can change the file then.
/// (Percent-encoding by hand: the three characters a URI path may not hold
/// bare are all SQLite's URI parser needs escaped.)
fn immutable_uri(path: &Path) -> Option<String> {
    let text = path.to_str()?;
    let mut out = String::from("file:");
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            '?' => out.push_str("%3f"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
    out.push_str("?immutable=1");
    Some(out)
}

/// Whether a write-ahead log with content is beside `path`.
fn has_wal(path: &Path) -> bool {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(PathBuf::from(wal)).is_ok_and(|m| m.len() > 0)
}

/// Opens an existing SQLite file for reading only, with its `user_version`.
/// A WAL database on a read-only filesystem cannot make its shared memory;
/// with no log beside it the file is the whole database and cannot change
/// there, so it is read as immutable.
fn lite_read_only(path: &Path) -> Result<(Connection, i64), StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
    let version = |conn: &Connection| {
        conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).map_err(|e| match e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
                StoreError::NotToolgate
            }
            // "Unable to open": WAL's shared memory could not be made.
            e @ rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::CannotOpen => open_error(&e),
            other => StoreError::from(other),
        })
    };
    let conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(&e))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    match version(&conn) {
        Err(StoreError::Open(_)) if on_read_only_filesystem(path) => {
            if has_wal(path) {
                return Err(StoreError::Open(
                    "the file is on a read-only filesystem with a write-ahead log beside it that cannot be read there; copy the file and its -wal to a writable place".into(),
                ));
            }
            let uri = immutable_uri(path).ok_or_else(|| StoreError::Open("the path is not UTF-8".into()))?;
            let conn = Connection::open_with_flags(uri, flags).map_err(|e| open_error(&e))?;
            let v = version(&conn)?;
            Ok((conn, v))
        }
        v => Ok((conn, v?)),
    }
}

impl Store {
    /// Opens an existing ledger for reading only: never creates, migrates or
    /// writes the file. An empty or foreign file is `DB_NOT_TOOLGATE`, an older
    /// schema `DB_SCHEMA_OLD`; every write through it is `DB_READ_ONLY`.
    pub fn open_read_only(path: &Path) -> Result<Self, StoreError> {
        if let Location::Postgres(url) = Location::of(path) {
            let conn = pg::open(url, Sync::Full, true)?;
            return Ok(Self { conn, sync: Sync::Full, relaxed: false, writer: writer_lock(path), read_only: true });
        }
        if !path.exists() {
            return Err(StoreError::Missing);
        }
        if std::fs::metadata(path).is_ok_and(|m| m.len() < 512) {
            return Err(StoreError::NotToolgate);
        }
        let (conn, version) = lite_read_only(path)?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew { found: version, supported: SCHEMA_VERSION });
        }
        let has_meta: i64 =
            conn.query_row("SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = 'meta'", [], |r| {
                r.get(0)
            })?;
        if version <= 0 || has_meta == 0 {
            return Err(StoreError::NotToolgate);
        }
        if version < SCHEMA_VERSION {
            return Err(StoreError::SchemaOld { found: version, supported: SCHEMA_VERSION });
        }
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(Self {
            conn: Conn::Lite(conn),
            sync: Sync::Full,
            relaxed: false,
            writer: writer_lock(path),
            read_only: true,
        })
    }

    /// Opens a database without touching the ledger's schema: neither its
    /// migrations nor its version check (the simulated providers' own store,
    /// which may live in a file of its own, has migrations of its own).
    pub(crate) fn open_unmigrated(path: &Path, opts: OpenOptions, read_only: bool) -> Result<Self, StoreError> {
        if let Location::Postgres(url) = Location::of(path) {
            let conn = Conn::Pg(pg::connect(url, opts.sync, read_only)?);
            return Ok(Self { conn, sync: opts.sync, relaxed: false, writer: writer_lock(path), read_only });
        }
        if !opts.create && !path.exists() {
            return Err(StoreError::Missing);
        }
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.len() > 0 && meta.len() < 512 {
                return Err(StoreError::NotToolgate);
            }
        }
        if read_only {
            let (conn, _) = lite_read_only(path)?;
            conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
            return Ok(Self {
                conn: Conn::Lite(conn),
                sync: opts.sync,
                relaxed: false,
                writer: writer_lock(path),
                read_only,
            });
        }
        let mut flags =
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
        if opts.create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let setup = || -> Result<Connection, StoreError> {
            let conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(&e))?;
            conn.busy_timeout(BUSY_TIMEOUT)?;
            conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).map_err(|e| match e {
                rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
                    StoreError::NotToolgate
                }
                other => open_error(&other),
            })?;
            let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
                return Err(StoreError::Open(format!("could not enable WAL (journal_mode={mode})")));
            }
            conn.execute_batch(match opts.sync {
                Sync::Full => "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
                Sync::Normal => "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
            })?;
            Ok(conn)
        };
        let conn = setup().map_err(|e| match e {
            StoreError::Open(_) | StoreError::Other(_) if on_read_only_filesystem(path) => StoreError::ReadOnly,
            e => e,
        })?;
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        Ok(Self { conn: Conn::Lite(conn), sync: opts.sync, relaxed: false, writer: writer_lock(path), read_only })
    }

    /// Opens (and migrates) a database: a SQLite file, or a PostgreSQL
    /// database when `path` is a `postgres://` URL (`create` has no meaning
    /// there: the database must exist; its schema is created on first use).
    pub fn open(path: &Path, opts: OpenOptions) -> Result<Self, StoreError> {
        if let Location::Postgres(url) = Location::of(path) {
            let conn = pg::open(url, opts.sync, false)?;
            return Ok(Self { conn, sync: opts.sync, relaxed: false, writer: writer_lock(path), read_only: false });
        }
        if !opts.create && !path.exists() {
            return Err(StoreError::Missing);
        }
        // A file too small to be a database is someone else's file: never let SQLite
        // initialise it. (Larger non-SQLite files fail SQLite's own header check.)
        // Only stat it: opening and closing the file here would drop the POSIX locks
        // that this process's other SQLite connections hold on it.
        if let Ok(meta) = std::fs::metadata(path) {
            if meta.len() > 0 && meta.len() < 512 {
                return Err(StoreError::NotToolgate);
            }
        }
        let mut flags =
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
        if opts.create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(&e))?;
        refuse_foreign(&conn, opts.create).and_then(|()| Self::setup(conn, opts.sync, writer_lock(path))).map_err(|e| {
            match e {
                // SQLite says "unable to open" where the file, its log or its
                // shared memory cannot be written: say why.
                StoreError::Open(_) | StoreError::Other(_) if on_read_only_filesystem(path) => StoreError::ReadOnly,
                e => e,
            }
        })
    }

    fn setup(conn: Connection, sync: Sync, writer: Arc<group::Writer>) -> Result<Self, StoreError> {
        // (The caller has refused a file that is someone else's: see `refuse_foreign`.)
        conn.busy_timeout(BUSY_TIMEOUT)?;
        // A file that is not SQLite fails on the first read.
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(|e| match e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
                StoreError::NotToolgate
            }
            other => open_error(&other),
        })?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::SchemaTooNew { found: version, supported: SCHEMA_VERSION });
        }
        if version == 0 {
            // A new ledger gives space back in steps (the reaper's, after a
            // purge): it can only be chosen before the first table exists.
            conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL")?;
        }
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
            return Err(StoreError::Open(format!("could not enable WAL (journal_mode={mode})")));
        }
        conn.execute_batch(match sync {
            Sync::Full => "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
            Sync::Normal => "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;",
        })?;
        // Room for every statement the engine, the console's views and the
        // metrics prepare (about a hundred): none is evicted and re-prepared.
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        let mut conn = conn;
        migrate_sqlite(&mut conn, version)?;
        Ok(Self { conn: Conn::Lite(conn), sync, relaxed: false, writer, read_only: false })
    }

    /// Which backend holds this ledger.
    pub fn backend(&self) -> Backend {
        self.conn.backend()
    }

    /// Whether this connection was opened read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Runs `f` in a write transaction: `BEGIN IMMEDIATE` on SQLite (the write
    /// lock is taken at the start, so the reads inside see what the writes will
    /// be checked against), `SERIALIZABLE` on PostgreSQL (the same guarantee:
    /// the transaction commits only if it is equivalent to running alone).
    /// Commits when `f` returns `Ok`, rolls back otherwise. Busy (and, on
    /// PostgreSQL, a serialization failure) is retried, which is why `f` may
    /// run more than once: it must do nothing outside the transaction.
    pub fn write<T, E: From<StoreError>>(&mut self, f: impl FnMut(&Tx<'_>) -> Result<T, E>) -> Result<T, E> {
        if self.relaxed {
            self.set_synchronous(self.sync)?;
            self.relaxed = false;
        }
        self.transaction(Mode::Write, f)
    }

    /// [`Store::write`] for a transaction that changes no state and only
    /// records how a call was answered (its trace event, its call-identity
    /// binding): the commit does not wait for the disk. In WAL mode such a
    /// commit is appended to the log like any other and becomes durable with
    /// the next synced commit of any connection, in order; a power loss (not a
    /// process crash) can lose the newest of these records, never a state
    /// change, and never one without the records before it. At
    /// `synchronous=NORMAL` it is [`Store::write`]. (PostgreSQL: the same, with
    /// `SET LOCAL synchronous_commit = off`.)
    pub fn write_relaxed<T, E: From<StoreError>>(&mut self, f: impl FnMut(&Tx<'_>) -> Result<T, E>) -> Result<T, E> {
        if self.sync != Sync::Full {
            return self.write(f);
        }
        if let Conn::Pg(_) = self.conn {
            return self.transaction(Mode::WriteRelaxed, f);
        }
        self.relaxed = true;
        self.set_synchronous(Sync::Normal)?;
        let out = self.transaction(Mode::Write, f);
        // A failure here leaves `relaxed` set: the next synced write restores it.
        if self.set_synchronous(Sync::Full).is_ok() {
            self.relaxed = false;
        }
        out
    }

    fn set_synchronous(&self, sync: Sync) -> Result<(), StoreError> {
        let Conn::Lite(conn) = &self.conn else {
            return Ok(());
        };
        let sql = match sync {
            Sync::Full => "PRAGMA synchronous=FULL",
            Sync::Normal => "PRAGMA synchronous=NORMAL",
        };
        conn.prepare_cached(sql)?.execute([])?;
        Ok(())
    }

    /// The durability this connection was opened with.
    pub fn durability(&self) -> Sync {
        self.sync
    }

    /// Runs `f` in a read transaction (one consistent snapshot).
    pub fn read<T, E: From<StoreError>>(&mut self, f: impl FnMut(&Tx<'_>) -> Result<T, E>) -> Result<T, E> {
        self.transaction(Mode::Read, f)
    }

    fn transaction<T, E: From<StoreError>>(
        &mut self,
        mode: Mode,
        f: impl FnMut(&Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        if mode == Mode::Read {
            return match &self.conn {
                Conn::Lite(conn) => lite_transaction(conn, &self.conn, false, f),
                Conn::Pg(pg) => pg::transaction(pg, &self.conn, mode, &self.writer, f),
            };
        }
        // A write on SQLite joins the batch of the writers queued with it (a
        // relaxed write at FULL runs alone: it must not wait for the disk).
        let synced = mode == Mode::Write && self.sync == Sync::Full && !self.relaxed;
        let joins = mode == Mode::Write && !self.relaxed;
        if joins && !self.read_only && self.writer.groups() && matches!(self.conn, Conn::Lite(_)) {
            return self.writer.write(synced, f);
        }
        let writer = Arc::clone(&self.writer);
        let _alone = writer.queues().then(|| writer.alone());
        let out = match &self.conn {
            Conn::Lite(conn) => lite_transaction(conn, &self.conn, true, f),
            Conn::Pg(pg) => pg::transaction(pg, &self.conn, mode, &writer, f),
        };
        if synced && out.is_ok() {
            writer.count_synced();
        }
        out
    }

    /// Commits that waited for the disk (a group commit counts once, whatever
    /// its members), made by this process's writers of this database, all
    /// time: `toolgate bench` reports them per call.
    pub fn synced_commits(&self) -> u64 {
        self.writer.synced_commits()
    }

    /// Write transactions this process ran again on this database after a
    /// serialization failure, deadlock or unique violation (PostgreSQL; 0 on
    /// SQLite), all time: `toolgate bench` reports them per call.
    pub fn write_retries(&self) -> u64 {
        self.writer.retries()
    }

    /// Gives free pages back to the file system, at most `max_pages` in this
    /// step (one short write; SQLite with `auto_vacuum = INCREMENTAL`, which a
    /// ledger has from creation or from [`Store::vacuum`]). Returns the bytes
    /// given back (0 elsewhere: PostgreSQL's autovacuum reuses its space).
    pub fn reclaim_space(&mut self, max_pages: u32) -> Result<u64, StoreError> {
        let Conn::Lite(conn) = &self.conn else { return Ok(0) };
        let incremental: i64 = conn.query_row("PRAGMA auto_vacuum", [], |r| r.get(0))?;
        if incremental != 2 {
            return Ok(0);
        }
        let page: i64 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let before: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        if before == 0 {
            return Ok(0);
        }
        // The pragma frees one page per row it returns: step it to the end
        // (one statement, one commit).
        let mut st = conn.prepare(&format!("PRAGMA incremental_vacuum({max_pages})"))?;
        let mut rows = st.query([])?;
        while rows.next()?.is_some() {}
        drop(rows);
        drop(st);
        let after: i64 = conn.query_row("PRAGMA freelist_count", [], |r| r.get(0))?;
        Ok(u64::try_from((before - after).max(0) * page).unwrap_or(0))
    }

    /// Rewrites a SQLite ledger into the least space, and sets it to give
    /// space back in steps from then on (`auto_vacuum = INCREMENTAL`): an
    /// operator's maintenance command (it holds the database for its whole
    /// run). Returns (bytes before, bytes after). PostgreSQL: refused, its
    /// autovacuum (or the server's own `VACUUM`) does this.
    pub fn vacuum(&mut self) -> Result<(u64, u64), StoreError> {
        let Conn::Lite(conn) = &self.conn else {
            return Err(StoreError::Unsupported(
                "PostgreSQL reuses purged space through its autovacuum; VACUUM FULL is the server's own tool".into(),
            ));
        };
        let size = |c: &rusqlite::Connection| -> Result<u64, StoreError> {
            let pages: i64 = c.query_row("PRAGMA page_count", [], |r| r.get(0))?;
            let page: i64 = c.query_row("PRAGMA page_size", [], |r| r.get(0))?;
            Ok(u64::try_from(pages * page).unwrap_or(0))
        };
        let before = size(conn)?;
        conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL; VACUUM;")?;
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        Ok((before, size(conn)?))
    }

    /// Folds the write-ahead log into the main file (SQLite; PostgreSQL
    /// manages its own).
    pub fn checkpoint(&mut self) -> Result<(), StoreError> {
        if let Conn::Lite(conn) = &self.conn {
            conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        }
        Ok(())
    }

    /// A change token: a number that changes when another connection commits
    /// (SQLite's `PRAGMA data_version`; on PostgreSQL the server's WAL insert
    /// position, which moves with every commit that wrote anything).
    pub fn data_version(&self) -> Result<i64, StoreError> {
        match &self.conn {
            Conn::Lite(conn) => Ok(conn.query_row("PRAGMA data_version", [], |r| r.get(0))?),
            Conn::Pg(pg) => pg::data_version(pg),
        }
    }
}

/// What a transaction may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Read,
    Write,
    /// A write whose commit need not wait for the disk ([`Store::write_relaxed`]).
    WriteRelaxed,
}

fn migrate_sqlite(conn: &mut Connection, from: i64) -> Result<(), StoreError> {
    if from < 0 {
        return Err(StoreError::NotToolgate);
    }
    if from == 0 {
        // A non-empty file with user_version 0 is someone else's database.
        let tables: i64 = conn.query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
            [],
            |r| r.get(0),
        )?;
        if tables > 0 {
            return Err(StoreError::NotToolgate);
        }
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(from as usize) {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        // Re-check under the write lock: another process may have migrated.
        let now: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if now > i as i64 {
            tx.commit()?;
            continue;
        }
        // A failure rolls the migration back whole (the transaction drops).
        tx.execute_batch(sql).map_err(|e| match StoreError::from(e) {
            StoreError::Other(reason) | StoreError::Constraint(reason) => {
                StoreError::Migration { number: i + 1, found: from, reason }
            }
            other => other,
        })?;
        tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))?;
        tx.commit()?;
    }
    Ok(())
}

/// One SQLite transaction: `BEGIN IMMEDIATE` (busy retried) or `BEGIN
/// DEFERRED`, `f`, then `COMMIT`, or `ROLLBACK` when `f` fails, panics or the
/// commit fails. The three statements are prepared once per connection
/// (rusqlite's `Transaction` re-parses them on every call).
fn lite_transaction<T, E: From<StoreError>>(
    conn: &Connection,
    neutral: &Conn,
    immediate: bool,
    mut f: impl FnMut(&Tx<'_>) -> Result<T, E>,
) -> Result<T, E> {
    let begin = if immediate { "BEGIN IMMEDIATE" } else { "BEGIN DEFERRED" };
    let started = Instant::now();
    loop {
        match conn.prepare_cached(begin).and_then(|mut st| st.execute([])) {
            Ok(_) => break,
            Err(rusqlite::Error::SqliteFailure(f, _))
                if immediate
                    && matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                    && started.elapsed() < BEGIN_RETRY_BUDGET =>
            {
                std::thread::sleep(Duration::from_millis(1 + rand::random::<u64>() % 10));
            }
            Err(e) => return Err(StoreError::from(e).into()),
        }
    }
    let open = OpenTransaction { conn };
    let out = f(&Tx { conn: neutral })?;
    conn.prepare_cached("COMMIT").and_then(|mut st| st.execute([])).map_err(StoreError::from)?;
    drop(open);
    Ok(out)
}

/// Rolls back on drop whatever is still open: `f` failed or panicked, or the
/// commit failed. After a commit the connection is in autocommit: nothing to do.
struct OpenTransaction<'a> {
    conn: &'a Connection,
}

impl Drop for OpenTransaction<'_> {
    fn drop(&mut self) {
        if !self.conn.is_autocommit() {
            let _ = self.conn.prepare_cached("ROLLBACK").and_then(|mut st| st.execute([]));
        }
    }
}

type R<T> = Result<T, StoreError>;

/// The result of an optimistic version check (a write fenced on the version,
/// or on the state, the caller read). It must be handled before any other
/// write of the same step: a step that records a refusal checks first, so
/// the refusal leaves nothing else changed; a step that cannot continue
/// returns [`Versioned::or_stale`]'s error, which rolls the whole step back.
#[must_use = "a version check must be handled before any other write of the step"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Versioned {
    /// The row was as read: the write applied.
    Applied,
    /// The row changed since it was read: nothing was written.
    Stale,
}

impl Versioned {
    /// Whether the row changed since it was read (and nothing was written).
    pub fn is_stale(self) -> bool {
        self == Versioned::Stale
    }

    /// `Stale` as an error that rolls the step back (a concurrent writer won;
    /// the caller runs the command again).
    pub fn or_stale(self) -> R<()> {
        match self {
            Versioned::Applied => Ok(()),
            Versioned::Stale => Err(StoreError::Conflict),
        }
    }
}

/// What [`Tx::outbox_for_claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForClaim {
    /// The row, locked for this transaction.
    Row(OutboxRow),
    /// Another transaction (a claim on another host) holds it right now.
    Busy,
    /// No outbox row.
    Missing,
}

/// Typed queries inside one transaction, on either backend.
pub struct Tx<'a> {
    conn: &'a Conn,
}

/// Who a worker's own status queries are logged as (`downstream.auto_query`):
/// not a person, so they never keep an operation from the retention purge.
pub const SETTLE_ACTOR: &str = "toolgate-settle";

impl Tx<'_> {
    /// Which backend this transaction runs on.
    pub fn backend(&self) -> Backend {
        self.conn.backend()
    }

    /// SQL condition on an audit-log row `a`: it records a person's act.
    /// Everything but a caller's own status query, whose actor is the caller's
    /// principal reference (`pr_` + 16 hex digits, a shape operator names may
    /// not take), and a worker's own ([`SETTLE_ACTOR`], `downstream.auto_query`;
    /// a unit test checks the text below names it).
    fn by_a_person(&self) -> &'static str {
        by_a_person(self.backend())
    }
}

/// [`Tx::by_a_person`] for a backend.
fn by_a_person(backend: Backend) -> &'static str {
    match backend {
        Backend::Sqlite => {
            "NOT (a.action = 'query' AND (a.actor = 'toolgate-settle' OR (length(a.actor) = 19 AND a.actor GLOB 'pr_[0-9a-f][0-9a-f][0-9a-f][0-9a-f]*')))"
        }
        Backend::Postgres => {
            "NOT (a.action = 'query' AND (a.actor = 'toolgate-settle' OR (length(a.actor) = 19 AND a.actor ~ '^pr_[0-9a-f]{4}')))"
        }
    }
}

// The typed queries, one module per aggregate: world.rs, ops.rs, trace.rs,
// approvals.rs, audit.rs (and views.rs, resilience.rs, tokens.rs).

// ---------------------------------------------------------- observability
//
// Metrics read the trace rollups plus a few small reads of the ledger's own
// state. Nothing here scans the whole trace. On SQLite the rollups are folded
// in batches (migration 0012, `Tx::fold_rollups`) and every read adds the
// unfolded tail (at most `FOLD_EVERY` events, read by rowid range) to them; on
// PostgreSQL a trigger keeps them in the transaction of each trace insert,
// each series split into slots (migration pg/0004, so that concurrent writers
// never update one row), and every read adds the slots up, which on SQLite's
// one row per series reads the same.

const METRIC_SERIES: &str =
    "answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason";
const METRIC_SUMS: &str = "CAST(sum(events) AS BIGINT), CAST(sum(latency_sum_us) AS BIGINT)";
const LATENCY_SERIES: &str = "answer, tool, tenant_ref, tool_version, bucket_us";

/// A metric series' dimensions (METRIC_SERIES), as a fold counts them: the
/// ten texts, interned (`Interner`).
type Series = [usize; 10];
/// A latency bucket's dimensions (LATENCY_SERIES): four interned texts and
/// the bucket's upper bound.
type Bucket = ([usize; 4], i64);

/// The distinct texts of one fold, each stored once and named by its index.
#[derive(Default)]
struct Interner {
    ids: HashMap<String, usize>,
    texts: Vec<String>,
    /// The last id of each series column: consecutive events mostly repeat
    /// a column's text, and comparing with it costs a tenth of a hash lookup.
    last: Series,
}

impl Interner {
    /// The id of `text` in series column `col`.
    fn id_in(&mut self, col: usize, text: &str) -> usize {
        if let Some(&last) = self.last.get(col).filter(|&&l| self.texts.get(l).is_some_and(|t| t == text)) {
            return last;
        }
        let id = self.id(text);
        if let Some(l) = self.last.get_mut(col) {
            *l = id;
        }
        id
    }

    fn id(&mut self, text: &str) -> usize {
        if let Some(&id) = self.ids.get(text) {
            return id;
        }
        let id = self.texts.len();
        self.texts.push(text.to_string());
        self.ids.insert(text.to_string(), id);
        id
    }

    fn text(&self, id: usize) -> &str {
        self.texts.get(id).map_or("", String::as_str)
    }
}

/// SQLite folds the trace into the rollups when an event's `seq` is a
/// multiple of this: the unfolded tail never holds more events than this
/// (plus those of the transaction that is folding).
pub const FOLD_EVERY: i64 = 256;

/// The rollup rule of migrations 0002 and 0006, one row per trace event,
/// in the rollups' columns (absent dimensions are ''), plus the latency
/// bucket and whether the event answers a call (the latency histograms count
/// those with a bucket). A caller appends its `WHERE` on `seq`.
const TRACE_AS_ROLLUP: &str = "SELECT at / 60000 AS minute, coalesce(answer, '') AS answer, step,
        coalesce(tool, '') AS tool, coalesce(tenant_ref, '') AS tenant_ref, coalesce(tool_version, '') AS tool_version,
        coalesce(code, '') AS code, coalesce(outcome, '') AS outcome, coalesce(delivery, '') AS delivery,
        coalesce(timeout_stage, '') AS timeout_stage, coalesce(reason, '') AS reason,
        1 AS events, coalesce(latency_us, 0) AS latency_sum_us,
        latency_bucket_us AS bucket_us, 1 AS count, answer IS NOT NULL AS answered
    FROM trace_events";
/// Of TRACE_AS_ROLLUP's rows, those the latency histograms count.
const LATENCY_COUNTED: &str = "answered AND bucket_us IS NOT NULL";

impl Tx<'_> {
    /// The rows of a rollup table as readers must see them: on SQLite the
    /// table plus the unfolded tail of the trace (`cols` are the columns to
    /// take, `counted` which tail rows the table counts); on PostgreSQL the
    /// table.
    fn rollup_rows(&self, table: &str, cols: &str, counted: &str) -> String {
        match self.backend() {
            Backend::Postgres => table.to_string(),
            Backend::Sqlite => format!(
                "(SELECT {cols} FROM {table} UNION ALL SELECT {cols} FROM
                  ({TRACE_AS_ROLLUP} WHERE seq > (SELECT folded_seq FROM rollup_mark)) WHERE {counted})"
            ),
        }
    }

    /// Folds the trace events past the fold mark into the rollups and moves the
    /// mark (SQLite; PostgreSQL's trigger keeps its rollups current). Runs in
    /// the caller's write transaction, so the events and their counts commit
    /// or roll back together; folding twice counts nothing twice.
    ///
    /// The tail is read once and counted here, then each series is upserted
    /// once: an SQL `GROUP BY` over ten text columns per rollup table cost
    /// about ten times as much (callgrind; ARCHITECTURE.md).
    pub fn fold_rollups(&self) -> R<()> {
        if self.backend() != Backend::Sqlite {
            return Ok(());
        }
        let (from, to): (i64, i64) = self
            .conn
            .prepare_cached("SELECT folded_seq, (SELECT coalesce(max(seq), 0) FROM trace_events) FROM rollup_mark")?
            .query_row((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        if to <= from {
            return Ok(());
        }
        // Counted by interned text: a tail of a few hundred events repeats a
        // handful of series, so each distinct text is copied once, not ten
        // texts per event (that copy was half the fold's cost, callgrind).
        let mut texts = Interner::default();
        let mut minutes: BTreeMap<(i64, Series), (i64, i64)> = BTreeMap::new();
        let mut buckets: BTreeMap<(i64, Bucket), i64> = BTreeMap::new();
        let mut st = self.conn.prepare_cached(sql_text!(
            "SELECT minute, {METRIC_SERIES}, events, latency_sum_us, bucket_us, answered
             FROM ({TRACE_AS_ROLLUP} WHERE seq > ?1 AND seq <= ?2)"
        ))?;
        for row in st.query_map(params![from, to], |r| {
            let mut series: Series = [0; 10];
            for (i, id) in series.iter_mut().enumerate() {
                *id = texts.id_in(i, r.str_ref(i + 1)?.unwrap_or_default());
            }
            let minute = r.get::<Option<i64>>(0)?.unwrap_or_default();
            let sums = (r.get::<i64>(11)?, r.get::<i64>(12)?);
            Ok((minute, series, sums, r.get::<Option<i64>>(13)?, r.get::<i64>(14)? != 0))
        })? {
            let (minute, s, (events, latency), bucket, has_answer) = row?;
            if let (true, Some(b)) = (has_answer, bucket) {
                *buckets.entry((minute, ([s[0], s[2], s[3], s[4]], b))).or_default() += 1;
            }
            let sums = minutes.entry((minute, s)).or_default();
            sums.0 += events;
            sums.1 += latency;
        }
        drop(st);
        let t = |i: usize| texts.text(i);
        let upsert_minute = format!(
            "INSERT INTO metric_minutes (minute, {METRIC_SERIES}, events, latency_sum_us)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
             ON CONFLICT DO UPDATE SET events = events + excluded.events,
                 latency_sum_us = latency_sum_us + excluded.latency_sum_us"
        );
        let mut totals: BTreeMap<&Series, (i64, i64)> = BTreeMap::new();
        for ((minute, s), (events, latency)) in &minutes {
            self.conn.prepare_cached(&upsert_minute)?.execute(params![
                minute,
                t(s[0]),
                t(s[1]),
                t(s[2]),
                t(s[3]),
                t(s[4]),
                t(s[5]),
                t(s[6]),
                t(s[7]),
                t(s[8]),
                t(s[9]),
                events,
                latency
            ])?;
            let t = totals.entry(s).or_default();
            t.0 += events;
            t.1 += latency;
        }
        let upsert_total = format!(
            "INSERT INTO metric_totals ({METRIC_SERIES}, events, latency_sum_us)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)
             ON CONFLICT DO UPDATE SET events = events + excluded.events,
                 latency_sum_us = latency_sum_us + excluded.latency_sum_us"
        );
        for (s, (events, latency)) in totals {
            self.conn.prepare_cached(&upsert_total)?.execute(params![
                t(s[0]),
                t(s[1]),
                t(s[2]),
                t(s[3]),
                t(s[4]),
                t(s[5]),
                t(s[6]),
                t(s[7]),
                t(s[8]),
                t(s[9]),
                events,
                latency
            ])?;
        }
        let upsert_bucket_minute = format!(
            "INSERT INTO latency_minutes (minute, {LATENCY_SERIES}, count) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT DO UPDATE SET count = count + excluded.count"
        );
        let mut bucket_totals: BTreeMap<&Bucket, i64> = BTreeMap::new();
        for ((minute, b), count) in &buckets {
            let (s, upper) = b;
            self.conn.prepare_cached(&upsert_bucket_minute)?.execute(params![
                minute,
                t(s[0]),
                t(s[1]),
                t(s[2]),
                t(s[3]),
                upper,
                count
            ])?;
            *bucket_totals.entry(b).or_default() += count;
        }
        let upsert_bucket_total = format!(
            "INSERT INTO latency_totals ({LATENCY_SERIES}, count) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT DO UPDATE SET count = count + excluded.count"
        );
        for ((s, upper), count) in bucket_totals {
            self.conn.prepare_cached(&upsert_bucket_total)?.execute(params![
                t(s[0]),
                t(s[1]),
                t(s[2]),
                t(s[3]),
                upper,
                count
            ])?;
        }
        self.conn.prepare_cached("UPDATE rollup_mark SET folded_seq = ?1")?.execute([to])?;
        Ok(())
    }

    /// All-time event counts, one row per series.
    pub fn metric_totals(&self) -> R<Vec<MetricRow>> {
        let rows = self.rollup_rows("metric_totals", &format!("{METRIC_SERIES}, events, latency_sum_us"), "true");
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT CAST(NULL AS BIGINT), {METRIC_SERIES}, {METRIC_SUMS} FROM {rows} r GROUP BY {METRIC_SERIES}"
        ))?;
        let rows = st.query_map((), MetricRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Per-minute event counts for minutes in `[from_minute, to_minute)`.
    pub fn metric_minutes(&self, from_minute: i64, to_minute: i64) -> R<Vec<MetricRow>> {
        let rows =
            self.rollup_rows("metric_minutes", &format!("minute, {METRIC_SERIES}, events, latency_sum_us"), "true");
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT minute, {METRIC_SERIES}, {METRIC_SUMS} FROM {rows} r WHERE minute >= ?1 AND minute < ?2
             GROUP BY minute, {METRIC_SERIES} ORDER BY minute"
        ))?;
        let rows = st.query_map(params![from_minute, to_minute], MetricRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The all-time latency histogram of answered calls.
    pub fn latency_totals(&self) -> R<Vec<LatencyRow>> {
        let rows = self.rollup_rows("latency_totals", &format!("{LATENCY_SERIES}, count"), LATENCY_COUNTED);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT CAST(NULL AS BIGINT), {LATENCY_SERIES}, CAST(sum(count) AS BIGINT) FROM {rows} r
             GROUP BY {LATENCY_SERIES}"
        ))?;
        let rows = st.query_map((), LatencyRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The latency histogram of calls answered in minutes `[from_minute, to_minute)`.
    pub fn latency_minutes(&self, from_minute: i64, to_minute: i64) -> R<Vec<LatencyRow>> {
        let rows = self.rollup_rows("latency_minutes", &format!("minute, {LATENCY_SERIES}, count"), LATENCY_COUNTED);
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT minute, {LATENCY_SERIES}, CAST(sum(count) AS BIGINT) FROM {rows} r
             WHERE minute >= ?1 AND minute < ?2 GROUP BY minute, {LATENCY_SERIES}"
        ))?;
        let rows = st.query_map(params![from_minute, to_minute], LatencyRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// How many trace events, all time, carry this decision reason (read from
    /// the rollups and the unfolded tail, never the whole trace).
    pub fn trace_reason_total(&self, reason: Reason) -> R<i64> {
        let rows = self.rollup_rows("metric_totals", "reason, events", "true");
        self.conn
            .prepare_cached(&format!(
                "SELECT CAST(coalesce(sum(events), 0) AS BIGINT) FROM {rows} r WHERE reason = ?1"
            ))?
            .query_row([reason.as_str()], |r| r.get(0))
    }

    /// Non-terminal operations per state, tool, tenant and contract revisions,
    /// with the oldest one's creation time (served by the `operations_state` index).
    pub fn open_operations(&self) -> R<Vec<OpenOperationsRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT state, tool, tenant, input_rev || '.' || output_rev || '.' || effect_rev, count(*), min(created_at)
             FROM operations WHERE state IN ('accepted', 'in_flight', 'unknown', 'needs_review')
             GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4",
        )?;
        let rows = st.query_map((), |r| {
            Ok(OpenOperationsRow {
                state: r.get(0)?,
                tool: r.get(1)?,
                tenant: r.get(2)?,
                tool_version: r.get(3)?,
                count: r.get(4)?,
                oldest_created_at: r.get(5)?,
            })
        })?;
        rows.collect::<Result<_, _>>()
    }

    /// Approval requests per tool, tenant and effective state: a pending request
    /// whose expiry has passed (`now >= expires_at`, exclusive) counts as `expired`.
    pub fn approval_states(&self, now: i64) -> R<Vec<ApprovalStateRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT tool, tenant, CASE WHEN state = 'pending' AND expires_at <= ?1 THEN 'expired' ELSE state END, count(*)
             FROM approvals GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
        )?;
        let rows = st.query_map([now], |r| {
            Ok(ApprovalStateRow { tool: r.get(0)?, tenant: r.get(1)?, state: r.get(2)?, count: r.get(3)? })
        })?;
        rows.collect::<Result<_, _>>()
    }

    /// Deletes per-minute rollups older than `before_minute` (the all-time totals stay).
    pub fn prune_metric_minutes(&self, before_minute: i64) -> R<usize> {
        let a = self.conn.prepare_cached("DELETE FROM metric_minutes WHERE minute < ?1")?.execute([before_minute])?;
        let b = self.conn.prepare_cached("DELETE FROM latency_minutes WHERE minute < ?1")?.execute([before_minute])?;
        Ok(a + b)
    }
}

#[cfg(test)]
mod person_tests {
    use super::{by_a_person, Backend, SETTLE_ACTOR};

    #[test]
    fn a_workers_own_query_is_not_a_persons_act_on_either_backend() {
        for b in [Backend::Sqlite, Backend::Postgres] {
            assert!(by_a_person(b).contains(&format!("a.actor = '{SETTLE_ACTOR}'")), "{b:?}");
        }
    }
}

#[cfg(test)]
mod error_tests {
    use super::StoreError;
    use crate::Coded;

    fn check(code: std::ffi::c_int, expect: &str) {
        let e = rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), Some("detail".into()));
        assert_eq!(StoreError::from(e).code(), expect);
    }

    #[test]
    fn sqlite_failures_map_to_stable_codes() {
        check(rusqlite::ffi::SQLITE_FULL, "DISK_FULL");
        check(rusqlite::ffi::SQLITE_READONLY, "DB_READ_ONLY");
        check(rusqlite::ffi::SQLITE_BUSY, "DB_BUSY");
        check(rusqlite::ffi::SQLITE_NOTADB, "DB_NOT_TOOLGATE");
        check(rusqlite::ffi::SQLITE_CONSTRAINT, "DB_CONSTRAINT");
        check(rusqlite::ffi::SQLITE_ERROR, "DB_ERROR");
    }

    #[test]
    fn an_error_never_carries_the_sql_text() {
        let e = rusqlite::Error::SqlInputError {
            error: rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
            msg: "near \"x\": syntax error".into(),
            sql: "SELECT secret FROM t".into(),
            offset: 7,
        };
        assert!(!StoreError::from(e).to_string().contains("SELECT"));
    }
}
