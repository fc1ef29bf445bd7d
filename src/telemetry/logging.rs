//! Internal diagnostics: `tracing` events to a log file, never to the terminal
//! (a console owns the terminal; the CLI's stdout is its contract).
//!
//! The file is `$TOOLGATE_LOG` when set (`off` disables logging), else
//! `<database>.log` beside the ledger. `$TOOLGATE_LOG_LEVEL` picks the level
//! (`error`, `warn`, `info` (default), `debug`, `trace`).
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

/// A subscriber that appends plain-text lines (no colours) to `path`.
pub fn file_subscriber(path: &Path, level: LevelFilter) -> std::io::Result<impl Subscriber + Send + Sync> {
    let file: File = OpenOptions::new().create(true).append(true).open(path)?;
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
