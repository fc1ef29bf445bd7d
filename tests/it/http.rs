//! The `http` adapter over real sockets (issue 15 §3, §4): a real
//! `toolgate provider serve` child process on an ephemeral loopback port, the
//! demo catalog behind it, and every class of reply classified by evidence.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::Value;
use tempfile::TempDir;
use toolgate::downstream::http::HttpAdapter;
use toolgate::downstream::{DownstreamContext, DownstreamFactory, DownstreamRequest, FaultPlan, Lookup, Reply};
use toolgate::engine::clock::{Clock, ManualClock};
use toolgate::engine::envelope::{Code, Status};
use toolgate::engine::world::{World, DEMO_WORLD};
use toolgate::engine::{Engine, EngineOptions};
use toolgate::store::Sync;

use crate::support::{call, dispatch_with, query_req, T0};

/// A create_refund for agent_ana with a call identity of the query's provider profile.
fn refund(key: &str, amount: i64) -> toolgate::engine::DispatchRequest {
    toolgate::engine::DispatchRequest {
        call: Some(call(&format!("call-{key}-{amount}"))),
        ..crate::support::refund(key, amount)
    }
}

/// A `toolgate provider serve` child on an ephemeral loopback port; killed on drop.
pub struct ProviderServer {
    child: Child,
    pub addr: String,
    pub db: PathBuf,
}

impl ProviderServer {
    pub fn start(dir: &Path, extra: &[&str]) -> Self {
        let db = dir.join("provider.db");
        let mut child = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .args(["provider", "serve", "--listen", "127.0.0.1:0", "--db"])
            .arg(&db)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr =
            line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("no address in {line:?}")).to_string();
        Self { child, addr, db }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Effects the provider committed (all, or for one intent's key count).
    pub fn effects(&self) -> i64 {
        let c = rusqlite::Connection::open(&self.db).unwrap();
        c.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
        c.query_row("SELECT count(*) FROM provider_effects", [], |r| r.get(0)).unwrap()
    }

    /// Intents with more than one effect (must be 0).
    pub fn duplicates(&self) -> i64 {
        let c = rusqlite::Connection::open(&self.db).unwrap();
        c.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
        c.query_row(
            "SELECT count(*) FROM (SELECT intent FROM provider_effects GROUP BY intent HAVING count(*) > 1)",
            [],
            |r| r.get(0),
        )
        .unwrap()
    }
}

impl Drop for ProviderServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The shipped `assets/catalog-http/` pointed at `base_url`, with a 1 s attempt
/// timeout (so a lost reply costs the test one second), optionally with a
/// secret header read from a file.
pub fn write_catalog(dir: &Path, base_url: &str, secret_file: Option<&Path>) -> PathBuf {
    let secrets = secret_file.map(|f| serde_json::json!([{"header": "Authorization", "file": f, "prefix": "Bearer "}]));
    write_catalog_with(dir, base_url, &|http| {
        if let Some(s) = &secrets {
            http.insert("secret_headers".into(), s.clone());
        }
    })
}

/// [`write_catalog`] with a change to each tool's `downstream.http` section.
pub fn write_catalog_with(dir: &Path, base_url: &str, edit: &dyn Fn(&mut serde_json::Map<String, Value>)) -> PathBuf {
    write_catalog_edited(dir, base_url, &|v| {
        if let Some(http) = v["downstream"].get_mut("http").and_then(Value::as_object_mut) {
            edit(http);
        }
    })
}

/// [`write_catalog`] with a change to each http tool's whole file.
pub fn write_catalog_edited(dir: &Path, base_url: &str, edit: &dyn Fn(&mut Value)) -> PathBuf {
    let out = dir.join("catalog");
    std::fs::create_dir_all(&out).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    for name in ["create_refund.json", "get_order.json", "notify_customer.json"] {
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(src.join(name)).unwrap()).unwrap();
        if let Some(http) = v["downstream"].get_mut("http").and_then(Value::as_object_mut) {
            http.remove("base_url_env");
            http.insert("base_url".into(), Value::String(base_url.into()));
            v["retry"]["attempt_timeout_ms"] = Value::from(1000);
            edit(&mut v);
        }
        std::fs::write(out.join(name), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    }
    out
}

/// A ledger with the demo world whose tools run behind a served provider.
pub struct HttpFixture {
    /// Kept for the fixture's lifetime: the directory goes on drop.
    _dir: TempDir,
    pub server: ProviderServer,
    pub catalog: PathBuf,
    pub ledger: PathBuf,
    pub clock: ManualClock,
    /// The PostgreSQL database of the ledger, when it is there.
    _pg: Option<crate::support::PgDb>,
}

impl HttpFixture {
    pub fn new() -> Self {
        Self::with(&[], None)
    }

    pub fn with(server_args: &[&str], secret_file: Option<&Path>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let server = ProviderServer::start(dir.path(), server_args);
        let catalog = write_catalog(dir.path(), &server.url(), secret_file);
        Self::finish(dir, server, catalog)
    }

    /// With a change to each http tool's whole catalog file, the ledger on
    /// the given backend.
    pub fn with_catalog_on(backend: crate::support::Backend, edit: &dyn Fn(&mut Value)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let server = ProviderServer::start(dir.path(), &[]);
        let catalog = write_catalog_edited(dir.path(), &server.url(), edit);
        Self::finish_on(backend, dir, server, catalog)
    }

    /// With a change to each tool's `downstream.http` section.
    pub fn with_http(edit: &dyn Fn(&mut serde_json::Map<String, Value>)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let server = ProviderServer::start(dir.path(), &[]);
        let catalog = write_catalog_with(dir.path(), &server.url(), edit);
        Self::finish(dir, server, catalog)
    }

    fn finish(dir: TempDir, server: ProviderServer, catalog: PathBuf) -> Self {
        Self::finish_on(crate::support::Backend::Sqlite, dir, server, catalog)
    }

    fn finish_on(backend: crate::support::Backend, dir: TempDir, server: ProviderServer, catalog: PathBuf) -> Self {
        let (pg, ledger) = match backend {
            crate::support::Backend::Sqlite => (None, dir.path().join("ledger.db")),
            crate::support::Backend::Postgres => {
                let db = crate::support::PgDb::new().expect("TOOLGATE_TEST_PG is set");
                let url = PathBuf::from(&db.url);
                (Some(db), url)
            }
        };
        let clock = ManualClock::new(T0);
        let fx = Self { _dir: dir, server, catalog, ledger, clock, _pg: pg };
        let mut e = Engine::create(&fx.ledger, fx.opts()).unwrap();
        e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
        fx
    }

    pub fn opts(&self) -> EngineOptions {
        EngineOptions {
            clock: Arc::new(self.clock.clone()),
            worker_id: "w-http".into(),
            ..EngineOptions::new(toolgate::tools::load_toolset(Some(&self.catalog)).unwrap())
        }
    }

    pub fn engine(&self) -> Engine {
        Engine::open(&self.ledger, self.opts()).unwrap()
    }
}

/// The state of the newest operation.
fn state(e: &mut Engine) -> String {
    e.list_operations(None, 1).unwrap()[0].state.to_string()
}

/// Waits (bounded) until the provider holds `n` effects: an effect that lands
/// after the reply was lost.
fn wait_for_effects(server: &ProviderServer, n: i64) {
    for _ in 0..200 {
        if server.effects() >= n {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    panic!("the provider never reached {n} effects");
}

#[test]
fn a_committed_reply_succeeds_once_and_a_retry_replays_it() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let first = e.dispatch(&refund("http-ok-000001", 1500)).unwrap();
    assert_eq!(first.model_result.status, Status::Succeeded, "{first:?}");
    let again = e.dispatch(&refund("http-ok-000001", 1500)).unwrap();
    assert_eq!(again.model_result.data, first.model_result.data);
    assert_eq!(fx.server.effects(), 1);
    assert_eq!(
        toolgate::tools::demo::orders(&mut e)
            .unwrap()
            .iter()
            .find(|o| o.order_ref == "ord_1001")
            .unwrap()
            .refunded_minor,
        1500
    );
    assert!(e.audit().unwrap().is_empty(), "the audit looks the effect up over HTTP and finds it");
}

#[test]
fn a_refused_connection_is_provably_not_received_and_retried() {
    // A port nobody listens on: bind, note it, close it.
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog(dir.path(), &format!("http://127.0.0.1:{port}"), None);
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = || EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&refund("http-refused-01", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    assert!(env.model_result.error.as_ref().unwrap().retry_after_ms.is_some());
    let op = &e.list_operations(None, 1).unwrap()[0];
    assert_eq!(op.state, "accepted", "nothing was sent, so it may run again");
    let detail = e.operation_detail(&op.id).unwrap().unwrap();
    assert!(
        detail
            .attempts
            .iter()
            .all(|a| a.outcome == Some(toolgate::store::AttemptOutcome::Refused) && a.proven_not_received()),
        "{:?}",
        detail.attempts
    );
    assert_eq!(detail.attempts.len(), 5, "retried up to the attempt cap");
}

#[test]
fn a_reply_slower_than_the_attempt_timeout_is_unknown_until_a_query_finds_it() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-slow-00001", 1500), "latency(2000)");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e), "unknown");
    // The provider goes on and commits after the client gave up.
    wait_for_effects(&fx.server, 1);
    let q = e.query_operation_status(&query_req(&env, "q-slow")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
    assert_eq!(fx.server.effects(), 1);
}

#[test]
fn a_connection_dropped_after_commit_is_unknown_and_a_status_query_settles_it() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-drop-00001", 1500), "drop_after_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(fx.server.effects(), 1);
    // A retry with the same key never re-sends: it reports the unknown.
    let retry = e.dispatch(&refund("http-drop-00001", 1500)).unwrap();
    assert_eq!(retry.code(), Some(Code::OutcomeUnknown));
    assert_eq!(fx.server.effects(), 1);
    let q = e.query_operation_status(&query_req(&env, "q-drop")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
    assert_eq!(fx.server.duplicates(), 0);
}

#[test]
fn a_429_with_retry_after_is_rate_limit_with_retry_after_ms() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let mut req = refund("http-429-000001", 1500);
    req.deadline_ms = Some(1_500);
    let env = dispatch_with(&mut e, &req, "rate_limit(3000)");
    assert_eq!(env.code(), Some(Code::RateLimit), "{env:?}");
    assert_eq!(env.model_result.error.as_ref().unwrap().retry_after_ms, Some(3000), "Retry-After: 3 (seconds)");
    assert_eq!(state(&mut e), "accepted");
    assert_eq!(fx.server.effects(), 0);
}

#[test]
fn a_503_is_retried_and_then_succeeds() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-503-000001", 1500), "unavailable,unavailable");
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    let op = e.list_operations(None, 1).unwrap()[0].id.clone();
    assert_eq!(e.operation_detail(&op).unwrap().unwrap().attempts.len(), 3);
    assert_eq!(fx.server.effects(), 1);
}

#[test]
fn a_409_same_key_in_progress_is_unknown_with_retry_after_and_never_resent() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-409-000001", 1500), "in_progress(2000)");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(env.model_result.error.as_ref().unwrap().retry_after_ms, Some(2000));
    assert_eq!(state(&mut e), "unknown");
    // Nothing there yet: the query says so and the operation stays unknown.
    let q = e.query_operation_status(&query_req(&env, "q-409")).unwrap();
    assert_eq!(q.code(), Some(Code::OutcomeUnknown));
    assert_eq!(fx.server.effects(), 0);
}

