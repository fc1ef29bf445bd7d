//! The command line (docs/design.md §15). A stable contract: `--json` prints one JSON
//! document; exit codes are 0 ok, 1 the call's result is a failure or unknown,
//! 2 usage or environment error. Errors print a stable code and a message, never
//! a backtrace or a local path.

use crate::Coded;
use std::path::Path;
use std::sync::Arc;

use clap::Parser;
use serde_json::json;

use crate::engine::clock::{parse_rfc3339, Clock, ManualClock, SystemClock};
use crate::engine::projection::{Projection, UnknownProjection};
use crate::engine::{BulkAction, Engine, EngineError, EngineOptions};
use crate::store::Location;

/// `print!` through [`write_stdout`]: never panics on a closed pipe.
macro_rules! out {
    ($($t:tt)*) => { $crate::cli::write_stdout(&format!($($t)*)) };
}

/// `println!` through [`write_stdout`]: never panics on a closed pipe.
macro_rules! outln {
    () => { $crate::cli::write_stdout("\n") };
    ($($t:tt)*) => { $crate::cli::write_stdout(&format!("{}\n", format_args!($($t)*))) };
}

mod args;
mod bulk;
mod calls;
mod commands;
mod console;
mod observe;
mod principals;
mod runs;

pub use args::*;
use bulk::{bulk_command, bulk_resolve, print_outcome};
use calls::{print_envelope, read_args};
use console::console;
use observe::{metrics_command, print_detail, trace_command, trace_json};
use principals::{subject_command, tenant_command, token_command};
use runs::{cancel_command, lab_command, load_command, scenario_command, serve_command};

/// A CLI failure: stable code + message, exit 2.
#[derive(Debug)]
pub struct CliError {
    code: String,
    message: String,
    json: bool,
}

impl CliError {
    fn new(code: &str, message: impl Into<String>) -> Self {
        Self { code: code.to_string(), message: message.into(), json: false }
    }
}

/// Any floor's error becomes the CLI's the same way: its stable code and its
/// message.
impl<E: Coded> From<E> for CliError {
    fn from(e: E) -> Self {
        Self::new(e.code(), e.to_string())
    }
}

/// Runs the CLI with the process arguments; returns the exit code.
pub fn main() -> i32 {
    // A panic (there should be none) prints a short report, never the build
    // machine's source paths or a backtrace. The console wraps this hook with
    // its own, which restores the terminal first.
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "error[INTERNAL]: toolgate hit an internal error (a bug). Please report it with the command you ran."
        );
        // For whoever debugs toolgate itself: the panic's own words, on request only.
        if std::env::var_os("TOOLGATE_PANIC_DETAIL").is_some() {
            eprintln!("{info}");
        }
    }));
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let wants_json = command_wants_json(cli.command.as_ref());
    match run(&cli) {
        Ok(code) => code,
        Err(mut e) => {
            e.json |= wants_json;
            if e.json {
                outln!("{}", json!({"error": {"code": e.code, "message": e.message}}));
            } else {
                eprintln!("error[{}]: {}", e.code, e.message);
            }
            2
        }
    }
}

fn clock_from(now: Option<&str>) -> Result<Arc<dyn Clock>, CliError> {
    match now {
        None => Ok(Arc::new(SystemClock)),
        Some(s) => parse_rfc3339(s)
            .map(|ms| Arc::new(ManualClock::new(ms)) as Arc<dyn Clock>)
            .ok_or_else(|| CliError::new("BAD_TIME", "--now must be an RFC 3339 time, e.g. 2026-01-01T00:00:00Z")),
    }
}

fn db_path(cli: &Cli) -> Result<&Path, CliError> {
    cli.db.as_deref().ok_or_else(|| CliError::new("DB_REQUIRED", "--db PATH is required for this command"))
}

