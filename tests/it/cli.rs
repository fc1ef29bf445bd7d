//! The CLI contract: JSON envelopes, exit codes 0 / 1 / 2, stable error codes, no
//! backtraces, no local paths.

use std::path::Path;

use assert_cmd::Command;
use serde_json::Value;

const NOW: &str = "2026-01-01T00:00:00Z";
const ARGS: &str = r#"{"order_ref":"ord_1001","amount_minor":1000,"currency":"EUR","reason":"damaged"}"#;

fn tg() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_toolgate"));
    c.env_remove("RUST_BACKTRACE");
    c
}

fn init(dir: &Path) -> std::path::PathBuf {
    let db = dir.join("cli.db");
    tg().args(["init", "--db"]).arg(&db).assert().success();
    db
}

fn dispatch(db: &Path, key: &str, args: &str, extra: &[&str]) -> (i32, Value) {
    let out = tg()
        .args(["dispatch", "--db"])
        .arg(db)
        .args([
            "--now",
            NOW,
            "--tenant",
            "acme",
            "--subject",
            "agent_ana",
            "--tool",
            "create_refund",
            "--key",
            key,
            "--args",
            args,
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    (out.status.code().unwrap(), v)
}

#[test]
fn dispatch_prints_the_envelope_and_exit_codes_follow_the_result() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let (rc, v) = dispatch(&db, "cli-key-0001", ARGS, &[]);
    assert_eq!(rc, 0);
    assert_eq!(v["model_result"]["status"], "succeeded");
    assert_eq!(v["model_result"]["execution"]["delivery"], "fresh");
    assert_eq!(v["protected_audit"]["binding"]["request_sha256"].as_str().unwrap().len(), 64);
    let (rc, v) = dispatch(&db, "cli-key-0001", ARGS, &[]);
    assert_eq!((rc, v["model_result"]["execution"]["delivery"].as_str()), (0, Some("local_replay")));
    let (rc, v) = dispatch(&db, "cli-key-0001", &ARGS.replace("1000", "1500"), &[]);
    assert_eq!((rc, v["model_result"]["error"]["code"].as_str()), (1, Some("IDEMPOTENCY_CONFLICT")));
    assert_eq!(v["model_result"]["error"]["retryable"], false);
    let (rc, v) = dispatch(&db, "cli-key-0002", ARGS, &["--fault", "timeout_after_commit"]);
    assert_eq!((rc, v["model_result"]["status"].as_str()), (1, Some("unknown")));

    // Explicit query reconciles.
    let out = tg()
        .args(["query", "--db"])
        .arg(&db)
        .args(["--tenant", "acme", "--subject", "agent_ana", "--status-ref"])
        .arg(v["protected_audit"]["downstream"]["status_ref"].as_str().unwrap())
        .arg("--expect-sha256")
        .arg(v["protected_audit"]["binding"]["request_sha256"].as_str().unwrap())
        .arg("--json")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let q: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(q["model_result"]["execution"]["delivery"], "receipt_reconciled");

    let out = tg().args(["counts", "--json", "--db"]).arg(&db).output().unwrap();
    let c: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(c["downstream_effects"], 2);
    assert_eq!(c["side_effect_duplicates"], 0);
    assert_eq!(c["operations"]["succeeded"], 2);

    let op = v["protected_audit"]["operation_id"].as_str().unwrap();
    let out = tg().args(["ops", "show", op, "--json", "--db"]).arg(&db).output().unwrap();
    let d: Value = serde_json::from_slice(&out.stdout).unwrap();
    let steps: Vec<&str> = d["trace"].as_array().unwrap().iter().map(|t| t["step"].as_str().unwrap()).collect();
    assert_eq!(steps, ["accepted", "claimed", "sent", "downstream_reply", "query"]);
    assert!(d["operation"].get("idem_key").is_none(), "the raw key is never printed");
    tg().args(["audit", "--db"]).arg(&db).assert().code(0).stdout("audit: no findings\n");
}

#[test]
fn environment_errors_exit_2_with_a_code_and_no_path_or_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let secret_dir = dir.path().to_str().unwrap().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["counts".into(), "--db".into(), file.join("x.db").display().to_string()], "DB_NOT_FOUND"),
        (vec!["init".into(), "--db".into(), file.join("x.db").display().to_string()], "DB_OPEN_FAILED"),
        (vec!["counts".into(), "--db".into(), file.display().to_string()], "DB_NOT_TOOLGATE"),
        (vec!["counts".into()], "DB_REQUIRED"),
        (vec!["counts".into(), "--db".into(), "x".into(), "--now".into(), "yesterday".into()], "BAD_TIME"),
    ];
    for (args, code) in cases {
        let out = tg().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with(&format!("error[{code}]: ")), "{args:?}: {err}");
        assert!(!err.contains(&secret_dir), "{args:?} leaks a path: {err}");
        assert!(!err.contains("panicked") && !err.contains("backtrace"), "{args:?}: {err}");
    }
    // JSON mode reports the same code as a document.
    let out = tg().args(["counts", "--json", "--db"]).arg(file.join("y.db")).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "DB_NOT_FOUND");
}

#[test]
fn a_newer_schema_is_refused_by_the_cli_without_change() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    rusqlite::Connection::open(&db).unwrap().execute_batch("PRAGMA user_version = 42").unwrap();
    let before = std::fs::read(&db).unwrap();
    let out = tg().args(["counts", "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error[DB_SCHEMA_TOO_NEW]"));
    assert_eq!(std::fs::read(&db).unwrap(), before);
}

