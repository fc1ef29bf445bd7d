//! The console: screens (insta snapshots at 80×24 and 140×40), colours, key
//! handling (the engine requests each key emits), the walkthrough, and a smoke
//! test of the real binary in a pseudo-terminal.

use ratatui::backend::TestBackend;
use ratatui::buffer::Buffer;
use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
use ratatui::style::Color;
use ratatui::Terminal;
use toolgate::engine::{Engine, EngineOptions, Resolution};
use toolgate::store::OpsView;
use toolgate::tui::app::{Action, App, EngineEvent, Mode, Pane, Request, Rows};
use toolgate::tui::{keymap, ui};

/// A working copy of the committed demo database, re-based to a fixed instant, so
/// screens are deterministic.
const NOW: i64 = 1_800_000_000_000;

struct Demo {
    dir: tempfile::TempDir,
    engine: Engine,
    _pg: Option<crate::support::PgDb>,
}

fn demo() -> Demo {
    demo_on(crate::support::Backend::Sqlite)
}

/// The demo's working copy on a backend (on PostgreSQL: generated into a new database).
fn demo_on(backend: crate::support::Backend) -> Demo {
    let dir = tempfile::tempdir().unwrap();
    let pg = (backend == crate::support::Backend::Postgres).then(|| crate::support::PgDb::new().unwrap());
    let path = match &pg {
        None => toolgate::demo::working_copy(dir.path(), NOW).unwrap(),
        Some(db) => toolgate::demo::working_copy_at(std::path::Path::new(&db.url), NOW).unwrap(),
    };
    let clock = toolgate::engine::clock::ManualClock::new(NOW);
    let engine =
        Engine::open(&path, EngineOptions { clock: std::sync::Arc::new(clock), ..EngineOptions::default() }).unwrap();
    Demo { dir, engine, _pg: pg }
}

fn page(d: &mut Demo, pane: Pane, limit: i64) -> EngineEvent {
    let e = &mut d.engine;
    let rows = match pane {
        Pane::Live => Rows::Live(e.live_page("", toolgate::tui::app::default_order(Pane::Live), None, limit).unwrap()),
        Pane::Ledger => Rows::Ops(
            e.ops_page(OpsView::All, "", toolgate::tui::app::default_order(Pane::Ledger), None, limit).unwrap(),
        ),
        Pane::Unknown => Rows::Ops(
            e.ops_page(OpsView::Unknown, "", toolgate::tui::app::default_order(Pane::Unknown), None, limit).unwrap(),
        ),
        Pane::Approvals => Rows::Approvals(
            e.approvals_page("", toolgate::tui::app::default_order(Pane::Approvals), None, limit).unwrap(),
        ),
        Pane::Audit => {
            Rows::Audit(e.audit_page("", toolgate::tui::app::default_order(Pane::Audit), None, limit).unwrap())
        }
        Pane::Walkthrough => Rows::Empty,
        Pane::Metrics => Rows::Metrics(Box::new(
            toolgate::telemetry::metrics::snapshot(
                e,
                toolgate::telemetry::metrics::Window::last_minutes(15),
                &toolgate::telemetry::metrics::Slice::default(),
            )
            .unwrap(),
        )),
    };
    EngineEvent::Page { pane, rows, header: e.header_counts().unwrap() }
}

fn app_on(d: &mut Demo, pane: Pane, w: u16, h: u16) -> App {
    let mut app = App::new("demo.db (working copy)", "alice", false, false, NOW);
    app.size = (w, h);
    app.update(Action::SelectPane(pane));
    let limit = app.visible_rows();
    let mut ev = page(d, pane, limit);
    // Latencies in the demo database were measured when it was generated: pin
    // them so the screen snapshot checks the layout, not a stopwatch.
    if let EngineEvent::Page { rows: Rows::Metrics(m), .. } = &mut ev {
        for l in m.latency_window.iter_mut().chain(m.latency_all_time.iter_mut()) {
            l.percentiles =
                Some(toolgate::telemetry::histogram::Percentiles { p50_us: 1_200, p95_us: 35_000, p99_us: 70_000 });
        }
    }
    app.update(Action::Engine(ev));
    app
}

fn draw(app: &App, w: u16, h: u16) -> Buffer {
    let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
    t.draw(|f| ui::render(app, f)).unwrap();
    t.backend().buffer().clone()
}

fn text(b: &Buffer) -> String {
    let mut s = String::new();
    for y in 0..b.area.height {
        let line: String = (0..b.area.width).map(|x| b[(x, y)].symbol().to_string()).collect();
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

fn key(c: char) -> Action {
    keymap::lookup(Mode::Normal, &KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE), false).unwrap()
}

fn press(app: &mut App, code: KeyCode) -> Option<Request> {
    let action = keymap::lookup(app.mode, &KeyEvent::new(code, KeyModifiers::NONE), app.read_only)?;
    app.update(action)
}

#[test]
fn every_pane_at_two_sizes() {
    let mut d = demo();
    for (w, h) in [(80u16, 24u16), (140, 40)] {
        for pane in [Pane::Live, Pane::Ledger, Pane::Approvals, Pane::Unknown, Pane::Audit, Pane::Metrics] {
            let app = app_on(&mut d, pane, w, h);
            insta::assert_snapshot!(format!("pane_{}_{w}x{h}", pane.title().to_lowercase()), text(&draw(&app, w, h)));
        }
    }
}

#[test]
fn popups_and_detail_at_two_sizes() {
    let mut d = demo();
    for (w, h) in [(80u16, 24u16), (140, 40)] {
        let mut app = app_on(&mut d, Pane::Approvals, w, h);
        app.update(key('a'));
        insta::assert_snapshot!(format!("confirm_approve_{w}x{h}"), text(&draw(&app, w, h)));
        app.update(Action::Back);
        app.update(key('d'));
        for c in "too much".chars() {
            app.update(Action::Input(c));
        }
        insta::assert_snapshot!(format!("form_deny_{w}x{h}"), text(&draw(&app, w, h)));

        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        app.update(key('r'));
        insta::assert_snapshot!(format!("form_resolve_{w}x{h}"), text(&draw(&app, w, h)));
        app.update(Action::Back);
        app.update(key('?'));
        insta::assert_snapshot!(format!("help_{w}x{h}"), text(&draw(&app, w, h)));
        app.update(Action::ToggleHelp);
        let req = app.update(Action::OpenDetail);
        let Some(Request::Detail(id)) = req else { panic!("detail request expected, got {req:?}") };
        let detail = d.engine.operation_detail(&id).unwrap().unwrap();
        app.update(Action::Engine(EngineEvent::Detail(Box::new(detail))));
        insta::assert_snapshot!(format!("detail_{w}x{h}"), text(&draw(&app, w, h)));
    }
}

fn cell_with(b: &Buffer, needle: &str) -> (u16, u16) {
    for y in 0..b.area.height {
        let line: String = (0..b.area.width).map(|x| b[(x, y)].symbol().to_string()).collect();
        if let Some(i) = line.find(needle) {
            return (line[..i].chars().count() as u16, y);
        }
    }
    panic!("{needle:?} not on screen")
}

#[test]
fn the_duplicate_counter_is_green_at_zero_and_red_otherwise() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 140, 40);
    let b = draw(&app, 140, 40);
    let (x, y) = cell_with(&b, "duplicate effects");
    let counter = (x + 18..x + 22).find(|cx| b[(*cx, y)].symbol() == "0").unwrap();
    assert_eq!(b[(counter, y)].style().fg, Some(Color::Green));
    app.header.side_effect_duplicates = 2;
    let b = draw(&app, 140, 40);
    let counter = (x + 18..x + 22).find(|cx| b[(*cx, y)].symbol() == "2").unwrap();
    assert_eq!(b[(counter, y)].style().fg, Some(Color::Red));
    // NO_COLOR: no colours at all, the counter still stands out (reversed, bold).
    app.no_color = true;
    let b = draw(&app, 140, 40);
    assert!(b.content.iter().all(|c| c.style().fg.is_none() || c.style().fg == Some(Color::Reset)));
}