/// The engine options of a command: its clock and its catalog (`--catalog`).
fn engine_options(cli: &Cli) -> Result<EngineOptions, CliError> {
    let clock = clock_from(cli.now.as_deref())?;
    let toolset = crate::tools::load_toolset(cli.catalog.as_deref()).map_err(EngineError::from)?;
    Ok(EngineOptions { clock, ..EngineOptions::new(toolset) })
}

fn open(cli: &Cli) -> Result<Engine, CliError> {
    let path = db_path(cli)?;
    let engine = Engine::open(path, engine_options(cli)?)?;
    // Diagnostics go to `<db>.log` (or $TOOLGATE_LOG), never to the terminal.
    crate::telemetry::logging::init_for_db(path);
    tracing::info!(read_only = cli.read_only, pid = std::process::id(), "cli opened the ledger");
    Ok(engine)
}

/// Opens the ledger for a read command: read-only, never created, migrated or
/// written (an empty or foreign file is DB_NOT_TOOLGATE).
fn open_read(cli: &Cli) -> Result<Engine, CliError> {
    let path = db_path(cli)?;
    let engine = Engine::open_read_only(path, engine_options(cli)?)?;
    crate::telemetry::logging::init_for_db(path);
    tracing::info!(pid = std::process::id(), "cli opened the ledger read-only");
    Ok(engine)
}

fn refuse_read_only(cli: &Cli) -> Result<(), CliError> {
    if cli.read_only {
        return Err(CliError::new("READ_ONLY", "refused: --read-only is set"));
    }
    Ok(())
}

/// The `--project` choice, refused before anything is opened or dispatched.
fn projection(name: Option<&str>) -> Result<Option<Projection>, CliError> {
    name.map(|n| Projection::parse(n).map_err(|e| CliError::new(UnknownProjection::CODE, e.to_string()))).transpose()
}

fn print_json(v: &impl serde::Serialize) {
    outln!("{}", serde_json::to_string_pretty(v).unwrap_or_else(|_| "null".into()));
}

/// The database of `provider serve`: `--db PATH` (also `$TOOLGATE_DB`), or
/// `--provider-db PATH`; both only when they agree. A SQLite file: the
/// simulated providers keep no tables on PostgreSQL.
fn provider_serve_db<'a>(db: Option<&'a Path>, provider_db: Option<&'a Path>) -> Result<&'a Path, CliError> {
    let path = match (db, provider_db) {
        (Some(a), Some(b)) if a != b => {
            return Err(CliError::new("USAGE", "--db and --provider-db name two databases: give one"));
        }
        (Some(p), _) | (None, Some(p)) => p,
        (None, None) => {
            return Err(CliError::new("DB_REQUIRED", "provider serve needs the provider's database: --db PATH"));
        }
    };
    if Location::is_postgres(path) {
        return Err(CliError::new("USAGE", "the simulated providers keep their tables in a SQLite file: --db PATH"));
    }
    Ok(path)
}