#[cfg(unix)]
#[test]
fn invalid_utf8_arguments_are_invalid_arguments() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let out = tg()
        .args(["dispatch", "--db"])
        .arg(&db)
        .args([
            "--tenant",
            "acme",
            "--subject",
            "agent_ana",
            "--tool",
            "create_refund",
            "--key",
            "cli-key-0003",
            "--json",
            "--args",
        ])
        .arg(std::ffi::OsStr::from_bytes(b"{\"order_ref\":\"\xff\"}"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model_result"]["error"]["code"], "INVALID_ARGUMENTS");
}

#[test]
fn a_hostile_world_file_is_refused_and_no_database_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let world = dir.path().join("world.json");
    std::fs::write(&world, r#"{"tenants":[],"tenants":[],"subjects":[],"grants":[],"orders":[]}"#).unwrap();
    let db = dir.path().join("w.db");
    let out = tg().args(["init", "--db"]).arg(&db).arg("--world").arg(&world).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error[WORLD_INVALID]"));
    assert!(!db.exists());
    std::fs::write(&world, r#"{"tenants":[{"id":"t","approvers":[],"approval_threshold_minor":1,"extra":1}],"subjects":[],"grants":[],"orders":[]}"#).unwrap();
    let out = tg().args(["init", "--db"]).arg(&db).arg("--world").arg(&world).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field"));
}

/// Issue 32 §3: a world that cannot work with the catalog loaded silently
/// (a grant of a tool the catalog lacks; an order the catalog's order_ref
/// schema never accepts). Refused, naming the record; no ledger is left.
#[test]
fn a_world_that_does_not_fit_the_catalog_is_refused_naming_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let world = dir.path().join("world.json");
    let db = dir.path().join("w.db");
    let base = r#"{"tenants":[{"id":"acme","approvers":["alice"],"approval_threshold_minor":100}],
        "subjects":[{"id":"agent_ana","tenant":"acme"}],"#;
    for (rest, says) in [
        (
            r#""grants":[{"tenant":"acme","subject":"agent_ana","tool":"create_refnud"}],"orders":[]}"#,
            "grants[0]: tool \"create_refnud\" is not in the catalog",
        ),
        (
            r#""grants":[{"tenant":"acme","subject":"agent_ana","tool":"create_refund"}],
               "orders":[{"order_ref":"ORDER-1001","tenant":"acme","owner":"agent_ana","currency":"EUR","captured_minor":100,"refunded_minor":0,"status":"paid"}]}"#,
            "orders[0]: order_ref \"ORDER-1001\" never fits",
        ),
    ] {
        std::fs::write(&world, format!("{base}{rest}")).unwrap();
        let out = tg().args(["init", "--db"]).arg(&db).arg("--world").arg(&world).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.starts_with("error[WORLD_INVALID]") && err.contains(says), "{err}");
        assert!(!db.exists(), "nothing is left behind: {err}");
    }
}

