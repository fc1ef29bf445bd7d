//! The JSON-RPC layer under rmcp: every stdio line and every `/mcp` POST body
//! is screened here before rmcp sees it, so that every request that carries
//! an id gets an answer by that id.
//!
//! Why not rmcp's own stdio transport (`rmcp::transport::stdio`): it drops a
//! line that is not JSON without a word (its issue 938: other SDKs do the
//! same, to avoid error storms), and a lone UTF-16 surrogate escape
//! (`"\ud800"`, which Python's and JavaScript's encoders emit from a model's
//! broken output) is such a line to serde; it answers a message of the wrong
//! shape with an Invalid Request that carries no id; it turns `arguments`
//! sent as an array into a custom request and so answers -32601; and an
//! `initialize` it cannot read ends the session (the process exits). A
//! harness then waits for its own timeout, or loses its server. The
//! screening below answers each of those by the request's id (-32700 with id
//! null when no id can be read), and only well-formed messages reach rmcp.
//! An error storm cannot start: nothing is ever answered that had no id,
//! except a line unreadable as JSON, answered once.

use std::io::{BufRead, Write};

use rmcp::model::{CallToolRequestParams, ClientJsonRpcMessage, InitializeRequestParams, PaginatedRequestParams};
use rmcp::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::Transport;
use rmcp::RoleServer;
use serde_json::{json, Value};

/// What to do with one incoming message.
#[derive(Debug)]
pub(crate) enum Screened {
    /// Well-formed: rmcp handles it.
    Pass(Box<ClientJsonRpcMessage>),
    /// Answer this JSON-RPC error at once; rmcp never sees the message.
    Answer(Value),
    /// Nothing to do and nobody to answer (an empty line, a malformed notification).
    Skip,
}

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const INVALID_PARAMS: i64 = -32602;

fn error(id: &Value, code: i64, message: &str, data: Option<Value>) -> Value {
    let mut e = json!({"code": code, "message": message});
    if let Some(d) = data {
        e["data"] = d;
    }
    json!({"jsonrpc": "2.0", "id": id, "error": e})
}

/// The request id of a message, when it has one a response can carry.
fn id_of(v: &Value) -> Option<Value> {
    match v.get("id") {
        Some(id @ (Value::String(_) | Value::Number(_))) => Some(id.clone()),
        _ => None,
    }
}

/// `text` with each lone UTF-16 surrogate escape (`\ud800` not followed by a
/// low surrogate, or a lone `\udc00`) replaced by U+FFFD, and whether there
/// was one. Escaped backslashes (`\\u...`) are left alone.
fn without_lone_surrogates(text: &str) -> (String, bool) {
    let b = text.as_bytes();
    let hex = |at: usize| -> Option<u16> {
        let s = text.get(at..at + 4)?;
        u16::from_str_radix(s, 16).ok()
    };
    let escape_at = |at: usize| -> Option<u16> {
        if b.get(at) == Some(&b'\\') && b.get(at + 1) == Some(&b'u') {
            hex(at + 2)
        } else {
            None
        }
    };
    let mut out = String::with_capacity(text.len());
    let mut found = false;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            if let Some(u) = escape_at(i) {
                let pair =
                    (0xD800..0xDC00).contains(&u) && escape_at(i + 6).is_some_and(|l| (0xDC00..0xE000).contains(&l));
                if pair {
                    out.push_str(&text[i..i + 12]);
                    i += 12;
                } else if (0xD800..0xE000).contains(&u) {
                    out.push_str("\\ufffd");
                    found = true;
                    i += 6;
                } else {
                    out.push_str(&text[i..i + 6]);
                    i += 6;
                }
                continue;
            }
            // Any other escape: copy it whole, so `\\` never starts a new one.
            let end = (i + 2).min(b.len());
            out.push_str(&String::from_utf8_lossy(&b[i..end]));
            i = end;
            continue;
        }
        let ch_len = text[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&text[i..i + ch_len]);
        i += ch_len;
    }
    (out, found)
}

