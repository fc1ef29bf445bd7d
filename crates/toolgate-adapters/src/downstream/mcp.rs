//! The `mcp` adapter: an MCP server as a downstream, so toolgate is the
//! durable, exactly-once gate in front of the tools agents already have
//! (docs/catalog.md, "An MCP server as a downstream").
//!
//! toolgate is the MCP client here (rmcp's). A stdio server is started by
//! toolgate, and started again when it died; a streamable HTTP server is
//! reached at its URL. One server process (or HTTP session) per transport
//! serves every tool and every engine of the process. The engine's calls are
//! synchronous and the client is async: calls run on a small runtime of the
//! adapter's own while the engine's thread waits for the answer, bounded by
//! the attempt timeout.
//!
//! What a call's outcome is, by evidence:
//!
//! | what happened | reply |
//! |---|---|
//! | the server is not running and cannot be started; the transport was closed before the request was queued; a stdio write failed (the server never got the line whole) | not received (`Unavailable`): retried within the deadline |
//! | the server died or closed its stdout after the request was written; a streamable HTTP send failed | reply lost (`TimedOut`) |
//! | no answer within the attempt timeout | reply lost; the request is cancelled (`notifications/cancelled`) |
//! | `isError: true` | the tool failed, maybe after acting (`ToolFailed`: unknown), its content kept as evidence; `Rejected` (no effect) when the catalog says `is_error_means_not_committed` |
//! | JSON-RPC "method not found" or "invalid params" | refused before acting (`Rejected`) |
//! | another JSON-RPC error | may have acted (`ServerError`) |
//! | a result | `Committed`: `structuredContent` (or `{"content": [...]}`) as the result |
//!
//! A server that honours an idempotency key gets toolgate's downstream key in
//! the argument (`key_argument`) or `_meta` entry (`key_meta`) the catalog
//! names; with `downstream.lookup.by = resend` its unknown outcomes are then
//! asked by re-sending (the engine's, not this adapter's).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, ClientRequest, ErrorCode, RequestMetaObject, ServerResult,
};
use rmcp::service::{PeerRequestOptions, RunningService, ServiceError};
use rmcp::{RoleClient, ServiceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::engine::canonical::{canonical_string, sha256_hex};
use crate::engine::contracts::{Contract, DownstreamRef, Effect};
use crate::engine::tool::{
    Downstream, DownstreamContext, DownstreamError, DownstreamFactory, DownstreamRequest, Lookup, Receipt, Refusal,
    Reply,
};

/// The `downstream.mcp` section: which MCP server, and how a call is made of it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// A stdio server: its command and arguments (no shell). toolgate starts
    /// it on the first call, and again on the next call after it died. It
    /// inherits toolgate's environment, plus `env`. Exactly one of `command`
    /// and `url`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Variables added to a stdio server's environment (plain values: a
    /// secret is better left in toolgate's own environment, which it inherits).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Where a stdio server's standard error goes: appended to this file.
    /// Default: discarded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_file: Option<String>,
    /// A streamable HTTP server: its endpoint (`http://` or `https://`, the
    /// platform's roots trusted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// The environment variable that holds a bearer token for `url` (sent as
    /// `Authorization: Bearer ...`; never stored, traced or logged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_env: Option<String>,
    /// A file that holds the bearer token for `url` (read once per process,
    /// when the first engine opens the downstream; a trailing newline is
    /// dropped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bearer_file: Option<String>,
    /// The server's name for the tool. Default: the catalog tool's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// The argument that carries toolgate's downstream key, for a server
    /// tool that de-duplicates by it (the agent does not send it: it is not
    /// in the catalog's input schema, toolgate fills it in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_argument: Option<String>,
    /// The `_meta` entry that carries toolgate's downstream key, for a server
    /// that reads it there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_meta: Option<String>,
    /// A JSON pointer into the result to the server's own id of the effect
    /// (a message id, a charge id), recorded as the receipt id. Default: a
    /// digest of the key, the request and the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_id: Option<String>,
    /// The server documents that its tools fail before they act: an
    /// `isError` result is then a definitive failure, no effect (failed,
    /// BUSINESS_RULE_VIOLATION). Default false: a tool may fail after it acted
    /// (an exception after the email went out is also `isError`), so the
    /// outcome is unknown, its content kept as evidence.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_error_means_not_committed: bool,
    /// How long starting a stdio server (or opening the HTTP session) and its
    /// `initialize` handshake may take, in ms (default 10000). A call that
    /// finds no server within it was never sent.
    #[serde(default = "default_start_timeout", skip_serializing_if = "is_default_start_timeout")]
    #[schemars(range(min = 1))]
    pub start_timeout_ms: u64,
}