#[test]
fn approval_expiring_within_a_minute_is_red() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 140, 40);
    let Rows::Approvals(rows) = &app.rows else { panic!() };
    let exp = rows[0].expires_at;
    app.update(Action::Tick(exp - 30_000));
    let b = draw(&app, 140, 40);
    let (x, y) = cell_with(&b, "30s");
    assert_eq!(b[(x, y)].style().fg, Some(Color::Red));
    app.update(Action::Tick(exp - 300_000));
    let b = draw(&app, 140, 40);
    let (x, y) = cell_with(&b, "5m00s");
    assert_ne!(b[(x, y)].style().fg, Some(Color::Red));
}

#[test]
fn approve_sends_the_id_the_operator_saw_and_confirm_defaults_to_cancel() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 140, 40);
    let Rows::Approvals(rows) = &app.rows else { panic!() };
    let seen = rows[app.selected].id.clone();
    assert_eq!(app.update(key('a')), None, "opening the dialog sends nothing");
    let dialog = text(&draw(&app, 140, 40));
    assert!(dialog.contains("may approve: alice, bob"), "the dialog shows who may approve:\n{dialog}");
    assert_eq!(app.mode, Mode::Confirm);
    assert_eq!(press(&mut app, KeyCode::Enter), None, "Enter on the default button cancels");
    assert_eq!(app.mode, Mode::Normal);
    app.update(key('a'));
    press(&mut app, KeyCode::Tab);
    assert_eq!(press(&mut app, KeyCode::Enter), Some(Request::Approve { approval_id: seen }));
}

#[test]
fn query_and_resolve_send_what_was_shown() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 140, 40);
    let Rows::Ops(rows) = &app.rows else { panic!() };
    let op = rows[0].clone();
    app.update(key('q'));
    press(&mut app, KeyCode::Right);
    assert_eq!(press(&mut app, KeyCode::Enter), Some(Request::Query { operation_id: op.id.clone() }));
    // Resolve: failed (chosen: nothing is pre-selected), with a note; the dialog carries the version seen.
    app.update(key('r'));
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Tab);
    press(&mut app, KeyCode::Enter);
    assert!(app.form.as_ref().unwrap().error.as_deref().unwrap().contains("note"), "a note is required");
    for c in "provider has no record".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    press(&mut app, KeyCode::Enter);
    assert_eq!(app.mode, Mode::Confirm);
    press(&mut app, KeyCode::Tab);
    assert_eq!(
        press(&mut app, KeyCode::Enter),
        Some(Request::Resolve {
            operation_id: op.id.clone(),
            resolution: Resolution::Failed,
            note: "provider has no record".into(),
            evidence: None,
            seen_version: op.version,
        })
    );
    // Succeeded needs a receipt id.
    app.update(key('r'));
    press(&mut app, KeyCode::Left);
    press(&mut app, KeyCode::Tab);
    press(&mut app, KeyCode::Tab);
    for c in "ok".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    press(&mut app, KeyCode::Enter);
    assert!(app.form.as_ref().unwrap().error.as_deref().unwrap().contains("receipt"));
}

#[test]
fn read_only_hides_and_refuses_state_changes() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 140, 40);
    app.read_only = true;
    for c in ['q', 'a', 'd', 'r', 'c'] {
        // Not ignored silently: the key says why nothing happens.
        let k = KeyEvent::new(KeyCode::Char(c), KeyModifiers::NONE);
        let action = keymap::lookup(Mode::Normal, &k, true).unwrap();
        assert!(matches!(action, Action::ReadOnly(_)), "{c}: {action:?}");
        app.status = None;
        assert_eq!(app.update(action), None);
        assert_eq!(app.mode, Mode::Normal);
        let (said, error) = app.status.clone().unwrap();
        assert!(error && said.starts_with("read-only (--read-only)"), "{c}: {said}");
    }
    assert_eq!(app.update(Action::AskApprove), None);
    assert_eq!(app.mode, Mode::Normal);
    assert!(keymap::help_lines(Mode::Normal, true).iter().all(|(k, _)| !["q", "a", "d", "r"].contains(k)));
    assert!(!text(&draw(&app, 140, 40)).contains(" a approve"));
}

#[test]
fn panes_filter_copy_pause_and_quit() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Ledger, 140, 40);
    assert!(matches!(app.update(key('5')), Some(Request::Fetch { pane: Pane::Audit, .. })));
    assert!(matches!(press(&mut app, KeyCode::Tab), Some(Request::Fetch { pane: Pane::Walkthrough, .. })));
    app.update(key('2'));
    app.update(key('/'));
    for c in "unknown".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    let req = press(&mut app, KeyCode::Enter);
    assert!(
        matches!(req, Some(Request::Fetch { pane: Pane::Ledger, ref filter, .. }) if filter == "unknown"),
        "{req:?}"
    );
    app.update(Action::Engine(page(&mut d, Pane::Ledger, 30)));
    app.update(key('y'));
    assert!(app.clipboard.as_deref().is_some_and(|c| c.starts_with("op_")));
    assert_eq!(app.update(key(' ')), Some(Request::SetLive(false)));
    assert!(text(&draw(&app, 140, 40)).contains("PAUSED"));
    app.update(key('Q'));
    assert!(app.quit);
    let ctrl_c = KeyEvent::new(KeyCode::Char('c'), KeyModifiers::CONTROL);
    assert_eq!(keymap::lookup(Mode::Form, &ctrl_c, false), Some(Action::Quit));
}

