//! The PostgreSQL backend: connecting, its own numbered migrations, and
//! transactions.
//!
//! Isolation, step by step (ARCHITECTURE.md says why):
//! - every write transaction is `SERIALIZABLE`: PostgreSQL commits it only if
//!   the result is what running the transactions one at a time would give,
//!   which is the guarantee SQLite's `BEGIN IMMEDIATE` gives by running them
//!   one at a time. Every check-then-write of the engine (scope lookup then
//!   accept, claim, the fenced persist, the retry budget's last token, the
//!   breaker's half-open probe, the call-identity binding) keeps its meaning
//!   across hosts without a lock of its own;
//! - a serialization failure or deadlock is retried here, with a jittered
//!   backoff, re-running the whole closure (so closures do nothing outside the
//!   transaction), and never surfaces unless the retries run out (`DB_BUSY`);
//! - reads are `REPEATABLE READ READ ONLY`: one snapshot, as a SQLite read
//!   transaction is, and they never abort.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use super::group::Writer;
use super::pg_client::PgClient;
use super::sql::{pg_error, Conn, Failed, PgConn};
use super::{Mode, StoreError, Sync, Tx, BEGIN_RETRY_BUDGET};

type R<T> = Result<T, StoreError>;

/// PostgreSQL migrations, in order (numbered on their own: PostgreSQL 0001 is
/// the shape of SQLite schema 9). The version applied is meta `schema_version`.
const MIGRATIONS: [&str; 9] = [
    include_str!("pg/0001_ledger.sql"),
    include_str!("pg/0002_api_tokens.sql"),
    include_str!("pg/0003_sort_indexes.sql"),
    include_str!("pg/0004_rollup_slots.sql"),
    include_str!("pg/0005_holds.sql"),
    include_str!("pg/0006_scope_downstream_key.sql"),
    include_str!("pg/0007_operator_token_tenants.sql"),
    include_str!("pg/0008_audit_anchor.sql"),
    include_str!("pg/0009_purge_indexes.sql"),
];

/// The PostgreSQL schema version this build writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// How long a connection attempt may take when the URL does not say.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection that cannot reach its server is noticed within bounds, on
/// both ends (README, "PostgreSQL", "Bounds"):
/// - the client's socket: TCP keepalives after 10 s idle, every 2 s, 3 lost
///   probes; and `tcp_user_timeout` 15 s for data sent and never acknowledged
///   (the URL's own `keepalives_*` / `tcp_user_timeout` win);
/// - the server's end of the session (a host partitioned while holding row
///   locks loses them): the same keepalives and user timeout for the server's
///   socket, and `idle_in_transaction_session_timeout` 60 s (toolgate never
///   waits inside a transaction: its statements follow one another);
/// - `lock_timeout` 10 s (a lock held longer is a stuck holder: the call is
///   answered DB_BUSY, retried with the same key, instead of waiting on it)
///   and `statement_timeout` 120 s (the longest call deadline's order; the
///   audit and the purge work in batches well under it).
///
/// - and the client's own bound on every round trip (`pg_client`): the
///   statement timeout plus 5 s, for a path that acknowledges and never
///   delivers (a hung proxy), which no kernel timer notices.
///
/// A server setting given in the URL's `options` (`-c lock_timeout=5s`) wins.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_RETRIES: u32 = 3;
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(15);
/// The session's `statement_timeout` unless the URL's options say another
/// (also the base of the client's own bound on a round trip, `pg_client`).
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(120);
const SESSION_BOUNDS: [(&str, &str); 7] = [
    ("statement_timeout", "'120s'"),
    ("lock_timeout", "'10s'"),
    ("idle_in_transaction_session_timeout", "'60s'"),
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "2"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "15000"),
];

/// How long one migration's statements may take (an index on a large ledger).
const MIGRATION_BOUND: Duration = Duration::from_secs(60 * 60);

/// Lock key that serializes migrations of one database across processes.
const MIGRATION_LOCK: i64 = 0x746f_6f6c_6761_7465; // "toolgate"

