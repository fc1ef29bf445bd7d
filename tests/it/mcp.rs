//! `toolgate mcp` (issue 17 §3): a real child process driven over its stdio by
//! the official SDK's own client (rmcp), on both backends.

use std::path::Path;
use std::process::Command;

use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject, Tool};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Value};

use crate::support::{Backend, Fixture};

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

crate::on_both_backends!(tools_list_call_replay_conflict_and_revocation);