#[test]
fn walkthrough_steps_scenario_4_to_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = toolgate::tui::walkthrough::Walkthrough::new(dir.path().to_path_buf(), None);
    let mut app = App::new("demo", "alice", false, false, NOW);
    app.size = (140, 40);
    app.update(Action::SelectPane(Pane::Walkthrough));
    let EngineEvent::Walkthrough(v) = w.view() else { panic!() };
    let four = v.scenarios.iter().position(|(n, _)| n == "4").unwrap();
    w.select(four);
    for _ in 0..40 {
        w.step();
        let EngineEvent::Walkthrough(v) = w.view() else { panic!() };
        if !v.more {
            break;
        }
    }
    app.update(Action::Engine(w.view()));
    let screen = text(&draw(&app, 140, 40));
    assert!(!app.walkthrough.more);
    assert!(app.walkthrough.steps.len() >= 6, "{screen}");
    assert!(app.walkthrough.steps.iter().all(|s| s.verdict == "PASS"), "{screen}");
    assert!(screen.contains("simulated in process"), "the screen says how the crash ran");
    assert!(screen.contains("receipt_rec"), "{screen}");
    assert_eq!(
        app.walkthrough.steps.last().unwrap().effects,
        app.walkthrough.steps.iter().map(|s| s.effects).max().unwrap()
    );
}

#[cfg(unix)]
#[test]
fn smoke_the_real_binary_in_a_pseudo_terminal() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let pty = portable_pty::native_pty_system();
    let pair = pty.openpty(portable_pty::PtySize { rows: 40, cols: 140, pixel_width: 0, pixel_height: 0 }).unwrap();
    let mut cmd = portable_pty::CommandBuilder::new(env!("CARGO_BIN_EXE_toolgate"));
    cmd.args(["--operator", "smoke"]);
    cmd.env("TERM", "xterm-256color");
    let mut child = pair.slave.spawn_command(cmd).unwrap();
    drop(pair.slave);
    let parser = Arc::new(Mutex::new(vt100::Parser::new(40, 140, 0)));
    let mut reader = pair.master.try_clone_reader().unwrap();
    let p = parser.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            p.lock().unwrap().process(&buf[..n]);
        }
    });
    let mut writer = pair.master.take_writer().unwrap();
    let screen = || parser.lock().unwrap().screen().contents();
    let wait_for = |needle: &str| {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if screen().contains(needle) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{needle:?} never appeared:\n{}", screen());
    };
    wait_for("Outcome unknown");
    wait_for("OUTCOME_UNKNOWN");
    writer.write_all(b"?").unwrap();
    wait_for("Keys (? or Esc to close)");
    writer.write_all(b"2").unwrap();
    wait_for("Idempotency ledger");
    // The page arrives from the engine thread after the pane switch: `q` acts on
    // the selected row, so wait for the rows (the table header), not the title.
    wait_for("result ref / code");
    writer.write_all(b"q").unwrap();
    wait_for("Status query");
    writer.write_all(b"\r").unwrap();
    wait_for("cancelled");
    // issue 19: the command bar opens a prefix into a detail (with why it is stuck).
    writer.write_all(b":op op_5706\r").unwrap();
    wait_for("Operation detail");
    wait_for("does not know the key");
    writer.write_all(b"\x1b").unwrap();
    // Sort the Unknown pane both ways.
    writer.write_all(b":unknown\r").unwrap();
    wait_for("sort updated ↑");
    writer.write_all(b":sort since\r").unwrap();
    wait_for("sort since ↑");
    writer.write_all(b"S").unwrap();
    wait_for("sort since ↓");
    // Too small, then back.
    parser.lock().unwrap().screen_mut().set_size(20, 60);
    pair.master.resize(portable_pty::PtySize { rows: 20, cols: 60, pixel_width: 0, pixel_height: 0 }).unwrap();
    wait_for("terminal too small: need 80×24, have 60×20");
    parser.lock().unwrap().screen_mut().set_size(24, 80);
    pair.master.resize(portable_pty::PtySize { rows: 24, cols: 80, pixel_width: 0, pixel_height: 0 }).unwrap();
    wait_for("sort since ↓");
    writer.write_all(b"Q").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the console did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "clean exit: {status:?}");
}

#[test]
fn demo_runs_on_the_database_path_it_is_given() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("class.db");
    let pty = portable_pty::native_pty_system();
    let pair = pty.openpty(portable_pty::PtySize { rows: 40, cols: 140, pixel_width: 0, pixel_height: 0 }).unwrap();
    let mut cmd = portable_pty::CommandBuilder::new(env!("CARGO_BIN_EXE_toolgate"));
    cmd.arg("demo");
    cmd.arg("--agents");
    cmd.arg("1");
    cmd.arg("--db");
    cmd.arg(&db);
    cmd.env("TERM", "xterm-256color");
    let mut child = pair.slave.spawn_command(cmd).unwrap();
    drop(pair.slave);
    let mut reader = pair.master.try_clone_reader().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
        }
    });
    let mut writer = pair.master.take_writer().unwrap();
    let start = Instant::now();
    while !db.exists() {
        assert!(start.elapsed() < Duration::from_secs(20), "no database at the given path");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500));
    writer.write_all(b"Q").unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "the console did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "clean exit: {status:?}");
    // The demo ran there: a demo database with the demo's operations, kept after exit.
    let c = crate::support::raw(&db);
    let demo: String = c.query_row("SELECT value FROM meta WHERE key = 'demo'", [], |r| r.get(0)).unwrap();
    assert_eq!(demo, "1");
    let ops: i64 = c.query_row("SELECT count(*) FROM operations", [], |r| r.get(0)).unwrap();
    assert!(ops >= 10, "{ops}");
    // A file that is not a demo database is refused, and left as it was.
    let fx = crate::support::Fixture::new();
    let before = crate::support::snapshot(fx.path());
    let pair = pty.openpty(portable_pty::PtySize { rows: 24, cols: 80, pixel_width: 0, pixel_height: 0 }).unwrap();
    let mut cmd = portable_pty::CommandBuilder::new(env!("CARGO_BIN_EXE_toolgate"));
    cmd.args(["demo", "--db"]);
    cmd.arg(fx.path());
    let mut child = pair.slave.spawn_command(cmd).unwrap();
    drop(pair.slave);
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(crate::support::snapshot(fx.path()), before);
}