/// Takes this session's slot (migration `pg/0004`): the first of 0..63 no
/// other session of the database holds, as a session advisory lock on
/// (`0x74676c74` "tglt", slot) that the server drops with the connection,
/// and sets it as `toolgate.slot`, which the triggers read to choose the rows
/// of the counters, rollups and trace sequence this connection writes. Two
/// writing connections, whatever their host, never share a slot (while there
/// are at most 64), so their transactions never update one counter row. With
/// every slot taken, the triggers fall back to the backend pid modulo 64
/// (`toolgate_slot()`). Needs no schema: it is part of the session settings,
/// restored on a reconnect.
const SLOT_CLAIM: &str = "DO $$ BEGIN
    FOR s IN 0..63 LOOP
        IF pg_try_advisory_lock(1952935028, s) THEN
            PERFORM set_config('toolgate.slot', s::text, false);
            RETURN;
        END IF;
    END LOOP;
END $$;";

/// Connects, checks the ledger's schema, and migrates it unless `read_only`.
pub(crate) fn open(url: &str, sync: Sync, read_only: bool) -> R<Conn> {
    let pg = connect(url, sync, read_only)?;
    let client = pg.client.borrow_mut();
    let version = schema_version(&client)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::SchemaTooNew { found: version, supported: SCHEMA_VERSION });
    }
    if read_only {
        if version <= 0 {
            return Err(StoreError::NotToolgate);
        }
        if version < SCHEMA_VERSION {
            return Err(StoreError::SchemaOld { found: version, supported: SCHEMA_VERSION });
        }
    } else {
        migrate(&client, version)?;
    }
    drop(client);
    Ok(Conn::Pg(pg))
}