fn run(cli: &Cli) -> Result<i32, CliError> {
    let Some(command) = &cli.command else {
        return console(cli, 0);
    };
    if command.writes() {
        refuse_read_only(cli)?;
    }
    match command {
        Command::DemoDb { out, seed, json } => commands::demo_db(out, *seed, *json),
        Command::Demo { agents } => console(cli, *agents),
        Command::Cancel(a) => cancel_command(cli, a),
        Command::Token { what } => token_command(cli, what),
        Command::Tenant { what } => tenant_command(cli, what),
        Command::Subject { what } => subject_command(cli, what),
        Command::Serve(a) => serve_command(cli, a),
        Command::Mcp { token, concurrency, queue, grace_ms } => {
            commands::mcp(cli, token, *concurrency, *queue, *grace_ms)
        }
        Command::Load(a) => load_command(cli, a),
        Command::Lab(a) => lab_command(cli, a),
        Command::Init { world, json } => commands::init(cli, world.as_deref(), *json),
        Command::Dispatch(a) => commands::dispatch(cli, a),
        Command::Query(a) if a.select.all => {
            let operator = cli.operator.clone().unwrap_or_default();
            bulk_command(cli, &a.select, a.tenant.as_deref(), &BulkAction::Query, &operator, a.json)
        }
        Command::Approve { approver, tenant, select, json, .. } if select.all => {
            bulk_command(cli, select, tenant.as_deref(), &BulkAction::Approve, approver, *json)
        }
        Command::Deny { approver, note, tenant, select, json, .. } if select.all => {
            bulk_command(cli, select, tenant.as_deref(), &BulkAction::Deny { note: note.clone() }, approver, *json)
        }
        Command::Resolve(a) if a.select.all => bulk_resolve(cli, a),
        Command::Query(a) => commands::query(cli, a),
        Command::Approve { approval_id, approver, json, .. } => {
            commands::approve(cli, approval_id.as_deref(), approver, *json)
        }
        Command::Deny { approval_id, approver, note, json, .. } => {
            commands::deny(cli, approval_id.as_deref(), approver, note, *json)
        }
        Command::Approvals { json } => commands::approvals(cli, *json),
        Command::Resolve(a) => commands::resolve(cli, a),
        Command::Ops { what } => commands::ops(cli, what),
        Command::Provider { what } => commands::provider(cli, what),
        Command::Counts { json } => commands::counts(cli, *json),
        Command::Grant(g) | Command::Revoke(g) => commands::grant_or_revoke(cli, g, command),
        Command::Orders { json } => commands::orders(cli, *json),
        Command::Reap { json } => commands::reap(cli, *json),
        Command::Vacuum { json } => commands::vacuum(cli, *json),
        Command::Clock { accept, json } => commands::clock(cli, *accept, *json),
        Command::Work { json } => commands::work(cli, *json),
        Command::Scenario { what } => scenario_command(what),
        Command::Catalog { what } => commands::catalog(what),
        Command::Trace(a) => trace_command(cli, a),
        Command::Metrics(a) => metrics_command(cli, a),
        Command::Bench { quick, json, dir, http } => commands::bench(cli, *quick, *json, dir.as_deref(), *http),
        Command::Audit { log, json } => commands::audit(cli, *log, *json),
    }
}

fn fmt_map(m: &std::collections::BTreeMap<String, i64>) -> String {
    if m.is_empty() {
        return "none".into();
    }
    m.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
}

// ------------------------------------------------------- tokens and serve

/// The operator an operator-log entry names: `--operator`, else `$USER`.
/// The operator a command acts as: `--operator`, else the login name (the
/// console's default too), else `operator`.
fn operator_or_user(cli: &Cli) -> String {
    cli.operator.clone().unwrap_or_else(crate::tui::default_operator)
}

/// Writes to stdout; a closed pipe (`| head`) is not an error worth a panic.
/// Writes to standard output. A reader that went away (`toolgate ops list |
/// head -1`) ends the command quietly with exit 0, as coreutils and ripgrep
/// do; any other write failure is reported once, without a panic.
///
/// The CLI prints no escape sequences of its own, so every control character
/// but the line breaks of its own layout is written out (`\u{1b}`): a stored
/// name or note cannot clear the screen or move the cursor. Stored free text
/// that may hold a line break goes through [`crate::display::escape`] first.
pub(crate) fn write_stdout(text: &str) {
    use std::io::Write as _;
    let safe: std::borrow::Cow<'_, str> = if text.chars().any(|c| c.is_control() && c != '\n') {
        text.split('\n').map(crate::display::escape).collect::<Vec<_>>().join("\n").into()
    } else {
        text.into()
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(safe.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            // Not `eprintln!`: on a closed terminal stderr fails too, and it
            // would panic instead of exiting with the code.
            let _ = writeln!(std::io::stderr(), "error[STDOUT_FAILED]: cannot write the output: {}", e.kind());
            std::process::exit(2);
        }
    }
}

fn operator_of(cli: &Cli, what: &str) -> Result<String, CliError> {
    cli.operator
        .clone()
        .ok_or_else(|| CliError::new("OPERATOR_REQUIRED", format!("--operator NAME is required to {what}")))
}
