//! The console: screens (insta snapshots at 80×24, 120×40, 140×40 and 200×50), colours, key
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
        Engine::open(&path, EngineOptions { clock: std::sync::Arc::new(clock), ..toolgate::tools::demo_options() })
            .unwrap();
    Demo { dir, engine, _pg: pg }
}

fn page(d: &mut Demo, pane: Pane, limit: i64) -> EngineEvent {
    let e = &mut d.engine;
    let rows = match pane {
        Pane::Live => Rows::Live(
            e.live_page(
                &toolgate::store::Filter::default(),
                toolgate::tui::app::default_order(Pane::Live),
                None,
                limit,
            )
            .unwrap(),
        ),
        Pane::Ledger => Rows::Ops(
            e.ops_page(
                OpsView::All,
                &toolgate::store::Filter::default(),
                toolgate::tui::app::default_order(Pane::Ledger),
                None,
                limit,
            )
            .unwrap(),
        ),
        Pane::Unknown => Rows::Ops(
            e.ops_page(
                OpsView::Unknown,
                &toolgate::store::Filter::default(),
                toolgate::tui::app::default_order(Pane::Unknown),
                None,
                limit,
            )
            .unwrap(),
        ),
        Pane::Approvals => Rows::Approvals(
            e.approvals_page(
                &toolgate::store::Filter::default(),
                toolgate::tui::app::default_order(Pane::Approvals),
                None,
                limit,
            )
            .unwrap(),
        ),
        Pane::Audit => Rows::Audit(
            e.audit_page(
                &toolgate::store::Filter::default(),
                toolgate::tui::app::default_order(Pane::Audit),
                None,
                limit,
            )
            .unwrap(),
        ),
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
    t.draw(|f| {
        ui::render(app, f);
    })
    .unwrap();
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

/// The sizes every pane and popup is drawn at (issue 19 §7: 80×24, 120×40, 200×50; and 140×40).
const SIZES: [(u16, u16); 4] = [(80, 24), (120, 40), (140, 40), (200, 50)];

#[test]
fn every_pane_at_each_size() {
    let mut d = demo();
    let scratch = tempfile::tempdir().unwrap();
    let walk = toolgate::tui::walkthrough::Walkthrough::new(scratch.path().to_path_buf(), None);
    for (w, h) in SIZES {
        for pane in Pane::ALL {
            let mut app = app_on(&mut d, pane, w, h);
            if pane == Pane::Walkthrough {
                app.update(Action::Engine(walk.view()));
                assert!(!app.walkthrough.scenarios.is_empty());
            }
            let screen = text(&draw(&app, w, h));
            fits(&screen, w, h);
            insta::assert_snapshot!(format!("pane_{}_{w}x{h}", pane.title().to_lowercase()), screen);
        }
    }
}

/// What every screen keeps at any size: the header's first line and the tabs
/// whole, the status and key lines, and no line longer than the terminal.
fn fits(screen: &str, w: u16, h: u16) {
    fits_under(screen, w, h, true);
}

/// [`fits`]; `tabs: false` for a panel that covers them at this size.
fn fits_under(screen: &str, w: u16, h: u16, tabs: bool) {
    let lines: Vec<&str> = screen.lines().collect();
    assert_eq!(lines.len(), usize::from(h), "{screen}");
    assert!(lines.iter().all(|l| l.chars().count() <= usize::from(w)), "{screen}");
    assert!(lines[0].starts_with("toolgate demo.db (working copy)  operator alice"), "{screen}");
    let walk = if w < 100 { "6 Walk │" } else { "6 Walkthrough │" };
    assert!(!tabs || (lines[3].contains(walk) && lines[3].contains("7 Metrics")), "the tabs are whole:\n{screen}");
    assert!(
        lines[usize::from(h) - 1].ends_with("? help  Q quit")
            || lines[usize::from(h) - 1].contains("Enter run")
            || lines[usize::from(h) - 1].ends_with("Esc go back  Ctrl-C quit"),
        "{screen}"
    );
}

#[test]
fn popups_and_detail_at_each_size() {
    let mut d = demo();
    for (w, h) in SIZES {
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
        // The marks' popups: the one bulk confirm, the shared-note form, and an
        // ambiguous :op listing its matches.
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        let req = app.update(key('V'));
        app.update(Action::Engine(marked(&mut d, req)));
        app.update(key('q'));
        insta::assert_snapshot!(format!("popup_bulk_query_{w}x{h}"), text(&draw(&app, w, h)));
        app.update(Action::Back);
        app.update(key('r'));
        insta::assert_snapshot!(format!("popup_bulk_resolve_{w}x{h}"), text(&draw(&app, w, h)));
        app.update(Action::Back);
        press(&mut app, KeyCode::Char(':'));
        type_text(&mut app, "op op_");
        let Some(Request::FindOperation { prefix, limit }) = press(&mut app, KeyCode::Enter) else { panic!() };
        let ids = d.engine.operation_ids_with_prefix(&prefix, limit).unwrap();
        app.update(Action::Engine(EngineEvent::Found { asked: prefix.clone(), prefix: Some(prefix), ids }));
        insta::assert_snapshot!(format!("popup_op_matches_{w}x{h}"), text(&draw(&app, w, h)));
        // The command bar open, with a half-typed command.
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        press(&mut app, KeyCode::Char(':'));
        type_text(&mut app, "sort sin");
        let screen = text(&draw(&app, w, h));
        assert!(screen.lines().last().is_some_and(|l| l.starts_with(":sort sin")), "{screen}");
        insta::assert_snapshot!(format!("popup_command_bar_{w}x{h}"), screen);
        // One status query, confirmed (Cancel focused).
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        app.update(key('q'));
        assert_eq!(app.mode, Mode::Confirm);
        let screen = text(&draw(&app, w, h));
        fits(&screen, w, h);
        insta::assert_snapshot!(format!("confirm_query_{w}x{h}"), screen);
        // Cancel: the note, then the confirm that says what cancelling means.
        let mut app = app_on(&mut d, Pane::Live, w, h);
        app.update(key('c'));
        assert_eq!(app.mode, Mode::Form);
        type_text(&mut app, "customer withdrew");
        press(&mut app, KeyCode::Enter);
        assert_eq!(app.mode, Mode::Confirm);
        let screen = text(&draw(&app, w, h));
        fits(&screen, w, h);
        insta::assert_snapshot!(format!("confirm_cancel_{w}x{h}"), screen);
        // The lab panel, on the demo database.
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        let s = d.engine.lab_state().unwrap();
        app.update(Action::Engine(EngineEvent::Lab(toolgate::tui::app::LabView {
            demo: s.demo,
            toggle: s.toggle,
            fault_bp: s.fault_bp,
            masked_conflicts: s.masked_conflicts,
            agents: None,
        })));
        app.update(key('L'));
        assert_eq!(app.mode, Mode::Lab);
        let screen = text(&draw(&app, w, h));
        // At 80×24 the panel takes the whole height, over the tabs.
        fits_under(&screen, w, h, h > 24);
        assert!(screen.contains("Esc: close"), "the panel's key line is whole:\n{screen}");
        insta::assert_snapshot!(format!("popup_lab_{w}x{h}"), screen);
        // A bulk status query under way: its gauge on the status line.
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        let req = app.update(key('V'));
        app.update(Action::Engine(marked(&mut d, req)));
        app.update(key('q'));
        press(&mut app, KeyCode::Tab);
        assert!(matches!(press(&mut app, KeyCode::Enter), Some(Request::Bulk { .. })));
        app.update(Action::Engine(EngineEvent::BulkProgress { verb: "query".into(), done: 2, total: 5 }));
        let screen = text(&draw(&app, w, h));
        fits(&screen, w, h);
        assert!(screen.contains("bulk query 2/5"), "{screen}");
        insta::assert_snapshot!(format!("bulk_gauge_{w}x{h}"), screen);
    }
}

/// The line of `screen` that holds `needle`.
fn line_of<'a>(screen: &'a str, needle: &str) -> &'a str {
    screen.lines().find(|l| l.contains(needle)).unwrap_or_else(|| panic!("{needle:?} not on screen:\n{screen}"))
}

#[test]
fn the_metrics_pane_shows_each_tools_budget_breaker_and_rate_limit_cooldown() {
    let mut d = demo();
    let screen = text(&draw(&app_on(&mut d, Pane::Metrics, 140, 40), 140, 40));
    assert!(line_of(&screen, "budget").contains("rate-limit cooldown"), "{screen}");
    let refund = line_of(&screen, "create_refund");
    assert!(refund.contains(" 10/10 ") && refund.contains(" closed ") && refund.ends_with(" none"), "{screen}");
    // The payments circuit opens (its cool-down is 5 s), the budget is spent down
    // to 2.5 retries, and the demo's rate-limited operation waits 30 s more.
    let c = crate::support::raw(&d.dir.path().join("demo.db"));
    c.execute("UPDATE circuits SET state = 'open', open_until = ?1 WHERE downstream = 'payments'", [NOW + 20_000])
        .unwrap();
    c.execute("UPDATE retry_budgets SET tokens_milli = 2500 WHERE tool = 'create_refund'", []).unwrap();
    let limited = c
        .execute(
            "UPDATE outbox SET available_at = ?1 WHERE last_code = 'RATE_LIMIT' AND state = 'pending'",
            [NOW + 30_000],
        )
        .unwrap();
    assert_eq!(limited, 1);
    let app = app_on(&mut d, Pane::Metrics, 140, 40);
    let screen = text(&draw(&app, 140, 40));
    let refund = line_of(&screen, "create_refund");
    assert!(refund.contains(" 2.5/10 ") && refund.contains("open since 08:00:15, probe 08:00:20"), "{screen}");
    assert!(refund.contains("1 op wait until 08:00:30"), "{screen}");
    assert!(line_of(&screen, "notify_customer").contains("closed"), "another downstream: {screen}");
    insta::assert_snapshot!("metrics_resilience_open_140x40", screen);
    // At 80 columns, three lines per tool say the same.
    let app = app_on(&mut d, Pane::Metrics, 80, 24);
    let screen = text(&draw(&app, 80, 24));
    for fact in [
        "create_refund  retries 2.5/10",
        "breaker open since 08:00:15\n",
        "           probe 08:00:20\n",
        "rate limit 1 op wait until 08:00:30",
    ] {
        assert!(screen.contains(fact), "{fact}: {screen}");
    }
    insta::assert_snapshot!("metrics_resilience_open_80x24", screen);
    // And the latency table's tool names are whole at 80 columns.
    assert!(line_of(&screen, "1.2ms").starts_with("create_refund   "), "{screen}");
    // Past the cool-down the next send is the probe; half-open, the probe is out.
    let mut later = app.clone();
    later.update(Action::Tick(NOW + 21_000));
    assert!(text(&draw(&later, 80, 24)).contains("           probe due\n"));
    c.execute("UPDATE circuits SET state = 'half_open', open_until = NULL, probe_until = ?1", [NOW + 3_000]).unwrap();
    let screen = text(&draw(&app_on(&mut d, Pane::Metrics, 140, 40), 140, 40));
    assert!(line_of(&screen, "create_refund").contains("half-open, probe out until 08:00:03"), "{screen}");
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
fn failed_on_a_tool_that_cannot_be_asked_states_no_evidence_in_the_confirm() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 140, 40);
    let Rows::Ops(rows) = &app.rows else { panic!() };
    let op = rows[0].clone();
    app.update(Action::Engine(EngineEvent::Tools { unaskable: [op.tool.clone()].into_iter().collect() }));
    app.update(key('r'));
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Tab);
    for c in "no way to ask".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    press(&mut app, KeyCode::Enter);
    assert_eq!(app.mode, Mode::Confirm);
    let dialog = text(&draw(&app, 140, 40));
    assert!(dialog.contains("none either way"), "the confirm states what confirming means:\n{dialog}");
    press(&mut app, KeyCode::Tab);
    assert_eq!(
        press(&mut app, KeyCode::Enter),
        Some(Request::Resolve {
            operation_id: op.id.clone(),
            resolution: Resolution::Failed,
            note: "no way to ask".into(),
            evidence: None,
            seen_version: op.version,
            no_evidence: true,
            against_evidence: false,
        })
    );
}

