//! The scenarios of docs/design.md §13 as data: every script passes (with a real child
//! crash, and with the console's in-process one), the runner reports a wrong
//! expectation as FAIL with its step and field, the loader refuses bad scripts
//! naming the step and field, and `toolgate scenario` works from the CLI.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::{json, Value};
use toolgate::engine::Engine;
use toolgate::scenarios::{
    self, report, script, CrashKind, CrashMode, Mismatch, RunOptions, ScenarioError, ScenarioRun, Script,
};

fn child() -> CrashMode {
    CrashMode::ChildProcess(PathBuf::from(env!("CARGO_BIN_EXE_toolgate")))
}

fn opts(crash_mode: CrashMode) -> RunOptions {
    RunOptions { crash_mode, keep_db: None, http: None }
}

fn builtin(id: u32) -> Script {
    scenarios::select(&id.to_string()).unwrap().remove(0)
}

/// A built-in scenario file as JSON, to make a test copy of it.
fn builtin_json(id: u32) -> Value {
    let name = &builtin(id).file;
    let (_, text) = scenarios::BUILTIN.iter().find(|(n, _)| n == name).unwrap();
    serde_json::from_str(text).unwrap()
}

fn parse(v: &Value) -> Result<Script, ScenarioError> {
    script::parse("copy.json", v.to_string().as_bytes())
}

use crate::support::{Backend, PgDb};

fn toolgate() -> Command {
    Command::cargo_bin("toolgate").unwrap()
}