const DEFAULT_START_TIMEOUT_MS: u64 = 10_000;

fn default_start_timeout() -> u64 {
    DEFAULT_START_TIMEOUT_MS
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_default_start_timeout(v: &u64) -> bool {
    *v == DEFAULT_START_TIMEOUT_MS
}

/// The JSON Schema of the `downstream.mcp` section, derived from [`McpConfig`].
pub fn mcp_section_schema() -> Value {
    serde_json::to_value(schemars::schema_for!(McpConfig)).unwrap_or(Value::Null)
}

fn mcp_validator() -> Option<&'static jsonschema::Validator> {
    static V: OnceLock<Option<jsonschema::Validator>> = OnceLock::new();
    V.get_or_init(|| jsonschema::validator_for(&mcp_section_schema()).ok()).as_ref()
}

impl McpConfig {
    /// Parses and checks a section, every problem at once (its shape, then
    /// its rules); never empty on `Err`.
    pub fn parse_all(d: &DownstreamRef) -> Result<McpConfig, Vec<(String, String)>> {
        let Some(v) = &d.mcp else {
            return Err(vec![("mcp".into(), "the mcp adapter needs an `mcp` section".into())]);
        };
        let shape = mcp_validator()
            .map(|val| crate::engine::contracts::shape_problems(val, &mcp_section_schema(), v, "mcp"))
            .unwrap_or_default();
        if !shape.is_empty() {
            return Err(shape);
        }
        let c: McpConfig = serde_path_to_error::deserialize(v.clone())
            .map_err(|e| vec![(format!("mcp.{}", e.path()), e.into_inner().to_string())])?;
        c.rules().map_err(|one| vec![one])?;
        Ok(c)
    }

    fn rules(&self) -> Result<(), (String, String)> {
        match (self.command.is_empty(), &self.url) {
            (false, None) => {
                if self.command[0].is_empty() {
                    return Err(("mcp.command".into(), "the first word is the program".into()));
                }
                if self.bearer_env.is_some() || self.bearer_file.is_some() {
                    return Err(("mcp".into(), "a bearer token is for a server reached by url".into()));
                }
            }
            (true, Some(u)) => {
                if !(u.starts_with("http://") || u.starts_with("https://")) {
                    return Err(("mcp.url".into(), "must start with http:// or https://".into()));
                }
                if !self.env.is_empty() || self.stderr_file.is_some() {
                    return Err((
                        "mcp".into(),
                        "env and stderr_file are for a server toolgate starts (command)".into(),
                    ));
                }
                if self.bearer_env.is_some() && self.bearer_file.is_some() {
                    return Err(("mcp".into(), "give at most one of bearer_env and bearer_file".into()));
                }
            }
            _ => return Err(("mcp".into(), "give exactly one of command (stdio) and url (streamable HTTP)".into())),
        }
        if self.key_argument.is_some() && self.key_meta.is_some() {
            return Err(("mcp".into(), "give at most one of key_argument and key_meta".into()));
        }
        if [&self.key_argument, &self.key_meta, &self.tool].into_iter().flatten().any(String::is_empty) {
            return Err(("mcp".into(), "tool, key_argument and key_meta are not empty when given".into()));
        }
        if self.receipt_id.as_deref().is_some_and(|p| !p.starts_with('/')) {
            return Err(("mcp.receipt_id".into(), "a JSON pointer into the result (starts with /)".into()));
        }
        Ok(())
    }