#[test]
fn keys_typed_in_one_burst_each_act_on_the_state_the_previous_one_left() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Live, 140, 40);
    // `4 g q` arrive before pane 4's page does.
    assert!(matches!(app.update(key('4')), Some(Request::Fetch { pane: Pane::Unknown, .. })));
    assert_eq!(app.update(key('g')), None);
    assert_eq!(app.update(key('q')), None);
    assert_ne!(app.mode, Mode::Confirm, "q waits for the rows");
    // The page arrives: g then q act on it, the query asks about the first unknown row.
    let limit = app.visible_rows();
    let ev = page(&mut d, Pane::Unknown, limit);
    app.update(Action::Engine(ev));
    assert_eq!(app.mode, Mode::Confirm, "{:?}", app.status);
    let Rows::Ops(rows) = &app.rows else { panic!() };
    assert_eq!(app.selected, 0);
    assert!(app.confirm.is_some() && !rows.is_empty());
    assert!(!app.status.as_ref().is_some_and(|(s, _)| s.contains("select an unknown operation")), "{:?}", app.status);
}

#[test]
fn damaged_rows_never_panic_a_pane_or_the_detail_view_and_are_marked() {
    let mut d = demo();
    let path = d.dir.path().join("demo.db");
    let c = crate::support::raw(&path);
    c.execute_batch(
        "PRAGMA ignore_check_constraints = ON;
         UPDATE operations SET key_sha256 = 'é', request_sha256 = substr(request_sha256, 1, 3),
                status_ref = 'ééééééééééééééééééééééé', updated_at = -9223372036854775808,
                state_since = 9223372036854775807, deadline_at = -9223372036854775808
          WHERE id = (SELECT id FROM operations WHERE state = 'unknown' ORDER BY id LIMIT 1);
         UPDATE operations SET state = 'bogus\u{1b}[2J' WHERE id = (SELECT id FROM operations WHERE state = 'succeeded' ORDER BY id LIMIT 1);
         UPDATE approvals SET request_sha256 = 'x', expires_at = -9223372036854775808;
         UPDATE outbox SET available_at = -9223372036854775808, lease_until = 9223372036854775807;",
    )
    .unwrap();
    drop(c);
    for pane in Pane::ALL {
        for (w, h) in [(80, 24), (140, 40)] {
            let mut app = app_on(&mut d, pane, w, h);
            app.now_ms = i64::MAX;
            let screen = text(&draw(&app, w, h));
            if pane == Pane::Ledger && w >= 100 {
                assert!(screen.contains("!é"), "the damaged digest is marked:\n{screen}");
            }
            assert!(!screen.contains('\u{1b}'), "{screen}");
            // The detail view of every row on the page.
            for i in 0..8 {
                app.selected = i;
                if let Some(id) = app.selected_id().filter(|id| id.starts_with("op_")) {
                    if let Some(detail) = d.engine.operation_detail(&id).unwrap() {
                        app.update(Action::Engine(EngineEvent::Detail(Box::new(detail))));
                        app.mode = Mode::Detail;
                        let _ = draw(&app, w, h);
                        app.mode = Mode::Normal;
                    }
                }
            }
        }
    }
    // The audit names the damage.
    let findings = d.engine.audit().unwrap();
    assert!(findings.iter().any(|f| f.detail.contains("request_sha256 does not recompute")), "{findings:?}");
    assert!(findings.iter().any(|f| f.check == "state"), "{findings:?}");
}

#[test]
fn approvals_that_cannot_be_decided_are_refused_before_any_dialog_with_the_reason() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 140, 40);
    let Rows::Approvals(rows) = &app.rows else { panic!() };
    let (acme, globex) = (rows[0].clone(), rows[1].clone());
    assert_eq!(globex.tenant, "globex");
    // alice is not on globex's list: said at once, with who may approve, and no dialog.
    app.selected = 1;
    for k in ['a', 'd'] {
        app.status = None;
        assert_eq!(app.update(key(k)), None);
        assert_eq!(app.mode, Mode::Normal, "{k}: no dialog");
        let (said, error) = app.status.clone().unwrap();
        assert!(error && said.contains("not on globex's approver list") && said.contains("gina"), "{said}");
    }
    // An expired request: refused before the dialog, and not counted as pending.
    app.selected = 0;
    app.update(Action::Tick(acme.expires_at));
    assert_eq!(app.update(key('a')), None);
    assert_eq!(app.mode, Mode::Normal);
    assert!(app.status.clone().unwrap().0.contains("expired"), "{:?}", app.status);
    let screen = text(&draw(&app, 140, 40));
    assert!(screen.contains("Pending approvals (1; 1 expired"), "{screen}");
    let mut e = d.engine;
    assert_eq!(e.header_counts().unwrap().pending_approvals, 2, "the engine's clock is still before expiry");
}

#[test]
fn the_resolve_dialog_preselects_nothing_does_not_wrap_and_says_what_each_decision_needs() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 140, 40);
    app.update(key('r'));
    let form = app.form.clone().unwrap();
    assert_eq!(form.choice, None, "no decision pre-selected");
    assert!(text(&draw(&app, 140, 40)).contains("no decision yet"));
    // Enter without a decision: asks for one.
    press(&mut app, KeyCode::Enter);
    assert!(app.form.as_ref().unwrap().error.as_deref().unwrap().contains("choose a decision"));
    // Right Right: failed, then compensated (no wrap to succeeded); a third Right stays.
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    assert_eq!(app.form.as_ref().unwrap().choice, Some(2));
    assert!(text(&draw(&app, 140, 40)).contains("compensated: the effect was undone elsewhere; needs a note"));
    // Left stops at succeeded, whose receipt field comes before the note.
    for _ in 0..5 {
        press(&mut app, KeyCode::Left);
    }
    assert_eq!(app.form.as_ref().unwrap().choice, Some(0));
    press(&mut app, KeyCode::Tab);
    for c in "rcpt_1".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    press(&mut app, KeyCode::Tab);
    for c in "seen in the dashboard".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    let f = app.form.clone().unwrap();
    assert_eq!((f.evidence.as_str(), f.note.as_str()), ("rcpt_1", "seen in the dashboard"));
}

