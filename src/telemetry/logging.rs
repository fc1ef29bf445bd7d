//! Internal diagnostics: `tracing` events to a log file, never to the terminal
//! (a console owns the terminal; the CLI's stdout is its contract).
//!
//! The file is `$TOOLGATE_LOG` when set (`off` disables logging), else
//! `<database>.log` beside the ledger. `$TOOLGATE_LOG_LEVEL` picks the level
//! (`error`, `warn`, `info` (default), `debug`, `trace`). The file is bounded:
//! past `$TOOLGATE_LOG_MAX_BYTES` (default 64 MiB) it becomes `FILE.1`
//! (replacing the one before) and a new file starts, so a ledger's logs take
//! at most twice that.
//!
//! What reaches the log is redacted at the source: the engine logs trace events
//! through [`crate::engine::TraceEvent`]'s own summary (ids, codes, classes) and
//! errors by code; arguments, results, provider replies and headers are never
//! formatted into a log line.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use tracing::level_filters::LevelFilter;
use tracing::Subscriber;

/// Where the log of a database goes: `$TOOLGATE_LOG`, or `<db>.log` beside a
/// SQLite file; `None` when `$TOOLGATE_LOG` is `off` (or unset for PostgreSQL).
pub fn log_path_for(db: &Path) -> Option<PathBuf> {
    match std::env::var_os("TOOLGATE_LOG") {
        Some(v) if v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        // A PostgreSQL ledger has no directory of its own to log beside.
        _ if crate::store::Location::is_postgres(db) => None,
        _ => {
            let mut name = db.as_os_str().to_os_string();
            name.push(".log");
            Some(PathBuf::from(name))
        }
    }
}

/// The level from `$TOOLGATE_LOG_LEVEL` (default `info`).
pub fn level_from_env() -> LevelFilter {
    match std::env::var("TOOLGATE_LOG_LEVEL").unwrap_or_default().to_ascii_lowercase().as_str() {
        "off" => LevelFilter::OFF,
        "error" => LevelFilter::ERROR,
        "warn" => LevelFilter::WARN,
        "debug" => LevelFilter::DEBUG,
        "trace" => LevelFilter::TRACE,
        _ => LevelFilter::INFO,
    }
}

/// The default bound of a log file before it is rotated.
pub const DEFAULT_LOG_MAX_BYTES: u64 = 64 * 1024 * 1024;

fn max_bytes_from_env() -> u64 {
    std::env::var("TOOLGATE_LOG_MAX_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_LOG_MAX_BYTES)
}

/// A log file that rotates by size: written by hand, as `tracing-appender`
/// rotates by time only. Past `max` bytes the file is renamed `FILE.1`
/// (replacing the one before) and a new one is started. Another process
/// appending to the same log keeps writing to its open file (now `FILE.1`)
/// until it rotates in its turn: each process's lines still go somewhere
/// bounded.
pub struct RotatingFile {
    path: PathBuf,
    file: File,
    written: u64,
    max: u64,
}

impl RotatingFile {
    /// Opens (appends to) `path`, rotating past `max` bytes.
    pub fn open(path: &Path, max: u64) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let written = file.metadata().map_or(0, |m| m.len());
        Ok(Self { path: path.to_path_buf(), file, written, max })
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let mut old = self.path.as_os_str().to_os_string();
        old.push(".1");
        std::fs::rename(&self.path, PathBuf::from(old))?;
        self.file = OpenOptions::new().create(true).append(true).open(&self.path)?;
        self.written = 0;
        Ok(())
    }
}

impl std::io::Write for RotatingFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.written > 0 && self.written + buf.len() as u64 > self.max && self.rotate().is_err() {
            // A rotation that fails (a read-only directory) keeps appending,
            // and is tried again only after another `max` bytes: diagnostics
            // never stop the ledger.
            self.written = 0;
        }
        let n = self.file.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// A subscriber that appends plain-text lines (no colours) to `path`,
/// rotated past `$TOOLGATE_LOG_MAX_BYTES`.
pub fn file_subscriber(path: &Path, level: LevelFilter) -> std::io::Result<impl Subscriber + Send + Sync> {
    let file = RotatingFile::open(path, max_bytes_from_env())?;
    Ok(tracing_subscriber::fmt()
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .with_target(true)
        .with_max_level(level)
        .finish())
}

/// Installs the process-wide log for a database (the first call wins; later
/// calls do nothing). Returns whether a log is active. A log file that cannot
/// be opened disables logging rather than failing the command: diagnostics
/// must never stop the ledger, and must not fall back to the terminal.
pub fn init_for_db(db: &Path) -> bool {
    let Some(path) = log_path_for(db) else { return false };
    let level = level_from_env();
    if level == LevelFilter::OFF {
        return false;
    }
    match file_subscriber(&path, level) {
        Ok(s) => tracing::subscriber::set_global_default(s).is_ok(),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_log_rotates_past_its_bound_and_keeps_one_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l.db.log");
        let mut f = RotatingFile::open(&path, 1_000).unwrap();
        let line = [b'x'; 99];
        for _ in 0..35 {
            f.write_all(&line).unwrap();
            f.write_all(b"\n").unwrap();
        }
        f.flush().unwrap();
        let now = std::fs::metadata(&path).unwrap().len();
        let old = std::fs::metadata(dir.path().join("l.db.log.1")).unwrap().len();
        assert!(now <= 1_000 && old <= 1_000, "{now} {old}");
        // Reopened, it counts what the file already holds.
        let f = RotatingFile::open(&path, 1_000).unwrap();
        assert_eq!(f.written, now);
    }
}
