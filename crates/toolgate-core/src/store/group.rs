//! Group commit for SQLite: the writers of one process share commits.
//!
//! Every commit at `synchronous=FULL` waits for an fsync, so with one
//! transaction per caller, eight callers make eight fsyncs one after the
//! other, and adding callers makes the ledger slower. Here the write
//! transactions of the callers of one process that arrive together run on one
//! connection inside one SQLite transaction, each in a savepoint of its own,
//! and share one `COMMIT` (one fsync):
//!
//! - a caller takes the database's writer (a mutex per database per process),
//!   opens the batch's transaction if none is open (`BEGIN IMMEDIATE`, the file's
//!   write lock, busy retried), and runs its closure inside `SAVEPOINT member`
//!   (the batch's first member runs without one: the transaction is its own);
//! - its closure failed: `ROLLBACK TO member` undoes exactly its writes, and the
//!   caller gets its error at once; the batch goes on without it (a first
//!   member rolls the whole transaction back, and the batch ends with it);
//! - then, if no other caller is waiting for the writer, this caller commits
//!   the batch (one fsync for every member) and wakes the members; otherwise
//!   it leaves the writer to the next caller and waits until its batch is
//!   committed. Nobody's result is returned before the commit that makes it
//!   durable, and a failed commit fails every member of the batch.
//!
//! Each caller stays all-or-nothing and sees exactly what it would see alone
//! (the members of a batch run one after the other, each on the state the
//! previous ones left); a crash before the commit loses the whole batch, none
//! of whose callers had been answered.
//!
//! Stores opened at `NORMAL` batch the same way, in batches that commit at
//! `NORMAL`: a FULL caller never joins one (it commits that batch first and
//! opens its own), while a NORMAL caller may join a FULL batch (its commit is
//! only more durable than it asked). Batching there saves no fsync, but every
//! write of the process runs on one connection, whose page cache no other
//! connection's commit resets: a fresh dispatch's three transactions (the
//! ledger's, the provider's, the ledger's) used to re-read every page they
//! touched. Writers that must not wait for a disk flush at FULL
//! (`Store::write_relaxed`) do not join a batch: they commit the open batch
//! first (they hold the writer) and then run alone on their own connection.
//! PostgreSQL has group commit of
//! its own (`commit_delay`, and concurrent commits share WAL flushes), so its
//! writers only take turns here.
//!
//! Hand-written: SQLite has no group commit across connections, and no crate
//! offers one over rusqlite.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OpenFlags};

use super::sql::Conn;
use super::{StoreError, Tx, BEGIN_RETRY_BUDGET, BUSY_TIMEOUT, STATEMENT_CACHE};

/// Failed batches remembered for members that wake late (failures are rare).
const FAILED_KEPT: usize = 256;

/// The writers of one database in this process.
pub(crate) struct Writer {
    /// The SQLite file whose batches this writer commits (`None`: PostgreSQL,
    /// or group commit switched off: writers only take turns).
    path: Option<PathBuf>,
    state: Mutex<Group>,
    committed: Condvar,
    /// Callers waiting to take the writer: a batch stays open for them.
    arrivals: AtomicUsize,
    /// Commits that waited for the disk (group commits and FULL commits of
    /// writers alone), all time: `toolgate bench` reports them per call.
    synced: AtomicU64,
    /// PostgreSQL write transactions run again after a serialization failure,
    /// deadlock or unique violation (`pg::transaction`), all time:
    /// `toolgate bench` reports them per call of the contention phases.
    retries: AtomicU64,
    /// Writers take turns (always on SQLite; on PostgreSQL unless
    /// `TOOLGATE_PG_WRITER_QUEUE=off`, for measurements: its writers then
    /// meet only the server's own locking and serializable conflicts).
    queue: bool,
}

/// The shared connection and its open batch.
#[derive(Default)]
pub(crate) struct Group {
    conn: Option<Conn>,
    /// A batch transaction is open on `conn`.
    open: bool,
    /// The current (or last) batch.
    batch: u64,
    /// The open batch commits at `synchronous=FULL` (a FULL member is in
    /// it); otherwise at NORMAL.
    full: bool,
    /// The `synchronous` level `conn` is set to (`None`: not set yet).
    conn_full: Option<bool>,
    /// The last batch whose outcome is known.
    done: u64,
    /// Batches whose commit failed, newest last.
    failed: Vec<(u64, Failure)>,
}

