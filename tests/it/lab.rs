//! The classroom lab: each "defenses off" toggle, run under the load generator's
//! agents, does the harm it exists to demonstrate, and the same traffic with the
//! defense on does none; the lab is refused on a database not marked as a demo;
//! and the `load`, `lab` and `cancel` commands keep the CLI contract.
//!
//! The agents run on a manual clock (every wait is instant) and without fsync;
//! each run is a few dozen intents on a fresh working copy of the demo database.
//! One agent (with its two dispatcher replicas) keeps a run deterministic for its
//! seed; the CLI test and `toolgate load` run several agents concurrently.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use toolgate::Coded;

use assert_cmd::Command;
use serde_json::Value;
use toolgate::engine::clock::ManualClock;
use toolgate::engine::{Engine, LabToggle};
use toolgate::load::{self, LoadOptions, LoadReport};
use toolgate::store::Sync;

use crate::support::{Backend, Fixture, PgDb, T0};

/// A demo database (marked `demo`), re-based to T0.
fn demo_db(dir: &Path) -> PathBuf {
    toolgate::demo::working_copy(dir, T0).unwrap()
}

/// A demo database on a backend: the committed file's working copy, or the
/// same demo generated into a new PostgreSQL database (kept by the guard).
fn demo_on(backend: Backend, dir: &Path) -> (PathBuf, Option<PgDb>) {
    match backend {
        Backend::Sqlite => (demo_db(dir), None),
        Backend::Postgres => {
            let pg = PgDb::new().unwrap();
            let url = toolgate::demo::working_copy_at(Path::new(&pg.url), T0).unwrap();
            (url, Some(pg))
        }
    }
}

fn opts(lab: Option<LabToggle>) -> LoadOptions {
    LoadOptions {
        agents: 1,
        ops: 30,
        fault_bp: Some(1_000),
        seed: 7,
        lab,
        operator: "teacher".into(),
        clock: Arc::new(ManualClock::new(T0)),
        sync: Sync::Normal,
        settle_ms: 60_000,
        // No background worker: one agent and its replicas make the run deterministic.
        worker_interval_ms: None,
        ..LoadOptions::default()
    }
}

/// Runs the same traffic with the defense off, then (on a fresh copy) on.
fn both(backend: Backend, toggle: LabToggle, tune: impl Fn(&mut LoadOptions)) -> (LoadReport, LoadReport) {
    let run = |lab: Option<LabToggle>| {
        let dir = tempfile::tempdir().unwrap();
        let (db, _pg) = demo_on(backend, dir.path());
        let mut o = opts(lab);
        tune(&mut o);
        let r = load::run(&db, &o, &mut |_| {}).unwrap();
        // The run puts the defense back; the lab never leaks past it.
        let mut e = Engine::open(&db, toolgate::tools::demo_options()).unwrap();
        assert_eq!(e.lab_state().unwrap().toggle, None);
        assert_eq!(r.ops, o.ops);
        r
    };
    (run(Some(toggle)), run(None))
}

fn assert_clean(r: &LoadReport) {
    assert_eq!((r.duplicates, r.silently_wrong), (0, 0), "with every defense on: {r:#?}");
}

fn server_generated_keys_turn_replays_into_second_refunds(backend: Backend) {
    let (off, on) = both(backend, LabToggle::ServerGeneratedKey, |o| o.replay_percent = 30);
    assert!(off.duplicates > 0, "{off:#?}");
    // The model's replay got a fresh refund, not the first one.
    assert!(off.replay_mismatches > 0);
    assert_clean(&on);
    assert!(on.answers.contains_key("succeeded") && on.effects > 0);
}

fn a_conflict_answered_with_the_old_result_drops_the_second_request_silently(backend: Backend) {
    let (off, on) = both(backend, LabToggle::ConflictReturnsOldResult, |o| o.conflict_percent = 40);
    assert!(off.masked_conflicts > 0, "{off:#?}");
    // No second effect: the harm is a wrong answer that looks right.
    assert_eq!(off.duplicates, 0);
    assert_clean(&on);
    assert!(on.answers.get("IDEMPOTENCY_CONFLICT").is_some_and(|n| *n > 0), "the control saw conflicts");
}

fn an_in_memory_ledger_forgets_keys_across_replicas_and_restarts(backend: Backend) {
    let (off, on) = both(backend, LabToggle::InMemoryLedger, |o| {
        o.replay_percent = 30;
        o.restart_percent = 20;
    });
    assert!(off.duplicates > 0, "{off:#?}");
    assert!(on.restarts > 0, "the control restarted dispatchers too");
    assert_clean(&on);
}