#[test]
fn another_4xx_is_a_definitive_failure_with_no_effect() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-400-000001", 1500), "reject(card_declined)");
    assert_eq!(env.code(), Some(Code::BusinessRuleViolation), "{env:?}");
    assert_eq!(state(&mut e), "failed");
    assert_eq!(fx.server.effects(), 0);
}

#[test]
fn a_500_after_the_send_is_unknown_and_the_query_finds_the_effect() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-500-000001", 1500), "server_error_after_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e), "unknown");
    let q = e.query_operation_status(&query_req(&env, "q-500")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded);
    assert_eq!(fx.server.effects(), 1);
}

#[test]
fn a_2xx_that_breaks_the_output_contract_goes_to_human_review() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    for (key, fault) in [("http-bad-000001", "malformed_response"), ("http-bad-000002", "echo_credential(tok_x)")] {
        let env = dispatch_with(&mut e, &refund(key, 100), fault);
        assert_eq!(env.code(), Some(Code::OutputContractViolation), "{fault}: {env:?}");
        assert_eq!(state_of(&mut e, &env), "unknown", "{fault}");
    }
}

#[test]
fn a_hung_response_cannot_hold_the_worker_past_its_attempt_timeout() {
    // The server holds the request for 10 s and never commits; the attempt
    // timeout (1 s) ends the call and parks it as unknown.
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let started = std::time::Instant::now();
    let env = dispatch_with(&mut e, &refund("http-hang-00001", 1500), "timeout_before_commit");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    // Not a timing assertion of speed: only that it did not wait for the server's 10 s hold.
    assert!(started.elapsed() < std::time::Duration::from_secs(9));
    let q = e.query_operation_status(&query_req(&env, "q-hang")).unwrap();
    assert_eq!(q.code(), Some(Code::OutcomeUnknown), "not found yet: stays unknown");
    assert_eq!(fx.server.effects(), 0);
}

pub(crate) fn adapter_for(catalog: &Path, tool: &str) -> Box<dyn toolgate::downstream::Downstream> {
    let set = toolgate::tools::load_toolset(Some(catalog)).unwrap();
    let d = set.catalog().get(tool).unwrap().downstream.clone();
    let dir = tempfile::tempdir().unwrap();
    let ctx = DownstreamContext {
        ledger_path: &dir.path().join("unused.db"),
        clock: Arc::new(ManualClock::new(T0)) as Arc<dyn Clock>,
        faults: Arc::new(Mutex::new(FaultPlan::none())),
        sync: Sync::Normal,
        ids: toolgate::engine::ids::Ids::default(),
        read_only: false,
    };
    HttpAdapter.open(&d, &ctx).unwrap()
}

pub(crate) fn request(digest: &str) -> DownstreamRequest {
    DownstreamRequest {
        intent: format!("intent-{digest}"),
        tool: "create_refund".into(),
        arguments: serde_json::json!({"order_ref": "ord_1001", "amount_minor": 5, "currency": "EUR", "reason": "other"}),
        request_sha256: digest.into(),
        timeout_ms: 2_000,
    }
}

#[test]
fn a_key_reused_with_another_payload_is_a_422_key_conflict_and_status_conflict() {
    let fx = HttpFixture::new();
    let mut ds = adapter_for(&fx.catalog, "create_refund");
    assert!(matches!(ds.execute("dk-shared-key-1", &request("aaaa")).unwrap(), Reply::Committed(_)));
    assert_eq!(ds.execute("dk-shared-key-1", &request("bbbb")).unwrap(), Reply::KeyConflict);
    // The same payload again is the original effect, not a new one.
    assert!(matches!(ds.execute("dk-shared-key-1", &request("aaaa")).unwrap(), Reply::Committed(_)));
    assert_eq!(fx.server.effects(), 1);
}

#[test]
fn lookups_answer_found_not_found_and_unavailable() {
    let fx = HttpFixture::new();
    let mut ds = adapter_for(&fx.catalog, "create_refund");
    let Reply::Committed(r) = ds.execute("dk-lookup-0001", &request("cccc")).unwrap() else { panic!() };
    match ds.lookup("dk-lookup-0001", 2_000).unwrap() {
        Lookup::Found(found) => assert_eq!(found.receipt_id, r.receipt_id),
        other => panic!("{other:?}"),
    }
    assert_eq!(ds.lookup("dk-nothing-here", 2_000).unwrap(), Lookup::NotFound);
    assert_eq!(ds.lookup("dk-lookup-0001", 40).unwrap(), Lookup::Unavailable, "no time to ask: not asked");
    drop(fx.server);
    assert_eq!(ds.lookup("dk-lookup-0001", 2_000).unwrap(), Lookup::Unavailable);
}

/// A one-shot loopback listener that records the raw request and answers 503.
fn capture_one_request() -> (String, std::thread::JoinHandle<String>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        let mut buf = vec![0u8; 16 * 1024];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = s.read(&mut buf).unwrap_or(0);
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
        }
        let _ = s.write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        String::from_utf8_lossy(&got).into_owned()
    });
    (url, h)
}

/// The environment variable the secret-header test reads its second secret from.
const SECRET_ENV: &str = "TOOLGATE_TEST_PROVIDER_API_KEY";

/// Both secret sources on every tool: `Authorization` from a file and
/// `X-Api-Key` from [`SECRET_ENV`].
fn both_secret_sources(file: &Path) -> impl Fn(&mut serde_json::Map<String, Value>) + '_ {
    move |http| {
        http.insert(
            "secret_headers".into(),
            serde_json::json!([
                {"header": "Authorization", "file": file, "prefix": "Bearer "},
                {"header": "X-Api-Key", "env": SECRET_ENV}
            ]),
        );
    }
}

#[test]
fn secret_headers_from_a_file_and_the_environment_are_sent_and_never_stored_traced_or_logged() {
    const FILE_SECRET: &str = "sk_live_canary_5f1d3c9e";
    const ENV_SECRET: &str = "ak_live_canary_env_93b0e7d2";
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("provider.token");
    std::fs::write(&secret_file, format!("{FILE_SECRET}\n")).unwrap();
    // Every child gets the variable; this process never sets it.
    let toolgate = |db: &Path, catalog: &Path, log: &Path, args: &[&str]| {
        let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(db)
            .arg("--catalog")
            .arg(catalog)
            .args(args)
            .env(SECRET_ENV, ENV_SECRET)
            .env("TOOLGATE_LOG", log)
            .env_remove("TOOLGATE_LOG_LEVEL")
            .output()
            .unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let dispatch = |key: &str, fault: &str| -> Vec<String> {
        [
            "dispatch",
            "--tenant",
            "acme",
            "--subject",
            "agent_ana",
            "--tool",
            "create_refund",
            "--key",
            key,
            "--fault",
            fault,
            "--args",
            r#"{"order_ref":"ord_1001","amount_minor":10,"currency":"EUR","reason":"other"}"#,
        ]
        .iter()
        .map(|s| (*s).to_string())
        .collect()
    };
    fn strs(v: &[String]) -> Vec<&str> {
        v.iter().map(String::as_str).collect()
    }

    // On the wire: the captured request carries both, and the catalog neither.
    let (url, captured) = capture_one_request();
    let wire = tempfile::tempdir().unwrap();
    let catalog = write_catalog_with(wire.path(), &url, &both_secret_sources(&secret_file));
    let (db, log) = (wire.path().join("l.db"), wire.path().join("l.log"));
    toolgate(&db, &catalog, &log, &["init"]);
    let seen = toolgate(&db, &catalog, &log, &strs(&dispatch("dk-secret-wire-1", "ok")));
    let head = captured.join().unwrap();
    assert!(head.contains(&format!("authorization: Bearer {FILE_SECRET}")), "{head}");
    assert!(head.contains(&format!("x-api-key: {ENV_SECRET}")), "{head}");
    assert!(head.contains("idempotency-key: dk"), "{head}");
    assert!(seen.contains("TOOL_UNAVAILABLE"), "{seen}");
    for f in ["create_refund.json", "notify_customer.json"] {
        let text = std::fs::read_to_string(catalog.join(f)).unwrap();
        assert!(!text.contains(FILE_SECRET) && !text.contains(ENV_SECRET), "{f}");
    }

    // Through the whole CLI against a served provider: in no table, trace
    // export, metric, operator log, log file or output.
    // (Set up through the CLI too: this process does not have the variable.)
    let home = tempfile::tempdir().unwrap();
    let server = ProviderServer::start(home.path(), &[]);
    let catalog = write_catalog_with(home.path(), &server.url(), &both_secret_sources(&secret_file));
    let (ledger, log) = (home.path().join("ledger.db"), home.path().join("toolgate.log"));
    let run = |args: &[&str]| toolgate(&ledger, &catalog, &log, args);
    let mut outputs: Vec<(String, String)> = vec![("init".into(), run(&["init"]))];
    for (key, fault) in [("canary-ok-key-01", "ok"), ("canary-echo-key-1", "echo_header(x)")] {
        outputs.push((format!("dispatch {fault}"), run(&strs(&dispatch(key, fault)))));
    }
    // A lost reply, settled by a status query: a lookup that carries the secrets too.
    let mut lost = dispatch("canary-drop-key-1", "drop_after_commit");
    lost.push("--json".into());
    let lost = run(&strs(&lost));
    outputs.push(("dispatch drop_after_commit".into(), lost.clone()));
    let env: Value = serde_json::Deserializer::from_str(&lost)
        .into_iter()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("{lost}"));
    let query = run(&[
        "query",
        "--tenant",
        "acme",
        "--subject",
        "agent_ana",
        "--status-ref",
        env["protected_audit"]["downstream"]["status_ref"].as_str().unwrap(),
        "--expect-sha256",
        env["protected_audit"]["binding"]["request_sha256"].as_str().unwrap(),
        "--json",
    ]);
    outputs.push(("query".into(), query));
    let list = run(&["ops", "list", "--json"]);
    let list: Value = serde_json::from_str(&list).unwrap_or_else(|_| panic!("{list}"));
    let ops: Vec<String> =
        list["operations"].as_array().unwrap().iter().map(|o| o["id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ops.len(), 3, "{ops:?}");
    for op in &ops {
        outputs.push((format!("ops show {op}"), run(&["ops", "show", op])));
        outputs.push((format!("ops show {op} --json"), run(&["ops", "show", op, "--json"])));
    }
    for args in [
        &["trace", "--format", "jsonl"][..],
        &["trace"],
        &["metrics"],
        &["metrics", "--format", "json"],
        &["audit", "--log", "--json"],
        &["audit"],
        &["ops", "list"],
        &["counts"],
    ] {
        outputs.push((args.join(" "), run(args)));
    }
    outputs.push(("log".into(), std::fs::read_to_string(&log).unwrap()));
    for (what, text) in &outputs {
        for secret in [FILE_SECRET, ENV_SECRET] {
            assert!(!text.contains(secret), "{what} leaks a secret:\n{text}");
        }
    }
    for db in [&ledger, &server.db] {
        let cells = crate::observability::every_cell(db);
        let leaks: Vec<&String> =
            cells.iter().filter(|(_, v)| v.contains(FILE_SECRET) || v.contains(ENV_SECRET)).map(|(c, _)| c).collect();
        assert!(leaks.is_empty(), "{}: a secret is stored in {leaks:?}", db.display());
    }
    let mut files = vec![log.clone()];
    for db in [&ledger, &server.db] {
        files.extend(["db", "db-wal", "db-shm", "db.log"].iter().map(|x| db.with_extension(x)));
    }
    for f in files {
        if let Ok(bytes) = std::fs::read(&f) {
            let text = String::from_utf8_lossy(&bytes);
            assert!(!text.contains(FILE_SECRET) && !text.contains(ENV_SECRET), "{} holds a secret", f.display());
        }
    }
    // Controls: the scans saw real content.
    let text = |w: &str| &outputs.iter().find(|(what, _)| what == w).unwrap().1;
    assert!(text("init").contains("initialized"), "{}", text("init"));
    assert!(text("dispatch ok").contains("succeeded"), "{}", text("dispatch ok"));
    assert!(text("dispatch drop_after_commit").contains("OUTCOME_UNKNOWN"), "{}", text("dispatch drop_after_commit"));
    assert!(text("query").contains("receipt_reconciled"), "{}", text("query"));
    assert!(ops.iter().all(|op| text("trace --format jsonl").contains(op.as_str())));
    assert!(text("log").contains("answered"), "the CLI's dispatches are in the log");
    assert!(crate::observability::every_cell(&ledger)
        .iter()
        .any(|(c, v)| c == "operations.request_json" && v.contains("ord_1001")));
    assert!(crate::observability::every_cell(&server.db).iter().any(|(c, _)| c.starts_with("provider_effects.")));
}

#[test]
fn a_missing_secret_or_base_url_is_a_setup_error_naming_the_variable_not_a_value() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("l.db");
    let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
        .args(["init", "--catalog", "assets/catalog-http", "--db"])
        .arg(&ledger)
        .env_remove("TOOLGATE_PROVIDER_URL")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("error[DOWNSTREAM_SETUP]") && err.contains("TOOLGATE_PROVIDER_URL"), "{err}");
}

