//! `toolgate mcp`: a Model Context Protocol server, with the official Rust
//! SDK (`rmcp`), over stdio (`toolgate mcp`) and over streamable HTTP at
//! `/mcp` inside `toolgate serve` ([`http_service`]).
//!
//! Each catalog tool is an MCP tool; its input schema is the contract's plus,
//! for write and external tools, a required `idempotency_key` (MCP has no key
//! of its own). One more tool, `query_operation_status`, settles an
//! `OUTCOME_UNKNOWN`. A result carries the `model_result` as structured
//! content and as text (never the `protected_audit`); anything but a success
//! sets `isError`. The MCP session and request ids become the call identity
//! (provider `mcp`).
//!
//! The caller is whoever the token says (`--token` on stdio, the request's
//! `Authorization` header over HTTP), re-checked at every call (a revoked
//! token is refused from the next call on). The engine runs on plain threads
//! of its own ([`crate::pool`]): the async runtime only moves messages.
//!
//! A call in flight reports progress (`notifications/progress`, when the
//! request carries a progress token) while it waits, and a
//! `notifications/cancelled` for it becomes the engine's cancellation of the
//! operation its key names (docs/design.md §11: before send it is cancelled,
//! after send it goes to the unknown queue, a late reply never flips it).
//! The result's `_meta` carries what a harness needs to settle an
//! `OUTCOME_UNKNOWN` later (`status_ref`, `request_sha256`, the operation
//! id); the model-facing content never does.

pub(crate) mod wire;

use std::path::Path;
use std::sync::Arc;
use toolgate_core::Coded;

use std::time::Duration;

use axum::http::request::Parts;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, Implementation, JsonObject, ListToolsResult, MetaObject,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};

use crate::engine::canonical::CallIdentity;
use crate::engine::contracts::{Contract, Effect};
use crate::engine::envelope::{Envelope, Status};
use crate::engine::faults::FaultPlan;
use crate::engine::projection::QUERY_STATUS_TOOL;
use crate::engine::tokens::Principal;
use crate::engine::{CancelSignal, DispatchRequest, Engine, EngineError, EngineOptions, QueryRequest};
use crate::pool::Pool;
use crate::store::Scope;

/// `/mcp` inside `serve`: the grace of a call in flight at shutdown (within
/// the server's drain timeout).
const HTTP_GRACE: Duration = Duration::from_secs(3);
/// Who the operator log names when a stopping server detaches a call.
const DETACHED_BY: &str = "mcp-shutdown";
/// Cancellations that may wait for the cancellation lane's engine.
pub(crate) const LANE_QUEUE: usize = 256;
/// How often a call in flight reports progress.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// How long a client's cancellation keeps looking for the operation of a
/// call whose accept is being committed (a call not at its accept yet
/// cancels itself there, through its [`CancelSignal`]).
const CANCEL_LOOKUP: Duration = Duration::from_secs(5);
/// Who the operator log names for a caller's own cancellation.
const CANCELLED_BY: &str = "mcp-client";

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

impl toolgate_core::Coded for McpError {
    /// Stable code.
    fn code(&self) -> &'static str {
        match self {
            McpError::Engine(e) => e.code(),
            McpError::Token(code) => code,
            McpError::OperatorToken => "SUBJECT_TOKEN_REQUIRED",
            McpError::Runtime(_) => "INTERNAL",
        }
    }
}

/// How `toolgate mcp` runs its session's calls.
pub struct StdioOptions {
    /// One engine per call the session runs at once.
    pub workers: Vec<EngineOptions>,
    /// The cancellation lane's engine: a client's cancellation never waits
    /// behind the calls it cancels.
    pub lane: EngineOptions,
    /// Calls that may wait for a free engine; more are `SERVER_BUSY`.
    pub queue: usize,
    /// At a shutdown, how long a call in flight may take to reach its next
    /// durable step before it is detached (see [`Gate::stop`]).
    pub grace: Duration,
}