fn dropped_error_codes_make_harnesses_believe_refunds_failed(backend: Backend) {
    let (off, on) = both(backend, LabToggle::ErrorCodesDropped, |o| {
        o.fault_bp = Some(4_000);
        o.ops = 40;
    });
    assert!(off.wrong_beliefs > 0, "{off:#?}");
    // The ledger itself held: the keys stayed stable, so no second effect.
    assert_eq!(off.duplicates, 0);
    assert_clean(&on);
    assert!(on.answers.get("OUTCOME_UNKNOWN").is_some_and(|n| *n > 0), "the control met lost replies");
}

fn a_naive_timeout_retry_notifies_customers_twice(backend: Backend) {
    let (off, on) = both(backend, LabToggle::NaiveTimeoutRetry, |o| {
        o.notify_percent = 100;
        o.fault_bp = Some(5_000);
        o.ops = 40;
    });
    assert!(off.duplicates > 0, "{off:#?}");
    assert_clean(&on);
    assert!(on.answers.get("OUTCOME_UNKNOWN").is_some_and(|n| *n > 0), "the control met lost replies");
}

fn the_lab_is_refused_on_a_database_not_marked_as_a_demo(backend: Backend) {
    let fx = Fixture::on(backend);
    let mut e = fx.engine();
    assert!(!e.lab_state().unwrap().demo);
    let err = e.set_lab_toggle(Some(LabToggle::ServerGeneratedKey), "teacher").unwrap_err();
    assert_eq!(err.code(), "LAB_NOT_DEMO");
    let err = load::run(fx.path(), &opts(Some(LabToggle::InMemoryLedger)), &mut |_| {}).unwrap_err();
    assert_eq!(err.code(), "LAB_NOT_DEMO");
    // Not even a meta row sneaks in, and the operator log has nothing.
    let mut e = fx.engine();
    assert_eq!(e.lab_state().unwrap().toggle, None);
    assert!(e.audit_log(10).unwrap().is_empty());
    // The CLI says so with the stable code (exit 2), and `init` never marks an
    // existing ledger: running it again changes nothing about the mark.
    let out = tg().args(["lab", "--toggle", "in_memory_ledger", "--db"]).arg(fx.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[LAB_NOT_DEMO]"), "{out:?}");
    let out = tg().args(["init", "--db"]).arg(fx.path()).output().unwrap();
    assert_ne!(out.status.code(), Some(0), "init does not re-initialise an existing ledger");
    let out = tg().args(["lab", "--json", "--db"]).arg(fx.path()).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["lab"]["demo"].as_bool(), v["lab"]["toggle"].is_null()), (Some(false), true));
}

fn a_demo_database_takes_one_toggle_at_a_time_and_logs_who(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let (db, _pg) = demo_on(backend, dir.path());
    let mut e = Engine::open(&db, toolgate::tools::demo_options()).unwrap();
    assert!(e.lab_state().unwrap().demo);
    e.set_lab_toggle(Some(LabToggle::ServerGeneratedKey), "teacher").unwrap();
    e.set_lab_toggle(Some(LabToggle::InMemoryLedger), "teacher").unwrap();
    assert_eq!(e.lab_state().unwrap().toggle, Some(LabToggle::InMemoryLedger));
    e.set_lab_toggle(None, "teacher").unwrap();
    assert_eq!(e.lab_state().unwrap().toggle, None);
    let log: Vec<String> =
        e.audit_log(10).unwrap().into_iter().filter(|a| a.action == "lab").map(|a| a.reason).collect();
    assert_eq!(log, ["every defense back on", "defense off: in_memory_ledger", "defense off: server_generated_key"]);
}

fn tg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_toolgate"));
    c.env_remove("RUST_BACKTRACE");
    c
}