    /// What identifies the server: tools whose sections share it share one
    /// process (or session).
    fn transport_key(&self) -> String {
        canonical_string(&json!({
            "command": self.command, "env": self.env, "stderr_file": self.stderr_file,
            "url": self.url, "bearer_env": self.bearer_env, "bearer_file": self.bearer_file,
            "start_timeout_ms": self.start_timeout_ms,
        }))
    }
}

/// The `mcp` adapter factory. Clones share their servers: one process per
/// stdio command, one session per URL, for every engine opened from it.
#[derive(Clone, Default)]
pub struct McpAdapter {
    hub: Arc<Hub>,
}

impl std::fmt::Debug for McpAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.hub.servers.lock().map_or(0, |s| s.len());
        f.debug_struct("McpAdapter").field("servers", &n).finish()
    }
}

impl McpAdapter {
    fn check_parsed(contract: &Contract, c: &McpConfig) -> Result<(), (String, String)> {
        let d = &contract.downstream;
        if d.http.is_some() {
            return Err(("http".into(), "only the http adapter takes http settings".into()));
        }
        let key = c.key_argument.as_ref().or(c.key_meta.as_ref());
        if contract.effect == Effect::Read {
            if key.is_some() {
                return Err(("mcp".into(), "a read tool is sent no key: drop key_argument and key_meta".into()));
            }
        } else if d.dedupes_keys && key.is_none() {
            return Err((
                "dedupes_keys".into(),
                "the server cannot de-duplicate a key it is never sent: name the argument (mcp.key_argument) or _meta entry (mcp.key_meta) that carries it".into(),
            ));
        }
        if let Some(arg) = &c.key_argument {
            if contract.input_schema.get("properties").and_then(|p| p.get(arg)).is_some() {
                return Err((
                    "mcp.key_argument".into(),
                    format!("{arg:?} is filled in by toolgate with its downstream key: remove it from input_schema (the agent does not send it)"),
                ));
            }
        }
        Ok(())
    }
}

impl DownstreamFactory for McpAdapter {
    fn check(&self, contract: &Contract) -> Result<(), (String, String)> {
        match self.check_all(contract).into_iter().next() {
            Some(first) => Err(first),
            None => Ok(()),
        }
    }

    fn check_all(&self, contract: &Contract) -> Vec<(String, String)> {
        match McpConfig::parse_all(&contract.downstream) {
            Err(all) => all,
            Ok(c) => Self::check_parsed(contract, &c).err().into_iter().collect(),
        }
    }

    fn open(&self, d: &DownstreamRef, _ctx: &DownstreamContext<'_>) -> Result<Box<dyn Downstream>, DownstreamError> {
        let setup = |reason: String| DownstreamError::Setup { name: d.name.clone(), reason };
        let cfg = McpConfig::parse_all(d).map_err(|mut all| {
            let (f, why) = all.remove(0);
            setup(format!("{f}: {why}"))
        })?;
        let server = self.hub.server(&cfg).map_err(setup)?;
        Ok(Box::new(Mcp { server, cfg }))
    }
}

/// The adapter's runtime and its servers.
#[derive(Default)]
struct Hub {
    rt: OnceLock<Result<tokio::runtime::Runtime, String>>,
    servers: Mutex<HashMap<String, Arc<Server>>>,
}

impl Drop for Hub {
    fn drop(&mut self) {
        // Never blocks (a factory may be dropped inside an async context);
        // a stdio server sees its stdin close and exits.
        if let Some(Ok(rt)) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Hub {
    fn handle(&self) -> Result<tokio::runtime::Handle, String> {
        let rt = self.rt.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("toolgate-mcp")
                .enable_all()
                .build()
                .map_err(|e| format!("the MCP client's runtime did not start ({})", e.kind()))
        });
        rt.as_ref().map(|r| r.handle().clone()).map_err(Clone::clone)
    }