/// Issue 32 §2: `toolgate demo --db EMPTY` answered NOT_A_DEMO_DB after
/// making the empty file a ledger, and `toolgate --db EMPTY` opened it as one;
/// a refused run left an empty working directory (and a `.log` beside a
/// foreign file). A refused command changes nothing.
#[cfg(unix)]
#[test]
fn a_console_refused_on_a_file_that_is_no_ledger_changes_and_leaves_nothing() {
    let config = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.db");
    std::fs::write(&empty, b"").unwrap();
    for (args, says) in [
        (vec!["demo".as_ref(), "--db".as_ref(), empty.as_os_str()], "NOT_A_DEMO_DB"),
        (vec!["--db".as_ref(), empty.as_os_str()], "DB_NOT_TOOLGATE"),
    ] {
        let mut t = Pty::spawn(&args, config.path());
        t.wait_for(says);
        let _ = t.child.wait();
        assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0, "{says}: the file is untouched");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["empty.db"], "{says}: nothing beside it");
        let scratch = std::fs::read_dir(config.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("toolgate-console-"));
        assert_eq!(scratch.count(), 0, "{says}: no working directory left");
    }
}

/// Issue 32 §2: the Cancel dialog's abort button was called "Cancel" and
/// aborting printed "cancelled".
#[test]
fn the_cancel_dialog_names_its_buttons_by_what_they_do_and_going_back_says_nothing_happened() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Live, 140, 40);
    app.update(key('c'));
    if app.mode == Mode::Form {
        for ch in "stuck".chars() {
            press(&mut app, KeyCode::Char(ch));
        }
        press(&mut app, KeyCode::Enter);
    }
    assert_eq!(app.mode, Mode::Confirm);
    let dialog = text(&draw(&app, 140, 40));
    assert!(dialog.contains("[ Keep it ]") && dialog.contains("[ Cancel operation ]"), "{dialog}");
    assert!(!dialog.contains("[ Cancel ]"), "{dialog}");
    assert_eq!(press(&mut app, KeyCode::Enter), None, "the default keeps it");
    let after = text(&draw(&app, 140, 40));
    assert!(after.contains("went back: nothing was done"), "{after}");
    assert!(!after.contains("cancelled"), "{after}");
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
    assert!(app.dialog.form.as_ref().unwrap().error.as_deref().unwrap().contains("note"), "a note is required");
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
            no_evidence: false,
            against_evidence: false,
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
    assert!(app.dialog.form.as_ref().unwrap().error.as_deref().unwrap().contains("receipt"));
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
    // Issue 32 §2: one `n` past the end restarted it silently. Now it says so,
    // and only a second `n` starts over.
    assert_eq!(app.update(key('n')), None, "the first n past the end sends nothing");
    let screen = text(&draw(&app, 140, 40));
    assert!(screen.contains("the scenario is finished"), "{screen}");
    assert_eq!(app.update(key('n')), Some(Request::ScenarioStep));
}

/// The real binary in a pseudo-terminal, its screen parsed as a terminal would.
#[cfg(unix)]
struct Pty {
    master: Box<dyn portable_pty::MasterPty + Send>,
    child: Box<dyn portable_pty::Child + Send + Sync>,
    writer: Box<dyn std::io::Write + Send>,
    parser: std::sync::Arc<std::sync::Mutex<vt100::Parser>>,
}

#[cfg(unix)]
impl Pty {
    /// `toolgate ARGS` at 140×40, with its settings under `config` (never the real home).
    fn spawn(args: &[&std::ffi::OsStr], config: &std::path::Path) -> Self {
        Self::spawn_with(args, config, &[])
    }

    /// [`Pty::spawn`] with these environment variables set.
    fn spawn_with(args: &[&std::ffi::OsStr], config: &std::path::Path, env: &[(&str, &str)]) -> Self {
        use std::io::Read;
        let pty = portable_pty::native_pty_system();
        let pair = pty.openpty(portable_pty::PtySize { rows: 40, cols: 140, pixel_width: 0, pixel_height: 0 }).unwrap();
        let mut cmd = portable_pty::CommandBuilder::new(env!("CARGO_BIN_EXE_toolgate"));
        cmd.args(args);
        cmd.env("TERM", "xterm-256color");
        cmd.env("XDG_CONFIG_HOME", config);
        // Working copies and scratch directories go there too (a test can look).
        cmd.env("TMPDIR", config);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = pair.slave.spawn_command(cmd).unwrap();
        drop(pair.slave);
        let parser = std::sync::Arc::new(std::sync::Mutex::new(vt100::Parser::new(40, 140, 0)));
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
        let writer = pair.master.take_writer().unwrap();
        Self { master: pair.master, child, writer, parser }
    }

    fn screen(&self) -> String {
        self.parser.lock().unwrap().screen().contents()
    }

    fn keys(&mut self, k: &[u8]) {
        self.writer.write_all(k).unwrap();
    }

    /// Waits for text on the screen (the console answers as the engine thread does).
    fn wait_for(&self, needle: &str) {
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_secs(20) {
            if self.screen().contains(needle) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("{needle:?} never appeared:\n{}", self.screen());
    }

    /// The screen line holding `needle`.
    fn line_with(&self, needle: &str) -> String {
        self.screen().lines().find(|l| l.contains(needle)).unwrap_or_default().trim().to_string()
    }

    fn resize(&self, rows: u16, cols: u16) {
        self.parser.lock().unwrap().screen_mut().set_size(rows, cols);
        self.master.resize(portable_pty::PtySize { rows, cols, pixel_width: 0, pixel_height: 0 }).unwrap();
    }

    /// Sends the console `signal` (`HUP`: what a terminal whose window is
    /// closed sends; `TERM`), then waits for it to end.
    fn signal(self, signal: &str) -> portable_pty::ExitStatus {
        let Self { master, mut child, writer, parser: _ } = self;
        let pid = child.process_id().unwrap().to_string();
        assert!(std::process::Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap().success());
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(20), "the console did not end on SIG{signal}");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        drop((writer, master));
        status
    }

    /// `Q`, and a clean exit.
    fn quit(mut self) {
        self.keys(b"Q");
        let start = std::time::Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(20), "the console did not exit");
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.success(), "clean exit: {status:?}");
    }
}

