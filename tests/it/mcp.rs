//! `toolgate mcp` (issue 17 §3): a real child process driven over its stdio by
//! the official SDK's own client (rmcp), on both backends.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject, Tool};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Value};

use crate::support::{Backend, Fixture};

mod harness;

fn toolgate(db: &Path, args: &[&str]) -> Value {
    let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate")).arg("--db").arg(db).args(args).output().unwrap();
    // 1 is a call whose result is a failure or unknown (still an answer); 2 is an error.
    assert!(matches!(out.status.code(), Some(0 | 1)), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn connect(db: &Path, token: &str) -> RunningService<RoleClient, ()> {
    let mut cmd = tokio::process::Command::new(assert_cmd::cargo::cargo_bin("toolgate"));
    cmd.arg("--db").arg(db).args(["mcp", "--token", token]);
    let transport = TokioChildProcess::new(cmd).unwrap();
    ().serve(transport).await.unwrap()
}

fn args(v: Value) -> JsonObject {
    match v {
        Value::Object(m) => m,
        other => panic!("arguments must be an object: {other}"),
    }
}

async fn call(client: &RunningService<RoleClient, ()>, tool: &str, a: Value) -> CallToolResult {
    client.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args(a))).await.unwrap()
}

/// The model result of a call, checked to be the same as structured content and as text.
fn model(r: &CallToolResult) -> Value {
    let structured = r.structured_content.clone().expect("structured content");
    let text = r.content.first().and_then(|c| c.as_text()).map(|t| t.text.clone()).expect("a text block");
    assert_eq!(serde_json::from_str::<Value>(&text).unwrap(), structured);
    assert!(structured.get("protected_audit").is_none() && structured.get("operation_id").is_none());
    let succeeded = structured["status"] == "succeeded";
    assert_eq!(r.is_error, Some(!succeeded), "isError is set exactly when the call did not succeed");
    structured
}

fn tool<'a>(tools: &'a [Tool], name: &str) -> &'a Tool {
    tools.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no tool {name}"))
}

fn refund(order: &str, amount: i64, key: Option<&str>) -> Value {
    let mut v = json!({"order_ref": order, "amount_minor": amount, "currency": "EUR", "reason": "damaged"});
    if let Some(k) = key {
        v["idempotency_key"] = Value::from(k);
    }
    v
}