fn every_scenario_passes_with_a_real_crash_and_leaves_a_ledger_that_audits_clean(backend: Backend) {
    let all = scenarios::builtin().unwrap();
    assert_eq!(all.len(), scenarios::BUILTIN.len());
    let dir = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    let mut keep = Vec::new();
    for s in &all {
        let db = match backend {
            Backend::Sqlite => dir.path().join(format!("{}.db", s.slug)),
            Backend::Postgres => {
                let pg = PgDb::new().unwrap();
                let url = PathBuf::from(&pg.url);
                keep.push(pg);
                url
            }
        };
        let r = ScenarioRun::run(s, RunOptions { crash_mode: child(), keep_db: Some(db.clone()), http: None }).unwrap();
        if !r.passed {
            failed.push(report::render(&r));
        }
        let findings = Engine::open(&db, toolgate::tools::demo_options()).unwrap().audit().unwrap();
        assert!(findings.is_empty(), "scenario {}: {findings:?}", s.id);
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn every_scenario_passes_with_the_consoles_in_process_crash() {
    for s in scenarios::builtin().unwrap() {
        let r = ScenarioRun::run(&s, opts(CrashMode::InProcess)).unwrap();
        assert!(r.passed, "{}", report::render(&r));
        assert_eq!(r.crash_mode, CrashKind::InProcess);
    }
}

#[test]
fn scenario_4_aborts_a_real_child_process_and_the_observation_says_so() {
    let mut run = ScenarioRun::new(&builtin(4), opts(child())).unwrap();
    let crash = run.step().unwrap();
    let report = crash.crash.clone().unwrap();
    assert_eq!(report.mode, CrashKind::ChildProcess);
    assert!(report.aborted, "{}", report.detail);
    assert!(report.detail.contains("SIGABRT"), "{}", report.detail);
    // The provider committed; the dead process never stored the result.
    assert_eq!((crash.transition.to.as_str(), crash.effects), ("in_flight", 1));
    assert!(crash.envelope.is_none(), "the caller got no reply");
    while run.step().is_some() {}
    let r = run.report();
    assert!(r.passed, "{}", report::render(&r));
    assert!(r.steps.iter().all(|o| o.duplicates == 0));
}

#[test]
fn the_stepper_runs_one_step_at_a_time_and_simulates_the_crash_in_process() {
    let script = builtin(4);
    let mut run = ScenarioRun::new(&script, opts(CrashMode::InProcess)).unwrap();
    assert!(run.db_path().exists());
    assert_eq!(run.next_step().map(|s| s.number), Some(1));
    let first = run.step().unwrap();
    assert_eq!(first.step, 1);
    let crash = first.crash.unwrap();
    assert_eq!(crash.mode, CrashKind::InProcess);
    assert!(crash.detail.contains("in this process"), "{}", crash.detail);
    // The simulation loses the reply of a committed call: the ledger says unknown
    // (a real crash leaves in_flight); the script states both.
    assert_eq!(first.transition.to, "unknown");
    assert!(first.passed, "{:?}", first.failures);
    assert_eq!(run.observations().len(), 1);
    let mut n = 1;
    while let Some(o) = run.step() {
        n += 1;
        assert_eq!(o.step, n);
        assert!(o.passed, "step {n}: {:?}", o.failures);
    }
    assert_eq!(n, script.steps.len());
    assert!(run.is_finished());
    assert!(run.step().is_none());
}

#[test]
fn a_wrong_expectation_fails_naming_the_step_and_the_field() {
    // (scenario, step, expectation field, wrong value, what really happens)
    let cases: Vec<(u32, usize, &str, Value, &str)> = vec![
        (2, 2, "delivery", json!("fresh"), "local_replay"),
        (3, 2, "code", json!("CALL_ID_CONFLICT"), "IDEMPOTENCY_CONFLICT"),
        (4, 1, "transition", json!("none -> succeeded"), "none → in_flight"),
        (4, 3, "code", Value::Null, "OUTCOME_UNKNOWN"),
        (4, 12, "transition", json!("unknown -> succeeded"), "unknown → needs_review"),
        (5, 3, "sees", json!("refunded 600.00 EUR on ord_1002"), "APPROVAL_INVALID: ask an approver"),
        (6, 3, "data", json!("present"), "null"),
        (7, 1, "elapsed_ms", json!(0), "2000"),
        (9, 3, "status_ref", json!({"differs_from": 2}), ""),
        (11, 5, "trace_includes", json!(["persisted"]), ""),
        (1, 1, "effects", json!(2), "1"),
    ];
    for (id, step, field, wrong, actual) in cases {
        let mut v = builtin_json(id);
        v["steps"][step - 1]["expect"][field] = wrong.clone();
        let script = parse(&v).unwrap_or_else(|e| panic!("{e}"));
        let r = ScenarioRun::run(&script, opts(child())).unwrap();
        let what = format!("scenario {id} step {step} {field}={wrong}");
        assert!(!r.passed, "{what}: the runner must fail");
        let failing: Vec<(usize, &Mismatch)> =
            r.steps.iter().flat_map(|o| o.failures.iter().map(move |m| (o.step, m))).collect();
        assert_eq!(failing.len(), 1, "{what}: only that field fails: {failing:?}");
        let (at, m) = failing[0];
        assert_eq!((at, m.field.as_str()), (step, field), "{what}");
        if !actual.is_empty() {
            assert_eq!(m.actual, actual, "{what}");
        }
        let table = report::render(&r);
        assert!(table.contains(&format!("✗ {field}: expected")), "{what}:\n{table}");
        assert!(table.contains("FAIL"), "{table}");
    }
}

#[test]
fn a_step_that_cannot_run_fails_and_stops_the_run() {
    // Step 3 of scenario 6 is POLICY_DENIED: its envelope has no status_ref to query.
    let mut v = builtin_json(6);
    v["steps"][3]["status_ref_from"] = json!(3);
    let script = parse(&v).unwrap();
    let mut run = ScenarioRun::new(&script, opts(child())).unwrap();
    for _ in 0..3 {
        assert!(run.step().unwrap().passed);
    }
    let stuck = run.step().unwrap();
    assert!(!stuck.passed);
    assert_eq!(stuck.failures[0].field, "status_ref_from");
    assert!(stuck.failures[0].actual.contains("step 3 returned no status_ref"), "{:?}", stuck.failures);
    assert!(run.step().is_none(), "the run stops at a step that could not run");
    let r = run.report();
    assert!(!r.passed);
    assert!(report::render(&r).contains(&format!("3 of {} steps passed (stopped after step 4)", script.steps.len())));
}

/// Loads a mutated copy of a built-in scenario and expects a refusal whose
/// message contains every one of `expect`.
#[track_caller]
fn refused(v: &Value, expect: &[&str]) {
    let err = parse(v).err().unwrap_or_else(|| panic!("accepted: {v}"));
    assert!(matches!(err, ScenarioError::Script { .. }), "{err:?}");
    let msg = err.to_string();
    for e in expect {
        assert!(msg.contains(e), "{e:?} not in: {msg}");
    }
}

#[test]
fn the_loader_refuses_bad_scripts_and_names_the_step_and_field() {
    let base = builtin_json(4);
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = base.clone();
        f(&mut v);
        v
    };
    // Unknown fields, at every level.
    refused(&with(&|v| v["author"] = json!("x")), &["copy.json: author", "unknown field `author`"]);
    refused(&with(&|v| v["steps"][2]["amount"] = json!(5)), &["step 3.amount", "unknown field `amount`"]);
    refused(
        &with(&|v| v["steps"][2]["expect"]["efects"] = json!(1)),
        &["step 3 (dispatch).expect.efects", "unknown field"],
    );
    refused(&with(&|v| v["steps"][2]["in_process"]["colour"] = json!(1)), &["step 3 (dispatch).in_process.colour"]);
    // A step that uses a later step, or itself.
    refused(
        &with(&|v| v["steps"][4]["status_ref_from"] = json!(7)),
        &["step 5 (query).status_ref_from", "refers to step 7", "comes later"],
    );
    refused(&with(&|v| v["steps"][4]["status_ref_from"] = json!(5)), &["step 5 (query).status_ref_from", "itself"]);
    refused(
        &with(&|v| v["steps"][3]["expect"]["status_ref"] = json!({"same_as": 9})),
        &["step 4 (dispatch).expect.status_ref.same_as", "refers to step 9"],
    );
    refused(
        &with(&|v| v["steps"][13]["operation_from"] = json!(15)),
        &["step 14 (resolve).operation_from", "step 15 comes later"],
    );
    // A reference to a step that has nothing to give.
    refused(
        &with(&|v| v["steps"][4]["status_ref_from"] = json!(1)),
        &["step 5 (query).status_ref_from", "step 1 (crash) returns no envelope"],
    );
    // Unknown codes, states and values.
    refused(
        &with(&|v| v["steps"][2]["expect"]["code"] = json!("OUTCOME_UNKOWN")),
        &["step 3 (dispatch).expect.code", "unknown code \"OUTCOME_UNKOWN\""],
    );
    refused(
        &with(&|v| v["steps"][2]["expect"]["transition"] = json!("none -> done")),
        &["step 3 (dispatch).expect.transition", "unknown state \"done\""],
    );
    refused(
        &with(&|v| v["steps"][2]["expect"]["delivery"] = json!("replay")),
        &["step 3 (dispatch).expect.delivery", "unknown delivery"],
    );
    refused(
        &with(&|v| v["steps"][2]["expect"]["effects"] = json!("one")),
        &["step 3 (dispatch).expect.effects", "invalid type"],
    );
    refused(&with(&|v| v["steps"][2]["action"] = json!("teleport")), &["step 3.action", "unknown action \"teleport\""]);
    refused(&with(&|v| v["steps"][6]["fault"] = json!("explode")), &["step 7 (dispatch).fault", "bad fault spec"]);
    // Fields an action does not take, expectations it cannot show, missing ones.
    refused(
        &with(&|v| v["steps"][1]["tool"] = json!("create_refund")),
        &["step 2 (restart).tool", "not a field of restart"],
    );
    refused(
        &with(&|v| v["steps"][1]["expect"]["code"] = Value::Null),
        &["step 2 (restart).expect.code", "returns no envelope"],
    );
    refused(
        &with(&|v| {
            v["steps"][2]["expect"].as_object_mut().unwrap().remove("sees");
        }),
        &["step 3 (dispatch).expect.sees", "missing"],
    );
    // The dispatcher is down after a crash until a restart.
    refused(
        &with(&|v| {
            v["steps"].as_array_mut().unwrap().remove(1);
        }),
        &["step 2 (dispatch).action", "the dispatcher is down", "restart"],
    );
    // In-process differences only where a crash came before.
    let mut v = builtin_json(2);
    v["steps"][0]["in_process"] = json!({"transition": "none -> unknown"});
    refused(&v, &["step 1 (dispatch).in_process", "crash"]);
    // Await needs a background call still running.
    let mut v = builtin_json(9);
    v["steps"][2]["from"] = json!(2);
    refused(&v, &["step 3 (await).from", "step 2 is not a background call"]);
}

#[test]
fn a_script_may_bring_its_own_world_and_a_broken_one_is_refused() {
    // Scenario 1 with the demo world written inline passes as it does with "demo".
    let mut v = builtin_json(1);
    v["world"] = serde_json::from_str(toolgate::engine::world::DEMO_WORLD).unwrap();
    let r = ScenarioRun::run(&parse(&v).unwrap(), opts(child())).unwrap();
    assert!(r.passed, "{}", report::render(&r));
    // A world in which ord_1001 belongs to someone else: the refund is NOT_FOUND.
    v["world"]["orders"][0]["owner"] = json!("agent_ben");
    let r = ScenarioRun::run(&parse(&v).unwrap(), opts(child())).unwrap();
    assert_eq!(r.steps[0].code, Some(toolgate::engine::envelope::Code::NotFound));
    assert!(!r.passed);
    v["world"]["orders"][0]["owner"] = json!("nobody");
    refused(&v, &["copy.json: world", "field `owner`: must name a subject of the order's tenant"]);
    v["world"] = json!(42);
    refused(&v, &["copy.json: world", "\"demo\" or a world object"]);
}

#[test]
fn duplicate_keys_are_refused_even_where_serde_would_keep_the_last() {
    let text = builtin_json(1).to_string().replacen(
        "\"key\":\"refund-s1-0001\"",
        "\"key\":\"a-key-0001\",\"key\":\"refund-s1-0001\"",
        1,
    );
    let err = script::parse("copy.json", text.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("copy.json: file: duplicate object key \"key\""), "{err}");
    let dup_code = builtin_json(1).to_string().replacen("\"code\":null", "\"code\":null,\"code\":\"NOT_FOUND\"", 1);
    let err = script::parse("copy.json", dup_code.as_bytes()).unwrap_err().to_string();
    assert!(err.contains("duplicate object key \"code\""), "{err}");
}

#[test]
fn the_files_in_assets_are_exactly_the_builtin_ones() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/scenarios");
    let mut on_disk: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read_to_string(&p).unwrap()))
        .collect();
    on_disk.sort();
    let embedded: Vec<(String, String)> =
        scenarios::BUILTIN.iter().map(|(n, t)| ((*n).to_string(), (*t).to_string())).collect();
    assert_eq!(on_disk, embedded);
    // A file loaded from disk is the same script.
    let from_disk = scenarios::load_file(&dir.join(&builtin(7).file)).unwrap();
    assert_eq!(from_disk.steps.len(), builtin(7).steps.len());
}