/// `toolgate ARGS --json` on the database, parsed.
fn cli_json(db: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_toolgate")).arg("--db").arg(db).args(args).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Status-query trace events per operation, read through the CLI.
fn queries_of(db: &std::path::Path, id: &str) -> usize {
    let v = cli_json(db, &["ops", "show", id, "--json"]);
    v["trace"].as_array().unwrap().iter().filter(|e| e["step"] == "query").count()
}

#[cfg(unix)]
#[test]
fn smoke_the_real_binary_in_a_pseudo_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    let db = toolgate::demo::working_copy(dir.path(), chrono::Utc::now().timestamp_millis()).unwrap();
    let unknown: Vec<String> = ["unknown", "needs_review"]
        .iter()
        .flat_map(|s| {
            let v = cli_json(&db, &["ops", "list", "--state", s, "--json"]);
            v["operations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o["id"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(unknown.len(), 5);
    let queried_before: Vec<usize> = unknown.iter().map(|id| queries_of(&db, id)).collect();
    let counts_before = cli_json(&db, &["counts", "--json"]);
    let args = ["--db".as_ref(), db.as_os_str(), "--operator".as_ref(), "smoke".as_ref()];
    let mut t = Pty::spawn(&args, config.path());
    t.wait_for("Outcome unknown");
    t.wait_for("OUTCOME_UNKNOWN");
    t.keys(b"?");
    t.wait_for("Keys (? or Esc to close)");
    t.keys(b"2");
    t.wait_for("Idempotency ledger");
    // The page arrives from the engine thread after the pane switch: `q` acts on
    // the selected row, so wait for the rows (the table header), not the title.
    t.wait_for("result ref / code");
    t.keys(b"q");
    t.wait_for("Status query");
    t.keys(b"\r");
    t.wait_for("nothing was done");
    // issue 19: the command bar opens a prefix into a detail (with why it is stuck).
    t.keys(b":op op_5706\r");
    t.wait_for("Operation detail");
    t.wait_for("does not know the key");
    t.keys(b"\x1b");
    // Sort the Unknown pane both ways.
    t.keys(b":unknown\r");
    t.wait_for("sort updated ↑");
    t.keys(b":sort since\r");
    t.wait_for("sort since ↑");
    t.keys(b"S");
    t.wait_for("sort since ↓");
    // Mark every unknown operation, one bulk status query, one confirm.
    t.keys(b"V");
    t.wait_for("[5 marked]");
    t.keys(b"q");
    t.wait_for("Bulk status query: 5 operations");
    t.keys(b"\t\r");
    t.wait_for("query 5: ");
    let summary = t.line_with("query 5: ");
    eprintln!("bulk summary: {summary}");
    assert!(summary.contains("still unknown") || summary.contains("settled"), "{summary}");
    // A filter, kept across a restart.
    t.keys(b"/state:unknown\r");
    t.wait_for("/state:unknown");
    // Too small, then back.
    t.resize(20, 60);
    t.wait_for("terminal too small: need 80×24, have 60×20");
    t.resize(24, 80);
    t.wait_for("sort since ↓");
    t.wait_for("6 Walk │ 7 Metrics");
    // And back to 140×40: the full header labels and tab names return.
    t.resize(40, 140);
    t.wait_for("6 Walkthrough │ 7 Metrics");
    let screen = t.screen();
    let lines: Vec<&str> = screen.lines().collect();
    assert!(lines[0].starts_with("toolgate ") && lines[0].contains("operator smoke"), "{screen}");
    assert!(
        lines[1].starts_with("accepted ") && lines[1].contains(" in_flight ") && lines[1].contains(" needs_review "),
        "{screen}"
    );
    assert!(lines[2].starts_with("duplicate effects") && lines[2].contains("pending approvals"), "{screen}");
    assert!(lines[3].contains("1 Live │ 2 Ledger │ 3 Approvals │ 4 Unknown │ 5 Audit │ 6 Walkthrough"), "{screen}");
    t.wait_for("sort since ↓");
    t.quit();
    // Through the CLI: each was queried once, with one audit entry each, by this operator.
    for (id, before) in unknown.iter().zip(&queried_before) {
        assert_eq!(queries_of(&db, id), before + 1, "{id}");
    }
    let log = cli_json(&db, &["audit", "--log", "--json"]);
    for id in &unknown {
        let mine = log["log"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["action"] == "query" && r["actor"] == "smoke" && r["operation_id"] == id.as_str())
            .count();
        assert_eq!(mine, 1, "{id}");
    }
    let counts = cli_json(&db, &["counts", "--json"]);
    assert_eq!(counts["side_effect_duplicates"], 0);
    let total =
        |c: &serde_json::Value| c["operations"].as_object().unwrap().values().map(|v| v.as_i64().unwrap()).sum::<i64>();
    assert_eq!(total(&counts), total(&counts_before), "a query never creates an operation");
    // Start again: the Unknown pane's filter and sort are back.
    let t = Pty::spawn(&args, config.path());
    t.wait_for("/state:unknown");
    t.wait_for("sort since ↓");
    t.quit();
    // A damaged settings file is said, and the console still opens (and leaves it as it was).
    let file = config.path().join("toolgate").join("console.json");
    std::fs::write(&file, b"{ not json").unwrap();
    let t = Pty::spawn(&args, config.path());
    t.wait_for("is damaged and ignored");
    t.wait_for("sort updated ↑");
    t.quit();
    assert_eq!(std::fs::read(&file).unwrap(), b"{ not json");
}

#[test]
fn demo_runs_on_the_database_path_it_is_given() {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("class.db");
    let pty = portable_pty::native_pty_system();
    let pair = pty.openpty(portable_pty::PtySize { rows: 40, cols: 140, pixel_width: 0, pixel_height: 0 }).unwrap();
    let config = tempfile::tempdir().unwrap();
    let mut cmd = portable_pty::CommandBuilder::new(env!("CARGO_BIN_EXE_toolgate"));
    // Never the real home's settings.
    cmd.env("XDG_CONFIG_HOME", config.path());
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
    cmd.env("XDG_CONFIG_HOME", config.path());
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
    assert!(app.dialog.confirm.is_some() && !rows.is_empty());
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
    let form = app.dialog.form.clone().unwrap();
    assert_eq!(form.choice, None, "no decision pre-selected");
    assert!(text(&draw(&app, 140, 40)).contains("no decision yet"));
    // Enter without a decision: asks for one.
    press(&mut app, KeyCode::Enter);
    assert!(app.dialog.form.as_ref().unwrap().error.as_deref().unwrap().contains("choose a decision"));
    // Right Right: failed, then compensated (no wrap to succeeded); a third Right stays.
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    assert_eq!(app.dialog.form.as_ref().unwrap().choice, Some(2));
    assert!(text(&draw(&app, 140, 40)).contains("compensated: the effect was undone elsewhere; needs a note"));
    // Left stops at succeeded, whose receipt field comes before the note.
    for _ in 0..5 {
        press(&mut app, KeyCode::Left);
    }
    assert_eq!(app.dialog.form.as_ref().unwrap().choice, Some(0));
    press(&mut app, KeyCode::Tab);
    for c in "rcpt_1".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    press(&mut app, KeyCode::Tab);
    for c in "seen in the dashboard".chars() {
        press(&mut app, KeyCode::Char(c));
    }
    let f = app.dialog.form.clone().unwrap();
    assert_eq!((f.evidence.as_str(), f.note.as_str()), ("rcpt_1", "seen in the dashboard"));
}

#[test]
fn the_filter_applies_to_every_pane_and_an_empty_filtered_pane_says_so() {
    let mut d = demo();
    let all = d
        .engine
        .audit_page(&toolgate::store::Filter::default(), toolgate::tui::app::default_order(Pane::Audit), None, 100)
        .unwrap();
    // The demo's operator log has one entry about agent_ben's operations.
    let ben = d
        .engine
        .audit_page(
            &toolgate::store::Filter::word("agent_ben"),
            toolgate::tui::app::default_order(Pane::Audit),
            None,
            100,
        )
        .unwrap();
    assert!(!ben.is_empty() && ben.len() < all.len(), "{} of {}", ben.len(), all.len());
    for r in &ben {
        let op = r.operation_id.clone().unwrap();
        assert_eq!(d.engine.operation_detail(&op).unwrap().unwrap().operation.subject, "agent_ben", "{r:?}");
    }
    assert!(d
        .engine
        .audit_page(&toolgate::store::Filter::word("globex"), toolgate::tui::app::default_order(Pane::Audit), None, 100)
        .unwrap()
        .is_empty());
    assert_eq!(
        d.engine
            .audit_page(
                &toolgate::store::Filter::word("alice"),
                toolgate::tui::app::default_order(Pane::Audit),
                None,
                100
            )
            .unwrap()
            .iter()
            .filter(|r| r.actor != "alice")
            .count(),
        0
    );
    // Live with a filter that hides its rows says the filter hides them, not that nothing is in flight.
    let mut app = app_on(&mut d, Pane::Live, 140, 40);
    app.filter = "globex".into();
    let rows = d
        .engine
        .live_page(&toolgate::store::Filter::word("globex"), toolgate::tui::app::default_order(Pane::Live), None, 10)
        .unwrap();
    app.update(Action::Engine(EngineEvent::Page {
        pane: Pane::Live,
        rows: Rows::Live(rows),
        header: d.engine.header_counts().unwrap(),
    }));
    let screen = text(&draw(&app, 140, 40));
    assert!(screen.contains("no row matches the filter"), "{screen}");
    assert!(!screen.contains("nothing in flight"), "{screen}");
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
    // Every command is on one of the screens j scrolls through.
    let mut last = String::new();
    for _ in 0..60 {
        press(&mut app, KeyCode::Char('j'));
        last.push_str(&text(&draw(&app, 80, 24)));
    }
    assert_eq!(app.mode, Mode::Help, "j scrolls the help, it does not close it");
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
fn the_readme_names_every_command_and_every_key_of_the_panes_the_detail_and_the_lab() {
    let readme = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    for c in toolgate::tui::app::COMMANDS {
        assert!(readme.contains(&format!("`:{}", c.name)), "README lacks :{}", c.name);
    }
    // Every single-character key of the pane, detail and lab keymaps has a row
    // (or a mention) in the key table, as the in-app help lists it.
    let table: String = readme.lines().filter(|l| l.starts_with("| ")).collect::<Vec<_>>().join("\n");
    for mode in [Mode::Normal, Mode::Detail, Mode::Lab] {
        for (keys, _) in keymap::help_lines(mode, false) {
            for k in keys.split([' ', '/']).filter(|k| k.chars().count() == 1) {
                assert!(table.contains(&format!("`{k}`")), "README's key table lacks `{k}` ({keys}, {mode:?})");
            }
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
    app.detail.op = Some(Box::new(detail));
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
        ("needs_review_mismatch", mismatch, "does not match this request", "then press r"),
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
fn enter_on_a_pending_approval_says_why_it_waits_and_what_to_press() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Approvals, 80, 24);
    let Rows::Approvals(rows) = &app.rows else { panic!("approvals expected") };
    let a = rows[0].clone();
    assert!(a.operation_id.is_none(), "a pending approval has no operation yet");
    assert_eq!(press(&mut app, KeyCode::Enter), None, "the approval is on screen already: nothing to fetch");
    assert_eq!(app.mode, Mode::Detail);
    let why = toolgate::tui::app::explain_approval(&a, NOW, None);
    assert!(why.sentence.starts_with(&format!("Waiting for approval {}; it expires in ", a.id)), "{why:?}");
    assert!(why.sentence.ends_with("UTC (a approves, d denies)."), "{why:?}");
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.lines().nth(6).is_some_and(|l| l.trim_start().starts_with("why")), "opens with it\n{screen}");
    insta::assert_snapshot!("why_approval_pending_80x24", screen);
    // a and d act on the approval shown; a cancelled dialog comes back to it.
    press(&mut app, KeyCode::Char('a'));
    assert_eq!(app.mode, Mode::Confirm);
    assert_eq!(
        app.dialog.confirm.as_ref().map(|c| c.request.clone()),
        Some(Request::Approve { approval_id: a.id.clone() })
    );
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Detail);
    press(&mut app, KeyCode::Char('y'));
    assert_eq!(app.clipboard.as_deref(), Some(a.id.as_str()));
    // Past its expiry: expired, and a new dispatch makes a new request; a and d refuse.
    app.update(Action::Tick(a.expires_at + 5_000));
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.contains("expired 5s ago") && screen.contains("next dispatch of the same call"), "{screen}");
    insta::assert_snapshot!("why_approval_expired_80x24", screen);
    press(&mut app, KeyCode::Char('a'));
    assert_eq!(app.mode, Mode::Detail, "no dialog for an expired request");
    assert!(app.status.as_ref().is_some_and(|(s, err)| *err && s.contains("expired")), "{:?}", app.status);
    press(&mut app, KeyCode::Esc);
    assert!(app.mode == Mode::Normal && app.detail.approval.is_none());
    // An operator who may not decide it is told why, in the detail.
    let mut bob = app_on(&mut d, Pane::Approvals, 80, 24);
    bob.operator = "mallory".into();
    press(&mut bob, KeyCode::Enter);
    let screen = text(&draw(&bob, 80, 24));
    assert!(screen.contains("You cannot decide it: mallory is not on"), "{screen}");
}

#[test]
fn the_detail_shows_absolute_times_beside_countdowns_and_nothing_counts_below_zero() {
    let mut d = demo();
    let accepted = detail_in(&mut d, "accepted", None);
    let tall = |detail: toolgate::engine::OperationDetail| {
        let mut app = App::new("demo.db (working copy)", "alice", false, false, NOW);
        app.size = (140, 50);
        app.mode = Mode::Detail;
        app.detail.op = Some(Box::new(detail));
        text(&draw(&app, 140, 50))
    };
    // Pending, due in 12 s, deadline in a minute.
    let mut waits = accepted.clone();
    waits.outbox.as_mut().unwrap().available_at = NOW + 12_000;
    waits.operation.deadline_at = NOW + 60_000;
    let screen = tall(waits);
    assert!(screen.contains("deadline        2027-01-15T08:01:00.000Z (in 1m00s)"), "{screen}");
    assert!(screen.contains("next retry      2027-01-15T08:00:12.000Z (in 12s)"), "{screen}");
    // The demo's own: the retry was due 33 s ago and the deadline passed 1m16s ago.
    let screen = tall(accepted.clone());
    assert!(screen.contains("(overdue 33s)") && screen.contains("(overdue 1m16s)"), "{screen}");
    // A lease held, then lapsed.
    let mut leased = accepted;
    leased.operation.state = toolgate::store::OpState::InFlight;
    let ob = leased.outbox.as_mut().unwrap();
    ob.state = toolgate::store::OutboxState::Leased;
    ob.lease_owner = Some("w-2".into());
    ob.lease_until = Some(NOW + 25_000);
    let screen = tall(leased.clone());
    assert!(screen.contains("lease until     2027-01-15T08:00:25.000Z (in 25s), worker w-2"), "{screen}");
    leased.outbox.as_mut().unwrap().lease_until = Some(NOW - 4_000);
    let screen = tall(leased);
    assert!(screen.contains("lease until     2027-01-15T07:59:56.000Z (expired 4s ago), worker w-2"), "{screen}");
    // No screen counts below zero anywhere.
    for pane in [Pane::Live, Pane::Ledger, Pane::Approvals, Pane::Unknown] {
        let mut app = app_on(&mut d, pane, 140, 40);
        app.update(Action::Tick(NOW + 3_600_000));
        let screen = text(&draw(&app, 140, 40));
        let negative = screen.as_bytes().windows(3).any(|w| w[0] == b' ' && w[1] == b'-' && w[2].is_ascii_digit());
        assert!(!negative, "{pane:?}: a negative countdown:\n{screen}");
        assert!(pane != Pane::Live || screen.contains("overdue 1h00m"), "{screen}");
    }
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
        matches!(&app.dialog.form.as_ref().unwrap().kind, toolgate::tui::app::FormKind::Resolve { operation_id, .. } if *operation_id == target.operation.id)
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
fn big_f_follows_the_detail_and_a_new_trace_event_appears_at_its_end() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let target = detail_in(&mut d, "unknown", Some("not_found"));
    let id = target.operation.id.clone();
    app.update(Action::Engine(EngineEvent::Found {
        asked: id.clone(),
        prefix: Some(id.clone()),
        ids: vec![id.clone()],
    }));
    app.update(Action::Engine(EngineEvent::Detail(Box::new(target))));
    assert_eq!(app.mode, Mode::Detail);
    // Not following: a page brings nothing for the detail.
    assert_eq!(app.update(Action::Engine(page(&mut d, Pane::Unknown, app.visible_rows()))), None);
    assert_eq!(press(&mut app, KeyCode::Char('F')), Some(Request::Detail(id.clone())), "F fetches it at once");
    assert!(app.detail.follow);
    assert!(app.status.as_ref().is_some_and(|(s, err)| !err && s.starts_with("following ")), "{:?}", app.status);
    // Another process changes the ledger: a status query writes a trace event
    // (at the manual clock's 08:00:00). The engine thread's next page asks for the detail again.
    d.engine.operator_query(&id, "alice").unwrap();
    let req = app.update(Action::Engine(page(&mut d, Pane::Unknown, app.visible_rows())));
    assert_eq!(req, Some(Request::Detail(id.clone())));
    let detail = d.engine.operation_detail(&id).unwrap().unwrap();
    assert_eq!(detail.trace.last().map(|e| e.step.as_str()), Some("query"));
    app.update(Action::Engine(EngineEvent::Detail(Box::new(detail))));
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.contains("08:00:00.000 query"), "the new event, at the end, is in view:\n{screen}");
    assert!(screen.contains("[following]"), "{screen}");
    // Without following, the same detail opens at its top, where the new event is not.
    let mut top = app.clone();
    top.detail.follow = false;
    assert!(!text(&draw(&top, 80, 24)).contains("08:00:00.000 query"));
    // j/k scroll again, and stop following; F starts again, Esc leaves and stops.
    press(&mut app, KeyCode::Char('k'));
    assert!(!app.detail.follow);
    assert_eq!(app.status, Some(("stopped following".into(), false)));
    assert_eq!(app.update(Action::Engine(page(&mut d, Pane::Unknown, app.visible_rows()))), None);
    assert_eq!(press(&mut app, KeyCode::Char('F')), Some(Request::Detail(id.clone())));
    press(&mut app, KeyCode::Esc);
    assert!(!app.detail.follow && app.mode == Mode::Normal);
    // The key is in the detail view's help (generated from the keymap).
    assert!(keymap::help_lines(Mode::Detail, false).iter().any(|(k, h)| *k == "F" && h.contains("follow")));
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
    let rows =
        d.engine.ops_page(OpsView::Unknown, &toolgate::store::Filter::default(), app.order(), None, limit).unwrap();
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
        |o, c, n| e.ops_page(OpsView::All, &toolgate::store::Filter::default(), o, c, n).unwrap(),
    );
    check_order(
        "unknown",
        OPS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.ops_page(OpsView::Unknown, &toolgate::store::Filter::default(), o, c, n).unwrap(),
    );
    check_order(
        "ledger filtered",
        OPS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.ops_page(OpsView::All, &toolgate::store::Filter::word("acme"), o, c, n).unwrap(),
    );
    check_order(
        "audit",
        AUDIT_SORT,
        |r| Key::Int(r.seq),
        |o, c, n| e.audit_page(&toolgate::store::Filter::default(), o, c, n).unwrap(),
    );
    check_order(
        "approvals",
        APPROVALS_SORT,
        |r| Key::Text(r.id.clone()),
        |o, c, n| e.approvals_page(&toolgate::store::Filter::default(), o, c, n).unwrap(),
    );
    // The demo has one live row: page through it anyway (nothing lost, nothing twice).
    for column in 0..LIVE_SORT.len() {
        for desc in [false, true] {
            let order = toolgate::store::Order { column, desc };
            let whole = e.live_page(&toolgate::store::Filter::default(), order, None, 100).unwrap();
            let paged = all_pages(
                |c, n| e.live_page(&toolgate::store::Filter::default(), order, c, n).unwrap(),
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
    let c = app.dialog.confirm.clone().unwrap();
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

/// The engine thread's answer to `V` (the same function the backend runs).
fn marked(d: &mut Demo, req: Option<Request>) -> EngineEvent {
    let Some(Request::MarkAll { pane, filter, order, limit }) = req else { panic!("{req:?}") };
    toolgate::tui::backend::mark_all(&mut d.engine, pane, filter, order, limit)
}

#[test]
fn v_marks_big_v_marks_every_match_and_esc_clears() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let Rows::Ops(rows) = app.rows.clone() else { panic!() };
    // v marks the selected row and moves down; v on a marked row unmarks it.
    assert_eq!(app.update(key('v')), None);
    assert_eq!((app.marks.len(), app.selected), (1, 1));
    assert!(app.is_marked(&rows[0].id));
    app.update(Action::Up);
    app.update(key('v'));
    assert!(app.marks.is_empty());
    // V asks the engine for every row that matches the filter, not the visible page.
    app.update(key('v'));
    let req = app.update(key('V'));
    assert!(
        matches!(&req, Some(Request::MarkAll { pane: Pane::Unknown, filter, limit, .. }) if filter.is_empty() && *limit == 1001),
        "{req:?}"
    );
    app.update(Action::Engine(marked(&mut d, req)));
    assert_eq!(app.marks.len(), 5, "4 unknown and 1 needs_review: {:?}", app.marks);
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.contains("[5 marked]"), "{screen}");
    assert!(screen.contains(&format!("*{}…", &rows[1].id[..14])), "marked ids start with *:\n{screen}");
    // With a filter, only its rows; the count is on the status line.
    press(&mut app, KeyCode::Esc);
    assert!(app.marks.is_empty(), "Esc clears the marks first");
    assert_eq!(app.status.as_ref().map(|s| s.0.as_str()), Some("5 marks cleared"));
    app.filter = "needs:review".into();
    let req = app.update(key('V'));
    app.update(Action::Engine(marked(&mut d, req)));
    assert_eq!(app.marks.len(), 1);
    assert!(app
        .marks
        .iter()
        .all(|m| m.kind == toolgate::tui::app::MarkKind::Operation(toolgate::store::OpState::NeedsReview)));
    // The operator log has nothing to mark.
    app.update(key('5'));
    app.update(Action::Engine(page(&mut d, Pane::Audit, 10)));
    assert_eq!(app.update(key('v')), None);
    assert!(app.status.as_ref().is_some_and(|s| s.1 && s.0.contains("nothing to mark")));
    assert_eq!(app.update(key('V')), None);
}

#[test]
fn one_bulk_query_on_every_marked_row_after_one_confirm_with_one_audit_entry_each() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let req = app.update(key('V'));
    app.update(Action::Engine(marked(&mut d, req)));
    // An approval marked too: the query skips it, and says why.
    app.update(key('3'));
    app.update(Action::Engine(page(&mut d, Pane::Approvals, 10)));
    app.update(key('v'));
    assert_eq!(app.marks.len(), 6);
    app.update(key('4'));
    app.update(Action::Engine(page(&mut d, Pane::Unknown, app.visible_rows())));
    assert_eq!(app.update(key('q')), None, "a dialog first");
    assert_eq!(app.mode, Mode::Confirm);
    let c = app.dialog.confirm.clone().unwrap();
    assert_eq!(c.title, "Bulk status query: 5 operations");
    assert!(!c.on_confirm, "Cancel is the default");
    assert!(c.evidence.iter().any(|e| e.contains("an approval, not an operation")), "{:?}", c.evidence);
    insta::assert_snapshot!("confirm_bulk_query_80x24", text(&draw(&app, 80, 24)));
    // Enter on Cancel sends nothing.
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    assert_eq!(app.marks.len(), 6);
    app.update(key('q'));
    press(&mut app, KeyCode::Tab);
    let req = press(&mut app, KeyCode::Enter);
    let Some(Request::Bulk { action, targets }) = req else { panic!("{req:?}") };
    assert_eq!(action, toolgate::engine::BulkAction::Query);
    assert_eq!(targets.len(), 5);
    assert!(targets.iter().all(|t| t.id.starts_with("op_") && t.seen_version.is_some()));
    assert_eq!(app.bulk.as_ref().map(|b| (b.done, b.total)), Some((0, 5)));
    // The engine thread runs it: progress after each, then the summary.
    let before = d.engine.audit_log(10_000).unwrap();
    let last_seq = before.iter().map(|r| r.seq).max().unwrap_or(0);
    let events = std::cell::RefCell::new(Vec::new());
    let done = toolgate::tui::backend::run_bulk(&mut d.engine, "alice", &action, &targets, &|e| {
        events.borrow_mut().push(e);
        true
    });
    let events = events.into_inner();
    assert_eq!(events.len(), 5);
    for e in events {
        app.update(Action::Engine(e));
    }
    assert_eq!(app.bulk.as_ref().map(|b| (b.done, b.total)), Some((5, 5)));
    insta::assert_snapshot!("bulk_progress_80x24", text(&draw(&app, 80, 24)));
    let EngineEvent::BulkDone { summary, .. } = &done else { panic!("{done:?}") };
    assert!(summary.contains("still unknown"), "{summary}");
    let req = app.update(Action::Engine(done.clone()));
    assert!(matches!(req, Some(Request::Fetch { .. })), "the pane refreshes: {req:?}");
    assert!(app.bulk.is_none());
    let (said, _) = app.status.clone().unwrap();
    assert!(said.starts_with(&format!("query 5: {summary}")), "{said}");
    assert_eq!(app.marks.len(), 1, "the skipped approval stays marked");
    // One audit entry per operation, by this operator, about each target.
    let log: Vec<_> = d.engine.audit_log(10_000).unwrap().into_iter().filter(|r| r.seq > last_seq).collect();
    assert_eq!(log.len(), 5);
    for t in &targets {
        let n = log.iter().filter(|r| r.action == "query" && r.operation_id.as_deref() == Some(&t.id)).count();
        let by_alice = log.iter().filter(|r| r.actor == "alice" && r.operation_id.as_deref() == Some(&t.id)).count();
        assert_eq!((n, by_alice), (1, 1), "{}", t.id);
    }
}

#[test]
fn bulk_deny_resolve_and_cancel_ask_for_one_shared_note_and_skip_what_does_not_apply() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Ledger, 140, 40);
    let req = app.update(key('V'));
    app.update(Action::Engine(marked(&mut d, req)));
    assert_eq!(app.marks.len(), 11);
    // Cancel: one note form, then the confirm dialog with the skipped rows and why.
    app.update(key('c'));
    assert_eq!(app.mode, Mode::Form);
    type_text(&mut app, "provider outage");
    press(&mut app, KeyCode::Enter);
    let c = app.dialog.confirm.clone().unwrap();
    assert_eq!(c.title, "Bulk cancel: 1 operation", "{:?}", c.evidence);
    assert!(c.evidence.iter().any(|e| e.contains("skips 10 marked")), "{:?}", c.evidence);
    assert!(c.evidence.iter().any(|e| e.contains("unknown: only accepted or in_flight")), "{:?}", c.evidence);
    assert!(c.evidence.iter().any(|e| e.contains("note (shared)  provider outage")), "{:?}", c.evidence);
    press(&mut app, KeyCode::Esc);
    // Resolve: a decision first; succeeded is refused (each needs its own receipt).
    app.update(key('r'));
    assert_eq!(app.mode, Mode::Form);
    insta::assert_snapshot!("form_bulk_resolve_80x24", text(&draw(&app, 80, 24)));
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Tab);
    type_text(&mut app, "no effect, per provider");
    press(&mut app, KeyCode::Enter);
    let err = app.dialog.form.as_ref().and_then(|f| f.error.clone()).unwrap();
    assert!(err.contains("own receipt id"), "{err}");
    // The error put the focus back on the decision: → failed.
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Enter);
    let c = app.dialog.confirm.clone().unwrap();
    assert_eq!(c.title, "Bulk resolve: 5 operations", "{:?}", c.evidence);
    let Request::Bulk { action, targets } = c.request.clone() else { panic!() };
    assert_eq!(
        action,
        toolgate::engine::BulkAction::Resolve {
            resolution: Resolution::Failed,
            note: "no effect, per provider".into(),
            no_evidence: false,
        }
    );
    // Run it: each resolved with the shared note in its own audit entry; one
    // changed since it was marked is refused and the rest still run.
    let stale = &targets[2].id;
    let op = d.engine.operation_detail(stale).unwrap().unwrap().operation;
    d.engine.operator_query(stale, "bob").unwrap();
    assert!(d.engine.operation_detail(stale).unwrap().unwrap().operation.version > op.version);
    let last_seq = d.engine.audit_log(1).unwrap().first().map_or(0, |r| r.seq);
    let done = toolgate::tui::backend::run_bulk(&mut d.engine, "alice", &action, &targets, &|_| true);
    let EngineEvent::BulkDone { summary, ok, .. } = &done else { panic!() };
    // Failed against a provider that holds a receipt is refused (resolve asks it
    // first); refusals of one kind count together.
    assert_eq!(
        summary,
        "1 resolved, 3 refused: the provider's evidence contradicts it, 1 refused: changed since it was marked"
    );
    assert!(!ok);
    let log: Vec<_> = d.engine.audit_log(10_000).unwrap().into_iter().filter(|r| r.seq > last_seq).collect();
    assert_eq!(log.len(), 5);
    for t in &targets {
        let e: Vec<_> =
            log.iter().filter(|r| r.action == "resolve" && r.operation_id.as_deref() == Some(&t.id)).collect();
        assert_eq!(e.len(), 1, "{}", t.id);
        assert_eq!(e[0].actor, "alice");
        if e[0].result == "applied" {
            assert_eq!(e[0].reason, "no effect, per provider", "the shared note");
        }
    }
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Normal);
    // Deny every pending approval: the one alice may not decide is skipped, with why.
    app.marks.clear();
    app.update(key('3'));
    app.update(Action::Engine(page(&mut d, Pane::Approvals, 10)));
    let req = app.update(key('V'));
    app.update(Action::Engine(marked(&mut d, req)));
    assert_eq!(app.marks.len(), 2);
    // Each approval row shows what it pays, as the single dialog does.
    let money = |c: &toolgate::tui::app::Confirm| {
        c.evidence.iter().any(|e| e.contains("apr_3960bc4aa496beee9b88a832") && e.ends_with(" 1,200.00 EUR"))
    };
    app.update(key('a'));
    let c = app.dialog.confirm.clone().unwrap();
    assert_eq!(c.title, "Bulk approve: 1 approval");
    assert!(money(&c), "{:?}", c.evidence);
    insta::assert_snapshot!("confirm_bulk_approve_140x40", text(&draw(&app, 140, 40)));
    press(&mut app, KeyCode::Esc);
    app.update(key('d'));
    assert_eq!(app.mode, Mode::Form);
    type_text(&mut app, "duplicate request");
    press(&mut app, KeyCode::Enter);
    let c = app.dialog.confirm.clone().unwrap();
    assert_eq!(c.title, "Bulk deny: 1 approval");
    assert!(money(&c), "{:?}", c.evidence);
    assert!(c.evidence.iter().any(|e| e.contains("alice may not approve for globex")), "{:?}", c.evidence);
    let Request::Bulk { action, targets } = c.request.clone() else { panic!() };
    let done = toolgate::tui::backend::run_bulk(&mut d.engine, "alice", &action, &targets, &|_| true);
    assert!(matches!(&done, EngineEvent::BulkDone { summary, ok: true, .. } if summary == "1 denied"), "{done:?}");
    let entry = d.engine.audit_log(1).unwrap().remove(0);
    assert_eq!((entry.action.as_str(), entry.reason.as_str()), ("deny", "duplicate request"));
    press(&mut app, KeyCode::Esc);
    // Marked rows the action does not apply to at all: said before any dialog.
    app.marks.retain(|m| m.tenant == "globex");
    assert_eq!(app.update(key('a')), None);
    assert_eq!(app.mode, Mode::Normal);
    let (said, err) = app.status.clone().unwrap();
    assert!(err && said.contains("none of the 1 marked rows applies (alice may not approve for globex)"), "{said}");
    // Read-only refuses all of it.
    app.read_only = true;
    for a in [Action::AskQuery, Action::AskApprove, Action::AskDeny, Action::AskResolve, Action::AskCancel] {
        assert_eq!(app.update(a), None);
        assert_eq!(app.mode, Mode::Normal);
        assert!(app.status.as_ref().is_some_and(|s| s.1 && s.0.starts_with("read-only")));
    }
}