    fn server(&self, cfg: &McpConfig) -> Result<Arc<Server>, String> {
        let handle = self.handle()?;
        let key = cfg.transport_key();
        let mut servers = self.servers.lock().map_err(|_| "the MCP adapter's state is poisoned".to_string())?;
        if let Some(s) = servers.get(&key) {
            return Ok(s.clone());
        }
        let bearer = match (&cfg.bearer_env, &cfg.bearer_file) {
            (Some(var), _) => Some(std::env::var(var).map_err(|_| format!("mcp.bearer_env: {var} is not set"))?),
            (None, Some(file)) => Some(
                std::fs::read_to_string(file)
                    .map_err(|e| format!("mcp.bearer_file: the file cannot be read ({})", e.kind()))?
                    .trim_end_matches(['\n', '\r'])
                    .to_string(),
            ),
            (None, None) => None,
        };
        let s = Arc::new(Server {
            transport: if cfg.command.is_empty() {
                Transport::Http { url: cfg.url.clone().unwrap_or_default(), bearer }
            } else {
                Transport::Stdio { command: cfg.command.clone(), env: cfg.env.clone(), stderr: cfg.stderr_file.clone() }
            },
            start_timeout: Duration::from_millis(cfg.start_timeout_ms),
            client: tokio::sync::Mutex::new(None),
            handle,
        });
        servers.insert(key, s.clone());
        Ok(s)
    }
}

enum Transport {
    Stdio { command: Vec<String>, env: BTreeMap<String, String>, stderr: Option<String> },
    Http { url: String, bearer: Option<String> },
}

/// One MCP server (a supervised child, or an HTTP session).
struct Server {
    transport: Transport,
    start_timeout: Duration,
    client: tokio::sync::Mutex<Option<RunningService<RoleClient, ()>>>,
    handle: tokio::runtime::Handle,
}

/// How one call went, by evidence.
enum CallOutcome {
    /// Never written: the server is not there, or did not get the request whole.
    NotSent(String),
    /// Written, no answer (the server died, closed its output, or was too slow).
    Lost,
    /// No answer within the timeout; the request was cancelled.
    TimedOut,
    /// A JSON-RPC error answer.
    Protocol(ErrorCode, String),
    /// An answer that is not a tool result.
    Unexpected,
    /// The tool's result.
    Result(Box<CallToolResult>),
}

impl Server {
    /// The running client, started (again) if there is none or it died.
    async fn peer(&self) -> Result<rmcp::Peer<RoleClient>, String> {
        let mut client = self.client.lock().await;
        if let Some(c) = client.as_ref() {
            if !c.peer().is_transport_closed() {
                return Ok(c.peer().clone());
            }
            tracing::warn!("the MCP server's connection closed; starting it again");
        }
        // Dropping the old client kills a stdio server that still runs (one
        // that closed its output but not its input).
        *client = None;
        let started = tokio::time::timeout(self.start_timeout, self.start()).await;
        let c = match started {
            Ok(Ok(c)) => c,
            Ok(Err(why)) => return Err(why),
            Err(_) => return Err(format!("the MCP server did not start within {} ms", self.start_timeout.as_millis())),
        };
        let peer = c.peer().clone();
        *client = Some(c);
        Ok(peer)
    }

    async fn start(&self) -> Result<RunningService<RoleClient, ()>, String> {
        match &self.transport {
            Transport::Stdio { command, env, stderr } => {
                use rmcp::transport::TokioChildProcess;
                let mut cmd = tokio::process::Command::new(&command[0]);
                cmd.args(&command[1..]).envs(env);
                let err: std::process::Stdio = match stderr {
                    Some(path) => std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                        .map_err(|e| format!("mcp.stderr_file cannot be opened ({})", e.kind()))?
                        .into(),
                    None => std::process::Stdio::null(),
                };
                let (transport, _) = TokioChildProcess::builder(cmd)
                    .stderr(err)
                    .spawn()
                    .map_err(|e| format!("the MCP server's command did not start ({})", e.kind()))?;
                ().serve(transport).await.map_err(|e| format!("the MCP server did not initialize: {e}"))
            }
            Transport::Http { url, bearer } => {
                use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
                use rmcp::transport::StreamableHttpClientTransport;
                if rustls::crypto::CryptoProvider::get_default().is_none() {
                    // The process's TLS provider (ring, as everywhere in
                    // toolgate): the HTTP client builds its TLS settings even
                    // for http:// and has none of its own.
                    // (Deprecated from rustls 0.23.48 for want of post-quantum
                    // key exchange; ring is what ureq and the rest of toolgate
                    // use, and they move to another provider together.)
                    #[allow(deprecated)]
                    let _ = rustls::crypto::ring::default_provider().install_default();
                }
                let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                if let Some(b) = bearer {
                    config = config.auth_header(b.clone());
                }
                ().serve(StreamableHttpClientTransport::from_config(config))
                    .await
                    .map_err(|e| format!("the MCP server did not initialize: {}", redact_url(&e.to_string())))
            }
        }
    }

