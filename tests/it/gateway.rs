//! Issue 35 §1: an MCP server as a downstream (the gateway). The server is a
//! real one written with the official Python SDK
//! (`fixtures/mcp_effects_server.py`) that counts its effects in its own
//! SQLite file and acts out faults: its reply lost after a commit (stdout
//! closed), a crash (SIGKILL) before or after its commit, `isError`, a slow
//! call with progress that toolgate cancels. Its catalog is made the way an
//! operator makes it: `toolgate catalog import-mcp`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use serde_json::{json, Value};
use tempfile::TempDir;
use toolgate::engine::clock::ManualClock;
use toolgate::engine::envelope::{Code, Envelope, Status};
use toolgate::engine::tool::Toolset;
use toolgate::engine::world::World;
use toolgate::engine::{DispatchRequest, Engine, EngineOptions};

use crate::support::Backend;

const T0: i64 = 1_767_225_600_000;
const SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/fixtures/mcp_effects_server.py");
/// How long the server remembers a key, as the operator says at import.
const KEY_RETENTION_MS: u64 = 86_400_000;

const WORLD: &str = r#"{
  "tenants": [{"id": "acme", "approvers": ["alice"], "approval_threshold_minor": 50000}],
  "subjects": [{"id": "agent_ana", "tenant": "acme"}, {"id": "alice", "tenant": "acme"}],
  "grants": [
    {"tenant": "acme", "subject": "agent_ana", "tool": "send_email"},
    {"tenant": "acme", "subject": "agent_ana", "tool": "create_charge"},
    {"tenant": "acme", "subject": "agent_ana", "tool": "charge_by_meta"},
    {"tenant": "acme", "subject": "agent_ana", "tool": "get_order"}
  ]
}"#;

pub fn toolgate() -> Command {
    Command::new(env!("CARGO_BIN_EXE_toolgate"))
}

/// Runs `catalog import-mcp` for the server over stdio into `out`.
fn import(out: &Path, effects: &Path, extra: &[&str]) -> Value {
    let o = toolgate()
        .args(["catalog", "import-mcp", "--json", "--out"])
        .arg(out)
        .args(extra)
        .args(["--", "python3", SERVER])
        .arg(effects)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Edits each catalog file of a directory.
fn edit_catalog(dir: &Path, edit: &dyn Fn(&mut Value)) {
    for f in std::fs::read_dir(dir).unwrap() {
        let p = f.unwrap().path();
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
}

pub struct McpFixture {
    _dir: TempDir,
    pub catalog: PathBuf,
    pub effects: PathBuf,
    pub ledger: PathBuf,
    pub clock: ManualClock,
    /// One toolset for the fixture: its engines share one server process.
    toolset: Arc<Toolset>,
    _pg: Option<crate::support::PgDb>,
}

impl McpFixture {
    pub fn new(backend: Backend) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let effects = dir.path().join("effects.db");
        let catalog = dir.path().join("catalog");
        import(&catalog, &effects, &["--key-argument", "idempotency_key"]);
        // Seconds, not the import's half-minute, so a slow call is cut short;
        // a receipt window of 1 s after it for the re-send.
        edit_catalog(&catalog, &|v| {
            v["retry"]["attempt_timeout_ms"] = json!(3_000);
            v["retry"]["deadline_ms"] = json!(20_000);
            v["downstream"]["receipt_visible_within_ms"] = json!(1_000);
        });
        let (pg, ledger) = match backend {
            Backend::Sqlite => (None, dir.path().join("ledger.db")),
            Backend::Postgres => {
                let db = crate::support::PgDb::new().expect("TOOLGATE_TEST_PG is set");
                let url = PathBuf::from(&db.url);
                (Some(db), url)
            }
        };
        let toolset = toolgate::tools::load_toolset(Some(&catalog)).unwrap();
        let fx = Self { _dir: dir, catalog, effects, ledger, clock: ManualClock::new(T0), toolset, _pg: pg };
        let mut e = Engine::create(&fx.ledger, fx.opts()).unwrap();
        e.load_world(&World::parse(WORLD.as_bytes()).unwrap()).unwrap();
        fx
    }

    pub fn opts(&self) -> EngineOptions {
        EngineOptions {
            clock: Arc::new(self.clock.clone()),
            worker_id: "w-mcp".into(),
            ..EngineOptions::new(self.toolset.clone())
        }
    }

    pub fn engine(&self) -> Engine {
        Engine::open(&self.ledger, self.opts()).unwrap()
    }

    /// The server's next call acts out this fault.
    pub fn fault(&self, line: &str) {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.effects.with_extension("db.faults"))
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }

    fn db(&self) -> rusqlite::Connection {
        let c = rusqlite::Connection::open(&self.effects).unwrap();
        c.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
        c
    }

    /// Effects the server committed, of one tool.
    pub fn effects(&self, tool: &str) -> i64 {
        self.db().query_row("SELECT COUNT(*) FROM effects WHERE tool = ?1", [tool], |r| r.get(0)).unwrap()
    }

    /// What the server saw (`tool:fault`, `tool:cancelled`).
    pub fn events(&self) -> Vec<String> {
        let c = self.db();
        let mut s = c.prepare("SELECT what FROM events ORDER BY id").unwrap();
        s.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    }
}

