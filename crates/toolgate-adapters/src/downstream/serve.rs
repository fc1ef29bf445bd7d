//! `toolgate provider serve`: the simulated payments and notifications
//! providers over real HTTP (hyper on tokio), so the `http` adapter meets real
//! sockets, real timeouts and real dropped connections. Same durable tables,
//! same key semantics and the same fault plans as in process; a fault is set
//! per request by the `Toolgate-Fault` header, or for every request by a plan
//! (`--faults 'rate_limit(2000),ok'`, `--faults 'random(0.05,seed=7)'`).
//!
//! - `POST /v1/{payments|notifications}/calls`: the arguments as the JSON body,
//!   the key in `Idempotency-Key` (payments honours it, notifications does
//!   not), the caller's request digest in `Toolgate-Request-Sha256`. A 200 reply is
//!   `{"receipt_id", "request_id", "body_sha256", "key", "result"}` (`key`:
//!   the idempotency key the effect was made under).
//! - `GET /v1/{payments|notifications}/calls/{key}`: the effect under a key, or 404.
//! - `GET /healthz`.
//!
//! What each fault does on the wire: `ok` 200; `latency(ms)` waits, then
//! commits and replies; `reject(code)` 400; `rate_limit(ms)` 429 with
//! Retry-After in seconds (`rate_limit(ms,date)`: as an HTTP date);
//! `unavailable` and `connect_timeout` 503 (a refused connection is shown by
//! a closed port instead), `unavailable(ms)` / `unavailable(ms,date)` 503 with
//! Retry-After; `server_error` 500 with nothing committed; `in_progress(ms)`
//! 409 with Retry-After; `slow_body(ms)` commits and answers 200 at once, its
//! body trickling in over `ms`; `huge_body(bytes)` commits and answers 200
//! with a receipt padded to that many bytes;
//! `timeout_before_commit` holds the request and drops it uncommitted;
//! `timeout_after_commit` commits, holds, then drops; `drop_after_commit`,
//! `receipt_delay(ms)`, `mismatch_after_commit` and `panic_after_commit` commit
//! and close the connection with no reply; `server_error_after_commit` commits
//! and answers 500; `malformed_response` commits and answers 200 with a body
//! that is not JSON; `crash_after_commit` commits and aborts the process.
//! Loopback only unless `--public`.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use serde_json::{json, Value};

use super::{Downstream, DownstreamRequest, Fault, FaultPlan, Lookup, Receipt, SimKind, Simulated};
use crate::engine::canonical::{canonical_string, parse_strict, sha256_hex};
use crate::engine::clock::SystemClock;
use crate::engine::faults::RetryAfter;
use crate::engine::ids::Ids;
use crate::store::{OpenOptions, ProviderStore, Sync};

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Most connections served at once; more wait in the accept queue.
pub const MAX_CONNECTIONS: usize = 256;
/// How long a request head may take to arrive.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a "no reply" fault holds the request before dropping it.
const HOLD: Duration = Duration::from_secs(10);

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
    /// The provider database.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The provider.
    #[error(transparent)]
    Downstream(#[from] super::DownstreamError),
    /// The runtime.
    #[error("runtime: {0}")]
    Runtime(std::io::ErrorKind),
}

impl toolgate_core::Coded for ServeError {
    /// Stable code.
    fn code(&self) -> &'static str {
        match self {
            ServeError::NotLoopback(_) => "NOT_LOOPBACK",
            ServeError::Bind { .. } => "LISTEN_FAILED",
            ServeError::Store(e) => e.code(),
            ServeError::Downstream(_) => "DOWNSTREAM_STORAGE",
            ServeError::Runtime(_) => "INTERNAL",
        }
    }
}

/// How to serve.
#[derive(Debug)]
pub struct ServeOptions {
    /// Address to listen on (port 0: any free port).
    pub listen: SocketAddr,
    /// Allow a non-loopback address.
    pub public: bool,
    /// The fault plan for requests without a `Toolgate-Fault` header.
    pub faults: FaultPlan,
    /// When set, every `/v1` request must carry `Authorization: Bearer
    /// TOKEN`; others are answered 401, as a real API answers a rotated key.
    pub require_bearer: Option<String>,
}

