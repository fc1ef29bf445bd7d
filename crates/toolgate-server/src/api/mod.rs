//! `toolgate serve`: the authenticated HTTP API for agents and operators
//! (axum on hyper and tokio). One process runs the API's engine threads
//! ([`pool`]), the outbox workers and the reaper.
//!
//! Every request that is not `/healthz` or `/metrics` resolves its bearer
//! token first (re-read from the ledger at every request), then the engine
//! does the work with the caller's tenant and subject from the token, never
//! from the request. Bodies are the envelope of docs/design.md §4; the status
//! mapping is [`status`].
//!
//! Hostile input is bounded before it costs anything: request heads must
//! arrive within [`HEAD_TIMEOUT`], bodies within [`BODY_TIMEOUT`] and under
//! [`MAX_BODY_BYTES`] (the engine's own argument limit), at most
//! [`MAX_CONNECTIONS`] connections are served at once (more wait in the
//! kernel's accept queue), of which at most [`MAX_CONNECTIONS_PER_CLIENT`]
//! from one client address (more are answered 429 and closed at once, so one
//! client holding slow connections cannot keep `/healthz` or anyone else
//! out), and at most a bounded queue of jobs waits for an engine thread (then
//! `SERVER_BUSY`). Malformed JSON, deep nesting, invalid
//! UTF-8 and duplicate keys are refused by the engine's strict parser with
//! `INVALID_ARGUMENTS` before any state.

// A handler's early return is the finished response itself, built once per
// request; boxing it would only add an allocation.
#![allow(clippy::result_large_err)]

pub use crate::{pool, status, MAX_BODY_BYTES};

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use toolgate_core::Coded;

use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{header, HeaderMap, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::Router;
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::engine::canonical::{parse_strict, CallIdentity, MAX_DEPTH};
use crate::engine::envelope::{Code, Envelope};
use crate::engine::faults::FaultPlan;
use crate::engine::projection::{Projection, QUERY_STATUS_TOOL};
use crate::engine::tokens::{AuthFailure, Principal};
use crate::engine::tool::Toolset;
use crate::engine::{
    CancelRequest, DispatchRequest, Engine, EngineError, EngineOptions, OperatorOutcome, QueryRequest, Resolution,
    ResolveRequest,
};
use crate::shutdown::shutdown_signal;
use pool::{Pool, Refused};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::StreamableHttpService;
use status::ServerCode;

/// Most connections served at once (`serve --max-connections`).
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections served at once from one client address
/// (`serve --max-connections-per-client`).
pub const MAX_CONNECTIONS_PER_CLIENT: usize = 256;
/// How long a request head may take to arrive (slow-loris bound).
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request body may take to arrive.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for in-flight requests before it stops anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Jobs that may wait for an engine thread, per thread.
const QUEUE_PER_THREAD: usize = 64;
/// How often the in-process outbox worker and reaper look for work.
const WORK_INTERVAL: Duration = Duration::from_millis(250);

/// How to serve.
pub struct ServeOptions {
    /// Address to listen on (port 0: any free port).
    pub listen: SocketAddr,
    /// Allow a non-loopback address.
    pub public: bool,
    /// Engine threads answering requests.
    pub threads: usize,
    /// The tools.
    pub toolset: Arc<Toolset>,
    /// Durability of the engines' ledger commits (FULL unless a bench says).
    pub sync: crate::store::Sync,
    /// Run the in-process outbox worker and reaper (a bench that measures
    /// calls alone turns it off: it would claim the bench's own operations).
    pub worker: bool,
    /// The engines' clock: the system's, or the global `--now` fixed instant.
    pub clock: Arc<dyn crate::engine::clock::Clock>,
    /// Connections served at once ([`MAX_CONNECTIONS`] by default).
    pub max_connections: usize,
    /// Connections served at once from one client address
    /// ([`MAX_CONNECTIONS_PER_CLIENT`] by default); a client behind a proxy
    /// or NAT shares its address with every other client there.
    pub max_connections_per_client: usize,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Refused to bind a non-loopback address without `--public`.
    #[error("{0} is not a loopback address: pass --public to serve beyond this machine")]
    NotLoopback(SocketAddr),
    /// The socket.
    #[error("cannot listen on {addr}: {kind}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// What went wrong.
        kind: std::io::ErrorKind,
    },
    /// Opening the ledger.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Threads or the runtime.
    #[error("runtime: {0}")]
    Runtime(std::io::ErrorKind),
}

impl toolgate_core::Coded for ServeError {
    /// Stable code.
    fn code(&self) -> &'static str {
        match self {
            ServeError::NotLoopback(_) => "NOT_LOOPBACK",
            ServeError::Bind { .. } => "LISTEN_FAILED",
            ServeError::Engine(e) => e.code(),
            ServeError::Runtime(_) => "INTERNAL",
        }
    }
}

struct App {
    pool: Arc<Pool>,
    /// The ledger is marked as a demo: `Toolgate-Fault` is honoured.
    demo: bool,
    /// `/mcp`'s token checks and MCP cancellations: one engine of their own.
    mcp_lane: Arc<Pool>,
    /// `/mcp`: MCP over streamable HTTP on the same engine pool.
    mcp: StreamableHttpService<crate::mcp::Gate, LocalSessionManager>,
    /// Ends every MCP session at shutdown (an open event stream would
    /// otherwise hold its connection until the drain timeout).
    mcp_stop: tokio_util::sync::CancellationToken,
    /// Each `/mcp` session, bound to the principal whose token opened it.
    mcp_owners: std::sync::Mutex<McpOwners>,
}