fn email(key: &str, to: &str) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "send_email".into(),
        arguments: json!({"to": to, "subject": "your refund"}).to_string().into_bytes(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

fn charge(key: &str, amount: i64) -> DispatchRequest {
    DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "create_charge".into(),
        arguments: json!({"order_ref": "ord_1", "amount_minor": amount}).to_string().into_bytes(),
        idempotency_key: Some(key.into()),
        ..DispatchRequest::default()
    }
}

fn state(e: &mut Engine, env: &Envelope) -> (String, Option<String>) {
    let id = env.protected_audit.operation_id.clone().expect("an operation");
    let d = e.operation_detail(&id).unwrap().unwrap();
    (d.operation.state.to_string(), d.operation.code.clone())
}

#[test]
fn import_writes_reviewable_files_and_proposes_effects_only_from_evidence() {
    let dir = tempfile::tempdir().unwrap();
    let effects = dir.path().join("effects.db");
    // Without the operator's word, a tool with a key-like argument is still external.
    let plain = import(&dir.path().join("plain"), &effects, &[]);
    let effect_of = |v: &Value, tool: &str| {
        v["files"].as_array().unwrap().iter().find(|f| f["tool"] == tool).unwrap()["effect"].clone()
    };
    assert_eq!(plain["ok"], true, "{plain}");
    assert_eq!(effect_of(&plain, "send_email"), "external");
    assert_eq!(effect_of(&plain, "create_charge"), "external");
    assert_eq!(effect_of(&plain, "get_order"), "read", "readOnlyHint");
    let notes = plain["files"].to_string();
    assert!(notes.contains("--key-argument idempotency_key"), "the hint: {notes}");
    // With it: write, the key filled in by toolgate (not in the agent's schema), asked by re-sending.
    let keyed_dir = dir.path().join("keyed");
    let keyed = import(&keyed_dir, &effects, &["--key-argument", "idempotency_key"]);
    assert_eq!(effect_of(&keyed, "create_charge"), "write");
    assert_eq!(effect_of(&keyed, "send_email"), "external", "it takes no such argument");
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(keyed_dir.join("create_charge.json")).unwrap()).unwrap();
    assert!(file["input_schema"]["properties"].get("idempotency_key").is_none(), "{file}");
    assert_eq!(file["downstream"]["mcp"]["key_argument"], "idempotency_key");
    assert_eq!(file["downstream"]["lookup"]["by"], "resend");
    // The server's output schema is the contract.
    assert_eq!(file["output_schema"]["required"], json!(["charge_id", "order_ref", "amount_minor"]));
    // A second import does not overwrite a reviewed file, unless told to.
    let again = toolgate()
        .args(["catalog", "import-mcp", "--json", "--out"])
        .arg(&keyed_dir)
        .args(["--", "python3", SERVER])
        .arg(&effects)
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2), "{}", String::from_utf8_lossy(&again.stdout));
    assert!(String::from_utf8_lossy(&again.stdout).contains("CATALOG_FILE_EXISTS"));
    // A server that does not start is a clear error, with no path in it.
    let bad = toolgate()
        .args(["catalog", "import-mcp", "--json", "--out"])
        .arg(dir.path().join("none"))
        .args(["--", "/nonexistent/mcp-server"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&bad.stdout).to_string() + &String::from_utf8_lossy(&bad.stderr);
    assert!(text.contains("MCP_SERVER_UNREACHABLE"), "{text}");
    assert!(!text.contains("/nonexistent"), "{text}");
    // Nothing was written for it; the catalogs written load as they are.
    assert!(!dir.path().join("none").exists());
    assert_eq!(toolgate().args(["catalog", "check"]).arg(&keyed_dir).status().unwrap().code(), Some(0));
}