#[test]
fn a_filter_expression_that_is_not_understood_says_so_and_esc_keeps_the_one_in_force() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    press(&mut app, KeyCode::Char('/'));
    type_text(&mut app, "state:unknown");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(&req, Some(Request::Fetch { filter, .. }) if filter == "state:unknown"), "{req:?}");
    assert!(app.prefs_dirty);
    press(&mut app, KeyCode::Char('/'));
    type_text(&mut app, " colour:red");
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    assert_eq!(app.mode, Mode::Filter, "the filter stays open");
    let (said, err) = app.status.clone().unwrap();
    assert!(err && said.contains("colour:red: no such field"), "{said}");
    insta::assert_snapshot!("filter_error_80x24", text(&draw(&app, 80, 24)));
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.filter, "state:unknown");
    // A field the pane has no column for.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "approvals");
    press(&mut app, KeyCode::Enter);
    assert_eq!(app.filter, "", "each pane keeps its own filter");
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter state:unknown");
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    assert!(app.command.error.as_deref().is_some_and(|e| e.contains("cannot be filtered by state")));
    press(&mut app, KeyCode::Esc);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "unknown");
    let req = press(&mut app, KeyCode::Enter);
    assert!(matches!(&req, Some(Request::Fetch { filter, .. }) if filter == "state:unknown"), "{req:?}");
}