#[test]
fn the_provider_server_refuses_a_public_address_unless_told() {
    let dir = tempfile::tempdir().unwrap();
    // A non-loopback address no interface here holds (TEST-NET-1, RFC 5737):
    // were the refusal ever lost, binding it fails instead of listening
    // beyond this machine.
    let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
        .args(["provider", "serve", "--listen", "192.0.2.1:0", "--provider-db"])
        .arg(dir.path().join("p.db"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("error[NOT_LOOPBACK]"));
}

#[test]
fn provider_serve_takes_its_database_as_db_and_still_as_provider_db() {
    // `--db` (the documented name) is what every other test's server uses;
    // `--provider-db` is kept for scripts written against earlier versions.
    // An accepted form starts serving on loopback (and is stopped); a refused
    // one exits 2 before it listens.
    let dir = tempfile::tempdir().unwrap();
    let serve = |args: &[&str]| {
        Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .args(["provider", "serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("TOOLGATE_DB")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (dir.path().join("a.db"), dir.path().join("b.db"));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    for args in [vec!["--db", a], vec!["--provider-db", a], vec!["--db", a, "--provider-db", a]] {
        let mut child = serve(&args);
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert!(line.starts_with("listening on 127.0.0.1:"), "{args:?}: {line:?}");
    }
    for (args, code) in [
        (vec!["--db", a, "--provider-db", b], "USAGE"),
        (vec![], "DB_REQUIRED"),
        (vec!["--db", "postgres://u@127.0.0.1/p"], "USAGE"),
    ] {
        let out = serve(&args).wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(&format!("error[{code}]")), "{args:?}: {err}");
    }
    assert!(!dir.path().join("b.db").exists());
}

#[test]
fn the_provider_server_answers_bad_requests_with_stable_codes() {
    let dir = tempfile::tempdir().unwrap();
    let server = ProviderServer::start(dir.path(), &[]);
    let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let post = |path: &str, key: Option<&str>, body: &[u8]| {
        let mut r = agent.post(&format!("{}{path}", server.url())).header("content-type", "application/json");
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        let mut resp = r.send(body).unwrap();
        (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap())
    };
    assert_eq!(post("/v1/payments/calls", None, b"{}").0, 400, "payments needs a key");
    assert_eq!(
        post("/v1/payments/calls", Some("k1"), b"{\"a\":1,\"a\":2}"),
        (400, r#"{"error":"body_not_json"}"#.into())
    );
    assert_eq!(post("/v1/payments/calls", Some("k1"), &vec![b' '; 70 * 1024]).0, 413);
    assert_eq!(post("/v1/nope/calls", Some("k1"), b"{}").0, 404);
    assert_eq!(server.effects(), 0);
}

#[test]
fn the_catalog_is_loaded_strictly_and_a_refusal_writes_nothing() {
    let base: Value = serde_json::from_str(include_str!("../../assets/catalog/create_refund.json")).unwrap();
    type Change = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Change, &str)> = vec![
        ("unknown field", Box::new(|v| v["colour"] = "blue".into()), "field colour"),
        (
            "write without dedupe",
            Box::new(|v| v["downstream"]["dedupes_keys"] = false.into()),
            "field downstream.dedupes_keys",
        ),
        ("external claiming dedupe", Box::new(|v| v["effect"] = "external".into()), "field downstream.dedupes_keys"),
        ("bad schema", Box::new(|v| v["input_schema"]["type"] = 7.into()), "field input_schema"),
        ("unknown adapter", Box::new(|v| v["downstream"]["adapter"] = "smtp".into()), "field downstream.adapter"),
        (
            "http key header missing",
            Box::new(|v| {
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": true, "http": {
                    "base_url": "http://127.0.0.1:1", "key_header": "",
                    "execute": {"method": "POST", "path": "/x"}, "lookup": {"method": "GET", "path": "/x/{key}"},
                    "reply": {"receipt_id": "/id"}}});
            }),
            "field downstream.dedupes_keys",
        ),
        (
            "a lookup whose receipt nothing binds",
            Box::new(|v| {
                v["result_echoes"] = serde_json::json!([]);
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": true, "http": {
                    "base_url": "http://127.0.0.1:1",
                    "execute": {"method": "POST", "path": "/x"}, "lookup": {"method": "GET", "path": "/x/{key}"},
                    "reply": {"receipt_id": "/receipt_id", "result": "/result"}}});
            }),
            "field downstream.http.reply",
        ),
        (
            "an http section that says nothing of a lookup",
            Box::new(|v| {
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": true, "http": {
                    "base_url": "http://127.0.0.1:1", "execute": {"method": "POST", "path": "/x"},
                    "reply": {"receipt_id": "/id", "key": "/key"}}});
            }),
            "field downstream.http.lookup",
        ),
        (
            "a lookup by a key that is never sent",
            Box::new(|v| {
                v["effect"] = "external".into();
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": false, "http": {
                    "base_url": "http://127.0.0.1:1", "key_header": "",
                    "execute": {"method": "POST", "path": "/x"}, "lookup": {"method": "GET", "path": "/x/{key}"},
                    "reply": {"receipt_id": "/id", "key": "/key"}}});
            }),
            "field downstream.http.lookup",
        ),
        (
            "a path placeholder that is never filled in",
            Box::new(|v| {
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": true, "http": {
                    "base_url": "http://127.0.0.1:1",
                    "execute": {"method": "POST", "path": "/orders/{order_ref}/refunds"}, "lookup": {"method": "GET", "path": "/x/{key}"},
                    "reply": {"receipt_id": "/id", "key": "/key"}}});
            }),
            "field downstream.http.execute.path",
        ),
        (
            "a lookup path with a second placeholder",
            Box::new(|v| {
                v["downstream"] = serde_json::json!({"name": "payments", "adapter": "http", "dedupes_keys": true, "http": {
                    "base_url": "http://127.0.0.1:1",
                    "execute": {"method": "POST", "path": "/x"}, "lookup": {"method": "GET", "path": "/x/{key}/{tenant}"},
                    "reply": {"receipt_id": "/id", "key": "/key"}}});
            }),
            "field downstream.http.lookup.path",
        ),
        (
            "a receipt window longer than a day",
            Box::new(|v| v["downstream"]["receipt_visible_within_ms"] = 86_400_001.into()),
            "field downstream.receipt_visible_within_ms",
        ),
        (
            "an argument named like toolgate's MCP key argument",
            Box::new(|v| v["input_schema"]["properties"]["idempotency_key"] = serde_json::json!({"type": "string"})),
            "field input_schema.properties.idempotency_key",
        ),
        ("bad revision", Box::new(|v| v["revisions"]["output"] = 0.into()), "field revisions"),
        ("unknown echo", Box::new(|v| v["result_echoes"] = serde_json::json!(["nope"])), "field result_echoes[0]"),
    ];
    for (what, change, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        let cat = dir.path().join("cat");
        std::fs::create_dir(&cat).unwrap();
        let mut v = base.clone();
        change(&mut v);
        std::fs::write(cat.join("create_refund.json"), v.to_string()).unwrap();
        std::fs::write(cat.join("get_order.json"), include_str!("../../assets/catalog/get_order.json")).unwrap();
        let ledger = dir.path().join("l.db");
        let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .args(["init", "--catalog"])
            .arg(&cat)
            .arg("--db")
            .arg(&ledger)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{what}: {err}");
        assert!(err.starts_with("error[CATALOG_INVALID]: catalog file create_refund.json"), "{what}: {err}");
        assert!(err.contains(expect), "{what}: {err}");
        assert!(!err.contains(&*dir.path().to_string_lossy()), "{what}: no local path: {err}");
        assert!(!ledger.exists(), "{what}: nothing written");
    }
    // Two files with one name.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.json"), base.to_string()).unwrap();
    std::fs::write(dir.path().join("b.json"), base.to_string()).unwrap();
    let err = toolgate::engine::contracts::Contracts::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("catalog file b.json, field name: duplicate tool name create_refund"), "{err}");
}

#[test]
fn a_new_revision_in_the_catalog_changes_new_digests_and_never_replays_the_old_result() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let first = e.dispatch(&refund("http-rev-000001", 700)).unwrap();
    assert_eq!(first.model_result.status, Status::Succeeded);
    // The catalog's output revision moves on (a new file set on disk).
    let path = fx.catalog.join("create_refund.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["revisions"]["output"] = 2.into();
    std::fs::write(&path, v.to_string()).unwrap();
    let mut e2 = fx.engine();
    // The model's retry carries a new call id; the key is the same.
    let retry =
        toolgate::engine::DispatchRequest { call: Some(call("call-rev-retry")), ..refund("http-rev-000001", 700) };
    let again = e2.dispatch(&retry).unwrap();
    assert_ne!(
        again.protected_audit.binding.request_sha256, first.protected_audit.binding.request_sha256,
        "the revision is part of the request digest"
    );
    assert_ne!(again.model_result.data, first.model_result.data, "never replayed as the new contract's result");
    assert_eq!(again.code(), Some(Code::IdempotencyConflict), "{again:?}");
    let fresh = e2.dispatch(&refund("http-rev-000002", 700)).unwrap();
    assert_eq!(fresh.model_result.status, Status::Succeeded);
    assert_eq!(fx.server.effects(), 2);
}