/// Serves MCP on standard input and output until the client closes it. The
/// token is checked once here (a bad one never starts the server) and again
/// at every call.
pub fn serve_stdio(db: &Path, token: &str, opts: StdioOptions) -> Result<(), McpError> {
    let authorization = format!("Bearer {token}").into_bytes();
    let StdioOptions { workers, lane, queue, grace } = opts;
    // As `serve`: each downstream's bulkhead keeps one worker free of it.
    if workers.len() >= 3 {
        crate::engine::bulkhead::set_default_limit(workers.len() - 1);
    }
    let runtime = |e: std::io::Error| McpError::Runtime(e.to_string());
    // Opened here, on a plain thread, before any runtime exists.
    let mut engines = Vec::with_capacity(workers.len());
    for o in workers {
        engines.push(Engine::open(db, o)?);
    }
    let Some(engine) = engines.first_mut() else { return Err(McpError::Runtime("no engine".into())) };
    match engine.authenticate(Some(&authorization))? {
        Ok(Principal::Subject { .. }) => {}
        Ok(Principal::Operator { .. }) => return Err(McpError::OperatorToken),
        Err(f) => return Err(McpError::Token(f.code())),
    }
    let tools = tools_of(engine);
    let lane = Pool::start(vec![Engine::open(db, lane)?], LANE_QUEUE).map_err(runtime)?;
    let pool = Pool::start(engines, queue).map_err(runtime)?;
    let session = crate::engine::ids::Ids::default().id("mcps");
    let gate = Gate {
        pool: Arc::new(pool),
        lane: Arc::new(lane),
        tools,
        auth: Auth::Fixed(Arc::new(authorization)),
        demo: false,
        session,
        shutdown: tokio_util::sync::CancellationToken::new(),
        grace,
    };
    let (pool, lane) = (gate.pool.clone(), gate.lane.clone());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| McpError::Runtime(e.to_string()))?;
    let stop = gate.shutdown.clone();
    let queued = pool.clone();
    let served = rt.block_on(async move {
        let runtime = |e: &dyn std::fmt::Display| McpError::Runtime(e.to_string());
        // SIGTERM or SIGINT (a harness stopping its server: the Python SDK
        // closes stdin, then sends SIGTERM 2 s later) is a shutdown, as the end
        // of input is: stop reading, let calls in flight reach their next
        // durable step within the grace period, start nothing queued.
        let signalled = crate::shutdown::shutdown_signal().map_err(|e| runtime(&e))?;
        tokio::spawn({
            let stop = stop.clone();
            async move {
                tokio::select! {
                    () = signalled => tracing::info!("signal: stopping"),
                    () = stop.cancelled() => {}
                }
                stop.cancel();
            }
        });
        tokio::spawn({
            let stop = stop.clone();
            async move {
                stop.cancelled().await;
                queued.discard_queued();
            }
        });
        let (transport, flush) = wire::Stdio::start(stop.clone()).map_err(|e| runtime(&e))?;
        let running = match gate.serve(transport).await {
            Ok(r) => r,
            // Stopped before the client initialized: nothing to serve.
            Err(_) if stop.is_cancelled() => {
                flush.finish(Duration::from_secs(5)).await;
                return Ok(());
            }
            Err(e) => return Err(runtime(&e)),
        };
        let waited = running.waiting().await;
        // Every answer queued (the detached calls' last ones too) reaches
        // stdout before the runtime stops.
        flush.finish(Duration::from_secs(5)).await;
        waited.map_err(|e| runtime(&e))?;
        Ok::<_, McpError>(())
    });
    rt.shutdown_timeout(Duration::from_millis(500));
    // The handlers waited out the grace period and detached what still ran:
    // whatever a thread is still doing is recorded already.
    pool.close_within(Duration::from_millis(250));
    lane.close_within(Duration::from_millis(250));
    served
}

/// Every catalog tool of `engine`'s catalog as an MCP tool, plus
/// `query_operation_status`.
pub(crate) fn tools_of(engine: &Engine) -> Arc<Vec<Tool>> {
    Arc::new(engine.contracts().all().iter().map(mcp_tool).chain([query_tool()]).collect())
}