#[test]
fn named_filters_and_each_panes_filter_and_sort_are_kept_and_restored() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter save empty");
    press(&mut app, KeyCode::Enter);
    assert!(app.saved_filters.is_empty(), "nothing to save yet");
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter tool:create_refund age:>1m");
    press(&mut app, KeyCode::Enter);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter save refunds");
    press(&mut app, KeyCode::Enter);
    app.update(key('S'));
    app.update(key('2'));
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter refunds");
    let req = press(&mut app, KeyCode::Enter);
    assert!(
        matches!(&req, Some(Request::Fetch { pane: Pane::Ledger, filter, .. }) if filter == "tool:create_refund age:>1m"),
        "a saved name recalls its filter: {req:?}"
    );
    // Tab completes saved names after `filter `.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "filter ref");
    press(&mut app, KeyCode::Tab);
    assert_eq!(app.command.input, "filter refunds");
    press(&mut app, KeyCode::Esc);
    let prefs = app.prefs();
    // Saved as JSON and read back, then restored into a fresh console.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toolgate").join("console.json");
    toolgate::tui::config::save(&path, &prefs).unwrap();
    let back = toolgate::tui::config::load(&path).unwrap().unwrap();
    assert_eq!(back, prefs);
    let mut fresh = App::new("demo", "alice", false, false, NOW);
    assert!(fresh.restore(&back).is_empty());
    assert_eq!(fresh.saved_filters.get("refunds").map(String::as_str), Some("tool:create_refund age:>1m"));
    let Request::Fetch { pane, filter, order, .. } = fresh.fetch() else { panic!() };
    assert_eq!((pane, filter.as_str(), order.desc), (Pane::Unknown, "tool:create_refund age:>1m", true));
    assert_eq!(fresh.update(key('2')), Some(fresh.fetch()));
    assert_eq!(fresh.filter, "tool:create_refund age:>1m");
    // A saved filter or column that no longer makes sense is left out and said.
    let mut odd = back.clone();
    odd.panes.get_mut("unknown").unwrap().sort = Some("colour".into());
    odd.filters.insert("bad".into(), "colour:red".into());
    let mut fresh = App::new("demo", "alice", false, false, NOW);
    let dropped = fresh.restore(&odd);
    assert_eq!(dropped.len(), 2, "{dropped:?}");
    assert!(dropped.iter().any(|d| d.contains("no column \"colour\"")), "{dropped:?}");
}

fn ids(rows: &[toolgate::store::OperationRow]) -> Vec<String> {
    let mut v: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
    v.sort();
    v
}

fn filter_expressions_select_the_same_rows_on_both_backends(backend: crate::support::Backend) {
    use toolgate::tui::app::filter::parse;
    let mut d = demo_on(backend);
    let order = toolgate::tui::app::default_order(Pane::Ledger);
    let all = d.engine.ops_page(OpsView::All, &toolgate::store::Filter::default(), order, None, 1000).unwrap();
    let since = |o: &toolgate::store::OperationRow| o.state_since.unwrap_or(o.updated_at);
    type Keep = Box<dyn Fn(&toolgate::store::OperationRow) -> bool>;
    let cases: Vec<(&str, Keep)> = vec![
        ("state:outcome_unknown", Box::new(|o| o.state == "unknown")),
        (
            "state:unknown,needs_review tenant:acme",
            Box::new(|o| o.tenant == "acme" && matches!(o.state.as_str(), "unknown" | "needs_review")),
        ),
        ("needs:review", Box::new(|o| o.state == "needs_review")),
        (
            "tenant:acme state:outcome_unknown tool:create_refund age:>1m needs:review",
            Box::new(move |o| {
                o.tenant == "acme"
                    && o.tool == "create_refund"
                    && since(o) <= NOW - 60_000
                    && matches!(o.state.as_str(), "unknown" | "needs_review")
            }),
        ),
        ("tool:create_refund age:>2m", Box::new(move |o| o.tool == "create_refund" && since(o) <= NOW - 120_000)),
        ("age:<2m", Box::new(move |o| since(o) > NOW - 120_000)),
        ("needs:query state:unknown", Box::new(|o| o.state == "unknown" && o.last_query_at.is_none())),
        ("acme", Box::new(|o| o.tenant == "acme")),
        ("id:op_6", Box::new(|o| o.id.starts_with("op_6"))),
        ("op_6", Box::new(|o| o.id.starts_with("op_6"))),
        // Exact on both backends: `_` and `%` are themselves, case counts.
        ("id:op%", Box::new(|_| false)),
        ("id:op_6_", Box::new(|o| o.id.starts_with("op_6_"))),
        ("OP_", Box::new(|_| false)),
        ("id:OP_", Box::new(|_| false)),
    ];
    for (expr, keep) in &cases {
        let want: Vec<_> = all.iter().filter(|o| keep(o)).cloned().collect();
        let got = d.engine.ops_page(OpsView::All, &parse(expr).unwrap(), order, None, 1000).unwrap();
        assert_eq!(ids(&got), ids(&want), "{expr} on {backend:?}");
    }
    assert!(cases.len() > 10);
    assert_eq!(d.engine.ops_page(OpsView::All, &parse("state:unknown").unwrap(), order, None, 1000).unwrap().len(), 4);
    // The other tables.
    let live =
        d.engine.live_page(&parse("tenant:acme").unwrap(), toolgate::tui::app::default_order(Pane::Live), None, 100);
    assert!(live.unwrap().iter().all(|r| r.tenant == "acme"));
    let ap = d
        .engine
        .approvals_page(&parse("tenant:globex").unwrap(), toolgate::tui::app::default_order(Pane::Approvals), None, 100)
        .unwrap();
    assert_eq!(ap.len(), 1);
    assert!(d
        .engine
        .approvals_page(&parse("id:APR_").unwrap(), toolgate::tui::app::default_order(Pane::Approvals), None, 100)
        .unwrap()
        .is_empty());
    let audit_order = toolgate::tui::app::default_order(Pane::Audit);
    let log = d.engine.audit_page(&toolgate::store::Filter::default(), audit_order, None, 1000).unwrap();
    let by = d.engine.audit_page(&parse("actor:alice").unwrap(), audit_order, None, 1000).unwrap();
    assert_eq!(by.len(), log.iter().filter(|r| r.actor == "alice").count());
    let acme = d.engine.audit_page(&parse("tenant:acme action:resolve").unwrap(), audit_order, None, 1000).unwrap();
    for r in &acme {
        assert_eq!(r.action, "resolve");
        let op = d.engine.operation_detail(r.operation_id.as_deref().unwrap()).unwrap().unwrap().operation;
        assert_eq!(op.tenant, "acme");
    }
    // The header's oldest unknown is the Unknown pane's oldest "since".
    let unknown = d.engine.ops_page(OpsView::Unknown, &toolgate::store::Filter::default(), order, None, 100).unwrap();
    let oldest = unknown.iter().map(since).min();
    assert_eq!(d.engine.header_counts().unwrap().oldest_unknown_at, oldest);
    assert!(unknown.iter().any(|o| o.state_since != Some(o.updated_at)), "the demo has a row where they differ");
}

crate::on_both_backends!(
    every_sort_column_pages_by_keyset_in_both_directions,
    filter_expressions_select_the_same_rows_on_both_backends
);

