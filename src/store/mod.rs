//! Storage: connection set-up, embedded migrations and typed queries, on an
//! embedded SQLite file or a PostgreSQL server.
//!
//! **This is the only module with SQL.** The engine sees [`Store`] (open, run a
//! transaction) and [`Tx`] (typed reads and writes inside one transaction).
//! Every query is written once against [`sql`]'s neutral statement API and runs
//! on either backend; a `--db` value that is a `postgres://` or
//! `postgresql://` URL selects PostgreSQL, anything else is a SQLite path.

pub mod bench;
mod group;
mod pg;
mod provider;
mod resilience;
#[macro_use]
mod rows;
pub(crate) mod sql;
mod states;
mod tokens;
mod views;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

pub use pg::ScratchDatabase;
pub use provider::{ProviderStore, ProviderTx};
pub use resilience::{CircuitRow, RateLimitedRow, RetryBudgetRow, MILLI_TOKEN};
pub use rows::*;
pub use sql::Backend;
use sql::{params, Conn};
pub use states::{ApprovalState, AttemptOutcome, OpState, OutboxState};
pub use tokens::TokenRow;
pub use views::{
    cursor_after, Cursor, Filter, FilterTarget, Key, LiveRow, OpsView, Order, SortColumn, APPROVALS_SORT, AUDIT_SORT,
    LIVE_SORT, OPS_SORT,
};

/// Migrations, in order. The schema version is the number applied (`PRAGMA user_version`).
const MIGRATIONS: [&str; 11] = [
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

impl StoreError {
    /// Stable code for the CLI.
    pub fn code(&self) -> &'static str {
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
            Location::Postgres(url) => url.parse::<postgres::Config>().map_or_else(
                |_| "postgres".into(),
                |c| {
                    let host = match c.get_hosts().first() {
                        Some(postgres::config::Host::Tcp(h)) => h.clone(),
                        Some(postgres::config::Host::Unix(p)) => p.display().to_string(),
                        None => "localhost".into(),
                    };
                    format!("postgres {host}/{}", c.get_dbname().unwrap_or("postgres"))
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
/// made the slowest calls wait seconds. On SQLite the FULL writers that queue
/// together share one commit (group commit, `group.rs`); other processes still
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

fn open_error(e: &rusqlite::Error) -> StoreError {
    // rusqlite's messages for open failures do not include the path; keep only the
    // SQLite description.
    match e {
        rusqlite::Error::SqliteFailure(err, _) => StoreError::Open(err.to_string()),
        other => StoreError::Open(other.to_string()),
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
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
        let conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(&e))?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
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
        let mut flags = if read_only { OpenFlags::SQLITE_OPEN_READ_ONLY } else { OpenFlags::SQLITE_OPEN_READ_WRITE }
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI;
        if opts.create && !read_only {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
        }
        let conn = Connection::open_with_flags(path, flags).map_err(|e| open_error(&e))?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        conn.query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0)).map_err(|e| match e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::NotADatabase => {
                StoreError::NotToolgate
            }
            other => open_error(&other),
        })?;
        if !read_only {
            let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
            if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
                return Err(StoreError::Open(format!("could not enable WAL (journal_mode={mode})")));
            }
            conn.execute_batch(match opts.sync {
                Sync::Full => "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;",
                Sync::Normal => "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;",
            })?;
        }
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
        Self::setup(conn, opts.sync, writer_lock(path))
    }

    fn setup(conn: Connection, sync: Sync, writer: Arc<group::Writer>) -> Result<Self, StoreError> {
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
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
            return Err(StoreError::Open(format!("could not enable WAL (journal_mode={mode})")));
        }
        conn.execute_batch(match sync {
            Sync::Full => "PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;",
            Sync::Normal => "PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;",
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
                Conn::Pg(pg) => pg::transaction(pg, &self.conn, mode, f),
            };
        }
        // A FULL write on SQLite joins the batch of the writers queued with it.
        let synced = mode == Mode::Write && self.sync == Sync::Full && !self.relaxed;
        if synced && !self.read_only && self.writer.groups() && matches!(self.conn, Conn::Lite(_)) {
            return self.writer.write(f);
        }
        let writer = Arc::clone(&self.writer);
        let _alone = writer.alone();
        let out = match &self.conn {
            Conn::Lite(conn) => lite_transaction(conn, &self.conn, true, f),
            Conn::Pg(pg) => pg::transaction(pg, &self.conn, mode, f),
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

impl Tx<'_> {
    /// Which backend this transaction runs on.
    pub fn backend(&self) -> Backend {
        self.conn.backend()
    }

    /// SQL condition on an audit-log row `a`: it records a person's act.
    /// Everything but a caller's own status query, whose actor is the caller's
    /// principal reference (`pr_` + 16 hex digits, a shape operator names may
    /// not take).
    fn by_a_person(&self) -> &'static str {
        match self.backend() {
            Backend::Sqlite => {
                "NOT (a.action = 'query' AND length(a.actor) = 19 AND a.actor GLOB 'pr_[0-9a-f][0-9a-f][0-9a-f][0-9a-f]*')"
            }
            Backend::Postgres => "NOT (a.action = 'query' AND length(a.actor) = 19 AND a.actor ~ '^pr_[0-9a-f]{4}')",
        }
    }
}