#[test]
fn the_load_generator_with_the_shipped_http_catalog_reports_no_duplicate_and_no_silently_wrong_result() {
    // The shipped assets/catalog-http as it is (its base URL from
    // TOOLGATE_PROVIDER_URL, its own 5 s attempt timeout), against a served
    // provider. Random faults (10%) travel to the provider as headers; the
    // referee counts the effects in the provider's own database.
    let dir = tempfile::tempdir().unwrap();
    let server = ProviderServer::start(dir.path(), &[]);
    let ledger = dir.path().join("ledger.db");
    let catalog = Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/catalog-http");
    let toolgate = |args: &[&str]| {
        Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(&ledger)
            .arg("--catalog")
            .arg(&catalog)
            .args(args)
            .env("TOOLGATE_PROVIDER_URL", server.url())
            .output()
            .unwrap()
    };
    let init = toolgate(&["init"]);
    assert_eq!(init.status.code(), Some(0), "{}", String::from_utf8_lossy(&init.stderr));
    let db = server.db.to_string_lossy().into_owned();
    let out = toolgate(&[
        "load",
        "--agents",
        "3",
        "--ops",
        "60",
        "--fault-rate",
        "10%",
        "--seed",
        "3",
        "--json",
        "--provider-db",
        &db,
    ]);
    let report: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(out.status.code(), Some(0), "{report}");
    assert_eq!(report["duplicates"], 0, "{report}");
    assert_eq!(report["silently_wrong"], 0, "{report}");
    assert!(report["effects"].as_i64().unwrap() > 0, "{report}");
    assert_eq!(report["effects"].as_i64().unwrap(), server.effects(), "counted at the provider: {report}");
    assert_eq!(server.duplicates(), 0);
    // The faults did reach the provider: some calls were refused and retried,
    // or lost their reply.
    let trace = toolgate(&["trace", "--format", "jsonl"]);
    let trace = String::from_utf8_lossy(&trace.stdout);
    let faulted = trace
        .lines()
        .filter(|l| l.contains(r#""reason":"retry_scheduled""#) || l.contains(r#""reason":"parked_unknown""#))
        .count();
    assert!(faulted > 0, "no call met a fault: {report}");
}

/// Whether a scenario holds a call inside the provider while later steps run
/// (an `in_background` dispatch or approval).
fn holds_a_call_in_the_provider(s: &toolgate::scenarios::Script) -> bool {
    use toolgate::scenarios::Action;
    s.steps.iter().any(|st| match &st.action {
        Action::Dispatch(c) => c.in_background,
        Action::Approve { in_background, .. } => *in_background,
        _ => false,
    })
}

/// The scenarios with `create_refund` and `notify_customer` behind a served
/// provider, one provider per scenario (the expectations count its effects),
/// every step as expected.
///
/// A served provider keeps real time; the scenario's manual clock moves its
/// receipts' visibility with it (scenario 4's late receipt shows a scenario
/// minute later). Skipped: the scenarios that hold a call inside the provider
/// while later steps run (9: a duplicate while the first call is in flight;
/// 11: a reply after the lease was taken back). In process, the scenario's
/// gate parks the call in the provider's `latency` wait, which runs on the
/// scenario's clock, and lets it go when the script says. Over HTTP that wait
/// is a real sleep in another process, and the call a real socket read that
/// the adapter's real-time attempt timeout ends: nothing on the scenario's
/// clock can hold it, the steps in between would race the provider's real
/// latency, and scenario 9's `elapsed_ms` (scenario time) could not hold. What
/// those two scenarios check is checked over HTTP, with the call held by a
/// loopback server until the test lets it go, by
/// `a_duplicate_while_the_first_call_is_in_flight_over_http_is_unknown_and_never_sent` and
/// `a_reply_after_the_lease_was_taken_back_over_http_is_evidence_not_a_state_change`;
/// they run in process in `scenarios::`. The skip is derived from the
/// scripts, and must be exactly 9, 11 and 12: a new scenario that holds a
/// call cannot be skipped here unnoticed. Scenario 12 (two agents refund the
/// last 10 € at once) holds one refund in the provider while the other is
/// refused at accept: the hold is written and read in the ledger's accept
/// transaction, which is the same whatever adapter sends the call; its race is
/// run with real threads on both backends by `holds::`.
#[test]
fn the_scenarios_run_with_the_providers_behind_http() {
    use toolgate::scenarios::{self, report, CrashMode, HttpProviders, RunOptions, ScenarioRun};
    let all = scenarios::builtin().unwrap();
    let skipped: Vec<u32> = all.iter().filter(|s| holds_a_call_in_the_provider(s)).map(|s| s.id).collect();
    assert_eq!(skipped, [9, 11, 12], "scenarios that hold a call in the provider");
    let mut failed = Vec::new();
    let mut ran = 0;
    for s in all.iter().filter(|s| !skipped.contains(&s.id)) {
        let fx = HttpFixture::new();
        let opts = RunOptions {
            crash_mode: CrashMode::ChildProcess(PathBuf::from(env!("CARGO_BIN_EXE_toolgate"))),
            keep_db: None,
            http: Some(HttpProviders { catalog: fx.catalog.clone(), provider_db: fx.server.db.clone() }),
        };
        let r = ScenarioRun::run(s, opts).unwrap();
        if r.steps.iter().any(|o| !o.passed) || r.steps.len() != r.total_steps {
            failed.push(report::render(&r));
        }
        assert_eq!(fx.server.duplicates(), 0, "scenario {}", s.id);
        ran += 1;
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert_eq!(ran, all.len() - skipped.len());
}

#[test]
fn an_attempt_with_almost_no_time_left_is_not_sent_at_all() {
    // Under 100 ms left of the deadline: provably not received, because nothing
    // is sent (a connect racing the whole-call deadline could not say which
    // stage it died in, and would have to count as possibly received).
    let fx = HttpFixture::new();
    let mut ds = adapter_for(&fx.catalog, "create_refund");
    let mut r = request("eeee");
    r.timeout_ms = 40;
    assert_eq!(ds.execute("dk-no-time-0001", &r).unwrap(), Reply::ConnectTimeout);
    assert_eq!(fx.server.effects(), 0);
}

/// The operation's row, its attempts and its trace.
fn detail(e: &mut Engine) -> toolgate::engine::OperationDetail {
    let id = e.list_operations(None, 1).unwrap()[0].id.clone();
    e.operation_detail(&id).unwrap().unwrap()
}

/// The state of the operation an envelope is about (several operations can
/// share one instant of the manual clock, so "the newest" would be ambiguous).
fn state_of(e: &mut Engine, env: &toolgate::engine::envelope::Envelope) -> String {
    let id = env.protected_audit.operation_id.clone().unwrap();
    e.operation_detail(&id).unwrap().unwrap().operation.state.to_string()
}

/// Every attempt was refused before anything was sent.
fn all_proven_not_received(d: &toolgate::engine::OperationDetail) -> bool {
    !d.attempts.is_empty()
        && d.attempts
            .iter()
            .all(|a| a.outcome == Some(toolgate::store::AttemptOutcome::Refused) && a.proven_not_received())
}

#[test]
fn a_422_key_reused_with_another_payload_ends_as_status_conflict_in_needs_review() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    // Five 503s: provably not sent, the operation waits as accepted under its downstream key.
    let env = dispatch_with(&mut e, &refund("http-422-000001", 1500), &["unavailable"; 5].join(","));
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "accepted");
    // Meanwhile the provider committed another request under that very key.
    let mut ds = adapter_for(&fx.catalog, "create_refund");
    assert!(matches!(ds.execute(&d.operation.downstream_key, &request("ffff")).unwrap(), Reply::Committed(_)));
    // The retry is due: the engine sends again under the same key and the provider answers 422.
    fx.clock.advance(60_000);
    let again = e.dispatch(&refund("http-422-000001", 1500)).unwrap();
    assert_eq!(again.code(), Some(Code::StatusConflict), "{again:?}");
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "needs_review");
    let last = d.attempts.last().unwrap();
    assert_eq!(last.outcome, Some(toolgate::store::AttemptOutcome::Unknown));
    // Never re-sent: a retry answers the conflict from the ledger.
    let third = e.dispatch(&refund("http-422-000001", 1500)).unwrap();
    assert_eq!(third.code(), Some(Code::StatusConflict), "{third:?}");
    assert_eq!(detail(&mut e).attempts.len(), d.attempts.len());
    assert_eq!(fx.server.effects(), 1, "only the other request's effect");
}

#[test]
fn a_5xx_that_the_catalog_says_means_not_committed_is_tool_unavailable_and_stays_accepted() {
    // `server_error`: a 500 with nothing committed.
    let faults = ["server_error"; 5].join(",");
    let fx = HttpFixture::with_http(&|http| {
        http.insert("server_error_means_not_committed".into(), Value::Bool(true));
    });
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-5xx-nc-0001", 1500), &faults);
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    assert!(env.model_result.error.as_ref().unwrap().retryable, "{env:?}");
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "accepted");
    assert!(all_proven_not_received(&d), "{:?}", d.attempts);
    assert_eq!(d.attempts.len(), 5, "retried up to the attempt cap");
    assert_eq!(fx.server.effects(), 0);
    // It runs again when retried, and then succeeds once.
    fx.clock.advance(60_000);
    let ok = e.dispatch(&refund("http-5xx-nc-0001", 1500)).unwrap();
    assert_eq!(ok.model_result.status, Status::Succeeded, "{ok:?}");
    assert_eq!(fx.server.effects(), 1);

    // Control: the same 500 without that statement may have committed.
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let env = dispatch_with(&mut e, &refund("http-5xx-nc-0002", 1500), &faults);
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state(&mut e), "unknown");
    assert_eq!(detail(&mut e).attempts.len(), 1, "never re-sent");
}

#[test]
fn a_503_with_retry_after_is_tool_unavailable_with_retry_after_ms() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    let mut req = refund("http-503-ra-0001", 1500);
    req.deadline_ms = Some(1_500);
    let env = dispatch_with(&mut e, &req, "unavailable(3000)");
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    assert_eq!(env.model_result.error.as_ref().unwrap().retry_after_ms, Some(3000), "Retry-After: 3 (seconds)");
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "accepted");
    assert!(all_proven_not_received(&d), "{:?}", d.attempts);
    assert_eq!(fx.server.effects(), 0);
}