#[test]
fn keep_db_leaves_a_database_the_cli_can_open() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("kept.db");
    let r = ScenarioRun::run(&builtin(1), RunOptions { crash_mode: child(), keep_db: Some(db.clone()), http: None })
        .unwrap();
    assert!(r.passed);
    assert_eq!(r.kept_db.as_deref(), Some(db.as_path()));
    let out = toolgate().args(["counts", "--json", "--db"]).arg(&db).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let counts: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(counts["downstream_effects"], 1);
    assert_eq!(counts["side_effect_duplicates"], 0);
    // An existing path is never overwritten.
    let again = ScenarioRun::new(&builtin(1), RunOptions { crash_mode: child(), keep_db: Some(db), http: None });
    assert!(matches!(again, Err(ScenarioError::Db(_))));
}

#[test]
fn cli_runs_all_scenarios() {
    // How long it takes is a benchmark's question, not a test's (shared machines are noisy).
    let out = toolgate().args(["scenario", "run", "all"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let n = scenarios::BUILTIN.len();
    assert_eq!(stdout.lines().last(), Some(format!("{n} passed, 0 failed").as_str()), "{stdout}");
    assert!(stdout.contains("real crash: child process"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
}

#[test]
fn cli_lists_runs_one_and_reports_json() {
    let out = toolgate().args(["scenario", "list", "--json"]).output().unwrap();
    assert!(out.status.success());
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["scenarios"].as_array().unwrap().len(), scenarios::BUILTIN.len());
    assert_eq!(list["scenarios"][3]["slug"], "crash_after_commit");
    let text = toolgate().args(["scenario", "list"]).output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("approval_expired"));

    let out = toolgate().args(["scenario", "run", "6", "--json"]).output().unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((doc["passed"].as_u64(), doc["failed"].as_u64()), (Some(1), Some(0)));
    let steps = doc["scenarios"][0]["steps"].as_array().unwrap();
    assert_eq!(steps[2]["code"], "POLICY_DENIED");
    assert_eq!(steps[2]["transition"], json!({"from": "succeeded", "to": "succeeded"}));
    assert_eq!(steps[2]["passed"], true);
}

#[test]
fn cli_exits_1_on_a_failing_script_and_2_on_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let mut v = builtin_json(2);
    v["steps"][1]["expect"]["effects"] = json!(2);
    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, v.to_string()).unwrap();
    let out = toolgate().args(["scenario", "run", "--file"]).arg(&wrong).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("✗ effects: expected 2, got 1"), "{stdout}");
    assert_eq!(stdout.lines().last(), Some("0 passed, 1 failed"));

    let mut v = builtin_json(2);
    v["steps"][1]["expect"]["code"] = json!("NOPE");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, v.to_string()).unwrap();
    let out = toolgate().args(["scenario", "run", "--file"]).arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error[SCENARIO_INVALID]: bad.json: step 2 (dispatch).expect.code"), "{stderr}");
    assert!(!stderr.contains(dir.path().to_str().unwrap()), "no local path: {stderr}");

    let out = toolgate().args(["scenario", "run", "99"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[NO_SUCH_SCENARIO]"));
}

crate::on_both_backends!(every_scenario_passes_with_a_real_crash_and_leaves_a_ledger_that_audits_clean);