/// The principal (tenant, subject) that opened each MCP session on `/mcp`,
/// oldest first. A request on a session from anyone else, or on a session this
/// map does not hold (ended, never issued), is `NO_SUCH_SESSION` (404), the
/// same answer for each. At most [`MAX_MCP_SESSIONS`] are kept; the oldest
/// beyond that is forgotten, which ends it for every caller (fail closed).
#[derive(Default)]
struct McpOwners {
    by_session: std::collections::HashMap<String, (String, String)>,
    order: std::collections::VecDeque<String>,
}

/// How many MCP sessions the server remembers the owner of.
const MAX_MCP_SESSIONS: usize = 4096;

impl McpOwners {
    fn owner(&self, session: &str) -> Option<&(String, String)> {
        self.by_session.get(session)
    }

    fn open(&mut self, session: String, principal: (String, String)) {
        if self.by_session.insert(session.clone(), principal).is_none() {
            self.order.push_back(session);
        }
        while self.order.len() > MAX_MCP_SESSIONS {
            if let Some(old) = self.order.pop_front() {
                self.by_session.remove(&old);
            }
        }
    }

    fn close(&mut self, session: &str) {
        if self.by_session.remove(session).is_some() {
            self.order.retain(|s| s != session);
        }
    }
}

/// Serves until Ctrl-C or SIGTERM, then stops accepting, lets in-flight
/// requests finish (bounded by [`DRAIN_TIMEOUT`]), stops the engine threads
/// and the worker, and returns. `ready` gets the bound address first.
pub fn serve(db: &Path, opts: &ServeOptions, ready: impl FnOnce(SocketAddr)) -> Result<(), ServeError> {
    serve_until(db, opts, ready, None)
}

/// [`serve`], which also stops (the same way) when `stop` fires: for a
/// server inside another program (`toolgate bench --http`).
pub fn serve_until(
    db: &Path,
    opts: &ServeOptions,
    ready: impl FnOnce(SocketAddr),
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<(), ServeError> {
    if !opts.public && !opts.listen.ip().is_loopback() {
        return Err(ServeError::NotLoopback(opts.listen));
    }
    // Each downstream's bulkhead keeps one engine thread free of it (when
    // there are threads to spare), unless the catalog sets its own.
    if opts.threads >= 3 {
        crate::engine::bulkhead::set_default_limit(opts.threads - 1);
    }
    let pid = std::process::id();
    let engine_opts = |role: String| EngineOptions {
        worker_id: format!("serve-{pid}-{role}"),
        sync: opts.sync,
        clock: opts.clock.clone(),
        ..EngineOptions::new(opts.toolset.clone())
    };
    // Every engine is opened here, on a plain thread, before any runtime exists.
    let mut engines = Vec::with_capacity(opts.threads);
    for i in 0..opts.threads {
        engines.push(Engine::open(db, engine_opts(format!("api{i}")))?);
    }
    let demo = engines.first().is_some_and(Engine::is_demo);
    let tools = match engines.first() {
        Some(e) => crate::mcp::tools_of(e),
        None => Arc::new(Vec::new()),
    };
    let worker = Engine::open(db, engine_opts("worker".into()))?;
    // MCP cancellations run on an engine of their own (src/mcp.rs).
    let lane = Engine::open(db, engine_opts("mcp-cancel".into()))?;
    let lane = Arc::new(Pool::start(vec![lane], crate::mcp::LANE_QUEUE).map_err(|e| ServeError::Runtime(e.kind()))?);
    let pool =
        Arc::new(Pool::start(engines, opts.threads * QUEUE_PER_THREAD).map_err(|e| ServeError::Runtime(e.kind()))?);
    let mcp_stop = tokio_util::sync::CancellationToken::new();
    let mcp = crate::mcp::http_service(pool.clone(), lane.clone(), tools, demo, opts.public, mcp_stop.clone());
    let app =
        Arc::new(App { pool, mcp_lane: lane.clone(), demo, mcp, mcp_stop, mcp_owners: std::sync::Mutex::default() });
    let (stop_worker, stopped) = std::sync::mpsc::channel::<()>();
    let run_worker = opts.worker;
    let worker = std::thread::Builder::new()
        .name("toolgate-worker".into())
        .spawn(move || {
            if run_worker {
                work(worker, &stopped);
            }
        })
        .map_err(|e| ServeError::Runtime(e.kind()))?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ServeError::Runtime(e.kind()))?;
    let limits = Limits { total: opts.max_connections.max(1), per_client: opts.max_connections_per_client.max(1) };
    let served = rt.block_on(accept_loop(app.clone(), opts.listen, limits, ready, stop));
    drop(rt);
    // Requests have drained: the engine threads finish what is queued, then the worker stops.
    app.pool.close();
    lane.close();
    drop(stop_worker);
    let _ = worker.join();
    tracing::info!("serve stopped");
    served
}

/// The in-process outbox worker and reaper: due retries, accepted operations
/// (approved calls), expired leases, and the unknown outcomes a worker asks
/// about by itself (`downstream.auto_query`).
fn work(mut engine: Engine, stop: &std::sync::mpsc::Receiver<()>) {
    loop {
        if let Err(e) = engine.reap().and_then(|_| engine.work_background(64)).and_then(|_| engine.settle_unknown(16)) {
            tracing::warn!(code = e.code(), "worker pass failed");
        }
        match stop.recv_timeout(WORK_INTERVAL) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            _ => return,
        }
    }
}

/// How many connections are served at once, in all and from one address.
#[derive(Debug, Clone, Copy)]
struct Limits {
    total: usize,
    per_client: usize,
}