/// Screens one incoming message (a stdio line without its newline, or an
/// HTTP body). `initialized`: whether an `initialize` went through already
/// (stdio: rmcp ends a session whose first message is anything else).
pub(crate) fn screen(raw: &[u8], initialized: bool) -> Screened {
    let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
    let raw = raw.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(raw);
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Screened::Skip;
    }
    let v = match serde_json::from_slice::<Value>(raw) {
        Ok(v) => v,
        Err(e) => {
            // Not JSON to serde. If it is only because a string is not valid
            // Unicode (bytes that are not UTF-8, a lone surrogate escape), the
            // id can still be read: refuse the arguments by it.
            let text = String::from_utf8_lossy(raw);
            let (mended, lone) = without_lone_surrogates(&text);
            let not_utf8 = std::str::from_utf8(raw).is_err();
            return match serde_json::from_str::<Value>(&mended) {
                Ok(v) if lone || not_utf8 => match id_of(&v) {
                    Some(id) if v.get("method").is_some_and(Value::is_string) => Screened::Answer(error(
                        &id,
                        INVALID_PARAMS,
                        "Invalid params: a string is not valid Unicode (a lone UTF-16 surrogate or bytes that are not UTF-8)",
                        Some(json!({"code": "INVALID_ARGUMENTS"})),
                    )),
                    _ => Screened::Skip,
                },
                _ => Screened::Answer(error(&Value::Null, PARSE_ERROR, &format!("Parse error: {e}"), None)),
            };
        }
    };
    let Value::Object(m) = &v else {
        // A batch (MCP has none since 2025-06-18) or a bare value.
        return Screened::Answer(error(&Value::Null, INVALID_REQUEST, "Invalid Request: not a JSON-RPC object", None));
    };
    let id = id_of(&v);
    let has_id = m.contains_key("id");
    let invalid = |why: &str| {
        if has_id || m.contains_key("method") {
            Screened::Answer(error(id.as_ref().unwrap_or(&Value::Null), INVALID_REQUEST, why, None))
        } else {
            Screened::Skip
        }
    };
    if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return invalid("Invalid Request: \"jsonrpc\" must be \"2.0\"");
    }
    if has_id && id.is_none() {
        return invalid("Invalid Request: an id must be a string or a number");
    }
    let method = match m.get("method") {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(_) => return invalid("Invalid Request: \"method\" must be a string"),
        None => None,
    };
    if let (Some(id), Some(method)) = (&id, method) {
        if !initialized && method != "initialize" && method != "ping" {
            return Screened::Answer(error(
                id,
                INVALID_REQUEST,
                "Invalid Request: the session is not initialized (send initialize first)",
                None,
            ));
        }
        let params = m.get("params").cloned();
        let why = |r: Result<(), serde_json::Error>| r.err().map(|e| e.to_string());
        let bad = match (method, params) {
            ("initialize" | "tools/call", None) => Some("params are required".to_string()),
            ("initialize", Some(p)) => why(serde_json::from_value::<InitializeRequestParams>(p).map(drop)),
            ("tools/call", Some(p)) => why(serde_json::from_value::<CallToolRequestParams>(p).map(drop)),
            ("tools/list", Some(p)) => why(serde_json::from_value::<Option<PaginatedRequestParams>>(p).map(drop)),
            _ => None,
        };
        if let Some(e) = bad {
            return Screened::Answer(error(id, INVALID_PARAMS, &format!("Invalid params for {method}: {e}"), None));
        }
    }
    match serde_json::from_value::<ClientJsonRpcMessage>(v.clone()) {
        Ok(msg) => Screened::Pass(Box::new(msg)),
        Err(e) => match (&id, method) {
            (Some(id), Some(_)) => Screened::Answer(error(id, INVALID_PARAMS, &format!("Invalid params: {e}"), None)),
            (Some(id), None) => Screened::Answer(error(id, INVALID_REQUEST, &format!("Invalid Request: {e}"), None)),
            // A notification rmcp cannot read: nobody to answer.
            _ => Screened::Skip,
        },
    }
}

/// MCP over standard input and output, with [`screen`] in front of rmcp.
/// Standard input is read on a plain thread of its own (a read of Tokio's
/// stdin cannot be cancelled, and would hold the runtime's shutdown until the
/// client writes or closes); `stop` ends the session as end of input does,
/// and the end of input cancels `stop`.
pub(crate) struct Stdio {
    incoming: tokio::sync::mpsc::Receiver<ClientJsonRpcMessage>,
    outgoing: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    stop: tokio_util::sync::CancellationToken,
}

/// The stdout writer's end: [`Flush::finish`] writes every answer queued
/// before it, then ends the writer. A runtime shut down without it drops the
/// writer task with answers still queued (the last call's answer, lost when
/// the session ended right after it was queued).
pub(crate) struct Flush {
    queue: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    writer: tokio::task::JoinHandle<()>,
}

impl Flush {
    /// Waits (at most `limit`) until everything queued so far is written.
    pub(crate) async fn finish(self, limit: std::time::Duration) {
        // An empty line is the writer's end mark (no answer is empty).
        if self.queue.send(Vec::new()).is_ok() {
            let _ = tokio::time::timeout(limit, self.writer).await;
        }
    }
}

