//! `toolgate` with no command, and `toolgate demo`: the console on a ledger or
//! on a working copy of the demo database.

use super::{engine_options, operator_or_user, Cli, CliError};
use crate::engine::Engine;
use crate::store::Location;
use crate::Coded;
use std::path::PathBuf;

/// Opens the console: on `--db PATH` in place, or on a working copy of the demo
/// database re-based to now (the committed file is never written).
pub(super) fn console(cli: &Cli, agents: usize) -> Result<i32, CliError> {
    use std::io::IsTerminal;
    // Simulated agents write the ledger they run on: never one named by
    // --db under --read-only (the demo's own working copy is a scratch file).
    if cli.read_only && agents > 0 && cli.db.is_some() {
        return Err(CliError::new("READ_ONLY", "refused: --read-only is set and the agents would write the ledger"));
    }
    // Said, not ignored: the console's panes, countdowns and working copy
    // run on the wall clock.
    if cli.now.is_some() {
        return Err(CliError::new(
            "INVALID_ARGUMENTS",
            "--now fixes the clock of a scripted command; the console runs on the wall clock (leave --now out)",
        ));
    }
    if !std::io::stdout().is_terminal() {
        return Err(CliError::new(
            "NOT_A_TERMINAL",
            "the console needs a terminal; see `toolgate --help` for the commands",
        ));
    }
    let (db, label, scratch) = if let (Some(p), true) = (&cli.db, agents > 0) {
        // `toolgate demo --db PATH`: the demo runs there.
        let name = p.file_name().map_or_else(|| "demo".into(), |n| n.to_string_lossy().into_owned());
        if Location::is_postgres(p) || p.exists() {
            // Looked at without writing: a refused command changes nothing
            // (an empty file or database is not made a ledger to be refused).
            let demo = match Engine::open_read_only(p, crate::tools::demo_options()) {
                Ok(e) => e.is_demo(),
                // An older demo database is migrated by the console, as any ledger.
                Err(e) if e.code() == "DB_SCHEMA_OLD" => Engine::open(p, crate::tools::demo_options())?.is_demo(),
                Err(e) if e.code() == "DB_NOT_TOOLGATE" => false,
                Err(e) => return Err(e.into()),
            };
            if !demo {
                return Err(CliError::new(
                    "NOT_A_DEMO_DB",
                    "the demo's agents only write to a demo database: give a new path (a working copy is made there) or one made by `toolgate demo-db`",
                ));
            }
        } else {
            crate::demo::working_copy_at(p, chrono::Utc::now().timestamp_millis())?;
        }
        (p.clone(), name, tempfile_dir()?)
    } else if let (Some(p), 0) = (&cli.db, agents) {
        if !Location::is_postgres(p) && !p.exists() {
            return Err(CliError::new("DB_NOT_FOUND", "no database at the given path (run `toolgate init` first)"));
        }
        // A file that is not a ledger is refused before anything is made
        // beside it (no working directory, no log file).
        match Engine::open_read_only(p, crate::tools::demo_options()) {
            Err(e) if e.code() != "DB_SCHEMA_OLD" => return Err(e.into()),
            _ => {}
        }
        (p.clone(), Location::of(p).label(), tempfile_dir()?)
    } else {
        let now = chrono::Utc::now().timestamp_millis();
        let scratch = tempfile_dir()?;
        match crate::demo::working_copy(&scratch, now) {
            Ok(copy) => (copy, "demo.db (working copy)".to_string(), scratch),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&scratch);
                return Err(e.into());
            }
        }
    };
    let operator = operator_or_user(cli);
    // The console owns the terminal: diagnostics go to the database's log file only.
    crate::telemetry::logging::init_for_db(&db);
    let load = (agents > 0).then(|| crate::load::spawn_agents(&db, agents)).transpose()?;
    let in_scratch = db.starts_with(&scratch);
    let result = crate::tui::run(&crate::tui::ConsoleOptions {
        db,
        db_label: label,
        operator,
        read_only: cli.read_only,
        workers: true,
        scratch: scratch.clone(),
        load: load.as_ref().map(|l| l.stats.clone()),
        toolset: engine_options(cli)?.toolset,
    });
    if let Some(l) = load {
        l.stop();
    }
    let discarded = in_scratch && result.is_ok();
    let _ = std::fs::remove_dir_all(&scratch);
    if discarded {
        // Said once the terminal is back: what was done in the copy is gone.
        outln!(
            "toolgate: the working copy of demo.db was discarded with what you did in it; `toolgate demo --db FILE` keeps one at FILE"
        );
    }
    result.map_err(|e| match e {
        crate::tui::ConsoleError::Engine(e) => CliError::from(e),
        crate::tui::ConsoleError::Terminal(e) => CliError::new("TERMINAL", format!("terminal error: {}", e.kind())),
    })?;
    Ok(0)
}

pub(super) fn tempfile_dir() -> Result<PathBuf, CliError> {
    let dir = std::env::temp_dir().join(format!(
        "toolgate-console-{}-{}",
        std::process::id(),
        hex::encode(rand::random::<[u8; 4]>())
    ));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::new("TEMP_DIR", format!("cannot create a working directory: {}", e.kind())))?;
    Ok(dir)
}