struct State {
    payments: Mutex<Simulated>,
    notifications: Mutex<Simulated>,
    faults: Mutex<FaultPlan>,
    require_bearer: Option<String>,
}

impl State {
    fn provider(&self, kind: SimKind) -> &Mutex<Simulated> {
        match kind {
            SimKind::Payments => &self.payments,
            SimKind::Notifications => &self.notifications,
        }
    }
}

/// Serves until Ctrl-C or SIGTERM; `ready` gets the bound address first.
pub fn serve(db: &Path, opts: ServeOptions, ready: impl FnOnce(SocketAddr)) -> Result<(), ServeError> {
    if !opts.public && !opts.listen.ip().is_loopback() {
        return Err(ServeError::NotLoopback(opts.listen));
    }
    drop(ProviderStore::open(db, OpenOptions { create: true, sync: Sync::Full })?);
    let open = |kind| {
        // Faults come per request from the server's plan or header: the
        // providers' own plans stay empty.
        Simulated::open(
            kind,
            db,
            Arc::new(SystemClock),
            Arc::new(Mutex::new(FaultPlan::none())),
            Sync::Full,
            Ids::default(),
        )
    };
    let state = Arc::new(State {
        payments: Mutex::new(open(SimKind::Payments)?),
        notifications: Mutex::new(open(SimKind::Notifications)?),
        faults: Mutex::new(opts.faults),
        require_bearer: opts.require_bearer,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| ServeError::Runtime(e.kind()))?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .map_err(|e| ServeError::Bind { addr: opts.listen, kind: e.kind() })?;
        let addr = listener.local_addr().map_err(|e| ServeError::Bind { addr: opts.listen, kind: e.kind() })?;
        ready(addr);
        let permits = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let shutdown = shutdown_signal();
        tokio::pin!(shutdown);
        loop {
            let permit = tokio::select! {
                () = &mut shutdown => break,
                p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            };
            let stream = tokio::select! {
                () = &mut shutdown => break,
                s = listener.accept() => match s {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let state = state.clone();
            tokio::spawn(async move {
                // Set by a handler that must drop the connection with no reply.
                let kill = Arc::new(tokio::sync::Notify::new());
                let svc = {
                    let kill = kill.clone();
                    hyper::service::service_fn(move |req| handle(state.clone(), kill.clone(), req))
                };
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEAD_TIMEOUT)
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
                tokio::select! {
                    _ = conn => {}
                    () = kill.notified() => {}
                }
                drop(permit);
            });
        }
        Ok(())
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

type Reply = Response<UnsyncBoxBody<Bytes, Infallible>>;

fn reply(status: StatusCode, body: &Value) -> Reply {
    json_reply(status, Full::new(Bytes::from(canonical_string(body))).boxed_unsync())
}

fn json_reply(status: StatusCode, body: UnsyncBoxBody<Bytes, Infallible>) -> Reply {
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut().insert("content-type", hyper::header::HeaderValue::from_static("application/json"));
    r
}

fn error(status: StatusCode, code: &str) -> Reply {
    reply(status, &json!({"error": code}))
}

/// Retry-After as delta-seconds (rounded up), or as the IMF-fixdate at least
/// that far ahead (RFC 9110 §10.2.3, §5.6.7).
fn with_retry_after(mut r: Reply, ra: RetryAfter) -> Reply {
    let text = if ra.http_date {
        let at = chrono::Utc::now() + chrono::Duration::milliseconds(i64::try_from(ra.ms).unwrap_or(i64::MAX));
        // The date has whole seconds: round up, so the wait is never shorter than asked.
        let at = at + chrono::Duration::milliseconds(999);
        at.format("%a, %d %b %Y %H:%M:%S GMT").to_string()
    } else {
        ra.ms.div_ceil(1000).to_string()
    };
    if let Ok(v) = hyper::header::HeaderValue::from_str(&text) {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

/// A reply body sent in pieces with a pause before each one after the first:
/// a receipt that trickles in, or one padded with JSON whitespace to any size,
/// without holding it in memory.
struct Paced {
    head: Option<Bytes>,
    /// Bytes of padding (spaces) still to send after `head`.
    padding: u64,
    /// The rest of the receipt, sent `piece` bytes at a time.
    tail: Bytes,
    piece: usize,
    pause: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Paced {
    /// `body` one byte at a time, spread over `ms`.
    fn trickle(body: Bytes, ms: u64) -> Self {
        let n = body.len().max(1) as u64;
        let pause = Duration::from_micros(ms.saturating_mul(1000) / n);
        Self { head: None, padding: 0, tail: body, piece: 1, pause, sleep: None }
    }

    /// `body` with spaces after its first byte (`{`) up to `size` bytes, sent at once.
    fn padded(body: &Bytes, size: u64) -> Self {
        let padding = size.saturating_sub(body.len() as u64);
        Self {
            head: Some(body.slice(..1)),
            padding,
            tail: body.slice(1..),
            piece: 64 * 1024,
            pause: Duration::ZERO,
            sleep: None,
        }
    }
}

impl hyper::body::Body for Paced {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(sleep) = self.sleep.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        let piece = self.piece;
        let next = if let Some(h) = self.head.take() {
            h
        } else if self.padding > 0 {
            let n = self.padding.min(piece as u64);
            self.padding -= n;
            Bytes::from(vec![b' '; usize::try_from(n).unwrap_or(piece)])
        } else if self.tail.is_empty() {
            return Poll::Ready(None);
        } else {
            let n = piece.min(self.tail.len());
            self.tail.split_to(n)
        };
        if !self.pause.is_zero() {
            self.sleep = Some(Box::pin(tokio::time::sleep(self.pause)));
        }
        Poll::Ready(Some(Ok(Frame::data(next))))
    }
}

fn receipt_json(r: &Receipt) -> Value {
    json!({
        "receipt_id": r.receipt_id, "request_id": r.request_id, "body_sha256": r.body_sha256, "key": r.key,
        "result": r.result,
    })
}

fn header<'a>(req: &'a Request<Incoming>, name: &str) -> Option<&'a str> {
    req.headers().get(name).and_then(|v| v.to_str().ok())
}

async fn handle(
    state: Arc<State>,
    kill: Arc<tokio::sync::Notify>,
    req: Request<Incoming>,
) -> Result<Reply, Infallible> {
    let path = req.uri().path().to_string();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let kind = |name: &str| SimKind::of(name);
    if let (Some(want), ["v1", ..]) = (&state.require_bearer, parts.as_slice()) {
        let presented = header(&req, "authorization").unwrap_or("");
        if presented != format!("Bearer {want}") {
            // As real APIs do, the refusal names what was presented: the
            // gateway must redact it before it records the body.
            return Ok(reply(
                StatusCode::UNAUTHORIZED,
                &json!({"error": "invalid_api_key", "message": format!("Invalid API key provided: {presented}")}),
            ));
        }
    }
    Ok(match (req.method().as_str(), parts.as_slice()) {
        ("GET", ["healthz"]) => reply(StatusCode::OK, &json!({"status": "ok"})),
        ("GET", ["v1", provider, "calls", key]) => match kind(provider) {
            None => error(StatusCode::NOT_FOUND, "no_such_provider"),
            Some(k) => lookup(&state, k, &percent_decode(key)).await,
        },
        ("POST", ["v1", provider, "calls"]) => match kind(provider) {
            None => error(StatusCode::NOT_FOUND, "no_such_provider"),
            Some(k) => execute(state, kill, k, req).await,
        },
        _ => error(StatusCode::NOT_FOUND, "no_such_route"),
    })
}

fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
}

async fn lookup(state: &Arc<State>, kind: SimKind, key: &str) -> Reply {
    let state = state.clone();
    let key = key.to_string();
    let found = tokio::task::spawn_blocking(move || {
        let mut p = state.provider(kind).lock().map_err(|_| ())?;
        // The in-process provider answers from its tables at once.
        p.lookup(&key, u64::MAX).map_err(|_| ())
    })
    .await;
    match found {
        Ok(Ok(Lookup::Found(r))) => reply(StatusCode::OK, &receipt_json(&r)),
        Ok(Ok(Lookup::NotFound)) => error(StatusCode::NOT_FOUND, "no_such_call"),
        _ => error(StatusCode::SERVICE_UNAVAILABLE, "lookup_failed"),
    }
}

/// Commits under the provider's lock, off the async threads.
async fn commit(
    state: &Arc<State>,
    kind: SimKind,
    key: &str,
    req: &DownstreamRequest,
    delay_ms: u64,
    drift: bool,
) -> Option<Result<Receipt, String>> {
    let (state, key, req) = (state.clone(), key.to_string(), req.clone());
    tokio::task::spawn_blocking(move || {
        let mut p = state.provider(kind).lock().ok()?;
        p.commit(&key, &req, delay_ms, drift).ok()
    })
    .await
    .ok()
    .flatten()
}

async fn execute(state: Arc<State>, kill: Arc<tokio::sync::Notify>, kind: SimKind, req: Request<Incoming>) -> Reply {
    if header(&req, "content-type").is_some_and(|c| !c.starts_with("application/json")) {
        return error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "content_type");
    }
    let fault = match header(&req, super::http::FAULT_HEADER) {
        Some(spec) => match Fault::parse(spec) {
            Ok(f) => f,
            Err(_) => return error(StatusCode::BAD_REQUEST, "bad_fault"),
        },
        None => state.faults.lock().map_or(Fault::Ok, |mut f| f.next_fault()),
    };
    let key = header(&req, "idempotency-key").map(str::to_string);
    let declared = header(&req, super::http::REQUEST_DIGEST_HEADER).map(str::to_string);
    let intent = header(&req, super::http::INTENT_HEADER).map(str::to_string);
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return error(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
    };
    let Ok(arguments) = parse_strict(&body, MAX_BODY_BYTES, 64) else {
        return error(StatusCode::BAD_REQUEST, "body_not_json");
    };
    // The digest the caller declares (toolgate's request digest), or the body's own.
    let digest = declared.unwrap_or_else(|| sha256_hex(canonical_string(&arguments).as_bytes()));
    let key = match (key, kind.honours_keys()) {
        (Some(k), _) if !k.is_empty() && k.len() <= 255 => k,
        (None, true) => return error(StatusCode::BAD_REQUEST, "idempotency_key_missing"),
        // Notifications ignores keys: every call is its own message.
        _ => Ids::unseeded_id("nokey"),
    };
    let dreq = DownstreamRequest {
        intent: intent.unwrap_or_else(|| digest.clone()),
        tool: kind.as_str().to_string(),
        arguments,
        request_sha256: digest,
        timeout_ms: 0,
    };
    // The work goes on when the caller hangs up (as a real provider's would):
    // hyper drops this handler on a disconnect, not the spawned task.
    tokio::spawn(run(state, kill, kind, key, dreq, fault))
        .await
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "internal"))
}