impl Stdio {
    /// Starts the reader thread and the writer task (on the current runtime).
    pub(crate) fn start(stop: tokio_util::sync::CancellationToken) -> std::io::Result<(Self, Flush)> {
        let (to_rmcp, incoming) = tokio::sync::mpsc::channel::<ClientJsonRpcMessage>(64);
        let (outgoing, mut lines) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
        let answers = outgoing.clone();
        std::thread::Builder::new().name("toolgate-mcp-stdin".into()).spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut line = Vec::new();
            let mut initialized = false;
            loop {
                line.clear();
                match stdin.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
                let body = line.strip_suffix(b"\n").unwrap_or(&line);
                match screen(body, initialized) {
                    Screened::Pass(msg) => {
                        if let ClientJsonRpcMessage::Request(r) = msg.as_ref() {
                            initialized |= matches!(r.request, rmcp::model::ClientRequest::InitializeRequest(_));
                        }
                        if to_rmcp.blocking_send(*msg).is_err() {
                            return;
                        }
                    }
                    Screened::Answer(v) => {
                        tracing::info!(answer = %v, "MCP: a malformed request answered by the screen");
                        if answers.send(v.to_string().into_bytes()).is_err() {
                            return;
                        }
                    }
                    Screened::Skip => {}
                }
            }
        })?;
        let flush = outgoing.clone();
        let writer = tokio::spawn(async move {
            // One writer, so that answers from the screen and rmcp's never interleave.
            while let Some(mut l) = lines.recv().await {
                if l.is_empty() {
                    return;
                }
                l.push(b'\n');
                let done = tokio::task::spawn_blocking(move || {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&l).and_then(|()| out.flush())
                })
                .await;
                if !matches!(done, Ok(Ok(()))) {
                    return;
                }
            }
        });
        Ok((Self { incoming, outgoing, stop }, Flush { queue: flush, writer }))
    }
}

impl Transport<RoleServer> for Stdio {
    type Error = std::io::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleServer>,
    ) -> impl std::future::Future<Output = Result<(), Self::Error>> + Send + 'static {
        let sent = serde_json::to_vec(&item)
            .map_err(std::io::Error::other)
            .and_then(|b| self.outgoing.send(b).map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe)));
        std::future::ready(sent)
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleServer>> {
        let m = tokio::select! {
            m = self.incoming.recv() => m,
            () = self.stop.cancelled() => None,
        };
        if m.is_none() {
            // The end of input is a shutdown too (the calls in flight get their grace).
            self.stop.cancel();
        }
        m
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        self.incoming.close();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (kind, code, id) of what the screen does with `line`.
    #[allow(clippy::needless_pass_by_value)] // the table reads better with values
    fn check(line: &str, initialized: bool, expect: (&str, Option<i64>, Value)) {
        let got = match screen(line.as_bytes(), initialized) {
            Screened::Pass(_) => ("pass", None, Value::Null),
            Screened::Skip => ("skip", None, Value::Null),
            Screened::Answer(v) => ("answer", v["error"]["code"].as_i64(), v["id"].clone()),
        };
        assert_eq!((got.0, got.1, &got.2), (expect.0, expect.1, &expect.2), "{line}");
    }

    #[test]
    fn every_request_with_an_id_is_answered_by_it() {
        let call = |id: &str, args: &str| {
            format!(r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"t","arguments":{args}}}}}"#)
        };
        check(&call("1", "{}"), true, ("pass", None, Value::Null));
        check("{not json", true, ("answer", Some(-32700), Value::Null));
        check("", true, ("skip", None, Value::Null));
        check(&call("7", r#"{"a":"\ud800"}"#), true, ("answer", Some(-32602), json!(7)));
        check(&call(r#""x""#, r#"{"a":"\udc00 and \\ud800"}"#), true, ("answer", Some(-32602), json!("x")));
        check(&call("8", r#"{"a":"\ud83d\ude00"}"#), true, ("pass", None, Value::Null));
        check(&call("9", r#"["a"]"#), true, ("answer", Some(-32602), json!(9)));
        check(r#"{"jsonrpc":"1.0","id":3,"method":"tools/list"}"#, true, ("answer", Some(-32600), json!(3)));
        check(
            r#"{"jsonrpc":"2.0","id":4,"method":"initialize","params":{"capabilities":{},"clientInfo":{"name":"a","version":"1"}}}"#,
            false,
            ("answer", Some(-32602), json!(4)),
        );
        check(r#"{"jsonrpc":"2.0","id":5,"method":"tools/list"}"#, false, ("answer", Some(-32600), json!(5)));
        check(
            r#"{"jsonrpc":"2.0","method":"notifications/cancelled","params":{"requestId":"\ud800"}}"#,
            true,
            ("skip", None, Value::Null),
        );
        check("[1,2]", true, ("answer", Some(-32600), Value::Null));
    }
}
