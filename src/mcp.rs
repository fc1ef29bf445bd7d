//! `toolgate mcp`: a Model Context Protocol server over stdio, with the
//! official Rust SDK (`rmcp`).
//!
//! Each catalog tool is an MCP tool; its input schema is the contract's plus,
//! for write and external tools, a required `idempotency_key` (MCP has no key
//! of its own). One more tool, `query_operation_status`, settles an
//! `OUTCOME_UNKNOWN`. A result carries the `model_result` as structured
//! content and as text (never the `protected_audit`); anything but a success
//! sets `isError`. The MCP session and request ids become the call identity
//! (provider `mcp`).
//!
//! The caller is whoever the `--token` says, re-checked at every call (a
//! revoked token is refused from the next call on). The engine runs on a
//! plain thread of its own ([`crate::api::pool`]): the async runtime only
//! moves messages.

use std::path::Path;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};

use crate::api::pool::Pool;
use crate::engine::canonical::CallIdentity;
use crate::engine::contracts::{Contract, Effect};
use crate::engine::envelope::{Envelope, Status};
use crate::engine::projection::QUERY_STATUS_TOOL;
use crate::engine::tokens::Principal;
use crate::engine::{DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest};

/// The argument that carries the idempotency key of a write or external tool.
pub const KEY_ARGUMENT: &str = "idempotency_key";

/// Why the MCP server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// Opening the ledger.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The token was refused.
    #[error("the token was refused ({0})")]
    Token(&'static str),
    /// An operator token cannot act as a subject.
    #[error("an operator token cannot call tools: use an agent's (subject) token")]
    OperatorToken,
    /// Threads, the runtime or the stdio transport.
    #[error("runtime: {0}")]
    Runtime(String),
}

impl McpError {
    /// Stable code.
    pub fn code(&self) -> &'static str {
        match self {
            McpError::Engine(e) => e.code(),
            McpError::Token(code) => code,
            McpError::OperatorToken => "SUBJECT_TOKEN_REQUIRED",
            McpError::Runtime(_) => "INTERNAL",
        }
    }
}

/// Serves MCP on standard input and output until the client closes it. The
/// token is checked once here (a bad one never starts the server) and again
/// at every call.
pub fn serve_stdio(db: &Path, token: &str, opts: EngineOptions) -> Result<(), McpError> {
    let authorization = format!("Bearer {token}").into_bytes();
    // Opened here, on a plain thread, before any runtime exists.
    let mut engine = Engine::open(db, opts)?;
    match engine.authenticate(Some(&authorization))? {
        Ok(Principal::Subject { .. }) => {}
        Ok(Principal::Operator { .. }) => return Err(McpError::OperatorToken),
        Err(f) => return Err(McpError::Token(f.code())),
    }
    let tools = engine.contracts().all().iter().map(mcp_tool).chain([query_tool()]).collect();
    let pool = Pool::start(vec![engine], 64).map_err(|e| McpError::Runtime(e.to_string()))?;
    let session = crate::engine::ids::Ids::default().id("mcps");
    let gate = Gate { pool: Arc::new(pool), tools: Arc::new(tools), authorization: Arc::new(authorization), session };
    let pool = gate.pool.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| McpError::Runtime(e.to_string()))?;
    let served = rt.block_on(async move {
        let running = gate.serve(rmcp::transport::stdio()).await.map_err(|e| McpError::Runtime(e.to_string()))?;
        running.waiting().await.map_err(|e| McpError::Runtime(e.to_string()))?;
        Ok::<_, McpError>(())
    });
    drop(rt);
    pool.close();
    served
}

/// The MCP tool of a contract.
fn mcp_tool(c: &Contract) -> Tool {
    let mut schema = match &c.input_schema {
        Value::Object(m) => m.clone(),
        _ => JsonObject::new(),
    };
    let keyed = c.effect != Effect::Read;
    let mut description = c.description.clone();
    if keyed {
        let props = schema.entry("properties").or_insert_with(|| json!({}));
        if let Value::Object(p) = props {
            p.insert(
                KEY_ARGUMENT.into(),
                json!({
                    "type": "string",
                    "minLength": 8,
                    "maxLength": 255,
                    "description": KEY_DESCRIPTION,
                }),
            );
        }
        let required = schema.entry("required").or_insert_with(|| json!([]));
        if let Value::Array(r) = required {
            r.push(Value::from(KEY_ARGUMENT));
        }
        description.push_str("\n\n");
        description.push_str(KEY_DESCRIPTION);
    }
    let annotations = match c.effect {
        Effect::Read => ToolAnnotations::new().read_only(true),
        // The key makes a repeat harmless: the same key and arguments replay the
        // first result and never run the effect again, whatever the downstream does.
        Effect::Write | Effect::External => ToolAnnotations::new().read_only(false).destructive(true).idempotent(true),
    };
    let mut tool = Tool::new(c.name.clone(), description, Arc::new(schema));
    tool.annotations = Some(annotations);
    tool
}

const KEY_DESCRIPTION: &str =
    "Idempotency key: generate it once per business intent (for example one per refund you mean to make; \
     8 to 255 characters) and send the same key on every retry of that intent. The same key with the same arguments \
     returns the first result and never repeats the effect; the same key with other arguments is \
     IDEMPOTENCY_CONFLICT. A new key is a new intent.";