/// Connects with the session settings, touching no schema.
pub(crate) fn connect(url: &str, sync: Sync, read_only: bool) -> R<PgConn> {
    // The URL may carry a password: no error here repeats it.
    let parsed = super::pg_tls::parse(url)?;
    let connector = super::pg_tls::Connector::for_url(&parsed)?;
    let mut config = parsed.config;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    // The driver's defaults are the kernel's (two hours of silence).
    if config.get_keepalives_idle() == Duration::from_secs(2 * 60 * 60) {
        config.keepalives(true).keepalives_idle(KEEPALIVE_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    config.application_name("toolgate");
    let given = config.get_options().unwrap_or("").to_string();
    let bound = super::pg_client::bound_for(&given, STATEMENT_TIMEOUT);
    let client = super::pg_client::PgClient::connect(&config, &connector, bound).map_err(|e| connect_error(&e))?;
    let mut session = String::from("SET client_min_messages = warning;");
    for (name, value) in SESSION_BOUNDS {
        if !given.contains(name) {
            let _ = write!(session, "SET {name} = {value};");
        }
    }
    if sync == Sync::Normal {
        session.push_str("SET synchronous_commit = off;");
    }
    if read_only {
        session.push_str("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY;");
    } else {
        session.push_str(SLOT_CLAIM);
    }
    client.batch_execute(&session).map_err(|e| pg_error(&e))?;
    Ok(PgConn::new(client, config, connector, bound, session))
}

fn connect_error(e: &super::pg_client::PgError) -> StoreError {
    match e.as_db_error() {
        // The server's own words (a missing database, a refused login).
        Some(db) => StoreError::Open(db.message().to_string()),
        // The driver's: "error connecting to server: Connection refused", no URL.
        None => StoreError::Open(e.to_string()),
    }
}

/// A row's column, its error as the store's.
fn col<'a, T: postgres::types::FromSql<'a>>(r: &'a postgres::Row, i: usize) -> R<T> {
    r.try_get(i).map_err(|e| pg_error(&e.into()))
}

/// The applied version: 0 for an empty database, an error for a database that
/// holds someone else's tables.
fn schema_version(client: &PgClient) -> R<i64> {
    let has_meta: bool =
        col(&client.query_one("SELECT to_regclass('meta') IS NOT NULL", &[]).map_err(|e| pg_error(&e))?, 0)?;
    if !has_meta {
        let row = client
            .query_one("SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()", &[])
            .map_err(|e| pg_error(&e))?;
        let tables: i64 = col(&row, 0)?;
        return if tables > 0 { Err(StoreError::NotToolgate) } else { Ok(0) };
    }
    let v: Option<String> = client
        .query_opt("SELECT value FROM meta WHERE key = 'schema_version'", &[])
        .map_err(|e| pg_error(&e))?
        .map(|r| col(&r, 0))
        .transpose()?;
    match v.as_deref().map(str::parse::<i64>) {
        Some(Ok(n)) if n > 0 => Ok(n),
        _ => Err(StoreError::NotToolgate),
    }
}

fn migrate(client: &PgClient, from: i64) -> R<()> {
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(from as usize) {
        client.batch_execute("BEGIN").map_err(|e| pg_error(&e))?;
        let step = migrate_one(client, i, sql, from);
        match step {
            Ok(()) => client.batch_execute("COMMIT").map_err(|e| pg_error(&e))?,
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK");
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Migration `i + 1`, inside its own transaction.
fn migrate_one(client: &PgClient, i: usize, sql: &str, from: i64) -> R<()> {
    // One migrator at a time; re-check under the lock (another process may
    // have migrated meanwhile).
    client.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK]).map_err(|e| pg_error(&e))?;
    let has_meta: bool =
        col(&client.query_one("SELECT to_regclass('meta') IS NOT NULL", &[]).map_err(|e| pg_error(&e))?, 0)?;
    let now: i64 = if has_meta {
        client
            .query_opt("SELECT value FROM meta WHERE key = 'schema_version'", &[])
            .map_err(|e| pg_error(&e))?
            .and_then(|r| r.try_get::<_, String>(0).ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    } else {
        0
    };
    if now > i as i64 {
        return Ok(());
    }
    // Transactional DDL: a failure rolls the migration back whole. An index
    // on a large ledger takes as long as it takes: no statement timeout for
    // it, and the client's bound stretched to an hour.
    client.batch_execute("SET LOCAL statement_timeout = 0").map_err(|e| pg_error(&e))?;
    client.batch_execute_within(sql, MIGRATION_BOUND).map_err(|e| match pg_error(&e) {
        StoreError::Other(reason) | StoreError::Constraint(reason) => {
            StoreError::Migration { number: i + 1, found: from, reason }
        }
        other => other,
    })?;
    client
        .execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', $1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            &[&(i as i64 + 1).to_string()],
        )
        .map_err(|e| pg_error(&e))?;
    Ok(())
}

/// How many times a write transaction that met a unique violation is run
/// again before the violation is returned (`Failed::Unique`).
const UNIQUE_RETRIES: u32 = 3;

/// One transaction on PostgreSQL, retried on serialization failure.
pub(crate) fn transaction<T, E: From<StoreError>>(
    pg: &PgConn,
    neutral: &Conn,
    mode: Mode,
    writer: &Writer,
    mut f: impl FnMut(&Tx<'_>) -> Result<T, E>,
) -> Result<T, E> {
    let begin = match mode {
        Mode::Read => "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        Mode::Write => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        Mode::WriteRelaxed => "BEGIN ISOLATION LEVEL SERIALIZABLE; SET LOCAL synchronous_commit = off",
    };
    let started = Instant::now();
    let mut tries: u32 = 0;
    let mut unique_tries: u32 = 0;
    loop {
        tries += 1;
        pg.failed.set(None);
        pg.ensure_connected()?;
        let began = pg.client.borrow_mut().batch_execute(begin);
        if let Err(e) = began {
            match pg_error(&e) {
                // A connection the server dropped (a restart) fails its first
                // statement: nothing of this transaction ran, so a new
                // connection begins it. A caller is never told "unavailable"
                // (and an attempt never parked as unknown) for a connection
                // that could be replaced.
                StoreError::Unavailable => {
                    pg.reconnect()?;
                    pg.client.borrow_mut().batch_execute(begin).map_err(|e| pg_error(&e))?;
                }
                other => return Err(other.into()),
            }
        }
        let out = f(&Tx { conn: neutral });
        let failed = pg.failed.get();
        let retry = match (&out, failed) {
            // Nothing failed: commit (which may itself meet a serialization failure).
            (Ok(_), None) => match commit(pg) {
                Ok(()) => return out,
                Err(e) => match pg_error(&e) {
                    StoreError::Conflict => true,
                    other => {
                        rollback(pg);
                        return Err(other.into());
                    }
                },
            },
            (_, Some(Failed::Serialization)) => true,
            // A concurrent insert of the same key (see `Failed::Unique`):
            // run again a few times, then it is a real constraint violation.
            (_, Some(Failed::Unique)) if mode != Mode::Read && unique_tries < UNIQUE_RETRIES => {
                unique_tries += 1;
                true
            }
            // A statement failed and `f` went on as if it had not: PostgreSQL
            // has aborted the transaction, so nothing of it can commit.
            (Ok(_), Some(_)) => {
                rollback(pg);
                return Err(StoreError::Other("a statement of the transaction failed".into()).into());
            }
            (Err(_), _) => {
                rollback(pg);
                return out;
            }
        };
        rollback(pg);
        if !retry || started.elapsed() >= BEGIN_RETRY_BUDGET {
            return Err(StoreError::Conflict.into());
        }
        writer.count_retry();
        // Full jitter, growing with the tries, at most ~50 ms.
        let cap = 1u64 << tries.min(6);
        std::thread::sleep(Duration::from_micros(500 + rand::random::<u64>() % (cap * 800)));
    }
}

/// `COMMIT`, with the client's borrow released before the caller reacts.
fn commit(pg: &PgConn) -> Result<(), super::pg_client::PgError> {
    pg.client.borrow_mut().batch_execute("COMMIT")
}

fn rollback(pg: &PgConn) {
    let _ = pg.client.borrow_mut().batch_execute("ROLLBACK");
    pg.failed.set(None);
}

/// The server's WAL insert position as a number: it moves with every commit
/// that wrote anything, which is what the console needs to know to refetch.
pub(crate) fn data_version(pg: &PgConn) -> R<i64> {
    pg.ensure_connected()?;
    let row = pg
        .client
        .borrow_mut()
        .query_one("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint", &[])
        .map_err(|e| pg_error(&e))?;
    col(&row, 0)
}

/// A database of its own on a PostgreSQL server, made for one run (the bench's
/// ledgers) and dropped when this goes. Needs a role that may create databases.
#[derive(Debug)]
pub struct ScratchDatabase {
    admin: String,
    name: String,
    url: String,
}

impl ScratchDatabase {
    /// Creates `toolgate_<label>_<random>` on the server `server` (a URL of
    /// any database on it).
    pub fn create(server: &str, label: &str) -> R<Self> {
        let name = format!("toolgate_{label}_{}_{:08x}", std::process::id(), rand::random::<u32>());
        let admin = admin_client(server)?;
        admin.batch_execute(&format!("CREATE DATABASE {name}")).map_err(|e| pg_error(&e))?;
        let url = match server.split_once('?') {
            Some((base, query)) => format!("{}/{name}?{query}", base.rsplit_once('/').map_or(base, |(b, _)| b)),
            None => format!("{}/{name}", server.rsplit_once('/').map_or(server, |(b, _)| b)),
        };
        Ok(Self { admin: server.to_string(), name, url })
    }

    /// Its URL (a `--db` value).
    pub fn url(&self) -> std::path::PathBuf {
        std::path::PathBuf::from(&self.url)
    }
}

/// A connection to `server` as its URL says (TLS included), for administration.
fn admin_client(server: &str) -> R<PgClient> {
    let parsed = super::pg_tls::parse(server)?;
    let connector = super::pg_tls::Connector::for_url(&parsed)?;
    let bound = super::pg_client::bound_for(parsed.config.get_options().unwrap_or(""), STATEMENT_TIMEOUT);
    PgClient::connect(&parsed.config, &connector, bound).map_err(|e| connect_error(&e))
}

impl Drop for ScratchDatabase {
    fn drop(&mut self) {
        if let Ok(admin) = admin_client(&self.admin) {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
        }
    }
}