#[test]
fn the_filter_applies_to_every_pane_and_an_empty_filtered_pane_says_so() {
    let mut d = demo();
    let all = d.engine.audit_page("", toolgate::tui::app::default_order(Pane::Audit), None, 100).unwrap();
    // The demo's operator log has one entry about agent_ben's operations.
    let ben = d.engine.audit_page("agent_ben", toolgate::tui::app::default_order(Pane::Audit), None, 100).unwrap();
    assert!(!ben.is_empty() && ben.len() < all.len(), "{} of {}", ben.len(), all.len());
    for r in &ben {
        let op = r.operation_id.clone().unwrap();
        assert_eq!(d.engine.operation_detail(&op).unwrap().unwrap().operation.subject, "agent_ben", "{r:?}");
    }
    assert!(d
        .engine
        .audit_page("globex", toolgate::tui::app::default_order(Pane::Audit), None, 100)
        .unwrap()
        .is_empty());
    assert_eq!(
        d.engine
            .audit_page("alice", toolgate::tui::app::default_order(Pane::Audit), None, 100)
            .unwrap()
            .iter()
            .filter(|r| r.actor != "alice")
            .count(),
        0
    );
    // Live with a filter that hides its rows says the filter hides them, not that nothing is in flight.
    let mut app = app_on(&mut d, Pane::Live, 140, 40);
    app.filter = "globex".into();
    let rows = d.engine.live_page("globex", toolgate::tui::app::default_order(Pane::Live), None, 10).unwrap();
    app.update(Action::Engine(EngineEvent::Page {
        pane: Pane::Live,
        rows: Rows::Live(rows),
        header: d.engine.header_counts().unwrap(),
    }));
    let screen = text(&draw(&app, 140, 40));
    assert!(screen.contains("no row matches the filter"), "{screen}");
    assert!(!screen.contains("nothing in flight"), "{screen}");
}

/// Every `.rs` file under `dir` (relative to the crate), with its text.
fn sources(dir: &str) -> Vec<(std::path::PathBuf, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut out = Vec::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if p.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        } else if p.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&p).unwrap();
            out.push((p, text));
        }
    }
    out
}

#[test]
fn the_model_never_imports_the_view_and_the_engine_no_terminal_crate() {
    // issue 19 §8: the view imports the model, never the reverse.
    let model: Vec<_> =
        ["src/tui/app.rs", "src/tui/app", "src/tui/format.rs"].iter().flat_map(|d| sources(d)).collect();
    assert!(model.len() >= 3, "{model:?}");
    for (path, text) in &model {
        for needle in ["super::ui", "tui::ui", "ratatui::", "crossterm::"] {
            assert!(!text.contains(needle), "{} names {needle}", path.display());
        }
    }
    let engine = sources("src/engine");
    assert!(!engine.is_empty());
    for (path, text) in &engine {
        for needle in ["ratatui", "crossterm"] {
            assert!(!text.contains(needle), "{} names {needle}", path.display());
        }
    }
}

fn type_text(app: &mut App, s: &str) -> Vec<Request> {
    s.chars().filter_map(|c| press(app, KeyCode::Char(c))).collect()
}

#[test]
fn the_command_bar_switches_panes_completes_and_keeps_a_history() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Ledger, 80, 24);
    assert_eq!(press(&mut app, KeyCode::Char(':')), None);
    assert_eq!(app.mode, Mode::Command);
    assert!(type_text(&mut app, "unk").is_empty(), "typing sends nothing");
    assert_eq!(press(&mut app, KeyCode::Tab), None);
    assert_eq!(app.command.input, "unknown");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(req, Some(Request::Fetch { pane: Pane::Unknown, .. })), "{req:?}");
    assert_eq!((app.mode, app.pane), (Mode::Normal, Pane::Unknown));
    let limit = app.visible_rows();
    app.update(Action::Engine(page(&mut d, Pane::Unknown, limit)));
    // An unknown command: the error line, the bar stays open with the line, nothing is sent.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "frobnicate");
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    assert_eq!(app.mode, Mode::Command);
    assert_eq!(app.command.input, "frobnicate");
    insta::assert_snapshot!("command_error_80x24", text(&draw(&app, 80, 24)));
    // Esc closes it; Up brings back earlier lines, newest first.
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Normal);
    press(&mut app, KeyCode::Char(':'));
    press(&mut app, KeyCode::Up);
    assert_eq!(app.command.input, "frobnicate");
    press(&mut app, KeyCode::Up);
    assert_eq!(app.command.input, "unknown");
    press(&mut app, KeyCode::Down);
    press(&mut app, KeyCode::Down);
    assert_eq!(app.command.input, "");
    // :filter sets the filter every pane uses; :filter alone clears it.
    type_text(&mut app, "filter acme");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(&req, Some(Request::Fetch { pane: Pane::Unknown, filter, .. }) if filter == "acme"), "{req:?}");
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(&req, Some(Request::Fetch { filter, .. }) if filter.is_empty()), "{req:?}");
    // Several completions are listed under the bar.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "a");
    press(&mut app, KeyCode::Tab);
    assert_eq!(app.command.candidates, vec!["approvals".to_string(), "audit".into()]);
    press(&mut app, KeyCode::Esc);
    // :q quits.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "q");
    press(&mut app, KeyCode::Enter);
    assert!(app.quit);
}

#[test]
fn op_opens_a_prefix_and_an_ambiguous_prefix_lists_the_matches() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Ledger, 80, 24);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "op op_");
    let req = press(&mut app, KeyCode::Enter);
    let Some(Request::FindOperation { prefix, limit }) = req else { panic!("{req:?}") };
    assert_eq!(prefix, "op_");
    // The engine's answer: every demo operation starts with op_.
    let ids = d.engine.operation_ids_with_prefix(&prefix, limit).unwrap();
    assert_eq!(ids.len() as i64, limit, "more than are shown");
    let answer = EngineEvent::Found { asked: prefix.clone(), prefix: Some(prefix), ids: ids.clone() };
    assert_eq!(app.update(Action::Engine(answer)), None);
    assert_eq!(app.mode, Mode::Command, "back in the bar to type more");
    assert_eq!(app.command.input, "op op_");
    assert_eq!(app.command.candidates.len(), toolgate::tui::app::MATCHES_SHOWN);
    assert!(app.command.more);
    insta::assert_snapshot!("command_op_ambiguous_80x24", text(&draw(&app, 80, 24)));
    // Type more, Tab completes among the listed ids, Enter looks the full id up and opens it.
    let target = ids[3].clone();
    type_text(&mut app, &target[3..8]);
    press(&mut app, KeyCode::Tab);
    assert_eq!(app.command.input, format!("op {target}"));
    let req = press(&mut app, KeyCode::Enter);
    assert_eq!(req, Some(Request::FindOperation { prefix: target.clone(), limit }));
    let ids = d.engine.operation_ids_with_prefix(&target, limit).unwrap();
    assert_eq!(ids, vec![target.clone()]);
    let req =
        app.update(Action::Engine(EngineEvent::Found { asked: target.clone(), prefix: Some(target.clone()), ids }));
    assert_eq!(req, Some(Request::Detail(target)));
    assert_eq!(app.mode, Mode::Detail);
    // No match is an error on the status line.
    let req = app.update(Action::Engine(EngineEvent::Found {
        asked: "op_zz".into(),
        prefix: Some("op_zz".into()),
        ids: vec![],
    }));
    assert_eq!(req, None);
    assert!(app.status.as_ref().is_some_and(|(s, e)| *e && s.contains("no operation matches op_zz")));
}