/// `/mcp` for `toolgate serve`: MCP over streamable HTTP on the server's
/// engine pool, one session per client (rmcp's in-memory session manager).
/// The token comes with every request (checked by the server before the
/// request reaches rmcp, and again by each call); `ct` ends every session at
/// shutdown. Host validation (rmcp's guard against DNS rebinding) stays on
/// for a loopback server and is off with `--public`, where the bearer token
/// is what admits a caller.
pub(crate) fn http_service(
    pool: Arc<Pool>,
    lane: Arc<Pool>,
    tools: Arc<Vec<Tool>>,
    demo: bool,
    public: bool,
    ct: tokio_util::sync::CancellationToken,
) -> StreamableHttpService<Gate, LocalSessionManager> {
    let mut config = StreamableHttpServerConfig::default()
        .with_cancellation_token(ct.clone())
        .with_max_request_body_bytes(crate::MAX_BODY_BYTES);
    if public {
        config = config.disable_allowed_hosts();
    }
    let factory = move || {
        Ok(Gate {
            pool: pool.clone(),
            lane: lane.clone(),
            tools: tools.clone(),
            auth: Auth::PerRequest,
            demo,
            session: crate::engine::ids::Ids::default().id("mcph"),
            shutdown: ct.clone(),
            grace: HTTP_GRACE,
        })
    };
    StreamableHttpService::new(factory, Arc::new(LocalSessionManager::default()), config)
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
    tool.output_schema = Some(Arc::new(result_schema(Some(&c.output_schema))));
    tool
}

/// The schema of a call's structured content: the model result, whose
/// `data` on a success (not a person's resolution) is the contract's output
/// (`output`; any object when `None`: the status query answers for any tool).
/// Every result, refusals of the server's own included, has this shape.
fn result_schema(output: Option<&Value>) -> JsonObject {
    let recoveries = [
        "correct_input",
        "none",
        "request_authorization",
        "human_review",
        "request_approval",
        "retry_after",
        "query_status",
    ];
    let error = json!({
        "type": "object",
        "required": ["code", "category", "recovery", "retryable", "message"],
        "additionalProperties": false,
        "properties": {
            "code": {"type": "string"},
            "category": {"type": "string"},
            "recovery": {"enum": recoveries},
            "retryable": {"type": "boolean"},
            "retry_after_ms": {"type": ["integer", "null"], "minimum": 0},
            "message": {"type": "string"},
            "detail": {},
        },
    });
    let schema = json!({
        "type": "object",
        "required": ["status", "data", "error", "execution"],
        "additionalProperties": false,
        "properties": {
            "status": {"enum": ["succeeded", "failed", "unknown"]},
            "data": {"type": ["object", "null"]},
            "error": {"anyOf": [{"type": "null"}, error]},
            "execution": {
                "type": "object",
                "required": ["outcome", "delivery"],
                "additionalProperties": false,
                "properties": {
                    "outcome": {"enum": ["committed", "not_started", "unknown"]},
                    "delivery": {"enum": ["fresh", "local_replay", "receipt_reconciled", "human_resolved"]},
                },
            },
        },
        "if": {"properties": {
            "status": {"const": "succeeded"},
            "execution": {"properties": {"delivery": {"not": {"const": "human_resolved"}}}},
        }},
        "then": {"properties": {"data": output.cloned().unwrap_or_else(|| json!({"type": "object"}))}},
    });
    schema.as_object().cloned().unwrap_or_default()
}

const KEY_DESCRIPTION: &str =
    "Idempotency key: generate it once per business intent (for example one per action you mean to take; \
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
    tool.output_schema = Some(Arc::new(result_schema(None)));
    tool
}

/// Where a call's token comes from.
#[derive(Clone)]
enum Auth {
    /// stdio: the `--token` the server was started with.
    Fixed(Arc<Vec<u8>>),
    /// HTTP: the `Authorization` header of the request that carries the call.
    PerRequest,
}