impl Tx<'_> {
    // ---------------------------------------------------------------- meta

    /// A meta value.
    pub fn meta(&self, key: &str) -> R<Option<String>> {
        self.conn.prepare_cached("SELECT value FROM meta WHERE key = ?1")?.query_opt([key], |r| r.get(0))
    }

    /// Sets a meta value if absent; returns the stored value.
    pub fn meta_init(&self, key: &str, value: &str) -> R<String> {
        self.conn
            .prepare_cached("INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO NOTHING")?
            .execute([key, value])?;
        Ok(self.meta(key)?.unwrap_or_default())
    }

    /// Sets a meta value.
    pub fn meta_set(&self, key: &str, value: &str) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO meta (key, value) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            )?
            .execute([key, value])?;
        Ok(())
    }

    // --------------------------------------------------------------- world

    /// Inserts a tenant.
    pub fn insert_tenant(&self, id: &str, threshold: i64) -> R<()> {
        self.conn
            .prepare_cached("INSERT INTO tenants (id, approval_threshold_minor) VALUES (?1, ?2)")?
            .execute(params![id, threshold])?;
        Ok(())
    }

    /// Adds an approver to a tenant's allowlist.
    pub fn insert_approver(&self, tenant: &str, approver: &str) -> R<()> {
        self.conn
            .prepare_cached("INSERT INTO approvers (tenant, approver) VALUES (?1, ?2)")?
            .execute([tenant, approver])?;
        Ok(())
    }

    /// Inserts a subject.
    pub fn insert_subject(&self, id: &str, tenant: &str) -> R<()> {
        self.conn.prepare_cached("INSERT INTO subjects (id, tenant) VALUES (?1, ?2)")?.execute([id, tenant])?;
        Ok(())
    }

    /// Grants a tool (re-granting clears `revoked_at`). Returns whether anything changed.
    pub fn grant(&self, tenant: &str, subject: &str, tool: &str, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached(
                "INSERT INTO grants (tenant, subject, tool, granted_at) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (tenant, subject, tool) DO UPDATE SET granted_at = excluded.granted_at, revoked_at = NULL
                 WHERE grants.revoked_at IS NOT NULL",
            )?
            .execute(params![tenant, subject, tool, now])?;
        Ok(n > 0)
    }

    /// Revokes a grant. Returns whether an active grant was revoked.
    pub fn revoke(&self, tenant: &str, subject: &str, tool: &str, now: i64) -> R<bool> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE grants SET revoked_at = ?4 WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND revoked_at IS NULL",
            )?
            .execute(params![tenant, subject, tool, now])?;
        Ok(n > 0)
    }

    /// Inserts an order.
    pub fn insert_order(&self, o: &OrderRow) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO orders (order_ref, tenant, owner, currency, captured_minor, refunded_minor, status, revision)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                o.order_ref,
                o.tenant,
                o.owner,
                o.currency,
                o.captured_minor,
                o.refunded_minor,
                o.status,
                o.revision
            ])?;
        Ok(())
    }

    /// The tenant a subject acts for.
    pub fn subject_tenant(&self, subject: &str) -> R<Option<String>> {
        self.conn.prepare_cached("SELECT tenant FROM subjects WHERE id = ?1")?.query_opt([subject], |r| r.get(0))
    }

    /// Whether an unrevoked grant exists (read now, never cached).
    pub fn grant_active(&self, tenant: &str, subject: &str, tool: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT 1 FROM grants g JOIN subjects s ON s.id = g.subject AND s.tenant = g.tenant
                 WHERE g.tenant = ?1 AND g.subject = ?2 AND g.tool = ?3 AND g.revoked_at IS NULL",
            )?
            .query_opt([tenant, subject, tool], |_| Ok(()))?
            .is_some())
    }

    /// A tenant.
    pub fn tenant(&self, id: &str) -> R<Option<TenantRow>> {
        self.conn
            .prepare_cached("SELECT id, approval_threshold_minor, policy_revision FROM tenants WHERE id = ?1")?
            .query_opt([id], |r| {
                Ok(TenantRow { id: r.get(0)?, approval_threshold_minor: r.get(1)?, policy_revision: r.get(2)? })
            })
    }

    /// Bumps a tenant's policy revision (invalidates pending approvals).
    pub fn bump_policy_revision(&self, tenant: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached("UPDATE tenants SET policy_revision = policy_revision + 1 WHERE id = ?1")?
            .execute([tenant])?
            > 0)
    }

    /// Whether `approver` is on the tenant's allowlist.
    pub fn is_approver(&self, tenant: &str, approver: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached("SELECT 1 FROM approvers WHERE tenant = ?1 AND approver = ?2")?
            .query_opt([tenant, approver], |_| Ok(()))?
            .is_some())
    }

    /// An order.
    pub fn order(&self, order_ref: &str) -> R<Option<OrderRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {ORDER_COLS} FROM orders WHERE order_ref = ?1"))?
            .query_opt([order_ref], OrderRow::from_row)
    }

    /// All orders, in order_ref order.
    pub fn orders(&self) -> R<Vec<OrderRow>> {
        let mut st = self.conn.prepare_cached(&format!("SELECT {ORDER_COLS} FROM orders ORDER BY order_ref"))?;
        let rows = st.query_map((), OrderRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Applies a committed refund to an order.
    pub fn apply_refund(&self, order_ref: &str, amount: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE orders SET refunded_minor = CASE WHEN refunded_minor + ?2 > captured_minor THEN captured_minor
                                           ELSE refunded_minor + ?2 END,
                   status = CASE WHEN refunded_minor + ?2 >= captured_minor THEN 'refunded' ELSE 'partially_refunded' END,
                   revision = revision + 1
                 WHERE order_ref = ?1",
            )?
            .execute(params![order_ref, amount])?;
        Ok(())
    }

    // ------------------------------------------------------ call identities

    /// A call identity's binding.
    pub fn call_identity(&self, k: &CallKey<'_>) -> R<Option<CallIdentityRow>> {
        self
            .conn
            .prepare_cached(
                "SELECT purpose, request_sha256, key_sha256, operation_id FROM call_identities
                 WHERE tenant = ?1 AND subject = ?2 AND provider = ?3 AND api_family = ?4 AND response_id = ?5 AND call_id = ?6",
            )?
            .query_opt(params![k.tenant, k.subject, k.provider, k.api_family, k.response_id, k.call_id], |r| {
                Ok(CallIdentityRow {
                    purpose: r.get(0)?,
                    request_sha256: r.get(1)?,
                    key_sha256: r.get(2)?,
                    operation_id: r.get(3)?,
                })
            })
    }

    /// Binds a call identity on first use (no-op if already bound).
    pub fn bind_call_identity(&self, k: &CallKey<'_>, row: &CallIdentityRow, now: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO call_identities
                   (tenant, subject, provider, api_family, response_id, call_id, purpose, request_sha256, key_sha256, operation_id, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
                 ON CONFLICT (tenant, subject, provider, api_family, response_id, call_id)
                 DO UPDATE SET operation_id = coalesce(call_identities.operation_id, excluded.operation_id)",
            )?
            .execute(params![
                k.tenant,
                k.subject,
                k.provider,
                k.api_family,
                k.response_id,
                k.call_id,
                row.purpose,
                row.request_sha256,
                row.key_sha256,
                row.operation_id,
                now
            ])?;
        Ok(())
    }

    // ----------------------------------------------------------- operations

    /// The operation for a scope.
    pub fn operation_by_scope(&self, tenant: &str, subject: &str, tool: &str, key: &str) -> R<Option<OperationRow>> {
        self.conn
            .prepare_cached(&format!(
                "SELECT {OP_COLS} FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4"
            ))?
            .query_opt([tenant, subject, tool, key], OperationRow::from_row)
    }

    /// The state of the operation for a scope (no row: `None`).
    pub fn operation_state_by_scope(&self, tenant: &str, subject: &str, tool: &str, key: &str) -> R<Option<String>> {
        self.conn
            .prepare_cached(
                "SELECT state FROM operations WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4",
            )?
            .query_opt([tenant, subject, tool, key], |r| r.get(0))
    }

    /// An operation by id.
    pub fn operation(&self, id: &str) -> R<Option<OperationRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {OP_COLS} FROM operations WHERE id = ?1"))?
            .query_opt([id], OperationRow::from_row)
    }

    /// An operation by status_ref.
    pub fn operation_by_status_ref(&self, status_ref: &str) -> R<Option<OperationRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {OP_COLS} FROM operations WHERE status_ref = ?1"))?
            .query_opt([status_ref], OperationRow::from_row)
    }

    /// Inserts a new operation (unique scope enforced by the schema).
    pub fn insert_operation(&self, o: &OperationRow) -> R<()> {
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO operations ({OP_COLS}) VALUES ({})",
                placeholders(OperationRow::WIDTH)
            ))?
            .execute(o.params().as_slice())?;
        Ok(())
    }

    /// Writes back an operation, checking and bumping its version (optimistic
    /// fence: refused when the row changed since it was read). Returns false when
    /// the version did not match.
    pub fn update_operation(&self, o: &OperationRow) -> R<Versioned> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE operations SET state = ?2, code = ?3, result_json = ?4, result_sha256 = ?5,
                   downstream_request_id = ?6, receipt_id = ?7, call_binding_sha256 = ?8, approval_id = ?9,
                   resolution = ?10, resolution_note = ?11, resolved_by = ?12, last_query_at = ?13,
                   last_query_result = ?14, updated_at = ?15, deadline_at = ?16, version = version + 1,
                   -- Retention counts from the moment the operation becomes terminal.
                   state_since = CASE WHEN state IS DISTINCT FROM ?2 THEN ?15 ELSE state_since END,
                   terminal_at = CASE WHEN ?2 IN ('succeeded', 'failed', 'resolved')
                                      THEN coalesce(terminal_at, ?15) END,
                   expires_at = CASE WHEN ?2 IN ('succeeded', 'failed', 'resolved') AND terminal_at IS NULL
                                     THEN ?15 + retention_ms ELSE expires_at END
                 WHERE id = ?1 AND version = ?17",
            )?
            .execute(params![
                o.id,
                o.state,
                o.code,
                o.result_json,
                o.result_sha256,
                o.downstream_request_id,
                o.receipt_id,
                o.call_binding_sha256,
                o.approval_id,
                o.resolution,
                o.resolution_note,
                o.resolved_by,
                o.last_query_at,
                o.last_query_result,
                o.updated_at,
                o.deadline_at,
                o.version
            ])?;
        Ok(if n == 1 { Versioned::Applied } else { Versioned::Stale })
    }

    /// Operations, newest first, optionally by state, keyset-paged by (updated_at, id).
    pub fn list_operations(
        &self,
        state: Option<OpState>,
        limit: i64,
        before: Option<(i64, &str)>,
    ) -> R<Vec<OperationRow>> {
        let (b_at, b_id) = before.map_or((i64::MAX, ""), |(a, i)| (a, i));
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {OP_COLS} FROM operations
             WHERE (CAST(?1 AS TEXT) IS NULL OR state = ?1) AND (updated_at < ?2 OR (updated_at = ?2 AND id < ?3) OR ?3 = '')
             ORDER BY updated_at DESC, id DESC LIMIT ?4"
        ))?;
        let rows = st.query_map(params![state, b_at, b_id, limit], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Every operation id (for the integrity audit).
    pub fn all_operations(&self) -> R<Vec<OperationRow>> {
        let mut st = self.conn.prepare_cached(&format!("SELECT {OP_COLS} FROM operations ORDER BY created_at, id"))?;
        let rows = st.query_map((), OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The operations under the same key string in other scopes (index
    /// `operations_key`): a new intent looks here for its own row when a hand
    /// edit moved that row out of its scope (tenant, subject or tool changed).
    pub fn operations_sharing_key(&self, tenant: &str, subject: &str, tool: &str, key: &str) -> R<Vec<OperationRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {OP_COLS} FROM operations
             WHERE idem_key = ?1 AND NOT (tenant = ?2 AND subject = ?3 AND tool = ?4) LIMIT 64"
        ))?;
        let rows = st.query_map(params![key, tenant, subject, tool], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operation counts per state.
    pub fn count_operations_by_state(&self) -> R<Vec<(String, i64)>> {
        let mut st =
            // Kept by triggers (migration 0003): constant time on any ledger size.
            self.conn.prepare_cached("SELECT state, n FROM state_counts WHERE n > 0 ORDER BY state")?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<_, _>>()
    }

    /// Terminal operations whose retention has passed (counted from the moment
    /// they became terminal) and that no person acted on (no audit-log entry,
    /// no approval): the only ones a purge may take. Oldest first, at most `limit`.
    pub fn purgeable_operations(&self, now: i64, limit: i64) -> R<Vec<OperationRow>> {
        let by_a_person = self.by_a_person();
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {OP_COLS} FROM operations o
             WHERE o.terminal_at IS NOT NULL AND o.expires_at <= ?1
               AND o.state IN ('succeeded', 'failed', 'resolved')
               AND o.approval_id IS NULL
               AND NOT EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND {by_a_person})
             ORDER BY o.expires_at, o.id LIMIT ?2"
        ))?;
        let rows = st.query_map(params![now, limit], OperationRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Terminal operations past their retention that are kept because a person
    /// acted on them (they stay as long as their audit entries, which are never deleted).
    pub fn count_kept_for_audit(&self, now: i64) -> R<i64> {
        let by_a_person = self.by_a_person();
        self.conn
            .prepare_cached(&format!(
                "SELECT count(*) FROM operations o
                 WHERE o.terminal_at IS NOT NULL AND o.expires_at <= ?1
                   AND (o.approval_id IS NOT NULL
                        OR EXISTS (SELECT 1 FROM audit_log a WHERE a.operation_id = o.id AND {by_a_person}))"
            ))?
            .query_row([now], |r| r.get(0))
    }

    /// Purges one operation: writes its tombstone, then deletes its attempts,
    /// outbox row, receipts, call-identity bindings and the row itself. Returns
    /// false (and changes nothing) when the row is gone or no longer purgeable.
    #[must_use = "a purge may find the row no longer purgeable"]
    pub fn purge_operation(&self, t: &TombstoneRow) -> R<bool> {
        let still: bool = self
            .conn
            .prepare_cached(
                "SELECT count(*) FROM operations WHERE id = ?1 AND terminal_at IS NOT NULL AND expires_at <= ?2
                   AND state IN ('succeeded', 'failed', 'resolved')",
            )?
            .query_row(params![t.operation_id, t.purged_at], |r| r.get::<i64>(0))?
            == 1;
        if !still {
            return Ok(false);
        }
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO purged_operations ({TOMBSTONE_COLS}) VALUES ({})",
                placeholders(TombstoneRow::WIDTH)
            ))?
            .execute(t.params().as_slice())?;
        for table in ["attempts", "outbox", "receipts", "call_identities"] {
            self.conn
                .prepare_cached(&format!("DELETE FROM {table} WHERE operation_id = ?1"))?
                .execute([&t.operation_id])?;
        }
        self.conn.prepare_cached("DELETE FROM operations WHERE id = ?1")?.execute([&t.operation_id])?;
        Ok(true)
    }

    /// The tombstone of a purged operation.
    pub fn tombstone(&self, operation_id: &str) -> R<Option<TombstoneRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {TOMBSTONE_COLS} FROM purged_operations WHERE operation_id = ?1"))?
            .query_opt([operation_id], TombstoneRow::from_row)
    }

    /// The newest tombstone of a scope, if its operation was purged.
    pub fn tombstone_by_scope(&self, scope_sha256: &str) -> R<Option<TombstoneRow>> {
        self.conn
            .prepare_cached(&format!(
                "SELECT {TOMBSTONE_COLS} FROM purged_operations WHERE scope_sha256 = ?1 ORDER BY purged_at DESC LIMIT 1"
            ))?
            .query_opt([scope_sha256], TombstoneRow::from_row)
    }

    // --------------------------------------------------------------- outbox

    /// Inserts the outbox row of a newly accepted operation.
    pub fn insert_outbox(&self, operation_id: &str, max_attempts: i64, available_at: i64) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO outbox (operation_id, state, attempt, max_attempts, available_at) VALUES (?1, 'pending', 0, ?2, ?3)",
            )?
            .execute(params![operation_id, max_attempts, available_at])?;
        Ok(())
    }

    /// An outbox row.
    pub fn outbox(&self, operation_id: &str) -> R<Option<OutboxRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {OUTBOX_COLS} FROM outbox WHERE operation_id = ?1"))?
            .query_opt([operation_id], OutboxRow::from_row)
    }

    /// The outbox row a claim is about to take, locked for this transaction. On
    /// PostgreSQL `FOR UPDATE SKIP LOCKED`: a row another host's claim holds
    /// right now is not waited for; it reads as [`ForClaim::Busy`] and the
    /// worker moves on (the queue pattern: claimers never queue behind each
    /// other). On SQLite the write lock is already held: never busy.
    pub fn outbox_for_claim(&self, operation_id: &str) -> R<ForClaim> {
        if self.backend() == Backend::Postgres {
            let locked = self
                .conn
                .prepare_cached(&format!(
                    "SELECT {OUTBOX_COLS} FROM outbox WHERE operation_id = ?1 FOR UPDATE SKIP LOCKED"
                ))?
                .query_opt([operation_id], OutboxRow::from_row)?;
            if let Some(row) = locked {
                return Ok(ForClaim::Row(row));
            }
        }
        Ok(match self.outbox(operation_id)? {
            Some(_) if self.backend() == Backend::Postgres => ForClaim::Busy,
            Some(row) => ForClaim::Row(row),
            None => ForClaim::Missing,
        })
    }

    /// Claims a pending, due outbox row with a lease; bumps the attempt. Returns the
    /// new attempt number, or `None` when someone else holds it or it is not due.
    #[must_use = "a claim may lose to another worker"]
    pub fn claim(&self, operation_id: &str, owner: &str, now: i64, lease_until: i64) -> R<Option<i64>> {
        let attempt: Option<i64> = self
            .conn
            .prepare_cached(
                "UPDATE outbox SET state = 'leased', attempt = attempt + 1, lease_owner = ?2, lease_until = ?4
                 WHERE operation_id = ?1 AND state = 'pending' AND available_at <= ?3
                 RETURNING attempt",
            )?
            .query_opt(params![operation_id, owner, now, lease_until], |r| r.get(0))?;
        if let Some(a) = attempt {
            self.conn
                .prepare_cached(
                    "INSERT INTO attempts (operation_id, attempt, owner, claimed_at) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![operation_id, a, owner, now])?;
        }
        Ok(attempt)
    }

    /// Whether (owner, attempt) still holds the lease: the fence for every write a
    /// worker makes about its attempt.
    #[must_use = "the fence decides whether the worker may write"]
    pub fn holds_lease(&self, operation_id: &str, owner: &str, attempt: i64) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT 1 FROM outbox WHERE operation_id = ?1 AND state = 'leased' AND lease_owner = ?2 AND attempt = ?3",
            )?
            .query_opt(params![operation_id, owner, attempt], |_| Ok(()))?
            .is_some())
    }

    /// The sent-marker, fenced on (owner, attempt). Returns false when the fence fails.
    #[must_use = "the fence decides whether the attempt may be sent"]
    pub fn mark_sent(&self, operation_id: &str, owner: &str, attempt: i64, now: i64) -> R<bool> {
        if !self.holds_lease(operation_id, owner, attempt)? {
            return Ok(false);
        }
        let n = self
            .conn
            .prepare_cached(
                "UPDATE attempts SET sent_at = ?3 WHERE operation_id = ?1 AND attempt = ?2 AND sent_at IS NULL AND owner = ?4",
            )?
            .execute(params![operation_id, attempt, now, owner])?;
        Ok(n == 1)
    }

    /// Puts an outbox row back to pending, due at `available_at`.
    pub fn release_outbox(&self, operation_id: &str, available_at: i64, last_code: Option<&str>) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE outbox SET state = 'pending', lease_owner = NULL, lease_until = NULL, available_at = ?2,
                   last_code = coalesce(?3, last_code) WHERE operation_id = ?1",
            )?
            .execute(params![operation_id, available_at, last_code])?;
        Ok(())
    }

    /// Ends an outbox row: `done` (terminal) or `parked` (unknown: waits for a query or a human).
    pub fn close_outbox(&self, operation_id: &str, state: OutboxState, last_code: Option<&str>) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE outbox SET state = ?2, lease_owner = NULL, lease_until = NULL, last_code = coalesce(?3, last_code)
                 WHERE operation_id = ?1",
            )?
            .execute(params![operation_id, state, last_code])?;
        Ok(())
    }

    /// Records how an attempt ended.
    pub fn finish_attempt(
        &self,
        operation_id: &str,
        attempt: i64,
        outcome: AttemptOutcome,
        code: Option<&str>,
        now: i64,
    ) -> R<()> {
        self.conn
            .prepare_cached(
                "UPDATE attempts SET outcome = ?3, code = ?4, finished_at = ?5 WHERE operation_id = ?1 AND attempt = ?2",
            )?
            .execute(params![operation_id, attempt, outcome, code, now])?;
        Ok(())
    }

    /// All attempts of an operation, in order.
    pub fn attempts(&self, operation_id: &str) -> R<Vec<AttemptRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT operation_id, attempt, owner, claimed_at, sent_at, finished_at, outcome, code
             FROM attempts WHERE operation_id = ?1 ORDER BY attempt",
        )?;
        let rows = st.query_map([operation_id], |r| {
            Ok(AttemptRow {
                operation_id: r.get(0)?,
                attempt: r.get(1)?,
                owner: r.get(2)?,
                claimed_at: r.get(3)?,
                sent_at: r.get(4)?,
                finished_at: r.get(5)?,
                outcome: r.get(6)?,
                code: r.get(7)?,
            })
        })?;
        rows.collect::<Result<_, _>>()
    }

    /// Due pending outbox rows whose operation deadline has not passed.
    pub fn ready_outbox(&self, now: i64, limit: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT o.operation_id FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state = 'pending' AND o.available_at <= ?1 AND p.deadline_at > ?1
             ORDER BY o.available_at, o.operation_id LIMIT ?2",
        )?;
        let rows = st.query_map(params![now, limit], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Leases that have expired (`lease_until <= now`).
    pub fn expired_leases(&self, now: i64) -> R<Vec<OutboxRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {OUTBOX_COLS} FROM outbox WHERE state = 'leased' AND lease_until <= ?1"
        ))?;
        let rows = st.query_map([now], OutboxRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Operations re-queued after a possibly-sent attempt (`in_flight` with a
    /// pending outbox row) whose deadline has passed: no worker will pick them up.
    pub fn overdue_in_flight(&self, now: i64) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT o.operation_id FROM outbox o JOIN operations p ON p.id = o.operation_id
             WHERE o.state = 'pending' AND p.state = 'in_flight' AND p.deadline_at <= ?1
             ORDER BY o.operation_id",
        )?;
        let rows = st.query_map([now], |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Outbox counts per state.
    pub fn count_outbox_by_state(&self) -> R<Vec<(String, i64)>> {
        let mut st = self.conn.prepare_cached("SELECT state, count(*) FROM outbox GROUP BY state ORDER BY state")?;
        let rows = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?;
        rows.collect::<Result<_, _>>()
    }

    // ------------------------------------------------------------- receipts

    /// Records a receipt the ledger has seen.
    pub fn insert_receipt(&self, r: &ReceiptRow) -> R<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO receipts (receipt_id, operation_id, request_id, body_sha256, result_sha256, source, recorded_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (receipt_id) DO NOTHING",
            )?
            .execute(params![r.receipt_id, r.operation_id, r.request_id, r.body_sha256, r.result_sha256, r.source, r.recorded_at])?;
        Ok(())
    }

    /// Receipts whose operation does not exist or does not name them.
    pub fn orphan_receipts(&self) -> R<Vec<String>> {
        let mut st = self.conn.prepare_cached(
            "SELECT r.receipt_id FROM receipts r LEFT JOIN operations o ON o.id = r.operation_id
             WHERE o.id IS NULL OR o.receipt_id IS DISTINCT FROM r.receipt_id ORDER BY r.receipt_id",
        )?;
        let rows = st.query_map((), |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    // ---------------------------------------------------------------- trace

    /// Appends a trace event.
    pub fn insert_trace(&self, e: &TraceRow) -> R<()> {
        // The trace's sequence has no gaps (a gap is a deleted event, which the
        // audit reports). SQLite's rowid never leaves one; a PostgreSQL
        // sequence does on every rolled-back insert, so there the number is the
        // next one under the transaction's serializable snapshot.
        let sql = match self.backend() {
            Backend::Sqlite => {
                "INSERT INTO trace_events (at, operation_id, step, tool, code, outcome, delivery, attempt, duration_us, fields,
                   answer, latency_us, tenant_ref, tool_version, timeout_stage, reason, latency_bucket_us)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)"
            }
            Backend::Postgres => {
                "INSERT INTO trace_events (seq, at, operation_id, step, tool, code, outcome, delivery, attempt, duration_us, fields,
                   answer, latency_us, tenant_ref, tool_version, timeout_stage, reason, latency_bucket_us)
                 SELECT coalesce(max(seq), 0) + 1, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17
                 FROM trace_events"
            }
        };
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
            e.latency_us.map(crate::telemetry::histogram::bucket_upper)
        ])?;
        Ok(())
    }

    /// The trace of one operation.
    pub fn trace_for(&self, operation_id: &str) -> R<Vec<TraceRow>> {
        let mut st = self
            .conn
            .prepare_cached(&format!("SELECT {TRACE_COLS} FROM trace_events WHERE operation_id = ?1 ORDER BY seq"))?;
        let rows = st.query_map([operation_id], TraceRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Trace events with seq > `after`, in order.
    pub fn trace_since(&self, after_seq: i64, since_at: i64, limit: i64) -> R<Vec<TraceRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {TRACE_COLS} FROM trace_events WHERE seq > ?1 AND at >= ?2 ORDER BY seq LIMIT ?3"
        ))?;
        let rows = st.query_map(params![after_seq, since_at, limit], TraceRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    // ------------------------------------------------------------ approvals

    /// Inserts an approval request.
    pub fn insert_approval(&self, a: &ApprovalRow) -> R<()> {
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO approvals ({APPROVAL_COLS}) VALUES ({})",
                placeholders(ApprovalRow::WIDTH)
            ))?
            .execute(a.params().as_slice())?;
        Ok(())
    }

    /// An approval request.
    pub fn approval(&self, id: &str) -> R<Option<ApprovalRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {APPROVAL_COLS} FROM approvals WHERE id = ?1"))?
            .query_opt([id], ApprovalRow::from_row)
    }

    /// The newest approval request for a scope.
    pub fn latest_approval(&self, tenant: &str, subject: &str, tool: &str, key: &str) -> R<Option<ApprovalRow>> {
        self
            .conn
            .prepare_cached(&format!(
                "SELECT {APPROVAL_COLS} FROM approvals WHERE tenant = ?1 AND subject = ?2 AND tool = ?3 AND idem_key = ?4
                 ORDER BY created_at DESC, rowid DESC LIMIT 1"
            ))?
            .query_opt([tenant, subject, tool, key], ApprovalRow::from_row)
    }

    /// Records a decision on an approval; only from `pending`. Returns whether it applied.
    pub fn decide_approval(&self, a: &ApprovalRow) -> R<Versioned> {
        let applied = self
            .conn
            .prepare_cached(
                "UPDATE approvals SET state = ?2, decided_by = ?3, decided_at = ?4, note = ?5, operation_id = ?6,
                   approval_sha256 = ?7 WHERE id = ?1 AND state = 'pending'",
            )?
            .execute(params![a.id, a.state, a.decided_by, a.decided_at, a.note, a.operation_id, a.approval_sha256])?
            == 1;
        Ok(if applied { Versioned::Applied } else { Versioned::Stale })
    }

    /// Pending approvals, soonest expiry first.
    pub fn pending_approvals(&self, limit: i64) -> R<Vec<ApprovalRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT {APPROVAL_COLS} FROM approvals WHERE state = 'pending' ORDER BY expires_at, id LIMIT ?1"
        ))?;
        let rows = st.query_map([limit], ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    // ------------------------------------------------------------ audit log

    /// Appends to the operator log (there is no update or delete).
    pub fn insert_audit(&self, a: &AuditRow) -> R<()> {
        // Link to the newest row (migration 0007): the chain `audit` verifies.
        let last = self
            .conn
            .prepare_cached(&format!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq DESC LIMIT 1"))?
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
        self.meta_set("audit_head", &stored.chain_hash())
    }

    /// Every operator-log row, oldest first (for the chain check).
    pub fn audit_log_ascending(&self) -> R<Vec<AuditRow>> {
        let mut st = self.conn.prepare_cached(&format!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq"))?;
        let rows = st.query_map((), AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The operator log, newest first.
    pub fn audit_log(&self, limit: i64) -> R<Vec<AuditRow>> {
        let mut st =
            self.conn.prepare_cached(&format!("SELECT {AUDIT_COLS} FROM audit_log ORDER BY seq DESC LIMIT ?1"))?;
        let rows = st.query_map([limit], AuditRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The applied operator-log row carrying an action id, if any.
    pub fn audit_by_action_id(&self, action_id: &str) -> R<Option<AuditRow>> {
        self.conn
            .prepare_cached(&format!("SELECT {AUDIT_COLS} FROM audit_log WHERE action_id = ?1"))?
            .query_opt([action_id], AuditRow::from_row)
    }

    /// The operator log rows about one operation.
    pub fn audit_for(&self, operation_id: &str) -> R<Vec<AuditRow>> {
        let mut st = self
            .conn
            .prepare_cached(&format!("SELECT {AUDIT_COLS} FROM audit_log WHERE operation_id = ?1 ORDER BY seq"))?;
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

    /// Operations written after keys became derived (migration 0009) that carry
    /// a legacy-shaped (`dk_`) downstream key: a hand edit.
    pub fn legacy_keys_after_migration(&self) -> R<Vec<String>> {
        let mut st = self.conn.prepare(
            "SELECT id FROM operations WHERE downstream_key NOT LIKE 'dk2!_%' ESCAPE '!'
               AND rowid > coalesce((SELECT CAST(value AS BIGINT) FROM meta
                                     WHERE key = 'legacy_downstream_keys_until_rowid'), 0)
             ORDER BY id",
        )?;
        let rows = st.query_map((), |r| r.get(0))?;
        rows.collect::<Result<_, _>>()
    }

    /// Whether a receipt row exists.
    pub fn receipt_exists(&self, receipt_id: &str) -> R<bool> {
        Ok(self
            .conn
            .prepare_cached("SELECT count(*) FROM receipts WHERE receipt_id = ?1")?
            .query_row([receipt_id], |r| r.get::<i64>(0))?
            > 0)
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
    pub fn trace_damage(&self) -> R<TraceDamage> {
        let mut st = self.conn.prepare("SELECT seq FROM trace_events WHERE json_valid(fields) = 0 ORDER BY seq")?;
        let bad = st.query_map((), |r| r.get(0))?.collect::<Result<Vec<i64>, _>>()?;
        let mut st = self.conn.prepare(
            "SELECT seq + 1, next - 1 FROM (SELECT seq, lead(seq) OVER (ORDER BY seq) AS next FROM trace_events) AS t
             WHERE next > seq + 1",
        )?;
        let gaps = st.query_map((), |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<Vec<_>, _>>()?;
        Ok((bad, gaps))
    }

    /// Every approval request (for the integrity audit).
    pub fn all_approvals(&self) -> R<Vec<ApprovalRow>> {
        let mut st = self.conn.prepare(&format!("SELECT {APPROVAL_COLS} FROM approvals ORDER BY created_at, id"))?;
        let rows = st.query_map((), ApprovalRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }
}

// ---------------------------------------------------------- observability
//
// Metrics read the rollups that the `trace_events_rollup` trigger (migration
// 0002) keeps in the same transaction as each trace insert, plus a few small
// reads of the ledger's own state. Nothing here scans the whole trace.

const METRIC_DIMS: &str =
    "answer, step, tool, tenant_ref, tool_version, code, outcome, delivery, timeout_stage, reason, events, latency_sum_us";

impl Tx<'_> {
    /// All-time event counts, one row per series.
    pub fn metric_totals(&self) -> R<Vec<MetricRow>> {
        let mut st =
            self.conn.prepare_cached(&format!("SELECT CAST(NULL AS BIGINT), {METRIC_DIMS} FROM metric_totals"))?;
        let rows = st.query_map((), MetricRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// Per-minute event counts for minutes in `[from_minute, to_minute)`.
    pub fn metric_minutes(&self, from_minute: i64, to_minute: i64) -> R<Vec<MetricRow>> {
        let mut st = self.conn.prepare_cached(&format!(
            "SELECT minute, {METRIC_DIMS} FROM metric_minutes WHERE minute >= ?1 AND minute < ?2 ORDER BY minute"
        ))?;
        let rows = st.query_map(params![from_minute, to_minute], MetricRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The all-time latency histogram of answered calls.
    pub fn latency_totals(&self) -> R<Vec<LatencyRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT CAST(NULL AS BIGINT), answer, tool, tenant_ref, tool_version, bucket_us, count FROM latency_totals",
        )?;
        let rows = st.query_map((), LatencyRow::from_row)?;
        rows.collect::<Result<_, _>>()
    }

    /// The latency histogram of calls answered in minutes `[from_minute, to_minute)`.
    pub fn latency_minutes(&self, from_minute: i64, to_minute: i64) -> R<Vec<LatencyRow>> {
        let mut st = self.conn.prepare_cached(
            "SELECT minute, answer, tool, tenant_ref, tool_version, bucket_us, count FROM latency_minutes
             WHERE minute >= ?1 AND minute < ?2",
        )?;
        let rows = st.query_map(params![from_minute, to_minute], LatencyRow::from_row)?;
        rows.collect::<Result<_, _>>()
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

    /// The newest trace sequence number (0 when the trace is empty).
    pub fn last_trace_seq(&self) -> R<i64> {
        self.conn.prepare_cached("SELECT coalesce(max(seq), 0) FROM trace_events")?.query_row((), |r| r.get(0))
    }
}

#[cfg(test)]
mod error_tests {
    use super::StoreError;

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