#[test]
fn load_prints_a_table_or_json_and_passes_with_every_defense_on() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("load.db");
    tg().args(["init", "--db"]).arg(&db).assert().success();
    // A manual clock (--now): retries and status-query waits take no real time.
    let out = tg()
        .args(["load", "--agents", "2", "--ops", "30", "--fault-rate", "10%", "--seed", "3", "--json"])
        .args(["--now", "2026-01-01T00:00:00Z", "--db"])
        .arg(&db)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["ops"].as_u64(), v["duplicates"].as_i64(), v["silently_wrong"].as_u64()),
        (Some(30), Some(0), Some(0))
    );
    assert_eq!(v["fault_bp"].as_u64(), Some(1_000));
    assert!(v["latency"]["p99_us"].as_u64().unwrap() >= v["latency"]["p50_us"].as_u64().unwrap());
    // Not a terminal: no progress bar on stderr.
    assert!(out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = tg()
        .args(["load", "--agents", "1", "--ops", "5", "--now", "2026-01-01T00:00:00Z", "--db"])
        .arg(&db)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in ["answers (every call)", "duplicate effects", "silently wrong results", "p50", "p95", "p99"] {
        assert!(text.contains(needle), "{needle} missing from:\n{text}");
    }
    // Usage errors keep the contract.
    let out = tg().args(["load", "--fault-rate", "250%", "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[BAD_FAULT_RATE]"));
    let out = tg().args(["load", "--lab", "nope", "--db"]).arg(&db).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[UNKNOWN_TOGGLE]"));
}

/// Issue 32 §3: `load` exited 0 after every call was UNKNOWN_TOOL.
#[test]
fn a_load_whose_every_call_is_refused_for_what_it_asked_fails() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("load.db");
    tg().args(["init", "--db"]).arg(&db).assert().success();
    let cat = dir.path().join("cat");
    std::fs::create_dir(&cat).unwrap();
    std::fs::write(cat.join("get_order.json"), include_str!("../../assets/catalog/get_order.json")).unwrap();
    let out = tg()
        .args(["load", "--agents", "1", "--ops", "5", "--json", "--now", "2026-01-01T00:00:00Z", "--catalog"])
        .arg(&cat)
        .arg("--db")
        .arg(&db)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["answers"]["UNKNOWN_TOOL"].as_u64(), Some(5), "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("every call was refused for what it asked"));
}

#[test]
fn cancel_from_the_cli_needs_an_operator_and_reports_what_happened() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("cancel.db");
    tg().args(["init", "--db"]).arg(&db).assert().success();
    let args = r#"{"order_ref":"ord_1001","amount_minor":100,"currency":"EUR","reason":"damaged"}"#;
    let out = tg()
        .args(["dispatch", "--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--key"])
        .args(["cli-cancel-0001", "--args", args, "--fault", "rate_limit(60000)", "--deadline-ms", "1000"])
        .args(["--now", "2026-01-01T00:00:00Z", "--json", "--db"])
        .arg(&db)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let op = v["protected_audit"]["operation_id"].as_str().unwrap().to_string();
    let out = tg().args(["cancel", &op, "--note", "x", "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[OPERATOR_REQUIRED]"));
    let out = tg()
        .args(["cancel", &op, "--operator", "kim", "--note", "customer withdrew", "--json", "--db"])
        .arg(&db)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["applied"].as_bool(), v["code"].as_str()), (Some(true), Some("OK")));
    let out = tg().args(["cancel", &op, "--operator", "kim", "--note", "again", "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("refused [NOT_CANCELLABLE]"));
    let out = tg().args(["ops", "show", &op, "--json", "--db"]).arg(&db).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["operation"]["code"], "CANCELLED");
}

// ------------------------------------------------------------------ console

mod console {
    use ratatui::backend::TestBackend;
    use ratatui::crossterm::event::{KeyCode, KeyEvent, KeyModifiers};
    use ratatui::Terminal;
    use toolgate::engine::{Engine, EngineOptions, LabToggle};
    use toolgate::store::OpsView;
    use toolgate::tui::app::{Action, AgentsView, App, EngineEvent, LabView, Mode, Pane, Request, Rows};
    use toolgate::tui::{keymap, ui};

    const NOW: i64 = 1_800_000_000_000;

    fn engine(dir: &std::path::Path, demo: bool) -> Engine {
        let path = if demo {
            toolgate::demo::working_copy(dir, NOW).unwrap()
        } else {
            let p = dir.join("ledger.db");
            let mut e = Engine::create(&p, toolgate::tools::demo_options()).unwrap();
            let w = toolgate::engine::world::World::parse(toolgate::engine::world::DEMO_WORLD.as_bytes()).unwrap();
            e.load_world(&w).unwrap();
            p
        };
        let clock = toolgate::engine::clock::ManualClock::new(NOW);
        Engine::open(&path, EngineOptions { clock: std::sync::Arc::new(clock), ..toolgate::tools::demo_options() })
            .unwrap()
    }