/// Issue 17's proof: a call an agent makes through `toolgate serve` (another
/// process, over a real socket) appears in a console on the same ledger
/// without a key press: the new operation in the Ledger pane, and the
/// header's count of succeeded operations one higher.
#[cfg(unix)]
#[test]
fn a_call_through_serve_appears_live_in_the_console() {
    let dir = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    let db = toolgate::demo::working_copy(dir.path(), chrono::Utc::now().timestamp_millis()).unwrap();
    let token = crate::serve::agent_token(&db, "acme", "agent_ana");
    let server = crate::serve::Server::start(&db, &[]);
    let args = ["--db".as_ref(), db.as_os_str(), "--operator".as_ref(), "live".as_ref()];
    let mut t = Pty::spawn(&args, config.path());
    t.keys(b"2");
    t.wait_for("result ref / code");
    let succeeded = |screen: &str| -> i64 {
        let line = screen.lines().find(|l| l.starts_with("accepted ")).unwrap_or_default();
        let mut words = line.split_whitespace();
        while let Some(w) = words.next() {
            if w == "succeeded" {
                return words.next().and_then(|n| n.parse().ok()).unwrap_or(-1);
            }
        }
        -1
    };
    let before = succeeded(&t.screen());
    assert!(before >= 0, "{}", t.screen());

    let c = crate::serve::Client::new(&server);
    let a = c
        .try_call(
            &token,
            "create_refund",
            Some("refund-live-console-1"),
            &crate::support::refund_args("ord_1002", 100),
            &[],
        )
        .unwrap();
    assert_eq!(a.status, 200, "{:#}", a.body);
    let op = a.body["protected_audit"]["operation_id"].as_str().unwrap().to_string();
    // Ids are cut to fit the column: its first 20 characters are enough.
    t.wait_for(&op[..20]);
    let start = std::time::Instant::now();
    while succeeded(&t.screen()) != before + 1 {
        assert!(start.elapsed() < std::time::Duration::from_secs(20), "count never moved:\n{}", t.screen());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    t.quit();
}

/// Issue 32 §1.6: `max_attempts` caps one call's automatic retries; an agent
/// that calls again with the same key starts another round, so the
/// operation's count passes the cap. The screens said "attempt 8/3".
#[test]
fn an_operations_attempts_past_the_per_call_cap_are_not_shown_as_n_of_m() {
    let dir = tempfile::tempdir().unwrap();
    let path = toolgate::demo::working_copy(dir.path(), NOW).unwrap();
    let clock = toolgate::engine::clock::ManualClock::new(NOW);
    let engine = Engine::open(
        &path,
        EngineOptions { clock: std::sync::Arc::new(clock.clone()), ..toolgate::tools::demo_options() },
    )
    .unwrap();
    let mut d = Demo { dir, engine, _pg: None };
    let faults = vec!["unavailable(1)"; 40].join(",");
    d.engine.set_faults(toolgate::engine::faults::FaultPlan::parse(&faults).unwrap());
    let req = crate::support::refund("attempts-past-cap-1", 100);
    let mut op = None;
    for _ in 0..4 {
        let env = d.engine.dispatch(&req).unwrap();
        op = env.protected_audit.operation_id.clone().or(op);
        // Past the backoff and the breaker's cool-down: the next call sends again.
        clock.advance(60_000);
    }
    let op = op.expect("the refund was accepted");
    let detail = d.engine.operation_detail(&op).unwrap().unwrap();
    let ob = detail.outbox.clone().unwrap();
    assert!(ob.attempt > ob.max_attempts, "the fixture passes the cap: {} of {}", ob.attempt, ob.max_attempts);
    let mut app = app_on(&mut d, Pane::Live, 140, 40);
    let pane = text(&draw(&app, 140, 40));
    assert!(!pane.contains(&format!("{}/{}", ob.attempt, ob.max_attempts)), "the pane counts attempts:\n{pane}");
    app.update(Action::Engine(EngineEvent::Found { asked: op.clone(), prefix: Some(op.clone()), ids: vec![op] }));
    app.update(Action::Engine(EngineEvent::Detail(Box::new(detail))));
    assert_eq!(app.mode, Mode::Detail);
    let screen = text(&draw(&app, 140, 40));
    let wrong = format!("{}/{}", ob.attempt, ob.max_attempts);
    assert!(!screen.contains(&wrong), "no '{wrong}' on the detail:\n{screen}");
    assert!(screen.contains(&format!("attempt {} (at most {} per call)", ob.attempt, ob.max_attempts)), "{screen}");
}

/// Issue 32 §2: status messages were cut at 80 columns with no ellipsis and
/// stayed after the state changed. Now: cut with `…`, gone after a while, and
/// every one of them in `:messages`.
#[test]
fn status_messages_are_cut_with_an_ellipsis_expire_and_stay_in_the_message_log() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let long = "x".repeat(120);
    app.update(Action::Engine(EngineEvent::Done { ok: true, summary: format!("first {long}") }));
    let screen = text(&draw(&app, 80, 24));
    let status = screen.lines().find(|l| l.contains("first")).unwrap_or_default().to_string();
    assert!(status.trim_end().ends_with('…'), "{status:?}");
    // Gone once it is old news; the log keeps it.
    app.update(Action::Tick(NOW + 60_000));
    assert!(app.status.is_none(), "{:?}", app.status);
    app.update(Action::Engine(EngineEvent::Done { ok: false, summary: "second".into() }));
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "messages");
    press(&mut app, KeyCode::Enter);
    let log = text(&draw(&app, 80, 24));
    assert!(log.contains("Messages, newest first (2;"), "{log}");
    let line_of = |w: &str| log.lines().position(|l| l.contains(w) && !l.contains("Messages")).unwrap();
    assert!(line_of("second") < line_of("first"), "newest first:\n{log}");
    press(&mut app, KeyCode::Esc);
    assert_eq!(app.mode, Mode::Normal);
}

/// Issue 32 §2: at 80 columns the Audit pane dropped its result column and a
/// refused action looked like an applied one.
#[test]
fn a_refused_action_is_told_apart_in_the_audit_pane_at_80_columns() {
    let mut d = demo();
    let op = d.engine.list_operations(Some(toolgate::store::OpState::Unknown), 1).unwrap()[0].id.clone();
    let out = d.engine.resolve(&crate::support::failed_by(&op, "kim", " ")).unwrap();
    assert!(!out.applied);
    let app = app_on(&mut d, Pane::Audit, 80, 24);
    let screen = text(&draw(&app, 80, 24));
    assert!(!screen.contains("result"), "the result column is dropped at 80 columns:\n{screen}");
    assert!(screen.contains("✗resolve"), "the refused resolve is marked:\n{screen}");
    let wide = app_on(&mut d, Pane::Audit, 140, 40);
    let screen = text(&draw(&wide, 140, 40));
    assert!(screen.contains("refused") && !screen.contains("✗resolve"), "{screen}");
}

/// Issue 32 §2: in the detail, `g`/`G`/PgDn did nothing and `j` scrolled
/// past the end into blank space. The view tells the model how far it can
/// scroll (as the event loop does after each draw).
#[test]
fn the_detail_scrolls_with_g_big_g_and_page_keys_and_stops_at_its_end() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let Some(Request::Detail(id)) = app.update(Action::OpenDetail) else { panic!("a detail request") };
    let detail = d.engine.operation_detail(&id).unwrap().unwrap();
    app.update(Action::Engine(EngineEvent::Detail(Box::new(detail))));
    let extent = |app: &App| {
        let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
        let mut n = 0;
        t.draw(|f| n = ui::render(app, f)).unwrap();
        n
    };
    let end = extent(&app);
    assert!(end > 0, "the demo's detail is longer than 24 rows");
    app.update(Action::BodyExtent(end));
    press(&mut app, KeyCode::Char('G'));
    assert_eq!(app.detail.scroll, end);
    press(&mut app, KeyCode::Char('j'));
    assert_eq!(app.detail.scroll, end, "j stops at the end");
    press(&mut app, KeyCode::Char('g'));
    assert_eq!(app.detail.scroll, 0);
    press(&mut app, KeyCode::PageDown);
    assert!(app.detail.scroll > 1 && app.detail.scroll <= end, "{}", app.detail.scroll);
    press(&mut app, KeyCode::PageUp);
    assert_eq!(app.detail.scroll, 0);
    assert_eq!(app.mode, Mode::Detail, "still in the detail");
}

/// Issue 32 §2: the lab's confirm dialog (its lines wrapped at the border, the
/// box closed before the button row) showed no buttons at 80×24 and 160×45,
/// and the footer offered the pane's keys. Every line of a dialog is inside
/// its box, the buttons are on screen, and the footer has the dialog's keys.
#[test]
fn the_lab_confirm_shows_its_buttons_at_80x24_and_160x45_and_the_footer_its_keys() {
    let mut d = demo();
    for (w, h) in [(80u16, 24u16), (160, 45)] {
        let mut app = app_on(&mut d, Pane::Unknown, w, h);
        app.lab.demo = true;
        app.update(key('L'));
        for _ in 0..2 {
            press(&mut app, KeyCode::Char('j'));
        }
        press(&mut app, KeyCode::Enter);
        assert_eq!(app.mode, Mode::Confirm);
        let screen = text(&draw(&app, w, h));
        assert!(screen.contains("[ Go back ]   [ Turn the defense off ]"), "{w}x{h}:\n{screen}");
        // Every line of the box starts and ends at its border.
        let (top, bottom) = (line_of(&screen, "┌ Lab"), line_of(&screen, "┘"));
        let left = top.chars().position(|c| c == '┌').unwrap();
        let right = top.chars().position(|c| c == '┐').unwrap();
        let rows: Vec<&str> = screen.lines().skip_while(|l| *l != top).skip(1).take_while(|l| *l != bottom).collect();
        assert!(rows.len() > 3, "{screen}");
        for l in &rows {
            let cs: Vec<char> = l.chars().collect();
            assert!(cs[left] == '│' && cs[right] == '│', "a line outside the box:\n{screen}");
        }
        let footer = screen.lines().last().unwrap();
        assert!(footer.contains("Enter choose") && footer.contains("Esc go back"), "{screen}");
        assert!(!footer.contains("PgDn") && !footer.contains("? help"), "{screen}");
        insta::assert_snapshot!(format!("confirm_lab_{w}x{h}"), screen);
    }
}