    async fn call(
        &self,
        params: CallToolRequestParams,
        timeout: Duration,
        abandoned: &std::sync::atomic::AtomicBool,
    ) -> CallOutcome {
        let peer = match self.peer().await {
            Ok(p) => p,
            Err(why) => return CallOutcome::NotSent(why),
        };
        // The engine stopped waiting (a server slow to start): it holds the
        // call as unknown already, and it is not sent after that.
        if abandoned.load(std::sync::atomic::Ordering::SeqCst) {
            return CallOutcome::NotSent("the caller stopped waiting before it was sent".into());
        }
        let stdio = matches!(self.transport, Transport::Stdio { .. });
        let req = ClientRequest::CallToolRequest(CallToolRequest::new(params));
        let handle = match peer.send_cancellable_request(req, PeerRequestOptions::with_timeout(timeout)).await {
            Ok(h) => h,
            // Refused before it was queued for the transport.
            Err(e) => return CallOutcome::NotSent(format!("not sent: {e}")),
        };
        match handle.await_response().await {
            Ok(ServerResult::CallToolResult(r)) => CallOutcome::Result(Box::new(r)),
            // The untagged result may decode as another shape (a result
            // with no content); read it as a tool result if it is one.
            Ok(other) => match serde_json::to_value(&other).ok().and_then(|v| serde_json::from_value(v).ok()) {
                Some(r) => CallOutcome::Result(Box::new(r)),
                None => CallOutcome::Unexpected,
            },
            Err(ServiceError::Timeout { .. }) => CallOutcome::TimedOut,
            // A stdio write that failed: the server's input is closed, so
            // it never read the line whole. Over HTTP a send may fail after
            // the server got the request: lost, not "not sent".
            Err(ServiceError::TransportSend(e)) if stdio => CallOutcome::NotSent(format!("the write failed: {e}")),
            Err(ServiceError::McpError(e)) => CallOutcome::Protocol(e.code, e.message.to_string()),
            Err(_) => CallOutcome::Lost,
        }
    }
}