/// One MCP server session: the tools, the engine pool, the caller's token.
#[derive(Clone)]
pub(crate) struct Gate {
    pool: Arc<Pool>,
    /// Cancellations only, on an engine of their own: a cancellation never
    /// queues behind the calls (possibly the very one) it cancels.
    lane: Arc<Pool>,
    tools: Arc<Vec<Tool>>,
    auth: Auth,
    /// A demo ledger behind HTTP: a request's `Toolgate-Fault` header is
    /// honoured, as on the API's call endpoint (the server refused it before
    /// rmcp saw the request on any other ledger).
    demo: bool,
    /// The call identity's `response_id` when the transport has no session id.
    session: String,
    /// The server is stopping (stdio: a signal or the end of input; HTTP:
    /// `serve`'s shutdown): a call's request ending now is not its client's
    /// cancellation.
    shutdown: tokio_util::sync::CancellationToken,
    /// How long a call in flight may run on once the server is stopping.
    grace: Duration,
}

/// A failure of the server's own (a refused token, a busy engine), in the
/// model result's shape.
fn refusal(code: &str, category: &str, recovery: &str, message: &str) -> CallToolResult {
    let env = crate::status::envelope_json(code, category, recovery, message, None, false);
    CallToolResult::structured_error(env["model_result"].clone())
}

fn result_of(env: &Envelope) -> CallToolResult {
    let model = serde_json::to_value(&env.model_result).unwrap_or(Value::Null);
    let mut r = if env.model_result.status == Status::Succeeded {
        CallToolResult::structured(model)
    } else {
        CallToolResult::structured_error(model)
    };
    // For the harness, not the model: what settles an OUTCOME_UNKNOWN later.
    let a = &env.protected_audit;
    let mut meta = JsonObject::new();
    let mut put = |k: &str, v: Option<&String>| {
        if let Some(v) = v {
            meta.insert(format!("toolgate/{k}"), Value::from(v.as_str()));
        }
    };
    put("operation_id", a.operation_id.as_ref());
    put("status_ref", a.downstream.status_ref.as_ref());
    put("request_sha256", a.binding.request_sha256.as_ref());
    if !meta.is_empty() {
        r.meta = Some(MetaObject(meta));
    }
    r
}

/// An environment failure: the ledger is the truth, the outcome unknown to
/// us; a retry with the same key is safe.
fn environment(e: &EngineError) -> CallToolResult {
    let env = crate::status::envelope_json(
        e.code(),
        "environment",
        "retry_after",
        crate::status::INTERNAL.message,
        Some(1000),
        true,
    );
    CallToolResult::structured_error(env["model_result"].clone())
}

/// One `tools/call`, ready to run on an engine (by a worker, or by the
/// cancellation lane when its client cancelled it before its accept).
struct Prepared {
    authorization: Vec<u8>,
    name: String,
    args: JsonObject,
    key: Option<String>,
    call: CallIdentity,
    /// A demo ledger's `Toolgate-Fault` header (checked by the server before rmcp saw it).
    faults: Option<String>,
}