    /// The console on a pane, fed what the backend would send.
    fn app_on(e: &mut Engine, pane: Pane, w: u16, h: u16, agents: Option<AgentsView>) -> App {
        let label = if e.is_demo() { "demo.db (working copy)" } else { "ledger.db" };
        let mut app = App::new(label, "teacher", false, false, NOW);
        app.size = (w, h);
        app.update(Action::SelectPane(pane));
        let limit = app.visible_rows();
        let rows = match pane {
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
            Pane::Live => Rows::Live(
                e.live_page(
                    &toolgate::store::Filter::default(),
                    toolgate::tui::app::default_order(Pane::Live),
                    None,
                    limit,
                )
                .unwrap(),
            ),
            _ => Rows::Ops(
                e.ops_page(
                    OpsView::Unknown,
                    &toolgate::store::Filter::default(),
                    toolgate::tui::app::default_order(Pane::Unknown),
                    None,
                    limit,
                )
                .unwrap(),
            ),
        };
        app.update(Action::Engine(EngineEvent::Page { pane, rows, header: e.header_counts().unwrap() }));
        let s = e.lab_state().unwrap();
        let lab = LabView {
            demo: s.demo,
            toggle: s.toggle,
            fault_bp: s.fault_bp,
            masked_conflicts: s.masked_conflicts,
            agents,
        };
        app.update(Action::Engine(EngineEvent::Lab(lab)));
        app
    }

    fn text(app: &App, w: u16, h: u16) -> String {
        let mut t = Terminal::new(TestBackend::new(w, h)).unwrap();
        t.draw(|f| {
            ui::render(app, f);
        })
        .unwrap();
        let b = t.backend().buffer().clone();
        let mut s = String::new();
        for y in 0..b.area.height {
            let line: String = (0..b.area.width).map(|x| b[(x, y)].symbol().to_string()).collect();
            s.push_str(line.trim_end());
            s.push('\n');
        }
        s
    }

    fn press(app: &mut App, code: KeyCode) -> Option<Request> {
        let action = keymap::lookup(app.mode, &KeyEvent::new(code, KeyModifiers::NONE), app.read_only)?;
        app.update(action)
    }