/// Why a batch did not commit (every member gets it).
#[derive(Debug, Clone)]
enum Failure {
    DiskFull,
    Busy,
    ReadOnly,
    Other(String),
}

impl Failure {
    fn of(e: &StoreError) -> Self {
        match e {
            StoreError::DiskFull => Failure::DiskFull,
            StoreError::Busy => Failure::Busy,
            StoreError::ReadOnly => Failure::ReadOnly,
            other => Failure::Other(other.to_string()),
        }
    }

    fn error(&self) -> StoreError {
        match self {
            Failure::DiskFull => StoreError::DiskFull,
            Failure::Busy => StoreError::Busy,
            Failure::ReadOnly => StoreError::ReadOnly,
            Failure::Other(m) => StoreError::Other(format!("the shared commit failed: {m}")),
        }
    }
}

fn exec(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

/// The batches' own connection: the same settings as a ledger connection.
fn open_conn(path: &Path) -> Result<Connection, StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(path, flags).map_err(|e| StoreError::Open(e.to_string()))?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") && !mode.eq_ignore_ascii_case("memory") {
        return Err(StoreError::Open(format!("could not enable WAL (journal_mode={mode})")));
    }
    // `synchronous` is set per batch (`Writer::turn`).
    conn.execute_batch("PRAGMA foreign_keys=ON; PRAGMA temp_store=MEMORY;")?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(conn)
}