/// A URL in an error message loses its query (a token may sit there).
fn redact_url(s: &str) -> String {
    s.split_whitespace()
        .map(|w| match w.split_once('?') {
            Some((base, _)) if w.contains("://") => format!("{base}?[redacted]"),
            _ => w.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One engine's handle on an MCP downstream.
struct Mcp {
    server: Arc<Server>,
    cfg: McpConfig,
}

impl std::fmt::Debug for Mcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mcp").field("tool", &self.cfg.tool).finish_non_exhaustive()
    }
}

impl Mcp {
    fn params(&self, key: &str, req: &DownstreamRequest) -> CallToolRequestParams {
        let name = self.cfg.tool.clone().unwrap_or_else(|| req.tool.clone());
        let mut args = req.arguments.as_object().cloned().unwrap_or_default();
        let mut params = CallToolRequestParams::new(name);
        if !key.is_empty() {
            if let Some(a) = &self.cfg.key_argument {
                args.insert(a.clone(), Value::String(key.to_string()));
            }
            if let Some(m) = &self.cfg.key_meta {
                let mut meta = serde_json::Map::new();
                meta.insert(m.clone(), Value::String(key.to_string()));
                params.meta = Some(RequestMetaObject::from(meta));
            }
        }
        params.arguments = Some(args);
        params
    }

    fn reply(&self, key: &str, req: &DownstreamRequest, sent: CallOutcome) -> Reply {
        match sent {
            CallOutcome::NotSent(why) => {
                tracing::warn!(tool = %req.tool, %why, "MCP call not sent");
                Reply::Unavailable { retry_after_ms: None }
            }
            CallOutcome::Lost | CallOutcome::TimedOut => Reply::TimedOut,
            CallOutcome::Unexpected => Reply::Malformed,
            // The server says the call was not one it could run: no effect.
            CallOutcome::Protocol(code, msg)
                if code == ErrorCode::METHOD_NOT_FOUND || code == ErrorCode::INVALID_PARAMS =>
            {
                let refusal = Refusal::of_body(0, msg.as_bytes(), &[]);
                Reply::Rejected { reason: msg, refusal: Some(refusal) }
            }
            CallOutcome::Protocol(..) => Reply::ServerError,
            CallOutcome::Result(r) if r.is_error == Some(true) => {
                // A tool failure: its content is the evidence (digest and a
                // redacted excerpt traced, as an HTTP refusal's body). It may
                // have acted before it failed, unless the catalog says the
                // server's tools fail before acting.
                let content = serde_json::to_vec(&r.content).unwrap_or_default();
                let text: Vec<String> = r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect();
                let mut refusal = Refusal::of_body(0, text.join(" ").as_bytes(), &[]);
                refusal.body_sha256 = sha256_hex(&content);
                if self.cfg.is_error_means_not_committed {
                    Reply::Rejected { reason: text.join(" "), refusal: Some(refusal) }
                } else {
                    Reply::ToolFailed(refusal)
                }
            }
            CallOutcome::Result(r) => {
                let result = match r.structured_content {
                    Some(v) => v,
                    None => json!({ "content": serde_json::to_value(&r.content).unwrap_or(Value::Null) }),
                };
                let own_id = self
                    .cfg
                    .receipt_id
                    .as_deref()
                    .and_then(|p| result.pointer(p))
                    .and_then(|v| v.as_str().map(str::to_string).or_else(|| v.as_i64().map(|n| n.to_string())));
                let derived = || {
                    let d =
                        sha256_hex(format!("{key}\n{}\n{}", req.request_sha256, canonical_string(&result)).as_bytes());
                    format!("mcp_{}", &d[..24])
                };
                let receipt_id = own_id.unwrap_or_else(derived);
                Reply::Committed(Receipt {
                    request_id: receipt_id.clone(),
                    receipt_id,
                    body_sha256: None,
                    // The answer to the request that carried the key.
                    key: (!key.is_empty() && (self.cfg.key_argument.is_some() || self.cfg.key_meta.is_some()))
                        .then(|| key.to_string()),
                    result,
                    headers: Vec::new(),
                })
            }
        }
    }
}

impl Downstream for Mcp {
    fn execute(&mut self, key: &str, req: &DownstreamRequest) -> Result<Reply, DownstreamError> {
        let params = self.params(key, req);
        let timeout = Duration::from_millis(req.timeout_ms.max(1));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let server = self.server.clone();
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = abandoned.clone();
        self.server.handle.spawn(async move {
            let _ = tx.send(server.call(params, timeout, &flag).await);
        });
        // The call is bounded by its own timeout once sent, and its server's
        // start by start_timeout; this bound guards against a runtime that
        // stopped or a queue behind a restart. Past it the call counts as
        // lost (it may have been sent); one still waiting for its server is
        // not sent after that.
        let bound = timeout + self.server.start_timeout + Duration::from_secs(5);
        let sent = rx.recv_timeout(bound).unwrap_or_else(|_| {
            abandoned.store(true, std::sync::atomic::Ordering::SeqCst);
            CallOutcome::Lost
        });
        Ok(self.reply(key, req, sent))
    }

    fn lookup(&mut self, _key: &str, _timeout_ms: u64) -> Result<Lookup, DownstreamError> {
        // MCP has no "what happened under this key": a server that
        // de-duplicates is asked by re-sending (downstream.lookup).
        Ok(Lookup::Unsupported)
    }
}

/// One tool a server lists, as `catalog import-mcp` writes it.
#[derive(Debug, Clone)]
pub struct ListedTool {
    /// The server's name for it.
    pub name: String,
    /// Its description.
    pub description: String,
    /// Its input schema.
    pub input_schema: Value,
    /// Its output schema, when it declares one.
    pub output_schema: Option<Value>,
    /// `annotations.readOnlyHint`.
    pub read_only: bool,
}

/// Lists the tools of a server (`tools/list`, every page), for `catalog import-mcp`.
pub fn list_tools(section: &Value, timeout_ms: u64) -> Result<Vec<ListedTool>, String> {
    let cfg: McpConfig = serde_json::from_value(section.clone()).map_err(|e| e.to_string())?;
    cfg.rules().map_err(|(f, why)| format!("{f}: {why}"))?;
    let hub = Hub::default();
    let server = hub.server(&cfg)?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let s = server.clone();
    server.handle.spawn(async move {
        let listed = async {
            let peer = s.peer().await?;
            tokio::time::timeout(Duration::from_millis(timeout_ms), peer.list_all_tools())
                .await
                .map_err(|_| format!("tools/list took longer than {timeout_ms} ms"))?
                .map_err(|e| format!("tools/list failed: {e}"))
        }
        .await;
        // Close the session (a stdio server is stopped) before answering.
        if let Some(c) = s.client.lock().await.take() {
            let _ = c.cancel().await;
        }
        let _ = tx.send(listed);
    });
    let tools = rx
        .recv_timeout(Duration::from_millis(timeout_ms) + server.start_timeout + Duration::from_secs(5))
        .map_err(|e| match e {
        std::sync::mpsc::RecvTimeoutError::Timeout => "the MCP server did not answer in time".to_string(),
        std::sync::mpsc::RecvTimeoutError::Disconnected => "the MCP client failed".to_string(),
    })??;
    Ok(tools
        .into_iter()
        .map(|t| ListedTool {
            name: t.name.to_string(),
            description: t.description.map(|d| d.to_string()).unwrap_or_default(),
            input_schema: Value::Object((*t.input_schema).clone()),
            output_schema: t.output_schema.map(|o| Value::Object((*o).clone())),
            read_only: t.annotations.and_then(|a| a.read_only_hint).unwrap_or(false),
        })
        .collect())
}

/// What `catalog import-mcp` is told beside the server's own word.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The `mcp` section every file gets (the transport).
    pub section: Value,
    /// Prefix of the downstream names (`PREFIX_TOOL`).
    pub prefix: String,
    /// The argument the server's tools de-duplicate by, as the operator says.
    pub key_argument: Option<String>,
    /// How long the server remembers a key, as the operator says.
    pub key_retention_ms: u64,
}