/// `query_operation_status(status_ref, expected_request_sha256)`.
fn query_tool() -> Tool {
    let schema = json!({
        "type": "object",
        "properties": {
            "status_ref": {"type": "string", "description": "The status_ref the harness kept from the unknown call's audit."},
            "expected_request_sha256": {"type": "string", "description": "The request digest of that call."},
        },
        "required": ["status_ref", "expected_request_sha256"],
        "additionalProperties": false,
    });
    let schema = schema.as_object().cloned().unwrap_or_default();
    let mut tool = Tool::new(
        QUERY_STATUS_TOOL,
        "Settle an OUTCOME_UNKNOWN: ask the provider whether the call happened. Never re-executes the call.",
        Arc::new(schema),
    );
    tool.annotations = Some(ToolAnnotations::new().read_only(true));
    tool
}

#[derive(Clone)]
struct Gate {
    pool: Arc<Pool>,
    tools: Arc<Vec<Tool>>,
    authorization: Arc<Vec<u8>>,
    session: String,
}

/// A failure of the server's own (a refused token, a busy engine), in the
/// model result's shape.
fn refusal(code: &str, category: &str, recovery: &str, message: &str) -> CallToolResult {
    let env = crate::api::status::envelope_json(code, category, recovery, message, None, false);
    CallToolResult::structured_error(env["model_result"].clone())
}

fn result_of(env: &Envelope) -> CallToolResult {
    let model = serde_json::to_value(&env.model_result).unwrap_or(Value::Null);
    if env.model_result.status == Status::Succeeded {
        CallToolResult::structured(model)
    } else {
        CallToolResult::structured_error(model)
    }
}

impl Gate {
    async fn call(&self, request: CallToolRequestParams, id: String) -> CallToolResult {
        let authorization = self.authorization.clone();
        let call = CallIdentity {
            provider: "mcp".into(),
            api_family: "tools/call".into(),
            response_id: self.session.clone(),
            call_id: id,
            adapter_revision: "1".into(),
        };
        let name = request.name.to_string();
        let mut args = request.arguments.unwrap_or_default();
        let job = move |e: &mut Engine| -> Result<CallToolResult, EngineError> {
            let (tenant, subject) = match e.authenticate(Some(&authorization))? {
                Ok(Principal::Subject { tenant, subject, .. }) => (tenant, subject),
                Ok(Principal::Operator { .. }) => {
                    let c = crate::api::status::SUBJECT_TOKEN_REQUIRED;
                    return Ok(refusal(c.code, c.category, c.recovery, c.message));
                }
                Err(f) => return Ok(refusal(f.code(), "authentication", "request_authorization", f.message())),
            };
            let text = |v: Option<Value>| match v {
                Some(Value::String(s)) => s,
                _ => String::new(),
            };
            let env = if name == QUERY_STATUS_TOOL {
                e.query_operation_status(&QueryRequest {
                    tenant,
                    subject,
                    status_ref: text(args.remove("status_ref")),
                    expected_request_sha256: text(args.remove("expected_request_sha256")),
                    idempotency_key: None,
                    call: Some(call),
                    operator: None,
                })?
            } else {
                // A key that is not a string stays in the arguments, where the
                // contract refuses it (INVALID_ARGUMENTS) like any other stray field.
                let key = match args.get(KEY_ARGUMENT) {
                    Some(Value::String(_)) => args.remove(KEY_ARGUMENT).and_then(|v| v.as_str().map(str::to_string)),
                    _ => None,
                };
                let arguments = serde_json::to_vec(&args).unwrap_or_default();
                e.dispatch(&DispatchRequest {
                    tenant,
                    subject,
                    tool: name,
                    arguments,
                    idempotency_key: key,
                    call: Some(call),
                    approval_id: None,
                    deadline_ms: None,
                })?
            };
            Ok(result_of(&env))
        };
        let busy = || {
            let c = crate::api::status::SERVER_BUSY;
            refusal(c.code, c.category, c.recovery, c.message)
        };
        match self.pool.submit(job) {
            Err(_) => busy(),
            Ok(answer) => match answer.await {
                Ok(Ok(r)) => r,
                // An environment failure: the ledger is the truth, the outcome
                // unknown to us; a retry with the same key is safe.
                Ok(Err(e)) => {
                    let env = crate::api::status::envelope_json(
                        e.code(),
                        "environment",
                        "retry_after",
                        crate::api::status::INTERNAL.message,
                        Some(1000),
                        true,
                    );
                    CallToolResult::structured_error(env["model_result"].clone())
                }
                Err(_) => busy(),
            },
        }
    }
}

impl ServerHandler for Gate {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("toolgate", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tool calls go through toolgate's ledger: each write or external tool needs an idempotency_key \
                 you generate once per business intent and reuse on every retry. An OUTCOME_UNKNOWN result \
                 is settled with query_operation_status, never by calling the tool again with a new key.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult { tools: self.tools.as_ref().clone(), ..Default::default() })
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let id = match serde_json::to_value(&context.id) {
            Ok(Value::String(s)) => s,
            Ok(v) => v.to_string(),
            Err(_) => String::new(),
        };
        Ok(self.call(request, format!("req_{id}")).await.into())
    }
}