/// What a fault does to one call, after the request was read.
async fn run(
    state: Arc<State>,
    kill: Arc<tokio::sync::Notify>,
    kind: SimKind,
    key: String,
    dreq: DownstreamRequest,
    fault: Fault,
) -> Reply {
    let committed = |r: Option<Result<Receipt, String>>| match r {
        Some(Ok(r)) => reply(StatusCode::OK, &receipt_json(&r)),
        Some(Err(_)) => error(StatusCode::UNPROCESSABLE_ENTITY, "idempotency_key_reused"),
        None => error(StatusCode::INTERNAL_SERVER_ERROR, "storage"),
    };
    let drop_connection = || async {
        kill.notify_one();
        std::future::pending::<()>().await;
        error(StatusCode::INTERNAL_SERVER_ERROR, "unreachable")
    };
    match fault {
        Fault::Ok => committed(commit(&state, kind, &key, &dreq, 0, false).await),
        Fault::Latency(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            committed(commit(&state, kind, &key, &dreq, 0, false).await)
        }
        Fault::Reject(code) => error(StatusCode::BAD_REQUEST, &code),
        Fault::RateLimit(ra) => with_retry_after(error(StatusCode::TOO_MANY_REQUESTS, "rate_limited"), ra),
        Fault::Unavailable(Some(ra)) => with_retry_after(error(StatusCode::SERVICE_UNAVAILABLE, "unavailable"), ra),
        Fault::Unavailable(None) | Fault::ConnectTimeout => error(StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        Fault::ServerError => error(StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        Fault::InProgress(ms) => with_retry_after(error(StatusCode::CONFLICT, "in_progress"), RetryAfter::seconds(ms)),
        Fault::SlowBody(ms) => match commit(&state, kind, &key, &dreq, 0, false).await {
            Some(Ok(rc)) => {
                let body = Bytes::from(canonical_string(&receipt_json(&rc)));
                json_reply(StatusCode::OK, Paced::trickle(body, ms).boxed_unsync())
            }
            other => committed(other),
        },
        Fault::HugeBody(size) => match commit(&state, kind, &key, &dreq, 0, false).await {
            Some(Ok(rc)) => {
                let body = Bytes::from(canonical_string(&receipt_json(&rc)));
                json_reply(StatusCode::OK, Paced::padded(&body, size).boxed_unsync())
            }
            other => committed(other),
        },
        Fault::TimeoutBeforeCommit => {
            tokio::time::sleep(HOLD).await;
            drop_connection().await
        }
        Fault::TimeoutAfterCommit => {
            let _ = commit(&state, kind, &key, &dreq, 0, false).await;
            tokio::time::sleep(HOLD).await;
            drop_connection().await
        }
        Fault::DropAfterCommit | Fault::PanicAfterCommit => {
            let _ = commit(&state, kind, &key, &dreq, 0, false).await;
            drop_connection().await
        }
        Fault::ReceiptDelay(ms) => {
            let _ = commit(&state, kind, &key, &dreq, ms, false).await;
            drop_connection().await
        }
        Fault::MismatchAfterCommit => {
            let _ = commit(&state, kind, &key, &dreq, 0, true).await;
            drop_connection().await
        }
        Fault::ServerErrorAfterCommit => {
            let _ = commit(&state, kind, &key, &dreq, 0, false).await;
            error(StatusCode::INTERNAL_SERVER_ERROR, "internal")
        }
        Fault::MalformedResponse => {
            let _ = commit(&state, kind, &key, &dreq, 0, false).await;
            json_reply(StatusCode::OK, Full::new(Bytes::from_static(b"{\"receipt_id\": ")).boxed_unsync())
        }
        Fault::EchoCredential { value, in_result } => match commit(&state, kind, &key, &dreq, 0, false).await {
            Some(Ok(mut rc)) => {
                if in_result {
                    if let Some(obj) = rc.result.as_object_mut() {
                        obj.insert("card_token".into(), Value::String(value.clone()));
                    }
                }
                let mut r = reply(StatusCode::OK, &receipt_json(&rc));
                if let Ok(v) = hyper::header::HeaderValue::from_str(&format!("Bearer {value}")) {
                    r.headers_mut().insert("authorization", v);
                }
                r
            }
            other => committed(other),
        },
        Fault::CrashAfterCommit => {
            let _ = commit(&state, kind, &key, &dreq, 0, false).await;
            // A real crash: no reply, no unwinding.
            std::process::abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_decode() {
        assert_eq!(percent_decode("dk2_ab%2F..%2Fx%20y"), "dk2_ab/../x y");
        assert_eq!(percent_decode("plain"), "plain");
        assert_eq!(percent_decode("bad%zz%2"), "bad%zz%2");
        assert_eq!(percent_decode("é%C3%A9"), "éé");
    }
}