fn tools_list_call_replay_conflict_and_revocation(backend: Backend) {
    let f = Fixture::on(backend);
    let created = toolgate(f.path(), &["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"]);
    let token = created["token"].as_str().unwrap().to_string();
    let token_id = created["id"].as_str().unwrap().to_string();
    // The engine (PostgreSQL's blocking driver) is used outside the runtime only.
    let contracts = f.engine().contracts().all().len();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let db = f.path().to_path_buf();
        let client = connect(&db, &token).await;

        let info = client.peer_info().expect("the server's initialize answer");
        assert_eq!(info.server_info.as_ref().map(|i| i.name.as_str()), Some("toolgate"));

        // tools/list: every catalog tool, the key where the effect needs one, and the query tool.
        let tools = client.list_all_tools().await.unwrap();
        if std::env::var_os("TOOLGATE_PRINT_TOOLS").is_some() {
            eprintln!("{}", serde_json::to_string_pretty(&tools).unwrap());
        }
        assert_eq!(tools.len(), contracts + 1);
        let refund_tool = tool(&tools, "create_refund");
        let schema = Value::Object(refund_tool.input_schema.as_ref().clone());
        assert_eq!(schema["properties"]["idempotency_key"]["type"], "string");
        assert!(schema["required"].as_array().unwrap().contains(&Value::from("idempotency_key")));
        assert!(refund_tool.description.as_deref().unwrap().contains("once per business intent"));
        let a = refund_tool.annotations.as_ref().unwrap();
        assert_eq!((a.read_only_hint, a.destructive_hint, a.idempotent_hint), (Some(false), Some(true), Some(true)));
        let read = tool(&tools, "get_order");
        let schema = Value::Object(read.input_schema.as_ref().clone());
        assert!(schema["properties"].get("idempotency_key").is_none());
        let a = read.annotations.as_ref().unwrap();
        assert_eq!((a.read_only_hint, a.idempotent_hint), (Some(true), None));
        let q = tool(&tools, "query_operation_status");
        let schema = Value::Object(q.input_schema.as_ref().clone());
        assert_eq!(schema["required"], json!(["status_ref", "expected_request_sha256"]));

        // A call, then its replay under the same key (a new MCP request id).
        let first = model(&call(&client, "create_refund", refund("ord_1001", 1000, Some("refund-mcp-0001"))).await);
        assert_eq!(
            (first["status"].as_str(), first["execution"]["delivery"].as_str()),
            (Some("succeeded"), Some("fresh"))
        );
        let again = model(&call(&client, "create_refund", refund("ord_1001", 1000, Some("refund-mcp-0001"))).await);
        assert_eq!(again["execution"]["delivery"], "local_replay");
        assert_eq!(again["data"]["refund_id"], first["data"]["refund_id"]);

        // The same key with another amount: a conflict; no key at all: refused.
        let conflict = model(&call(&client, "create_refund", refund("ord_1001", 1500, Some("refund-mcp-0001"))).await);
        assert_eq!(conflict["error"]["code"], "IDEMPOTENCY_CONFLICT");
        let keyless = model(&call(&client, "create_refund", refund("ord_1001", 1000, None)).await);
        assert_eq!(keyless["error"]["code"], "IDEMPOTENCY_KEY_REQUIRED");

        // A read needs no key; a status query with a forged status_ref is refused, not a crash.
        let order = model(&call(&client, "get_order", json!({"order_ref": "ord_1001"})).await);
        assert_eq!(order["data"]["refunded_minor"], 1000);
        let forged = call(
            &client,
            "query_operation_status",
            json!({"status_ref": "sr1_forged", "expected_request_sha256": "0".repeat(64)}),
        )
        .await;
        assert_eq!(forged.is_error, Some(true));
        assert!(model(&forged)["error"]["code"].is_string());

        // A lost reply (dispatched by the CLI for the same agent under MCP's
        // provider profile, the provider's answer dropped) settled through the
        // query tool: the receipt is found.
        let lost = toolgate(
            &db,
            &[
                "dispatch",
                "--tenant",
                "acme",
                "--subject",
                "agent_ana",
                "--tool",
                "create_refund",
                "--key",
                "refund-mcp-lost",
                "--args",
                &refund("ord_1004", 700, None).to_string(),
                "--fault",
                "timeout_after_commit",
                "--json",
                // A status query must come from the dispatch's provider profile:
                // the lost call is dispatched as MCP would have.
                "--provider",
                "mcp",
                "--api-family",
                "tools/call",
            ],
        );
        assert_eq!(lost["model_result"]["error"]["code"], "OUTCOME_UNKNOWN");
        let settled = model(
            &call(
                &client,
                "query_operation_status",
                json!({
                    "status_ref": lost["protected_audit"]["downstream"]["status_ref"],
                    "expected_request_sha256": lost["protected_audit"]["binding"]["request_sha256"],
                }),
            )
            .await,
        );
        assert_eq!(
            (settled["status"].as_str(), settled["execution"]["delivery"].as_str()),
            (Some("succeeded"), Some("receipt_reconciled")),
            "{settled:#} {:#}",
            lost["protected_audit"]["provider"]
        );

        // Revoked between two calls: the next call is refused, nothing dispatched.
        toolgate(f.path(), &["token", "revoke", &token_id, "--json"]);
        let refused = model(&call(&client, "create_refund", refund("ord_1002", 500, Some("refund-mcp-0002"))).await);
        assert_eq!(refused["error"]["code"], "TOKEN_REVOKED");
        client.cancel().await.unwrap();
    });

    // Two refunds happened (one over MCP, the CLI's lost one), and every call
    // ran under an MCP call identity.
    assert_eq!(f.engine().counts().unwrap().downstream_effects, 2);
    assert_eq!(f.engine().counts().unwrap().side_effect_duplicates, 0);
    assert_eq!(f.query_i64("SELECT count(*) FROM operations"), 2);
    assert_eq!(f.query_i64("SELECT count(*) FROM call_identities WHERE provider <> 'mcp'"), 0);
    assert!(f.query_i64("SELECT count(*) FROM call_identities WHERE provider = 'mcp'") >= 3);
}