#[test]
fn a_retry_after_given_as_an_http_date_is_honoured() {
    // The provider writes Retry-After as an IMF-fixdate 30 s ahead (rounded up
    // to the second); the wait the caller is told is what is left of it.
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    for (key, fault, code) in [
        ("http-date-503-01", "unavailable(30000,date)", Code::ToolUnavailable),
        ("http-date-429-01", "rate_limit(30000,date)", Code::RateLimit),
    ] {
        let mut req = refund(key, 1500);
        req.deadline_ms = Some(1_500);
        let env = dispatch_with(&mut e, &req, fault);
        assert_eq!(env.code(), Some(code), "{fault}: {env:?}");
        let ms = env.model_result.error.as_ref().unwrap().retry_after_ms.unwrap();
        // Seconds of slack for a slow machine; a date that was not understood
        // would leave only the engine's own backoff (at most 5 s in this catalog).
        assert!((20_000..=31_000).contains(&ms), "{fault}: retry_after_ms {ms}");
        assert_eq!(state_of(&mut e, &env), "accepted", "{fault}");
    }
    assert_eq!(fx.server.effects(), 0);
}

/// A loopback listener whose accept queue is full and never drained: a new
/// connect gets no answer at all (Linux drops the SYN), as behind a
/// black-holing firewall. Returns the runtime that owns the socket, the
/// listener, the connections that fill its queue and its address.
fn a_listener_that_never_accepts(
) -> (tokio::runtime::Runtime, tokio::net::TcpListener, Vec<std::net::TcpStream>, std::net::SocketAddr) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let _guard = rt.enter();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..64 {
        match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(300)) {
            Ok(s) => fillers.push(s),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return (rt, listener, fillers, addr),
            Err(e) => panic!("filling the accept queue: {e}"),
        }
    }
    panic!("the accept queue never filled: connects to a full queue are not dropped on this system");
}

#[test]
fn a_connect_that_times_out_is_timeout_before_execute_and_nothing_arrives() {
    let (rt, listener, fillers, addr) = a_listener_that_never_accepts();
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog(dir.path(), &format!("http://{addr}"), None);
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = || EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let started = std::time::Instant::now();
    let env = e.dispatch(&refund("http-cto-000001", 1500)).unwrap();
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "the connect timeout ended each attempt");
    assert_eq!(env.code(), Some(Code::TimeoutBeforeExecute), "{env:?}");
    assert!(env.model_result.error.as_ref().unwrap().retryable);
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "accepted", "nothing was sent, so it may run again");
    assert!(all_proven_not_received(&d), "{:?}", d.attempts);
    // The proof on the server's side: the only connections that ever got
    // through are the ones that filled the queue, and none carries a request.
    let accepted = rt.block_on(async {
        let mut n = 0;
        while let Ok(Ok((mut s, _))) =
            tokio::time::timeout(std::time::Duration::from_millis(200), listener.accept()).await
        {
            let mut buf = [0u8; 64];
            let read = tokio::time::timeout(std::time::Duration::from_millis(100), async {
                tokio::io::AsyncReadExt::read(&mut s, &mut buf).await
            })
            .await;
            assert!(!matches!(read, Ok(Ok(k)) if k > 0), "a request arrived: {:?}", String::from_utf8_lossy(&buf));
            n += 1;
        }
        n
    });
    assert_eq!(accepted, fillers.len());
}

/// What a scripted loopback server does with one connection, in order.
#[derive(Clone)]
enum Then {
    /// Reads the request, then closes the connection with no reply.
    Close,
    /// Reads the request and answers this status with an empty body.
    Status(u16),
    /// Reads the request and never answers (until the server is dropped).
    Hold,
    /// Reads the request and answers with the next reply the test gives
    /// ([`Scripted::reply`]), holding the call until then.
    Answer,
    /// Reads the request and writes this whole response.
    Raw(String),
}