#[test]
fn approvals_grant_revoke_and_read_only() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let big = r#"{"order_ref":"ord_1002","amount_minor":60000,"currency":"EUR","reason":"damaged"}"#;
    let (rc, v) = dispatch(&db, "cli-key-0004", big, &[]);
    assert_eq!((rc, v["model_result"]["error"]["code"].as_str()), (1, Some("APPROVAL_REQUIRED")));
    let id = v["protected_audit"]["approval_id"].as_str().unwrap().to_string();
    let out = tg().args(["approvals", "--json", "--now", NOW, "--db"]).arg(&db).output().unwrap();
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["pending"][0]["approval_id"], id.as_str());
    assert_eq!(p["pending"][0]["expires_in_ms"], 900_000);
    // Read-only refuses state changes.
    let out = tg().args(["--read-only", "approve", &id, "--approver", "bob", "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).starts_with("error[READ_ONLY]"));
    let out =
        tg().args(["approve", &id, "--approver", "bob", "--json", "--now", NOW, "--db"]).arg(&db).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    tg().args(["revoke", "--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--db"])
        .arg(&db)
        .assert()
        .success();
    let (rc, v) = dispatch(&db, "cli-key-0004", big, &[]);
    assert_eq!((rc, v["model_result"]["error"]["code"].as_str()), (1, Some("POLICY_DENIED")));
    assert!(v["model_result"]["data"].is_null());
}

fn query(db: &Path, env: &Value, call: &[&str]) -> Value {
    let out = tg()
        .args(["query", "--db"])
        .arg(db)
        .args(["--now", NOW, "--tenant", "acme", "--subject", "agent_ana", "--json"])
        .args(["--status-ref", env["protected_audit"]["downstream"]["status_ref"].as_str().unwrap()])
        .args(["--expect-sha256", env["protected_audit"]["binding"]["request_sha256"].as_str().unwrap()])
        .args(call)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

#[test]
fn query_names_its_call_identity_like_dispatch() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let ident =
        ["--provider", "openai", "--api-family", "responses", "--response-id", "resp_9", "--adapter-revision", "1"];
    let mut d = ident.to_vec();
    d.extend(["--call-id", "call_dispatch_9", "--fault", "timeout_after_commit"]);
    let (_, env) = dispatch(&db, "cli-query-ident-1", ARGS, &d);
    assert_eq!(env["model_result"]["status"], "unknown");
    // The dispatch's own identity cannot be used to query (another purpose).
    let mut q = ident.to_vec();
    q.extend(["--call-id", "call_dispatch_9"]);
    assert_eq!(query(&db, &env, &q)["model_result"]["error"]["code"], "CALL_ID_CONFLICT");
    // A query identity of its own, retried under the same identity: answered both times.
    let mut q = ident.to_vec();
    q.extend(["--call-id", "call_query_9"]);
    assert_eq!(query(&db, &env, &q)["model_result"]["execution"]["delivery"], "receipt_reconciled");
    assert_eq!(query(&db, &env, &q)["model_result"]["status"], "succeeded");
}

/// `--project` (docs/design.md §17) prints only the model result as a provider's tool
/// result for `--call-id`, keeps the exit codes, and an unknown name is exit 2
/// before anything is dispatched.
#[test]
fn project_prints_a_provider_tool_result_and_an_unknown_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let (rc, v) = dispatch(&db, "cli-proj-0001", ARGS, &["--project", "openai-chat", "--call-id", "call_c1"]);
    assert_eq!(rc, 0, "{v:#}");
    assert_eq!((v["role"].as_str(), v["tool_call_id"].as_str()), (Some("tool"), Some("call_c1")));
    let content: Value = serde_json::from_str(v["content"].as_str().unwrap()).unwrap();
    assert_eq!((content["status"].as_str(), content.get("protected_audit")), (Some("succeeded"), None));

    let conflict = ARGS.replace("1000", "1500");
    let (rc, v) = dispatch(&db, "cli-proj-0001", &conflict, &["--project", "anthropic", "--call-id", "toolu_1"]);
    assert_eq!((rc, v["is_error"].as_bool(), v["tool_use_id"].as_str()), (1, Some(true), Some("toolu_1")));
    assert!(v["content"][0]["text"].as_str().unwrap().contains("IDEMPOTENCY_CONFLICT"));

    // An unknown outcome, then its status query, projected for Gemini and OpenAI Responses.
    let (_, env) = dispatch(
        &db,
        "cli-proj-lost",
        ARGS.replace("ord_1001", "ord_1004").as_str(),
        &["--fault", "timeout_after_commit"],
    );
    let (rc, v) =
        dispatch(&db, "cli-proj-lost", ARGS.replace("ord_1001", "ord_1004").as_str(), &["--project", "gemini"]);
    assert_eq!((rc, v["functionResponse"]["name"].as_str()), (1, Some("create_refund")));
    assert_eq!(v["functionResponse"]["response"]["error"]["code"], "OUTCOME_UNKNOWN");
    assert!(!v.to_string().contains(env["protected_audit"]["downstream"]["status_ref"].as_str().unwrap()));
    let q = query(&db, &env, &["--project", "openai-responses", "--call-id", "call_q1"]);
    assert_eq!((q["type"].as_str(), q["call_id"].as_str()), (Some("function_call_output"), Some("call_q1")));
    assert!(q["output"].as_str().unwrap().contains("receipt_reconciled"), "{q:#}");

    // An unknown name: exit 2 with the stable code, and the key was never used.
    let (rc, v) = dispatch(&db, "cli-proj-0002", ARGS, &["--project", "openai"]);
    assert_eq!((rc, v["error"]["code"].as_str()), (2, Some("UNKNOWN_PROJECTION")));
    let (rc, v) = dispatch(&db, "cli-proj-0002", &conflict, &[]);
    assert_eq!((rc, v["model_result"]["execution"]["delivery"].as_str()), (0, Some("fresh")));
}

#[test]
fn every_read_command_stops_quietly_when_the_reader_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    std::fs::write(&db, toolgate::demo::DEMO_DB).unwrap();
    let op: String =
        crate::support::raw(&db).query_row("SELECT id FROM operations ORDER BY id LIMIT 1", [], |r| r.get(0)).unwrap();
    let commands: Vec<Vec<&str>> = vec![
        vec!["ops", "list"],
        vec!["ops", "list", "--json"],
        vec!["ops", "show", &op],
        vec!["counts"],
        vec!["audit"],
        vec!["audit", "--log"],
        vec!["orders"],
        vec!["approvals"],
        vec!["metrics"],
        vec!["trace"],
        vec!["scenario", "list"],
    ];
    for cmd in commands {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_toolgate"))
            .args(&cmd)
            .arg("--db")
            .arg(&db)
            .env_remove("RUST_BACKTRACE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The reader goes away before the first line is written.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(matches!(out.status.code(), Some(0 | 141)), "{cmd:?}: {:?} {stderr}", out.status);
        assert!(stderr.is_empty(), "{cmd:?} printed: {stderr}");
    }
}

#[test]
fn an_oversized_args_file_is_read_only_up_to_the_limit_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let db = init(dir.path());
    let big = dir.path().join("big.json");
    // 10 MB: the CLI stops reading one byte past the 64 KiB limit.
    std::fs::write(&big, vec![b' '; 10 * 1024 * 1024]).unwrap();
    let out = tg()
        .args(["dispatch", "--db"])
        .arg(&db)
        .args(["--tenant", "acme", "--subject", "agent_ana", "--tool", "create_refund", "--key", "cli-big-args-1"])
        .arg("--args-file")
        .arg(&big)
        .arg("--json")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["model_result"]["error"]["code"], "INVALID_ARGUMENTS");
    let text = v.to_string();
    assert!(text.contains("over the 64 KiB limit"), "{text}");
    assert!(!text.contains("8388608") && !text.contains("10485760"), "{text}");
}