crate::on_both_backends!(fresh_replay_and_conflict_make_one_effect);
fn fresh_replay_and_conflict_make_one_effect(backend: Backend) {
    let fx = McpFixture::new(backend);
    let mut e = fx.engine();
    let first = e.dispatch(&charge("gw-charge-0001", 500)).unwrap();
    assert_eq!(first.model_result.status, Status::Succeeded, "{first:?}");
    assert_eq!(first.model_result.data.as_ref().unwrap()["amount_minor"], 500);
    // The agent retries: the ledger answers, the server is not called.
    let replay = e.dispatch(&charge("gw-charge-0001", 500)).unwrap();
    assert_eq!(replay.model_result.status, Status::Succeeded);
    assert_eq!(replay.model_result.data, first.model_result.data);
    // The same key for another charge is refused before anything is sent.
    let conflict = e.dispatch(&charge("gw-charge-0001", 900)).unwrap();
    assert_eq!(conflict.code(), Some(Code::IdempotencyConflict), "{conflict:?}");
    // An email without de-duplication, and its replay.
    let mail = e.dispatch(&email("gw-email-0001", "a@example.com")).unwrap();
    assert_eq!(mail.model_result.status, Status::Succeeded, "{mail:?}");
    e.dispatch(&email("gw-email-0001", "a@example.com")).unwrap();
    assert_eq!((fx.effects("create_charge"), fx.effects("send_email")), (1, 1));
    // The server got toolgate's downstream key in the argument it de-duplicates by.
    let key: String =
        fx.db().query_row("SELECT key FROM effects WHERE tool = 'create_charge'", [], |r| r.get(0)).unwrap();
    let id = first.protected_audit.operation_id.clone().unwrap();
    assert_eq!(key, e.operation_detail(&id).unwrap().unwrap().operation.downstream_key);
}

#[test]
fn a_read_tool_is_answered_by_the_server_and_records_no_operation() {
    let fx = McpFixture::new(Backend::Sqlite);
    let mut e = fx.engine();
    let env = e
        .dispatch(&DispatchRequest {
            tenant: "acme".into(),
            subject: "agent_ana".into(),
            tool: "get_order".into(),
            arguments: br#"{"order_ref":"ord_7"}"#.to_vec(),
            idempotency_key: Some("gw-read-00001".into()),
            ..DispatchRequest::default()
        })
        .unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert_eq!(env.model_result.data, Some(json!({"order_ref": "ord_7", "status": "open"})));
    assert!(env.protected_audit.operation_id.is_none());
    assert_eq!(fx.events(), ["get_order:ok"]);
}

