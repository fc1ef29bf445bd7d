//! The operations console (ratatui + crossterm on tokio), The Elm Architecture:
//! crossterm events → keymap (per mode) → [`app::Action`] → [`app::App::update`]
//! → engine [`app::Request`]s on a channel → answers back as actions; rendering is
//! a pure function of the app ([`ui::render`]).
//!
//! The engine runs in its own threads ([`backend`]); this module never touches
//! the database.

pub mod app;
pub mod backend;
pub mod config;
pub mod format;
pub mod keymap;
pub mod ui;
pub mod walkthrough;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures_util::StreamExt;
use ratatui::crossterm::event::{
    DisableMouseCapture, EnableMouseCapture, Event, EventStream, KeyCode, KeyEventKind, KeyModifiers, MouseButton,
    MouseEventKind,
};
use ratatui::crossterm::execute;

use app::{Action, App};

use crate::engine::EngineError;

/// Why the console stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The engine could not start.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The terminal failed.
    #[error("terminal: {0}")]
    Terminal(#[from] std::io::Error),
}

/// What the console opens.
#[derive(Debug, Clone)]
pub struct ConsoleOptions {
    /// Database (a real ledger, or the demo's working copy).
    pub db: PathBuf,
    /// How the header names it.
    pub db_label: String,
    /// Operator identity.
    pub operator: String,
    /// Hide and refuse state-changing actions.
    pub read_only: bool,
    /// Run outbox workers and the reaper in this process.
    pub workers: bool,
    /// Scratch directory for walkthrough databases.
    pub scratch: PathBuf,
    /// Live counters of simulated agents running in this process (`toolgate demo`).
    pub load: Option<std::sync::Arc<crate::load::LoadStats>>,
    /// The tools (`--catalog`; the demo's by default).
    pub toolset: std::sync::Arc<crate::engine::tool::Toolset>,
}

/// The operator a console acts as without `--operator`: the login name
/// (`USER`, then `LOGNAME`, when it is a valid operator name), else
/// `operator`. `:operator NAME` changes it for the session.
pub fn default_operator() -> String {
    operator_from(|k| std::env::var(k).ok())
}

fn operator_from(var: impl Fn(&str) -> Option<String>) -> String {
    ["USER", "LOGNAME"]
        .into_iter()
        .filter_map(var)
        .map(|v| v.trim().to_string())
        .find(|v| crate::engine::check_name("the operator name", v, crate::engine::MAX_NAME_CHARS).is_ok())
        .unwrap_or_else(|| "operator".into())
}

/// Most frames per second when the engine is busy.
const FRAME: Duration = Duration::from_millis(33);

/// Maps a terminal event to an action through the current mode's keymap.
pub fn map_event(app: &App, ev: &Event) -> Option<Action> {
    // Too small to draw: only quit and resize (a key must not land in a
    // field or dialog nobody can see).
    if app.too_small() {
        return match ev {
            Event::Key(k)
                if k.kind == KeyEventKind::Press
                    && (k.code == KeyCode::Char('Q')
                        || (k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL))) =>
            {
                Some(Action::Quit)
            }
            Event::Resize(w, h) => Some(Action::Resize(*w, *h)),
            _ => None,
        };
    }
    match ev {
        Event::Key(k) if k.kind == KeyEventKind::Press => keymap::lookup(app.mode, k, app.read_only),
        Event::Mouse(m) => match m.kind {
            MouseEventKind::ScrollDown => Some(Action::Scroll(1)),
            MouseEventKind::ScrollUp => Some(Action::Scroll(-1)),
            MouseEventKind::Down(MouseButton::Left) => Some(Action::Click(m.column, m.row)),
            _ => None,
        },
        Event::Resize(w, h) => Some(Action::Resize(*w, *h)),
        _ => None,
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Copies text to the terminal's clipboard with OSC 52.
fn osc52(text: &str) {
    let b64 = base64::engine::general_purpose::STANDARD.encode(text);
    let mut out = std::io::stdout();
    let _ = write!(out, "\x1b]52;c;{b64}\x07");
    let _ = out.flush();
}

/// Runs the console until the user quits. The terminal is restored on every
/// exit path, and on panic (ratatui's hook, extended to mouse capture).
pub fn run(opts: &ConsoleOptions) -> Result<(), ConsoleError> {
    let (ev_tx, ev_rx) = tokio::sync::mpsc::unbounded_channel::<Action>();
    // Start the engine before taking over the terminal (a bad database is a
    // plain error) and outside the async runtime: the engine's threads are
    // plain threads, and a blocking database driver (PostgreSQL's) must never
    // be opened from a thread that is driving asynchronous tasks.
    let backend = backend::spawn(
        &backend::BackendOptions {
            path: opts.db.clone(),
            operator: opts.operator.clone(),
            workers: opts.workers && !opts.read_only,
            read_only: opts.read_only,
            scratch: opts.scratch.clone(),
            exe: std::env::current_exe().ok(),
            load: opts.load.clone(),
            toolset: opts.toolset.clone(),
        },
        ev_tx,
    )?;
    // I/O enabled for the signal driver (SIGHUP, SIGTERM).
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().enable_io().build()?;
    rt.block_on(run_async(opts, backend, ev_rx))
}

async fn run_async(
    opts: &ConsoleOptions,
    backend: backend::Backend,
    mut ev_rx: tokio::sync::mpsc::UnboundedReceiver<Action>,
) -> Result<(), ConsoleError> {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    // The hook from before ratatui's: ratatui's restores with `restore`, which
    // on a terminal that hung up reports its failure on stderr, which fails
    // too and panics inside the hook (the process aborted before the caller
    // removed the working copy). Ours uses `try_restore`.
    let hook = std::panic::take_hook();
    let mut terminal = ratatui::try_init()?;
    drop(std::panic::take_hook());
    std::panic::set_hook(Box::new(move |info| {
        let _ = execute!(std::io::stdout(), DisableMouseCapture);
        let _ = ratatui::try_restore();
        hook(info);
    }));
    let _ = execute!(std::io::stdout(), EnableMouseCapture);
    let result = event_loop(&mut terminal, opts, no_color, &backend, &mut ev_rx).await;
    let _ = execute!(std::io::stdout(), DisableMouseCapture);
    let _ = ratatui::try_restore();
    // A terminal that cannot show its cursor again is gone (hung up): its
    // drop would try again and report on stderr, which panics.
    if terminal.show_cursor().is_err() {
        std::mem::forget(terminal);
    }
    backend.shutdown();
    result
}

/// The signals that end the console as `Q` does (so the caller cleans up,
/// e.g. removes the demo's working copy): the terminal hung up (SIGHUP, its
/// window closed) or the process was asked to stop (SIGTERM).
struct Stop {
    #[cfg(unix)]
    hup: tokio::signal::unix::Signal,
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
}

impl Stop {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self { hup: signal(SignalKind::hangup())?, term: signal(SignalKind::terminate())? })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// Resolves when one of the signals arrives.
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.hup.recv() => {}
            _ = self.term.recv() => {}
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    }
}