/// `toolgate --db DB ARGS` → (exit code, JSON on stdout or Null, stderr).
fn run_json(db: &Path, args: &[&str]) -> (i32, Value, String) {
    let out = tg().arg("--db").arg(db).args(args).output().unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap(), v, String::from_utf8_lossy(&out.stderr).into_owned())
}

fn ids_of(v: &Value, list: &str) -> Vec<String> {
    v[list].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap().to_string()).collect()
}

fn bulk_selection_from_the_cli_dry_run_and_one_audit_entry_each(backend: crate::support::Backend) {
    let dir = tempfile::tempdir().unwrap();
    let pg = (backend == crate::support::Backend::Postgres).then(|| crate::support::PgDb::new().unwrap());
    let now = chrono::Utc::now().timestamp_millis();
    let db = match &pg {
        None => toolgate::demo::working_copy(dir.path(), now).unwrap(),
        Some(p) => toolgate::demo::working_copy_at(Path::new(&p.url), now).unwrap(),
    };
    let log_len = |db: &Path| run_json(db, &["audit", "--log", "--json"]).1["log"].as_array().unwrap().len();
    let before = log_len(&db);
    // --dry-run lists what would be touched, changes nothing, needs no operator.
    let (rc, v, _) = run_json(&db, &["query", "--all", "--state", "outcome_unknown", "--dry-run", "--json"]);
    assert_eq!((rc, v["dry_run"].as_bool(), v["selected"].as_i64()), (0, Some(true), Some(4)), "{v}");
    assert!(v["would_touch"].as_array().unwrap().iter().all(|r| r["state"] == "unknown"));
    let (_, v, _) = run_json(
        &db,
        &[
            "query",
            "--all",
            "--state",
            "outcome_unknown",
            "--tenant",
            "acme",
            "--tool",
            "create_refund",
            "--dry-run",
            "--json",
        ],
    );
    assert_eq!(v["selected"], 2, "{v}");
    assert!(v["would_touch"].as_array().unwrap().iter().all(|r| r["tenant"] == "acme" && r["tool"] == "create_refund"));
    let (_, v, _) = run_json(&db, &["query", "--all", "--older-than", "1d", "--dry-run", "--json"]);
    assert_eq!(v["selected"], 0, "nothing has been unknown for a day: {v}");
    let (_, v, _) = run_json(&db, &["query", "--all", "--dry-run", "--json"]);
    assert_eq!(v["selected"], 5, "default: unknown and needs_review: {v}");
    assert_eq!(log_len(&db), before, "a dry run writes nothing");
    // Usage errors exit 2 with a stable code.
    for (args, code) in [
        (&["query", "--all", "--state", "stuck"][..], "BAD_SELECTION"),
        (&["query", "--all", "--older-than", "5x"][..], "BAD_SELECTION"),
        (&["query", "--all"][..], "OPERATOR_REQUIRED"),
        (&["approve", "--all", "--approver", "alice", "--state", "unknown", "--dry-run"][..], "BAD_SELECTION"),
        (&["--operator", "ops1", "resolve", "--all", "--as", "succeeded", "--note", "n"][..], "EVIDENCE_PER_OPERATION"),
        (&["--read-only", "--operator", "ops1", "query", "--all"][..], "READ_ONLY"),
        // Simulated agents would write the ledger named by --db.
        (&["--read-only", "demo", "--agents", "2"][..], "READ_ONLY"),
        // Switching a defense off writes; showing the lab (below) reads.
        (&["--read-only", "lab", "--off"][..], "READ_ONLY"),
    ] {
        let (rc, _, err) = run_json(&db, args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(err.contains(&format!("error[{code}]")), "{args:?}: {err}");
    }
    let (rc, _, err) = run_json(&db, &["--read-only", "lab", "--json"]);
    assert_eq!(rc, 0, "the lab's state is read under --read-only: {err}");
    assert_eq!(log_len(&db), before, "refusals and reads under --read-only write nothing");
    let (rc, _, err) = run_json(&db, &["query", "--all", "--status-ref", "x"]);
    assert_eq!(rc, 2, "--all and one operation's status_ref do not mix: {err}");
    // The run: one engine call and one audit entry each, by the operator.
    let (rc, v, err) = run_json(&db, &["--operator", "ops1", "query", "--all", "--state", "outcome_unknown", "--json"]);
    assert_eq!(rc, i32::from(v["all_done"] != true), "exit 1 when any is refused or still unknown: {v} {err}");
    let queried = ids_of(&v, "results");
    assert_eq!(queried.len(), 4);
    assert!(v["summary"].as_str().unwrap().chars().next().unwrap().is_ascii_digit(), "{v}");
    let (_, log, _) = run_json(&db, &["audit", "--log", "--json"]);
    let log = log["log"].as_array().unwrap().clone();
    assert_eq!(log.len(), before + 4);
    for id in &queried {
        let n = log
            .iter()
            .filter(|r| r["actor"] == "ops1" && r["action"] == "query" && r["operation_id"] == id.as_str())
            .count();
        assert_eq!(n, 1, "{id}");
    }
    // Resolve what is still unknown or needs review, as compensated, with one shared note.
    let (_, left, _) = run_json(
        &db,
        &["resolve", "--all", "--as", "compensated", "--note", "refunded by hand", "--dry-run", "--json"],
    );
    let left = ids_of(&left, "would_touch");
    let (rc, v, err) = run_json(
        &db,
        &["--operator", "ops1", "resolve", "--all", "--as", "compensated", "--note", "refunded by hand", "--json"],
    );
    assert_eq!((rc, v["selected"].as_u64()), (0, Some(left.len() as u64)), "{v} {err}");
    assert!(v["results"].as_array().unwrap().iter().all(|r| r["outcome"] == "resolved"), "{v}");
    let (_, v, _) = run_json(&db, &["query", "--all", "--dry-run", "--json"]);
    assert_eq!(v["selected"], 0, "the queue is empty");
}

crate::on_both_backends!(bulk_selection_from_the_cli_dry_run_and_one_audit_entry_each);

/// A file that is not a ledger is never made one by a command that did not
/// ask to create one: an empty file (a mistyped --db) or another program's
/// SQLite database. Refused DB_NOT_TOOLGATE, the file unchanged.
#[test]
fn a_write_command_never_turns_a_file_that_is_no_ledger_into_one() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty.db");
    std::fs::write(&empty, b"").unwrap();
    let foreign = dir.path().join("foreign.db");
    {
        let c = rusqlite::Connection::open(&foreign).unwrap();
        c.execute_batch(
            "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT); INSERT INTO notes (body) VALUES ('mine');",
        )
        .unwrap();
    }
    let before = std::fs::read(&foreign).unwrap();
    for db in [&empty, &foreign] {
        for args in [
            &["reap", "--json"][..],
            &["work", "--json"],
            &["grant", "--tenant", "acme", "--subject", "agent_ana", "--tool", "get_order"],
        ] {
            let out = tg().args(args).arg("--db").arg(db).env("TOOLGATE_LOG", "off").output().unwrap();
            let err = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert_eq!(out.status.code(), Some(2), "{args:?} on {}: {err}", db.display());
            assert!(err.contains("DB_NOT_TOOLGATE"), "{args:?}: {err}");
        }
    }
    assert_eq!(std::fs::metadata(&empty).unwrap().len(), 0);
    assert_eq!(std::fs::read(&foreign).unwrap(), before, "another program's database is untouched");
}