/// The connections open per client address; a [`ClientSlot`] holds one.
#[derive(Debug, Default)]
struct PerClient(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl PerClient {
    /// A slot for one more connection from `ip`, or `None` at the limit.
    fn take(self: &Arc<Self>, ip: std::net::IpAddr, limit: usize) -> Option<ClientSlot> {
        let mut open = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = open.entry(ip).or_insert(0);
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(ClientSlot { all: self.clone(), ip })
    }
}

/// One open connection of a client; gives its slot back when dropped.
struct ClientSlot {
    all: Arc<PerClient>,
    ip: std::net::IpAddr,
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut open = self.all.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// The answer to a connection over its client's limit: written in one
/// non-blocking write and closed, before anything is read from it.
fn too_many_connections() -> &'static [u8] {
    static ANSWER: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    ANSWER.get_or_init(|| {
        let body = json!({"code": "TOO_MANY_CONNECTIONS", "message": "too many connections from this client address at once"})
            .to_string();
        format!(
            "HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    })
}

async fn accept_loop(
    app: Arc<App>,
    listen: SocketAddr,
    limits: Limits,
    ready: impl FnOnce(SocketAddr),
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Result<(), ServeError> {
    let listener =
        tokio::net::TcpListener::bind(listen).await.map_err(|e| ServeError::Bind { addr: listen, kind: e.kind() })?;
    let addr = listener.local_addr().map_err(|e| ServeError::Bind { addr: listen, kind: e.kind() })?;
    // The handlers are installed before anyone is told where we listen: a
    // SIGTERM right after the address is printed must drain, not kill.
    let signal = shutdown_signal().map_err(|e| ServeError::Runtime(e.kind()))?;
    let shutdown = async move {
        match stop {
            Some(stop) => tokio::select! {
                () = signal => {}
                _ = stop => {}
            },
            None => signal.await,
        }
    };
    ready(addr);
    tracing::info!(%addr, "serving the API");
    let mcp_stop = app.mcp_stop.clone();
    serve_connections(listener, router(app), limits, shutdown, move || mcp_stop.cancel()).await;
    Ok(())
}

/// Serves `router` on `listener` until `shutdown`: at most `limits`
/// connections (per client address and in all), request heads within
/// [`HEAD_TIMEOUT`]; then stops accepting, calls `stopping`, and lets every
/// connection finish its request in flight (at most [`DRAIN_TIMEOUT`]). The
/// one HTTP server stack of the binary (`serve`, `metrics --listen`).
async fn serve_connections(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl std::future::Future<Output = ()>,
    stopping: impl FnOnce(),
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.total));
    let per_client = Arc::new(PerClient::default());
    let (draining, drain) = tokio::sync::watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            s = listener.accept() => match s {
                Ok((s, peer)) => {
                    let Some(slot) = per_client.take(peer.ip(), limits.per_client) else {
                        // Over its client's limit: refused at once, without
                        // holding a slot another client could use.
                        let _ = s.try_write(too_many_connections());
                        crate::telemetry::metrics::CONNECTIONS_REFUSED
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        continue;
                    };
                    (s, slot)
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait, never spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Request/response over small writes: without TCP_NODELAY a reply
        // split in two segments waits for the client's delayed ACK (a
        // replay measured ~4 ms at p50 instead of ~0.5 ms).
        let (stream, slot) = stream;
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let mut drain = drain.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let router = router.clone();
                async move {
                    use tower::ServiceExt as _;
                    router.oneshot(req.map(Body::new)).await
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = async { drop(drain.wait_for(|d| *d).await) } => {
                    // Finish the request in flight (if any), then close.
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(slot);
            drop(permit);
        });
    }
    // Stop accepting; let every connection finish its request in flight.
    drop(listener);
    stopping();
    let _ = draining.send(true);
    let all = u32::try_from(limits.total).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN_TIMEOUT, permits.acquire_many(all)).await.is_err() {
        tracing::warn!("shutdown: requests still in flight after the drain timeout");
    }
}

/// Connections a `metrics --listen` endpoint serves at once (a scrape target
/// has few clients: more from one address are answered 429 at once).
pub const METRICS_MAX_CONNECTIONS: usize = 32;

/// `toolgate metrics --listen`: `GET /metrics` on `listen`, each scrape
/// rendered by `render` on `engine` (its own thread, as every engine of the
/// server's), on the same HTTP stack and limits as `serve`, until SIGTERM or
/// Ctrl-C. Other paths are 404, other methods 405.
pub fn serve_metrics<F>(
    engine: Engine,
    listen: SocketAddr,
    render: F,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServeError>
where
    F: Fn(&mut Engine) -> Result<(&'static str, String), EngineError> + Send + Sync + 'static,
{
    let pool = Arc::new(Pool::start(vec![engine], 8).map_err(|e| ServeError::Runtime(e.kind()))?);
    let render = Arc::new(render);
    let scrape = {
        let pool = pool.clone();
        move || {
            let (pool, render) = (pool.clone(), render.clone());
            async move {
                let text = |status: StatusCode, body: &str| {
                    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], body.to_string()).into_response()
                };
                let Ok(answer) = pool.submit(move |e| render(e)) else {
                    return text(StatusCode::SERVICE_UNAVAILABLE, "busy: try again\n");
                };
                match answer.await {
                    Ok(Ok((content_type, body))) => {
                        (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], body).into_response()
                    }
                    Ok(Err(e)) => {
                        tracing::warn!(code = e.code(), "metrics scrape failed");
                        text(StatusCode::INTERNAL_SERVER_ERROR, &format!("metrics unavailable: {}\n", e.code()))
                    }
                    Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n"),
                }
            }
        }
    };
    let router = Router::new()
        .route("/metrics", get(scrape))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found: GET /metrics\n") })
        .method_not_allowed_fallback(|| async {
            (StatusCode::METHOD_NOT_ALLOWED, "method not allowed: GET /metrics\n")
        });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ServeError::Runtime(e.kind()))?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| ServeError::Bind { addr: listen, kind: e.kind() })?;
        let addr = listener.local_addr().map_err(|e| ServeError::Bind { addr: listen, kind: e.kind() })?;
        let signal = shutdown_signal().map_err(|e| ServeError::Runtime(e.kind()))?;
        ready(addr);
        let limits = Limits { total: METRICS_MAX_CONNECTIONS, per_client: METRICS_MAX_CONNECTIONS / 2 };
        serve_connections(listener, router, limits, signal, || {}).await;
        Ok(())
    });
    drop(rt);
    pool.close();
    served
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/tools/{tool}/calls", post(call_tool))
        .route("/v1/status-queries", post(status_query))
        .route("/v1/operations/{id}", get(get_operation))
        .route("/v1/approvals", get(list_approvals))
        .route("/v1/approvals/{id}/approve", post(approve))
        .route("/v1/approvals/{id}/deny", post(deny))
        .route("/v1/operations/{id}/resolve", post(resolve))
        .route("/v1/operations/{id}/cancel", post(cancel))
        .route("/mcp", any(mcp))
        .fallback(|| async { refuse(status::NO_SUCH_ROUTE) })
        .method_not_allowed_fallback(|| async { refuse(status::METHOD_NOT_ALLOWED) })
        .layer(axum::middleware::from_fn(one_of_each_identity_header))
        .with_state(app)
}