async fn event_loop(
    terminal: &mut ratatui::DefaultTerminal,
    opts: &ConsoleOptions,
    no_color: bool,
    backend: &backend::Backend,
    ev_rx: &mut tokio::sync::mpsc::UnboundedReceiver<Action>,
) -> Result<(), ConsoleError> {
    let mut app = App::new(opts.db_label.clone(), opts.operator.clone(), opts.read_only, no_color, now_ms());
    let size = terminal.size()?;
    app.size = (size.width, size.height);
    let prefs_path = config::path();
    // A damaged settings file is said and left alone (never overwritten).
    let mut prefs_writable = prefs_path.is_some();
    match prefs_path.as_deref().map(config::load) {
        None => app.said_prefs("no config directory (XDG_CONFIG_HOME, HOME): filters and sorts are not kept", true),
        Some(Ok(None)) => {}
        Some(Ok(Some(p))) => {
            let dropped = app.restore(&p);
            if !dropped.is_empty() {
                app.said_prefs(format!("settings: left out {}", dropped.join("; ")), true);
            }
        }
        Some(Err(e)) => {
            prefs_writable = false;
            let name = prefs_path.as_deref().map_or_else(String::new, |p| p.display().to_string());
            app.said_prefs(
                format!("settings file {name} is damaged and ignored ({e}); it is not overwritten: fix or remove it"),
                true,
            );
        }
    }
    let _ = backend.requests.send(app.fetch());
    let mut stop = Stop::new()?;
    let mut events = EventStream::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut last_tick_second = 0;
    let mut dirty = true;
    let mut last_draw = Instant::now().checked_sub(FRAME).unwrap_or_else(Instant::now);
    loop {
        if dirty && last_draw.elapsed() >= FRAME {
            let mut extent = 0;
            terminal.draw(|f| extent = ui::render(&app, f))?;
            if extent != app.body_extent {
                app.update(Action::BodyExtent(extent));
            }
            last_draw = Instant::now();
            dirty = false;
        }
        let action = tokio::select! {
            ev = events.next() => match ev {
                Some(Ok(e)) => {
                    // Input draws at once; engine answers are capped at FRAME.
                    last_draw = Instant::now().checked_sub(FRAME).unwrap_or_else(Instant::now);
                    map_event(&app, &e)
                }
                Some(Err(e)) => return Err(e.into()),
                None => Some(Action::Quit),
            },
            a = ev_rx.recv() => a,
            // Closed or stopped: leave as Q does, so the caller cleans up.
            () = stop.recv() => return Ok(()),
            _ = tick.tick() => {
                let now = now_ms();
                // Countdowns move once a second.
                if now / 1000 == last_tick_second {
                    None
                } else {
                    last_tick_second = now / 1000;
                    Some(Action::Tick(now))
                }
            }
        };
        let Some(action) = action else { continue };
        dirty = true;
        if let Some(req) = app.update(action) {
            let _ = backend.requests.send(req);
        }
        for req in app.pending_requests.drain(..) {
            let _ = backend.requests.send(req);
        }
        if let Some(text) = app.clipboard.take() {
            osc52(&text);
        }
        if std::mem::take(&mut app.prefs_dirty) && prefs_writable {
            if let Some(Err(e)) = prefs_path.as_deref().map(|p| config::save(p, &app.prefs())) {
                prefs_writable = false;
                app.said_prefs(format!("settings not saved: {e}"), true);
            }
        }
        if app.quit {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(env: &[(&str, &str)], expect: &str) {
        let got = operator_from(|k| env.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_string()));
        assert_eq!(got, expect);
    }

    #[test]
    fn the_default_operator_is_the_login_name() {
        check(&[("USER", "dana"), ("LOGNAME", "other")], "dana");
        check(&[("LOGNAME", "erin")], "erin");
        check(&[("USER", ""), ("LOGNAME", "erin")], "erin");
        check(&[("USER", "a\u{1b}b")], "operator");
        check(&[], "operator");
    }
}