/// Likely names of an idempotency key argument (only a hint: the operator says).
const KEY_LIKE: [&str; 4] = ["idempotency_key", "idempotencyKey", "idempotency-key", "request_key"];

/// A catalog name from a server's tool name: lowercase letters, digits and
/// `_`, starting with a letter, at most 64.
fn catalog_name(s: &str) -> String {
    let mut n: String =
        s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).collect();
    if !n.starts_with(|c: char| c.is_ascii_lowercase()) {
        n.insert_str(0, "t_");
    }
    n.truncate(64);
    n
}

/// One catalog file for a listed tool, with what a person should review.
/// The effect class is proposed from the server's word and the operator's,
/// never more: `readOnlyHint` is read; a tool with the operator's
/// `key_argument` is `write` (asked by re-sending); anything else is
/// `external` (a lost reply goes to human review, never re-sent).
pub fn catalog_file(t: &ListedTool, o: &ImportOptions) -> (String, Value, Vec<String>) {
    let name = catalog_name(&t.name);
    let mut notes = Vec::new();
    let mut input = t.input_schema.clone();
    let mut section = o.section.clone();
    if name != t.name {
        section["tool"] = Value::String(t.name.clone());
        notes.push(format!("named {name} here (the server calls it {:?})", t.name));
    }
    let has = |arg: &str| input.get("properties").and_then(|p| p.get(arg)).is_some();
    let keyed = !t.read_only && o.key_argument.as_deref().is_some_and(has);
    // The argument toolgate fills with its downstream key: the operator's, or
    // one that looks like a key (sent either way, harmless if the server
    // ignores it, and `idempotency_key` is the agent's own name over MCP).
    let key_arg = if t.read_only {
        None
    } else if keyed {
        o.key_argument.clone()
    } else {
        KEY_LIKE.iter().find(|k| has(k)).map(ToString::to_string)
    };
    if let Some(arg) = &key_arg {
        // toolgate fills the key in: the agent no longer sends it.
        if let Some(p) = input.get_mut("properties").and_then(Value::as_object_mut) {
            p.remove(arg);
        }
        if let Some(r) = input.get_mut("required").and_then(Value::as_array_mut) {
            r.retain(|v| v.as_str() != Some(arg.as_str()));
        }
        section["key_argument"] = Value::String(arg.clone());
    }
    let effect = if t.read_only {
        notes.push(
            "read: the server marks it readOnlyHint, a hint the server gives: check that it acts on nothing (a read is sent no key and records nothing)".into(),
        );
        "read"
    } else if keyed {
        notes.push(format!(
            "write: you said the server de-duplicates by {:?} for {}s; toolgate fills it in and asks by re-sending",
            key_arg.clone().unwrap_or_default(),
            o.key_retention_ms / 1000
        ));
        "write"
    } else {
        notes.push(match &key_arg {
            Some(k) => format!(
                "external: toolgate fills {k:?} with its downstream key; if the server honours it as an idempotency key, import again with --key-argument {k}"
            ),
            None => "external: a lost reply goes to human review, never re-sent".into(),
        });
        "external"
    };
    let output = t.output_schema.clone().unwrap_or_else(|| {
        notes.push("no outputSchema: the result is {\"content\": [...]} as the server sends it".into());
        json!({"type": "object", "required": ["content"], "properties": {"content": {"type": "array"}}})
    });
    let mut downstream = json!({
        "name": catalog_name(&format!("{}_{}", o.prefix, name)),
        "adapter": "mcp",
        "dedupes_keys": keyed,
        "mcp": section,
    });
    if keyed {
        downstream["lookup"] = json!({"by": "resend", "key_retention_ms": o.key_retention_ms});
    }
    let file = json!({
        "name": name,
        "description": if t.description.is_empty() { format!("{} (imported from an MCP server)", t.name) } else { t.description.clone() },
        "revisions": {"input": 1, "output": 1, "effect": 1},
        "effect": effect,
        "risk": if t.read_only { "low" } else { "medium" },
        "downstream": downstream,
        "data_classification": "internal",
        "approval": {"policy": "never"},
        "retry": {"attempt_timeout_ms": 30_000, "deadline_ms": 120_000, "backoff_base_ms": 200, "backoff_cap_ms": 5000, "max_attempts": 3, "budget_percent": 20, "budget_burst": 10},
        "retention_ms": o.key_retention_ms.max(2_592_000_000),
        "input_schema": input,
        "output_schema": output,
    });
    (format!("{name}.json"), file, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(v: &Value) -> DownstreamRef {
        serde_json::from_value(json!({"name": "m", "adapter": "mcp", "mcp": v})).unwrap()
    }

    #[test]
    fn a_section_names_one_transport() {
        assert!(McpConfig::parse_all(&section(&json!({"command": ["srv"]}))).is_ok());
        assert!(McpConfig::parse_all(&section(&json!({"url": "http://127.0.0.1:1/mcp"}))).is_ok());
        for bad in [
            json!({}),
            json!({"command": ["srv"], "url": "http://x/mcp"}),
            json!({"url": "ftp://x"}),
            json!({"command": ["srv"], "bearer_env": "T"}),
            json!({"url": "http://x/mcp", "bearer_env": "T", "bearer_file": "f"}),
            json!({"command": ["srv"], "key_argument": "k", "key_meta": "m"}),
            json!({"command": ["srv"], "receipt_id": "id"}),
            json!({"command": ["srv"], "commands": ["x"]}),
        ] {
            assert!(McpConfig::parse_all(&section(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_url_in_an_error_loses_its_query() {
        assert_eq!(redact_url("error at https://h/mcp?token=abc now"), "error at https://h/mcp?[redacted] now");
    }
}