/// Whether a header says who is calling or which intent a call is: it must
/// appear at most once.
fn names_an_identity(name: &str) -> bool {
    matches!(name, "authorization" | "idempotency-key" | "mcp-session-id") || name.starts_with("toolgate-")
}

/// Refuses a request that carries an identity header twice (400
/// `DUPLICATE_HEADER`), before any route sees it. A handler reads one value
/// of a header, so two `Idempotency-Key` headers in the other order would be
/// another intent (a second refund), and two `Authorization` headers would
/// leave which token counts to the order of lines. The folded form
/// (`A, B` in one line) is refused by the key's own check.
async fn one_of_each_identity_header(req: Request<Body>, next: axum::middleware::Next) -> Response {
    let h = req.headers();
    if h.keys().any(|name| names_an_identity(name.as_str()) && h.get_all(name).iter().nth(1).is_some()) {
        return refuse(status::DUPLICATE_HEADER);
    }
    // An identity header is text: bytes that are not UTF-8 would be read
    // lossily, and two different byte strings would become one call id.
    if h.iter().any(|(name, v)| names_an_identity(name.as_str()) && std::str::from_utf8(v.as_bytes()).is_err()) {
        return refuse(status::INVALID_HEADER);
    }
    next.run(req).await
}

/// `/mcp`: MCP over streamable HTTP (rmcp). The token is resolved here
/// first, like every other endpoint's (401 before rmcp sees the request; an
/// operator token is 403), and again by each tool call, so a token revoked
/// mid-session stops working at its next call.
async fn mcp(State(app): State<Arc<App>>, req: Request<Body>) -> Response {
    use tower::ServiceExt as _;
    // On the MCP lane's engine, not the calls' pool: a `notifications/cancelled`
    // comes in a request of its own, and must not wait behind the calls it cancels.
    let principal = match authenticate_on(&app.mcp_lane, req.headers()).await {
        Ok(Principal::Subject { tenant, subject, .. }) => (tenant, subject),
        Ok(Principal::Operator { .. }) => return refuse(status::SUBJECT_TOKEN_REQUIRED),
        Err(refused) => return refused,
    };
    // Faults only on a demo ledger, and only well-formed ones (as on the call endpoint).
    if let Some(spec) = header_text(req.headers(), "toolgate-fault") {
        if !app.demo {
            return refuse(status::FAULT_NOT_ALLOWED);
        }
        if FaultPlan::parse(&spec).is_err() {
            return refuse(status::BAD_FAULT);
        }
    }
    // A session is its opener's: another principal's request on it (a call, a
    // cancellation, a DELETE) meets a session that does not exist.
    let session = header_text(req.headers(), "mcp-session-id");
    if let Some(id) = &session {
        let owner = app.mcp_owners.lock().unwrap_or_else(std::sync::PoisonError::into_inner).owner(id).cloned();
        if owner.as_ref() != Some(&principal) {
            // Another principal's, ended, or never issued: the same answer for all three.
            return refuse(status::NO_SUCH_SESSION);
        }
    }
    let delete = req.method() == axum::http::Method::DELETE;
    // Every request with an id gets an answer by that id, before rmcp (which
    // drops what it cannot read): the same screen as on stdio (src/mcp/wire.rs).
    let req = if req.method() == axum::http::Method::POST && is_json(req.headers()) {
        let (parts, body) = req.into_parts();
        let bytes = match read_body(&parts.headers, body, false).await {
            Ok(b) => b,
            Err(refused) => return refused,
        };
        if let crate::mcp::wire::Screened::Answer(v) = crate::mcp::wire::screen(&bytes, true) {
            // With an id, the answer to that request; without one, the body was unreadable.
            let st = if v["id"].is_null() { StatusCode::BAD_REQUEST } else { StatusCode::OK };
            return json_reply(st, &v);
        }
        Request::from_parts(parts, Body::from(bytes))
    } else {
        req
    };
    let r = match app.mcp.clone().oneshot(req).await {
        Ok(r) => r.map(Body::new),
        Err(never) => match never {},
    };
    let mut owners = app.mcp_owners.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    match &session {
        // `initialize` opened one: it is this principal's.
        None => {
            if let Some(id) = r.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()) {
                owners.open(id.to_string(), principal);
            }
        }
        Some(id) if delete && r.status().is_success() => owners.close(id),
        Some(_) => {}
    }
    r
}