crate::on_both_backends!(a_lost_reply_of_an_external_tool_goes_to_a_person_and_is_never_resent);
fn a_lost_reply_of_an_external_tool_goes_to_a_person_and_is_never_resent(backend: Backend) {
    let fx = McpFixture::new(backend);
    let mut e = fx.engine();
    // The server commits, then closes its stdout: the reply never comes.
    fx.fault("close_stdout_after_commit");
    let env = e.dispatch(&email("gw-lost-00001", "b@example.com")).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e, &env), ("needs_review".into(), Some("OUTCOME_UNKNOWN".into())));
    // The agent retries; the worker runs; time passes: nothing is sent again.
    let again = e.dispatch(&email("gw-lost-00001", "b@example.com")).unwrap();
    assert_ne!(again.model_result.status, Status::Succeeded);
    fx.clock.advance(60_000);
    e.work(16).unwrap();
    assert_eq!(e.settle_unknown(16).unwrap(), 0, "an MCP tool without a key cannot be asked");
    assert_eq!(fx.effects("send_email"), 1);
    // The server is started again for the next call (the old one is gone).
    let next = e.dispatch(&email("gw-next-00001", "c@example.com")).unwrap();
    assert_eq!(next.model_result.status, Status::Succeeded, "{next:?}");
    assert_eq!(fx.effects("send_email"), 2);
}

