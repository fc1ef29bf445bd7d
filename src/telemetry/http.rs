//! A tiny HTTP/1.1 server for `GET /metrics` (`toolgate metrics --listen`).
//!
//! Why no crate: a scrape endpoint needs one route, one response per
//! connection (`Connection: close`) and no TLS; `std::net` does that in a page,
//! adds no dependency to a ledger binary, and keeps every limit visible here.
//! Connections are served concurrently, one thread each, at most
//! [`MAX_CONNECTIONS`] at a time (more are answered 503 at once); a client has
//! [`HEAD_DEADLINE`] for its whole request head (not per read), so one client
//! trickling a byte every few seconds, or many idle ones, cannot stall a
//! scrape. Only computing the metrics is serialized (one engine).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a client may take to send its whole request head.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// How long writing the response may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 32;
/// The largest request head accepted.
const MAX_HEAD: u64 = 16 * 1024;

/// What a handler answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Self { status, content_type: "text/plain; charset=utf-8", body: body.to_string() }
    }
}

/// Stops a running [`serve`] loop from another thread.
#[derive(Debug, Clone)]
pub struct StopHandle {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl StopHandle {
    /// Asks the loop to stop after the request in progress, and wakes it.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        // accept() blocks: one throw-away connection wakes it up to see the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

/// A stop handle for a listener about to be served.
pub fn stop_handle(listener: &TcpListener) -> std::io::Result<(StopHandle, Arc<AtomicBool>)> {
    let stop = Arc::new(AtomicBool::new(false));
    Ok((StopHandle { stop: stop.clone(), addr: listener.local_addr()? }, stop))
}

/// Serves `GET /metrics` with `metrics()` until `stop` is set (forever when it
/// never is). Each connection gets one response and is closed. A handler error
/// is a 500 with its message (which, like every message here, names no path).
pub fn serve<E: std::fmt::Display, F: FnMut() -> Result<Response, E> + Send>(
    listener: &TcpListener,
    stop: &AtomicBool,
    metrics: F,
) -> std::io::Result<()> {
    let metrics = Mutex::new(metrics);
    let active = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for conn in listener.incoming() {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let Ok(stream) = conn else { continue };
            if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                active.fetch_sub(1, Ordering::SeqCst);
                let _ = busy(&stream);
                continue;
            }
            let (metrics, active) = (&metrics, &active);
            scope.spawn(move || {
                // A client that misbehaves only loses its own connection.
                let _ = handle(&stream, metrics);
                active.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Ok(())
}

/// 503 for a connection over the limit (written with a short timeout).
fn busy(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_write_timeout(Some(Duration::from_millis(200)))?;
    let mut out = stream;
    out.write_all(
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n",
    )
}

/// A reader whose every read waits only for what is left of one deadline.
struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "request head deadline passed"));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

fn handle<E: std::fmt::Display, F: FnMut() -> Result<Response, E>>(
    stream: &TcpStream,
    metrics: &Mutex<F>,
) -> std::io::Result<()> {
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let head = Deadline { stream, until: Instant::now() + HEAD_DEADLINE };
    let mut reader = BufReader::new(head.take(MAX_HEAD));
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    // Drain the headers (we need none of them).
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line)?;
        if n == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let response = match (method, path) {
        ("GET" | "HEAD", "/metrics") => match metrics.lock().map_err(|_| std::io::ErrorKind::Other)?() {
            Ok(r) => r,
            Err(e) => Response::text(500, &format!("metrics unavailable: {e}\n")),
        },
        ("GET" | "HEAD", "/") => Response::text(200, "toolgate metrics: GET /metrics\n"),
        ("GET" | "HEAD", _) => Response::text(404, "not found\n"),
        _ => Response::text(405, "method not allowed\n"),
    };
    let reason = match response.status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    };
    let mut out = stream;
    write!(
        out,
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n{}\r\n",
        response.status,
        response.content_type,
        response.body.len(),
        if response.status == 405 { "Allow: GET, HEAD\r\n" } else { "" },
    )?;
    if method != "HEAD" {
        out.write_all(response.body.as_bytes())?;
    }
    out.flush()
}

/// A minimal client for tests and smoke checks: `GET path` on `addr`, returning
/// the status code and the body.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((raw.as_str(), ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, body.to_string()))
}