/// Issue 33 Medium 10 / issue 32 §3: two catalogs with the same revisions and
/// different policies on one ledger (one `approval: always`) let one replica
/// run what the other held for approval; an edit without a revision bump was
/// accepted silently. The ledger records what each (tool, revisions) means.
#[test]
fn a_catalog_that_changes_a_tool_under_the_same_revisions_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("l.db");
    tg().args(["init", "--db"]).arg(&db).assert().success();
    let cat = dir.path().join("cat");
    std::fs::create_dir(&cat).unwrap();
    for f in ["get_order.json", "notify_customer.json"] {
        std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog").join(f), cat.join(f)).unwrap();
    }
    let mut refund: Value = serde_json::from_str(include_str!("../../assets/catalog/create_refund.json")).unwrap();
    refund["approval"]["policy"] = "always".into();
    std::fs::write(cat.join("create_refund.json"), refund.to_string()).unwrap();
    let reap =
        |catalog: &Path| tg().args(["reap", "--json", "--catalog"]).arg(catalog).arg("--db").arg(&db).output().unwrap();
    let out = reap(&cat);
    let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "{all}");
    assert!(all.contains("CATALOG_REVISION_REUSED") && all.contains("create_refund"), "{all}");
    // A description or a retry setting is not a change of meaning; a bump is the way to change one.
    refund["revisions"]["effect"] = 2.into();
    std::fs::write(cat.join("create_refund.json"), refund.to_string()).unwrap();
    let out = reap(&cat);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let mut described = refund.clone();
    described["description"] = "Refund part of an order (reworded).".into();
    described["retry"]["max_attempts"] = 3.into();
    std::fs::write(cat.join("create_refund.json"), described.to_string()).unwrap();
    assert_eq!(reap(&cat).status.code(), Some(0));
}

/// A tmpfs mounted read-only (needs the privilege to mount, as CI's root
/// has); unmounted on drop.
struct ReadOnlyMount(tempfile::TempDir);

impl ReadOnlyMount {
    /// Mounts a tmpfs, puts `files` in it, remounts it read-only; `None`
    /// (with a message) where this machine may not mount.
    fn with(files: &[(&str, &Path)]) -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("*** read-only filesystem test SKIPPED: cannot mount a tmpfs here (needs root) ***");
            return None;
        }
        let m = Self(dir);
        for (name, from) in files {
            std::fs::copy(from, m.0.path().join(name)).unwrap();
        }
        let ro = std::process::Command::new("mount").args(["-o", "remount,ro"]).arg(m.0.path()).status().unwrap();
        assert!(ro.success());
        Some(m)
    }
}

impl Drop for ReadOnlyMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