/// `BEGIN IMMEDIATE`, busy retried (another process holds the write lock).
fn begin(conn: &Connection) -> Result<(), StoreError> {
    let started = Instant::now();
    loop {
        match conn.prepare_cached("BEGIN IMMEDIATE").and_then(|mut st| st.execute([])) {
            Ok(_) => return Ok(()),
            Err(rusqlite::Error::SqliteFailure(f, _))
                if matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
                    && started.elapsed() < BEGIN_RETRY_BUDGET =>
            {
                std::thread::sleep(Duration::from_millis(1 + rand::random::<u64>() % 10));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// What one member's turn gave: its batch and result, or its panic.
type Turn<T, E> = Result<Result<(u64, T), E>, Box<dyn Any + Send>>;

impl Writer {
    /// The writer of a SQLite file (`group`: its writers share commits)
    /// or of a PostgreSQL database (`path` `None`).
    pub(crate) fn new(path: Option<PathBuf>, group: bool) -> Self {
        let queue = path.is_some() || std::env::var("TOOLGATE_PG_WRITER_QUEUE").map_or(true, |v| v != "off");
        Self {
            queue,
            path: path.filter(|_| group),
            state: Mutex::new(Group::default()),
            committed: Condvar::new(),
            arrivals: AtomicUsize::new(0),
            synced: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        }
    }

    /// Whether writers of this database share commits (SQLite, group commit on).
    pub(crate) fn groups(&self) -> bool {
        self.path.is_some()
    }

    /// Whether writers take turns on this database in this process.
    pub(crate) fn queues(&self) -> bool {
        self.queue
    }

    /// Commits that waited for the disk, all time, in this process.
    pub(crate) fn synced_commits(&self) -> u64 {
        self.synced.load(Ordering::Relaxed)
    }

    /// Write transactions run again (PostgreSQL), all time, in this process.
    pub(crate) fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// Counts one write transaction run again.
    pub(crate) fn count_retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a FULL commit made outside a batch.
    pub(crate) fn count_synced(&self) {
        self.synced.fetch_add(1, Ordering::Relaxed);
    }

    fn lock(&self) -> MutexGuard<'_, Group> {
        // A panicking member rolled its own writes back before the lock
        // was released: the state is consistent, so a poisoned lock is usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes the writer for a caller that runs alone on its own connection
    /// (a relaxed commit at FULL, PostgreSQL, group commit off): the open batch, if
    /// any, is committed first (its members are woken), and nobody else
    /// writes until the guard is dropped.
    pub(crate) fn alone(&self) -> MutexGuard<'_, Group> {
        let mut g = self.lock();
        self.flush(&mut g);
        g
    }

    /// Commits the open batch and wakes its members; a failed commit fails
    /// them all.
    fn flush(&self, g: &mut Group) {
        if !g.open {
            return;
        }
        let Some(Conn::Lite(conn)) = &g.conn else { return };
        let outcome = exec(conn, "COMMIT");
        if let Err(e) = &outcome {
            if !conn.is_autocommit() {
                let _ = exec(conn, "ROLLBACK");
            }
            self.fail(g, g.batch, &Failure::of(e));
        } else if g.full {
            self.synced.fetch_add(1, Ordering::Relaxed);
        }
        g.open = false;
        g.done = g.batch;
        self.committed.notify_all();
    }

    fn fail(&self, g: &mut Group, batch: u64, why: &Failure) {
        g.failed.push((batch, why.clone()));
        if g.failed.len() > FAILED_KEPT {
            g.failed.remove(0);
        }
        g.done = batch;
        g.open = false;
        self.committed.notify_all();
    }

    /// Commits the batch if nobody is waiting to join it.
    fn leave(&self, g: &mut Group) {
        if self.arrivals.load(Ordering::SeqCst) == 0 {
            self.flush(g);
        }
    }

    /// Runs `f` as one member of a batch (see the module's doc) and returns
    /// once the batch that holds its writes is committed; `full`: that commit
    /// must wait for the disk (`synchronous=FULL`).
    pub(crate) fn write<T, E: From<StoreError>>(
        &self,
        full: bool,
        mut f: impl FnMut(&Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        self.arrivals.fetch_add(1, Ordering::SeqCst);
        let mut g = self.lock();
        self.arrivals.fetch_sub(1, Ordering::SeqCst);
        // A FULL member never joins a batch that would commit at NORMAL: that
        // batch commits first. (A NORMAL member may join a FULL batch: its
        // commit is only more durable than it asked for.)
        if full && g.open && !g.full {
            self.flush(&mut g);
        }
        let (batch, out) = match self.turn(&mut g, full, &mut f) {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                self.leave(&mut g);
                return Err(e);
            }
            Err(panic) => {
                self.leave(&mut g);
                drop(g);
                std::panic::resume_unwind(panic);
            }
        };
        if self.arrivals.load(Ordering::SeqCst) == 0 {
            self.flush(&mut g);
        } else {
            while g.done < batch {
                g = self.committed.wait(g).unwrap_or_else(PoisonError::into_inner);
            }
        }
        match g.failed.iter().rev().find(|(b, _)| *b == batch) {
            Some((_, why)) => Err(why.error().into()),
            None => Ok(out),
        }
    }

    /// One member's turn: the batch opened if needed, `f` in its savepoint.
    fn turn<T, E: From<StoreError>>(
        &self,
        g: &mut Group,
        full: bool,
        f: &mut impl FnMut(&Tx<'_>) -> Result<T, E>,
    ) -> Turn<T, E> {
        let path = self.path.as_deref().ok_or_else(|| StoreError::Other("no group connection".into()));
        if g.conn.is_none() {
            match path.and_then(open_conn) {
                Ok(c) => g.conn = Some(Conn::Lite(c)),
                Err(e) => return Ok(Err(e.into())),
            }
        }
        let Some(neutral @ Conn::Lite(conn)) = &g.conn else {
            return Ok(Err(StoreError::Other("no group connection".into()).into()));
        };
        // The batch's first member needs no savepoint: the transaction holds
        // only its writes, so rolling the whole of it back undoes exactly them.
        // (A savepoint makes SQLite copy every page the member touches into
        // its sub-journal first: ~230 k instructions of a fresh dispatch.)
        let first = !g.open;
        if first {
            // The level is set between transactions: SQLite refuses to change
            // it inside one.
            if g.conn_full != Some(full) {
                let level = if full { "PRAGMA synchronous=FULL" } else { "PRAGMA synchronous=NORMAL" };
                if let Err(e) = exec(conn, level) {
                    return Ok(Err(e.into()));
                }
                g.conn_full = Some(full);
            }
            if let Err(e) = begin(conn) {
                return Ok(Err(e.into()));
            }
            g.open = true;
            g.full = full;
            g.batch += 1;
        }
        let batch = g.batch;
        if !first {
            if let Err(e) = exec(conn, "SAVEPOINT member") {
                let why = Failure::of(&e);
                if !conn.is_autocommit() {
                    let _ = exec(conn, "ROLLBACK");
                }
                self.fail(g, batch, &why);
                return Ok(Err(e.into()));
            }
        }
        let out = std::panic::catch_unwind(AssertUnwindSafe(|| f(&Tx { conn: neutral })));
        let kept = match (&out, first) {
            (Ok(Ok(_)), true) => Ok(()),
            (Ok(Ok(_)), false) => exec(conn, "RELEASE member"),
            // The batch is this member alone: it ends here, nobody else had
            // joined it, and the next caller opens a new one. (A failed
            // ROLLBACK fails the batch below, as any other.)
            (_, true) => {
                let undone = if conn.is_autocommit() { Ok(()) } else { exec(conn, "ROLLBACK") };
                if undone.is_ok() {
                    g.open = false;
                    g.done = batch;
                    return out.map(|r| r.map(|t| (batch, t)));
                }
                undone
            }
            // This member's writes go; the batch's stay.
            (_, false) => exec(conn, "ROLLBACK TO member").and_then(|()| exec(conn, "RELEASE member")),
        };
        // An error SQLite answers by rolling the whole transaction back (I/O,
        // a full disk) took every member's writes with it: the batch failed.
        if kept.is_err() || conn.is_autocommit() {
            let err = kept.err().unwrap_or_else(|| StoreError::Other("the shared transaction was rolled back".into()));
            let why = Failure::of(&err);
            if !conn.is_autocommit() {
                let _ = exec(conn, "ROLLBACK");
            }
            self.fail(g, batch, &why);
            return match out {
                Ok(Err(e)) => Ok(Err(e)),
                Ok(Ok(_)) => Ok(Err(why.error().into())),
                Err(panic) => Err(panic),
            };
        }
        out.map(|r| r.map(|t| (batch, t)))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{OpenOptions, Store, StoreError, Sync};

    fn store(path: &std::path::Path) -> Store {
        store_at(path, Sync::Full)
    }

    fn store_at(path: &std::path::Path, sync: Sync) -> Store {
        Store::open_unmigrated(path, OpenOptions { create: true, sync }, false).unwrap()
    }

    fn count(s: &mut Store) -> i64 {
        s.read(|tx| tx.conn.prepare_cached("SELECT count(*) FROM t")?.query_row((), |r| r.get(0))).unwrap()
    }

    /// Writes row `v` while another caller is made to queue behind it: the
    /// second waits on the writer until this closure has seen it arrive.
    fn write_while_another_queues(s: &mut Store, v: i64, fail: bool) -> Result<(), StoreError> {
        let writer = s.writer.clone();
        s.write(|tx| {
            tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
            let started = std::time::Instant::now();
            while writer.arrivals.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                assert!(started.elapsed() < std::time::Duration::from_secs(20), "the other caller never queued");
                std::thread::yield_now();
            }
            if fail {
                return Err(StoreError::Other("refused".into()));
            }
            Ok(())
        })
    }

    /// Two callers that queue together share one commit; each sees its own
    /// result, and a caller whose closure fails loses only its own writes.
    fn check(first_fails: bool, second_fails: bool) {
        check_at([Sync::Full, Sync::Full], first_fails, second_fails, 1);
    }

    /// `check` with the two callers' stores at `levels`, and the synced
    /// commits they are expected to make between them.
    fn check_at(levels: [Sync; 2], first_fails: bool, second_fails: bool, synced: u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.db");
        let mut setup = store(&path);
        setup.write(|tx| tx.conn.execute_batch("CREATE TABLE t (v INTEGER NOT NULL)")).unwrap();
        let before = setup.synced_commits();
        let mut a = store_at(&path, levels[0]);
        let mut b = store_at(&path, levels[1]);
        let writer = a.writer.clone();
        let first = std::thread::spawn(move || write_while_another_queues(&mut a, 1, first_fails));
        // The first caller holds the writer until the second queues for it.
        while writer.state.try_lock().is_ok() {
            std::thread::yield_now();
        }
        let second = std::thread::spawn(move || {
            b.write(|tx| {
                tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [2])?;
                if second_fails {
                    return Err(StoreError::Other("refused".into()));
                }
                Ok(())
            })
        });
        assert_eq!(first.join().unwrap().is_err(), first_fails);
        assert_eq!(second.join().unwrap().is_err(), second_fails);
        let expected = i64::from(!first_fails) + i64::from(!second_fails);
        assert_eq!(count(&mut setup), expected, "each caller all or nothing");
        assert_eq!(setup.synced_commits() - before, synced, "synced commits");
    }

    #[test]
    fn callers_that_queue_together_share_one_commit() {
        check(false, false);
    }

    #[test]
    fn a_failing_member_loses_only_its_own_writes() {
        check(true, false);
        check(false, true);
    }

    /// Stores at NORMAL share batches too, and their commits wait for no disk.
    #[test]
    fn normal_callers_share_a_commit_that_waits_for_no_disk() {
        check_at([Sync::Normal, Sync::Normal], false, false, 0);
        check_at([Sync::Normal, Sync::Normal], true, false, 0);
    }

    /// A FULL caller queued behind a NORMAL batch does not join it (its commit
    /// would not wait for the disk): that batch commits first, then the FULL
    /// caller's own, synced. A NORMAL caller may join a FULL batch.
    #[test]
    fn a_full_caller_never_rides_a_normal_commit() {
        check_at([Sync::Normal, Sync::Full], false, false, 1);
        check_at([Sync::Full, Sync::Normal], false, false, 1);
    }

    /// The shared connection commits each batch at its first member's level:
    /// what `PRAGMA synchronous` reads inside the batch (2 FULL, 1 NORMAL).
    #[test]
    fn each_batch_runs_at_its_first_members_level() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.db");
        let mut full = store(&path);
        let mut normal = store_at(&path, Sync::Normal);
        let level = |s: &mut Store| -> i64 {
            s.write(|tx| tx.conn.prepare_cached("PRAGMA synchronous")?.query_row((), |r| r.get(0))).unwrap()
        };
        assert_eq!(level(&mut normal), 1);
        assert_eq!(level(&mut full), 2);
        assert_eq!(level(&mut normal), 1);
        assert_eq!(level(&mut full), 2);
    }

    /// A caller alone is its batch's first member, which runs without a
    /// savepoint: its failure rolls the transaction back and commits nothing.
    #[test]
    fn a_failing_caller_alone_leaves_nothing_and_commits_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = store(&dir.path().join("g.db"));
        s.write(|tx| tx.conn.execute_batch("CREATE TABLE t (v INTEGER NOT NULL)")).unwrap();
        let before = s.synced_commits();
        let failed = s.write(|tx| -> Result<(), StoreError> {
            tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [7])?;
            Err(StoreError::Other("refused".into()))
        });
        assert!(failed.is_err());
        assert_eq!(count(&mut s), 0, "nothing of the failed caller stays");
        assert_eq!(s.synced_commits(), before, "nothing was committed");
        s.write(|tx| tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [1]).map(|_| ())).unwrap();
        assert_eq!(count(&mut s), 1);
        assert_eq!(s.synced_commits(), before + 1);
    }

    #[test]
    fn a_panicking_member_loses_only_its_own_writes_and_the_writer_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("g.db");
        let mut s = store(&path);
        s.write(|tx| tx.conn.execute_batch("CREATE TABLE t (v INTEGER NOT NULL)")).unwrap();
        let p = path.clone();
        let panicked = std::thread::spawn(move || {
            let mut t = store(&p);
            t.write(|tx| -> Result<(), StoreError> {
                tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [9])?;
                panic!("a bug in a closure");
            })
        })
        .join();
        assert!(panicked.is_err());
        s.write(|tx| tx.conn.execute("INSERT INTO t (v) VALUES (?1)", [1]).map(|_| ())).unwrap();
        assert_eq!(count(&mut s), 1);
    }
}