impl Prepared {
    fn run(&self, e: &mut Engine, signal: &CancelSignal) -> Result<CallToolResult, EngineError> {
        let (tenant, subject, token_id) = match e.authenticate(Some(&self.authorization))? {
            Ok(Principal::Subject { tenant, subject, token_id }) => (tenant, subject, token_id),
            Ok(Principal::Operator { .. }) => {
                let c = crate::status::SUBJECT_TOKEN_REQUIRED;
                return Ok(refusal(c.code, c.category, c.recovery, c.message));
            }
            Err(f) => return Ok(refusal(f.code(), "authentication", "request_authorization", f.message())),
        };
        let text = |k: &str| match self.args.get(k) {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        let env = if self.name == QUERY_STATUS_TOOL {
            e.query_operation_status(&QueryRequest {
                tenant,
                subject,
                status_ref: text("status_ref"),
                expected_request_sha256: text("expected_request_sha256"),
                idempotency_key: None,
                call: Some(self.call.clone()),
                operator: None,
            })?
        } else {
            let arguments = serde_json::to_vec(&self.args).unwrap_or_default();
            if let Some(f) = self.faults.as_deref().and_then(|spec| FaultPlan::parse(spec).ok()) {
                e.set_faults(f);
            }
            let note = format!("notifications/cancelled from the caller {subject}");
            let req = DispatchRequest {
                tenant,
                subject,
                tool: self.name.clone(),
                arguments,
                idempotency_key: self.key.clone(),
                call: Some(self.call.clone()),
                approval_id: None,
                deadline_ms: None,
                token_id: Some(token_id),
            };
            let env = e.dispatch_cancellable(&req, signal, CANCELLED_BY, &note);
            e.set_faults(FaultPlan::none());
            env?
        };
        Ok(result_of(&env))
    }
}

/// What the client's `notifications/cancelled` did.
enum Cancelled {
    /// The call's operation was cancelled (or moved to the unknown queue).
    Applied(&'static str),
    /// No operation yet: look again.
    NotYet,
    /// Nothing to cancel (a status query, a refused token, an operator token).
    Nothing,
}

impl Gate {
    /// The token of this call: the server's, or the HTTP request's header.
    fn authorization(&self, ctx: &RequestContext<RoleServer>) -> Vec<u8> {
        match &self.auth {
            Auth::Fixed(a) => a.as_ref().clone(),
            Auth::PerRequest => ctx
                .extensions
                .get::<Parts>()
                .and_then(|p| p.headers.get(axum::http::header::AUTHORIZATION))
                .map(|v| v.as_bytes().to_vec())
                .unwrap_or_default(),
        }
    }

    /// The call identity's `response_id`: the MCP session, as the transport names it.
    fn session_of(&self, ctx: &RequestContext<RoleServer>) -> String {
        ctx.extensions
            .get::<Parts>()
            .and_then(|p| p.headers.get("mcp-session-id"))
            .and_then(|v| v.to_str().ok())
            .filter(|s| !s.is_empty() && s.len() <= 128)
            .map_or_else(|| self.session.clone(), str::to_string)
    }

    async fn call(&self, request: CallToolRequestParams, ctx: &RequestContext<RoleServer>) -> CallToolResult {
        // JSON-RPC ids 13 and "13" are two requests: a string id is marked as
        // one (a number never starts with `str_`), so they never share a call id.
        let id = match serde_json::to_value(&ctx.id) {
            Ok(Value::String(s)) => format!("str_{s}"),
            Ok(v) => v.to_string(),
            Err(_) => String::new(),
        };
        let call = CallIdentity {
            provider: "mcp".into(),
            api_family: "tools/call".into(),
            response_id: self.session_of(ctx),
            call_id: format!("req_{id}"),
            adapter_revision: "1".into(),
        };
        let faults = if self.demo {
            ctx.extensions
                .get::<Parts>()
                .and_then(|p| p.headers.get("toolgate-fault"))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        } else {
            None
        };
        let name = request.name.to_string();
        let mut args = request.arguments.unwrap_or_default();
        // A key that is not a string stays in the arguments, where the
        // contract refuses it (INVALID_ARGUMENTS) like any other stray field.
        let key = match args.get(KEY_ARGUMENT) {
            Some(Value::String(_)) => args.remove(KEY_ARGUMENT).and_then(|v| v.as_str().map(str::to_string)),
            _ => None,
        };
        let prepared = Arc::new(Prepared { authorization: self.authorization(ctx), name, args, key, call, faults });
        let signal = CancelSignal::default();
        let busy = || {
            let c = crate::status::SERVER_BUSY;
            refusal(c.code, c.category, c.recovery, c.message)
        };
        let job = {
            let (prepared, signal) = (prepared.clone(), signal.clone());
            move |e: &mut Engine| prepared.run(e, &signal)
        };
        let Ok(mut answer) = self.pool.submit(job) else { return busy() };
        // While the engine works: progress for a client that asked for it,
        // and the client's cancellation.
        let progress = ctx.meta.get_progress_token();
        let mut tick = tokio::time::interval(PROGRESS_EVERY);
        tick.tick().await;
        let mut sent: u32 = 0;
        let answered = loop {
            tokio::select! {
                a = &mut answer => break Some(a),
                () = self.shutdown.cancelled() => break None,
                () = ctx.ct.cancelled() => break None,
                _ = tick.tick(), if progress.is_some() => {
                    if let Some(token) = progress.clone() {
                        sent += 1;
                        let mut p = ProgressNotificationParam::new(token, f64::from(sent));
                        p.message = Some("waiting for the downstream's answer".into());
                        let _ = ctx.peer.notify_progress(p).await;
                    }
                }
            }
        };
        let Some(answered) = answered else {
            if self.shutdown.is_cancelled() {
                return self.stop(prepared, answer).await;
            }
            return self.cancel(&signal, prepared, answer).await;
        };
        match answered {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => environment(&e),
            Err(_) => busy(),
        }
    }