// ------------------------------------------------------------------ replies

fn json_reply(status: StatusCode, body: &impl serde::Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_else(|_| b"null".to_vec());
    let mut r = (status, bytes).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn with_retry_after(mut r: Response, ms: u64) -> Response {
    if let Ok(v) = HeaderValue::from_str(&ms.div_ceil(1000).max(1).to_string()) {
        r.headers_mut().insert(header::RETRY_AFTER, v);
    }
    r
}

/// Asks the client to close the connection after this response. A refusal
/// of the server's own is answered before the request's body is read; hyper
/// then closes the connection unless the rest of the body happens to be in its
/// buffer already, and a client that reused the connection would meet a
/// reset on its next request. Saying so makes the close explicit.
fn closing(mut r: Response) -> Response {
    r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// A refusal of the server's own.
fn refuse(c: ServerCode) -> Response {
    let r =
        closing(json_reply(c.status, &status::envelope_json(c.code, c.category, c.recovery, c.message, None, false)));
    if c.code == status::SERVER_BUSY.code {
        return with_retry_after(r, 1000);
    }
    r
}

fn unauthorized(f: AuthFailure) -> Response {
    let body = status::envelope_json(f.code(), "authentication", "request_authorization", f.message(), None, false);
    let mut r = closing(json_reply(StatusCode::UNAUTHORIZED, &body));
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"toolgate\""));
    r
}

/// An environment failure during a call: the ledger is the truth, so the
/// outcome is reported as unknown, and a retry with the same key is safe.
fn engine_failure(e: &EngineError) -> Response {
    let code = e.code();
    let st = status::of_engine_error(code);
    tracing::warn!(code, "API call failed");
    if st.is_client_error() {
        let body = status::envelope_json(code, "invalid_request", "correct_input", &e.to_string(), None, false);
        return json_reply(st, &body);
    }
    let body = status::envelope_json(code, "environment", "retry_after", status::INTERNAL.message, Some(1000), true);
    with_retry_after(json_reply(st, &body), 1000)
}

/// A `?project=` view of a reply's body: only its model result, as one
/// provider's tool-result message for the call `call_id` of `tool`.
struct View {
    project: Projection,
    call_id: String,
    tool: String,
}

/// The reply for an engine envelope. A projection changes the body only: the
/// status and `Retry-After` are the envelope's either way.
fn envelope_reply(env: &Envelope, op_state: Option<crate::store::OpState>, view: Option<&View>) -> Response {
    let st = status::of_envelope(env, op_state);
    let r = match view {
        Some(v) => json_reply(st, &v.project.render(&v.call_id, &v.tool, &env.model_result)),
        None => json_reply(st, env),
    };
    let retry_ms = env.model_result.error.as_ref().and_then(|e| e.retry_after_ms);
    match (retry_ms, st) {
        (Some(ms), _) => with_retry_after(r, ms),
        // Still in flight: come back shortly with the same key.
        (None, StatusCode::CONFLICT) if env.code() == Some(Code::OutcomeUnknown) => with_retry_after(r, 1000),
        (None, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) => with_retry_after(r, 1000),
        _ => r,
    }
}

fn outcome_reply(o: &OperatorOutcome) -> Response {
    json_reply(if o.applied { StatusCode::OK } else { StatusCode::CONFLICT }, o)
}

// ------------------------------------------------------------------ plumbing

/// A flag an engine job reads: set when the request's handler is dropped
/// before it was answered (the client closed the connection), so a queued
/// call whose client went away is not accepted.
#[derive(Default)]
struct ClientGone {
    flag: Arc<std::sync::atomic::AtomicBool>,
    answered: bool,
}