crate::on_both_backends!(a_server_crash_after_its_commit_is_settled_by_resending_with_one_effect);
fn a_server_crash_after_its_commit_is_settled_by_resending_with_one_effect(backend: Backend) {
    let fx = McpFixture::new(backend);
    let mut e = fx.engine();
    fx.fault("crash_after_commit");
    let env = e.dispatch(&charge("gw-crash-00001", 700)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    // It can be asked (the server de-duplicates by the key): the unknown queue.
    assert_eq!(state(&mut e, &env).0, "unknown");
    assert_eq!(fx.effects("create_charge"), 1);
    // After the receipt window the worker asks by re-sending to a restarted
    // server, which answers the original charge.
    fx.clock.advance(4_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(state(&mut e, &env).0, "succeeded");
    assert_eq!(fx.effects("create_charge"), 1, "the re-send made no second charge");
    let replay = e.dispatch(&charge("gw-crash-00001", 700)).unwrap();
    assert_eq!(replay.model_result.data.as_ref().unwrap()["amount_minor"], 700);
}

#[test]
fn a_crash_before_the_commit_is_unknown_and_the_resend_runs_it_once() {
    let fx = McpFixture::new(Backend::Sqlite);
    let mut e = fx.engine();
    fx.fault("crash_before_commit");
    let env = e.dispatch(&charge("gw-early-00001", 300)).unwrap();
    // Written to the server, which died: toolgate cannot know it did nothing.
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(fx.effects("create_charge"), 0);
    fx.clock.advance(4_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(state(&mut e, &env).0, "succeeded");
    assert_eq!(fx.effects("create_charge"), 1);
}

/// An isError result may come after the tool acted (an exception after the
/// email went out is one too): an unknown outcome with its content as the
/// evidence, never "no effect", unless the catalog says the server's tools
/// fail before they act.
#[test]
fn is_error_is_an_unknown_outcome_with_its_content_kept_as_evidence() {
    let fx = McpFixture::new(Backend::Sqlite);
    let mut e = fx.engine();
    fx.fault("is_error");
    let env = e.dispatch(&email("gw-error-00001", "d@example.com")).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    let id = env.protected_audit.operation_id.clone().unwrap();
    let d = e.operation_detail(&id).unwrap().unwrap();
    assert_eq!(d.operation.state.to_string(), "needs_review", "external: a person looks");
    let said: Vec<String> = d.trace.iter().filter_map(toolgate::telemetry::export::refusal).collect();
    assert!(
        said.iter().any(|s| s.contains("isError") && s.contains("mailbox unavailable")),
        "the content is the evidence: {said:?}"
    );
    assert_eq!(fx.effects("send_email"), 0);
    // A tool asked by re-sending: unknown, and the worker's re-send runs it once.
    fx.fault("is_error");
    let charge_env = e.dispatch(&charge("gw-error-00002", 500)).unwrap();
    assert_eq!(state(&mut e, &charge_env), ("unknown".into(), Some("OUTCOME_UNKNOWN".into())));
    fx.clock.advance(4_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(state(&mut e, &charge_env).0, "succeeded");
    assert_eq!(fx.effects("create_charge"), 1);
    // A re-send answered isError again goes to a person (another could act).
    fx.fault("is_error");
    let twice = e.dispatch(&charge("gw-error-00003", 600)).unwrap();
    fx.fault("is_error");
    fx.clock.advance(4_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(state(&mut e, &twice), ("needs_review".into(), Some("STATUS_CONFLICT".into())));
    // The server documents that its tools fail before they act: failed.
    edit_catalog(&fx.catalog, &|v| {
        if v["name"] == "send_email" {
            v["downstream"]["mcp"]["is_error_means_not_committed"] = json!(true);
        }
    });
    let opts = EngineOptions {
        clock: Arc::new(fx.clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&fx.catalog)).unwrap())
    };
    let mut e2 = Engine::open(&fx.ledger, opts).unwrap();
    fx.fault("is_error");
    let failed = e2.dispatch(&email("gw-error-00004", "e@example.com")).unwrap();
    assert_eq!(failed.model_result.status, Status::Failed, "{failed:?}");
    assert_eq!(failed.code(), Some(Code::BusinessRuleViolation));
    assert_eq!(fx.effects("send_email"), 0);
}

#[test]
fn a_slow_call_is_cancelled_at_its_timeout_and_left_to_a_person() {
    let fx = McpFixture::new(Backend::Sqlite);
    let mut e = fx.engine();
    // Progress every 100 ms for 20 s; the attempt timeout is 3 s.
    fx.fault("slow:20000");
    let env = e.dispatch(&email("gw-slow-00001", "e@example.com")).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e, &env).0, "needs_review");
    // toolgate sent notifications/cancelled: the server stopped and recorded it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !fx.events().iter().any(|w| w == "send_email:cancelled") {
        assert!(std::time::Instant::now() < deadline, "never cancelled: {:?}", fx.events());
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(fx.effects("send_email"), 0);
}

#[test]
fn a_server_that_cannot_start_was_never_sent_anything() {
    let dir = tempfile::tempdir().unwrap();
    let effects = dir.path().join("effects.db");
    let catalog = dir.path().join("catalog");
    import(&catalog, &effects, &[]);
    edit_catalog(&catalog, &|v| v["downstream"]["mcp"]["command"] = json!(["/nonexistent/mcp-server"]));
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts).unwrap();
    e.load_world(&World::parse(WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&email("gw-nostart-0001", "f@example.com")).unwrap();
    // Provably not received: retryable, the operation waits in the outbox.
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    assert_eq!(state(&mut e, &env).0, "accepted");
}

#[test]
fn an_agent_calls_the_wrapped_server_through_toolgate_mcp() {
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::TokioChildProcess;
    use rmcp::ServiceExt;
    let fx = McpFixture::new(Backend::Sqlite);
    let o = toolgate()
        .arg("--db")
        .arg(&fx.ledger)
        .arg("--catalog")
        .arg(&fx.catalog)
        .args(["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"])
        .output()
        .unwrap();
    let token = serde_json::from_slice::<Value>(&o.stdout).unwrap()["token"].as_str().unwrap().to_string();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_toolgate"));
        cmd.arg("--db").arg(&fx.ledger).arg("--catalog").arg(&fx.catalog).args(["mcp", "--token", &token]);
        let client = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
        let tools = client.list_all_tools().await.unwrap();
        let charge = tools.iter().find(|t| t.name == "create_charge").expect("the wrapped tool is listed");
        // The agent's key is toolgate's idempotency_key; the server's own key
        // argument is toolgate's to fill.
        assert!(charge.input_schema["properties"].get("idempotency_key").is_some());
        let args = json!({"order_ref": "ord_9", "amount_minor": 1200, "idempotency_key": "agent-key-000001"});
        let mut seen = Vec::new();
        for _ in 0..2 {
            let r = client
                .call_tool(
                    CallToolRequestParams::new("create_charge").with_arguments(args.as_object().unwrap().clone()),
                )
                .await
                .unwrap();
            let s = r.structured_content.expect("structured");
            assert_eq!(s["status"], "succeeded", "{s}");
            seen.push(s["data"].clone());
        }
        assert_eq!(seen[0], seen[1], "the retry is answered from the ledger");
        assert_eq!(seen[0]["amount_minor"], 1200);
        client.cancel().await.unwrap();
    });
    assert_eq!(fx.effects("create_charge"), 1);
}