    /// The client cancelled its call. A call that has not reached its accept
    /// (still queued for an engine, or checking its arguments) is settled at
    /// once on the cancellation lane: accepted and cancelled in one
    /// transaction (`CANCELLED`, no effect, in the operator log as the
    /// client's), so when its queued job runs it only replays that. A call
    /// past its accept has its operation cancelled on the lane (after send:
    /// the unknown path), unless it finishes first. The client expects no
    /// answer to a cancelled request (rmcp drops it); the result says what
    /// happened, for the logs.
    async fn cancel(
        &self,
        signal: &CancelSignal,
        prepared: Arc<Prepared>,
        mut answer: tokio::sync::oneshot::Receiver<Result<CallToolResult, EngineError>>,
    ) -> CallToolResult {
        let Some(key) = prepared.key.clone().filter(|_| prepared.name != QUERY_STATUS_TOOL) else {
            return self.finish(answer).await;
        };
        if signal.cancel() {
            tracing::info!("MCP call cancelled by its client before its accept");
            let job = {
                let (prepared, signal) = (prepared.clone(), signal.clone());
                move |e: &mut Engine| prepared.run(e, &signal)
            };
            return match self.lane.submit(job) {
                Ok(rx) => match rx.await {
                    Ok(Ok(r)) => r,
                    Ok(Err(e)) => environment(&e),
                    Err(_) => self.finish(answer).await,
                },
                Err(_) => self.finish(answer).await,
            };
        }
        let started = tokio::time::Instant::now();
        loop {
            let (authorization, tool, key) = (prepared.authorization.clone(), prepared.name.clone(), key.clone());
            let job = move |e: &mut Engine| -> Result<Cancelled, EngineError> {
                let Ok(Principal::Subject { tenant, subject, .. }) = e.authenticate(Some(&authorization))? else {
                    return Ok(Cancelled::Nothing);
                };
                let note = format!("notifications/cancelled from the caller {subject}");
                Ok(match e.cancel_own_call(Scope::new(&tenant, &subject, &tool, &key), CANCELLED_BY, &note)? {
                    Some(o) => Cancelled::Applied(o.code),
                    None => Cancelled::NotYet,
                })
            };
            let done = match self.lane.submit(job) {
                Ok(rx) => rx.await.ok(),
                Err(_) => None,
            };
            match done {
                Some(Ok(Cancelled::Applied(code))) => {
                    tracing::info!(code, "MCP call cancelled by its client");
                    return self.finish(answer).await;
                }
                Some(Ok(Cancelled::Nothing)) => return self.finish(answer).await,
                Some(Err(e)) => tracing::warn!(code = e.code(), "MCP cancellation failed"),
                Some(Ok(Cancelled::NotYet)) => {}
                None => tracing::warn!("MCP cancellation: engine busy"),
            }
            // Its accept is being committed: look again in a moment (or take its end).
            if let Ok(done) = tokio::time::timeout(Duration::from_millis(50), &mut answer).await {
                return done.ok().and_then(Result::ok).unwrap_or_else(|| {
                    let c = crate::status::INTERNAL;
                    refusal(c.code, c.category, c.recovery, c.message)
                });
            }
            if started.elapsed() >= CANCEL_LOOKUP {
                return self.finish(answer).await;
            }
        }
    }