#[test]
fn prefix_lookup_treats_like_wildcards_as_themselves_and_key_lookup_needs_the_tenant() {
    let mut d = demo();
    let all = d.engine.operation_ids_with_prefix("op_", 1000).unwrap();
    assert!(all.len() >= 10);
    assert!(all.windows(2).all(|w| w[0] < w[1]), "in id order");
    // `_` and `%` are not wildcards; case matters; nothing odd panics.
    for p in ["o__", "op%", "%", "OP_", "op_\\", "'; DROP TABLE operations; --"] {
        assert!(d.engine.operation_ids_with_prefix(p, 1000).unwrap().is_empty(), "{p}");
    }
    let one = &all[0];
    assert_eq!(&d.engine.operation_ids_with_prefix(one, 10).unwrap(), &vec![one.clone()]);
    // By idempotency key: the key's tenant finds it, another tenant does not.
    let c = crate::support::raw(&d.dir.path().join("demo.db"));
    let (key, tenant): (String, String) = c
        .query_row("SELECT idem_key, tenant FROM operations WHERE id = ?1", [one], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap();
    assert_eq!(d.engine.operation_ids_with_key(&key, &tenant, 10).unwrap(), vec![one.clone()]);
    assert!(d.engine.operation_ids_with_key(&key, "no-such-tenant", 10).unwrap().is_empty());
    // The command bar sends it, and does not echo the key on screen.
    let mut app = app_on(&mut d, Pane::Ledger, 80, 24);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, &format!("key {key} --tenant {tenant}"));
    let req = press(&mut app, KeyCode::Enter);
    assert_eq!(req, Some(Request::FindByKey { key: key.clone(), tenant, limit: 9 }));
    assert!(!text(&draw(&app, 80, 24)).contains(&key));
}

#[test]
fn help_lists_the_commands_and_scrolls() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    press(&mut app, KeyCode::Char('?'));
    assert_eq!(app.mode, Mode::Help);
    let first = text(&draw(&app, 80, 24));
    assert!(first.contains("j/k scroll 0/"), "{first}");
    for _ in 0..40 {
        press(&mut app, KeyCode::Char('j'));
    }
    assert_eq!(app.mode, Mode::Help, "j scrolls the help, it does not close it");
    let last = text(&draw(&app, 80, 24));
    for c in toolgate::tui::app::COMMANDS {
        assert!(last.contains(&format!(":{}", c.name)), "{} missing:\n{last}", c.name);
    }
    assert!(last.contains(":op ID-OR-PREFIX"), "{last}");
    // At 200×50 everything fits: no scrolling, no line cut.
    let mut app = app_on(&mut d, Pane::Unknown, 200, 50);
    press(&mut app, KeyCode::Char('?'));
    let all = text(&draw(&app, 200, 50));
    assert!(!all.contains("j/k scroll") && all.contains(":key KEY --tenant T"), "{all}");
    assert!(all.contains("Audit, Walkthrough, Metrics)") && all.contains("/ compensated)"), "{all}");
}

#[test]
fn the_readme_names_every_command_and_every_normal_key() {
    let readme = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    for c in toolgate::tui::app::COMMANDS {
        assert!(readme.contains(&format!("`:{}", c.name)), "README lacks :{}", c.name);
    }
    // Every single-character key of the normal keymap has a row (or a mention) in the key table.
    let table: String = readme.lines().filter(|l| l.starts_with("| ")).collect::<Vec<_>>().join("\n");
    for (keys, _) in keymap::help_lines(Mode::Normal, false) {
        for k in keys.split([' ', '/']).filter(|k| k.chars().count() == 1) {
            assert!(table.contains(&format!("`{k}`")), "README's key table lacks `{k}` ({keys})");
        }
    }
}

/// The detail of the demo operation in `state` (the first by id).
fn detail_in(d: &mut Demo, state: &str, query: Option<&str>) -> toolgate::engine::OperationDetail {
    let c = crate::support::raw(&d.dir.path().join("demo.db"));
    let id: String = c
        .query_row(
            "SELECT id FROM operations WHERE state = ?1 AND coalesce(last_query_result, '') = ?2 ORDER BY id LIMIT 1",
            [state, query.unwrap_or("")],
            |r| r.get(0),
        )
        .unwrap();
    d.engine.operation_detail(&id).unwrap().unwrap()
}

fn detail_screen(detail: toolgate::engine::OperationDetail) -> String {
    let mut app = App::new("demo.db (working copy)", "alice", false, false, NOW);
    app.size = (80, 24);
    app.mode = Mode::Detail;
    app.detail = Some(Box::new(detail));
    text(&draw(&app, 80, 24))
}

#[test]
fn why_is_this_stuck_one_sentence_per_state_and_reason() {
    let mut d = demo();
    let never = detail_in(&mut d, "unknown", None);
    let not_found = detail_in(&mut d, "unknown", Some("not_found"));
    let mismatch = detail_in(&mut d, "needs_review", Some("mismatch"));
    let accepted = detail_in(&mut d, "accepted", None);
    assert!(accepted.attempts.iter().all(toolgate::store::AttemptRow::proven_not_received), "{accepted:?}");
    let succeeded = detail_in(&mut d, "succeeded", None);
    let mut unavailable = not_found.clone();
    unavailable.operation.last_query_result = Some("unavailable".into());
    let mut cancelled = never.clone();
    cancelled.audit.push(toolgate::store::AuditRow {
        seq: 99,
        at: NOW - 20_000,
        action_id: None,
        actor: "bob".into(),
        action: "cancel".into(),
        operation_id: Some(never.operation.id.clone()),
        approval_id: None,
        result: "applied".into(),
        reason: "customer called".into(),
        evidence: "{}".into(),
        chain_sha256: None,
    });
    // In flight: a lease held, a lease expired, past the deadline; accepted and due.
    let mut leased = accepted.clone();
    leased.operation.state = toolgate::store::OpState::InFlight;
    leased.operation.deadline_at = NOW + 60_000;
    let ob = leased.outbox.as_mut().unwrap();
    ob.state = toolgate::store::OutboxState::Leased;
    ob.lease_owner = Some("w-2".into());
    ob.lease_until = Some(NOW + 25_000);
    ob.attempt = 7;
    let mut expired = leased.clone();
    expired.outbox.as_mut().unwrap().lease_until = Some(NOW - 4_000);
    expired.operation.deadline_at = NOW - 1_000;
    // The demo's accepted operation: its retry was due and its deadline passed (no worker ran).
    let due = accepted.clone();
    let mut waits = accepted.clone();
    waits.outbox.as_mut().unwrap().available_at = NOW + 12_000;
    waits.operation.deadline_at = NOW + 60_000;
    let cases = [
        ("unknown_never_queried", never, "no status query yet", "Press q"),
        ("unknown_cancelled_after_send", cancelled, "Cancelled by bob", "Press q"),
        ("unknown_not_found", not_found, "does not know the key", "Press r"),
        ("unknown_unavailable", unavailable, "could not be reached", "Press q"),
        ("needs_review_mismatch", mismatch, "does not match this request", "Press r"),
        ("accepted_retry_waits", waits, "the next waits until", "a worker takes it"),
        ("accepted_due_past_deadline", due, "Its deadline passed", "nothing was sent"),
        ("in_flight_lease_held", leased, "Lease held by worker w-2", "wait for the worker"),
        ("in_flight_lease_expired", expired, "expired 4s ago", "reaper"),
    ];
    for (name, detail, sentence, next) in cases {
        let why = toolgate::tui::app::explain(&detail, NOW).unwrap_or_else(|| panic!("{name}: no sentence"));
        assert!(why.sentence.contains(sentence), "{name}: {why:?}");
        assert!(why.next.contains(next), "{name}: {why:?}");
        let screen = detail_screen(detail);
        assert!(
            screen.lines().nth(6).is_some_and(|l| l.trim_start().starts_with("why")),
            "{name}: opens with it\n{screen}"
        );
        insta::assert_snapshot!(format!("why_{name}_80x24"), screen);
    }
    assert_eq!(toolgate::tui::app::explain(&succeeded, NOW), None, "a terminal operation is not stuck");
    assert!(!detail_screen(succeeded).contains(" why "));
}