/// Issue 32 §2: a needs_review operation asked to check "the receipt" and
/// never showed it; the refusal that named it was cut off, and only the CLI
/// could decide against the evidence. The detail (and the resolve form) show
/// the receipt and downstream request the query found and the refund's
/// amount, order and currency; a decision the evidence contradicts is offered
/// against the evidence in a confirm of its own that names the contradiction.
#[test]
fn a_needs_review_operation_shows_the_receipt_found_and_can_be_decided_against_the_evidence() {
    let mut d = demo();
    let target = detail_in(&mut d, "needs_review", Some("mismatch"));
    let id = target.operation.id.clone();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    app.update(Action::Engine(EngineEvent::Found {
        asked: id.clone(),
        prefix: Some(id.clone()),
        ids: vec![id.clone()],
    }));
    app.update(Action::Engine(EngineEvent::Detail(Box::new(target.clone()))));
    assert_eq!(app.mode, Mode::Detail);
    let screen = text(&draw(&app, 80, 24));
    for fact in ["rcpt_9cc44104a6e05938", "dreq_f62d0e11d0d68e33", "4.00 EUR", "ord_2001", "another request's digest"] {
        assert!(screen.contains(fact), "{fact}:\n{screen}");
    }
    insta::assert_snapshot!("detail_needs_review_80x24", screen);
    // r, failed, a note: the form shows the receipt too.
    press(&mut app, KeyCode::Char('r'));
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    let form = text(&draw(&app, 80, 24));
    assert!(form.contains("rcpt_9cc44104a6e05938") && form.contains("4.00 EUR"), "{form}");
    press(&mut app, KeyCode::Tab);
    type_text(&mut app, "customer says no refund arrived");
    press(&mut app, KeyCode::Enter);
    press(&mut app, KeyCode::Tab);
    let req = press(&mut app, KeyCode::Enter).expect("a resolve request");
    assert!(matches!(req, Request::Resolve { against_evidence: false, .. }), "{req:?}");
    // The engine refuses it on the provider's word: a confirm of its own.
    let answer = toolgate::tui::backend::resolve(&mut d.engine, "alice", req);
    let EngineEvent::Contradicted { code, why, .. } = &answer else { panic!("{answer:?}") };
    assert_eq!(code, "STATUS_CONFLICT");
    assert!(why.contains("rcpt_9cc44104a6e05938"), "{why}");
    app.update(Action::Engine(answer));
    assert_eq!(app.mode, Mode::Confirm);
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.contains("Decide against the evidence") && screen.contains("rcpt_9cc44104a6e05938"), "{screen}");
    assert!(screen.contains("[ Resolve as failed against the evidence ]"), "{screen}");
    insta::assert_snapshot!("confirm_against_evidence_80x24", screen);
    assert_eq!(press(&mut app, KeyCode::Enter), None, "Go back is the default");
    assert_eq!(app.mode, Mode::Detail);
    assert_eq!(d.engine.operation_detail(&id).unwrap().unwrap().operation.state.as_str(), "needs_review");
    // Asked again and confirmed: applied, and logged as against the evidence.
    press(&mut app, KeyCode::Char('r'));
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Right);
    press(&mut app, KeyCode::Tab);
    type_text(&mut app, "customer says no refund arrived");
    press(&mut app, KeyCode::Enter);
    press(&mut app, KeyCode::Tab);
    let req = press(&mut app, KeyCode::Enter).unwrap();
    let answer = toolgate::tui::backend::resolve(&mut d.engine, "alice", req);
    app.update(Action::Engine(answer));
    press(&mut app, KeyCode::Tab);
    let req = press(&mut app, KeyCode::Enter).unwrap();
    assert!(matches!(req, Request::Resolve { against_evidence: true, .. }), "{req:?}");
    let EngineEvent::Done { ok: true, summary } = toolgate::tui::backend::resolve(&mut d.engine, "alice", req) else {
        panic!("applied")
    };
    assert!(summary.contains("against the evidence"), "{summary}");
    let after = d.engine.operation_detail(&id).unwrap().unwrap();
    assert_eq!(after.operation.state.as_str(), "resolved");
    let entry = after.audit.iter().rev().find(|r| r.action == "resolve" && r.result == "applied").unwrap();
    assert!(
        entry.evidence.contains("rcpt_9cc44104a6e05938") && entry.evidence.contains("against_evidence"),
        "{entry:?}"
    );
}

/// Issue 32 §2: the default operator was literally `operator` (every audit
/// row said so, and it could approve nothing). It is the login name, and
/// `:operator NAME` changes it: the header and the status line say so, and
/// the next action is recorded under the new name.
#[cfg(unix)]
#[test]
fn the_operator_defaults_to_the_login_name_and_colon_operator_changes_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = tempfile::tempdir().unwrap();
    let db = toolgate::demo::working_copy(dir.path(), chrono::Utc::now().timestamp_millis()).unwrap();
    let args = ["--db".as_ref(), db.as_os_str()];
    let mut t = Pty::spawn_with(&args, config.path(), &[("USER", "dana"), ("LOGNAME", "dana")]);
    t.wait_for("OUTCOME_UNKNOWN");
    assert!(t.line_with("toolgate ").contains("operator dana  "), "{}", t.screen());
    t.keys(b":operator erin\r");
    t.wait_for("operator is now erin (was dana)");
    assert!(t.line_with("toolgate ").contains("operator erin  "), "{}", t.screen());
    // A bad name is refused in the bar, and the operator stays.
    t.keys(b":operator \r");
    t.wait_for(":operator needs a name");
    t.keys(b"\x1b");
    // (Esc and the next key apart, or the terminal reads Alt-q.)
    std::thread::sleep(std::time::Duration::from_millis(300));
    // A status query on the first unknown row, recorded as erin.
    t.keys(b"q");
    t.wait_for("Status query");
    t.keys(b"\t\r");
    t.wait_for("query op_");
    t.quit();
    let log = cli_json(&db, &["audit", "--log", "--json"]);
    let actors: Vec<&str> = log["log"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "query")
        .filter_map(|r| r["actor"].as_str())
        .collect();
    assert!(actors.contains(&"erin") && !actors.contains(&"operator"), "{actors:?}");
}

/// Issue 32 §2: while PostgreSQL was down the header said `● LIVE` over stale
/// rows. A failed refresh says the connection state, since when, and how old
/// the rows shown are; the next page puts `LIVE` back.
#[test]
fn a_failed_refresh_says_db_down_since_when_and_how_old_the_rows_are() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    app.update(Action::Tick(NOW + 5_000));
    app.update(Action::Engine(EngineEvent::RefreshFailed {
        code: "DB_UNAVAILABLE".into(),
        error: "the database server is unreachable or restarting".into(),
    }));
    app.update(Action::Tick(NOW + 9_000));
    // A second failure does not move "since".
    app.update(Action::Engine(EngineEvent::RefreshFailed { code: "DB_UNAVAILABLE".into(), error: "again".into() }));
    let screen = text(&draw(&app, 80, 24));
    let lines: Vec<&str> = screen.lines().collect();
    assert!(lines[0].ends_with("● DB DOWN") && !screen.contains("LIVE"), "{screen}");
    assert!(lines[1].starts_with("● DB DOWN since 08:00:05, showing rows of 08:00:00"), "{screen}");
    insta::assert_snapshot!("db_down_80x24", screen);
    let req = app.update(Action::Engine(page(&mut d, Pane::Unknown, 15)));
    assert!(req.is_none());
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.lines().next().unwrap().ends_with("● LIVE") && !screen.contains("DB DOWN"), "{screen}");
    assert!(app.status.as_ref().is_some_and(|(s, _)| s.contains("the database is back")), "{:?}", app.status);
}

/// Issue 32 §2: the breaker is shown in the header while it is open (at 80
/// columns without the probe time, which the Metrics pane has).
#[test]
fn an_open_breaker_is_in_the_header() {
    let mut d = demo();
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 140, 40), 140, 40));
    assert!(!screen.contains("BREAKER"), "closed: not shown\n{screen}");
    let c = crate::support::raw(&d.dir.path().join("demo.db"));
    c.execute("UPDATE circuits SET state = 'open', open_until = ?1 WHERE downstream = 'payments'", [NOW + 20_000])
        .unwrap();
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 140, 40), 140, 40));
    assert!(line_of(&screen, "toolgate ").ends_with("● LIVE  BREAKER OPEN: payments (probe 08:00:20)"), "{screen}");
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 80, 24), 80, 24));
    fits(&screen, 80, 24);
    assert!(line_of(&screen, "toolgate ").ends_with("● LIVE  BREAKER OPEN: payments"), "{screen}");
    c.execute(
        "UPDATE circuits SET state = 'half_open', open_until = NULL, probe_until = ?1 WHERE downstream = 'payments'",
        [NOW + 3_000],
    )
    .unwrap();
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 80, 24), 80, 24));
    assert!(line_of(&screen, "toolgate ").ends_with("BREAKER PROBE: payments"), "{screen}");
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 140, 40), 140, 40));
    assert!(line_of(&screen, "toolgate ").ends_with("BREAKER HALF-OPEN: payments"), "{screen}");
}

/// Issue 32 §2: `:sort age` was refused although the filter calls the same
/// thing `age`; a refused `:sort` lost what was typed; Tab did not cycle among
/// several `:op` matches; on the "too small" screen `Q` went into a hidden
/// text field.
#[test]
fn sort_age_a_refused_sort_keeps_its_line_tab_cycles_op_matches_and_too_small_only_quits() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "sort age desc");
    assert!(matches!(press(&mut app, KeyCode::Enter), Some(Request::Fetch { .. })));
    assert_eq!(app.sort_label().as_deref(), Some("since ↓"));
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "sort colour desc");
    assert_eq!(press(&mut app, KeyCode::Enter), None);
    assert_eq!(app.mode, Mode::Command);
    assert_eq!(app.command.input, "sort colour desc", "the typed line stays to be mended");
    assert!(app.command.error.as_deref().is_some_and(|e| e.contains("no column")), "{:?}", app.command.error);
    press(&mut app, KeyCode::Esc);
    // Several :op matches: Tab goes through them, one after the other.
    press(&mut app, KeyCode::Char(':'));
    type_text(&mut app, "op op_");
    let Some(Request::FindOperation { prefix, limit }) = press(&mut app, KeyCode::Enter) else { panic!() };
    let ids = d.engine.operation_ids_with_prefix(&prefix, limit).unwrap();
    assert!(ids.len() > 2);
    app.update(Action::Engine(EngineEvent::Found { asked: prefix.clone(), prefix: Some(prefix), ids: ids.clone() }));
    let shown = app.command.candidates.clone();
    let mut seen = Vec::new();
    for _ in 0..=shown.len() {
        press(&mut app, KeyCode::Tab);
        seen.push(app.command.input.clone());
    }
    let expect: Vec<String> = shown.iter().chain(shown.first()).map(|id| format!("op {id}")).collect();
    assert_eq!(seen, expect, "Tab cycles and wraps");
    press(&mut app, KeyCode::Esc);
    // Too small: a filter open, and Q quits instead of being typed into it.
    press(&mut app, KeyCode::Char('/'));
    assert_eq!(app.mode, Mode::Filter);
    app.update(Action::Resize(60, 20));
    let ev = |c: KeyCode| ratatui::crossterm::event::Event::Key(KeyEvent::new(c, KeyModifiers::NONE));
    assert_eq!(toolgate::tui::map_event(&app, &ev(KeyCode::Char('x'))), None, "no key but quit");
    assert_eq!(toolgate::tui::map_event(&app, &ev(KeyCode::Enter)), None);
    assert_eq!(toolgate::tui::map_event(&app, &ev(KeyCode::Char('Q'))), Some(Action::Quit));
    let resize = ratatui::crossterm::event::Event::Resize(80, 24);
    assert_eq!(toolgate::tui::map_event(&app, &resize), Some(Action::Resize(80, 24)));
    app.update(Action::Resize(80, 24));
    assert_eq!(toolgate::tui::map_event(&app, &ev(KeyCode::Char('Q'))), Some(Action::Input('Q')), "big again: typed");
}

/// Issue 32 §2: the detail's footer offered `q`/`r` on a succeeded operation
/// and never `c` on an accepted one; the footer now offers what applies to the
/// state. And `j` stops at the end of every detail (an approval's too).
#[test]
fn the_detail_footer_offers_the_keys_of_its_state_and_j_stops_at_the_end() {
    let mut d = demo();
    let footer = |detail: toolgate::engine::OperationDetail| {
        detail_screen(detail).lines().last().unwrap_or_default().to_string()
    };
    let succeeded = footer(detail_in(&mut d, "succeeded", None));
    assert!(!succeeded.contains(" q ") && !succeeded.contains(" r ") && !succeeded.contains(" c "), "{succeeded}");
    let accepted = footer(detail_in(&mut d, "accepted", None));
    assert!(accepted.contains(" c cancel") && accepted.contains(" q query") && !accepted.contains(" r "), "{accepted}");
    let unknown = footer(detail_in(&mut d, "unknown", None));
    assert!(unknown.contains(" q query") && unknown.contains(" r resolve") && !unknown.contains(" c "), "{unknown}");
    // A pending approval's detail scrolls to its end and no further.
    let mut app = app_on(&mut d, Pane::Approvals, 80, 24);
    app.update(Action::OpenDetail);
    assert!(app.detail.approval.is_some());
    let extent = |app: &App| {
        let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
        let mut n = 0;
        t.draw(|f| n = ui::render(app, f)).unwrap();
        n
    };
    let end = extent(&app);
    app.update(Action::BodyExtent(end));
    for _ in 0..50 {
        press(&mut app, KeyCode::Char('j'));
    }
    assert_eq!(app.detail.scroll, end, "j stops at the end");
    // `:op` from an approval's detail opens the operation found, at its top:
    // the approval no longer stands in front of it.
    let target = detail_in(&mut d, "succeeded", None);
    let id = target.operation.id.clone();
    let found = EngineEvent::Found { asked: id.clone(), prefix: Some(id.clone()), ids: vec![id.clone()] };
    assert_eq!(app.update(Action::Engine(found)), Some(Request::Detail(id.clone())));
    assert!(app.detail.approval.is_none() && app.detail.scroll == 0);
    app.update(Action::Engine(EngineEvent::Detail(Box::new(target))));
    assert!(text(&draw(&app, 80, 24)).contains(&id), "the operation's detail is on screen");
}