#[test]
fn a_streamable_http_server_is_imported_and_called_by_url() {
    let dir = tempfile::tempdir().unwrap();
    let effects = dir.path().join("effects.db");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = Command::new("python3")
        .arg(SERVER)
        .arg(&effects)
        .args(["--http", &port.to_string()])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _guard = Kill(&mut server);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(std::time::Instant::now() < deadline, "the server did not listen");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let catalog = dir.path().join("catalog");
    let url = format!("http://127.0.0.1:{port}/mcp");
    let o = toolgate()
        .args(["catalog", "import-mcp", "--json", "--key-argument", "idempotency_key", "--url", &url, "--out"])
        .arg(&catalog)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    let file: Value =
        serde_json::from_str(&std::fs::read_to_string(catalog.join("create_charge.json")).unwrap()).unwrap();
    assert_eq!(file["downstream"]["mcp"]["url"], url.as_str());
    let ledger = dir.path().join("ledger.db");
    let opts = EngineOptions {
        clock: Arc::new(ManualClock::new(T0)),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts).unwrap();
    e.load_world(&World::parse(WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&charge("gw-http-000001", 450)).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    let again = e.dispatch(&charge("gw-http-000001", 450)).unwrap();
    assert_eq!(again.model_result.data, env.model_result.data);
    let n: i64 = rusqlite::Connection::open(&effects)
        .unwrap()
        .query_row("SELECT COUNT(*) FROM effects", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 1);
}

#[test]
fn the_catalog_refuses_an_mcp_section_that_would_claim_what_the_server_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let effects = dir.path().join("effects.db");
    let base = dir.path().join("base");
    import(&base, &effects, &["--key-argument", "idempotency_key"]);
    type Edit<'a> = &'a dyn Fn(&mut Value);
    let cases: [(&str, &str, Edit); 6] = [
        ("create_charge", "never sent", &|v| {
            v["downstream"]["mcp"].as_object_mut().unwrap().remove("key_argument");
        }),
        ("create_charge", "remove it from input_schema", &|v| {
            v["downstream"]["mcp"]["key_argument"] = json!("charge_key");
            v["input_schema"]["properties"]["charge_key"] = json!({"type": "string"});
        }),
        ("get_order", "a read tool is sent no key", &|v| {
            v["downstream"]["mcp"]["key_argument"] = json!("idempotency_key");
        }),
        ("send_email", "exactly one of command", &|v| {
            v["downstream"]["mcp"]["url"] = json!("http://127.0.0.1:9/mcp");
        }),
        ("send_email", "only the http adapter", &|v| {
            v["downstream"]["http"] = json!({});
        }),
        ("send_email", "dedupes_keys must be true", &|v| {
            v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": KEY_RETENTION_MS});
        }),
    ];
    for (i, (tool, why, edit)) in cases.into_iter().enumerate() {
        let sub = dir.path().join(format!("c{i}"));
        std::fs::create_dir_all(&sub).unwrap();
        for f in std::fs::read_dir(&base).unwrap() {
            let p = f.unwrap().path();
            std::fs::copy(&p, sub.join(p.file_name().unwrap())).unwrap();
        }
        edit_catalog(&sub, &|v| {
            if v["name"] == tool {
                edit(v);
            }
        });
        let err = toolgate::tools::load_toolset(Some(&sub)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// One intent of the gateway load run, as its agent saw it.
struct Carried {
    tool: &'static str,
    body: Value,
    env: Envelope,
}

/// Issue 35 §5: agents drive the wrapped server under faults (its reply lost
/// after a commit, crashes before and after a commit that take every call in
/// flight with them, isError, slow calls cancelled at their timeout), replay
/// and conflict as models do; then the worker settles. The referee counts the
/// server's own effects per intent. `TOOLGATE_SOAK=1`: 4 agents × 100 intents
/// (CI: 2 × 12).
#[test]
fn a_load_run_through_the_gateway_under_faults_makes_no_duplicate_and_nothing_silently_wrong() {
    use rand::{Rng, SeedableRng};
    let soak = std::env::var_os("TOOLGATE_SOAK").is_some();
    let (agents, per_agent) = if soak { (4, 100) } else { (2, 12) };
    let fx = McpFixture::new(Backend::Sqlite);
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    let faults: Vec<&str> = (0..agents * per_agent * 3)
        .map(|_| match rng.gen_range(0..100) {
            0..=7 => "close_stdout_after_commit",
            8..=15 => "crash_after_commit",
            16..=21 => "crash_before_commit",
            22..=31 => "is_error",
            32..=35 => "slow:4000",
            _ => "ok",
        })
        .collect();
    std::fs::write(fx.effects.with_extension("db.faults"), faults.join("\n") + "\n").unwrap();
    let started = std::time::Instant::now();
    let (replays, conflicts) = (std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0));
    let (mismatches, masked) = (std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0));
    let carried: Vec<Carried> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..agents)
            .map(|a| {
                let (fx, replays, conflicts, mismatches, masked) = (&fx, &replays, &conflicts, &mismatches, &masked);
                s.spawn(move || {
                    use std::sync::atomic::Ordering::Relaxed;
                    let mut rng = rand::rngs::StdRng::seed_from_u64(100 + a as u64);
                    let mut e = fx.engine();
                    let mut out = Vec::new();
                    for i in 0..per_agent {
                        let key = format!("gw-load-{a}-{i:04}");
                        let (tool, body, req) = if i % 3 == 0 {
                            let to = format!("u{a}_{i}@example.com");
                            let r = email(&key, &to);
                            ("send_email", json!({"to": to, "subject": "your refund"}), r)
                        } else {
                            let order = format!("ord_{a}_{i}");
                            let amount = 100 + i64::from(i);
                            let mut r = charge(&key, amount);
                            r.arguments = json!({"order_ref": order, "amount_minor": amount}).to_string().into_bytes();
                            ("create_charge", json!({"order_ref": order, "amount_minor": amount}), r)
                        };
                        // A careful harness: a retryable answer with a hint is
                        // retried under the same key once the hint has passed.
                        let mut env = e.dispatch(&req).unwrap();
                        for _ in 0..5 {
                            let Some(err) = env.model_result.error.as_ref() else { break };
                            let Some(ms) = err.retry_after_ms.filter(|_| err.retryable) else { break };
                            fx.clock.advance(ms as i64);
                            std::thread::sleep(std::time::Duration::from_millis(20));
                            env = e.dispatch(&req).unwrap();
                        }
                        // The model replays a finished call: the ledger's answer must be the first.
                        if env.model_result.status == Status::Succeeded && rng.gen_ratio(1, 4) {
                            replays.fetch_add(1, Relaxed);
                            let again = e.dispatch(&req).unwrap();
                            if again.model_result.data != env.model_result.data {
                                mismatches.fetch_add(1, Relaxed);
                            }
                        }
                        // A confused model re-sends the key with another amount.
                        if tool == "create_charge" && rng.gen_ratio(1, 10) {
                            conflicts.fetch_add(1, Relaxed);
                            let mut other = req.clone();
                            other.arguments =
                                json!({"order_ref": body["order_ref"], "amount_minor": 1}).to_string().into_bytes();
                            if e.dispatch(&other).unwrap().model_result.status == Status::Succeeded {
                                masked.fetch_add(1, Relaxed);
                            }
                        }
                        out.push(Carried { tool, body, env });
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    // The worker's passes: due retries, then the re-sends of what is unknown.
    let mut e = fx.engine();
    for _ in 0..6 {
        fx.clock.advance(10_000);
        e.work(10_000).unwrap();
        e.settle_unknown(10_000).unwrap();
    }
    // The referee: the server's effects per intent (each intent's body is its own).
    let c = fx.db();
    // As the server's json.dumps(body, sort_keys=True, separators=(",", ":")).
    let digest = |b: &Value| toolgate::engine::canonical::sha256_hex(serde_json::to_string(b).unwrap().as_bytes());
    let effects_of = |tool: &str, b: &Value| -> i64 {
        c.query_row("SELECT COUNT(*) FROM effects WHERE tool = ?1 AND body = ?2", [tool, &digest(b)], |r| r.get(0))
            .unwrap()
    };
    let mut states: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::default();
    let mut reasons: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::default();
    let (mut duplicates, mut wrong, mut effects) = (0, 0, 0);
    for it in &carried {
        let n = effects_of(it.tool, &it.body);
        effects += n;
        if n > 1 {
            duplicates += 1;
        }
        let Some(id) = it.env.protected_audit.operation_id.clone() else {
            // Refused before an operation existed (nothing can have been sent).
            assert_eq!(n, 0, "{:?}", it.env);
            *states.entry(format!("{} refused: {:?}", it.tool, it.env.code())).or_default() += 1;
            continue;
        };
        let op = e.operation_detail(&id).unwrap().unwrap().operation;
        let state = op.state.to_string();
        // Succeeded with no effect, or failed with one: wrong and looking right.
        if (state == "succeeded" && n != 1) || (state == "failed" && n != 0) {
            wrong += 1;
        }
        if state == "needs_review" {
            *reasons.entry(op.code.clone().unwrap_or_default()).or_default() += 1;
        }
        *states.entry(format!("{} {state}", it.tool)).or_default() += 1;
    }
    let acted: Vec<String> = fx.events();
    let mut seen: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::default();
    for a in &acted {
        *seen.entry(a.clone()).or_default() += 1;
    }
    let wrong = wrong
        + mismatches.load(std::sync::atomic::Ordering::Relaxed)
        + masked.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "gateway load: {agents} agents x {per_agent} intents in {:.1} s; replays {}, conflicting re-sends {}",
        started.elapsed().as_secs_f64(),
        replays.into_inner(),
        conflicts.into_inner()
    );
    eprintln!("  what the server acted out (tool:fault): {seen:?}");
    eprintln!("  operations at the end: {states:?}");
    eprintln!("  needs_review by reason: {reasons:?}");
    eprintln!("  effects {effects}, duplicates {duplicates}, silently wrong {wrong}");
    assert_eq!(duplicates, 0);
    assert_eq!(wrong, 0);
    assert!(!states.keys().any(|k| k.ends_with(" unknown")), "every unknown settled or parked: {states:?}");
    assert!(reasons.keys().all(|r| !r.is_empty()), "each parked with its reason: {reasons:?}");
    // The faults did happen (the run proves something).
    assert!(acted.iter().any(|a| a.ends_with(":crash_after_commit") || a.ends_with(":close_stdout_after_commit")));
}

#[test]
fn a_server_that_reads_the_key_in_meta_is_asked_by_resending_with_one_effect() {
    let fx = McpFixture::new(Backend::Sqlite);
    // The operator says the server de-duplicates by a _meta entry (the
    // import cannot see that in a schema).
    let file = fx.catalog.join("charge_by_meta.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(v["effect"], "external", "no key argument: external until a person says otherwise");
    // A changed meaning is a new revision (the ledger refuses it otherwise).
    v["effect"] = json!("write");
    v["revisions"]["effect"] = json!(2);
    v["downstream"]["dedupes_keys"] = json!(true);
    v["downstream"]["mcp"]["key_meta"] = json!("io.example/idempotency-key");
    v["downstream"]["lookup"] = json!({"by": "resend", "key_retention_ms": KEY_RETENTION_MS});
    std::fs::write(&file, serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let opts = EngineOptions {
        clock: Arc::new(fx.clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&fx.catalog)).unwrap())
    };
    let mut e = Engine::open(&fx.ledger, opts).unwrap();
    let mut req = charge("gw-meta-000001", 800);
    req.tool = "charge_by_meta".into();
    fx.fault("crash_after_commit");
    let env = e.dispatch(&req).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e, &env).0, "unknown");
    fx.clock.advance(4_001);
    assert_eq!(e.settle_unknown(16).unwrap(), 1);
    assert_eq!(state(&mut e, &env).0, "succeeded");
    assert_eq!(fx.effects("charge_by_meta"), 1, "the re-send carried the same key in _meta");
}