#[test]
fn keys_in_the_detail_view_act_on_its_operation_and_come_back_to_it() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Ledger, 80, 24);
    let target = detail_in(&mut d, "unknown", Some("not_found"));
    // Opened by :op, the operation need not be the selected row.
    app.selected = 1;
    app.update(Action::Engine(EngineEvent::Found {
        asked: target.operation.id.clone(),
        prefix: Some(target.operation.id.clone()),
        ids: vec![target.operation.id.clone()],
    }));
    app.update(Action::Engine(EngineEvent::Detail(Box::new(target.clone()))));
    assert_eq!(app.mode, Mode::Detail);
    press(&mut app, KeyCode::Char('y'));
    assert_eq!(app.clipboard.as_deref(), Some(target.operation.id.as_str()), "y copies the detail's id");
    press(&mut app, KeyCode::Char('q'));
    assert_eq!(app.mode, Mode::Confirm);
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Detail, "a cancelled dialog returns to the detail");
    press(&mut app, KeyCode::Char('q'));
    press(&mut app, KeyCode::Tab);
    let req = press(&mut app, KeyCode::Enter);
    assert_eq!(req, Some(Request::Query { operation_id: target.operation.id.clone() }));
    assert_eq!(app.mode, Mode::Detail);
    // The answer refreshes the pane and the detail.
    let req = app.update(Action::Engine(EngineEvent::Done { ok: true, summary: "query: ok".into() }));
    assert!(matches!(req, Some(Request::Fetch { .. })), "{req:?}");
    assert_eq!(app.pending_requests, vec![Request::Detail(target.operation.id.clone())]);
    // r opens the resolve form for it; c says why it does not apply to an unknown operation.
    press(&mut app, KeyCode::Char('r'));
    assert!(
        matches!(&app.form.as_ref().unwrap().kind, toolgate::tui::app::FormKind::Resolve { operation_id, .. } if *operation_id == target.operation.id)
    );
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Detail);
    press(&mut app, KeyCode::Char('c'));
    let (said, err) = app.status.clone().unwrap();
    assert!(err && said.contains("is unknown: cannot cancel"), "{said}");
    // Read-only: the keys say why they do nothing.
    app.read_only = true;
    let k = KeyEvent::new(KeyCode::Char('q'), KeyModifiers::NONE);
    assert!(matches!(keymap::lookup(Mode::Detail, &k, true), Some(Action::ReadOnly(_))));
}

#[test]
fn the_unknown_pane_says_why_in_a_short_column() {
    let mut d = demo();
    for (w, h) in [(80u16, 24u16), (140, 40)] {
        let app = app_on(&mut d, Pane::Unknown, w, h);
        let screen = text(&draw(&app, w, h));
        for reason in ["reply lost, not queried: q", "provider has no record: r", "receipt mismatch: r"] {
            assert!(screen.contains(reason), "{w}x{h} lacks {reason:?}:\n{screen}");
        }
    }
}

#[test]
fn s_cycles_the_sort_column_big_s_reverses_and_sort_names_one() {
    use toolgate::store::Order;
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    assert_eq!(app.sort_label().as_deref(), Some("updated ↑"), "Unknown: oldest first");
    let req = press(&mut app, KeyCode::Char('s'));
    assert!(matches!(req, Some(Request::Fetch { order: Order { column: 1, desc: false }, .. })), "{req:?}");
    let req = press(&mut app, KeyCode::Char('S'));
    assert!(
        matches!(req, Some(Request::Fetch { order: Order { column: 1, desc: true }, cursor: None, .. })),
        "{req:?}"
    );
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "sort since desc");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(req, Some(Request::Fetch { order: Order { column: 2, desc: true }, .. })), "{req:?}");
    let limit = app.visible_rows();
    let rows = d.engine.ops_page(OpsView::Unknown, "", app.order(), None, limit).unwrap();
    app.update(Action::Engine(EngineEvent::Page {
        pane: Pane::Unknown,
        rows: Rows::Ops(rows),
        header: d.engine.header_counts().unwrap(),
    }));
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.contains("sort since ↓") && screen.contains("since ↓"), "{screen}");
    insta::assert_snapshot!("pane_unknown_sorted_since_desc_80x24", screen);
    // Each pane keeps its own order; the Approvals default is soonest expiry first.
    app.update(Action::SelectPane(Pane::Approvals));
    assert_eq!(app.sort_label().as_deref(), Some("expires ↑"));
    app.update(Action::SelectPane(Pane::Unknown));
    assert_eq!(app.sort_label().as_deref(), Some("since ↓"));
    // A column the pane does not have: the error names the ones it has; nothing is sent.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "sort amount");
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    let e = app.command.error.clone().unwrap();
    assert!(e.contains("no column \"amount\"") && e.contains("since, created"), "{e}");
    // Tab completes the pane's columns after `sort `.
    press(&mut app, KeyCode::Esc);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "sort cr");
    press(&mut app, KeyCode::Tab);
    assert_eq!(app.command.input, "sort created");
    // Walkthrough and Metrics have no table to sort.
    press(&mut app, KeyCode::Esc);
    app.update(Action::SelectPane(Pane::Metrics));
    assert_eq!(press(&mut app, KeyCode::Char('s')), None);
    assert!(app.status.as_ref().is_some_and(|(s, e)| *e && s.contains("no table to sort")));
}