    #[test]
    fn the_lab_panel_explains_which_rule_is_broken() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), true);
        e.set_lab_toggle(Some(LabToggle::ConflictReturnsOldResult), "teacher").unwrap();
        e.set_load_fault_rate(500).unwrap();
        let agents = AgentsView {
            intents: 120,
            calls: 180,
            masked_conflicts: 4,
            replay_mismatches: 0,
            wrong_beliefs: 0,
            restarts: 2,
        };
        for (w, h) in [(100u16, 30u16), (140, 40)] {
            let mut app = app_on(&mut e, Pane::Ledger, w, h, Some(agents.clone()));
            // The header says a defense is off, and the fault rate.
            let screen = text(&app, w, h);
            assert!(
                screen.contains("LAB: conflict_returns_old_result OFF") && screen.contains("faults 5%"),
                "{screen}"
            );
            press(&mut app, KeyCode::Char('L'));
            assert_eq!(app.mode, Mode::Lab);
            insta::assert_snapshot!(format!("lab_panel_{w}x{h}"), text(&app, w, h));
        }
    }

    #[test]
    fn the_lab_panel_on_a_real_ledger_says_it_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), false);
        let mut app = app_on(&mut e, Pane::Ledger, 100, 30, None);
        press(&mut app, KeyCode::Char('L'));
        let screen = text(&app, 100, 30);
        assert!(screen.contains("LAB_NOT_DEMO"), "{screen}");
        insta::assert_snapshot!("lab_panel_refused_100x30", screen);
        // Enter asks for nothing and says why.
        assert_eq!(press(&mut app, KeyCode::Enter), None);
        assert!(app.status.as_ref().is_some_and(|(s, err)| *err && s.contains("LAB_NOT_DEMO")));
    }

    #[test]
    fn lab_keys_confirm_before_switching_and_cycle_faults() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), true);
        let mut app = app_on(&mut e, Pane::Ledger, 140, 40, None);
        press(&mut app, KeyCode::Char('L'));
        press(&mut app, KeyCode::Char('j'));
        press(&mut app, KeyCode::Char('j'));
        // Enter opens a confirm dialog with the rule; Cancel is the default.
        assert_eq!(press(&mut app, KeyCode::Enter), None);
        assert_eq!(app.mode, Mode::Confirm);
        let c = app.dialog.confirm.clone().unwrap();
        assert_eq!(c.request, Request::SetLab(Some(LabToggle::InMemoryLedger)));
        assert!(!c.on_confirm && c.evidence.iter().any(|l| l.contains("UNIQUE")), "{c:?}");
        assert_eq!(press(&mut app, KeyCode::Enter), None, "the default button is Cancel");
        assert_eq!(app.mode, Mode::Lab, "back to the panel");
        press(&mut app, KeyCode::Enter);
        press(&mut app, KeyCode::Tab);
        assert_eq!(press(&mut app, KeyCode::Enter), Some(Request::SetLab(Some(LabToggle::InMemoryLedger))));
        // The engine's answer comes back as the next lab view; `o` puts the defense back.
        e.set_lab_toggle(Some(LabToggle::InMemoryLedger), "teacher").unwrap();
        app.lab.toggle = Some(LabToggle::InMemoryLedger);
        assert_eq!(press(&mut app, KeyCode::Char('o')), Some(Request::SetLab(None)));
        // Fault rate steps: 0 → 1% → ... → 100% → 0.
        app.lab.fault_bp = 500;
        assert_eq!(press(&mut app, KeyCode::Char('f')), Some(Request::SetFaultRate(2_000)));
        app.lab.fault_bp = 10_000;
        assert_eq!(press(&mut app, KeyCode::Char('f')), Some(Request::SetFaultRate(0)));
        press(&mut app, KeyCode::Esc);
        assert_eq!(app.mode, Mode::Normal);
        // Read-only: the panel opens, but nothing in it switches.
        app.read_only = true;
        press(&mut app, KeyCode::Char('L'));
        assert_eq!(app.mode, Mode::Lab);
        for code in [KeyCode::Enter, KeyCode::Char('o'), KeyCode::Char('f')] {
            assert_eq!(press(&mut app, code), None);
        }
        assert!(keymap::help_lines(Mode::Normal, true).iter().all(|(k, _)| !["c", "f"].contains(k)));
    }

    #[test]
    fn cancel_asks_for_a_note_then_shows_what_cancelling_means() {
        let dir = tempfile::tempdir().unwrap();
        let mut e = engine(dir.path(), true);
        let mut app = app_on(&mut e, Pane::Ledger, 140, 40, None);
        let Rows::Ops(rows) = &app.rows else { panic!("ledger rows") };
        let accepted = rows.iter().position(|o| o.state == "accepted").expect("the demo has an accepted operation");
        let succeeded = rows.iter().position(|o| o.state == "succeeded").unwrap();
        let (id, version) = (rows[accepted].id.clone(), rows[accepted].version);
        // Not cancellable: said on the status bar, nothing asked.
        app.selected = succeeded;
        assert_eq!(press(&mut app, KeyCode::Char('c')), None);
        assert_eq!(app.mode, Mode::Normal);
        assert!(app.status.as_ref().is_some_and(|(_, err)| *err));
        app.selected = accepted;
        press(&mut app, KeyCode::Char('c'));
        assert_eq!(app.mode, Mode::Form);
        assert_eq!(press(&mut app, KeyCode::Enter), None, "a note is required");
        for ch in "customer withdrew".chars() {
            press(&mut app, KeyCode::Char(ch));
        }
        press(&mut app, KeyCode::Enter);
        assert_eq!(app.mode, Mode::Confirm);
        let c = app.dialog.confirm.clone().unwrap();
        assert!(c.evidence.iter().any(|l| l.contains("nothing sent yet")), "{c:?}");
        insta::assert_snapshot!("cancel_confirm_140x40", text(&app, 140, 40));
        press(&mut app, KeyCode::Tab);
        let req = press(&mut app, KeyCode::Enter);
        assert_eq!(
            req,
            Some(Request::Cancel {
                operation_id: id.clone(),
                note: "customer withdrew".into(),
                seen_version: Some(version)
            })
        );
        // What the backend does with it: the engine cancels, before send.
        let out = e
            .cancel(&toolgate::engine::CancelRequest {
                operation_id: id.clone(),
                operator: "teacher".into(),
                note: "customer withdrew".into(),
                seen_version: Some(version),
                action_id: None,
            })
            .unwrap();
        assert!(out.applied, "{out:?}");
        assert_eq!(e.operation_detail(&id).unwrap().unwrap().operation.code.as_deref(), Some("CANCELLED"));
    }
}

crate::on_both_backends!(
    server_generated_keys_turn_replays_into_second_refunds,
    a_conflict_answered_with_the_old_result_drops_the_second_request_silently,
    an_in_memory_ledger_forgets_keys_across_replicas_and_restarts,
    dropped_error_codes_make_harnesses_believe_refunds_failed,
    a_naive_timeout_retry_notifies_customers_twice,
    the_lab_is_refused_on_a_database_not_marked_as_a_demo,
    a_demo_database_takes_one_toggle_at_a_time_and_logs_who,
);