impl ClientGone {
    fn watch(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.flag.clone()
    }

    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for ClientGone {
    fn drop(&mut self) {
        if !self.answered {
            self.flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// Runs `f` on an engine thread and waits for it.
async fn on_engine<T: Send + 'static>(
    app: &App,
    f: impl FnOnce(&mut Engine) -> T + Send + 'static,
) -> Result<T, Response> {
    on_pool(&app.pool, f).await
}

async fn on_pool<T: Send + 'static>(
    pool: &Pool,
    f: impl FnOnce(&mut Engine) -> T + Send + 'static,
) -> Result<T, Response> {
    match pool.submit(f) {
        Ok(answer) => answer.await.map_err(|_| refuse(status::INTERNAL)),
        Err(Refused::Busy | Refused::Closed) => Err(refuse(status::SERVER_BUSY)),
    }
}

/// Resolves the request's token, before anything else.
async fn authenticate(app: &App, headers: &HeaderMap) -> Result<Principal, Response> {
    authenticate_on(&app.pool, headers).await
}

async fn authenticate_on(pool: &Pool, headers: &HeaderMap) -> Result<Principal, Response> {
    let header = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes().to_vec());
    match on_pool(pool, move |e| e.authenticate(header.as_deref())).await? {
        Ok(Ok(p)) => Ok(p),
        Ok(Err(f)) => Err(unauthorized(f)),
        Err(e) => Err(engine_failure(&e)),
    }
}

async fn subject_of(app: &App, headers: &HeaderMap) -> Result<(String, String), Response> {
    match authenticate(app, headers).await? {
        Principal::Subject { tenant, subject, .. } => Ok((tenant, subject)),
        Principal::Operator { .. } => Err(refuse(status::SUBJECT_TOKEN_REQUIRED)),
    }
}

/// The operator a request acts as, and the tenants its token may reach
/// (`None`: every tenant).
async fn operator_of(app: &App, headers: &HeaderMap) -> Result<(String, Option<Vec<String>>), Response> {
    match authenticate(app, headers).await? {
        Principal::Operator { operator, tenants, .. } => Ok((operator, tenants)),
        Principal::Subject { .. } => Err(refuse(status::OPERATOR_TOKEN_REQUIRED)),
    }
}

/// Runs `f` with the engine limited to a token's tenants: another tenant's
/// operation or approval is then answered as one that does not exist.
fn scoped<T>(e: &mut Engine, tenants: Option<Vec<String>>, f: impl FnOnce(&mut Engine) -> T) -> T {
    e.set_operator_scope(tenants);
    let out = f(e);
    e.set_operator_scope(None);
    out
}

fn is_json(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|ct| {
        let media = ct.split(';').next().unwrap_or("").trim();
        media.eq_ignore_ascii_case("application/json")
    })
}

/// Reads a JSON body: the right media type (an empty body may have none when
/// `empty_ok`), under the size limit, within the time limit.
async fn read_body(headers: &HeaderMap, body: Body, empty_ok: bool) -> Result<Bytes, Response> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_BODY_BYTES as u64) {
        return Err(refuse(status::BODY_TOO_LARGE));
    }
    let json = is_json(headers);
    if !(json || empty_ok && declared.unwrap_or(0) == 0) {
        return Err(refuse(status::UNSUPPORTED_MEDIA_TYPE));
    }
    let collected = tokio::time::timeout(BODY_TIMEOUT, Limited::new(body, MAX_BODY_BYTES).collect()).await;
    let bytes = match collected {
        Err(_) => return Err(refuse(status::BODY_TIMEOUT)),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => return Err(refuse(status::BODY_TOO_LARGE)),
        Ok(Err(_)) => return Err(refuse(status::INVALID_BODY)),
        Ok(Ok(c)) => c.to_bytes(),
    };
    if !json && !bytes.is_empty() {
        return Err(refuse(status::UNSUPPORTED_MEDIA_TYPE));
    }
    Ok(bytes)
}

/// Parses an endpoint's own JSON body strictly (no duplicate keys, bounded
/// depth, no unknown fields). An empty body is `{}`.
fn parse_body<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, Response> {
    let bytes: &[u8] = if bytes.is_empty() { b"{}" } else { bytes };
    let value = parse_strict(bytes, MAX_BODY_BYTES, MAX_DEPTH).map_err(|_| refuse(status::INVALID_BODY))?;
    // Bodies are objects: serde would also fill a struct from an array by
    // position (`["compensated", "note"]` resolved an operation).
    if !value.is_object() {
        return Err(refuse(status::INVALID_BODY));
    }
    serde_json::from_value(value).map_err(|_| refuse(status::INVALID_BODY))
}

fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    // Identity headers that are not UTF-8 were refused before any route
    // (`one_of_each_identity_header`); the engine checks every part (length,
    // control characters) and refuses with its own code.
    headers.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// The call identity from the `Toolgate-*` headers; each part absent is fresh.
fn call_identity(headers: &HeaderMap) -> CallIdentity {
    let part = |name| header_text(headers, name);
    let provider = part("toolgate-provider").unwrap_or_else(|| "http".into());
    let parts = ["toolgate-api-family", "toolgate-response-id", "toolgate-call-id", "toolgate-adapter-revision"];
    match parts.map(part) {
        // Fresh parts cost two seedings from OS entropy (a tenth of the
        // runtime's work per request): drawn only when a part is missing.
        [Some(api_family), Some(response_id), Some(call_id), Some(adapter_revision)] => {
            CallIdentity { provider, api_family, response_id, call_id, adapter_revision }
        }
        [api_family, response_id, call_id, adapter_revision] => {
            let fresh = crate::engine::fresh_call_identity();
            CallIdentity {
                provider,
                api_family: api_family.unwrap_or(fresh.api_family),
                response_id: response_id.unwrap_or(fresh.response_id),
                call_id: call_id.unwrap_or(fresh.call_id),
                adapter_revision: adapter_revision.unwrap_or(fresh.adapter_revision),
            }
        }
    }
}

/// The `?project=` choice of the call and status-query endpoints. The query
/// string holds that one parameter or nothing: anything else (another
/// parameter, `project` twice) is `INVALID_QUERY`, so a typo is not silently
/// answered with the whole envelope.
fn projection_param(query: Option<&str>) -> Result<Option<Projection>, Response> {
    let mut chosen = None;
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("project", name)) if chosen.is_none() => {
                // Names are plain ASCII: a percent-encoded one is just not a name.
                chosen = Some(Projection::parse(name).map_err(|_| refuse(status::UNKNOWN_PROJECTION))?);
            }
            _ => return Err(refuse(status::INVALID_QUERY)),
        }
    }
    Ok(chosen)
}