/// Pages of `page` rows through `fetch`, in `order`, until a short page.
fn all_pages<R: Clone>(
    mut fetch: impl FnMut(Option<&toolgate::store::Cursor>, i64) -> Vec<R>,
    cursor_of: impl Fn(&R) -> toolgate::store::Cursor,
) -> Vec<R> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = fetch(cursor.as_ref(), 3);
        out.extend(page.iter().cloned());
        if page.len() < 3 {
            return out;
        }
        cursor = page.last().map(&cursor_of);
        assert!(out.len() < 10_000, "paging does not end");
    }
}

fn check_order<R: Clone + PartialEq + std::fmt::Debug>(
    what: &str,
    cols: &[toolgate::store::SortColumn<R>],
    tie: fn(&R) -> toolgate::store::Key,
    mut fetch: impl FnMut(toolgate::store::Order, Option<&toolgate::store::Cursor>, i64) -> Vec<R>,
) {
    use toolgate::store::{cursor_after, Key, Order};
    let cmp = |a: &Key, b: &Key| match (a, b) {
        (Key::Int(x), Key::Int(y)) => x.cmp(y),
        (Key::Text(x), Key::Text(y)) => x.as_bytes().cmp(y.as_bytes()),
        _ => panic!("mixed keys"),
    };
    for column in 0..cols.len() {
        for desc in [false, true] {
            let order = Order { column, desc };
            let whole = fetch(order, None, 10_000);
            assert!(whole.len() >= 2, "{what}: too few rows to check");
            // In order: by the column, then the tie-breaker, in the direction asked.
            for w in whole.windows(2) {
                let (a, b) = (&w[0], &w[1]);
                let mut o = cmp(&(cols[column].key)(a), &(cols[column].key)(b)).then(cmp(&tie(a), &tie(b)));
                if desc {
                    o = o.reverse();
                }
                assert_eq!(
                    o,
                    std::cmp::Ordering::Less,
                    "{what} by {} desc={desc}: {a:?} then {b:?}",
                    cols[column].name
                );
            }
            // Keyset pages of 3 give the same rows in the same order, none twice.
            let paged = all_pages(|c, n| fetch(order, c, n), |r| cursor_after(cols, order, r, tie(r)));
            assert_eq!(paged, whole, "{what} by {} desc={desc}", cols[column].name);
        }
    }
}

fn every_sort_column_pages_by_keyset_in_both_directions(backend: crate::support::Backend) {
    use toolgate::store::{Key, APPROVALS_SORT, AUDIT_SORT, LIVE_SORT, OPS_SORT};
    let mut d = demo_on(backend);
    let e = &mut d.engine;
    check_order(
        "ledger",
        OPS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.ops_page(OpsView::All, "", o, c, n).unwrap(),
    );
    check_order(
        "unknown",
        OPS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.ops_page(OpsView::Unknown, "", o, c, n).unwrap(),
    );
    check_order(
        "ledger filtered",
        OPS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.ops_page(OpsView::All, "acme", o, c, n).unwrap(),
    );
    check_order("audit", AUDIT_SORT, |r| Key::Int(r.seq), |o, c, n| e.audit_page("", o, c, n).unwrap());
    check_order(
        "approvals",
        APPROVALS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.approvals_page("", o, c, n).unwrap(),
    );
    // The demo has one live row: page through it anyway (nothing lost, nothing twice).
    for column in 0..LIVE_SORT.len() {
        for desc in [false, true] {
            let order = toolgate::store::Order { column, desc };
            let whole = e.live_page("", order, None, 100).unwrap();
            let paged = all_pages(
                |c, n| e.live_page("", order, c, n).unwrap(),
                |r| toolgate::store::cursor_after(LIVE_SORT, order, r, Key::Text(r.operation_id.clone())),
            );
            assert_eq!(paged, whole);
        }
    }
}

#[test]
fn money_reads_as_money_in_the_pane_and_both_dialogs() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 80, 24);
    let pane = text(&draw(&app, 80, 24));
    assert!(pane.contains("1,200.00 EUR") && !pane.contains("120000"), "{pane}");
    app.selected = 0;
    let Rows::Approvals(rows) = &app.rows else { panic!() };
    let refund = rows.iter().position(|a| a.tool == "create_refund").unwrap();
    app.selected = refund;
    app.update(key('a'));
    let approve = text(&draw(&app, 80, 24));
    app.update(Action::Back);
    app.update(key('d'));
    let deny = text(&draw(&app, 80, 24));
    for screen in [&approve, &deny] {
        for what in ["1,200.00 EUR  (120000 minor units)", "order       ord_1002", "requester agent_ana", "expires in"]
        {
            assert!(screen.contains(what), "{what:?} missing:\n{screen}");
        }
    }
    // The deny confirm carries it too.
    type_text(&mut app, "wrong order");
    press(&mut app, KeyCode::Enter);
    let c = app.confirm.clone().unwrap();
    assert!(
        c.evidence.iter().any(|e| e.contains("1,200.00 EUR")) && c.evidence.last().unwrap().contains("wrong order")
    );
}

#[test]
fn below_80x24_the_console_says_what_it_needs_and_recovers() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    for (w, h) in [(79u16, 24u16), (80, 23), (40, 10), (20, 3)] {
        assert!(app.update(Action::Resize(w, h)).is_none(), "shrinking fetches nothing");
        let screen = text(&draw(&app, w, h));
        assert!(screen.contains("terminal too small"), "{w}x{h}:\n{screen}");
        if w >= 44 {
            assert!(screen.contains(&format!("need 80×24, have {w}×{h}")), "{screen}");
        }
    }
    insta::assert_snapshot!("too_small_60x20", text(&draw(&app, 60, 20)));
    // Growing back: a fetch for the taller page, and the pane is drawn again.
    assert!(matches!(app.update(Action::Resize(80, 24)), Some(Request::Fetch { .. })));
    let screen = text(&draw(&app, 80, 24));
    assert!(!screen.contains("too small") && screen.contains("Outcome unknown"), "{screen}");
    assert!(screen.lines().nth(3).unwrap().contains("7 Metrics"), "every tab fits:\n{screen}");
    // The active filter stays visible at 80 columns.
    app.filter = "tenant:acme state:unknown".into();
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.lines().nth(2).unwrap().contains("filter /tenant:acme state:unknown"), "{screen}");
}

crate::on_both_backends!(every_sort_column_pages_by_keyset_in_both_directions);