/// A loopback server that treats each connection as its script says and
/// records each request line. Held connections are let go on drop.
struct Scripted {
    url: String,
    /// Each request's head and body.
    seen: Arc<Mutex<Vec<(String, String)>>>,
    stop: Option<std::sync::mpsc::Sender<()>>,
    replies: Option<std::sync::mpsc::Sender<(u16, String)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Scripted {
    fn start(script: Vec<Then>) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (replies, next_reply) = std::sync::mpsc::channel::<(u16, String)>();
        let log = seen.clone();
        let thread = std::thread::spawn(move || {
            let mut held = Vec::new();
            for then in script {
                let Ok((mut s, _)) = l.accept() else { return };
                s.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
                log.lock().unwrap().push(read_request(&mut s));
                match then {
                    Then::Close => drop(s),
                    Then::Status(code) => {
                        let _ = write!(s, "HTTP/1.1 {code} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                    }
                    Then::Hold => held.push(s),
                    Then::Raw(r) => {
                        let _ = s.write_all(r.as_bytes());
                    }
                    Then::Answer => {
                        let Ok((code, body)) = next_reply.recv_timeout(std::time::Duration::from_secs(60)) else {
                            return;
                        };
                        let _ = write!(
                            s,
                            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                }
            }
            // Held connections stay open until the test is done with them.
            let _ = stopped.recv_timeout(std::time::Duration::from_secs(120));
            drop(held);
        });
        Self { url, seen, stop: Some(stop), replies: Some(replies), thread: Some(thread) }
    }

    /// Each request's first line.
    fn seen(&self) -> Vec<String> {
        self.requests().iter().map(|(head, _)| head.lines().next().unwrap_or_default().to_string()).collect()
    }

    fn requests(&self) -> Vec<(String, String)> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits (bounded) for the `n`th request (from 1) and returns it.
    fn wait_for_request(&self, n: usize) -> (String, String) {
        for _ in 0..1200 {
            if let Some(r) = self.requests().get(n - 1) {
                return r.clone();
            }
            std::thread::sleep(std::time::Duration::from_millis(25));
        }
        panic!("request {n} never arrived");
    }

    /// The reply the next [`Then::Answer`] sends.
    fn reply(&self, code: u16, body: String) {
        self.replies.as_ref().unwrap().send((code, body)).unwrap();
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        drop(self.stop.take());
        drop(self.replies.take());
        if let Some(t) = self.thread.take() {
            // A test that failed before its script ran out leaves the thread
            // waiting for a connection: connect until it is done, so the
            // failure is reported instead of hanging the suite.
            let addr = self.url.trim_start_matches("http://").to_string();
            for _ in 0..64 {
                if t.is_finished() {
                    break;
                }
                let _ = std::net::TcpStream::connect(&addr);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            let _ = t.join();
        }
    }
}

/// Reads a request's head and its body (by content-length).
fn read_request(s: &mut std::net::TcpStream) -> (String, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return (String::from_utf8_lossy(&got).into_owned(), String::new()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    };
    let head = String::from_utf8_lossy(&got[..head_end]).into_owned();
    let len: usize = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
        .unwrap_or(0);
    while got.len() < head_end + len {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    (head, String::from_utf8_lossy(&got[head_end..]).into_owned())
}

/// A payments receipt for a request a scripted server read: what the served
/// provider would answer (the request digest it was sent, the arguments echoed).
fn receipt_for((head, body): &(String, String)) -> String {
    let digest = head
        .lines()
        .find_map(|l| l.strip_prefix("toolgate-request-sha256: "))
        .unwrap_or_else(|| panic!("no digest in {head}"));
    let key = head
        .lines()
        .find_map(|l| {
            l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("idempotency-key")).map(|(_, v)| v.trim())
        })
        .unwrap_or_else(|| panic!("no key in {head}"));
    let args: Value = serde_json::from_str(body).unwrap();
    serde_json::json!({
        "receipt_id": "rcpt_scripted_0001",
        "request_id": "dreq_scripted_0001",
        "body_sha256": digest,
        "key": key,
        "result": {
            "refund_id": "re_00000000000000aa",
            "order_ref": args["order_ref"],
            "amount_minor": args["amount_minor"],
            "currency": args["currency"],
            "status": "succeeded"
        }
    })
    .to_string()
}

/// A ledger with the demo world whose tools go to `url` with this attempt
/// timeout; the options of an engine on it (all on one manual clock).
fn ledger_behind(dir: &Path, url: &str, attempt_timeout_ms: u64) -> (PathBuf, ManualClock, impl Fn() -> EngineOptions) {
    let catalog = write_catalog(dir, url, None);
    let path = catalog.join("create_refund.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    v["retry"]["attempt_timeout_ms"] = Value::from(attempt_timeout_ms);
    std::fs::write(&path, v.to_string()).unwrap();
    let clock = ManualClock::new(T0);
    let shared = clock.clone();
    let opts = move || EngineOptions {
        clock: Arc::new(shared.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let ledger = dir.join("ledger.db");
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    (ledger, clock, opts)
}

#[test]
fn a_duplicate_while_the_first_call_is_in_flight_over_http_is_in_progress_and_never_sent() {
    // Scenario 9 over HTTP: the first call is held by the server until the
    // test answers it (a 60 s attempt timeout is never reached).
    let server = Scripted::start(vec![Then::Answer]);
    let dir = tempfile::tempdir().unwrap();
    let (ledger, _clock, opts) = ledger_behind(dir.path(), &server.url, 60_000);
    let first = {
        let (ledger, opts) = (ledger.clone(), opts());
        std::thread::spawn(move || Engine::open(&ledger, opts).unwrap().dispatch(&refund("http-s9-00000001", 1000)))
    };
    let request = server.wait_for_request(1);
    // The same intent again on another dispatcher while the first is in flight.
    let mut e = Engine::open(&ledger, opts()).unwrap();
    let dup = toolgate::engine::DispatchRequest { call: Some(call("call-s9-dup")), ..refund("http-s9-00000001", 1000) };
    let env = e.dispatch(&dup).unwrap();
    // Both dispatchers are in this process, which knows the first is running.
    assert_eq!(env.code(), Some(Code::InProgress), "{env:?}");
    assert_eq!(state_of(&mut e, &env), "in_flight");
    assert_eq!(server.requests().len(), 1, "the duplicate was never sent");
    // The provider answers the first call.
    server.reply(200, receipt_for(&request));
    let done = first.join().unwrap().unwrap();
    assert_eq!(done.model_result.status, Status::Succeeded, "{done:?}");
    assert_eq!(done.status_ref(), env.status_ref(), "one operation");
    let replay = e.dispatch(&dup).unwrap();
    assert_eq!(replay.model_result.execution.delivery, toolgate::engine::envelope::Delivery::LocalReplay);
    assert_eq!(replay.model_result.data, done.model_result.data);
    assert_eq!(server.requests().len(), 1);
}

#[test]
fn a_reply_after_the_lease_was_taken_back_over_http_is_evidence_not_a_state_change() {
    // Scenario 11 over HTTP: the call is held by the server while the lease
    // runs out (the manual clock) and the reaper takes it back; then the reply
    // arrives. It writes nothing itself: its receipt makes toolgate look the
    // key up (a GET, as a status query), and the provider's answer settles it.
    let server = Scripted::start(vec![Then::Answer, Then::Answer]);
    let dir = tempfile::tempdir().unwrap();
    let (ledger, clock, opts) = ledger_behind(dir.path(), &server.url, 60_000);
    let first = {
        let (ledger, opts) = (ledger.clone(), opts());
        std::thread::spawn(move || Engine::open(&ledger, opts).unwrap().dispatch(&refund("http-s11-0000001", 1000)))
    };
    let request = server.wait_for_request(1);
    let mut e = Engine::open(&ledger, opts()).unwrap();
    let op = e.list_operations(None, 1).unwrap()[0].id.clone();
    // The lease (the attempt timeout plus 1 s) and the operation's deadline
    // run out; the reaper takes it back and parks it: it may have been received.
    clock.advance(120_000);
    let reaped = e.reap().unwrap();
    assert_eq!(reaped.parked_unknown, 1, "{reaped:?}");
    assert_eq!(e.operation_detail(&op).unwrap().unwrap().operation.state.to_string(), "unknown");
    // The old worker gets its reply now: its fence fails, the reply is evidence.
    server.reply(200, receipt_for(&request));
    // The receipt in it makes toolgate ask the provider by key.
    server.wait_for_request(2);
    server.reply(200, receipt_for(&request));
    let late = first.join().unwrap().unwrap();
    assert_eq!(late.code(), Some(Code::OutcomeUnknown), "its caller is told what the row said: {late:?}");
    let d = e.operation_detail(&op).unwrap().unwrap();
    assert!(
        d.trace.iter().any(|t| t.step == "late_reply"),
        "{:?}",
        d.trace.iter().map(|t| &t.step).collect::<Vec<_>>()
    );
    assert_eq!(d.operation.state.to_string(), "succeeded", "settled by the provider's answer to the lookup");
    let q = e.query_operation_status(&query_req(&late, "q-s11")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
    assert_eq!(q.model_result.execution.delivery, toolgate::engine::envelope::Delivery::ReceiptReconciled);
    let seen = server.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen[1].starts_with("GET "), "{seen:?}");
}

#[test]
fn a_lookup_that_answers_5xx_or_times_out_is_unavailable_and_the_operation_stays_unknown() {
    // The call is read and the connection closed with no reply; the first
    // lookup gets a 500, the second no answer at all.
    let server = Scripted::start(vec![Then::Close, Then::Status(500), Then::Hold]);
    let dir = tempfile::tempdir().unwrap();
    // A long connect timeout: before lookups were bounded by the tool's
    // attempt timeout (1 s here), this one would have waited 50 s.
    let catalog = write_catalog_with(dir.path(), &server.url, &|http| {
        http.insert("connect_timeout_ms".into(), Value::from(10_000));
    });
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = || EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&refund("http-lookup-5xx-1", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    for (n, what) in [(1, "a 500"), (2, "no answer")] {
        let started = std::time::Instant::now();
        let q = e.query_operation_status(&query_req(&env, &format!("q-lookup-{n}"))).unwrap();
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "{what}: the lookup did not hang");
        assert_eq!(q.code(), Some(Code::OutcomeUnknown), "{what}: {q:?}");
        let d = detail(&mut e);
        assert_eq!(d.operation.state.to_string(), "unknown", "{what}");
        assert_eq!(d.operation.last_query_result.as_deref(), Some("unavailable"), "{what}");
        let asked = d.audit.iter().filter(|a| a.action == "query" && a.evidence.contains("unavailable")).count();
        assert_eq!(asked, n, "{what}: each lookup is in the operator log");
    }
    let seen = server.seen();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(seen[0].starts_with("POST /v1/payments/calls"), "{seen:?}");
    assert!(seen[1..].iter().all(|l| l.starts_with("GET /v1/payments/calls/dk")), "{seen:?}");
}

#[test]
fn a_receipt_that_trickles_in_slower_than_the_attempt_timeout_is_unknown_and_a_query_finds_it() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    // Control: a body that trickles in within the attempt timeout is read whole.
    let ok = dispatch_with(&mut e, &refund("http-slowbody-01", 100), "slow_body(150)");
    assert_eq!(ok.model_result.status, Status::Succeeded, "{ok:?}");
    // The 200 arrives at once; the receipt takes 20 s, the attempt timeout is 1 s.
    let started = std::time::Instant::now();
    let env = dispatch_with(&mut e, &refund("http-slowbody-02", 200), "slow_body(20000)");
    assert!(started.elapsed() < std::time::Duration::from_secs(15), "the worker did not wait for the whole body");
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    assert_eq!(state_of(&mut e, &env), "unknown");
    assert_eq!(fx.server.effects(), 2);
    let q = e.query_operation_status(&query_req(&env, "q-slowbody")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
    assert_eq!(fx.server.duplicates(), 0);
}

#[test]
fn an_oversize_receipt_is_not_read_past_the_limit_and_goes_to_review() {
    let fx = HttpFixture::new();
    let mut e = fx.engine();
    // Control: padded with whitespace but under the catalog's 64 KiB limit, it is a receipt.
    let ok = dispatch_with(&mut e, &refund("http-hugebody-01", 100), "huge_body(60000)");
    assert_eq!(ok.model_result.status, Status::Succeeded, "{ok:?}");
    // 64 MiB: the adapter stops at the limit.
    let started = std::time::Instant::now();
    let env = dispatch_with(&mut e, &refund("http-hugebody-02", 200), "huge_body(67108864)");
    assert!(started.elapsed() < std::time::Duration::from_secs(30), "did not hang");
    assert_eq!(env.code(), Some(Code::OutputContractViolation), "{env:?}");
    assert_eq!(state_of(&mut e, &env), "unknown");
    assert_eq!(fx.server.effects(), 2);
    // The provider's lookup carries the ordinary receipt: a query settles it.
    let q = e.query_operation_status(&query_req(&env, "q-hugebody")).unwrap();
    assert_eq!(q.model_result.status, Status::Succeeded, "{q:?}");
}

/// A provider whose lookup answers another request's receipt, one that
/// echoes the same arguments (a second refund of the same amount on the same
/// order, under another key), behind a catalog that maps the key the
/// provider echoes but no request digest. Before: taken as
/// `receipt_reconciled` (the echoed arguments matched), binding another
/// intent's refund to this operation. Now the receipt's key is another's:
/// review, and no receipt is bound.
#[test]
fn a_lookup_answering_another_requests_receipt_is_not_evidence() {
    let server = Scripted::start(vec![Then::Close, Then::Answer]);
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog_with(dir.path(), &server.url, &|http| {
        http.insert(
            "reply".into(),
            serde_json::json!({"receipt_id": "/receipt_id", "result": "/result", "key": "/key"}),
        );
    });
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = || EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&refund("http-foreign-receipt-1", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    // The same arguments, under another intent's key.
    let (head, body) = server.wait_for_request(1);
    let mut receipt: Value = serde_json::from_str(&receipt_for(&(head, body))).unwrap();
    receipt["key"] = Value::from("dk3_0123456789abcdef0123456789abcdef");
    server.reply(200, receipt.to_string());
    let q = e.query_operation_status(&query_req(&env, "q-foreign")).unwrap();
    assert_eq!(q.code(), Some(Code::StatusConflict), "{q:?}");
    let d = detail(&mut e);
    assert_eq!(d.operation.state.to_string(), "needs_review");
    assert_eq!(d.operation.receipt_id, None, "the foreign receipt is not bound");
    assert!(d.trace.iter().any(|t| t.fields.contains("under another key")), "{:?}", d.trace);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// A lookup that answers a receipt already recorded for another operation
/// (a provider that keys lookups wrongly): the second operation is not
/// settled by it; one receipt is never bound to two operations.
#[test]
fn a_receipt_already_bound_to_another_operation_is_not_evidence() {
    let server = Scripted::start(vec![Then::Answer, Then::Close, Then::Answer]);
    let dir = tempfile::tempdir().unwrap();
    let (ledger, _clock, opts) = ledger_behind(dir.path(), &server.url, 1000);
    let mut e = Engine::open(&ledger, opts()).unwrap();
    let first = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut e1 = Engine::open(&ledger, opts()).unwrap();
            e1.dispatch(&refund("http-bound-twice-1", 1500)).unwrap()
        });
        let req = server.wait_for_request(1);
        server.reply(200, receipt_for(&req));
        h.join().unwrap()
    });
    assert_eq!(first.model_result.status, Status::Succeeded, "{first:?}");
    let env = e.dispatch(&refund("http-bound-twice-2", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    // The lookup answers rcpt_scripted_0001 again, with the second request's digest.
    let second = server.wait_for_request(2);
    server.reply(200, receipt_for(&second));
    let q = e.query_operation_status(&query_req(&env, "q-bound-twice")).unwrap();
    assert_eq!(q.code(), Some(Code::StatusConflict), "{q:?}");
    // Both were made at the same instant of the manual clock: by id.
    let d = e.operation_detail(env.protected_audit.operation_id.as_deref().unwrap()).unwrap().unwrap();
    assert_eq!(d.operation.state.to_string(), "needs_review");
    assert_eq!(d.operation.receipt_id, None);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// A service with no lookup, said honestly in the catalog (`"lookup": null`).
/// Before: the loader demanded a lookup, and an unknown outcome waited for a
/// status query that could never answer, then `resolve --as failed` marked a
/// call that may have happened as "no effect". Now the unknown outcome goes
/// straight to human review, a status query asks nothing and says so, and
/// "failed" needs the operator's statement that there is no evidence either
/// way, recorded as such.
#[test]
fn a_downstream_without_a_lookup_goes_to_review_and_failed_needs_a_statement() {
    let server = Scripted::start(vec![Then::Close]);
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog_with(dir.path(), &server.url, &|http| {
        http.insert("lookup".into(), Value::Null);
    });
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = || EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts()).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&refund("http-no-lookup-1", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::OutcomeUnknown), "{env:?}");
    let op = env.protected_audit.operation_id.clone().unwrap();
    let state = |e: &mut Engine| e.operation_detail(&op).unwrap().unwrap().operation.state.to_string();
    assert_eq!(state(&mut e), "needs_review", "straight to a person: nothing can be asked");
    let q = e.query_operation_status(&query_req(&env, "q-no-lookup")).unwrap();
    assert_eq!(q.code(), Some(Code::OutcomeUnknown), "{q:?}");
    assert_eq!(server.seen().len(), 1, "no lookup was sent: {:?}", server.seen());
    let d = e.operation_detail(&op).unwrap().unwrap();
    assert_eq!(d.operation.last_query_result.as_deref(), Some("unsupported"));
    let req = |no_evidence: bool| toolgate::engine::ResolveRequest {
        operation_id: op.clone(),
        resolution: toolgate::engine::Resolution::Failed,
        operator: "alice".into(),
        note: "the service has no record we can reach".into(),
        evidence: None,
        seen_version: None,
        action_id: None,
        no_evidence,
    };
    let refused = e.resolve(&req(false)).unwrap();
    assert_eq!((refused.applied, refused.code), (false, "NO_EVIDENCE_STATEMENT_REQUIRED"), "{refused:?}");
    let bulk = e
        .bulk(
            &toolgate::engine::BulkAction::Resolve {
                resolution: toolgate::engine::Resolution::Failed,
                note: "all of them".into(),
                no_evidence: false,
            },
            &[toolgate::engine::BulkTarget { id: op.clone(), seen_version: None }],
            "alice",
            |_, _| {},
        )
        .unwrap();
    assert_eq!(bulk.items[0].code, "NO_EVIDENCE_STATEMENT_REQUIRED", "{bulk:?}");
    let done = e.resolve(&req(true)).unwrap();
    assert!(done.applied, "{done:?}");
    assert_eq!(state(&mut e), "resolved");
    let log = e.audit_log(10).unwrap();
    let entry = log.iter().find(|a| a.action == "resolve" && a.result == "applied").unwrap();
    assert!(entry.evidence.contains("\"no_evidence_either_way\":true"), "{}", entry.evidence);
    assert!(e.audit().unwrap().is_empty(), "{:?}", e.audit().unwrap());
}

/// Issue 32 §1.5: a downstream that refuses the gateway's credentials (a
/// rotated secret) refused nothing the agent asked for. Before: a permanent
/// BUSINESS_RULE_VIOLATION with a fixed message, the status and body recorded
/// nowhere, and the same key replayed the failure after the secret was fixed.
#[test]
fn a_rotated_secret_is_a_configuration_refusal_the_same_key_survives() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("provider.token");
    std::fs::write(&secret, "sk_old_rotated_9f3e1a\n").unwrap();
    let fx = HttpFixture::with(&["--require-bearer", "sk_new_current_7b2c4d"], Some(&secret));
    let mut e = fx.engine();
    let req = refund("http-rotated-secret-1", 1500);
    let env = e.dispatch(&req).unwrap();
    assert_eq!(env.code(), Some(Code::DownstreamAuthFailed), "{env:?}");
    let err = env.model_result.error.as_ref().unwrap();
    assert!(err.retryable && err.retry_after_ms.is_some(), "{err:?}");
    assert_eq!(fx.server.effects(), 0);
    let op = e.list_operations(None, 1).unwrap()[0].clone();
    assert_eq!(op.state, "accepted", "nothing was processed: the key stays usable");
    let detail = e.operation_detail(&op.id).unwrap().unwrap();
    assert_eq!(detail.attempts.len(), 1, "not retried within the call: no retry helps before the fix");
    assert!(detail.attempts[0].proven_not_received(), "{:?}", detail.attempts);
    // The trace says what the downstream said: status, body digest, excerpt,
    // with the presented secret redacted.
    let said: Vec<String> = detail.trace.iter().filter_map(toolgate::telemetry::export::refusal).collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("HTTP 401") && said[0].contains("invalid_api_key"), "{}", said[0]);
    assert!(said[0].contains("[redacted]"), "{}", said[0]);
    let all: String = detail.trace.iter().map(|t| t.fields.clone()).collect();
    assert!(!all.contains("sk_old_rotated_9f3e1a"), "the presented secret is not recorded");

    // The operator fixes the secret; the same key runs once.
    std::fs::write(&secret, "sk_new_current_7b2c4d\n").unwrap();
    let mut e = fx.engine();
    fx.clock.advance(10_000);
    let env = e.dispatch(&req).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert_eq!(fx.server.effects(), 1);
    assert!(e.audit().unwrap().is_empty());
}

#[test]
fn a_refusal_records_its_status_and_a_redacted_bounded_excerpt() {
    use toolgate::engine::tool::Refusal;
    let body = format!(
        "{{\"error\":\"card_closed\",\"detail\":\"token sk_live_abcd1234 and Authorization: Bearer eyJabc.def\\n{}\"}}",
        "x".repeat(400)
    );
    let r = Refusal::of_body(402, body.as_bytes(), &["sk_live_abcd1234"]);
    assert_eq!(r.status, 402);
    assert_eq!(r.body_sha256, toolgate::engine::canonical::sha256_hex(body.as_bytes()));
    assert!(!r.excerpt.contains("sk_live_abcd1234") && !r.excerpt.contains("eyJabc"), "{}", r.excerpt);
    assert!(r.excerpt.contains("card_closed") && r.excerpt.ends_with('…'), "{}", r.excerpt);
    assert!(r.excerpt.chars().count() <= Refusal::EXCERPT_CHARS + 1);
    assert!(!r.excerpt.chars().any(char::is_control), "{}", r.excerpt);
}

/// A TLS server whose certificate nobody trusts (a throwaway self-signed
/// one): it counts the connections it saw and the application bytes that
/// reached it through TLS (none can, as the handshake never completes).
fn tls_server_nobody_trusts() -> (String, Arc<std::sync::atomic::AtomicUsize>, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let config = Arc::new(
        rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    let (connections, bytes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, b) = (connections.clone(), bytes.clone());
    std::thread::spawn(move || {
        for tcp in listener.incoming() {
            let Ok(tcp) = tcp else { break };
            c.fetch_add(1, Ordering::SeqCst);
            let mut tls = rustls::StreamOwned::new(rustls::ServerConnection::new(config.clone()).unwrap(), tcp);
            let mut buf = [0u8; 4096];
            while let Ok(n) = tls.read(&mut buf) {
                if n == 0 {
                    break;
                }
                b.fetch_add(n, Ordering::SeqCst);
            }
        }
    });
    (url, connections, bytes)
}

/// Issue 32 §1.4: a certificate that does not verify fails the handshake,
/// before any byte of the request. Before: OUTCOME_UNKNOWN, "may have
/// committed", parked for a human.
#[test]
fn a_tls_handshake_refused_is_provably_not_received_and_retried_with_the_same_key() {
    let (url, connections, bytes) = tls_server_nobody_trusts();
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog(dir.path(), &url, None);
    let ledger = dir.path().join("ledger.db");
    let clock = ManualClock::new(T0);
    let opts = EngineOptions {
        clock: Arc::new(clock.clone()),
        ..EngineOptions::new(toolgate::tools::load_toolset(Some(&catalog)).unwrap())
    };
    let mut e = Engine::create(&ledger, opts).unwrap();
    e.load_world(&World::parse(DEMO_WORLD.as_bytes()).unwrap()).unwrap();
    let env = e.dispatch(&refund("http-tls-untrusted-1", 1500)).unwrap();
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    let op = &e.list_operations(None, 1).unwrap()[0];
    assert_eq!(op.state, "accepted", "nothing was sent: the same key may run again");
    let detail = e.operation_detail(&op.id).unwrap().unwrap();
    assert!(detail.attempts.iter().all(toolgate::store::AttemptRow::proven_not_received), "{:?}", detail.attempts);
    assert!(connections.load(std::sync::atomic::Ordering::SeqCst) >= 1, "the client did connect");
    assert_eq!(bytes.load(std::sync::atomic::Ordering::SeqCst), 0, "no request byte got through TLS");
}

/// Issue 35 §3: the API's shape need not be the tool's. Path parameters,
/// query parameters and headers from the arguments, a form body from a
/// template with the key in a field, a success status set, a "key in use"
/// status, and the receipt read from response headers; over a real socket.
#[test]
fn a_mapped_request_has_the_apis_shape_and_its_receipt_comes_from_headers() {
    let answer = |status: &str, extra: &str| {
        let body = r#"{"reference":"dk-map-1"}"#;
        format!("HTTP/1.1 {status}\r\nrefund-id: re_77\r\nrequest-id: req_5\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}", body.len())
    };
    let server = Scripted::start(vec![
        Then::Raw(answer("201 Created", "")),
        Then::Raw(answer("200 OK", "")),
        Then::Raw("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let catalog = write_catalog_edited(dir.path(), &server.url, &|v| {
        if v["name"] == "create_refund" {
            v["downstream"]["http"]["execute"] = serde_json::json!({
                "method": "POST",
                "path": "/v1/orders/{args.order_ref}/refunds",
                "query": {"amount": "{args.amount_minor}", "currency": "{args.currency}"},
                "headers": {"X-Reason": "r-{args.reason}"},
                "body": {"amount": "{args.amount_minor}", "currency": "{args.currency}", "reference": "{key}", "live": false},
                "form": true,
                "success": [201],
                "key_conflict": [400]
            });
            v["downstream"]["http"]["reply"] = serde_json::json!({
                "receipt_id": "header:Refund-Id", "request_id": "header:Request-Id", "result": "", "key": "/reference"
            });
        }
    });
    let mut ds = adapter_for(&catalog, "create_refund");
    let mut req = request("abcd");
    req.arguments =
        serde_json::json!({"order_ref": "ord_1 2", "amount_minor": 1500, "currency": "EUR", "reason": "damaged"});
    match ds.execute("dk-map-1", &req).unwrap() {
        Reply::Committed(r) => {
            assert_eq!((r.receipt_id.as_str(), r.request_id.as_str()), ("re_77", "req_5"));
            assert_eq!(r.key.as_deref(), Some("dk-map-1"));
        }
        other => panic!("a 201 with the receipt in headers commits: {other:?}"),
    }
    let (head, body) = server.wait_for_request(1);
    let first = head.lines().next().unwrap_or_default();
    assert!(first.starts_with("POST /v1/orders/ord_1%202/refunds?amount=1500&currency=EUR "), "{first}");
    assert!(head.to_ascii_lowercase().contains("x-reason: r-damaged"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-type: application/x-www-form-urlencoded"), "{head}");
    assert_eq!(body, "amount=1500&currency=EUR&live=false&reference=dk-map-1");
    // A 2xx the catalog does not list may have committed: unknown, never a commit.
    assert_eq!(ds.execute("dk-map-1", &req).unwrap(), Reply::ServerError);
    // The catalog's "key in use" status.
    assert_eq!(ds.execute("dk-map-1", &req).unwrap(), Reply::KeyConflict);
    // Arguments that cannot fill the path: nothing is sent.
    req.arguments = serde_json::json!({"order_ref": ["x"], "amount_minor": 1, "currency": "EUR", "reason": "other"});
    assert!(matches!(ds.execute("dk-map-2", &req).unwrap(), Reply::Rejected { refusal: None, .. }));
    assert_eq!(server.requests().len(), 3);
}

/// The mapping's mistakes are caught when the catalog loads, each naming its field.
#[test]
fn a_mapping_that_cannot_be_filled_is_refused_when_the_catalog_loads() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, Value, &str); 6] = [
        ("/v1/{args.nope}", Value::Null, "not an input property"),
        ("/v1/{id}", Value::Null, "is not a placeholder"),
        ("/v1/x", serde_json::json!({"q": "{args.amount_minor"}), "unclosed"),
        ("/v1/x", serde_json::json!({"form": true}), "form body needs a body template"),
        ("/v1/x", serde_json::json!({"success": [302]}), "2xx statuses"),
        ("/v1/x", serde_json::json!({"key_conflict": [409]}), "4xx statuses other than"),
    ];
    for (i, (path, extra, why)) in cases.into_iter().enumerate() {
        let sub = dir.path().join(format!("c{i}"));
        std::fs::create_dir_all(&sub).unwrap();
        let catalog = write_catalog_edited(&sub, "http://127.0.0.1:9", &|v| {
            if v["name"] == "create_refund" {
                let e = &mut v["downstream"]["http"]["execute"];
                e["path"] = Value::String(path.into());
                if let Some(q) = extra.get("q") {
                    e["query"] = serde_json::json!({"a": q});
                }
                for k in ["form", "success", "key_conflict"] {
                    if let Some(x) = extra.get(k) {
                        e[k] = x.clone();
                    }
                }
            }
        });
        let err = toolgate::tools::load_toolset(Some(&catalog)).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(why), "{why}: {err}");
    }
}

/// Issue 35 §3: a read tool over HTTP with no Rust code: a mapped GET whose
/// body is the answer, no key, nothing recorded but the trace, and every
/// failure safe to report (the contract says nothing was written).
#[test]
fn a_read_tool_is_a_mapped_get_answered_by_the_service() {
    let order = r#"{"order_ref":"ord_1001","currency":"EUR","captured_minor":5000,"refunded_minor":0,"status":"paid"}"#;
    let ok = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{order}",
        order.len()
    );
    let server = Scripted::start(vec![
        Then::Raw(ok),
        Then::Raw("HTTP/1.1 503 X\r\nretry-after: 2\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".into()),
        Then::Raw("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}".into()),
    ]);
    let fx = HttpFixture::new();
    let get_order = serde_json::json!({
        // A new output schema is a new meaning: the revision says so (the ledger checks).
        "name": "get_order", "description": "Read one order.", "revisions": {"input": 1, "output": 2, "effect": 1},
        "effect": "read", "risk": "low", "data_classification": "internal", "approval": {"policy": "never"},
        "retry": {"attempt_timeout_ms": 2000, "deadline_ms": 10000, "backoff_base_ms": 100, "backoff_cap_ms": 2000, "max_attempts": 3},
        "retention_ms": 0,
        "downstream": {"name": "orders_api", "adapter": "http", "http": {
            "base_url": server.url, "key_header": "",
            "execute": {"method": "GET", "path": "/v1/orders/{args.order_ref}", "query": {"expand": "refunds"}},
            "lookup": null, "reply": {"result": ""}}},
        "input_schema": {"type": "object", "additionalProperties": false, "required": ["order_ref"],
            "properties": {"order_ref": {"type": "string", "pattern": "^ord_[A-Za-z0-9_]{1,60}$"}}},
        "output_schema": {"type": "object", "required": ["order_ref", "status"],
            "properties": {"order_ref": {"type": "string"}, "status": {"enum": ["paid", "partially_refunded", "refunded"]}}}
    });
    std::fs::write(fx.catalog.join("get_order.json"), get_order.to_string()).unwrap();
    let mut e = fx.engine();
    let read = toolgate::engine::DispatchRequest {
        tenant: "acme".into(),
        subject: "agent_ana".into(),
        tool: "get_order".into(),
        arguments: br#"{"order_ref":"ord_1001"}"#.to_vec(),
        ..toolgate::engine::DispatchRequest::default()
    };
    let env = e.dispatch(&read).unwrap();
    assert_eq!(env.model_result.status, Status::Succeeded, "{env:?}");
    assert_eq!(env.model_result.data.as_ref().unwrap()["captured_minor"], 5000);
    let (head, body) = server.wait_for_request(1);
    assert!(head.starts_with("GET /v1/orders/ord_1001?expand=refunds "), "{head}");
    assert!(!head.to_ascii_lowercase().contains("idempotency-key"), "a read sends no key: {head}");
    assert!(body.is_empty());
    // Unavailable: TOOL_UNAVAILABLE with the service's retry hint.
    let env = e.dispatch(&read).unwrap();
    assert_eq!(env.code(), Some(Code::ToolUnavailable), "{env:?}");
    assert_eq!(env.model_result.error.as_ref().and_then(|x| x.retry_after_ms), Some(2_000));
    // An answer outside the output contract is a tool error, never data.
    let env = e.dispatch(&read).unwrap();
    assert_eq!(env.code(), Some(Code::ToolError), "{env:?}");
    assert!(env.model_result.data.is_none());
    // Reads record no operation.
    assert!(e.list_operations(None, 10).unwrap().is_empty());
}

/// A read tool is a GET (and only a read tool is): the catalog refuses the rest.
#[test]
fn the_catalog_keeps_gets_for_reads_and_effects_off_gets() {
    let dir = tempfile::tempdir().unwrap();
    let refund_as_get = write_catalog_edited(dir.path(), "http://127.0.0.1:9", &|v| {
        if v["name"] == "create_refund" {
            v["downstream"]["http"]["execute"]["method"] = "GET".into();
        }
    });
    let err = toolgate::tools::load_toolset(Some(&refund_as_get)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("a GET must not act"), "{err}");
    let sim = dir.path().join("sim");
    std::fs::create_dir_all(&sim).unwrap();
    let mut read: Value = serde_json::from_str(include_str!("../../assets/catalog/get_order.json")).unwrap();
    read["downstream"] = serde_json::json!({"name": "payments", "adapter": "simulated", "dedupes_keys": true});
    std::fs::write(sim.join("get_order.json"), read.to_string()).unwrap();
    let err = toolgate::tools::load_toolset(Some(&sim)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("a read tool is answered by `local` or `http`"), "{err}");
}

/// A throwaway CA and a certificate it signed for `names` (PEM, key PEM).
pub(crate) fn ca_and_leaf(names: &[&str]) -> (rcgen::Certificate, rcgen::KeyPair, String, String) {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(names.iter().map(|n| (*n).to_string()).collect::<Vec<_>>())
        .unwrap()
        .signed_by(&leaf_key, &ca, &ca_key)
        .unwrap();
    (ca, ca_key, leaf.pem(), leaf_key.serialize_pem())
}

/// A TLS server with a certificate from a private CA, optionally requiring a
/// client certificate from `client_ca`; it answers each request with a
/// receipt. Returns its URL and how many requests reached it through TLS.
fn tls_server_of_a_private_ca(
    server_pem: &str,
    server_key_pem: &str,
    client_ca: Option<&rcgen::Certificate>,
) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let chain: Vec<rustls::pki_types::CertificateDer<'static>> =
        rustls::pki_types::pem::PemObject::pem_slice_iter(server_pem.as_bytes()).map(Result::unwrap).collect();
    let key = <rustls::pki_types::PrivateKeyDer as rustls::pki_types::pem::PemObject>::from_pem_slice(
        server_key_pem.as_bytes(),
    )
    .unwrap();
    let builder = rustls::ServerConfig::builder();
    let config = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(ca.der().clone()).unwrap();
            let verifier = rustls::server::WebPkiClientVerifier::builder(Arc::new(roots)).build().unwrap();
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = Arc::new(config.with_single_cert(chain, key).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://localhost:{}", listener.local_addr().unwrap().port());
    let requests = Arc::new(AtomicUsize::new(0));
    let seen = requests.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming() {
            let Ok(tcp) = tcp else { break };
            tcp.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
            let mut tls = rustls::StreamOwned::new(rustls::ServerConnection::new(config.clone()).unwrap(), tcp);
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                match tls.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            // Read the body too: a socket closed with unread bytes resets,
            // and the reset could reach the client before the reply.
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0)))
                .unwrap_or(0);
            while got.len() < end + 4 + len {
                match tls.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            seen.fetch_add(1, Ordering::SeqCst);
            let body =
                r#"{"receipt_id":"rcpt_tls_1","request_id":"req_1","result":{},"key":"dk-tls-1","body_sha256":"abcd"}"#;
            let _ = write!(
                tls,
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tls.flush();
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    (url, requests)
}

/// Issue 35 §4: a service behind a private CA is trusted through
/// `tls.ca_file` (beside the platform's roots), and one that requires a
/// client certificate gets it from `tls.client_cert_file` / `client_key_file`.
/// Without them the handshake fails and nothing is received (retried with the
/// same key); with them the call commits.
#[test]
fn a_private_ca_and_a_client_certificate_come_from_files() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let (ca, _ca_key, server_pem, server_key) = ca_and_leaf(&["localhost"]);
    let (client_ca, client_ca_key, _, _) = ca_and_leaf(&["unused"]);
    let client_key = rcgen::KeyPair::generate().unwrap();
    let client = rcgen::CertificateParams::new(vec!["agent-gateway".to_string()])
        .unwrap()
        .signed_by(&client_key, &client_ca, &client_ca_key)
        .unwrap();
    let files = dir.path().join("pki");
    std::fs::create_dir_all(&files).unwrap();
    let write = |name: &str, text: &str| {
        let p = files.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    };
    let ca_file = write("ca.pem", &ca.pem());
    let cert_file = write("client.pem", &client.pem());
    let key_file = write("client.key", &client_key.serialize_pem());
    let adapter = |url: &str, tls: Option<Value>, sub: &str| {
        let catalog = write_catalog_edited(&dir.path().join(sub), url, &|v| {
            if let (Some(t), "create_refund") = (&tls, v["name"].as_str().unwrap_or_default()) {
                v["downstream"]["http"]["tls"] = t.clone();
            }
        });
        adapter_for(&catalog, "create_refund")
    };
    let req = request("abcd");
    // A private CA: not trusted by default, trusted with ca_file.
    let (url, reached) = tls_server_of_a_private_ca(&server_pem, &server_key, None);
    let mut plain = adapter(&url, None, "a");
    assert_eq!(plain.execute("dk-tls-1", &req).unwrap(), Reply::Unavailable { retry_after_ms: None });
    assert_eq!(reached.load(Ordering::SeqCst), 0, "the handshake failed: nothing was received");
    let mut trusted = adapter(&url, Some(serde_json::json!({"ca_file": ca_file})), "b");
    let r = trusted.execute("dk-tls-1", &req).unwrap();
    assert!(matches!(r, Reply::Committed(_)), "{r:?}");
    assert_eq!(reached.load(Ordering::SeqCst), 1);
    // mTLS: without a client certificate refused in the handshake, with one committed.
    let (url, reached) = tls_server_of_a_private_ca(&server_pem, &server_key, Some(&client_ca));
    let mut anonymous = adapter(&url, Some(serde_json::json!({"ca_file": ca_file})), "c");
    assert_eq!(anonymous.execute("dk-tls-1", &req).unwrap(), Reply::Unavailable { retry_after_ms: None });
    assert_eq!(reached.load(Ordering::SeqCst), 0);
    let mtls = serde_json::json!({"ca_file": ca_file, "client_cert_file": cert_file, "client_key_file": key_file});
    let mut known = adapter(&url, Some(mtls), "d");
    let r = known.execute("dk-tls-1", &req).unwrap();
    assert!(matches!(r, Reply::Committed(_)), "{r:?}");
    assert_eq!(reached.load(Ordering::SeqCst), 1);
    // A file that is not there: a setup error naming the field, not the path.
    let missing = serde_json::json!({"ca_file": files.join("nope.pem")});
    let catalog = write_catalog_edited(&dir.path().join("e"), &url, &|v| {
        if v["name"] == "create_refund" {
            v["downstream"]["http"]["tls"] = missing.clone();
        }
    });
    let ctx_err = toolgate::downstream::http::HttpAdapter
        .open(
            &toolgate::tools::load_toolset(Some(&catalog)).unwrap().catalog().get("create_refund").unwrap().downstream,
            &DownstreamContext {
                ledger_path: &dir.path().join("unused.db"),
                clock: Arc::new(ManualClock::new(T0)) as Arc<dyn Clock>,
                faults: Arc::new(Mutex::new(FaultPlan::none())),
                sync: Sync::Normal,
                ids: toolgate::engine::ids::Ids::default(),
                read_only: false,
            },
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(ctx_err.contains("http.tls.ca_file cannot be read"), "{ctx_err}");
    assert!(!ctx_err.contains("nope.pem"), "no path: {ctx_err}");
}