/// Issue 33 (Low): on a read-only filesystem reads failed (`DB_ERROR`
/// "unable to open database file": WAL's shared memory cannot be made there)
/// and writes said `DB_OPEN_FAILED`. Reads work; writes say `DB_READ_ONLY`.
#[test]
fn on_a_read_only_filesystem_reads_work_and_writes_say_read_only() {
    let demo = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.db");
    let Some(m) = ReadOnlyMount::with(&[("ledger.db", &demo)]) else { return };
    let db = m.0.path().join("ledger.db");
    for read in [&["ops", "list", "--json"][..], &["counts", "--json"], &["audit", "--json"], &["approvals", "--json"]]
    {
        let out = tg().arg("--db").arg(&db).args(read).output().unwrap();
        assert!(
            out.status.success(),
            "{read:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let _: Value = serde_json::from_slice(&out.stdout).unwrap();
    }
    let (code, v) = dispatch(&db, "ro-fs-0001", ARGS, &[]);
    assert_eq!((code, v["error"]["code"].as_str()), (2, Some("DB_READ_ONLY")), "{v}");
    let out = tg().arg("--db").arg(&db).args(["reap", "--json"]).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["code"], "DB_READ_ONLY", "{v}");
}

/// `ops list` is a table: the state column is padded like the others (the
/// states' Display ignored the width, so every column after it shifted).
#[test]
fn ops_list_text_columns_line_up() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.db"), &db).unwrap();
    let out = tg().arg("--db").arg(&db).args(["ops", "list"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    let at = header.find("version").unwrap();
    let rows: Vec<&str> = lines.filter(|l| l.starts_with("op_")).collect();
    assert!(rows.len() > 3, "{text}");
    for row in rows {
        assert!(row[..at].ends_with(' ') && !row[at..].starts_with(' '), "misaligned: {row:?} under {header:?}");
    }
}
/// `dispatch` as `subject` of `tenant` on any backend (`--db` a path or URL).
fn dispatch_as(db: &Path, tenant: &str, subject: &str, tool: &str, key: &str, args: &str) -> (i32, Value) {
    let out = tg()
        .args(["dispatch", "--db"])
        .arg(db)
        .args(["--now", NOW, "--tenant", tenant, "--subject", subject, "--tool", tool, "--key", key])
        .args(["--args", args, "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    (out.status.code().unwrap(), v)
}

fn tenants_and_subjects_are_added_and_disabled_after_init_each_in_the_operator_log(backend: crate::support::Backend) {
    let fx = crate::support::Fixture::on(backend);
    let db = fx.path();
    let admin = |args: &[&str]| {
        let mut all = vec!["--operator", "olga", "--now", NOW];
        all.extend_from_slice(args);
        run_json(db, &all)
    };
    let log = || run_json(db, &["audit", "--log", "--json"]).1["log"].as_array().unwrap().clone();
    let code_of = |v: &Value| v["model_result"]["error"]["code"].as_str().map(str::to_string);
    let before = log().len();

    // Added after init: a tenant with an approver, a subject, a grant; it calls.
    let (rc, v, err) = admin(&["tenant", "add", "initech", "--approver", "peter", "--json"]);
    assert_eq!((rc, v["changed"].as_bool()), (0, Some(true)), "{err}");
    let (rc, _, err) = admin(&["subject", "add", "--tenant", "initech", "agent_ivy", "--json"]);
    assert_eq!(rc, 0, "{err}");
    let (rc, v) = dispatch_as(db, "initech", "agent_ivy", "get_order", "cli-key-1001", r#"{"order_ref":"ord_1001"}"#);
    assert_eq!((rc, code_of(&v).as_deref()), (1, Some("POLICY_DENIED")), "no grant yet: {v}");
    let (rc, _, err) = admin(&["grant", "--tenant", "initech", "--subject", "agent_ivy", "--tool", "get_order"]);
    assert_eq!(rc, 0, "{err}");
    let (_, v) = dispatch_as(db, "initech", "agent_ivy", "get_order", "cli-key-1002", r#"{"order_ref":"ord_1001"}"#);
    assert_eq!(code_of(&v).as_deref(), Some("NOT_FOUND"), "granted, and acme's order is not initech's: {v}");

    // Refused, changing nothing: a second tenant of the same id, a subject id
    // taken in another tenant, an unknown tenant, an id outside the rule.
    let refusals: [(&[&str], &str); 5] = [
        (&["tenant", "add", "initech"], "TENANT_EXISTS"),
        (&["subject", "add", "--tenant", "initech", "agent_ana"], "SUBJECT_EXISTS"),
        (&["subject", "add", "--tenant", "nobody", "agent_new"], "UNKNOWN_TENANT"),
        (&["subject", "add", "--tenant", "initech", "agent ivy"], "WORLD_INVALID"),
        (&["subject", "disable", "--tenant", "globex", "agent_ana"], "UNKNOWN_SUBJECT"),
    ];
    for (args, code) in refusals {
        let (rc, _, err) = admin(args);
        assert_eq!(rc, 2, "{args:?}: {err}");
        assert!(err.starts_with(&format!("error[{code}]")), "{args:?}: {err}");
    }
    assert_eq!(log().len(), before + 2, "two additions logged, no refusal");

    // A disabled subject is refused, whatever its grants, and no effect is made;
    // enabled again, it has its grants back.
    let (rc, v, err) = admin(&["subject", "disable", "--tenant", "acme", "agent_ana", "--json"]);
    assert_eq!((rc, v["changed"].as_bool()), (0, Some(true)), "{err}");
    let (_, v, _) = admin(&["subject", "disable", "--tenant", "acme", "agent_ana", "--json"]);
    assert_eq!(v["changed"].as_bool(), Some(false), "already disabled: no change, no log entry");
    let mut e = fx.engine();
    let effects = crate::support::effects(&mut e);
    let (rc, v) = dispatch_as(db, "acme", "agent_ana", "create_refund", "cli-key-1003", ARGS);
    assert_eq!((rc, code_of(&v).as_deref()), (1, Some("SUBJECT_DISABLED")), "{v}");
    assert_eq!(v["model_result"]["error"]["category"], "permission");
    assert_eq!(crate::support::effects(&mut e), effects, "nothing was sent");
    let tools = vec!["get_order".to_string(), "create_refund".to_string()];
    assert!(e.granted_tools("acme", "agent_ana", &tools).unwrap().is_empty(), "MCP lists no tool for it");
    assert_eq!(e.granted_tools("acme", "agent_ben", &tools).unwrap().len(), 2, "another subject is not touched");
    let (rc, _, _) = admin(&["subject", "enable", "--tenant", "acme", "agent_ana"]);
    assert_eq!(rc, 0);
    let (rc, v) = dispatch_as(db, "acme", "agent_ana", "create_refund", "cli-key-1003", ARGS);
    assert_eq!((rc, v["model_result"]["status"].as_str()), (0, Some("succeeded")), "{v}");

    // A disabled tenant: each of its subjects is refused; enabled, they call again.
    let (rc, _, _) = admin(&["tenant", "disable", "acme"]);
    assert_eq!(rc, 0);
    let (_, v) = dispatch_as(db, "acme", "agent_ben", "get_order", "cli-key-1004", r#"{"order_ref":"ord_2001"}"#);
    assert_eq!(code_of(&v).as_deref(), Some("SUBJECT_DISABLED"), "{v}");
    let (_, v) = dispatch_as(db, "globex", "agent_gus", "get_order", "cli-key-1005", r#"{"order_ref":"ord_3001"}"#);
    assert_eq!(v["model_result"]["status"], "succeeded", "another tenant is not touched: {v}");
    let (rc, _, _) = admin(&["tenant", "enable", "acme"]);
    assert_eq!(rc, 0);
    let (_, v) = dispatch_as(db, "acme", "agent_ben", "get_order", "cli-key-1006", r#"{"order_ref":"ord_2001"}"#);
    assert_eq!(v["model_result"]["status"], "succeeded", "{v}");

    // The operator log: each change once, by the operator, and its chain holds.
    let entries = log();
    let mine: Vec<(String, String)> = entries
        .iter()
        .filter(|r| r["actor"] == "olga")
        .map(|r| (r["action"].as_str().unwrap().to_string(), r["result"].as_str().unwrap().to_string()))
        .collect();
    let want = ["tenant_add", "subject_add", "subject_disable", "subject_enable", "tenant_disable", "tenant_enable"];
    let mut got: Vec<&str> = mine.iter().map(|(a, _)| a.as_str()).collect();
    got.sort_unstable();
    let mut want_sorted = want.to_vec();
    want_sorted.sort_unstable();
    assert_eq!(got, want_sorted, "{entries:?}");
    assert!(mine.iter().all(|(_, r)| r == "applied"));
    let (rc, v, err) = run_json(db, &["audit", "--json"]);
    assert_eq!(rc, 0, "the audit passes with these entries: {v} {err}");
}

crate::on_both_backends!(tenants_and_subjects_are_added_and_disabled_after_init_each_in_the_operator_log);

/// A ledger written with the HTTP catalog (one operation: the provider was
/// not there), on SQLite or PostgreSQL; the guard keeps it alive.
fn http_ledger(
    backend: crate::support::Backend,
) -> (tempfile::TempDir, Option<crate::support::PgDb>, std::path::PathBuf, Value) {
    let dir = tempfile::tempdir().unwrap();
    let pg = (backend == crate::support::Backend::Postgres).then(|| crate::support::PgDb::new().unwrap());
    let db = pg.as_ref().map_or_else(|| dir.path().join("http.db"), |p| std::path::PathBuf::from(&p.url));
    let catalog = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    let with_env = |args: &[&str]| {
        tg().env("TOOLGATE_PROVIDER_URL", "http://127.0.0.1:9")
            .arg("--db")
            .arg(&db)
            .arg("--catalog")
            .arg(&catalog)
            .args(args)
            .output()
            .unwrap()
    };
    assert!(with_env(&["init"]).status.success());
    let out = with_env(&[
        "dispatch",
        "--now",
        NOW,
        "--tenant",
        "acme",
        "--subject",
        "agent_ana",
        "--tool",
        "create_refund",
        "--key",
        "cli-key-2001",
        "--args",
        ARGS,
        "--json",
    ]);
    let env: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    assert_eq!(env["model_result"]["error"]["code"], "TOOL_UNAVAILABLE", "{env}");
    (dir, pg, db, env)
}

fn read_commands_need_neither_the_catalog_nor_its_environment(backend: crate::support::Backend) {
    let (_dir, _pg, db, env) = http_ledger(backend);
    let op = env["protected_audit"]["operation_id"].as_str().unwrap().to_string();
    let catalog = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    let reads: [&[&str]; 9] = [
        &["ops", "list", "--json"],
        &["ops", "show", &op, "--json"],
        &["counts", "--json"],
        &["audit", "--json"],
        &["audit", "--log", "--json"],
        &["trace", "--json"],
        &["approvals", "--json"],
        &["orders", "--json"],
        &["metrics", "--json"],
    ];
    for with_catalog in [false, true] {
        for args in reads {
            let mut c = tg();
            c.env_remove("TOOLGATE_PROVIDER_URL").arg("--db").arg(&db);
            if with_catalog {
                c.arg("--catalog").arg(&catalog);
            }
            let out = c.args(args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(0), "{args:?} (catalog: {with_catalog}): {err}");
            assert!(err.is_empty(), "{args:?}: {err}");
        }
        let mut c = tg();
        c.env_remove("TOOLGATE_PROVIDER_URL").arg("--db").arg(&db);
        if with_catalog {
            c.arg("--catalog").arg(&catalog);
        }
        let counts: Value = serde_json::from_slice(&c.args(["counts", "--json"]).output().unwrap().stdout).unwrap();
        let payments = &counts["downstreams"]["payments"];
        assert_eq!(payments["counted"], false, "{counts}");
        let note = payments["note"].as_str().unwrap();
        let says =
            if with_catalog { "TOOLGATE_PROVIDER_URL is not set" } else { "pass the ledger's catalog (--catalog DIR)" };
        assert!(note.contains(says) && !note.contains("older than this build"), "{note}");
    }
}

crate::on_both_backends!(read_commands_need_neither_the_catalog_nor_its_environment);

fn counts_say_per_downstream_what_they_count(backend: crate::support::Backend) {
    // The demo ledger: the simulated providers count their own effects.
    let fx = crate::support::Fixture::on(backend);
    let (rc, v) = dispatch_as(fx.path(), "acme", "agent_ana", "create_refund", "cli-key-3001", ARGS);
    assert_eq!(rc, 0, "{v}");
    let (_, c, _) = run_json(fx.path(), &["counts", "--json"]);
    assert_eq!((c["downstream_effects"].as_i64(), c["side_effect_duplicates"].as_i64()), (Some(1), Some(0)), "{c}");
    let d = &c["downstreams"];
    assert_eq!(
        [&d["payments"]["counted"], &d["payments"]["effects"], &d["payments"]["side_effect_duplicates"]],
        [&Value::Bool(true), &Value::from(1), &Value::from(0)],
        "{c}"
    );
    assert_eq!(
        (d["notifications"]["adapter"].as_str(), d["notifications"]["effects"].as_i64()),
        (Some("simulated"), Some(0))
    );

    // A real API's downstream: not counted, said so (0 is not a claim about it).
    let (_dir, _pg, db, _) = http_ledger(backend);
    let catalog = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    let out = tg()
        .env("TOOLGATE_PROVIDER_URL", "http://127.0.0.1:9")
        .arg("--db")
        .arg(&db)
        .arg("--catalog")
        .arg(&catalog)
        .args(["counts", "--json"])
        .output()
        .unwrap();
    let c: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
    for name in ["payments", "notifications"] {
        let row = &c["downstreams"][name];
        assert_eq!((row["adapter"].as_str(), row["counted"].as_bool()), (Some("http"), Some(false)), "{c}");
        assert!(row["effects"].is_null() && row["side_effect_duplicates"].is_null(), "{c}");
        assert!(row["note"].as_str().unwrap().contains("cannot count the effects it caused"), "{c}");
    }
    let text = tg()
        .env("TOOLGATE_PROVIDER_URL", "http://127.0.0.1:9")
        .arg("--db")
        .arg(&db)
        .arg("--catalog")
        .arg(&catalog)
        .arg("counts")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("side_effect_duplicates: 0 (counted at no downstream: not at notifications, payments)"),
        "{text}"
    );
}

crate::on_both_backends!(counts_say_per_downstream_what_they_count);

/// Issue 32 §2: `--now` was silently ignored by the console. It is refused
/// with a clear error (the console runs on the wall clock), before anything
/// is made.
#[test]
fn the_console_refuses_now_instead_of_ignoring_it() {
    let out = tg().args(["--now", NOW]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("INVALID_ARGUMENTS") && err.contains("wall clock"), "{err}");
}

/// Issue 40: `ops list` takes the console's tool filter and sort columns
/// (index-backed), and an unknown column is a clear error with the list.
#[test]
fn ops_list_filters_by_tool_and_state_and_sorts_like_the_console() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("demo.db"), &db).unwrap();
    let list = |args: &[&str]| -> (i32, Value) {
        let out = tg().arg("--db").arg(&db).args(["ops", "list", "--json"]).args(args).output().unwrap();
        (out.status.code().unwrap_or(-1), serde_json::from_slice(&out.stdout).unwrap())
    };
    let (code, v) = list(&["--tool", "create_refund", "--state", "unknown"]);
    assert_eq!(code, 0);
    let ops = v["operations"].as_array().unwrap();
    assert!(!ops.is_empty() && ops.iter().all(|o| o["tool"] == "create_refund" && o["state"] == "unknown"), "{v}");
    let (_, all) = list(&["--sort", "tool", "--asc"]);
    let tools: Vec<&str> = all["operations"].as_array().unwrap().iter().map(|o| o["tool"].as_str().unwrap()).collect();
    let mut sorted = tools.clone();
    sorted.sort_unstable();
    assert_eq!(tools, sorted);
    assert_eq!(tools.len(), 11);
    let (code, err) = list(&["--sort", "nope"]);
    assert_eq!((code, err["error"]["code"].as_str()), (2, Some("BAD_SORT")));
    assert!(err["error"]["message"].as_str().unwrap().contains("updated"), "{err}");
}