fn path_param(p: Result<UrlPath<String>, PathRejection>) -> Result<String, Response> {
    p.map(|UrlPath(s)| s).map_err(|_| refuse(status::NO_SUCH_ROUTE))
}

/// Collapses the `Result<Response, Response>` of a handler body.
fn reply(r: Result<Response, Response>) -> Response {
    r.unwrap_or_else(|e| e)
}

// ------------------------------------------------------------------ handlers

async fn healthz() -> Response {
    json_reply(StatusCode::OK, &json!({"ok": true}))
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    use crate::telemetry::{metrics, prometheus};
    let rendered = on_engine(&app, |e| {
        metrics::snapshot(e, metrics::Window::last_minutes(15), &metrics::Slice::default())
            .map(|s| prometheus::render(&s))
    })
    .await;
    match rendered {
        Ok(Ok(text)) => {
            let mut r = (StatusCode::OK, text).into_response();
            r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(prometheus::CONTENT_TYPE));
            r
        }
        Ok(Err(e)) => engine_failure(&e),
        Err(r) => r,
    }
}

async fn call_tool(
    State(app): State<Arc<App>>,
    tool: Result<UrlPath<String>, PathRejection>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // When the request arrived: its deadline counts from here, not from when
    // an engine thread takes it.
    let arrived = std::time::Instant::now();
    reply(
        async move {
            // The token's shape first, with nothing read; a malformed or
            // missing one is refused (and traced) by the engine as everywhere.
            // A well-formed one is looked up in the same engine job as the
            // call (one hop to an engine thread instead of two): after the
            // body is read (bounded), before anything else happens.
            let authorization = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes().to_vec());
            if !crate::engine::tokens::well_formed(authorization.as_deref()) {
                subject_of(&app, &headers).await?;
            }
            let tool = path_param(tool)?;
            let project = projection_param(query.as_deref())?;
            let arguments = read_body(&headers, body, false).await?;
            let faults = match header_text(&headers, "toolgate-fault") {
                None => None,
                // Faults make real calls look lost (or abort the server): never on
                // a ledger that matters. Only the demo generator marks a database
                // as a demo, and nothing marks an existing ledger.
                Some(_) if !app.demo => return Err(refuse(status::FAULT_NOT_ALLOWED)),
                Some(spec) => Some(FaultPlan::parse(&spec).map_err(|_| refuse(status::BAD_FAULT))?),
            };
            let deadline_ms = match header_text(&headers, "toolgate-deadline-ms") {
                None => None,
                Some(v) => Some(v.trim().parse::<u64>().map_err(|_| refuse(status::INVALID_HEADER))?),
            };
            let call = call_identity(&headers);
            let view = project.map(|project| View { project, call_id: call.call_id.clone(), tool: tool.clone() });
            let mut req = DispatchRequest {
                tenant: String::new(),
                subject: String::new(),
                tool,
                arguments: arguments.to_vec(),
                idempotency_key: header_text(&headers, "idempotency-key"),
                call: Some(call),
                approval_id: header_text(&headers, "toolgate-approval-id"),
                deadline_ms,
                token_id: None,
            };
            // Set when this handler is dropped before its answer (the client
            // hung up): a call not yet accepted then is never accepted.
            let gone = ClientGone::default();
            let watch = gone.watch();
            let answered = on_engine(&app, move |e| {
                if watch.load(std::sync::atomic::Ordering::SeqCst) {
                    return Ok(Err(refuse(status::CLIENT_GONE)));
                }
                match e.authenticate(authorization.as_deref())? {
                    Ok(Principal::Subject { tenant, subject, token_id }) => {
                        (req.tenant, req.subject, req.token_id) = (tenant, subject, Some(token_id));
                    }
                    Ok(Principal::Operator { .. }) => return Ok(Err(refuse(status::SUBJECT_TOKEN_REQUIRED))),
                    Err(f) => return Ok(Err(unauthorized(f))),
                }
                if let Some(f) = faults {
                    e.set_faults(f);
                }
                let env = e.dispatch_arrived(&req, arrived);
                e.set_faults(FaultPlan::none());
                let env = env?;
                let state = match (env.code(), env.protected_audit.operation_id.as_deref()) {
                    (Some(Code::OutcomeUnknown), Some(id)) => e.operation_state(id)?,
                    _ => None,
                };
                Ok::<_, EngineError>(Ok((env, state)))
            })
            .await?;
            gone.answered();
            match answered {
                Ok(Ok((env, state))) => Ok(envelope_reply(&env, state, view.as_ref())),
                Ok(Err(refused)) => Err(refused),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StatusQueryBody {
    status_ref: String,
    expected_request_sha256: String,
    #[serde(default)]
    idempotency_key: Option<String>,
}

async fn status_query(
    State(app): State<Arc<App>>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    reply(
        async move {
            let (tenant, subject) = subject_of(&app, &headers).await?;
            let project = projection_param(query.as_deref())?;
            let b: StatusQueryBody = parse_body(&read_body(&headers, body, false).await?)?;
            let call = call_identity(&headers);
            let view = project.map(|project| View {
                project,
                call_id: call.call_id.clone(),
                tool: QUERY_STATUS_TOOL.to_string(),
            });
            let q = QueryRequest {
                tenant,
                subject,
                status_ref: b.status_ref,
                expected_request_sha256: b.expected_request_sha256,
                idempotency_key: b.idempotency_key,
                call: Some(call),
                operator: None,
            };
            let answered = on_engine(&app, move |e| {
                let env = e.query_operation_status(&q)?;
                let state = match (env.code(), env.protected_audit.operation_id.as_deref()) {
                    (Some(Code::OutcomeUnknown), Some(id)) => e.operation_state(id)?,
                    _ => None,
                };
                Ok::<_, EngineError>((env, state))
            })
            .await?;
            match answered {
                Ok((env, state)) => Ok(envelope_reply(&env, state, view.as_ref())),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

async fn get_operation(
    State(app): State<Arc<App>>,
    id: Result<UrlPath<String>, PathRejection>,
    headers: HeaderMap,
) -> Response {
    reply(
        async move {
            let (scope, tenants) = match authenticate(&app, &headers).await? {
                Principal::Subject { tenant, subject, .. } => (Some((tenant, subject)), None),
                Principal::Operator { tenants, .. } => (None, tenants),
            };
            let id = path_param(id)?;
            let found = on_engine(&app, move |e| {
                let env = scoped(e, tenants, |e| {
                    e.caller_operation(&id, scope.as_ref().map(|(t, s)| (t.as_str(), s.as_str())))
                })?;
                let state = match &env {
                    Some(env) if env.code() == Some(Code::OutcomeUnknown) => env
                        .protected_audit
                        .operation_id
                        .as_deref()
                        .map(|id| e.operation_state(id))
                        .transpose()?
                        .flatten(),
                    _ => None,
                };
                Ok::<_, EngineError>(env.map(|env| (env, state)))
            })
            .await?;
            match found {
                Ok(Some((env, state))) => Ok(envelope_reply(&env, state, None)),
                // Another tenant's or subject's operation reads exactly like none at all.
                Ok(None) => Err(refuse(status::NO_SUCH_OPERATION)),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

async fn list_approvals(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    reply(
        async move {
            let (_, tenants) = operator_of(&app, &headers).await?;
            let listed = on_engine(&app, move |e| {
                let now = e.clock().now_ms();
                scoped(e, tenants, |e| e.pending_approvals(1000)).map(|rows| {
                    rows.iter()
                        .map(|a| {
                            json!({
                                "approval_id": a.id, "tool": a.tool, "tenant": a.tenant, "subject": a.subject,
                                "amount_minor": crate::engine::approval_amount(a),
                                "created_at": crate::engine::clock::rfc3339(a.created_at),
                                "expires_at": crate::engine::clock::rfc3339(a.expires_at),
                                "expires_in_ms": a.expires_at - now, "request_sha256": a.request_sha256,
                            })
                        })
                        .collect::<Vec<Value>>()
                })
            })
            .await?;
            match listed {
                Ok(list) => Ok(json_reply(StatusCode::OK, &json!({"pending": list}))),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

async fn approve(
    State(app): State<Arc<App>>,
    id: Result<UrlPath<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    reply(
        async move {
            let (operator, tenants) = operator_of(&app, &headers).await?;
            let id = path_param(id)?;
            let _: Empty = parse_body(&read_body(&headers, body, true).await?)?;
            match on_engine(&app, move |e| scoped(e, tenants, |e| e.approve(&id, &operator))).await? {
                Ok(env) => Ok(envelope_reply(&env, None, None)),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyBody {
    note: String,
}

async fn deny(
    State(app): State<Arc<App>>,
    id: Result<UrlPath<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    reply(
        async move {
            let (operator, tenants) = operator_of(&app, &headers).await?;
            let id = path_param(id)?;
            let b: DenyBody = parse_body(&read_body(&headers, body, false).await?)?;
            match on_engine(&app, move |e| scoped(e, tenants, |e| e.deny(&id, &operator, &b.note))).await? {
                Ok(o) => Ok(outcome_reply(&o)),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    resolution: Resolution,
    note: String,
    #[serde(default)]
    evidence: Option<String>,
    #[serde(default)]
    seen_version: Option<i64>,
    #[serde(default)]
    action_id: Option<String>,
    #[serde(default)]
    against_evidence: bool,
    #[serde(default)]
    no_evidence: bool,
}

async fn resolve(
    State(app): State<Arc<App>>,
    id: Result<UrlPath<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    reply(
        async move {
            let (operator, tenants) = operator_of(&app, &headers).await?;
            let operation_id = path_param(id)?;
            let b: ResolveBody = parse_body(&read_body(&headers, body, false).await?)?;
            let req = ResolveRequest {
                operation_id,
                resolution: b.resolution,
                operator,
                note: b.note,
                evidence: b.evidence,
                seen_version: b.seen_version,
                action_id: b.action_id,
                no_evidence: b.no_evidence,
            };
            let against = b.against_evidence;
            let out = on_engine(&app, move |e| {
                scoped(e, tenants, |e| if against { e.resolve_against_evidence(&req) } else { e.resolve(&req) })
            });
            match out.await? {
                Ok(o) => Ok(outcome_reply(&o)),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    note: String,
    #[serde(default)]
    seen_version: Option<i64>,
    #[serde(default)]
    action_id: Option<String>,
}

async fn cancel(
    State(app): State<Arc<App>>,
    id: Result<UrlPath<String>, PathRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    reply(
        async move {
            let (operator, tenants) = operator_of(&app, &headers).await?;
            let operation_id = path_param(id)?;
            let b: CancelBody = parse_body(&read_body(&headers, body, false).await?)?;
            let req = CancelRequest {
                operation_id,
                operator,
                note: b.note,
                seen_version: b.seen_version,
                action_id: b.action_id,
            };
            match on_engine(&app, move |e| scoped(e, tenants, |e| e.cancel(&req))).await? {
                Ok(o) => Ok(outcome_reply(&o)),
                Err(e) => Err(engine_failure(&e)),
            }
        }
        .await,
    )
}