/// A bad token never starts the server: exit 2 with the stable code.
#[test]
fn a_bad_token_is_refused_before_serving() {
    let f = Fixture::on(Backend::Sqlite);
    let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
        .arg("--db")
        .arg(f.path())
        .args(["mcp", "--token", "tgt_0000000000000000_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "nothing on the protocol stream");
    assert!(String::from_utf8_lossy(&out.stderr).contains("TOKEN_UNKNOWN"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Issue 32 §3: `tools/list` listed tools the token's subject has no grant
/// for. It lists what the subject may call, read at each listing, and the
/// status query.
fn tools_list_shows_only_the_subjects_granted_tools(backend: Backend) {
    let f = Fixture::on(backend);
    let created = toolgate(f.path(), &["token", "create", "--tenant", "acme", "--subject", "agent_ana", "--json"]);
    let token = created["token"].as_str().unwrap().to_string();
    toolgate(
        f.path(),
        &["revoke", "--tenant", "acme", "--subject", "agent_ana", "--tool", "notify_customer", "--json"],
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client = connect(f.path(), &token).await;
        let mut names: Vec<String> =
            client.list_all_tools().await.unwrap().into_iter().map(|t| t.name.to_string()).collect();
        names.sort();
        assert_eq!(names, ["create_refund", "get_order", "query_operation_status"]);
        client.cancel().await.unwrap();
    });
}

crate::on_both_backends!(
    tools_list_call_replay_conflict_and_revocation,
    tools_list_shows_only_the_subjects_granted_tools
);

/// Counts the progress notifications the server sends.
#[derive(Clone, Default)]
struct Progress(std::sync::Arc<std::sync::atomic::AtomicU32>);

impl rmcp::ClientHandler for Progress {
    async fn on_progress(
        &self,
        _params: rmcp::model::ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

async fn connect_http<H: rmcp::ClientHandler>(
    url: &str,
    token: &str,
    fault: Option<&str>,
    handler: H,
) -> RunningService<RoleClient, H> {
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::transport::StreamableHttpClientTransport;
    let mut headers = std::collections::HashMap::new();
    if let Some(f) = fault {
        headers.insert(
            axum::http::HeaderName::from_static("toolgate-fault"),
            axum::http::HeaderValue::from_str(f).unwrap(),
        );
    }
    let config =
        StreamableHttpClientTransportConfig::with_uri(format!("{url}/mcp")).auth_header(token).custom_headers(headers);
    handler.serve(StreamableHttpClientTransport::from_config(config)).await.unwrap()
}

/// `/mcp` inside `toolgate serve` (issue 17 §3, streamable HTTP), driven by
/// rmcp's own HTTP client: the token on every request (401 without, 403 for
/// an operator's), the tools, a call and its replay, a lost reply settled
/// with `query_operation_status` from the result's `_meta` alone, progress
/// while a slow call waits, the client's cancellation becoming the engine's
/// (after send: the unknown queue, the late reply only evidence), and a token
/// revoked mid-session refused at its next call.
fn mcp_over_streamable_http_in_serve(backend: Backend) {
    use crate::serve::{agent_token, operator_token, Server};
    let f = Fixture::on(backend);
    // Faults come in a request header only on a database marked as a demo.
    f.engine().mark_demo(crate::support::T0).unwrap();
    let token = agent_token(f.path(), "acme", "agent_ana");
    let operator = operator_token(f.path(), "alice");
    let contracts = f.engine().contracts().all().len();
    let mut server = Server::start(f.path(), &[]);

    // Refused before rmcp sees anything: no token, an operator's token, a bad fault.
    let http: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    let post = |auth: Option<&str>, fault: Option<&str>| {
        let mut r = http
            .post(&format!("{}/mcp", server.url))
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream");
        if let Some(a) = auth {
            r = r.header("authorization", &format!("Bearer {a}"));
        }
        if let Some(x) = fault {
            r = r.header("toolgate-fault", x);
        }
        let mut resp = r.send(init.to_string()).unwrap();
        (resp.status().as_u16(), resp.body_mut().read_to_string().unwrap_or_default())
    };
    let (st, body) = post(None, None);
    assert_eq!(st, 401, "{body}");
    assert!(body.contains("TOKEN_MISSING"), "{body}");
    let (st, body) = post(Some(&operator), None);
    assert_eq!(st, 403, "{body}");
    let (st, body) = post(Some(&token), Some("no_such_fault"));
    assert_eq!(st, 400, "{body}");

    let progress = Progress::default();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let token_id = {
        let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(f.path())
            .args(["token", "list", "--json"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows = v.as_array().cloned().or_else(|| v["tokens"].as_array().cloned()).unwrap();
        rows.iter().find(|t| t["subject"] == "agent_ana").unwrap()["id"].as_str().unwrap().to_string()
    };
    rt.block_on(async {
        let client = connect_http(&server.url, &token, None, ()).await;
        let info = client.peer_info().expect("the server's initialize answer");
        assert_eq!(info.server_info.as_ref().map(|i| i.name.as_str()), Some("toolgate"));
        let tools = client.list_all_tools().await.unwrap();
        assert_eq!(tools.len(), contracts + 1);
        assert!(tool(&tools, "create_refund").input_schema.contains_key("properties"));

        // A call and its replay under the same key.
        let first = call(&client, "create_refund", refund("ord_1001", 1000, Some("refund-mcph-001"))).await;
        let first_model = model(&first);
        assert_eq!(first_model["execution"]["delivery"], "fresh");
        let meta = first.meta.as_ref().expect("_meta for the harness").0.clone();
        assert!(meta["toolgate/status_ref"].as_str().unwrap().starts_with("sr1_"));
        assert_eq!(meta["toolgate/request_sha256"].as_str().unwrap().len(), 64);
        let again = model(&call(&client, "create_refund", refund("ord_1001", 1000, Some("refund-mcph-001"))).await);
        assert_eq!(again["execution"]["delivery"], "local_replay");
        assert_eq!(again["data"]["refund_id"], first_model["data"]["refund_id"]);
        client.cancel().await.unwrap();

        // A lost reply, then settled with what the result's _meta carries (no side channel).
        let lossy = connect_http(&server.url, &token, Some("timeout_after_commit"), ()).await;
        let lost = call(&lossy, "create_refund", refund("ord_1004", 700, Some("refund-mcph-lost"))).await;
        assert_eq!(model(&lost)["error"]["code"], "OUTCOME_UNKNOWN");
        let meta = lost.meta.as_ref().expect("_meta on an unknown outcome").0.clone();
        lossy.cancel().await.unwrap();
        let client = connect_http(&server.url, &token, None, ()).await;
        let settled = model(
            &call(
                &client,
                "query_operation_status",
                json!({
                    "status_ref": meta["toolgate/status_ref"],
                    "expected_request_sha256": meta["toolgate/request_sha256"],
                }),
            )
            .await,
        );
        assert_eq!(settled["execution"]["delivery"], "receipt_reconciled", "{settled:#}");
        client.cancel().await.unwrap();

        // A slow call: progress while it waits, then the client cancels it.
        let slow = connect_http(&server.url, &token, Some("latency(8000)"), progress.clone()).await;
        let request = rmcp::model::ClientRequest::CallToolRequest(rmcp::model::Request::new(
            CallToolRequestParams::new("create_refund").with_arguments(args(refund(
                "ord_1002",
                300,
                Some("refund-mcph-slow"),
            ))),
        ));
        let handle = slow
            .peer()
            .send_cancellable_request(request, rmcp::service::PeerRequestOptions::no_options())
            .await
            .unwrap();
        let waited = std::time::Instant::now();
        while progress.0.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(waited.elapsed() < Duration::from_secs(7), "no progress notification while the call waited");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        handle.cancel(Some("the user gave up".into())).await.unwrap();
        slow.cancel().await.unwrap();

        // Revoked mid-session: the next call is refused before anything runs.
        let client = connect_http(&server.url, &token, None, ()).await;
        let out = Command::new(assert_cmd::cargo::cargo_bin("toolgate"))
            .arg("--db")
            .arg(f.path())
            .args(["token", "revoke", &token_id, "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let refused = client
            .call_tool(CallToolRequestParams::new("create_refund").with_arguments(args(refund(
                "ord_1003",
                200,
                Some("refund-mcph-rev"),
            ))))
            .await;
        assert!(refused.is_err() || refused.as_ref().is_ok_and(|r| r.is_error == Some(true)), "{refused:?}");
        let _ = client.cancel().await;
    });

    // The cancelled call: moved to the unknown queue by the client's cancellation
    // (it had been sent), recorded in the operator log, and its late reply never
    // flipped it to success.
    let slow_op = || f.query_text("SELECT id FROM operations WHERE idem_key = 'refund-mcph-slow'");
    let waited = std::time::Instant::now();
    let op = loop {
        if let Some(id) = slow_op() {
            break id;
        }
        assert!(waited.elapsed() < Duration::from_secs(20), "the slow call never made an operation");
        std::thread::sleep(Duration::from_millis(100));
    };
    let cancelled = f.query_i64(&format!(
        "SELECT count(*) FROM audit_log WHERE action = 'cancel' AND actor = 'mcp-client' AND operation_id = '{op}'"
    ));
    assert_eq!(cancelled, 1, "one cancellation by the client, in the operator log");
    // Wait for the provider's late answer, then: still unknown, never succeeded.
    std::thread::sleep(Duration::from_secs(9));
    let state = f.query_text(&format!("SELECT state FROM operations WHERE id = '{op}'")).unwrap();
    assert_eq!(state, "unknown");
    assert_eq!(f.query_i64("SELECT count(*) FROM operations WHERE idem_key = 'refund-mcph-rev'"), 0);
    assert_eq!(f.engine().counts().unwrap().side_effect_duplicates, 0);
    assert_eq!(server.terminate().code(), Some(0));
}

crate::on_both_backends!(mcp_over_streamable_http_in_serve);

/// A session on `/mcp` is its opener's: another tenant's agent holding the
/// session id meets a session that does not exist (a request, a cancellation,
/// a DELETE: 404 `NO_SUCH_SESSION`, exactly as for an id that never existed),
/// and the opener's session goes on working.
fn an_mcp_session_is_its_openers_only(backend: Backend) {
    use crate::serve::{agent_token, Server};
    let f = Fixture::on(backend);
    let ana = agent_token(f.path(), "acme", "agent_ana");
    let gus = agent_token(f.path(), "globex", "agent_gus");
    let server = Server::start(f.path(), &[]);
    let http: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
    let send = |method: &str, token: &str, session: Option<&str>, body: Option<Value>| {
        let url = format!("{}/mcp", server.url);
        let mut r = if method == "DELETE" { http.delete(&url).force_send_body() } else { http.post(&url) };
        r = r
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .header("mcp-protocol-version", "2025-06-18")
            .header("authorization", &format!("Bearer {token}"));
        if let Some(s) = session {
            r = r.header("mcp-session-id", s);
        }
        let mut resp = r.send(body.map(|b| b.to_string()).unwrap_or_default()).unwrap();
        let sid = resp.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_string);
        (resp.status().as_u16(), sid, resp.body_mut().read_to_string().unwrap_or_default())
    };
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}});
    let (st, sid, body) = send("POST", &ana, None, Some(init));
    assert_eq!(st, 200, "{body}");
    let sid = sid.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (st, _, body) = send("POST", &ana, Some(&sid), Some(initialized));
    assert!(st == 202 || st == 200, "{st} {body}");
    let list = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"});
    // What a session that never existed looks like.
    let (missing, _, missing_body) = send("POST", &gus, Some("no-such-session-at-all"), Some(list.clone()));
    assert_eq!(missing, 404, "{missing_body}");
    assert!(missing_body.contains("NO_SUCH_SESSION"), "{missing_body}");
    // Another tenant's agent with ana's session id: the same answer.
    let (st, _, body) = send("POST", &gus, Some(&sid), Some(list.clone()));
    assert_eq!((st, body.as_str()), (missing, missing_body.as_str()), "a session of another principal does not exist");
    let cancel = json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 2}});
    let (st, _, _) = send("POST", &gus, Some(&sid), Some(cancel));
    assert_eq!(st, missing);
    let (st, _, _) = send("DELETE", &gus, Some(&sid), None);
    assert_eq!(st, missing, "another principal cannot end the session");
    // The opener's session is untouched.
    let (st, _, body) = send("POST", &ana, Some(&sid), Some(list));
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("create_refund"), "{body}");
    // JSON-RPC ids 13 and "13" are two calls, not one call identity used twice.
    for (id, key, amount) in [(json!(13), "mcp-id-number-13", 100), (json!("13"), "mcp-id-string-13", 200)] {
        let call = json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {"name": "create_refund",
            "arguments": {"order_ref": "ord_1001", "amount_minor": amount, "currency": "EUR", "reason": "damaged",
                          "idempotency_key": key}}});
        let (st, _, body) = send("POST", &ana, Some(&sid), Some(call));
        assert_eq!(st, 200, "{body}");
        assert!(!body.contains("CALL_ID_CONFLICT"), "id {id}: {body}");
    }
    let keys: Vec<String> = f.engine().list_operations(None, 10).unwrap().into_iter().map(|o| o.idem_key).collect();
    assert!(
        keys.contains(&"mcp-id-number-13".to_string()) && keys.contains(&"mcp-id-string-13".to_string()),
        "{keys:?}"
    );
    let (st, _, _) = send("DELETE", &ana, Some(&sid), None);
    assert!(st < 300, "the opener ends it: {st}");
}

crate::on_both_backends!(an_mcp_session_is_its_openers_only);