/// Issue 32 §2: the Ledger said "kept for 29d 23h" on operations a person
/// acted on, which the purge never takes (the store's rule: an approval, or an
/// operator-log entry other than a caller's own query). It says `always`.
fn the_ledger_says_always_for_what_a_person_acted_on_and_the_time_left_for_the_rest(backend: crate::support::Backend) {
    let mut d = demo_on(backend);
    let mut app = app_on(&mut d, Pane::Ledger, 140, 40);
    let ev = page(&mut d, Pane::Ledger, app.visible_rows());
    let acted = toolgate::tui::backend::acted_on(&mut d.engine, &ev).expect("a Ledger page");
    app.update(Action::Engine(acted));
    app.update(Action::Engine(ev));
    let screen = text(&draw(&app, 140, 40));
    // The demo's resolved operation was decided by a person; its succeeded ones were not.
    let resolved = line_of(&screen, " resolved     ");
    assert!(resolved.trim_end().ends_with(" always"), "{screen}");
    let succeeded = line_of(&screen, " succeeded    rcpt_");
    assert!(succeeded.trim_end().ends_with("29d 23h"), "{screen}");
    assert!(line_of(&screen, "operation ").trim_end().ends_with(" kept"), "{screen}");
}

crate::on_both_backends!(the_ledger_says_always_for_what_a_person_acted_on_and_the_time_left_for_the_rest);

/// Issue 32 §2: `since` cut its unit (`339d 13`), and the ages went on
/// ticking while the panes were paused (rows frozen, ages not).
#[test]
fn since_keeps_whole_units_and_ages_stand_still_while_paused() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let day = 86_400_000;
    app.update(Action::Tick(NOW + 339 * day + 13 * 3_600_000));
    let screen = text(&draw(&app, 80, 24));
    assert!(line_of(&screen, "op_a04bfa").contains(" 339d    reply"), "at 80 columns the day alone:\n{screen}");
    let mut wide = app_on(&mut d, Pane::Unknown, 140, 40);
    wide.update(Action::Tick(NOW + 339 * day + 13 * 3_600_000));
    let screen = text(&draw(&wide, 140, 40));
    assert!(line_of(&screen, "op_a04bfa").contains(" 339d 13h "), "{screen}");
    // Paused: a minute later the screen still says what it said.
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    app.update(key(' '));
    let before = text(&draw(&app, 80, 24));
    assert!(line_of(&before, "toolgate ").contains("‖ PAUSED at 08:00:00"), "{before}");
    app.update(Action::Tick(NOW + 60_000));
    let after = text(&draw(&app, 80, 24));
    assert!(after.contains("oldest 3m14s") && line_of(&after, "op_a04bfa").contains(" 3m14s "), "{after}");
    // Resumed: the ages catch up with the clock.
    app.update(key(' '));
    app.update(Action::Tick(NOW + 61_000));
    let resumed = text(&draw(&app, 80, 24));
    assert!(resumed.contains("oldest 4m15s"), "{resumed}");
}

/// Issue 32 §2: at 80×24 the walkthrough's table was unreadable and could not
/// be scrolled back; `[`/`]` typed in a burst were lost (each picked from the
/// scenario the engine last answered). Below 120 columns each step is a few
/// readable lines, j/k (and g/G, PgUp/PgDn) scroll them, the footer says so,
/// and `]]]` moves three scenarios.
#[test]
fn the_walkthrough_at_80x24_is_readable_scrolls_back_and_keeps_a_burst_of_picks() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = toolgate::tui::walkthrough::Walkthrough::new(dir.path().to_path_buf(), None);
    let mut app = App::new("demo.db (working copy)", "alice", false, false, NOW);
    app.size = (80, 24);
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
    let extent = |app: &App| {
        let mut t = Terminal::new(TestBackend::new(80, 24)).unwrap();
        let mut n = 0;
        t.draw(|f| n = ui::render(app, f)).unwrap();
        n
    };
    let end = extent(&app);
    assert!(end > 0, "scenario 4's steps are longer than 80×24");
    app.update(Action::BodyExtent(end));
    let screen = text(&draw(&app, 80, 24));
    assert!(screen.lines().all(|l| l.chars().count() <= 80), "{screen}");
    assert!(screen.lines().last().unwrap().contains("j/k scroll"), "{screen}");
    assert!(screen.contains(&format!("j/k scroll {end}/{end}")), "the newest step in view:\n{screen}");
    insta::assert_snapshot!("walkthrough_end_80x24", screen);
    press(&mut app, KeyCode::Char('g'));
    let top = text(&draw(&app, 80, 24));
    assert!(top.contains(&format!("j/k scroll 0/{end}")) && top.contains("  1  "), "{top}");
    insta::assert_snapshot!("walkthrough_top_80x24", top);
    press(&mut app, KeyCode::Char('j'));
    assert_eq!(app.walk_scroll, 1);
    for _ in 0..200 {
        press(&mut app, KeyCode::Char('j'));
    }
    assert_eq!(app.walk_scroll, end, "j stops at the end");
    press(&mut app, KeyCode::Char('k'));
    assert_eq!(app.walk_scroll, end - 1);
    // `]` three times before any answer: three scenarios on.
    let first = app.walkthrough.selected;
    let n = app.walkthrough.scenarios.len();
    let picks: Vec<Option<Request>> = (0..3).map(|_| app.update(key(']'))).collect();
    let expect: Vec<Option<Request>> = (1..=3).map(|k| Some(Request::ScenarioSelect((first + k) % n))).collect();
    assert_eq!(picks, expect);
    // The answers come back one by one: the last pick stays shown throughout.
    for k in 1..=3 {
        w.select((first + k) % n);
        app.update(Action::Engine(w.view()));
        assert_eq!(app.walkthrough.selected, (first + 3) % n);
    }
}

/// Issue 32 §2: closing the terminal (SIGHUP) left the demo's working copy
/// under the temporary directory. A hang-up, or SIGTERM, ends the console as
/// `Q` does: the working copy is removed.
#[cfg(unix)]
#[test]
fn closing_the_terminal_or_sigterm_removes_the_working_copy() {
    for how in ["HUP", "TERM"] {
        let config = tempfile::tempdir().unwrap();
        let t = Pty::spawn(&[], config.path());
        t.wait_for("OUTCOME_UNKNOWN");
        let copies = || {
            std::fs::read_dir(config.path())
                .unwrap()
                .filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().starts_with("toolgate-console-"))
                .count()
        };
        assert_eq!(copies(), 1, "{how}: the working copy is there while the console runs");
        let status = t.signal(how);
        eprintln!("SIG{how}: {status:?}");
        assert_eq!(copies(), 0, "{how}: the working copy is removed");
    }
}

/// Issue 32 §2: at 160 columns the tables cut text while space was free (a
/// code at 22 characters, the operator log's reasons at 40). The room left
/// over goes to that text.
#[test]
fn at_160_columns_the_tables_use_the_free_space() {
    let mut d = demo();
    let screen = text(&draw(&app_on(&mut d, Pane::Ledger, 160, 45), 160, 45));
    assert!(screen.contains(" BUSINESS_RULE_VIOLATION "), "{screen}");
    let app = app_on(&mut d, Pane::Audit, 160, 45);
    let Rows::Audit(rows) = &app.rows else { panic!() };
    let screen = text(&draw(&app, 160, 45));
    for r in rows.iter().filter(|r| r.reason.chars().count() < 70) {
        assert!(screen.contains(&r.reason), "{:?} whole:\n{screen}", r.reason);
    }
    let screen = text(&draw(&app_on(&mut d, Pane::Unknown, 160, 45), 160, 45));
    assert!(line_of(&screen, "op_a04bfa").contains("sr1_8d07446c00697e02171b7"), "{screen}");
    for (w, h) in [(80, 24), (160, 45)] {
        for pane in [Pane::Ledger, Pane::Audit, Pane::Unknown] {
            let screen = text(&draw(&app_on(&mut d, pane, w, h), w, h));
            fits(&screen, w, h);
        }
    }
}

/// Found trying issue 32 §2 in a terminal: `f` typed four times at once asked
/// for 1% four times (each stepped from the rate the engine last reported).
#[test]
fn f_typed_in_a_burst_steps_the_fault_rate_each_time() {
    let mut d = demo();
    let mut app = app_on(&mut d, Pane::Unknown, 80, 24);
    let asked: Vec<Option<Request>> = (0..4).map(|_| app.update(key('f'))).collect();
    let expect: Vec<Option<Request>> = [100, 500, 2_000, 10_000].map(|bp| Some(Request::SetFaultRate(bp))).to_vec();
    assert_eq!(asked, expect);
}

/// Issue 32 §2: in a walkthrough every pane showed the scratch database
/// against the wall clock ("339 days overdue", "oldest 340d"). While a
/// scenario runs, the panes measure against the scenario's own clock; once
/// none runs, against the wall clock again.
#[test]
fn a_walkthrough_measures_its_scratch_database_on_the_scenarios_clock() {
    use toolgate::tui::app::WalkthroughView;
    let mut app = App::new("demo", "alice", false, false, NOW);
    let scenario_now = NOW - 339 * 86_400_000;
    let running = WalkthroughView {
        db_label: Some("scenario 1 scratch db".into()),
        clock_ms: Some(scenario_now),
        ..WalkthroughView::default()
    };
    app.update(Action::Engine(EngineEvent::Walkthrough(running.clone())));
    assert_eq!(app.now_ms, scenario_now);
    app.update(Action::Tick(NOW + 1_000));
    assert_eq!(app.now_ms, scenario_now, "a tick keeps the scenario's clock");
    app.update(Action::Engine(EngineEvent::Walkthrough(WalkthroughView::default())));
    app.update(Action::Tick(NOW + 2_000));
    assert_eq!(app.now_ms, NOW + 2_000, "no scenario: the wall clock");
}

/// Issue 40: a pane's title counts the whole list, not the page: with 31
/// operations and 15 rows visible the Ledger reads `(15 of 31) · page 1 of
/// 3`, then `page 2 of 3` on the next page.
#[test]
fn a_panes_title_counts_the_whole_list_and_says_page_k_of_n() {
    let mut d = demo();
    for i in 0..20 {
        let env = d.engine.dispatch(&crate::support::refund(&format!("title-count-{i:04}"), 1)).unwrap();
        assert!(env.protected_audit.operation_id.is_some(), "{env:?}");
    }
    let mut app = app_on(&mut d, Pane::Ledger, 120, 24);
    assert_eq!(app.visible_rows(), 15);
    let screen = text(&draw(&app, 120, 24));
    assert!(screen.contains("Idempotency ledger (15 of 31)") && screen.contains("page 1 of 3"), "{screen}");
    let Some(Request::Fetch { .. }) = press(&mut app, KeyCode::PageDown) else { panic!("a fetch of the next page") };
    let rows = d
        .engine
        .ops_page(
            OpsView::All,
            &toolgate::store::Filter::default(),
            toolgate::tui::app::default_order(Pane::Ledger),
            app.cursor.as_ref(),
            15,
        )
        .unwrap();
    let header = d.engine.header_counts().unwrap();
    app.update(Action::Engine(EngineEvent::Page { pane: Pane::Ledger, rows: Rows::Ops(rows), header }));
    let screen = text(&draw(&app, 120, 24));
    assert!(screen.contains("(15 of 31)") && screen.contains("page 2 of 3"), "{screen}");
}