    /// The server is stopping while this call runs: its answer if it comes
    /// within the grace period (a call still queued is never started: the
    /// pool drops it); else the call is detached: its operation leaves
    /// `in_flight` now, through the cancellation path (before send:
    /// `CANCELLED`; after send: the unknown queue, settled by a status query),
    /// recorded in the operator log under `mcp-shutdown`, so nothing is left
    /// in flight for a lease expiry and a reap to find.
    async fn stop(
        &self,
        prepared: Arc<Prepared>,
        mut answer: tokio::sync::oneshot::Receiver<Result<CallToolResult, EngineError>>,
    ) -> CallToolResult {
        let nothing_done = || {
            let c = crate::status::SERVER_BUSY;
            refusal(c.code, c.category, c.recovery, c.message)
        };
        match tokio::time::timeout(self.grace, &mut answer).await {
            Ok(Ok(Ok(r))) => return r,
            Ok(Ok(Err(e))) => return environment(&e),
            Ok(Err(_)) => return nothing_done(),
            Err(_) => {}
        }
        let Some(key) = prepared.key.clone().filter(|_| prepared.name != QUERY_STATUS_TOOL) else {
            return nothing_done();
        };
        let (authorization, tool) = (prepared.authorization.clone(), prepared.name.clone());
        let job = move |e: &mut Engine| -> Result<Option<&'static str>, EngineError> {
            let Ok(Principal::Subject { tenant, subject, .. }) = e.authenticate(Some(&authorization))? else {
                return Ok(None);
            };
            let note = "the MCP server stopped (a signal or the end of its input) before the call finished";
            Ok(e.cancel_own_call(Scope::new(&tenant, &subject, &tool, &key), DETACHED_BY, note)?.map(|o| o.code))
        };
        let detached = match self.lane.submit(job) {
            Ok(rx) => rx.await.ok(),
            Err(_) => None,
        };
        tracing::warn!(?detached, "MCP call detached at shutdown");
        let c = crate::engine::envelope::Code::OutcomeUnknown;
        let (category, _, _) = c.catalog();
        let env = crate::status::envelope_json(c.as_str(), category, "query_status", c.message(), None, true);
        CallToolResult::structured_error(env["model_result"].clone())
    }

    /// The call's own answer, whenever the engine gives it.
    async fn finish(
        &self,
        answer: tokio::sync::oneshot::Receiver<Result<CallToolResult, EngineError>>,
    ) -> CallToolResult {
        if let Ok(Ok(r)) = answer.await {
            r
        } else {
            let c = crate::status::INTERNAL;
            refusal(c.code, c.category, c.recovery, c.message)
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
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        // Only the tools the token's subject holds a grant for (read now, on
        // the lane: a listing never waits behind calls); the status query
        // serves every agent. A token that no longer authenticates lists
        // nothing but the status query, and its calls are refused as ever.
        let authorization = self.authorization(&context);
        let names: Vec<String> =
            self.tools.iter().map(|t| t.name.to_string()).filter(|n| n != QUERY_STATUS_TOOL).collect();
        let job = move |e: &mut Engine| -> Result<Vec<String>, EngineError> {
            match e.authenticate(Some(&authorization))? {
                Ok(Principal::Subject { tenant, subject, .. }) => e.granted_tools(&tenant, &subject, &names),
                _ => Ok(Vec::new()),
            }
        };
        let granted = match self.lane.submit(job) {
            Ok(rx) => rx.await.ok().and_then(Result::ok).unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let tools = self
            .tools
            .iter()
            .filter(|t| t.name == QUERY_STATUS_TOOL || granted.iter().any(|g| *g == t.name))
            .cloned()
            .collect();
        Ok(ListToolsResult { tools, ..Default::default() })
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        Ok(self.call(request, &context).await.into())
    }
}
